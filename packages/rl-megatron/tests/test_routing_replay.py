"""Rollout routing replay in Megatron's routers (one gloo rank, tiny Qwen3-MoE, 4 experts,
top-2, and tiny DeepSeek-V3: sigmoid router with expert bias, 8 experts in 4 groups, top-2
groups, top-4): forced routes give the log-probs of the HF model forced to the same experts
(so replay is applied, with HF's weights), DeepSeek-V3's router uses the given experts even
across its group limit, with HF's sigmoid weights, and the loss's gradient still reaches
the router; on two ranks, TP=2 with sequence parallel, CP=2, PP=2, CP=2 x EP=2 and virtual
pipeline stages (Qwen3-MoE), CP=2 x EP=2 and PP=2 (DeepSeek-V3) replay as one rank does."""

import itertools
from dataclasses import replace

import pytest
import routing_replay_job as job
import tiny
import torch
from multi_rank import spawn_gloo
from routing_replay_job import forced_routes, model_routes
from test_single_rank import LENGTHS, make_backend

from rl_core.routing import hf_moe_routers, replay_hf_router


def hf_forced_log_probs(model, batch, routes) -> torch.Tensor:
    """tiny.hf_log_probs with every HF router replaying ``routes`` (one sequence at a time)."""
    current = {}

    def replayer(layer):
        def replay(router, args, output):
            logits, scores, _ = output
            weights, experts = replay_hf_router(router, output, current["routes"][:, layer])
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


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek_v3"])
def test_forced_routes_give_the_forced_hf_log_probs(world1, model_dirs, name):
    backend = make_backend(model_dirs, name, max_tokens_per_micro_batch=20)
    hf_model = model_dirs[name][1]
    batch = tiny.random_batch(LENGTHS, seed=1)
    routes = model_routes(hf_model.config, batch)
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


def test_deepseek_v3_replays_the_given_experts_with_its_sigmoid_weights(world1, model_dirs):
    """Routes (t..t+3 mod 8) that for odd t span three of the four expert groups, where the
    router itself keeps two: every MoE layer's routing map is exactly the given experts,
    and their weights are HF's for them: sigmoid of the logits (the expert bias only
    picks), renormalised over the four, times routed_scaling_factor 2.5."""
    from megatron.core.transformer.moe.router import TopKRouter

    backend = make_backend(model_dirs, "deepseek_v3")
    config = model_dirs["deepseek_v3"][1].config
    batch = tiny.random_batch([40], seed=1)  # one row: the router's tokens in packed order
    routes = model_routes(config, batch)
    seen = []

    def keep(router, args, output):
        logits = torch.nn.functional.linear(args[0].flatten(0, -2).float(), router.weight.float())
        seen.append((router.layer_number - 1, logits, *output))

    routers = [m for m in backend.model.modules() if isinstance(m, TopKRouter)]
    handles = [router.register_forward_hook(keep) for router in routers]
    try:
        backend.compute_log_probs(replace(batch, routed_experts=routes))
    finally:
        for handle in handles:
            handle.remove()
    named = routes[:, 0, 0] >= 0
    groups = (routes[named, 0].long() // 2).tolist()
    assert max(len(set(g)) for g in groups) > config.topk_group  # beyond the group limit
    assert sorted(layer for layer, *_ in seen) == [1, 2]  # layer 0 is dense
    for layer, logits, probs, routing_map in seen:
        given = routes[named, layer].long()
        expected_map = torch.zeros_like(routing_map[named]).scatter(1, given, True)
        assert torch.equal(routing_map[named], expected_map), layer
        scores = torch.sigmoid(logits[named]).gather(1, given)
        weights = 2.5 * scores / scores.sum(-1, keepdim=True)
        torch.testing.assert_close(probs[named].gather(1, given), weights, atol=1e-6, rtol=0)


@pytest.mark.integration
def test_replay_under_tp_cp_and_pp_equals_one_rank(world1, model_dirs, tmp_path):
    """The routes follow the tokens into each layout: SP's split of the sequence, CP's
    zigzag halves (with EP's token exchange too), the pipeline's stages (the second
    stage's router is layer 1) and each virtual stage's model chunk."""
    dirs = {name: str(model_dirs[name][0]) for name, _ in job.LAYOUTS.values()}
    results = spawn_gloo(job.rank_checks, 2, tmp_path / "results.pt", dirs)
    references = {name: job.replayed(path) for name, path in dirs.items()}
    assert set(results) == set(job.LAYOUTS)
    for name, got in results.items():
        reference = references[job.LAYOUTS[name][0]]
        assert got["num_replayed"] > 0, name
        torch.testing.assert_close(got["log_probs"], reference["log_probs"], atol=1e-5, rtol=0)
        for key in (k for k in reference["metrics"] if "loss" in k):
            assert got["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-5), key
