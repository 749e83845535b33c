"""Which HF tensors make each Megatron parameter, and how it is split over TP ranks.

Every Megatron parameter of a GPT model gets one :class:`ParamLayout`: its HF source names
and a ``kind`` saying how the HF tensors fuse and shard:

- ``replicated``: same tensor on every TP rank (norms, qk-norms).
- ``column`` / ``row``: split along dim 0 / dim 1 (ColumnParallel / RowParallel linears).
- ``vocab``: split along dim 0 after padding the vocabulary with zero rows.
- ``qkv``: Q, K, V fused in Megatron's per-query-group order — for each KV group g:
  ``[q heads of g (heads/groups · head_dim rows), k_g (head_dim), v_g (head_dim)]`` — so a
  rank's shard is a contiguous run of whole groups (GQA falls out of the same rule).
- ``gate_up``: ``[gate shard; up shard]`` per rank (the gated MLP's fused fc1).
- ``fused_gate_up``: the same from one HF tensor ``[gate; up]`` (GLM-4's ``gate_up_proj``).

MoE experts (``expert=True``) use the same kinds over the expert-TP group, and local expert
e of EP rank r is HF expert ``r · experts_per_rank + e``; the router is replicated.

Names follow megatron's local spec and also Transformer Engine's fused-norm names.
"""

import re
from dataclasses import dataclass

from rl_megatron.shape import ModelShape


@dataclass(frozen=True)
class ParamLayout:
    kind: str
    hf_names: tuple[str, ...]
    expert: bool = False  # sharded over the expert-TP group, one expert per EP rank slice


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")

# Megatron suffix inside a layer -> (kind, HF suffixes inside model.layers.{i}).
_LAYER_PARAMS = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
    # GLM-4's output norms (rl_megatron.layers)
    "self_attention.post_layernorm.weight": ("replicated", ("post_self_attn_layernorm.weight",)),
    "mlp.post_layernorm.weight": ("replicated", ("post_mlp_layernorm.weight",)),
    # DeepSeek-V3: multi-latent attention, shared experts, the router's expert bias (a buffer)
    "self_attention.linear_q_proj.weight": ("column", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("column", ("self_attn.q_a_proj.weight",)),
    "self_attention.linear_q_up_proj.weight": ("column", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": (  # whole on every rank (rl_megatron.layers)
        "replicated",
        ("self_attn.kv_a_proj_with_mqa.weight",),
    ),
    "self_attention.kv_layernorm.weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("column", ("self_attn.kv_b_proj.weight",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    ),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_experts.down_proj.weight",)),
    "mlp.router.expert_bias": ("replicated", ("mlp.gate.e_score_correction_bias",)),
}

# Where a family gives a megatron name other HF sources (ModelShape field -> entries).
_FAMILY_PARAMS = {
    "kv_lora_rank": {
        "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_a_layernorm.weight",))
    },
    "fused_gate_up": {"mlp.linear_fc1.weight": ("fused_gate_up", ("mlp.gate_up_proj.weight",))},
}
# Buffers that HF saves with the weights (loaded and exported like parameters).
HF_BUFFERS = ("mlp.router.expert_bias",)

_TOP_PARAMS = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
}


def param_layout(
    name: str, *, layer_offset: int = 0, expert_offset: int = 0, shape: ModelShape | None = None
) -> ParamLayout:
    """Layout of megatron parameter ``name``; ``layer_offset`` maps local layer indices of a
    pipeline stage to global HF layer numbers, ``expert_offset`` local experts of an EP rank
    to global expert numbers; ``shape`` picks a family's own sources (GLM-4's fused gate/up,
    MLA's query-latent norm)."""
    if name in _TOP_PARAMS:
        kind, hf = _TOP_PARAMS[name]
        return ParamLayout(kind, hf)
    match = _LAYER.fullmatch(name)
    if match is None:
        raise ValueError(f"no HF mapping for megatron parameter {name!r}")
    prefix = f"model.layers.{int(match.group(1)) + layer_offset}"
    expert = _EXPERT.fullmatch(match.group(2))
    if expert is not None:
        hf_expert = f"{prefix}.mlp.experts.{int(expert.group(1)) + expert_offset}"
        if expert.group(2) == "linear_fc1":
            names = (f"{hf_expert}.gate_proj.weight", f"{hf_expert}.up_proj.weight")
            return ParamLayout("gate_up", names, expert=True)
        return ParamLayout("row", (f"{hf_expert}.down_proj.weight",), expert=True)
    params = _layer_params(shape)
    if match.group(2) not in params:
        raise ValueError(f"no HF mapping for megatron parameter {name!r}")
    kind, suffixes = params[match.group(2)]
    return ParamLayout(kind, tuple(f"{prefix}.{s}" for s in suffixes))


def _layer_params(shape: ModelShape | None) -> dict:
    params = dict(_LAYER_PARAMS)
    for field, entries in _FAMILY_PARAMS.items():
        if shape is not None and getattr(shape, field):
            params.update(entries)
    return params


def is_hf_buffer(name: str) -> bool:
    """Whether megatron buffer ``name`` holds a tensor of the HF checkpoint."""
    return name.endswith(HF_BUFFERS)


def qkv_rows(shape: ModelShape, group: int) -> tuple[slice, slice]:
    """Rows of the HF q and k/v tensors that belong to KV group ``group``."""
    q_per_group = shape.num_heads // shape.num_kv_heads * shape.head_dim
    kv = slice(group * shape.head_dim, (group + 1) * shape.head_dim)
    return slice(group * q_per_group, (group + 1) * q_per_group), kv


def shard_range(size: int, tp_size: int, tp_rank: int) -> slice:
    """Rank ``tp_rank``'s contiguous part of a dimension of ``size`` (must divide)."""
    if size % tp_size:
        raise ValueError(f"dimension {size} does not split into {tp_size} equal TP shards")
    part = size // tp_size
    return slice(tp_rank * part, (tp_rank + 1) * part)
