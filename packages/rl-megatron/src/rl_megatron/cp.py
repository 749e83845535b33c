"""Context-parallel slicing of a packed batch with rl_core's zigzag layout.

Each sequence is padded to a multiple of ``2·cp_size`` and rank r keeps its chunks r and
``2·cp_size-1-r`` (:func:`rl_core.cp.zigzag_ranges`). Targets are taken from the *full*
sequence before slicing (the token after a rank's last position may live on another rank),
and the step's global denominators are kept, so the sum over CP ranks of each slice's loss
is the unsplit loss.

Shapes: packed ``[N]`` in; per rank ``[N_cp]`` out, ``N_cp = Σ padded_len / cp_size``.
"""

import itertools
from dataclasses import replace

import torch

from rl_core.aggregation import segment_ids
from rl_core.batch import PER_TOKEN_FIELDS, TrainBatch, next_token_targets
from rl_core.cp import padded_length, zigzag_positions
from rl_core.packing import cu_seqlens_from_lengths


def cp_token_index(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index [N_cp], positions [N_cp], cu_seqlens_cp [B + 1])``: the packed index of each
    token this rank holds (-1 for padding) and its position within its sequence."""
    bounds = cu_seqlens.tolist()
    indices, positions, lengths = [], [], []
    for start, end in itertools.pairwise(bounds):
        length = end - start
        held = zigzag_positions(
            padded_length(length, cp_size=cp_size), cp_size=cp_size, cp_rank=cp_rank
        )
        indices.append(torch.where(held < length, held + start, -1))
        positions.append(held)
        lengths.append(held.numel())
    empty = torch.zeros(0, dtype=torch.long)
    return (
        torch.cat(indices) if indices else empty,
        torch.cat(positions) if positions else empty,
        cu_seqlens_from_lengths(lengths),
    )


def take(values: torch.Tensor, index: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """``values[index]`` along dim 0 with ``fill`` where index is -1."""
    picked = values[index.clamp(min=0)]
    pad = (index < 0).view(-1, *([1] * (values.dim() - 1)))
    return picked.masked_fill(pad, fill)


def cp_shard_batch(batch: TrainBatch, *, cp_size: int, cp_rank: int):
    """``(batch_cp, targets_cp [N_cp], positions_cp [N_cp])`` for CP rank ``cp_rank``;
    padding tokens carry loss_mask 0."""
    index, positions, cu_cp = cp_token_index(batch.cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)
    targets = take(next_token_targets(batch.tokens, batch.cu_seqlens), index)
    sliced = {
        name: take(getattr(batch, name), index)
        for name in PER_TOKEN_FIELDS
        if getattr(batch, name) is not None
    }
    shard = replace(
        batch, tokens=take(batch.tokens, index), cu_seqlens=cu_cp, routed_experts=None, **sliced
    )
    return shard, targets, positions


def restrict_batch(batch: TrainBatch, held: torch.Tensor) -> TrainBatch:
    """The tokens of ``batch`` at packed indices ``held`` (row-major, as the model returns
    them) as a batch: per-token fields sliced, one (shorter) row per sequence, global
    denominators kept. Only per-token sums of it are meaningful (token-mean, seq sums)."""
    if held.numel() == batch.num_tokens:
        return batch
    seq_of_token = segment_ids(batch.cu_seqlens, batch.num_tokens).to(held.device)[held]
    counts = torch.bincount(seq_of_token, minlength=batch.num_seqs)
    sliced = {
        name: getattr(batch, name)[held]
        for name in PER_TOKEN_FIELDS
        if getattr(batch, name) is not None
    }
    cu = cu_seqlens_from_lengths(counts.cpu()).to(batch.cu_seqlens.device)
    # routes were the forward's input; the loss after it has no use for them
    return replace(batch, tokens=batch.tokens[held], cu_seqlens=cu, routed_experts=None, **sliced)
