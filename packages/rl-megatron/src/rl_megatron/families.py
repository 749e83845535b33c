"""GLM-4 and DeepSeek-V3: what they add to the Llama layout, as :class:`ModelShape`
fields and megatron config arguments, and what of them these layers do not compute
(refused with a ValueError naming it and the FSDP backend as the way out).

- GLM-4 (``glm4``): an RMSNorm on the attention output and another on the MLP output,
  each before its residual add (``post_norms``); gate and up fused in one HF tensor
  ``mlp.gate_up_proj``; rope on the first ``partial_rotary_factor`` of each head's
  channels in interleaved pairs (megatron's ``rotary_percent`` / ``rotary_interleaved``).
- DeepSeek-V3 (``deepseek_v3``): multi-latent attention (megatron's ``MLASelfAttention``;
  its rope de-interleaves the decoupled rope channels as HF's ``rope_interleave`` does),
  ``first_k_dense_replace`` dense layers, then MoE layers with shared experts and
  megatron's sigmoid router: ``e_score_correction_bias`` as its expert bias (not updated:
  the RL loss is the whole objective), group-limited top-k, ``routed_scaling_factor``.
  Multi-token-prediction layers are not built; their weights are ignored on load.

Pure Python over the transformers config, like :mod:`rl_megatron.shape`.
"""

import functools
import logging

logger = logging.getLogger(__name__)


def _refuse(hf_config, what: str) -> ValueError:
    return ValueError(
        f"rl-megatron: {hf_config.model_type} with {what} is not supported; use the FSDP backend"
    )


def glm4_fields(hf_config, rope: dict) -> dict:
    """ModelShape fields of a GLM-4 config (``rope``: :func:`shape.rope_parameters`)."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    fraction = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if int(head_dim * fraction) % 2:
        raise _refuse(hf_config, f"an odd number of rotary channels ({head_dim} x {fraction})")
    return {
        "post_norms": True,
        "fused_gate_up": True,
        "rotary_percent": float(fraction),
        "rotary_interleaved": True,
    }


def deepseek_fields(hf_config, rope: dict) -> dict:
    """ModelShape fields of a DeepSeek-V3 config: MLA sizes and the MoE router."""
    _check_deepseek(hf_config, rope)
    topk, groups, group_topk = (
        hf_config.num_experts_per_tok,
        hf_config.n_group or 1,
        hf_config.topk_group or 1,
    )
    limited = group_topk < groups  # otherwise every group is kept: plain top-k
    dense = min(hf_config.first_k_dense_replace or 0, hf_config.num_hidden_layers)
    moe = dense < hf_config.num_hidden_layers  # else no layer has experts
    return {
        "num_kv_heads": hf_config.num_attention_heads,
        "head_dim": hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim,
        "q_lora_rank": hf_config.q_lora_rank or 0,
        "kv_lora_rank": hf_config.kv_lora_rank,
        "qk_nope_head_dim": hf_config.qk_nope_head_dim,
        "qk_rope_head_dim": hf_config.qk_rope_head_dim,
        "v_head_dim": hf_config.v_head_dim,
        "num_experts": hf_config.n_routed_experts if moe else 0,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_topk": topk,
        "norm_topk_prob": bool(hf_config.norm_topk_prob),
        "shared_ffn_hidden_size": hf_config.moe_intermediate_size * hf_config.n_shared_experts,
        "first_dense_layers": dense,
        "router_score": "sigmoid",
        "router_groups": groups if limited else 0,
        "router_group_topk": group_topk if limited else 0,
        "routed_scaling": float(hf_config.routed_scaling_factor),
        "mtp_layers": getattr(hf_config, "num_nextn_predict_layers", 0) or 0,
    }


def _check_deepseek(hf_config, rope: dict) -> None:
    """Refuse what megatron's MLA and sigmoid router compute differently from HF."""
    _check_yarn(hf_config, rope)
    if not getattr(hf_config, "rope_interleave", True):
        raise _refuse(hf_config, "rope_interleave false (megatron's MLA rope de-interleaves)")
    if hf_config.attention_bias:
        raise _refuse(hf_config, "attention_bias true (megatron's MLA projections have none)")
    topk = hf_config.num_experts_per_tok
    if not hf_config.norm_topk_prob and topk > 1:
        raise _refuse(
            hf_config, "norm_topk_prob false (megatron's sigmoid router renormalises the top-k)"
        )
    groups, group_topk = hf_config.n_group or 1, hf_config.topk_group or 1
    if group_topk < groups and topk // group_topk != 2:
        raise _refuse(
            hf_config,
            f"num_experts_per_tok // topk_group = {topk // group_topk} (groups are scored by "
            "their top 2 experts in HF, by their top num_experts_per_tok // topk_group here)",
        )


def _check_yarn(hf_config, rope: dict) -> None:
    """Refuse YaRN settings where megatron's YaRN scales attention otherwise than HF's."""
    if rope["rope_type"] != "yarn":
        return
    if rope.get("attention_factor") is not None:
        raise _refuse(hf_config, "a YaRN attention_factor (megatron derives it from mscale)")
    if not rope.get("truncate", True):
        raise _refuse(hf_config, "YaRN truncate false (megatron rounds the correction range)")
    if not rope.get("mscale") and rope.get("mscale_all_dim"):
        raise _refuse(hf_config, "YaRN mscale_all_dim without mscale")


def shape_fields(hf_config, rope: dict, *, tp_size: int = 1) -> dict:
    """The family's ModelShape fields ({} for the Llama-layout families)."""
    if hf_config.model_type == "glm4":
        return glm4_fields(hf_config, rope)
    if hf_config.model_type != "deepseek_v3":
        return {}
    fields = deepseek_fields(hf_config, rope)
    if fields["q_lora_rank"] % tp_size:  # a column-parallel down projection
        raise ValueError(
            f"tp={tp_size} must divide the MLA query latent size q_lora_rank "
            f"({fields['q_lora_rank']})"
        )
    return fields


def mla_config_kwargs(shape, rope: dict) -> dict:
    """MLATransformerConfig arguments of an MLA shape ({} otherwise); ``rope``:
    :func:`shape.rope_parameters`."""
    if not shape.kv_lora_rank:
        return {}
    return _mla_rope_kwargs(rope) | dict(
        multi_latent_attention=True,
        q_lora_rank=shape.q_lora_rank or None,
        kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_head_dim,
        qk_pos_emb_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
    )


def _mla_rope_kwargs(rope: dict) -> dict:
    """megatron's rope settings for MLA: plain rope, or YaRN with HF's parameters (HF
    takes mscale / mscale_all_dim only when both are set, otherwise the plain YaRN
    attention factor, which megatron's mscale 1 / mscale_all_dim 0 give)."""
    if rope["rope_type"] != "yarn":
        return {"rope_type": "rope", "rotary_base": rope["rope_theta"]}
    both = bool(rope.get("mscale") and rope.get("mscale_all_dim"))
    return {
        "rope_type": "yarn",
        "rotary_base": rope["rope_theta"],
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        "mscale": float(rope["mscale"]) if both else 1.0,
        "mscale_all_dim": float(rope["mscale_all_dim"]) if both else 0.0,
    }


def router_config_kwargs(shape) -> dict:
    """TransformerConfig arguments of DeepSeek-V3's router, shared experts and dense first
    layers ({} for softmax routers)."""
    if shape.router_score != "sigmoid":
        return {}
    dense = shape.first_dense_layers
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # holds e_score_correction_bias
        moe_router_bias_update_rate=0.0,  # a fixed bias, as in HF's forward
        moe_router_num_groups=shape.router_groups or None,
        moe_router_group_topk=shape.router_group_topk or None,
        moe_router_topk_scaling_factor=shape.routed_scaling,
        moe_shared_expert_intermediate_size=shape.shared_ffn_hidden_size or None,
        moe_layer_freq=[0] * dense + [1] * (shape.num_layers - dense),
    )


def is_moe_layer(shape, layer_index: int) -> bool:
    """Whether global layer ``layer_index`` (from 0) has experts."""
    return bool(shape.num_experts) and layer_index >= shape.first_dense_layers


@functools.cache
def note_ignored_mtp(mtp_layers: int) -> None:
    """One log line per process: multi-token-prediction layers are not built."""
    if mtp_layers:
        logger.warning(
            "rl-megatron: the %d multi-token-prediction layer(s) of this DeepSeek-V3 config "
            "(num_nextn_predict_layers) are not built; their weights are ignored and not "
            "exported (HF's forward does not use them either)",
            mtp_layers,
        )
