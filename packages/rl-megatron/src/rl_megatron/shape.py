"""What rl-megatron reads from a Hugging Face config: the family check and :class:`ModelShape`.

Pure Python over the transformers config (no megatron import), shared by the model builder
(:mod:`rl_megatron.models`), the weight layout (:mod:`rl_megatron.layout`) and the
converters, so none of them imports another to learn the shape.

Families (by ``model_type``): ``qwen2`` (qkv bias), ``qwen3`` (qk RMSNorm, explicit
head_dim), ``llama`` (optional attention bias; rope ``default``, ``linear`` or ``llama3``),
``mistral`` (Llama's layout; full attention only), ``qwen3_moe`` (qk-norm and experts, see
:mod:`rl_megatron.moe`), ``glm4`` and ``deepseek_v3`` (see :mod:`rl_megatron.families`). Others, and features these layers do not compute (sliding windows,
rope types whose frequencies depend on the length), are refused with a ValueError that
names the family, what is missing, and the FSDP backend as the way out.
"""

from dataclasses import dataclass

from rl_megatron.families import shape_fields
from rl_megatron.moe import moe_fields

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "glm4", "deepseek_v3")
VOCAB_MULTIPLE = 128
# Rope types whose inverse frequencies are fixed and whose attention scale is 1: megatron's
# rotary embedding takes them as a precomputed ``inv_freq`` (see models.rotary_inv_freq).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
# Rope types a family's own attention computes (DeepSeek-V3's MLA builds megatron's YaRN).
FAMILY_ROPE_TYPES = {"deepseek_v3": ("default", "yarn")}
# Families users bring that the local layer spec cannot reproduce, and why.
_UNSUPPORTED = {
    "gemma": "scaled embeddings, (1 + weight) RMSNorm and a GeLU MLP",
    "gemma2": "attention/final logit softcapping, sandwich norms and sliding-window layers",
    "gemma3_text": "sandwich norms, sliding-window layers with their own rope base",
    "gemma3": "a vision tower and sandwich norms",
}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the converters need to know about the HF architecture."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = False
    # GLM-4 and DeepSeek-V3 (rl_megatron.families)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs
    fused_gate_up: bool = False  # HF holds the MLP's gate and up in one tensor
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    q_lora_rank: int = 0  # multi-latent attention when kv_lora_rank > 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    shared_ffn_hidden_size: int = 0
    first_dense_layers: int = 0
    router_score: str = "softmax"
    router_groups: int = 0
    router_group_topk: int = 0
    routed_scaling: float | None = None
    mtp_layers: int = 0


def check_family(hf_config) -> str:
    """The config's ``model_type`` if this backend computes it exactly; ValueError naming
    the family and what is not supported otherwise."""
    family = hf_config.model_type
    if family in _UNSUPPORTED:
        raise ValueError(
            f"rl-megatron: {family} ({_UNSUPPORTED[family]}) is not supported; use the FSDP backend"
        )
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"rl-megatron: model_type {family!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}); use the FSDP backend"
        )
    window = _active_sliding_window(hf_config)
    if window is not None:
        raise ValueError(
            f"rl-megatron: {family} with sliding-window attention (sliding_window={window}) "
            "is not supported (attention here is full causal); use the FSDP backend, or a "
            "config with sliding_window null"
        )
    _check_mlp(hf_config)
    rope_parameters(hf_config)  # refuses rope types megatron cannot take
    return family


def _active_sliding_window(hf_config) -> int | None:
    """The window when some layer attends through one shorter than the context."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None  # Qwen configs carry a window that no layer uses
    if window is None or window >= hf_config.max_position_embeddings:
        return None
    return window


def _check_mlp(hf_config) -> None:
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation != "silu" or getattr(hf_config, "mlp_bias", False):
        raise ValueError(
            f"rl-megatron: {hf_config.model_type} with a {activation} MLP"
            f"{' with bias' if getattr(hf_config, 'mlp_bias', False) else ''} is not supported "
            "(only SwiGLU without bias); use the FSDP backend"
        )


def rope_parameters(hf_config) -> dict:
    """``{"rope_type", "rope_theta", ...}`` from either the transformers 4 or the 5 config
    layout; ValueError for rope types megatron's rotary embedding cannot take."""
    params = dict(
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    rope_type = params.get("rope_type", params.get("type", "default"))
    family_types = FAMILY_ROPE_TYPES.get(hf_config.model_type)
    if rope_type not in (family_types or STATIC_ROPE_TYPES):
        raise ValueError(
            f"rl-megatron: {hf_config.model_type} with rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(family_types or STATIC_ROPE_TYPES)}); use the FSDP backend"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return {**params, "rope_type": rope_type, "rope_theta": float(theta or 10000.0)}


def model_shape(hf_config, *, tp_size: int = 1) -> ModelShape:
    """Read a transformers config (``Qwen2Config`` etc.) into a :class:`ModelShape`."""
    family = check_family(hf_config)
    heads = hf_config.num_attention_heads
    fields = dict(
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        **moe_fields(hf_config),
    )
    fields.update(shape_fields(hf_config, rope_parameters(hf_config), tp_size=tp_size))
    kv_heads = fields["num_kv_heads"]
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tp={tp_size} must divide both attention heads ({heads}) and kv heads ({kv_heads})"
        )
    multiple = VOCAB_MULTIPLE * tp_size
    return ModelShape(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=heads,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=-(-hf_config.vocab_size // multiple) * multiple,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        **fields,
    )
