"""``torch_varlen``: the FlashAttention-2 varlen kernel that torch itself ships
(``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10), no flash-attn package needed.

One kernel launch per layer for the whole packed row, whatever the number and lengths of
its sequences: ``query [T, H, D]``, ``key/value [T, H_kv, D]``, ``cu_seqlens [B + 1]``
int32 on the device and the longest length as a host int (from
:class:`~rl_fsdp.attention.PackedLayout`: no device sync).

Its signature changed between torch releases, so it is read once per function
(:func:`call_plan`) and the call adapted:

- causal: ``is_causal=True`` (2.10) or ``window_size=(-1, 0)`` (later);
- the model's ``scaling``: passed as ``scale=`` where accepted; otherwise only the
  default ``1/sqrt(D)`` is possible and any other scaling raises a ValueError;
- GQA: ``enable_gqa=True`` where accepted, otherwise the key/value heads are repeated.
"""

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PROBE_ERRORS: list[str] = []  # why the probe refused the kernel (the bench reports it)


def varlen_function():
    """torch's ``varlen_attn``, or None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class CallPlan:
    """How to call one ``varlen_attn`` signature: the causal keyword and its value, and
    whether it takes ``scale=`` and ``enable_gqa=``."""

    causal: tuple[str, object]
    scale: bool
    gqa: bool


def plan_from_signature(signature: inspect.Signature) -> CallPlan:
    params = signature.parameters
    if "window_size" in params:
        causal = ("window_size", (-1, 0))
    elif "is_causal" in params:
        causal = ("is_causal", True)
    else:
        raise RuntimeError(
            f"torch {torch.__version__}: varlen_attn{signature} has neither window_size nor "
            "is_causal; use attention='sdpa_grouped'"
        )
    return CallPlan(causal, "scale" in params, "enable_gqa" in params)


@functools.lru_cache(maxsize=8)
def call_plan(fn) -> CallPlan:
    """The :class:`CallPlan` of ``fn`` (its signature inspected once)."""
    return plan_from_signature(inspect.signature(fn))


def call_kwargs(plan: CallPlan, *, scaling, head_dim: int, heads: int, kv_heads: int):
    """Keyword arguments for ``varlen_attn`` and the factor to repeat key/value heads by."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    kwargs = dict([plan.causal])
    if plan.scale:
        kwargs["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        raise ValueError(
            f"torch {torch.__version__}'s varlen_attn takes no scale, and the model scales "
            f"by {scaling} instead of 1/sqrt({head_dim}); use attention='sdpa_grouped'"
        )
    repeat = heads // kv_heads
    if repeat > 1 and plan.gqa:
        kwargs["enable_gqa"], repeat = True, 1
    return kwargs, repeat


def varlen_attention(
    query, key, value, cu_seqlens, max_seqlen: int, scaling, dropout, fn=None, plan=None
):
    """``query [1, H, N, D]``, ``key/value [1, H_kv, N, D]`` -> ``[1, N, H, D]``, each
    sequence of ``cu_seqlens`` attending causally to itself only. ``fn`` and its ``plan``
    default to torch's kernel; pass both (from :func:`kernel_and_plan`, outside) when
    traced by torch.compile, which cannot inspect a signature."""
    if dropout:
        raise ValueError("attention='torch_varlen' has no dropout; set attention_dropout=0")
    fn = fn or varlen_function()
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    kwargs, repeat = call_kwargs(
        plan or call_plan(fn), scaling=scaling, head_dim=head_dim, heads=heads, kv_heads=kv_heads
    )
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, H, D]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    return out.unsqueeze(0)


def kernel_and_plan():
    """torch's ``varlen_attn`` and its :class:`CallPlan`, or ``(None, None)`` without it."""
    fn = varlen_function()
    return (fn, call_plan(fn)) if fn is not None else (None, None)


@functools.lru_cache(maxsize=4)
def probe(device: torch.device) -> str | None:
    """None if torch's varlen kernel runs here (bf16, GQA, forward and backward) and
    matches one causal SDPA per sequence; else why not (also kept in PROBE_ERRORS)."""
    fn = varlen_function()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)"
    try:
        error = _probe(fn, device)
    except Exception as err:  # any failure: the caller picks another implementation
        error = f"torch_varlen probe failed: {err!r}"[:400]
    if error:
        PROBE_ERRORS.append(error)
    return error


def _probe(fn, device: torch.device) -> str | None:
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 130, 1, 64)
    shapes = ((1, 4, sum(lengths), 64), (1, 2, sum(lengths), 64), (1, 2, sum(lengths), 64))
    qkv = [
        torch.randn(s, generator=gen).to(device, torch.bfloat16).requires_grad_() for s in shapes
    ]
    cu = torch.tensor((0, *_cumsum(lengths)), dtype=torch.int32, device=device)
    got = varlen_attention(*qkv, cu, max(lengths), None, 0.0, fn=fn)
    got.float().square().sum().backward()
    grads = [t.grad for t in qkv]
    ref = [t.detach().float().requires_grad_() for t in qkv]
    want = per_sequence_attention(*ref, lengths)
    want.square().sum().backward()
    for name, a, b in zip("oqkv", (got, *grads), (want, *(t.grad for t in ref)), strict=True):
        err = float((a.detach().float() - b).norm() / b.norm().clamp(min=1e-6))
        if not err < 5e-2:  # bf16 noise is ~1e-2; a wrong mask or scale is ~1
            return f"torch_varlen probe: {name} off by {err:.3g} (relative) from per-sequence SDPA"
    return None


def per_sequence_attention(query, key, value, lengths) -> torch.Tensor:
    """Reference: one causal SDPA per sequence, ``[1, H, N, D]`` in, ``[1, N, H, D]`` out."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    parts = zip(*(t.split(list(lengths), dim=2) for t in (query, key, value)), strict=True)
    out = torch.cat(
        [F.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in parts], dim=2
    )
    return out.transpose(1, 2)


def _cumsum(lengths):
    total = 0
    for n in lengths:
        total += n
        yield total
