"""Qwen3-MoE: the mixture-of-experts part of the model config, and expert-parallel helpers.

Megatron's MoE layer (router + ``SequentialMLP`` of local experts, allgather dispatcher,
which needs no CUDA streams) replaces the dense MLP in every layer. Routing matches HF's
Qwen3-MoE: softmax over all experts then top-k (``norm_topk_prob`` False), or top-k then
softmax over the chosen logits, which equals renormalised top-k probabilities (True).
No auxiliary load-balancing loss is added: the RL loss is the whole objective.
DeepSeek-V3's router (sigmoid scores, expert bias, groups) is in :mod:`rl_megatron.families`.
"""

from rl_megatron.families import router_config_kwargs


def moe_fields(hf_config) -> dict:
    """ModelShape fields of an MoE config (zeros for a dense one); all layers must be sparse."""
    num_experts = getattr(hf_config, "num_experts", 0) or 0
    if not num_experts:
        return {}
    sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
    if sparse_step != 1 or getattr(hf_config, "mlp_only_layers", []):
        raise ValueError(
            "only MoE models whose every layer is sparse are supported "
            "(decoder_sparse_step=1, mlp_only_layers=[])"
        )
    return {
        "num_experts": num_experts,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_topk": hf_config.num_experts_per_tok,
        "norm_topk_prob": bool(getattr(hf_config, "norm_topk_prob", False)),
    }


def moe_config_kwargs(shape, *, ep_size: int) -> dict:
    """TransformerConfig arguments for the MoE layers of ``shape`` ({} when dense)."""
    if not shape.num_experts:
        return {}
    if shape.num_experts % ep_size:
        raise ValueError(f"ep={ep_size} must divide the number of experts ({shape.num_experts})")
    _define_te_gemm_placeholder()
    return dict(
        num_moe_experts=shape.num_experts,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_topk,
        moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep_size,
        **router_config_kwargs(shape),  # DeepSeek-V3's sigmoid router and shared experts
    )


def ep_synced_groups(groups: list[list[int]], ep_group, device) -> list[list[int]]:
    """Expert-parallel ranks exchange tokens in every forward, so all run the same number of
    micro-batches: a shorter list gets empty ones (no tokens, zero loss)."""
    (count,) = _ep_max([len(groups)], ep_group, device)
    return groups + [[] for _ in range(count - len(groups))]


def ep_common_shape(shape: tuple[int, int], ep_group, device) -> tuple[int, int]:
    """The padded ``[B, T]`` every EP rank uses (megatron's allgather dispatcher needs equal
    token counts on all ranks)."""
    rows, width = _ep_max(list(shape), ep_group, device)
    return rows, width


def _ep_max(values: list[int], group, device) -> list[int]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _define_te_gemm_placeholder() -> None:
    """megatron-core 0.16.1 reads ``moe_utils.te_general_gemm`` in the router even when
    Transformer Engine is absent (the name is then undefined): define it as None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
