"""Rollout routing replay in the FSDP backend (one gloo rank, the families' tiny Qwen3-MoE:
2 layers, 4 experts, top-2): the experts the batch names are the ones the MoE blocks run,
replaying the model's own routes changes nothing, other routes change the log-probs, the
reference pass ignores them, and the loss's gradient still reaches the routers. The same
for a tiny DeepSeek-V3 (sigmoid router with an expert bias, 8 experts in 4 groups, top-2
groups, top-4): the given experts are run even across the group limit, weighted as HF
weighs the experts it picks."""

from dataclasses import replace

import pytest
import torch
from fsdp_tiny import COMMON, FAMILIES, tokens_batch

from rl_core.objective import Objective
from rl_core.routing import NO_ROUTE, hf_moe_routers
from rl_fsdp import FSDPBackend, FSDPConfig
from rl_fsdp.forward import token_indices
from rl_fsdp.lora import LoRASpec

MOE = FAMILIES["qwen3_moe"]
# after one dense layer, two MoE layers: 8 routed experts in 4 groups (top 2 groups, top 4
# experts) and a shared one; MLA with query latent 32, kv latent 24, 16 + 8 rope channels
DEEPSEEK = {
    **COMMON,
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 32,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def make_backend(world, **overrides) -> FSDPBackend:
    settings = dict(model_config=MOE, device="cpu", log_prob_max_tokens=1 << 14)
    return FSDPBackend(FSDPConfig(**{**settings, **overrides}), dist_info=world)


def forced_routes(batch, num_layers=2, num_experts=4, top_k=2) -> torch.Tensor:
    """``[N, L, top_k]``: token t to experts (t, ..., t + top_k - 1) mod num_experts in every
    layer; sequence ends route on their own."""
    first = torch.arange(batch.num_tokens)
    experts = torch.stack([(first + k) % num_experts for k in range(top_k)], -1)
    routes = experts[:, None].expand(-1, num_layers, -1).clone()
    routes[batch.cu_seqlens[1:].long() - 1] = NO_ROUTE
    return routes.to(torch.int16)


def router_outputs(backend, batch, routes) -> dict[int, tuple]:
    """Per MoE layer, its router's ``(logits [N, E], weights [N, K], experts [N, K])`` after
    replay, in batch order."""
    ran = {}  # hooks run in order: this one sees the replayed output
    handles = [
        router.register_forward_hook(lambda m, a, out, i=i: ran.__setitem__(i, out))
        for i, router in hf_moe_routers(backend.model).items()
    ]
    try:
        backend.compute_log_probs(replace(batch, routed_experts=routes))
    finally:
        for handle in handles:
            handle.remove()
    (seqs,) = backend.plan(batch, backend.config.micro_batch_tokens_for_log_probs)
    index = token_indices(batch, seqs)
    result = {}
    for layer, output in ran.items():
        result[layer] = []
        for tensor in output:
            full = tensor.new_zeros(batch.num_tokens, *tensor.shape[1:])
            full[index] = tensor.detach()
            result[layer].append(full)
    return result


def experts_run(backend, batch, routes) -> torch.Tensor:
    """``[N, L, K]`` (batch order, each row sorted): the experts each MoE block ran."""
    outputs = router_outputs(backend, batch, routes)
    return torch.stack([outputs[i][2] for i in sorted(outputs)], dim=1).sort(-1).values


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


def deepseek_backend(world) -> FSDPBackend:
    """The tiny DeepSeek-V3 with an expert bias as large as its scores' spread."""
    backend = make_backend(world, model_config=DEEPSEEK)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in hf_moe_routers(backend.model).values():
            router.e_score_correction_bias.copy_(0.03 * torch.randn(8, generator=gen))
    return backend


def test_deepseek_v3_runs_the_given_experts_with_its_sigmoid_weights(world_of_one):
    """Routes (t..t+3 mod 8) that for odd t span three of the four groups, where the
    router keeps two: each MoE layer runs exactly the given experts, weighted by the
    sigmoid of their logits (the bias only picks), renormalised, times 2.5."""
    backend = deepseek_backend(world_of_one)
    batch = tokens_batch()
    routes = forced_routes(batch, num_layers=3, num_experts=8, top_k=4)
    named = routes[:, 0, 0] >= 0
    assert max(len(set(row)) for row in (routes[named, 0].long() // 2).tolist()) > 2
    outputs = router_outputs(backend, batch, routes)
    assert sorted(outputs) == [1, 2]  # layer 0 is dense
    for layer, (logits, weights, experts) in outputs.items():
        given = routes[named, layer].long()
        assert torch.equal(experts[named], given), layer
        scores = torch.sigmoid(logits[named]).gather(1, given)
        expected = 2.5 * scores / scores.sum(-1, keepdim=True)
        torch.testing.assert_close(weights[named], expected, atol=1e-6, rtol=0)


def test_deepseek_v3_own_routes_replayed_change_nothing_other_routes_do(world_of_one):
    backend = deepseek_backend(world_of_one)
    batch = tokens_batch()
    own = torch.stack([o[2] for _, o in sorted(router_outputs(backend, batch, None).items())], 1)
    own = torch.cat([torch.zeros_like(own[:, :1]), own], dim=1)  # the dense layer's row
    plain = backend.compute_log_probs(batch)
    same = backend.compute_log_probs(replace(batch, routed_experts=own.to(torch.int16)))
    torch.testing.assert_close(same, plain, atol=1e-6, rtol=0)
    forced = forced_routes(batch, num_layers=3, num_experts=8, top_k=4)
    moved = backend.compute_log_probs(replace(batch, routed_experts=forced)) - plain
    assert float(moved.abs().max()) > 1e-3
