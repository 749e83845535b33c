"""The two-rank gloo job of test_routing_replay.py: rollout routing replay under TP=2 with
sequence parallel, CP=2, PP=2 (one layer per stage), CP=2 x EP=2 and PP=2 with two virtual
stages (a four-layer Qwen3-MoE), and DeepSeek-V3's sigmoid router at CP=2 x EP=2 and PP=2
(four layers, the first dense), each the log-probs and the loss of a batch with forced
routes. Rank 0's results go back to the parent (multi_rank.spawn_gloo)."""

from dataclasses import replace

import tiny
import torch
from dist_job import LENGTHS, POLICY

from rl_core.routing import NO_ROUTE

VIRTUAL = {"virtual_pipeline_model_parallel_size": 2}
# name -> (model directory's name, layout)
LAYOUTS = {
    "tp2+sp": ("qwen3-moe", {"tp": 2, "sequence_parallel": True}),
    "cp2": ("qwen3-moe", {"cp": 2}),
    "pp2": ("qwen3-moe", {"pp": 2, "max_tokens_per_micro_batch": 28}),
    "cp2+ep2": ("qwen3-moe", {"cp": 2, "ep": 2}),
    "pp2+vpp2": ("qwen3-moe-4layers", {"pp": 2, "megatron": VIRTUAL}),
    "deepseek_v3 cp2+ep2": ("deepseek_v3", {"cp": 2, "ep": 2}),
    "deepseek_v3 pp2": ("deepseek_v3-4layers", {"pp": 2, "max_tokens_per_micro_batch": 28}),
}


def forced_routes(batch, num_layers: int, num_experts: int = 4, top_k: int = 2) -> torch.Tensor:
    """``[N, L, top_k]``: token t to experts (t, t + 1, ..., t + top_k - 1) mod num_experts
    in every layer; sequence ends route on their own."""
    first = torch.arange(batch.num_tokens)
    experts = torch.stack([(first + k) % num_experts for k in range(top_k)], dim=-1)
    routes = experts[:, None].expand(-1, num_layers, -1).to(torch.int16).clone()
    routes[batch.cu_seqlens[1:].long() - 1] = NO_ROUTE
    return routes


def model_routes(hf_config, batch) -> torch.Tensor:
    """:func:`forced_routes` of ``batch`` shaped for the model: every hidden layer, its
    experts, its top-k."""
    num_experts = getattr(hf_config, "num_experts", None) or hf_config.n_routed_experts
    return forced_routes(
        batch, hf_config.num_hidden_layers, num_experts, hf_config.num_experts_per_tok
    )


def replayed(hf_path: str, **layout) -> dict:
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, **POLICY, **layout))
    batch = tiny.random_batch(LENGTHS, seed=11)
    batch = replace(batch, routed_experts=model_routes(backend.hf_config, batch))
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["metrics"] = backend.forward_backward(batch)
    result["num_replayed"] = backend.route_replay.num_replayed
    return result


def rank_checks(rank: int, dirs: dict) -> dict:
    """Every layout of LAYOUTS, replaying the forced routes (each rank runs all of them)."""
    return {name: replayed(dirs[model], **layout) for name, (model, layout) in LAYOUTS.items()}
