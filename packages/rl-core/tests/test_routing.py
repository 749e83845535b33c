"""Rollout routing replay's bookkeeping (rl_core.routing), with hand-computed values."""

import pytest
import torch

from rl_core.batch import batch_from_samples
from rl_core.routing import (
    NO_ROUTE,
    decode_routes,
    encode_routes,
    packed_routes,
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
