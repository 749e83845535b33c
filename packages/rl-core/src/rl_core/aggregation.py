"""Reduce per-token losses to one scalar, with explicit global denominators.

Shapes: ``per_token`` and ``mask`` are padded ``[B, T]`` or packed ``[N]``; packed input
also takes ``cu_seqlens`` ``[B + 1]`` (int). ``mask`` is float or bool, 1 where a token counts.

Why explicit denominators: a micro-batch, a data-parallel shard or a context-parallel
slice only sees part of the batch. Passing the *global* counts (valid tokens, valid
sequences) makes the sum of the parts' losses equal the full-batch loss exactly, so
gradient accumulation and parallel layout never change the result.
"""

import torch

from rl_core._dtype import wide
from rl_core.names import AGGREGATION_MODES as AGGREGATION_MODES  # torch-free, re-exported
from rl_core.names import REDUCER_SHAPE as REDUCER_SHAPE
from rl_core.names import load_reducer


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar (the definitions of verl's ``agg_loss``).

    Modes, with row sum = sum over a sequence's valid tokens of x·m:
        - ``token-mean``: sum(x·m) / num_tokens (default: valid tokens here).
        - ``seq-mean-token-sum``: sum over sequences of (row sum) / num_seqs.
        - ``seq-mean-token-mean``: sum over sequences of (row sum / row count) / num_seqs.
        - ``seq-mean-token-sum-norm``: sum over sequences of (row sum) / norm_length, a
          constant horizon (Dr.GRPO); ``num_seqs`` plays no part. ``norm_length`` defaults
          to T, the padded width, and is required for packed input. Micro-batches and
          ranks must pass the same ``norm_length`` (e.g. the maximum response length) for
          their parts to add up to the full batch's loss.
    ``num_seqs`` defaults to the number of sequences with at least one valid token here;
    fully masked rows contribute nothing and are not counted.

    ``mode`` may also be a dotted path ``pkg.module:function`` to a reducer called with
    every argument but ``mode`` (:data:`REDUCER_SHAPE`).

    Returns:
        Scalar tensor, float32 (float64 for float64 ``per_token``), differentiable in
        ``per_token``.
    """
    reducer = load_reducer(mode)
    if callable(reducer):
        return reducer(
            per_token,
            mask,
            cu_seqlens=cu_seqlens,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_length=norm_length,
        )
    values = wide(per_token)
    weights = mask.to(values.dtype)
    if mode == "token-mean":
        denominator = weights.sum() if num_tokens is None else num_tokens
        return (values * weights).sum() / _at_least_one(denominator, values.dtype)
    if mode == "seq-mean-token-sum-norm":
        return (values * weights).sum() / _horizon(norm_length, per_token, cu_seqlens)

    row_sums, row_counts = row_sums_and_counts(values, weights, cu_seqlens)
    valid_rows = row_counts > 0
    per_seq = row_sums  # seq-mean-token-sum
    if mode == "seq-mean-token-mean":
        per_seq = row_sums / row_counts.clamp(min=1.0)
    denominator = valid_rows.sum() if num_seqs is None else num_seqs
    return (per_seq * valid_rows).sum() / _at_least_one(denominator, values.dtype)


def _horizon(
    norm_length: float | None, per_token: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> float:
    """The constant divisor of ``seq-mean-token-sum-norm``: ``norm_length`` or the padded width."""
    if norm_length is None:
        if cu_seqlens is not None:
            raise ValueError(
                "seq-mean-token-sum-norm on packed input needs norm_length (the horizon, "
                "e.g. the maximum response length)"
            )
        norm_length = per_token.shape[-1]
    if norm_length <= 0:
        raise ValueError(f"norm_length must be positive, got {norm_length}")
    return float(norm_length)


def row_sums_and_counts(
    values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of ``values·mask`` and of ``mask``, each ``[B]``.

    ``values``/``mask`` are ``[B, T]``, or packed ``[N]`` with ``cu_seqlens`` ``[B + 1]``.
    """
    weights = mask.to(values.dtype) if values.is_floating_point() else mask.float()
    if cu_seqlens is None:
        return (values * weights).sum(-1), weights.sum(-1)
    seq_ids = segment_ids(cu_seqlens, values.shape[0]).to(values.device)
    num_seqs = cu_seqlens.numel() - 1
    sums = values.new_zeros(num_seqs).index_add(0, seq_ids, values * weights)
    counts = weights.new_zeros(num_seqs).index_add(0, seq_ids, weights)
    return sums, counts


def segment_ids(cu_seqlens: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """Sequence index of every packed token: ``[N]`` int64 from ``cu_seqlens`` ``[B + 1]``.

    With ``num_tokens`` the output size is known, so a GPU ``cu_seqlens`` is never read
    back; the check that it covers ``num_tokens`` tokens runs where that is free (host)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seqs = torch.arange(lengths.numel(), device=lengths.device)
    if num_tokens is None:
        return torch.repeat_interleave(seqs, lengths)
    if lengths.device.type == "cpu" and int(lengths.sum()) != num_tokens:
        raise ValueError(
            f"cu_seqlens covers {int(lengths.sum())} tokens but the tensor has {num_tokens}"
        )
    return torch.repeat_interleave(seqs, lengths, output_size=num_tokens)


def _at_least_one(denominator: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor | float:
    """Guard an empty batch: 0 / max(0, 1) = 0 instead of NaN. A tensor count is cast to
    the loss's ``dtype`` so that it neither narrows nor widens the result."""
    if isinstance(denominator, torch.Tensor):
        return denominator.to(dtype).clamp(min=1.0)
    return max(float(denominator), 1.0)
