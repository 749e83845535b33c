"""Rollout routing replay in Megatron's routers (one gloo rank, tiny Qwen3-MoE, 4 experts,
top-2): forced routes give the log-probs of the HF model forced to the same experts (so
replay is applied, with HF's weights), and the loss's gradient still reaches the router."""

import itertools
from dataclasses import replace

import tiny
import torch
from test_single_rank import LENGTHS, make_backend

from rl_core.routing import NO_ROUTE, hf_moe_routers, replay_topk


def forced_routes(batch, num_layers: int) -> torch.Tensor:
    """``[N, L, 2]``: token t of the batch to experts (t mod 4, t + 1 mod 4) in every layer;
    each sequence's last token routes on its own."""
    first = torch.arange(batch.num_tokens) % 4
    pair = torch.stack([first, (first + 1) % 4], dim=-1)
    routes = pair[:, None].expand(-1, num_layers, -1).to(torch.int16).clone()
    routes[batch.cu_seqlens[1:].long() - 1] = NO_ROUTE
    return routes


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
