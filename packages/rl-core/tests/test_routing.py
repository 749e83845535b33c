"""Rollout routing replay's bookkeeping (rl_core.routing), with hand-computed values."""

import pytest
import torch

from rl_core.batch import batch_from_samples
from rl_core.routing import (
    NO_ROUTE,
    decode_routes,
    encode_routes,
    hf_moe_routers,
    packed_routes,
    replay_hf_router,
    replay_sigmoid_topk,
    replay_topk,
)
from rl_core.types import Sample, SampleStatus

# softmax of log([1, 2, 3, 4]) is [0.1, 0.2, 0.3, 0.4]; the router's own top-2 is [3, 2]
LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def test_given_experts_are_used_with_the_routers_own_probabilities():
    weights, experts = replay_topk(LOGITS, torch.tensor([[0, 1]]), norm_topk_prob=False)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.1, 0.2]]))
    weights, _ = replay_topk(LOGITS, torch.tensor([[0, 1]]), norm_topk_prob=True)
    torch.testing.assert_close(weights, torch.tensor([[1 / 3, 2 / 3]]))


def test_a_row_without_route_keeps_the_routers_choice():
    logits = LOGITS.repeat(2, 1)
    given = torch.tensor([[0, 1], [NO_ROUTE, NO_ROUTE]], dtype=torch.int16)
    weights, experts = replay_topk(logits, given, norm_topk_prob=False)
    assert experts.tolist() == [[0, 1], [3, 2]]
    torch.testing.assert_close(weights[1], torch.tensor([0.4, 0.3]))


def test_gradients_reach_the_router_weights():
    """d p_0 / d z = p_0 (e_0 - p): the replayed expert's weight still trains the router."""
    router_weight = torch.eye(4, requires_grad=True)  # logits = x W^T, x = LOGITS
    weights, _ = replay_topk(LOGITS @ router_weight.T, torch.tensor([[0, 1]]), norm_topk_prob=False)
    weights[0, 0].backward()
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    expected_dz = 0.1 * (torch.tensor([1.0, 0, 0, 0]) - p)
    torch.testing.assert_close(router_weight.grad, expected_dz[:, None] * LOGITS)


# sigmoid of [0, log 3, -log 3, log 4] is [1/2, 3/4, 1/4, 4/5]
SIGMOID_LOGITS = torch.log(torch.tensor([[1.0, 3.0, 1 / 3, 4.0]]))


def test_sigmoid_router_weighs_the_given_experts_by_their_sigmoid_scores():
    """DeepSeek-V3's router: sigmoid scores at the given experts (whatever the group limit
    or bias would pick), renormalised, times the scaling factor; own choice on NO_ROUTE."""
    given = torch.tensor([[2, 0], [NO_ROUTE, NO_ROUTE]], dtype=torch.int16)
    own = torch.tensor([[3, 1], [3, 1]])
    weights, experts = replay_sigmoid_topk(
        SIGMOID_LOGITS.repeat(2, 1), given, own, norm_topk_prob=True, scaling=2.0
    )
    assert experts.tolist() == [[2, 0], [3, 1]]
    # [1/4, 1/2] / (3/4) * 2 and [4/5, 3/4] / (31/20) * 2
    expected = torch.tensor([[2 / 3, 4 / 3], [32 / 31, 30 / 31]])
    torch.testing.assert_close(weights, expected)
    weights, _ = replay_sigmoid_topk(
        SIGMOID_LOGITS, given[:1], own[:1], norm_topk_prob=False, scaling=1.0
    )
    torch.testing.assert_close(weights, torch.tensor([[0.25, 0.5]]))


def test_hf_routers_are_found_and_replayed_by_their_kind():
    """Class names ending in TopKRouter (Qwen3-MoE) or TopkRouter (DeepSeek-V3); a router
    holding e_score_correction_bias replays with sigmoid scores, others with softmax."""

    class DeepseekV3TopkRouter(torch.nn.Module):
        norm_topk_prob, routed_scaling_factor = True, 2.0

        def __init__(self):
            super().__init__()
            self.register_buffer("e_score_correction_bias", torch.zeros(4))

    class Qwen3MoeTopKRouter(torch.nn.Module):
        norm_topk_prob = False

    layers = [
        torch.nn.ModuleDict({"gate": r()}) for r in (Qwen3MoeTopKRouter, DeepseekV3TopkRouter)
    ]
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(layers)})
    routers = hf_moe_routers(model)
    assert [type(routers[i]).__name__ for i in (0, 1)] == [
        "Qwen3MoeTopKRouter",
        "DeepseekV3TopkRouter",
    ]
    given = torch.tensor([[2, 0]])
    output = (SIGMOID_LOGITS, None, torch.tensor([[3, 1]]))
    weights, _ = replay_hf_router(routers[1], output, given)
    torch.testing.assert_close(weights, torch.tensor([[2 / 3, 4 / 3]]))
    weights, _ = replay_hf_router(routers[0], (LOGITS, None, None), given)
    torch.testing.assert_close(weights, torch.tensor([[0.3, 0.1]]))


def test_packed_routes_leave_each_sequence_end_to_the_router():
    first = torch.tensor([[[1, 2]], [[3, 0]]])  # 3 tokens: rows of tokens 0 and 1
    second = torch.tensor([[[2, 3]]])  # 2 tokens
    packed = packed_routes([first, second], [3, 2])
    assert packed.dtype == torch.int16 and packed.shape == (5, 1, 2)
    assert packed[:, 0].tolist() == [[1, 2], [3, 0], [-1, -1], [2, 3], [-1, -1]]
    with pytest.raises(ValueError, match="3 route rows for 3 tokens"):
        packed_routes([torch.zeros(3, 1, 2)], [3])


def test_sglang_wire_form_round_trips():
    routes = torch.tensor([[[1, 7], [0, 2]], [[5, 4], [3, 6]]], dtype=torch.int16)
    text = encode_routes(routes)
    assert len(text) == 44  # base64 of 8 int32 (32 bytes)
    assert torch.equal(decode_routes(text, num_layers=2, top_k=2), routes)
    with pytest.raises(ValueError, match="do not split"):
        decode_routes(text, num_layers=3, top_k=2)


def _sample(tokens, response_length, routes, index):
    return Sample(
        tokens=tokens,
        response_length=response_length,
        status=SampleStatus.COMPLETED,
        index=index,
        routed_experts=routes,
    )


def test_samples_carry_routes_into_the_batch_and_json():
    a = _sample([5, 6, 7], 1, torch.tensor([[[1, 2]], [[3, 0]]]), 0)
    b = _sample([8, 9], 1, torch.tensor([[[2, 3]]]), 1)
    back = Sample.from_json(a.to_json())
    assert torch.equal(back.routed_experts, a.routed_experts.to(torch.int16))
    batch = batch_from_samples([a, b], [1.0, -1.0])
    assert batch.routed_experts[:, 0].tolist() == [[1, 2], [3, 0], [-1, -1], [2, 3], [-1, -1]]
    assert batch.select([1]).routed_experts[:, 0].tolist() == [[2, 3], [-1, -1]]
    with pytest.raises(ValueError, match="have no routed_experts while others do"):
        batch_from_samples([a, _sample([8, 9], 1, None, 1)], [1.0, -1.0])
    with pytest.raises(ValueError, match="routed_experts"):
        _sample([5, 6], 1, torch.zeros(2, 1, 2), 2).validate()
