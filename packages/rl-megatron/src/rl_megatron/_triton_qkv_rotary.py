"""Triton kernels of :mod:`rl_megatron.qkv_rotary`: rotary of queries and keys read straight
from the fused q/k/v projection's output, and its backward.

Layout (megatron's, per query group): ``mixed [s, b, g, (q_per_group + 2) · d]`` holds the
group's ``q_per_group`` query heads, then its key head, then its value head. A program
takes ``BLOCK_ROWS`` token rows of one head slot (``g · (q_per_group + 2)`` slots) and
writes it to ``q [s, b, g · q_per_group, d]``, ``k`` or ``v [s, b, g, d]`` (contiguous), the
first ``rot`` channels of queries and keys rotated by the table ``[s, 1, 1, 2, rot]``
(cos, sin); the backward reads the three gradients (any strides over s, b and heads) and
writes the gradient of ``mixed`` contiguous.

Rounding is eager torch's: each product and the sum are rounded to the tensors' dtype as
megatron's ``(t · cos) + (rotate_half(t) · sin)`` rounds them op by op (a product of two
16-bit values is exact in float32, and the rounding between the multiply and the add keeps
the compiler from fusing them), so the values equal the torch path to the bit.
"""

import torch
import triton
import triton.language as tl

_BLOCK_ROWS = 16


@triton.jit
def _rounded(value, dtype: tl.constexpr):
    """``value`` (float32) rounded to ``dtype`` and kept in float32: the arithmetic stays in
    float32 (Triton's interpreter, which the CPU tests run, mishandles bf16 negation)."""
    return value.to(dtype).to(tl.float32)


@triton.jit
def _rotated(
    x, partner, cos, sin, channel, HALF: tl.constexpr, ROT: tl.constexpr, BACKWARD: tl.constexpr
):
    """``x · cos + rotate_half(x) · sin`` per channel, each op rounded to ``x``'s dtype;
    channels from ``ROT`` on pass through. ``partner`` holds ``x`` at the paired channel
    (``c ± HALF``) and, in backward, ``sin`` is the paired channel's. Forward,
    ``rotate_half`` negates the first half's partner; backward (its transpose) the second's."""
    negate = (channel >= HALF) if BACKWARD else (channel < HALF)
    direct = _rounded(x.to(tl.float32) * cos.to(tl.float32), x.dtype)
    crossed = _rounded(partner.to(tl.float32) * sin.to(tl.float32), x.dtype)
    out = (direct + tl.where(negate[None, :], -crossed, crossed)).to(x.dtype)
    return tl.where((channel < ROT)[None, :], out, x)


@triton.jit
def _qkv_rotary_forward_kernel(
    mixed_ptr,
    table_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    rows,
    batch,
    stride_ms,
    stride_mb,
    GROUPS: tl.constexpr,
    Q_PER_GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    slot = tl.program_id(1)
    group, kind = slot // (Q_PER_GROUP + 2), slot % (Q_PER_GROUP + 2)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    channel = tl.arange(0, D_PAD)
    inside = (row < rows)[:, None] & (channel < D)[None, :]
    token, column = row // batch, row % batch
    source = mixed_ptr + (token * stride_ms + column * stride_mb)[:, None] + slot * D
    x = tl.load(source + channel[None, :], mask=inside)
    if kind == Q_PER_GROUP + 1:  # value head: copied
        tl.store(v_ptr + (row * GROUPS + group)[:, None] * D + channel[None, :], x, mask=inside)
    else:
        HALF: tl.constexpr = ROT // 2
        partner_channel = tl.where(channel < HALF, channel + HALF, channel - HALF)
        rotating = inside & (channel < ROT)[None, :]
        partner = tl.load(source + partner_channel[None, :], mask=rotating, other=0.0)
        angle = table_ptr + (token * 2 * ROT)[:, None] + channel[None, :]
        cos = tl.load(angle, mask=rotating, other=0.0)
        sin = tl.load(angle + ROT, mask=rotating, other=0.0)
        out = _rotated(x, partner, cos, sin, channel, HALF, ROT, False)
        if kind == Q_PER_GROUP:  # key head
            target = k_ptr + (row * GROUPS + group)[:, None] * D
        else:
            target = q_ptr + (row * GROUPS * Q_PER_GROUP + group * Q_PER_GROUP + kind)[:, None] * D
        tl.store(target + channel[None, :], out, mask=inside)


@triton.jit
def _qkv_rotary_backward_kernel(
    grad_q_ptr,
    grad_k_ptr,
    grad_v_ptr,
    table_ptr,
    grad_mixed_ptr,
    rows,
    batch,
    q_strides_s,
    q_strides_b,
    q_strides_h,
    k_strides_s,
    k_strides_b,
    k_strides_h,
    v_strides_s,
    v_strides_b,
    v_strides_h,
    GROUPS: tl.constexpr,
    Q_PER_GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    slot = tl.program_id(1)
    group, kind = slot // (Q_PER_GROUP + 2), slot % (Q_PER_GROUP + 2)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    channel = tl.arange(0, D_PAD)
    inside = (row < rows)[:, None] & (channel < D)[None, :]
    token, column = row // batch, row % batch
    target = grad_mixed_ptr + (row * GROUPS * (Q_PER_GROUP + 2) + slot)[:, None] * D
    if kind == Q_PER_GROUP + 1:  # value head: copied
        base = grad_v_ptr + token * v_strides_s + column * v_strides_b + group * v_strides_h
        grad = tl.load(base[:, None] + channel[None, :], mask=inside)
        tl.store(target + channel[None, :], grad, mask=inside)
    else:
        if kind == Q_PER_GROUP:  # key head
            base = grad_k_ptr + token * k_strides_s + column * k_strides_b + group * k_strides_h
        else:
            head = group * Q_PER_GROUP + kind
            base = grad_q_ptr + token * q_strides_s + column * q_strides_b + head * q_strides_h
        grad = tl.load(base[:, None] + channel[None, :], mask=inside)
        HALF: tl.constexpr = ROT // 2
        partner_channel = tl.where(channel < HALF, channel + HALF, channel - HALF)
        rotating = inside & (channel < ROT)[None, :]
        partner = tl.load(base[:, None] + partner_channel[None, :], mask=rotating, other=0.0)
        angle = table_ptr + (token * 2 * ROT)[:, None]
        cos = tl.load(angle + channel[None, :], mask=rotating, other=0.0)
        partner_sin = tl.load(angle + ROT + partner_channel[None, :], mask=rotating, other=0.0)
        out = _rotated(grad, partner, cos, partner_sin, channel, HALF, ROT, True)
        tl.store(target + channel[None, :], out, mask=inside)


def _layout(mixed: torch.Tensor, table: torch.Tensor, q_per_group: int) -> dict:
    groups, width = mixed.shape[2], mixed.shape[3]
    head_dim = width // (q_per_group + 2)
    rot = table.shape[-1]
    assert head_dim * (q_per_group + 2) == width and rot % 2 == 0 and rot <= head_dim
    return dict(
        GROUPS=groups,
        Q_PER_GROUP=q_per_group,
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        ROT=rot,
        BLOCK_ROWS=_BLOCK_ROWS,
    )


def _grid(rows: int, layout: dict) -> tuple[int, int]:
    return triton.cdiv(rows, _BLOCK_ROWS), layout["GROUPS"] * (layout["Q_PER_GROUP"] + 2)


def rotate_qkv(mixed: torch.Tensor, table: torch.Tensor, q_per_group: int):
    """``(q [s, b, g·q_per_group, d], k [s, b, g, d], v [s, b, g, d])``, contiguous, from
    ``mixed [s, b, g, (q_per_group + 2)·d]`` (the last two dims dense) and the cos/sin
    ``table [s, 1, 1, 2, rot]`` (contiguous, ``mixed``'s dtype)."""
    seq, batch = mixed.shape[:2]
    assert mixed.stride(3) == 1 and mixed.stride(2) == mixed.shape[3]
    assert table.is_contiguous() and table.dtype == mixed.dtype and table.shape[0] == seq
    layout = _layout(mixed, table, q_per_group)
    groups, head_dim = layout["GROUPS"], layout["D"]
    q = mixed.new_empty(seq, batch, groups * q_per_group, head_dim)
    k = mixed.new_empty(seq, batch, groups, head_dim)
    v = torch.empty_like(k)
    rows = seq * batch
    if rows:
        _qkv_rotary_forward_kernel[_grid(rows, layout)](
            mixed,
            table,
            q,
            k,
            v,
            rows,
            batch,
            mixed.stride(0),
            mixed.stride(1),
            **layout,
            enable_fp_fusion=False,
        )
    return q, k, v


def rotate_qkv_backward(grad_q, grad_k, grad_v, table: torch.Tensor, q_per_group: int):
    """The gradient of :func:`rotate_qkv`'s ``mixed`` (contiguous ``[s, b, g, (q_per_group
    + 2)·d]``) from the gradients of q, k and v (any strides, the last dim dense)."""
    seq, batch, groups, head_dim = grad_k.shape
    grads = [g if g.stride(3) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v)]
    grad_mixed = grad_k.new_empty(seq, batch, groups, (q_per_group + 2) * head_dim)
    layout = _layout(grad_mixed, table, q_per_group)
    rows = seq * batch
    if rows:
        strides = [stride for g in grads for stride in g.stride()[:3]]
        _qkv_rotary_backward_kernel[_grid(rows, layout)](
            *grads, table, grad_mixed, rows, batch, *strides, **layout, enable_fp_fusion=False
        )
    return grad_mixed
