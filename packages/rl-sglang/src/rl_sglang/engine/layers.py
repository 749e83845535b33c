"""Decode-step pieces of a Llama-family decoder layer, written for few GPU kernels.

A decode step of a small model is bound by kernel launches, not FLOPs, so: q/k/v and
gate/up each run as one GEMM over concatenated weights, RMSNorm is torch's fused
``rms_norm``, rotary embeddings rotate queries and keys together, and grouped-query
attention runs as two Triton kernels that read only each row's length
(:mod:`rl_sglang.engine.decode_attention`) or, without them, as plain SDPA with a length
mask and the query heads of each KV head laid out as query positions (no repeated K/V, so
the fused attention kernels apply).

Shapes: ``B`` rows, ``H`` hidden, ``Hq``/``Hkv`` query/KV heads, ``G = Hq / Hkv``,
``D`` head dim, ``T`` cache length.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rl_sglang.engine.decode_attention import decode_attention

# SDPA's kernels for a prefill on CUDA: cuDNN's fused attention, which SDPA picks first on
# Hopper, builds a plan per new shape (58-93 ms on an H100 for each new prompt count, 0.2 ms
# once built), and a rollout's prefills come in whatever counts the requests arrived in.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms_norm(norm: torch.nn.Module, x_BH: torch.Tensor) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm: normalise in float32, cast back, scale by the weight."""
    return norm.weight * F.rms_norm(x_BH, (x_BH.shape[-1],), eps=norm_eps(norm))


def norm_eps(norm: torch.nn.Module) -> float:
    """The epsilon of an HF RMSNorm (``variance_epsilon`` in Llama/Qwen2, ``eps`` elsewhere)."""
    for name in ("variance_epsilon", "eps"):
        if getattr(norm, name, None) is not None:
            return float(getattr(norm, name))
    return 1e-6


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for :func:`rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's ``x * cos + rotate_half(x) * sin`` bit for bit:
    ``rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin)`` (one kernel, not two)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def attend(q_BQD: torch.Tensor, keys_BKTD, values_BKTD, mask_B11T) -> torch.Tensor:
    """One query per row against its slot: ``[B, Hq, D]`` queries, ``[B, Hkv, T, D]``
    keys/values, additive mask ``[B, 1, 1, T]``; returns ``[B, Hq * D]``."""
    batch, num_kv, _, head_dim = keys_BKTD.shape
    q_BKGD = q_BQD.reshape(batch, num_kv, -1, head_dim)  # query head h uses KV head h // G
    out_BKGD = F.scaled_dot_product_attention(q_BKGD, keys_BKTD, values_BKTD, mask_B11T)
    return out_BKGD.reshape(batch, -1)


def decode_layer(
    hidden_BH,
    keys_SKTD,
    values_SKTD,
    rows_B,
    positions_B,
    cos,
    sin,
    mask_B11T,
    weights: tuple,
    eps: float,
    num_heads: int,
    head_dim: int,
):
    """One decoder layer for one new token per row; writes the row's key/value at its
    position in slot ``row`` of the cache ``[S, Hkv, T, D]``. A pure function of tensors
    (``weights`` from :meth:`LayerWeights.tensors`), so one ``torch.compile`` serves every
    layer. ``cos``/``sin`` ``[B, 1, D]``; ``mask_B11T`` None: attention by
    :func:`decode_attention` (rows' lengths from ``positions_B``), else SDPA with it."""
    in_norm, post_norm, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b = weights
    batch = hidden_BH.shape[0]
    x_BH = in_norm * F.rms_norm(hidden_BH, (hidden_BH.shape[-1],), eps=eps)
    qkv = F.linear(x_BH, qkv_w, qkv_b)
    qk_width = (num_heads + keys_SKTD.shape[1]) * head_dim  # queries then keys, adjacent
    qk = rotate(qkv[:, :qk_width].view(batch, -1, head_dim), cos, sin)
    keys_SKTD[rows_B, :, positions_B] = qk[:, num_heads:]
    values_SKTD[rows_B, :, positions_B] = qkv[:, qk_width:].view(batch, -1, head_dim)
    if mask_B11T is None:
        attn_BQ = decode_attention(qk[:, :num_heads], keys_SKTD, values_SKTD, positions_B)
    else:
        attn_BQ = attend(qk[:, :num_heads], keys_SKTD[:batch], values_SKTD[:batch], mask_B11T)
    hidden_BH = hidden_BH + F.linear(attn_BQ, o_w, o_b)
    x_BH = post_norm * F.rms_norm(hidden_BH, (hidden_BH.shape[-1],), eps=eps)
    gate, up = F.linear(x_BH, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return hidden_BH + F.linear(F.silu(gate) * up, down_w, down_b)


def prefill_layer(hidden_NLH, weights: tuple, cos, sin, eps: float, num_heads: int, head_dim: int):
    """One decoder layer over ``N`` right-padded prompts of ``L`` tokens (causal attention,
    so a real token never sees the padding after it). ``cos``/``sin`` ``[1, L, 1, D]``.
    Returns the new hidden states and the rotated keys and the values ``[N, Hkv, L, D]``."""
    in_norm, post_norm, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b = weights
    batch, length, _ = hidden_NLH.shape
    x_NLH = in_norm * F.rms_norm(hidden_NLH, (hidden_NLH.shape[-1],), eps=eps)
    qkv = F.linear(x_NLH, qkv_w, qkv_b)
    num_kv = (qkv.shape[-1] // head_dim - num_heads) // 2
    qk_width = (num_heads + num_kv) * head_dim
    qk = rotate(qkv[..., :qk_width].view(batch, length, -1, head_dim), cos, sin).transpose(1, 2)
    values = qkv[..., qk_width:].view(batch, length, num_kv, head_dim).transpose(1, 2)
    queries, keys = qk[:, :num_heads], qk[:, num_heads:]
    with _prefill_attention(queries):
        attn = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, enable_gqa=num_kv != num_heads
        )
    attn_NLQ = attn.transpose(1, 2).reshape(batch, length, -1)
    hidden_NLH = hidden_NLH + F.linear(attn_NLQ, o_w, o_b)
    x_NLH = post_norm * F.rms_norm(hidden_NLH, (hidden_NLH.shape[-1],), eps=eps)
    gate, up = F.linear(x_NLH, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return hidden_NLH + F.linear(F.silu(gate) * up, down_w, down_b), keys, values


def _prefill_attention(queries: torch.Tensor):
    """SDPA restricted to :data:`PREFILL_ATTENTION` on CUDA; unrestricted elsewhere."""
    return sdpa_kernel(PREFILL_ATTENTION) if queries.is_cuda else contextlib.nullcontext()


class LayerWeights:
    """A layer's weights for :func:`decode_layer`: q/k/v and gate/up each one tensor (one
    GEMM each), the rest the model's own tensors. The fused tensors hold the projections
    themselves: each Linear's weight and bias is a row slice of its group's tensor (see
    :func:`fuse_projections`), so a weight update copied into the model lands in them
    (captured CUDA graphs keep pointing at them) and the projections are held once.
    ``empty(shape, dtype)`` allocates them where the layer is not fused yet (default:
    ``torch.empty`` on the weights' device)."""

    def __init__(self, layer: torch.nn.Module, empty=None):
        self.qkv, self.gate_up = fused_tensors(layer) or fuse_projections(layer, empty)
        attn, mlp = layer.self_attn, layer.mlp
        self.norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj

    def tensors(self) -> tuple:
        o, down = self.o_proj, self.down_proj
        return (*self.norms, *self.qkv, o.weight, o.bias, *self.gate_up, down.weight, down.bias)


Fused = tuple[torch.Tensor, torch.Tensor | None]  # a group's weight and bias (None: no bias)


@torch.no_grad()
def fuse_projections(layer: torch.nn.Module, empty=None) -> list[Fused]:
    """Move q/k/v and gate/up of ``layer`` into one tensor per group (allocated by
    ``empty(shape, dtype)``, default ``torch.empty`` on the weights' device), each Linear's
    weight and bias becoming a row slice of it; the fused ``(weight, bias)`` per group."""
    fused = []
    for group in fused_groups(layer):
        device = group[0].weight.device
        make = empty or (lambda shape, dtype, d=device: torch.empty(shape, dtype=dtype, device=d))
        tensors = [make(shape, dtype) for shape, dtype in _group_specs(group)]
        for tensor, attribute in zip(tensors, ("weight", "bias"), strict=False):
            parts = [getattr(m, attribute) for m in group]
            torch.cat([p.data for p in parts], out=tensor)
            for part, rows in zip(parts, tensor.split([p.shape[0] for p in parts]), strict=True):
                part.data = rows
        fused.append((tensors[0], tensors[1] if len(tensors) > 1 else None))
    return fused


def fused_tensors(layer: torch.nn.Module) -> list[Fused] | None:
    """The fused ``(weight, bias)`` of each group when :func:`fuse_projections` fused
    ``layer`` and its projections still lie there (their parameters not moved since); None
    otherwise."""
    fused = []
    for group in fused_groups(layer):
        has_bias = _group_bias(group)
        weight = _span([m.weight for m in group])
        bias = _span([m.bias for m in group]) if has_bias else None
        if weight is None or (has_bias and bias is None):
            return None
        fused.append((weight, bias))
    return fused


def _span(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor ``parts`` are consecutive row blocks of (one storage, back to back,
    contiguous), None when they are not."""
    first = parts[0].data
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        part = part.data
        same_place = part.untyped_storage().data_ptr() == storage and part.dtype == first.dtype
        if not (same_place and part.storage_offset() == offset and part.is_contiguous()):
            return None
        offset += part.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def fused_groups(layer: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The Linears :class:`LayerWeights` concatenates: q/k/v, then gate/up."""
    attn, mlp = layer.self_attn, layer.mlp
    return [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]]


def fused_specs(layer: torch.nn.Module) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of every tensor :class:`LayerWeights` allocates for ``layer``."""
    return [spec for group in fused_groups(layer) for spec in _group_specs(group)]


def _group_specs(linears: list[torch.nn.Module]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The concatenated weight of ``linears`` and, when they have biases, the bias."""
    weights = [m.weight for m in linears]
    rows = sum(w.shape[0] for w in weights)
    specs = [((rows, *weights[0].shape[1:]), weights[0].dtype)]
    if _group_bias(linears):
        specs.append(((rows,), linears[0].bias.dtype))
    return specs


def _group_bias(linears: list[torch.nn.Module]) -> bool:
    biases = [m.bias is not None for m in linears]
    if any(biases) and not all(biases):
        raise ValueError("projections with and without bias cannot be fused; use --runner dynamic")
    return all(biases)
