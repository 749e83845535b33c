"""Rollout routing replay in the FSDP backend (one gloo rank, the families' tiny Qwen3-MoE:
2 layers, 4 experts, top-2): the experts the batch names are the ones the MoE blocks run,
replaying the model's own routes changes nothing, other routes change the log-probs, the
reference pass ignores them, and the loss's gradient still reaches the routers."""

from dataclasses import replace

import pytest
import torch
from fsdp_tiny import FAMILIES, tokens_batch

from rl_core.objective import Objective
from rl_core.routing import NO_ROUTE, hf_moe_routers
from rl_fsdp import FSDPBackend, FSDPConfig
from rl_fsdp.forward import token_indices
from rl_fsdp.lora import LoRASpec

MOE = FAMILIES["qwen3_moe"]


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def make_backend(world, **overrides) -> FSDPBackend:
    settings = dict(model_config=MOE, device="cpu", log_prob_max_tokens=1 << 14)
    return FSDPBackend(FSDPConfig(**{**settings, **overrides}), dist_info=world)


def forced_routes(batch) -> torch.Tensor:
    """``[N, 2, 2]``: token t to experts (t mod 4, t + 1 mod 4) in both layers; sequence
    ends route on their own."""
    first = torch.arange(batch.num_tokens) % 4
    routes = torch.stack([first, (first + 1) % 4], -1)[:, None].expand(-1, 2, -1).clone()
    routes[batch.cu_seqlens[1:].long() - 1] = NO_ROUTE
    return routes.to(torch.int16)


def experts_run(backend, batch, routes) -> torch.Tensor:
    """``[N, L, K]`` (batch order, each row sorted): the experts each MoE block ran."""
    ran = {}  # hooks run in order: this one sees the replayed output
    handles = [
        router.register_forward_hook(lambda m, a, out, i=i: ran.__setitem__(i, out[2]))
        for i, router in hf_moe_routers(backend.model).items()
    ]
    try:
        backend.compute_log_probs(replace(batch, routed_experts=routes))
    finally:
        for handle in handles:
            handle.remove()
    (seqs,) = backend.plan(batch, backend.config.micro_batch_tokens_for_log_probs)
    out = torch.empty(batch.num_tokens, len(ran), 2, dtype=torch.long)
    out[token_indices(batch, seqs)] = torch.stack([ran[i] for i in sorted(ran)], dim=1)
    return out.sort(-1).values


def test_the_given_experts_are_the_ones_run(world_of_one):
    backend = make_backend(world_of_one)
    batch = tokens_batch()
    routes = forced_routes(batch)
    ran = experts_run(backend, batch, routes)
    named = routes[:, 0, 0] >= 0
    assert torch.equal(ran[named], routes[named].long().sort(-1).values)
    natural = experts_run(backend, batch, None)
    assert not torch.equal(natural[named], ran[named])  # the forced routes are not the own


def test_own_routes_replayed_change_nothing_other_routes_do(world_of_one):
    backend = make_backend(world_of_one)
    batch = tokens_batch()
    own = experts_run(backend, batch, None)
    plain = backend.compute_log_probs(batch)
    same = backend.compute_log_probs(replace(batch, routed_experts=own.to(torch.int16)))
    torch.testing.assert_close(same, plain, atol=1e-6, rtol=0)
    forced = backend.compute_log_probs(replace(batch, routed_experts=forced_routes(batch)))
    assert float((forced - plain).abs().max()) > 1e-3
    assert backend.route_replay.num_replayed > 0


def test_the_reference_routes_on_its_own(world_of_one):
    """With LoRA the reference is the policy's own model (adapters off): the pass must not
    replay the rollout's routes."""
    objective = Objective(policy_loss="ppo", kl_coef=0.1)
    lora = LoRASpec(rank=4, alpha=8.0, dropout=0.0, targets=("q_proj", "v_proj"))
    backend = make_backend(world_of_one, objective=objective, lora=lora)
    batch = tokens_batch()
    plain = backend.compute_log_probs(batch, model="ref")
    forced = replace(batch, routed_experts=forced_routes(batch))
    torch.testing.assert_close(backend.compute_log_probs(forced, model="ref"), plain)


def test_gradients_reach_the_routers_under_replay(world_of_one):
    backend = make_backend(world_of_one, lr=1e-2)
    batch = tokens_batch()
    advantages = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(0))
    batch = replace(batch, routed_experts=forced_routes(batch), advantages=advantages)
    old = backend.compute_log_probs(batch)
    batch = replace(batch, old_log_probs=old).with_global_denominators()
    backend.zero_grad()
    backend.forward_backward(batch)
    for router in hf_moe_routers(backend.model).values():
        grad = router.weight.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        assert float(grad.abs().sum()) > 0
