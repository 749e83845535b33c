"""Build a megatron-core ``GPTModel`` from a Hugging Face config (the families of
:mod:`rl_megatron.shape`).

The local layer spec is used (megatron-core modules only, no Transformer Engine), with
SDPA attention and sequence-parallel-capable norms (:mod:`rl_megatron.layers`). Parameters are created
directly in their tensor-parallel shard on this rank (``use_cpu_initialization``) in
``dtype``: float32, or bfloat16 for mixed precision (fp32 main gradients and master
weights then live in :mod:`rl_megatron.precision`; no autocast anywhere).

Vocabulary is padded to a multiple of ``128 · tp`` as Megatron does; the padding rows are
masked out of every softmax. Scaled rope types (``linear``, ``llama3``: Llama 3.1+) get
HF's inverse frequencies in megatron's rotary embedding.
"""

import torch

from rl_megatron.families import mla_config_kwargs, note_ignored_mtp
from rl_megatron.layout import param_layout
from rl_megatron.moe import moe_config_kwargs
from rl_megatron.qkv_rotary import use_fused_qkv_rotary
from rl_megatron.rotary import use_cos_sin_table
from rl_megatron.shape import model_shape, rope_parameters


def rotary_inv_freq(hf_config) -> torch.Tensor | None:
    """HF's inverse rotary frequencies ``[head_dim / 2]`` float32 for a scaled rope type
    (``linear``, ``llama3``), None for ``default`` (megatron computes the same itself)."""
    params = rope_parameters(hf_config)
    if params["rope_type"] == "default" or model_shape(hf_config).kv_lora_rank:
        return None  # megatron computes it (MLA: in each attention, default or YaRN)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu")
    assert attention_factor == 1.0, params  # static rope types scale no attention
    return inv_freq.float()


def transformer_config(
    hf_config,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    cp_size: int = 1,
    pp_size: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    swiglu_fusion: bool = False,
    options: dict | None = None,
):
    """The megatron ``TransformerConfig`` equivalent of ``hf_config`` (``dtype`` parameters;
    ``swiglu_fusion``: megatron's compiled SwiGLU, see :mod:`rl_megatron.fusions`), with
    ``options`` (other TransformerConfig fields, checked by
    :func:`rl_megatron.options.split_options`: activation recompute, ...) added."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    shape = model_shape(hf_config, tp_size=tp_size)
    defaults = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=cp_size,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=dtype,  # the residual stream's dtype, sent between stages
        bf16=dtype == torch.bfloat16,
        # variable_seq_lengths stays False: it only makes megatron's own p2p exchange shapes,
        # and rl_megatron.pipeline sends data only (every stage knows the shapes); megatron
        # would refuse the allgather MoE dispatcher (EP's here) with it
        calculate_per_token_loss=True,  # the loss already carries global denominators
        sequence_parallel=sequence_parallel and tp_size > 1,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=swiglu_fusion,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        rotary_interleaved=shape.rotary_interleaved,
        **moe_config_kwargs(shape, ep_size=ep_size),
    )
    mla = mla_config_kwargs(shape, rope_parameters(hf_config))
    config_class = MLATransformerConfig if mla else TransformerConfig
    return config_class(**(defaults | mla | (options or {})))


def build_gpt_model(
    hf_config,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    cp_size: int = 1,
    pp_size: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    swiglu_fusion: bool = False,
    options: dict | None = None,
    vp_stage: int | None = None,
    rotary_table: bool = True,
    fused_qkv_rotary: bool = True,
    attention_backends: str = "auto",
):
    """A ``GPTModel`` shard for this rank; weights uninitialised (load them with
    :func:`rl_megatron.weights.load_hf_weights`); ``options`` as in :func:`transformer_config`.
    ``vp_stage``: which of this stage's model chunks (``options`` then sets
    ``virtual_pipeline_model_parallel_size``): its layers, embedding and head follow.
    ``rotary_table``: rotary embedding from a cos/sin table (:mod:`rl_megatron.rotary`);
    ``fused_qkv_rotary``: queries and keys rotated straight from the q/k/v projection
    (:mod:`rl_megatron.qkv_rotary`, where the table serves); ``attention_backends``: the
    SDPA kernels core attention may use (:data:`rl_megatron.attention.KERNELS`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rl_megatron.attention import set_attention_backends
    from rl_megatron.layers import block_spec

    shape = model_shape(hf_config, tp_size=tp_size)
    note_ignored_mtp(shape.mtp_layers)
    config = transformer_config(
        hf_config,
        tp_size=tp_size,
        ep_size=ep_size,
        cp_size=cp_size,
        pp_size=pp_size,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        swiglu_fusion=swiglu_fusion,
        options=options,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            shape,
            get_num_layers_to_build(config, vp_stage=vp_stage),
            get_transformer_layer_offset(config, vp_stage),
        ),
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=_first_stage(pp_size) and not vp_stage,
        post_process=_last_stage(pp_size) and _last_chunk(config, vp_stage),
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_parameters(hf_config)["rope_theta"],
        rotary_percent=shape.rotary_percent,
    )
    inv_freq = rotary_inv_freq(hf_config)
    if inv_freq is not None:  # before any forward: megatron caches the rotary table
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    if rotary_table:
        use_cos_sin_table(model)
    if fused_qkv_rotary:
        use_fused_qkv_rotary(model)
    set_attention_backends(model, attention_backends)
    _mark_tensor_parallel(model)
    return model


def _first_stage(pp_size: int) -> bool:
    from megatron.core import parallel_state as ps

    return pp_size == 1 or ps.is_pipeline_first_stage()


def _last_stage(pp_size: int) -> bool:
    from megatron.core import parallel_state as ps

    return pp_size == 1 or ps.is_pipeline_last_stage()


def _last_chunk(config, vp_stage: int | None) -> bool:
    return vp_stage is None or vp_stage == config.virtual_pipeline_model_parallel_size - 1


def _mark_tensor_parallel(model) -> None:
    """Set ``tensor_model_parallel`` on every TP-sharded parameter (megatron sets it only
    when it initialises the weights itself, which this builder skips)."""
    for name, param in model.named_parameters():
        sharded = param_layout(name).kind != "replicated"
        if not hasattr(param, "tensor_model_parallel"):
            param.tensor_model_parallel = sharded


class ValueHead(torch.nn.Module):
    """A critic's head in place of ``GPTModel.output_layer``: hidden ``[s, b, h]`` ->
    values ``[s, b, 1]``. Replicated on every TP rank; starts at zero (values 0)."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool = False, dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        del weight, runtime_gather_output  # the LM head's arguments, unused by a value head
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; every rank then holds all
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None


def build_critic_model(hf_config, *, dtype: torch.dtype = torch.float32, **layout):
    """A ``GPTModel`` whose LM head is a :class:`ValueHead` (outputs ``[b, s, 1]``; with
    pipeline stages, on the last one); ``layout``: the other keywords of
    :func:`build_gpt_model`."""
    import copy

    untied = copy.deepcopy(hf_config)
    untied.tie_word_embeddings = False
    model = build_gpt_model(untied, dtype=dtype, **layout)
    if model.post_process:  # the last pipeline stage (every rank without pp)
        model.output_layer = ValueHead(
            hf_config.hidden_size, sequence_parallel=model.config.sequence_parallel, dtype=dtype
        )
    return model
