"""Rotary of queries and keys straight from the fused q/k/v projection, one pass each way
(``MegatronConfig.fused_qkv_rotary``).

megatron's attention splits ``mixed [s, b, g, (q_per_group + 2) · d]`` (each query group's
query heads, key and value) into strided views and rotates the queries and keys into new
tensors. Compiled, that was one Inductor kernel forward and one backward per layer; on the
1.5B shape (an H200, 2026-11-27) they took 0.27 and 0.23 ms a layer, about 16 times their
bytes at the GPU's bandwidth (13.9 ms of a 181 ms step).

With :func:`use_fused_qkv_rotary` megatron takes its own ``fused_single_qkv_rope`` path
(made for Transformer Engine's fused kernel, which is not installed here): it hands the
unsplit ``mixed`` and the rotary table to :func:`rotate_qkv`, which on CUDA in 16-bit
dtypes is one Triton kernel (:mod:`rl_megatron._triton_qkv_rotary`) reading ``mixed`` once
and writing contiguous q, k and v, and one kernel back writing the gradient of ``mixed``;
a custom op, so that the compiled layers call it as it is. Elsewhere (CPU, float32) it is
megatron's split and :func:`rl_megatron.rotary.apply_rotary_from_table`, the ops the
unfused path runs. The kernels round as eager torch does, op by op, so the values are the
torch path's to the bit (the compiled path's own kernel kept float32 between the multiply
and the add: the last bit of bf16 may differ from it).

It serves what the cos/sin table serves (plain rope, padded rows) without q/k norms
(megatron's fused path has none), without interleaved rope (megatron passes no rope
settings to the fused function) and with at least as many query groups as TP ranks:
:func:`fused_applies`. The kernels show in profiles as ``_qkv_rotary_forward_kernel`` and
``_qkv_rotary_backward_kernel``.
"""

import functools

import torch

from rl_megatron.rotary import TABLE_DIMS, apply_rotary_from_table

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def fused_applies(model) -> bool:
    """Whether :func:`use_fused_qkv_rotary` can serve ``model`` (a megatron ``GPTModel``
    whose rotary embedding returns the cos/sin table)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    config = model.config
    table = getattr(getattr(rotary, "forward", None), "makes_cos_sin_table", False)
    # fewer query groups than TP ranks: megatron's split picks each rank's queries itself
    split_groups = config.num_query_groups < config.tensor_model_parallel_size
    return table and not (config.qk_layernorm or config.rotary_interleaved or split_groups)


def use_fused_qkv_rotary(model) -> bool:
    """Route ``model``'s self-attention through :func:`rotate_qkv` (module docstring).
    Returns whether it did (False where :func:`fused_applies` is not). Idempotent."""
    if not fused_applies(model):
        return False
    _route_megatron_fused_rope()
    model.config.fused_single_qkv_rope = True
    return True


def split_and_rotate(mixed: torch.Tensor, table: torch.Tensor, q_per_group: int):
    """megatron's split of ``mixed [s, b, g, (q_per_group + 2)·d]`` into ``q [s, b,
    g·q_per_group, d]``, ``k`` and ``v [s, b, g, d]`` (views), then the table rotary of q
    and k: the reference the kernels equal."""
    head_dim = mixed.shape[-1] // (q_per_group + 2)
    query, key, value = torch.split(mixed, [q_per_group * head_dim, head_dim, head_dim], dim=3)
    query = query.reshape(query.shape[0], query.shape[1], -1, head_dim)
    query = apply_rotary_from_table(query, table, interleaved=False)
    return query, apply_rotary_from_table(key, table, interleaved=False), value


def rotate_qkv(mixed: torch.Tensor, table: torch.Tensor, q_per_group: int):
    """``(q, k, v)`` of :func:`split_and_rotate`: the Triton kernels on CUDA in 16-bit
    dtypes (q, k, v contiguous), the torch ops elsewhere; the same values."""
    if kernel_serves(mixed):
        table = table.to(mixed.dtype).contiguous()
        return torch.ops.rl_megatron.qkv_rotary(_dense_heads(mixed), table, q_per_group)
    return split_and_rotate(mixed, table, q_per_group)


def kernel_serves(mixed: torch.Tensor) -> bool:
    return mixed.is_cuda and mixed.dtype in KERNEL_DTYPES


def _dense_heads(mixed: torch.Tensor) -> torch.Tensor:
    """``mixed`` itself where its last two dims are dense (the projection's output), else a
    contiguous copy (the kernel indexes heads by ``slot · d``)."""
    dense = mixed.stride(3) == 1 and mixed.stride(2) == mixed.shape[3]
    return mixed if dense else mixed.contiguous()


@torch.library.custom_op("rl_megatron::qkv_rotary", mutates_args=())
def _qkv_rotary(
    mixed: torch.Tensor, table: torch.Tensor, q_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from rl_megatron._triton_qkv_rotary import rotate_qkv as kernel

    return kernel(mixed, table, q_per_group)


@_qkv_rotary.register_fake
def _(mixed, table, q_per_group):
    seq, batch, groups, width = mixed.shape
    head_dim = width // (q_per_group + 2)
    key = mixed.new_empty(seq, batch, groups, head_dim)
    return mixed.new_empty(seq, batch, groups * q_per_group, head_dim), key, torch.empty_like(key)


@torch.library.custom_op("rl_megatron::qkv_rotary_backward", mutates_args=())
def _qkv_rotary_backward(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    table: torch.Tensor,
    q_per_group: int,
) -> torch.Tensor:
    from rl_megatron._triton_qkv_rotary import rotate_qkv_backward as kernel

    return kernel(grad_q, grad_k, grad_v, table, q_per_group)


@_qkv_rotary_backward.register_fake
def _(grad_q, grad_k, grad_v, table, q_per_group):
    seq, batch, groups, head_dim = grad_k.shape
    return grad_k.new_empty(seq, batch, groups, (q_per_group + 2) * head_dim)


def _setup_context(ctx, inputs, output):
    _, table, q_per_group = inputs
    ctx.save_for_backward(table)
    ctx.q_per_group = q_per_group
    ctx.shapes = [out.shape for out in output]  # for the zero gradient of an unused output


def _backward(ctx, *grads):
    (table,) = ctx.saved_tensors
    grads = [
        table.new_zeros(shape) if grad is None else grad
        for grad, shape in zip(grads, ctx.shapes, strict=True)
    ]
    grad_mixed = torch.ops.rl_megatron.qkv_rotary_backward(*grads, table, ctx.q_per_group)
    return grad_mixed, None, None


_qkv_rotary.register_autograd(_backward, setup_context=_setup_context)


@functools.cache
def _route_megatron_fused_rope() -> None:
    """megatron's attention, with ``config.fused_single_qkv_rope``, hands the unsplit
    projection output to :func:`rotate_qkv` (its fused path otherwise needs Transformer
    Engine)."""
    from megatron.core.transformer import attention

    def apply_fused_qkv_rotary_pos_emb(mixed_qkv, q_freqs, k_freqs, qkv_split_arg_list):
        assert q_freqs.dim() == TABLE_DIMS, (
            "the fused q/k/v rotary takes the cos/sin table (rl_megatron.rotary)"
        )
        q_width, head_dim, _ = qkv_split_arg_list
        return rotate_qkv(mixed_qkv, q_freqs, q_width // head_dim)

    attention.apply_fused_qkv_rotary_pos_emb = apply_fused_qkv_rotary_pos_emb
    attention.HAVE_FUSED_QKV_ROPE = True
