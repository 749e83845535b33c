"""Packed forward passes and the micro-batch plan shared by every rank.

Shapes: N tokens of a (micro-)batch packed end to end with cu_seqlens ``[B + 1]``;
logits ``[N, V]``; log-probs / entropy / values ``[N]`` float32 with the
"prediction at position" alignment of rl_core.batch (no shift needed).
"""

import itertools
from dataclasses import replace

import torch
from torch import nn

from rl_core.batch import PER_TOKEN_FIELDS, HostBounds, TrainBatch, next_token_targets, to_device
from rl_core.logprobs import log_probs_and_entropy
from rl_core.packing import first_fit_pack, position_ids_from_cu_seqlens
from rl_fsdp.attention import PackedLayout


def packed_forward(
    model: nn.Module, tokens: torch.Tensor, cu_seqlens: torch.Tensor, impl: str, pad_to: int = 0
):
    """Run ``model`` on one packed row; returns its output's ``logits[0]``: ``[N, ...]``.
    ``cu_seqlens``: pass the host copy (``batch.host_cu_seqlens``); device boundaries are
    read back once. ``pad_to``: the micro-batch budget (FlexAttention's padded shape, see
    PackedLayout)."""
    device = tokens.device
    layout = PackedLayout.from_cu_seqlens(cu_seqlens, impl, device, pad_to=pad_to)
    host_cu = torch.tensor((0, *itertools.accumulate(layout.lengths)), dtype=torch.int64)
    position_ids = to_device(position_ids_from_cu_seqlens(host_cu), device)
    out = model(
        input_ids=tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        attention_mask=_no_mask(device),
        use_cache=False,
        rl_layout=layout,
    )
    return out.logits[0]


def _no_mask(device) -> torch.Tensor:
    """An empty 4D mask. Hugging Face takes a 4D mask as already built and skips its mask
    code, whose packed-sequence check reads the position ids back from the device (one
    sync per pass); the packed attention ignores it (boundaries come from ``rl_layout``)."""
    return torch.empty((1, 1, 0, 0), device=device)


def packed_log_probs(
    model: nn.Module,
    batch: TrainBatch,
    *,
    impl: str,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    pad_to: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each next token ``[N]`` (0 at sequence ends) and optionally entropy ``[N]``,
    through rl_core's chunked log-softmax (no float32 ``[N, V]`` softmax kept)."""
    logits = packed_forward(model, batch.tokens, batch.host_cu_seqlens, impl, pad_to)
    targets = next_token_targets(batch.tokens, batch.cu_seqlens.to(batch.tokens.device))
    return log_probs_and_entropy(
        logits,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )


def packed_values(
    model: nn.Module, batch: TrainBatch, *, impl: str, pad_to: int = 0
) -> torch.Tensor:
    """A value-head model's per-position values ``[N]`` float32."""
    logits = packed_forward(model, batch.tokens, batch.host_cu_seqlens, impl, pad_to)
    return logits[:, 0].float()


def plan_micro_batches(batch: TrainBatch, max_tokens: int, num_micro_batches: int | None = None):
    """Sequence indices of each micro-batch (first-fit by token budget), padded with empty
    lists up to ``num_micro_batches`` so every rank runs the same number of passes."""
    lengths = batch.seq_lengths()
    if lengths and max(lengths) > max_tokens:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens exceeds the micro-batch budget {max_tokens}; "
            "raise max_tokens_per_micro_batch / log_prob_max_tokens or truncate the sequence"
        )
    plan = first_fit_pack(lengths, max_tokens=max_tokens)
    if num_micro_batches is not None:
        if num_micro_batches < len(plan):
            raise ValueError(f"{len(plan)} micro-batches needed, only {num_micro_batches} allowed")
        plan += [[] for _ in range(num_micro_batches - len(plan))]
    return plan


def micro_batch(batch: TrainBatch, seq_indices: list[int]) -> TrainBatch:
    """The sub-batch of ``seq_indices``; an empty list gives a one-token dummy whose
    loss mask is 0 (it keeps the collectives of ranks with less data in step)."""
    if seq_indices:
        return batch.select(seq_indices)
    zeros = torch.zeros(1, device=batch.tokens.device)
    dummy = {name: zeros.clone() for name in PER_TOKEN_FIELDS if getattr(batch, name) is not None}
    bounds = torch.tensor([0, 1], dtype=torch.int32)
    cu_seqlens = to_device(bounds, batch.cu_seqlens.device)
    return replace(
        batch,
        tokens=torch.zeros(1, dtype=torch.long, device=batch.tokens.device),
        cu_seqlens=cu_seqlens,
        host_bounds=HostBounds(bounds, cu_seqlens),
        routed_experts=None,  # the dummy token routes on its own
        **dummy,
    )


def token_indices(batch: TrainBatch, seq_indices: list[int]) -> torch.Tensor:
    """Positions in ``batch``'s packed tokens of the sequences ``seq_indices``: ``[n]``
    on the host."""
    bounds = batch.host_cu_seqlens.tolist()
    parts = [torch.arange(bounds[i], bounds[i + 1]) for i in seq_indices]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
