"""Preference pairs for ``mode=dpo``: a prompt with a chosen and a rejected response.

A row is ``{"prompt": ..., "chosen": "...", "rejected": "..."}`` (keys from the dataset
config: ``prompt_key``, ``chosen_key``, ``rejected_key``; JSONL or Parquet). The prompt is
formatted like an RL or SFT prompt; each response is tokenized as an SFT response (text,
then EOS). One pair is one :class:`~rl_core.types.Sample` (prompt + chosen, the rejected
response's ids in ``metadata["rejected_ids"]``), so the SFT machinery mixes, shuffles,
length-filters and resumes pairs unchanged; :func:`pair_sequences` turns it into the two
sequences a trainer packs side by side, chosen first.
"""

from typing import Any

from rl_core.types import Sample
from rl_launcher.config import DatasetConfig
from rl_launcher.data.prompts import MalformedRow, sample_from_row
from rl_launcher.data.sft import response_ids

REJECTED_IDS = "rejected_ids"


def pair_sample_from_row(
    row: Any, spec: DatasetConfig, *, tokenizer: Any, apply_chat_template: bool = True
) -> Sample:
    """The pair of one row (see the module docstring); raises :class:`MalformedRow`."""
    if not isinstance(row, dict):
        raise MalformedRow(f"expected a JSON object, got {type(row).__name__}")
    texts = [row.get(spec.chosen_key), row.get(spec.rejected_key)]
    if not all(isinstance(text, str) and text for text in texts):
        raise MalformedRow(
            f"a preference pair needs non-empty texts in {spec.chosen_key!r} and "
            f"{spec.rejected_key!r}"
        )
    if texts[0] == texts[1]:
        raise MalformedRow("chosen and rejected are the same text: nothing to prefer")
    sample = sample_from_row(
        row, spec, tokenizer=tokenizer, apply_chat_template=apply_chat_template
    )
    chosen, rejected = (response_ids(text, tokenizer) for text in texts)
    sample.tokens = [*sample.tokens, *chosen]
    sample.response, sample.response_length = texts[0], len(chosen)
    sample.metadata[REJECTED_IDS] = rejected
    return sample


def pair_sequences(pair: Sample) -> list[Sample]:
    """``[chosen, rejected]``: the two sequences of a pair, sharing its prompt ids."""
    prompt = pair.tokens[: pair.prompt_length]
    rejected_ids = pair.metadata[REJECTED_IDS]
    rejected = Sample(
        tokens=[*prompt, *rejected_ids],
        response_length=len(rejected_ids),
        group_index=pair.group_index,
        index=1,
        metadata=pair.metadata,
    )
    return [pair, rejected]
