"""The layer spec: megatron's local (no Transformer Engine) GPT layer with two swaps.

- Core attention: :class:`rl_megatron.attention.SDPAttention` (torch SDPA kernels).
- Norms: :class:`RMSNorm`, a ``torch.nn.RMSNorm`` that, unlike megatron's local
  ``WrappedTorchNorm``, accepts sequence parallel: under it each TP rank normalises part of
  the sequence, so its weight is marked ``sequence_parallel`` and its gradient is summed
  over TP ranks by :func:`rl_megatron.optim.tp_partial_params`.
"""

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        del unused  # persist_layer_norm, zero_centered_gamma, normalization: not applicable
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def block_spec(shape, num_layers: int):
    """``TransformerBlockSubmodules`` for this stage's ``num_layers`` identical layers and the
    final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from rl_megatron.attention import SDPAttention

    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None, normalization="RMSNorm", qk_layernorm=shape.qk_norm
    )
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = SDPAttention
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    if shape.qk_norm:
        layer.self_attention.submodules.q_layernorm = RMSNorm
        layer.self_attention.submodules.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=RMSNorm)
