"""Supervised fine-tuning data: prompt + target response, loss only on the response.

A row is ``{"prompt": ..., "response": "..."}`` (keys from the dataset config), or chat
messages whose last turn is the assistant's answer (``{"prompt": [..., {"role":
"assistant", "content": "..."}]}``). The prompt goes through the same formatting as RL
prompts (chat template, tools); the response is tokenized without special tokens and ends
with the tokenizer's EOS, so the model learns to stop. The result is a
:class:`~rl_core.types.Sample` with ``tokens = prompt + response`` and ``response_length``
(loss mask 1 on every response token), which the prompt source mixes, shuffles and
resumes exactly like RL prompts.
"""

from typing import Any

from rl_core.types import Sample
from rl_launcher.config import DataConfig, DatasetConfig
from rl_launcher.data.prompts import MalformedRow, sample_from_row
from rl_launcher.data.reader import iter_rows, parse_spec
from rl_launcher.data.source import (
    DatasetStats,
    PromptDataset,
    PromptSource,
    _report_malformed,
)


def split_response(row: Any, spec: DatasetConfig) -> tuple[dict, str]:
    """``(row with the prompt only, response text)``; raises :class:`MalformedRow`."""
    if not isinstance(row, dict):
        raise MalformedRow(f"expected a JSON object, got {type(row).__name__}")
    prompt = row.get(spec.prompt_key)
    response = row.get(spec.response_key) if spec.response_key else None
    if response is None and isinstance(prompt, list) and prompt:
        last = prompt[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            prompt, response = prompt[:-1], last.get("content")
    if not isinstance(response, str) or not response:
        raise MalformedRow(
            f"no response: give a non-empty {spec.response_key!r} text or end the "
            f"{spec.prompt_key!r} chat messages with an assistant turn"
        )
    return {**row, spec.prompt_key: prompt}, response


def sft_sample_from_row(
    row: Any, spec: DatasetConfig, *, tokenizer: Any, apply_chat_template: bool = True
) -> Sample:
    """The training Sample of one SFT row (prompt ids, then response ids and EOS)."""
    prompt_row, response = split_response(row, spec)
    sample = sample_from_row(
        prompt_row, spec, tokenizer=tokenizer, apply_chat_template=apply_chat_template
    )
    ids = response_ids(response, tokenizer)
    sample.tokens = [*sample.tokens, *ids]
    sample.response, sample.response_length = response, len(ids)
    return sample


def response_ids(response: str, tokenizer: Any) -> list[int]:
    """A target response's ids: its text without special tokens, then EOS (learn to stop)."""
    ids = list(tokenizer.encode(response, add_special_tokens=False))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def load_sft_dataset(
    spec: DatasetConfig,
    data: DataConfig,
    *,
    tokenizer: Any,
    max_response_tokens: int,
    to_sample=sft_sample_from_row,
) -> PromptDataset:
    """Read, check, tokenize and length-filter one SFT dataset (malformed rows are
    reported as ``file:line`` and skipped or raised per ``data.on_malformed``);
    ``to_sample`` makes a row's Sample (a DPO pair's: ``data.preference``)."""
    name = spec.name or parse_spec(spec.path)[0].stem
    stats, samples = DatasetStats(), []
    for row in iter_rows(spec.path, batch_rows=data.read_batch_rows):
        stats.rows += 1
        try:
            if row.error is not None:
                raise MalformedRow(row.error)
            sample = to_sample(
                row.value, spec, tokenizer=tokenizer, apply_chat_template=data.apply_chat_template
            )
        except MalformedRow as error:
            _report_malformed(stats, f"{row.where}: {error}", data.on_malformed)
            continue
        too_long = sample.prompt_length > data.max_prompt_tokens
        if too_long or longest_response(sample) > max_response_tokens:
            stats.too_long += 1
            continue
        sample.metadata.update(dataset=name, row=row.index)
        samples.append(sample)
    stats.kept = len(samples)
    return PromptDataset(name=name, prompts=samples, stats=stats)


def longest_response(sample: Sample) -> int:
    """Response tokens of the sample's longest response (a DPO pair has two)."""
    return max(sample.response_length, len(sample.metadata.get("rejected_ids", ())))


def build_sft_source(config, *, tokenizer: Any, to_sample=sft_sample_from_row) -> PromptSource:
    """The example stream of an SFT run (of a DPO run with ``to_sample`` =
    :func:`rl_launcher.data.preference.pair_sample_from_row`): ``data.train`` mixed,
    shuffled and resumable."""
    datasets = [
        load_sft_dataset(
            spec,
            config.data,
            tokenizer=tokenizer,
            max_response_tokens=config.rollout.max_response_tokens,
            to_sample=to_sample,
        )
        for spec in config.data.train
    ]
    weights = [spec.weight for spec in config.data.train]
    return PromptSource(datasets, weights, seed=config.seed, shuffle=config.data.shuffle)
