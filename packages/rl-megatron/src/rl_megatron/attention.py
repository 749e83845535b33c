"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``, with
context parallelism by all-gathering keys and values.

A drop-in for megatron's local ``DotProductAttention`` (same constructor arguments, same
``[s, b, heads, head_dim]`` inputs and ``[s, b, heads · head_dim]`` output) that lets torch
pick a fused kernel (flash / memory-efficient on GPU) instead of materialising the fp32
``[b, heads, s, s]`` score tensor. GQA is handled by SDPA's ``enable_gqa``.

Context parallel (cp > 1): each rank holds the zigzag chunks r and 2·cp-1-r of every row
(:mod:`rl_core.cp`; megatron's rotary embedding uses the same layout). Keys and values are
all-gathered and put back in sequence order, and the causal mask compares the original
positions of this rank's queries with all key positions. Exact; memory of K/V is full length.

Kernels (``MegatronConfig.attention_backends``, :data:`KERNELS`): "auto" leaves
the pick to SDPA, which on Hopper tries cuDNN's fused attention first; cuDNN builds an
execution plan for every new input shape (58-93 ms on an H100, forward and backward each,
0.2-0.3 ms once built), and RL micro-batches change shape from step to step. "no_cudnn"
restricts SDPA to flash / memory-efficient / math (flash: 3 ms the first call of a shape).
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from rl_core.cp import zigzag_gather, zigzag_positions

# MegatronConfig.attention_backends -> the SDPA kernels allowed (None: SDPA's own choice)
KERNELS = {
    "auto": None,
    "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


class SDPAttention(MegatronModule):
    """Megatron core attention computed by torch SDPA (no dropout, no attention bias)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        del layer_number, attn_mask_type, attention_type, attention_dropout, cp_comm_type
        del k_channels, v_channels  # MLA's head sizes: SDPA reads them off the tensors
        self.softmax_scale = softmax_scale or config.kv_channels**-0.5
        self.cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state as ps

            self.cp_group = pg_collection.cp if pg_collection else ps.get_context_parallel_group()
        self.kernels = None  # SDPA's choice; set_attention_backends restricts it

    def _allowed_kernels(self):
        """The :data:`KERNELS` restriction (traced by dynamo without a graph
        break: a compiled layer bakes the kernel picked under it into its graph)."""
        return contextlib.nullcontext() if self.kernels is None else sdpa_kernel(self.kernels)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes padded rows, not packed_seq_params or a bias")
        allowed = None if attention_mask is None else ~attention_mask
        if self.cp_group is not None:
            key, value, allowed = _gather_context(key, value, self.cp_group)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if allowed is not None and k.shape[1] != q.shape[1]:  # fused masked kernels want MHA
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        with self._allowed_kernels():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                is_causal=allowed is None,
                scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def set_attention_backends(model: torch.nn.Module, name: str) -> int:
    """Restrict every :class:`SDPAttention` of ``model`` to the kernels of
    :data:`KERNELS` ``[name]``; returns how many modules were set."""
    if name not in KERNELS:
        raise ValueError(f"attention_backends must be one of {', '.join(KERNELS)}, got {name!r}")
    modules = [m for m in model.modules() if isinstance(m, SDPAttention)]
    for module in modules:
        module.kernels = KERNELS[name]
    return len(modules)


def _gather_context(key, value, group):
    """Full-length K/V ``[L, b, g, d]`` in sequence order and the causal mask
    ``[s_local, L]`` (True = may attend) of this rank's zigzag queries."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    keys = zigzag_gather(_AllGather.apply(key, group), dim=0)
    values = zigzag_gather(_AllGather.apply(value, group), dim=0)
    length = keys.shape[0]
    q_pos = zigzag_positions(length, cp_size=cp_size, cp_rank=cp_rank).to(key.device)
    allowed = q_pos[:, None] >= torch.arange(length, device=key.device)[None, :]
    return keys, values, allowed


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 returning every rank's shard; the backward sums the
    gradient over ranks (all-reduce, which gloo supports) and keeps this rank's part."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, shard.contiguous(), group=group)
        return tuple(shards)

    @staticmethod
    def backward(ctx, *grads):
        rank = dist.get_rank(ctx.group)
        mine = [g if g is not None else torch.zeros(()) for g in grads]
        total = torch.stack([torch.zeros_like(mine[rank]) + g for g in mine])
        dist.all_reduce(total, group=ctx.group)
        return total[rank], None
