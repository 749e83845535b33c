"""Triton kernels of :mod:`rl_megatron.qkv_rotary`: rotary of queries and keys read straight
from the fused q/k/v projection's output, and its backward.

Layout (megatron's, per query group): ``mixed [s, b, g, (q_per_group + 2) · d]`` holds the
group's ``q_per_group`` query heads, then its key head, then its value head. A program
takes ``BLOCK_ROWS`` token rows of one head slot (``g · (q_per_group + 2)`` slots) and
writes it to ``q [s, b, g · q_per_group, d]``, ``k`` or ``v [s, b, g, d]`` (contiguous), the
first ``rot`` channels of queries and keys rotated by the table ``[s, 1, 1, 2, rot]``
(cos, sin); the backward reads the three gradients (any strides over s, b and heads) and
writes the gradient of ``mixed`` contiguous. Each head is handled as three contiguous
tiles, the rotated halves ``[0, rot/2)`` and ``[rot/2, rot)`` and the passed rest
``[rot, d)``, so that loads and stores are vectorised.

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
def _rotate_head(
    source,
    target,
    table,
    rows_inside,
    BACKWARD: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
):
    """One head of ``BLOCK_ROWS`` rows: ``source`` and ``target`` ``[BLOCK_ROWS, 1]``
    pointers to each row's channel 0, ``table`` to each row's cos (sin ``ROT`` on).
    Forward: ``x · cos + rotate_half(x) · sin`` (``rotate_half(x) = [-x2, x1]``); backward,
    its transpose: ``g · cos + [g2 · sin2, -(g1 · sin1)]``; each product and the sum
    rounded to the dtype as eager torch rounds them."""
    HALF: tl.constexpr = ROT // 2
    h = tl.arange(0, HALF_PAD)[None, :]
    mask = rows_inside & (h < HALF)
    x1 = tl.load(source + h, mask=mask)
    x2 = tl.load(source + HALF + h, mask=mask)
    dtype: tl.constexpr = x1.dtype
    cos1 = tl.load(table + h, mask=mask).to(tl.float32)
    cos2 = tl.load(table + HALF + h, mask=mask).to(tl.float32)
    sin1 = tl.load(table + ROT + h, mask=mask).to(tl.float32)
    sin2 = tl.load(table + ROT + HALF + h, mask=mask).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if BACKWARD:
        out1 = _rounded(x1 * cos1, dtype) + _rounded(x2 * sin2, dtype)
        out2 = _rounded(x2 * cos2, dtype) - _rounded(x1 * sin1, dtype)
    else:
        out1 = _rounded(x1 * cos1, dtype) - _rounded(x2 * sin1, dtype)
        out2 = _rounded(x2 * cos2, dtype) + _rounded(x1 * sin2, dtype)
    tl.store(target + h, out1.to(dtype), mask=mask)
    tl.store(target + HALF + h, out2.to(dtype), mask=mask)
    if REST_PAD > 0:  # partial rope: the channels from ROT on pass through
        r = tl.arange(0, REST_PAD)[None, :]
        rest_mask = rows_inside & (r < D - ROT)
        tl.store(target + ROT + r, tl.load(source + ROT + r, mask=rest_mask), mask=rest_mask)


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
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    slot = tl.program_id(1)
    group, kind = slot // (Q_PER_GROUP + 2), slot % (Q_PER_GROUP + 2)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows_inside = (row < rows)[:, None]
    token, column = row // batch, row % batch
    source = mixed_ptr + (token * stride_ms + column * stride_mb + slot * D)[:, None]
    if kind == Q_PER_GROUP + 1:  # value head: copied
        d = tl.arange(0, D_PAD)[None, :]
        mask = rows_inside & (d < D)
        target = v_ptr + ((row * GROUPS + group) * D)[:, None]
        tl.store(target + d, tl.load(source + d, mask=mask), mask=mask)
    else:
        if kind == Q_PER_GROUP:  # key head
            target = k_ptr + ((row * GROUPS + group) * D)[:, None]
        else:
            head = group * Q_PER_GROUP + kind
            target = q_ptr + ((row * (GROUPS * Q_PER_GROUP) + head) * D)[:, None]
        table = table_ptr + (token * (2 * ROT))[:, None]
        _rotate_head(source, target, table, rows_inside, False, D, ROT, HALF_PAD, REST_PAD)


@triton.jit
def _qkv_rotary_backward_kernel(
    grad_q_ptr,
    grad_k_ptr,
    grad_v_ptr,
    table_ptr,
    grad_mixed_ptr,
    rows,
    batch,
    q_stride_s,
    q_stride_b,
    q_stride_h,
    k_stride_s,
    k_stride_b,
    k_stride_h,
    v_stride_s,
    v_stride_b,
    v_stride_h,
    GROUPS: tl.constexpr,
    Q_PER_GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROT: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    slot = tl.program_id(1)
    group, kind = slot // (Q_PER_GROUP + 2), slot % (Q_PER_GROUP + 2)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows_inside = (row < rows)[:, None]
    token, column = row // batch, row % batch
    target = grad_mixed_ptr + ((row * (GROUPS * (Q_PER_GROUP + 2)) + slot) * D)[:, None]
    if kind == Q_PER_GROUP + 1:  # value head: copied
        d = tl.arange(0, D_PAD)[None, :]
        mask = rows_inside & (d < D)
        source = grad_v_ptr + (token * v_stride_s + column * v_stride_b + group * v_stride_h)
        tl.store(target + d, tl.load(source[:, None] + d, mask=mask), mask=mask)
    else:
        if kind == Q_PER_GROUP:  # key head
            source = grad_k_ptr + (token * k_stride_s + column * k_stride_b + group * k_stride_h)
        else:
            head = group * Q_PER_GROUP + kind
            source = grad_q_ptr + (token * q_stride_s + column * q_stride_b + head * q_stride_h)
        table = table_ptr + (token * (2 * ROT))[:, None]
        _rotate_head(source[:, None], target, table, rows_inside, True, D, ROT, HALF_PAD, REST_PAD)


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
        HALF_PAD=triton.next_power_of_2(rot // 2),
        REST_PAD=triton.next_power_of_2(head_dim - rot) if head_dim > rot else 0,
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
