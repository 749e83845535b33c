"""The layer spec: megatron's local (no Transformer Engine) GPT layer with two swaps (and
the additions of GLM-4 and DeepSeek-V3, see :func:`layer_spec`).

- Core attention: :class:`rl_megatron.attention.SDPAttention` (torch SDPA kernels).
- Norms: :class:`RMSNorm`, a ``torch.nn.RMSNorm`` that, unlike megatron's local
  ``WrappedTorchNorm``, accepts sequence parallel: under it each TP rank normalises part of
  the sequence, so its weight is marked ``sequence_parallel`` and its gradient is summed
  over TP ranks by :func:`rl_megatron.optim.tp_partial_params`.
"""

import functools

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        del unused  # persist_layer_norm, zero_centered_gamma, normalization: not applicable
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def block_spec(shape, num_layers: int, first_layer: int = 0):
    """``TransformerBlockSubmodules`` for this stage's ``num_layers`` layers, global layers
    ``first_layer`` on (DeepSeek-V3's first layers are dense), and the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from rl_megatron.families import is_moe_layer

    specs = [
        layer_spec(shape, moe=is_moe_layer(shape, index))
        for index in range(first_layer, first_layer + num_layers)
    ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def layer_spec(shape, *, moe: bool):
    """One layer's ``ModuleSpec``: megatron's local spec with this module's attention and
    norms; GLM-4's output norms; DeepSeek-V3's multi-latent attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rl_megatron.attention import SDPAttention

    mla = bool(shape.kv_lora_rank)
    if mla:
        _define_te_placeholders_for_mla()
    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts if moe else None,
        normalization="RMSNorm",
        qk_layernorm=shape.qk_norm or mla,
        multi_latent_attention=mla,
    )
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = SDPAttention
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    if mla:
        layer.self_attention.module = latent_attention_class()
        attention.q_layernorm = LatentRMSNorm
        attention.kv_layernorm = RMSNorm
    elif shape.qk_norm:
        attention.q_layernorm = RMSNorm
        attention.k_layernorm = RMSNorm
    if shape.post_norms:
        layer.self_attention.module = _with_output_norm(layer.self_attention.module)
        layer.mlp.module = _with_output_norm(layer.mlp.module)
    return spec


def _define_te_placeholders_for_mla() -> None:
    """megatron-core 0.16.1's MLA tests ``isinstance(linear_proj, TELinear)`` even when
    Transformer Engine is absent, where its import leaves mocks that ``isinstance``
    refuses: classes that no module is an instance of stand in for them."""
    from megatron.core.transformer import multi_latent_attention as mla

    for name in ("TELinear", "TEColumnParallelLinear"):
        if not isinstance(getattr(mla, name), type):
            setattr(mla, name, type(f"No{name}", (), {}))


@functools.cache
def latent_attention_class():
    """megatron's ``MLASelfAttention`` with :class:`LatentDownProjection` as the key/value
    down projection (megatron's local spec splits it over TP ranks by columns, and its
    gather then drops the other ranks' share of the rope key's gradient)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentAttention(MLASelfAttention):
        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            self.linear_kv_down_proj = LatentDownProjection(config)

    return LatentAttention


class LatentDownProjection(torch.nn.Module):
    """MLA's ``[hidden -> kv_lora_rank + rope]`` projection, whole on every TP rank.

    Each rank's heads use the whole rope key, so its gradient is a per-rank part: with
    sequence parallel megatron's sequence gather sums it (and the weight, which then saw
    part of the sequence, is marked ``sequence_parallel``); without it the rope channels
    pass through :class:`_SumGradOverTP`."""

    def __init__(self, config):
        super().__init__()
        out_size = config.kv_lora_rank + config.qk_pos_emb_head_dim
        self.weight = torch.nn.Parameter(
            torch.empty(out_size, config.hidden_size, dtype=config.params_dtype)
        )
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.rope_channels = config.qk_pos_emb_head_dim
        self.sum_rope_grad = not config.sequence_parallel and config.tensor_model_parallel_size > 1

    def forward(self, hidden):
        out = torch.nn.functional.linear(hidden, self.weight)
        if self.sum_rope_grad:
            latent, rope = out.split([out.shape[-1] - self.rope_channels, self.rope_channels], -1)
            out = torch.cat([latent, _SumGradOverTP.apply(rope)], dim=-1)
        return out, None


class _SumGradOverTP(torch.autograd.Function):
    """Identity whose gradient is summed over the TP group. megatron's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns
    ``grad``: a non-contiguous gradient (a slice of the cat above) would stay unsummed."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        summed = grad.contiguous()
        dist.all_reduce(summed, group=ps.get_tensor_model_parallel_group())
        return summed


class LatentRMSNorm(RMSNorm):
    """MLA's norm of the query latent, which every TP rank computes whole (the down
    projection's output is gathered): its gradient is not a per-rank part, unlike the
    per-head q/k norms', and is not summed over TP (see optim.tp_partial_params)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config, hidden_size, eps=eps, **unused)
        self.weight.whole_on_every_tp_rank = True


@functools.cache
def _with_output_norm(module_class):
    """``module_class`` (attention or MLP, returning ``(output, bias)``) followed by an
    RMSNorm of its output, ``post_layernorm``: GLM-4's norms before each residual add."""

    class WithOutputNorm(module_class):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_layernorm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            assert bias is None, "GLM-4's projections have no output bias"
            return self.post_layernorm(output), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """megatron's MLP asks every child for its own sharded state dict, which a
            torch norm has not: the norm's entries come from megatron's default instead."""
            from megatron.core.transformer.utils import sharded_state_dict_default

            norm = self._modules.pop("post_layernorm")
            try:
                state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self._modules["post_layernorm"] = norm
            name = f"{prefix}post_layernorm."
            return state | sharded_state_dict_default(norm, name, sharded_offsets, metadata)

    WithOutputNorm.__name__ = f"{module_class.__name__}WithOutputNorm"
    return WithOutputNorm
