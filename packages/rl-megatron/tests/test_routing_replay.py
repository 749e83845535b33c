"""Rollout routing replay in Megatron's routers (one gloo rank, tiny Qwen3-MoE, 4 experts,
top-2): forced routes give the log-probs of the HF model forced to the same experts (so
replay is applied, with HF's weights), and the loss's gradient still reaches the router;
on two ranks, TP=2 with sequence parallel, CP=2 and PP=2 replay as one rank does."""

import itertools
from dataclasses import replace

import pytest
import routing_replay_job as job
import tiny
import torch
from multi_rank import spawn_gloo
from routing_replay_job import forced_routes
from test_single_rank import LENGTHS, make_backend

from rl_core.routing import hf_moe_routers, replay_topk


def hf_forced_log_probs(model, batch, routes) -> torch.Tensor:
    """tiny.hf_log_probs with every HF router replaying ``routes`` (one sequence at a time)."""
    current = {}

    def replayer(layer):
        def replay(router, args, output):
            logits, scores, _ = output
            weights, experts = replay_topk(
                logits, current["routes"][:, layer], norm_topk_prob=router.norm_topk_prob
            )
            return logits, weights.to(scores.dtype), experts

        return replay

    handles = [r.register_forward_hook(replayer(i)) for i, r in hf_moe_routers(model).items()]
    pieces = []
    try:
        bounds = itertools.pairwise(batch.cu_seqlens.tolist())
        for index, (start, end) in enumerate(bounds):
            current["routes"] = routes[start:end]
            pieces.append(tiny.hf_log_probs(model, batch.select([index])))
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(pieces)


def test_forced_routes_give_the_forced_hf_log_probs(world1, model_dirs):
    backend = make_backend(model_dirs, "qwen3-moe", max_tokens_per_micro_batch=20)
    hf_model = model_dirs["qwen3-moe"][1]
    batch = tiny.random_batch(LENGTHS, seed=1)
    routes = forced_routes(batch, hf_model.config.num_hidden_layers)
    replayed = backend.compute_log_probs(replace(batch, routed_experts=routes))
    assert backend.route_replay.num_replayed > 0
    expected = hf_forced_log_probs(hf_model, batch, routes).detach()
    ends = batch.cu_seqlens[1:].long() - 1
    replayed[ends] = 0.0
    torch.testing.assert_close(replayed, expected, atol=2e-5, rtol=0)
    natural = backend.compute_log_probs(batch)
    natural[ends] = 0.0
    assert float((natural - replayed).abs().max()) > 1e-3  # the routes changed something


def test_gradients_reach_the_router_under_replay(world1, model_dirs):
    backend = make_backend(model_dirs, "qwen3-moe", max_tokens_per_micro_batch=20)
    batch = tiny.random_batch(LENGTHS, seed=2)
    routes = forced_routes(batch, model_dirs["qwen3-moe"][1].config.num_hidden_layers)
    backend.forward_backward(replace(batch, routed_experts=routes))
    router_grads = [
        p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        for name, p in backend.model.named_parameters()
        if name.endswith("router.weight")
    ]
    assert router_grads and all(float(g.abs().sum()) > 0 for g in router_grads)


@pytest.mark.integration
def test_replay_under_tp_cp_and_pp_equals_one_rank(world1, model_dirs, tmp_path):
    """The routes follow the tokens into each layout: SP's split of the sequence, CP's
    zigzag halves, the pipeline's stages (the second stage's router is layer 1)."""
    hf_path = str(model_dirs["qwen3-moe"][0])
    results = spawn_gloo(job.rank_checks, 2, tmp_path / "results.pt", hf_path)
    reference = job.replayed(hf_path)
    for name, got in results.items():
        assert got["num_replayed"] > 0, name
        torch.testing.assert_close(got["log_probs"], reference["log_probs"], atol=1e-5, rtol=0)
        for key in (k for k in reference["metrics"] if "loss" in k):
            assert got["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-5), key
