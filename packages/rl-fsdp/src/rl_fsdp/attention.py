"""Attention over packed sequences that never crosses a document boundary.

Hugging Face models call a registered attention function per layer with
``query [1, H, N, D]``, ``key/value [1, H_kv, N, D]``; the extra keyword ``rl_layout``
(a :class:`PackedLayout`) given to the model's forward reaches it untouched. Six
implementations, all equal to running each sequence alone:

- ``flash_varlen``: flash-attn's ``flash_attn_varlen_func`` with cu_seqlens (GPU, fastest);
- ``torch_varlen``: the same FlashAttention-2 varlen kernel as shipped inside torch >= 2.10
  (:mod:`rl_fsdp.torch_varlen`; one launch per layer; the CUDA default without flash-attn);
  a micro-batch of several sequences all of one length runs one batched causal SDPA call
  instead (:func:`uniform_attention`: SDPA's fastest backend, cuDNN's fused attention on
  Hopper, which took half FA2's time in Megatron's profile of 2026-11-27), when every
  micro-batch of its batch does (:func:`equal_lengths_batched`);
- ``flex``: FlexAttention with a document-causal block mask (:mod:`rl_fsdp.flex`),
  compiled once on CUDA (GPU without flash-attn);
- ``sdpa_mask``: one SDPA call with a block-diagonal causal mask ``[N, N]`` (short N; traced
  whole in a compiled layer);
- ``sdpa_grouped``: sequences of similar length padded into a few batched causal SDPA
  calls (:mod:`rl_fsdp.grouped`; SDPA's flash kernel, a handful of launches per layer
  even for hundreds of short RL sequences; the CPU default, and the CUDA default on a
  torch without varlen);
- ``sdpa_per_doc``: one causal SDPA call per sequence (keeps SDPA's flash kernel, no
  ``[N, N]`` mask, but one launch per sequence and layer).
Without ``rl_layout`` (ordinary padded calls) it falls back to Hugging Face's SDPA path.
A layer with attention-logit softcapping (Gemma2), or a sliding window shorter than the
longest sequence of the call (Mistral v0.1, Gemma2/3, Qwen2 with ``use_sliding_window``),
runs an exact per-sequence path instead, whatever the implementation (slower; nothing is
silently ignored).
"""

import contextvars
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl_core.batch import to_device
from rl_fsdp.flex import bucket_length, document_block_mask, flex_available, flex_packed_attention
from rl_fsdp.grouped import build_groups, grouped_attention
from rl_fsdp.torch_varlen import kernel_and_plan, probe, varlen_attention, varlen_function

PACKED_ATTENTION = "rl_packed"
# Traced whole inside a compiled decoder layer (rl_fsdp.fusion): graph-safe kernels (torch's
# varlen op is a custom op with its autograd; SDPA) fed by what PackedLayout built on the
# host, so a layer is one graph. The others run eager behind a graph break (host lengths,
# Python loops over sequences); flex keeps its own compiled kernel per length bucket.
TRACED_IMPLS = ("torch_varlen", "sdpa_mask")
# sdpa_grouped runs layouts of at most this many sequences one SDPA call per sequence: a
# few launches cost nothing, and long sequences then never pay for padding (the GPU bench
# figures for 128..4096-token sequences were measured that way)
PER_DOC_UP_TO = 8
# whether equal-length torch_varlen layouts take batched SDPA now (equal_lengths_batched)
_EQUAL_LENGTHS_BATCHED = contextvars.ContextVar("rl_equal_lengths_batched", default=True)


@contextmanager
def equal_lengths_batched(allowed: bool):
    """Within: a ``torch_varlen`` layout of equal lengths takes batched SDPA only if
    ``allowed``. The trainer passes whether every micro-batch of the batch it runs has equal
    lengths (:func:`all_equal_lengths`): compiled, batched SDPA is a graph of its own, which
    a loop of mixed micro-batches (RL) would otherwise compile mid-run for a rare
    equal-length one (truncated responses to prompts of one length, packed longest first)."""
    token = _EQUAL_LENGTHS_BATCHED.set(allowed)
    try:
        yield
    finally:
        _EQUAL_LENGTHS_BATCHED.reset(token)


def equal_lengths(lengths) -> bool:
    """Two or more sequences, all of one length (one sequence alone takes the varlen
    kernel: the graph of mixed layouts)."""
    return len(lengths) > 1 and len(set(lengths)) == 1


def all_equal_lengths(lengths: list[int], plan: list[list[int]]) -> bool:
    """Whether every non-empty micro-batch of ``plan`` (indices into ``lengths``) is of
    :func:`equal_lengths`."""
    parts = [[lengths[i] for i in seqs] for seqs in plan if seqs]
    return bool(parts) and all(equal_lengths(part) for part in parts)


@dataclass  # not frozen: torch.compile would guard on every field (recompiles)
class PackedLayout:
    """Boundaries of the packed sequences of one forward pass.

    cu_seqlens ``[B + 1]`` int32 on the compute device; lengths and the longest on the
    host; for ``impl="flex"`` the FlexAttention ``BlockMask``, for ``"sdpa_mask"`` the
    ``[N, N]`` block-causal mask, for ``"torch_varlen"`` the kernel and its call plan,
    for ``"sdpa_grouped"`` the groups and their ``restore`` order (built once, shared by
    all layers).
    """

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    impl: str
    max_seqlen: int = 0
    uniform: bool = False  # 2+ sequences, all of one length (torch_varlen: batched SDPA)
    block_mask: object = None
    dense_mask: torch.Tensor | None = None
    varlen: tuple | None = None  # (varlen_attn, CallPlan)
    groups: list | None = None
    restore: torch.Tensor | None = None

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor, impl: str, device, *, pad_to: int = 0
    ) -> "PackedLayout":
        """From host (no sync) or device cu_seqlens (one sync for the host lengths).
        ``pad_to``: FlexAttention pads to the bucket of ``max(N, pad_to)`` (pass the
        micro-batch budget: every micro-batch then shares one compiled shape)."""
        host = cu_seqlens.cpu()
        lengths = tuple((host[1:] - host[:-1]).tolist())
        on_device = to_device(host.to(torch.int32), device)
        layout = cls(on_device, lengths, impl, max(lengths, default=0))
        if impl == "flex":
            total = bucket_length(max(int(host[-1]), pad_to))
            layout.block_mask = document_block_mask(on_device, total)
        if impl == "sdpa_mask":
            layout.dense_mask = block_causal_mask(on_device, int(host[-1]))
        if impl == "torch_varlen":
            layout.varlen = kernel_and_plan()
            layout.uniform = _EQUAL_LENGTHS_BATCHED.get() and equal_lengths(lengths)
        if impl == "sdpa_grouped" and len(lengths) <= PER_DOC_UP_TO:
            layout.impl = "sdpa_per_doc"
        if layout.impl == "sdpa_grouped":
            layout.groups, layout.restore = build_groups(lengths, device)
        return layout

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """``(tensor, dim)`` whose size changes between micro-batches: a compiled layer
        marks them dynamic up front (no recompile per layout). The sequence count."""
        return [(self.cu_seqlens, 0)]

    def token_dims(self) -> list[tuple[torch.Tensor, int]]:
        """``(tensor, dim)`` that are the micro-batch's token count (``sdpa_mask``'s
        ``[N, N]`` mask): unbacked in a compiled layer, as the activations' tokens."""
        return [(self.dense_mask, 0), (self.dense_mask, 1)] if self.dense_mask is not None else []


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention(impl: str, device: torch.device, precision: str = "fp32") -> str:
    """Name of the implementation to use; "auto" picks the fastest available on ``device``
    for ``precision`` (the varlen kernels compute in bf16 on CUDA only)."""
    _check_explicit(impl, device, precision)
    if impl != "auto":
        return impl
    return auto_attention(
        device.type,
        precision,
        flash_attn=flash_attn_available(),
        torch_varlen=lambda: probe(device) is None,
    )


def auto_attention(device_type: str, precision: str, *, flash_attn: bool, torch_varlen) -> str:
    """What "auto" picks; ``torch_varlen()`` says whether torch's varlen kernel works here
    (called only when it is the candidate: it runs a probe on the device)."""
    if device_type != "cuda":
        # the [N, N] mask costs N^2: on a 2-core CPU a 16k-token micro-batch of 512 RL
        # sequences took 9.0 s per layer's forward + backward against 75 ms grouped, and 13.3
        # against 2.7 ms at 788 tokens (rl-fsdp's CHANGELOG)
        return "sdpa_grouped"
    if precision == "bf16" and flash_attn:
        return "flash_varlen"
    if precision == "bf16" and torch_varlen():
        return "torch_varlen"
    # Measured on an H200 (bench/train_fsdp.py --attention flex): flex was slower than one
    # SDPA per sequence (0.5b full 0.73x vs 0.94x of the plain loop), so flex stays
    # opt-in; one SDPA per sequence left the GPU idle on RL batches of hundreds of short
    # sequences (4 % busy in the loop), which the grouped calls fix.
    return "sdpa_grouped"


def _check_explicit(impl: str, device: torch.device, precision: str) -> None:
    """ValueError with the fix for an explicit choice that cannot run here."""
    varlen_ok = device.type == "cuda" and precision == "bf16"
    if impl in ("flash_varlen", "torch_varlen") and not varlen_ok:
        raise ValueError(f"attention={impl!r} needs device='cuda' and precision='bf16'")
    if impl == "flash_varlen" and not flash_attn_available():
        raise ValueError("attention='flash_varlen' needs flash-attn: pip install flash-attn")
    if impl == "torch_varlen" and varlen_function() is None:
        raise ValueError("attention='torch_varlen' needs torch>=2.10 (torch.nn.attention.varlen)")
    if impl == "torch_varlen" and (error := probe(device)):
        raise ValueError(f"attention='torch_varlen' does not work here ({error}); use 'auto'")
    if impl == "flex" and device.type != "cuda":
        raise ValueError("attention='flex' needs device='cuda' (FlexAttention has no CPU backward)")
    if impl == "flex" and not flex_available(device):
        raise ValueError("attention='flex' needs torch>=2.5 with FlexAttention and triton")


def block_causal_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[N, N]`` bool, True where query i may attend key j (same sequence, j <= i)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    same_seq = seq_ids.unsqueeze(0) == seq_ids.unsqueeze(1)
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=lengths.device).tril()
    return same_seq & causal


def packed_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """The registered attention function; returns ``([1, N, H, D], None)``.

    Traced by torch.compile (a decoder layer compiled by :mod:`rl_fsdp.fusion`), the
    :data:`TRACED_IMPLS` and flex are traced with the layer (one graph); the others, and
    the exact per-sequence path, run eager behind a graph break."""
    layout: PackedLayout | None = kwargs.get("rl_layout")
    if layout is not None and torch.compiler.is_compiling() and not _traceable(layout, kwargs):
        return _behind_graph_break()(
            module, query, key, value, attention_mask, scaling, dropout, **kwargs
        )
    return _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _traceable(layout: PackedLayout, kwargs: dict) -> bool:
    if layout.impl == "flex":
        return True
    return layout.impl in TRACED_IMPLS and not _needs_exact(layout, kwargs)


def _needs_exact(layout: PackedLayout, kwargs: dict) -> bool:
    """Whether the layer has what the fast kernels skip: a softcap, or a sliding window
    shorter than the longest sequence."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    return softcap is not None or (window is not None and layout.max_seqlen > window)


def _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    layout: PackedLayout | None = kwargs.pop("rl_layout", None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got batch {query.shape[0]}")
    if _needs_exact(layout, kwargs):
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        return _exact_per_doc(query, key, value, layout, scaling, dropout, window, softcap), None
    if layout.impl == "flash_varlen":
        return _flash_varlen(query, key, value, layout, scaling, dropout), None
    if layout.impl == "torch_varlen" and layout.uniform:
        return uniform_attention(query, key, value, layout.max_seqlen, scaling, dropout), None
    if layout.impl == "torch_varlen":
        fn, plan = layout.varlen or (None, None)
        out = varlen_attention(
            query, key, value, layout.cu_seqlens, layout.max_seqlen, scaling, dropout, fn, plan
        )
        return out, None
    if layout.impl == "flex":
        out = flex_packed_attention(query, key, value, layout.block_mask, scaling, dropout)
        return out.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if layout.impl == "sdpa_grouped":
        out = grouped_attention(query, key, value, layout.groups, layout.restore, scaling, dropout)
    elif layout.impl == "sdpa_mask":
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=layout.dense_mask, dropout_p=dropout, scale=scaling
        )
    elif len(layout.lengths) == 1:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scaling, is_causal=True
        )
    else:
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, scale=scaling, is_causal=True
                )
                for q, k, v in zip(
                    query.split(layout.lengths, dim=2),
                    key.split(layout.lengths, dim=2),
                    value.split(layout.lengths, dim=2),
                    strict=True,
                )
            ],
            dim=2,
        )
    return out.transpose(1, 2).contiguous(), None


def uniform_attention(query, key, value, length: int, scaling, dropout) -> torch.Tensor:
    """Packed sequences all ``length`` long as one causal SDPA call over ``[B, H, L, D]``
    (views of the packed row; key/value heads repeated, which every SDPA backend takes);
    returns ``[1, N, H, D]``."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    q, k, v = (t[0].unflatten(1, (-1, length)).transpose(0, 1) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
    return out.transpose(1, 2).reshape(1, query.shape[2], query.shape[1], query.shape[3])


def _exact_per_doc(query, key, value, layout: PackedLayout, scaling, dropout, window, softcap):
    """Attention with what the fast kernels here skip, one sequence at a time: a layer's
    sliding window (query i sees keys j with ``i - window < j <= i``, Hugging Face's rule)
    and attention-logit softcapping (``cap · tanh(scores / cap)``, Gemma2). Returns
    ``[1, N, H, D]``."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    outs = []
    for q, k, v in zip(*(t.split(layout.lengths, dim=2) for t in (query, key, value)), strict=True):
        offsets = torch.arange(q.shape[2], device=q.device)
        distance = offsets[:, None] - offsets[None, :]  # i - j
        allowed = (distance >= 0) & (distance < (window or q.shape[2]))
        outs.append(_masked_attention(q, k, v, allowed, scale, dropout, softcap))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _masked_attention(q, k, v, allowed, scale: float, dropout: float, softcap):
    """``[1, H, L, D]`` attention where ``allowed`` ``[L, L]``: SDPA, or eagerly with a
    softcap (SDPA has none), as Hugging Face's eager attention computes it."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale
        )
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1, dtype=torch.float32)
    weights = F.dropout(weights.to(q.dtype), p=dropout, training=dropout > 0)
    return weights @ v


@functools.cache
def _behind_graph_break():
    """``_attention`` behind a graph break. The compiled code after it (the rest of the
    layer) is compiled for the first length, then once more with a dynamic length at the
    second (Hugging Face hands it the input shape as Python ints). Made on first use:
    ``torch.compiler.disable`` imports the compiler stack (about 0.9 s), which uncompiled
    runs (CPU) never need."""
    return torch.compiler.disable(_attention)


def _flash_varlen(query, key, value, layout: PackedLayout, scaling, dropout) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        layout.cu_seqlens,
        layout.cu_seqlens,
        layout.max_seqlen,
        layout.max_seqlen,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
    )
    return out.unsqueeze(0)


def _packed_mask(*args, **kwargs):
    """Mask builder: none for packed calls (boundaries come from ``rl_layout``); padded
    calls with an ``attention_mask`` get Hugging Face's SDPA mask."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register_packed_attention() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
    return PACKED_ATTENTION
