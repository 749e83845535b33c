"""FlexAttention over packed sequences: a document-causal block mask from cu_seqlens.

The packed row of N tokens is padded (inside attention only) to a bucket length L, a power
of two >= ``MIN_BUCKET``, so the compiled kernel sees few distinct shapes (one per bucket,
compiled once each, no dynamic shapes). Each padding token is a document of its own: it
attends only to itself, so no row is fully masked and padding costs one diagonal tile per
block. The BlockMask is built directly at tile level (``BLOCK`` x ``BLOCK`` tiles) from the
first and last document of each tile, with no ``[L, L]`` tensor and no host sync:

- tile (i, j) is *full* when j < i and both tiles lie inside one document;
- tile (i, j) is *partial* when j <= i, it is not full and the last document of tile j is
  >= the first document of tile i (documents are contiguous, so they then share one);
  inside partial tiles ``mask_mod`` (same document and kv <= q) decides per token.

Shapes: query ``[1, H, N, D]``, key/value ``[1, H_kv, N, D]``, output ``[1, H, N, D]``;
document ids ``[L]``; tile tensors ``[1, 1, L/BLOCK(, L/BLOCK)]`` int32.
"""

import importlib.util

import torch
import torch.nn.functional as F

BLOCK = 128
MIN_BUCKET = 1024
_COMPILED = {}


def flex_available(device: torch.device) -> bool:
    """FlexAttention exists in this torch, and on CUDA triton is there to compile it."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False
    return device.type != "cuda" or importlib.util.find_spec("triton") is not None


def bucket_length(num_tokens: int) -> int:
    """The padded length L: the next power of two, at least ``MIN_BUCKET``."""
    return max(MIN_BUCKET, 1 << max(num_tokens - 1, 0).bit_length())


def document_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Document index of each of ``length`` positions ``[L]`` int32: sequence b for its
    tokens, then B, B+1, ... for the padding after ``cu_seqlens[-1]`` (one each)."""
    cu = cu_seqlens.to(torch.int64)
    pos = torch.arange(length, device=cu.device)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    return (doc + (pos - cu[-1]).clamp(min=0)).to(torch.int32)


def document_causal_mask_mod(doc: torch.Tensor):
    """FlexAttention ``mask_mod``: same document and key not after query."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def tile_masks(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` ``[T, T]`` bool over tiles (rows: query tiles) for ``doc`` ``[L]``."""
    first, last = doc[::BLOCK], doc[BLOCK - 1 :: BLOCK]
    tiles = torch.arange(first.numel(), device=doc.device)
    q_tile, kv_tile = tiles[:, None], tiles[None, :]
    full = (kv_tile < q_tile) & (first[None, :] == last[:, None])
    touched = (kv_tile <= q_tile) & (last[None, :] >= first[:, None])
    return touched & ~full, full


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count ``[1, 1, T]`` and indices ``[1, 1, T, T]`` (set tiles first) of a tile mask."""
    counts = mask.sum(-1, dtype=torch.int32)
    order = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None], order.to(torch.int32)[None, None]


def document_block_mask(cu_seqlens: torch.Tensor, length: int):
    """The document-causal ``BlockMask`` of a packed row padded to ``length`` (a multiple
    of ``BLOCK``), on ``cu_seqlens``'s device."""
    from torch.nn.attention.flex_attention import BlockMask

    if length % BLOCK:
        raise ValueError(f"length must be a multiple of {BLOCK}, got {length}")
    doc = document_ids(cu_seqlens, length)
    partial, full = tile_masks(doc)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=BLOCK,
        mask_mod=document_causal_mask_mod(doc),
        seq_lengths=(length, length),
    )


def _flex_fn(device: torch.device):
    """flex_attention, compiled once per process on CUDA (static shapes: one graph per
    bucket); inside a compiled decoder layer the plain function (the layer's compile
    covers it); elsewhere the unfused reference implementation (forward only:
    FlexAttention has no CPU backward; used by the CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():  # inside a compiled layer
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["cuda"]


def flex_packed_attention(query, key, value, block_mask, scaling, dropout) -> torch.Tensor:
    """Attention of the packed row through FlexAttention: ``[1, H, N, D]`` out."""
    if dropout:
        raise ValueError("attention='flex' has no attention dropout; set attention_dropout=0")
    num_tokens, length = query.shape[2], block_mask.seq_lengths[0]
    q, k, v = query, key, value
    if length != num_tokens:
        pad = (0, 0, 0, length - num_tokens)
        q, k, v = (F.pad(t, pad) for t in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    out = _flex_fn(q.device)(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out[:, :, :num_tokens]
