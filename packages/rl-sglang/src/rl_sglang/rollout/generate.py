"""Turning one :class:`~rl_core.types.Sample` into a response through the engine API.

A generate function has the signature ``async fn(ctx, sample, sampling_params)`` and returns
the sample (or several) with ``tokens``, ``response_length``, ``loss_mask``,
``rollout_log_probs``, ``weight_versions`` and ``status`` filled. :func:`generate_sample`
is the default; others are picked by dotted path with :func:`load_function`.
Tokens go in and come out as ids (``input_ids`` / ``output_ids``): the text is never
re-tokenised, so training sees exactly the tokens the engine sampled. A sample whose
``metadata["sampling_seed"]`` is set asks for it (SGLang's ``sampling_seed``): the embedded
engine then draws its tokens with a generator of its own, so the response does not depend
on which requests share its batch.
"""

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rl_core.registry import is_dotted, load_dotted
from rl_core.routing import decode_routes
from rl_core.types import Sample, SampleStatus
from rl_sglang.client import EngineClient
from rl_sglang.detokenize import text_decoder
from rl_sglang.protocol import parse_token_logprobs

OFFPOLICY_MODES = ("keep", "mask")
STATUS_OF_FINISH = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass(kw_only=True)
class GenerateContext:
    """What a generate function may use: the client (usually the router), a tokenizer for
    text prompts, and how resumed partial responses are treated."""

    client: EngineClient
    tokenizer: Any = None
    # A resumed response whose earlier part came from older weights: "keep" trains on it
    # (correct it with rl_core.importance using rollout_log_probs), "mask" gives it loss 0.
    offpolicy_tokens: str = "keep"
    # MoE rollout routing replay: (hidden layers, experts per token) of the model; set, every
    # request asks return_routed_experts and the sample keeps them (Sample.routed_experts)
    routed_experts_shape: tuple[int, int] | None = None

    def route_fields(self) -> dict:
        """The /generate fields that ask for routed experts (none when not replaying)."""
        return {} if self.routed_experts_shape is None else {"return_routed_experts": True}

    def prompt_ids(self, sample: Sample) -> list[int]:
        if sample.tokens:
            return list(sample.tokens)
        if self.tokenizer is None:
            raise ValueError("sample has no tokens and the GenerateContext has no tokenizer")
        if isinstance(sample.prompt, list):  # chat messages
            return list(
                self.tokenizer.apply_chat_template(sample.prompt, add_generation_prompt=True)
            )
        return list(self.tokenizer.encode(sample.prompt))


GenerateFn = Callable[[GenerateContext, Sample, dict], Awaitable["Sample | list[Sample]"]]


def load_function(path: str) -> Callable:
    """``"package.module:name"`` (rl_core's one loader, as every dotted option of a run
    uses) or ``"package.module.name"`` -> the object."""
    if is_dotted(path):
        return load_dotted(path)
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'my_pkg.rollouts:generate'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load {path!r}: {error}") from error


def append_response(
    sample: Sample,
    output: dict,
    *,
    trainable: bool = True,
    routed_experts_shape: tuple[int, int] | None = None,
) -> None:
    """Append one /generate output (ids, log-probs, weight version) to ``sample``; with
    ``routed_experts_shape`` (layers, top_k) its ``meta_info["routed_experts"]`` become the
    sample's routes (they cover the whole sequence the request ran)."""
    meta = output["meta_info"]
    logprobs, ids = parse_token_logprobs(meta.get("output_token_logprobs", []))
    if ids and ids != list(output["output_ids"]):
        raise ValueError("output_token_logprobs do not match output_ids; request return_logprob")
    ids = list(output["output_ids"])
    sample.tokens.extend(ids)
    sample.response_length += len(ids)
    sample.loss_mask = sample.effective_loss_mask()[: sample.response_length - len(ids)]
    sample.loss_mask.extend([int(trainable)] * len(ids))
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + (logprobs or [0.0] * len(ids))
    version = str(meta.get("weight_version", ""))
    if ids and (not sample.weight_versions or sample.weight_versions[-1] != version):
        sample.weight_versions.append(version)
    sample.status = STATUS_OF_FINISH[meta["finish_reason"]["type"]]
    sample.metadata["finish_reason"] = meta["finish_reason"]
    if routed_experts_shape is not None and ids and "routed_experts" not in meta:
        raise ValueError(
            "the engine answered without meta_info routed_experts: start it with "
            "--enable-return-routed-experts, and generate behind sglang-router with "
            "rl_sglang.router_client.RouterClient (the router drops return_routed_experts "
            "from the requests it forwards)"
        )
    if routed_experts_shape is not None and "routed_experts" in meta:
        num_layers, top_k = routed_experts_shape
        sample.routed_experts = decode_routes(
            meta["routed_experts"], num_layers=num_layers, top_k=top_k
        )


def seeded(sampling_params: dict, sample: Sample) -> dict:
    """``sampling_params`` with the sample's ``metadata["sampling_seed"]``, when it has one."""
    seed = sample.metadata.get("sampling_seed")
    return sampling_params if seed is None else {**sampling_params, "sampling_seed": int(seed)}


def remaining_budget(sample: Sample, sampling_params: dict) -> dict:
    """Sampling params with ``max_new_tokens`` reduced by the response already there."""
    budget = int(sampling_params.get("max_new_tokens", 128)) - sample.response_length
    return {**sampling_params, "max_new_tokens": max(budget, 0)}


async def generate_sample(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    """Generate (or resume) the response of ``sample``; statuses follow the finish reason."""
    old_length, old_versions = sample.response_length, list(sample.weight_versions)
    if not sample.tokens:
        sample.tokens = ctx.prompt_ids(sample)
    output = await ctx.client.generate(
        input_ids=sample.tokens,
        sampling_params=remaining_budget(sample, seeded(sampling_params, sample)),
        return_logprob=True,
        rid=sample.metadata.get("rid"),
        **ctx.route_fields(),
    )
    append_response(sample, output, routed_experts_shape=ctx.routed_experts_shape)
    if ctx.tokenizer is not None:
        sample.response = text_decoder(ctx.tokenizer)(sample.tokens[sample.prompt_length :])
    if old_length:
        sample.metadata["resumed"] = sample.metadata.get("resumed", 0) + 1
        stale = old_versions and old_versions[-1] != sample.weight_versions[-1]
        if stale and ctx.offpolicy_tokens == "mask":
            sample.loss_mask[:old_length] = [0] * old_length
    return sample


def fresh_group(group: list[Sample]) -> bool:
    """True when every sample of ``group`` is a fresh copy of one prompt (nothing generated
    yet), so one ``n = len(group)`` request can generate them all."""
    first = group[0]
    return len(group) > 1 and all(
        s.status is SampleStatus.PENDING
        and not s.response_length
        and s.tokens == first.tokens
        and s.prompt == first.prompt
        for s in group
    )


async def generate_group(
    ctx: GenerateContext, group: list[Sample], sampling_params: dict, *, rid: str | None = None
) -> list[Sample]:
    """Generate a :func:`fresh_group` with one /generate request of ``n = len(group)``: the
    engine admits its rows together; output ``i`` (rid ``<rid>-i``) goes to ``group[i]``.
    A seeded group asks for ``group[0]``'s seed: the engine seeds row ``i`` with it plus
    ``i``, which is ``group[i]``'s own seed (:func:`rl_sglang.rollout.default.make_groups`),
    so a sample gets the same tokens alone or in its group's request."""
    prompt_ids = ctx.prompt_ids(group[0])
    outputs = await ctx.client.generate(
        input_ids=prompt_ids,
        sampling_params={**seeded(sampling_params, group[0]), "n": len(group)},
        return_logprob=True,
        rid=rid,
        **ctx.route_fields(),
    )
    if not isinstance(outputs, list) or len(outputs) != len(group):
        raise ValueError(f"asked for n={len(group)} samples, the engine returned {outputs!r:.200}")
    decode = None if ctx.tokenizer is None else text_decoder(ctx.tokenizer)
    for sample, output in zip(group, outputs, strict=True):
        sample.tokens = list(prompt_ids)
        append_response(sample, output, routed_experts_shape=ctx.routed_experts_shape)
        if decode is not None:
            sample.response = decode(sample.tokens[sample.prompt_length :])
    return group
