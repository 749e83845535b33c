import math

import pytest
import torch

from rl_core.importance import logprob_gap_share, rollout_importance_weights


def test_token_truncate_by_hand():
    old = torch.tensor([[math.log(3.0), 0.0, 0.0]])
    rollout = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, metrics = rollout_importance_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.0]]))
    assert metrics["mismatch/frac_capped"] == pytest.approx(0.5)
    assert metrics["mismatch/abs_log_ratio_mean"] == pytest.approx(math.log(3.0) / 2)
    assert metrics["mismatch/weight_mean"] == pytest.approx(1.5)


def test_token_mask_mode_drops_out_of_range():
    old = torch.tensor([math.log(3.0), math.log(0.25), math.log(1.5)])
    weights, metrics = rollout_importance_weights(
        old, torch.zeros(3), torch.ones(3), mode="mask", cap=2.0
    )
    torch.testing.assert_close(weights, torch.tensor([0.0, 0.0, 1.5]))
    assert metrics["mismatch/frac_capped"] == pytest.approx(2 / 3)


def test_sequence_level_shares_the_product():
    old = torch.tensor([[0.1, 0.2, 9.0], [0.0, -0.5, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    weights, _ = rollout_importance_weights(old, rollout, mask, level="sequence", cap=5.0)
    expected = torch.tensor([[math.exp(0.3)] * 2 + [0.0], [math.exp(-0.5)] * 3])
    torch.testing.assert_close(weights, expected)
    packed, _ = rollout_importance_weights(
        old[mask.bool()],
        rollout[mask.bool()],
        torch.ones(5),
        level="sequence",
        cap=5.0,
        cu_seqlens=torch.tensor([0, 2, 5]),
    )
    torch.testing.assert_close(packed, expected[mask.bool()])


def test_bad_options():
    with pytest.raises(ValueError, match="token, sequence"):
        rollout_importance_weights(torch.zeros(1), torch.zeros(1), torch.ones(1), level="seq")
    with pytest.raises(ValueError, match="truncate, mask"):
        rollout_importance_weights(torch.zeros(1), torch.zeros(1), torch.ones(1), mode="clip")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_float64_in_float64_out(level):
    old = torch.tensor([[math.log(3.0), -0.1, 0.0]], dtype=torch.float64)
    rollout = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, metrics = rollout_importance_weights(
        old, rollout, mask, level=level, cap=5.0, tensor_metrics=True
    )
    assert weights.dtype == torch.float64
    assert all(value.dtype == torch.float64 for value in metrics.values())
    expected = [3.0, math.exp(-0.1)] if level == "token" else [3 * math.exp(-0.1)] * 2
    torch.testing.assert_close(weights[0, :2], torch.tensor(expected, dtype=torch.float64))
    gap = logprob_gap_share(old, rollout, mask, num_tokens=4.0)
    assert gap.dtype == torch.float64 and gap.item() == pytest.approx((math.log(3) + 0.1) / 4)
