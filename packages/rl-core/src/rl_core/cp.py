"""Context-parallel zigzag layout of one sequence across ``cp_size`` ranks.

Causal attention costs more at the end of a sequence than at its start, so giving each
rank one contiguous slice would leave the last rank with most of the work. Zigzag cuts the
sequence into ``2·cp_size`` equal chunks and gives rank r chunks r and 2·cp_size-1-r:
every rank gets one cheap and one expensive chunk.

These are pure index helpers: slicing a per-token tensor for a rank, and reassembling the
full tensor from every rank's slice (the all-gather itself belongs to the backend).
"""

from collections.abc import Sequence

import torch


def zigzag_ranges(seq_len: int, *, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """Half-open token ranges held by ``cp_rank``; ``[(0, seq_len)]`` when cp_size is 1.

    ``seq_len`` must divide into ``2·cp_size`` equal chunks (pad it with
    :func:`padded_length` first).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank} cp_size={cp_size}")
    if cp_size == 1:
        return [(0, seq_len)]
    num_chunks = 2 * cp_size
    if seq_len % num_chunks:
        raise ValueError(
            f"seq_len {seq_len} is not divisible by 2·cp_size = {num_chunks}; "
            f"pad it to {padded_length(seq_len, cp_size=cp_size)}"
        )
    chunk = seq_len // num_chunks
    first, second = cp_rank, num_chunks - 1 - cp_rank
    return [(first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)]


def padded_length(seq_len: int, *, cp_size: int) -> int:
    """Smallest length >= seq_len that splits into 2·cp_size equal chunks (seq_len if cp_size 1)."""
    multiple = 1 if cp_size == 1 else 2 * cp_size
    return -(-seq_len // multiple) * multiple


def zigzag_slice(
    tensor: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = -1
) -> torch.Tensor:
    """The part of a per-token tensor that ``cp_rank`` holds, along ``dim`` (the sequence)."""
    seq_len = tensor.shape[dim]
    pieces = [
        tensor.narrow(dim, start, end - start)
        for start, end in zigzag_ranges(seq_len, cp_size=cp_size, cp_rank=cp_rank)
    ]
    return torch.cat(pieces, dim=dim)


def zigzag_gather(shards: Sequence[torch.Tensor], *, dim: int = -1) -> torch.Tensor:
    """Reassemble the full tensor from every rank's :func:`zigzag_slice`, in rank order."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    halves_by_chunk: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        halves_by_chunk[rank] = first
        halves_by_chunk[2 * cp_size - 1 - rank] = second
    return torch.cat([halves_by_chunk[i] for i in range(2 * cp_size)], dim=dim)


def zigzag_positions(seq_len: int, *, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Original token positions held by ``cp_rank``, ``[seq_len / cp_size]`` int64."""
    ranges = zigzag_ranges(seq_len, cp_size=cp_size, cp_rank=cp_rank)
    return torch.cat([torch.arange(start, end) for start, end in ranges])
