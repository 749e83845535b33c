"""The two-rank gloo job of test_routing_replay.py: rollout routing replay under TP=2 with
sequence parallel, CP=2 and PP=2 (one layer per stage), each the log-probs and the loss of
a batch with forced routes. Rank 0's results go back to the parent
(multi_rank.spawn_gloo)."""

from dataclasses import replace

import tiny
import torch
from dist_job import LENGTHS, POLICY

from rl_core.routing import NO_ROUTE

LAYOUTS = {
    "tp2+sp": {"tp": 2, "sequence_parallel": True},
    "cp2": {"cp": 2},
    "pp2": {"pp": 2, "max_tokens_per_micro_batch": 28},
}


def forced_routes(batch, num_layers: int) -> torch.Tensor:
    """``[N, L, 2]``: token t to experts (t mod 4, t + 1 mod 4) in every layer; sequence
    ends route on their own."""
    first = torch.arange(batch.num_tokens) % 4
    pair = torch.stack([first, (first + 1) % 4], dim=-1)
    routes = pair[:, None].expand(-1, num_layers, -1).to(torch.int16).clone()
    routes[batch.cu_seqlens[1:].long() - 1] = NO_ROUTE
    return routes


def replayed(hf_path: str, **layout) -> dict:
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, **POLICY, **layout))
    batch = tiny.random_batch(LENGTHS, seed=11)
    batch = replace(batch, routed_experts=forced_routes(batch, 2))
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["metrics"] = backend.forward_backward(batch)
    result["num_replayed"] = backend.route_replay.num_replayed
    return result


def rank_checks(rank: int, hf_path: str) -> dict:
    """Every layout of LAYOUTS, replaying the forced routes (each rank runs all of them)."""
    return {name: replayed(hf_path, **layout) for name, layout in LAYOUTS.items()}
