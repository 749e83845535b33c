"""Decode attention as two Triton kernels that read each row's length (split-KV, GQA).

A decode step has one query per row and head. SDPA over the whole slot with a length mask
runs a prefill-shaped kernel: it tiles the query heads of a KV head as query positions,
reads every cache position up to the slot's end and masks most of them away, so its cost
follows the cache's size, not the tokens a row holds. Here each row's keys are split into
up to :data:`SPLITS` chunks of its own length (no position past it is read); one program
per (row, KV head, chunk) computes the chunk's softmax numerator and statistics for all
query heads of that KV head at once, and a second kernel merges the chunks. Softmax and
accumulation are in float32; float32 inputs use IEEE products (no TF32).

Shapes: ``B`` rows, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim, cache ``[S, Hkv, T, D]``
(row ``i`` in slot ``i``), ``positions_B`` the position of each row's new token (its
length minus one).
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: SDPA serves (rl_sglang.engine.layers.attend)
    triton = None

SPLITS = 8  # chunks per row and KV head (a power of two)
BLOCK_T = 32  # cache positions per inner iteration


def fused_decode_available(device: torch.device) -> bool:
    """True where the kernels run: CUDA with Triton (not ROCm, where they are untested)."""
    return triton is not None and device.type == "cuda" and torch.version.hip is None


def decode_attention(q_BQD, keys_SKTD, values_SKTD, positions_B) -> torch.Tensor:
    """Attention of ``q_BQD`` ``[B, Hq, D]`` over positions ``0..positions_B[i]`` of slot
    ``i``; ``[B, Hq * D]`` in the queries' dtype (what SDPA with the length mask returns)."""
    batch, num_heads, head_dim = q_BQD.shape
    num_kv = keys_SKTD.shape[1]
    parts = q_BQD.new_empty((batch, num_heads, SPLITS, head_dim), dtype=torch.float32)
    stats = q_BQD.new_empty((batch, num_heads, SPLITS, 2), dtype=torch.float32)
    out = q_BQD.new_empty((batch, num_heads * head_dim))
    block_d = triton.next_power_of_2(head_dim)
    _chunk_kernel[(batch, num_kv, SPLITS)](
        q_BQD,
        keys_SKTD,
        values_SKTD,
        positions_B,
        parts,
        stats,
        *q_BQD.stride(),
        *keys_SKTD.stride(),
        *values_SKTD.stride(),
        SCALE=head_dim**-0.5,  # a constant: a float argument reaches Inductor's kernels as fp64
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv,
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, block_d),
        BLOCK_T=BLOCK_T,
        SPLITS=SPLITS,
        PRECISION="ieee" if q_BQD.dtype == torch.float32 else "tf32",  # tf32: unused in bf16
    )
    _merge_kernel[(batch, num_heads)](
        parts, stats, out, HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=SPLITS
    )
    return out


if triton is not None:

    @triton.jit
    def _chunk_kernel(
        Q, K, V, Positions, Parts, Stats,
        sq_b, sq_h, sq_d, sk_s, sk_h, sk_t, sk_d, sv_s, sv_h, sv_t, sv_d,
        SCALE: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
        SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV head, chunk): the unnormalised output and (max, sum) per query
        head of the group; an empty chunk stores zeros and a max of -inf."""
        row, kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = row.to(tl.int64)  # slot offsets pass 2**31 elements in large caches
        length = tl.load(Positions + row).to(tl.int32) + 1
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_T) * BLOCK_T
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        heads = kv * GROUP + g
        head_ok, d_ok = g < GROUP, d < HEAD_DIM
        q = tl.load(
            Q + row * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d,
            mask=head_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_row, v_row = K + slot * sk_s + kv * sk_h, V + slot * sv_s + kv * sv_h
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < end
            mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_row + t[:, None] * sk_t + d[None, :] * sk_d, mask=mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = tl.where(t_ok[None, :], s * SCALE, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            p = tl.exp(s - new_top[:, None])
            keep = tl.exp(top - new_top)
            total = total * keep + tl.sum(p, 1)
            v = tl.load(v_row + t[:, None] * sv_t + d[None, :] * sv_d, mask=mask, other=0.0)
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            top = new_top
        at = (row * NUM_HEADS + heads) * SPLITS + split
        tl.store(Parts + at[:, None] * HEAD_DIM + d[None, :], acc, mask=head_ok[:, None] & d_ok)
        tl.store(Stats + at * 2, top, mask=head_ok)
        tl.store(Stats + at * 2 + 1, total, mask=head_ok)

    @triton.jit
    def _merge_kernel(
        Parts, Stats, Out, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr
    ):
        """One (row, query head): the chunks' outputs weighted by their softmax shares."""
        row, head = tl.program_id(0), tl.program_id(1)
        at = (row * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
        d = tl.arange(0, BLOCK_D)
        top = tl.load(Stats + at * 2)
        weight = tl.exp(top - tl.max(top, 0))  # an empty chunk (-inf) weighs nothing
        total = tl.sum(tl.load(Stats + at * 2 + 1) * weight, 0)
        parts = tl.load(Parts + at[:, None] * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM)
        out = tl.sum(parts * weight[:, None], 0) / total
        offset = (row * tl.num_programs(1) + head) * HEAD_DIM + d
        tl.store(Out + offset, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)
