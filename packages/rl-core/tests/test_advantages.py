import math
from dataclasses import replace

import pytest
import torch

from rl_core.advantages import (
    ADVANTAGE_ESTIMATORS,
    WHITENED_BY_DEFAULT,
    AdvantageInputs,
    discounted_returns,
    gae,
    group_normalize,
    last_token_rewards,
    reinforce_pp_baseline,
    reinforce_pp_returns,
    rloo,
    whiten,
)


def test_group_normalize_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    out = group_normalize(rewards, group_size=3)
    # group 1: mean 1/3, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [(1 - 1 / 3) / (std + 1e-6), -1 / 3 / (std + 1e-6), -1 / 3 / (std + 1e-6)]
    torch.testing.assert_close(out[:3], torch.tensor(expected))
    torch.testing.assert_close(out[3:], torch.zeros(3))  # identical rewards
    dr = group_normalize(rewards, group_size=3, std=False)
    torch.testing.assert_close(dr[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_group_normalize_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_normalize(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="1-D"):
        group_normalize(torch.zeros(2, 3), group_size=3)


def test_group_of_one_has_zero_advantage():
    torch.testing.assert_close(group_normalize(torch.tensor([3.0]), group_size=1), torch.zeros(1))


def test_rloo_by_hand():
    out = rloo(torch.tensor([1.0, 0.0, 0.0, 2.0]), group_size=4)
    torch.testing.assert_close(out, torch.tensor([1 - 2 / 3, -1.0, -1.0, 2 - 1 / 3]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo(torch.zeros(2), group_size=1)


def test_discounted_returns_by_hand_and_skips_masked():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 5.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    out = discounted_returns(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + 0.5·2 = 1, G0 = 1 + 0.5 = 1.5
    # row 1 (position 1 masked): G3 = 7, G2 = 1 + 3.5 = 4.5, G0 = 0 + 0.5·4.5 = 2.25
    torch.testing.assert_close(out, torch.tensor([[1.5, 1.0, 2.0, 0.0], [2.25, 0.0, 4.5, 7.0]]))


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25]])
    mask = torch.ones(1, 2)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    delta1 = 1.0 - 0.25
    delta0 = 0.0 + 0.9 * 0.25 - 0.5
    expected = torch.tensor([[delta0 + 0.9 * 0.8 * delta1, delta1]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_gae_with_lambda_one_is_discounted_returns_minus_values():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 7), torch.randn(4, 7)
    mask = (torch.rand(4, 7) > 0.3).float()
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=1.0)
    expected = (discounted_returns(rewards, mask, gamma=0.95) - values) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, discounted_returns(rewards, mask, gamma=0.95))


def test_reinforce_pp_returns_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = reinforce_pp_returns(rewards, kl=kl, mask=mask, kl_coef=0.1, gamma=1.0)
    # row 0 token rewards: -0.01, -0.02 + 1 -> returns 0.97, 0.98
    # row 1: -0.05 each -> returns -0.15, -0.10, -0.05
    torch.testing.assert_close(out, torch.tensor([[0.97, 0.98, 0.0], [-0.15, -0.10, -0.05]]))


def test_reinforce_pp_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2], [0.0, 0.4]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = reinforce_pp_baseline(rewards, group_size=2, kl=kl, mask=mask, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.45, 0.40], [-0.5, 0.0]]))


def test_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = whiten(values, mask)
    # mean 2, unbiased var 1
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    scaled = whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(scaled, torch.tensor([[1.0, 2.0, 3.0, 0.0]]), atol=1e-6, rtol=0)


def test_registry_estimators_run_and_match_functions():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    inputs = AdvantageInputs(rewards=rewards, mask=mask, group_size=2, values=torch.zeros(4, 2))
    for name in ADVANTAGE_ESTIMATORS:
        adv, ret = ADVANTAGE_ESTIMATORS.get(name)(inputs)
        assert adv.shape == mask.shape and ret.shape == mask.shape
        assert (adv[mask == 0] == 0).all()
    grpo, _ = ADVANTAGE_ESTIMATORS.get("grpo")(inputs)
    expected = group_normalize(rewards, group_size=2).unsqueeze(-1) * mask
    torch.testing.assert_close(grpo, expected)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        ADVANTAGE_ESTIMATORS.get("ppo2")
    with pytest.raises(ValueError, match="critic values"):
        ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(rewards=rewards, mask=mask))


def test_groups_of_different_sizes_by_hand():
    """A group of 3 (one sample's reward failed and was left out) beside a full one of 4."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0])
    sizes = (3, 4)
    out = group_normalize(rewards, group_size=4, group_sizes=sizes)
    std3, std4 = math.sqrt(1 / 3), math.sqrt(4 / 3)  # unbiased, over each group's own samples
    expected = [
        2 / 3 / std3,
        -1 / 3 / std3,
        -1 / 3 / std3,
        1 / std4,
        1 / std4,
        -1 / std4,
        -1 / std4,
    ]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    dr = group_normalize(rewards, group_size=4, std=False, group_sizes=sizes)
    torch.testing.assert_close(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, 1.0, -1.0, -1.0]))
    # rloo: 1 - mean(0, 0); 0 - mean(1, 0); ... 2 - mean(2, 0, 0) = 4/3; 0 - mean(2, 2, 0)
    torch.testing.assert_close(
        rloo(rewards, group_size=4, group_sizes=sizes),
        torch.tensor([1.0, -0.5, -0.5, 4 / 3, 4 / 3, -4 / 3, -4 / 3]),
    )
    assert group_normalize(torch.tensor([5.0, 1.0]), group_size=4, group_sizes=(1, 1)).eq(0).all()


def test_equal_sizes_given_as_a_list_match_the_uniform_path():
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    for std in (True, False):
        torch.testing.assert_close(
            group_normalize(rewards, group_size=4, std=std, group_sizes=(4, 4, 4)),
            group_normalize(rewards, group_size=4, std=std),
        )
    torch.testing.assert_close(
        rloo(rewards, group_size=3, group_sizes=(3,) * 4), rloo(rewards, group_size=3)
    )


def test_ragged_groups_are_checked_and_reach_every_group_estimator():
    with pytest.raises(ValueError, match=r"sizes \[3, 3\]"):
        group_normalize(torch.zeros(7), group_size=4, group_sizes=(3, 3))
    with pytest.raises(ValueError, match="every group needs a sample"):
        group_normalize(torch.zeros(3), group_size=4, group_sizes=(3, 0))
    with pytest.raises(ValueError, match=">= 2 samples"):
        rloo(torch.zeros(3), group_size=2, group_sizes=(2, 1))
    rewards, mask = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0]), torch.ones(5, 2)
    inputs = AdvantageInputs(rewards=rewards, mask=mask, group_size=3, group_sizes=(2, 3))
    dr, _ = ADVANTAGE_ESTIMATORS.get("dr_grpo")(inputs)
    expected = torch.tensor([0.5, -0.5, -4 / 3, 5 / 3, -1 / 3])
    torch.testing.assert_close(dr, expected.unsqueeze(-1) * mask)
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv, _ = ADVANTAGE_ESTIMATORS.get(name)(inputs)  # the uniform path would refuse 5 / 3
        assert adv.shape == mask.shape and torch.isfinite(adv).all()


F64 = torch.float64


def test_every_function_keeps_float64():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1], [0, 1, 1]], dtype=F64)
    token = torch.rand(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    outputs = {
        "group_normalize": group_normalize(rewards, group_size=2),
        "group_normalize ragged": group_normalize(rewards, group_size=2, group_sizes=(1, 3)),
        "rloo": rloo(rewards, group_size=2),
        "rloo ragged": rloo(rewards, group_size=2, group_sizes=(2, 2)),
        "discounted_returns": discounted_returns(token, mask, gamma=0.9),
        "gae": gae(token, token.flip(0), mask, gamma=0.9, lam=0.8)[0],
        "gae returns": gae(token, token.flip(0), mask, gamma=0.9, lam=0.8)[1],
        "last_token_rewards": last_token_rewards(rewards, mask),
        "reinforce_pp_returns": reinforce_pp_returns(rewards, kl=token, mask=mask, kl_coef=0.1),
        "reinforce_pp_baseline": reinforce_pp_baseline(
            rewards, group_size=2, kl=token, mask=mask, kl_coef=0.1
        ),
        "whiten": whiten(token, mask),
    }
    assert {name: out.dtype for name, out in outputs.items()} == dict.fromkeys(outputs, F64)
    # a float64 mask or kl beside float32 rewards does not narrow either
    assert last_token_rewards(rewards.float(), mask).dtype == torch.float32
    assert reinforce_pp_returns(rewards.float(), kl=token, mask=mask, kl_coef=0.1).dtype == F64


def test_every_estimator_keeps_float64():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1], [0, 1, 1]], dtype=F64)
    inputs = AdvantageInputs(
        rewards=rewards, mask=mask, group_size=2, values=torch.zeros(4, 3, dtype=F64), kl_coef=0.1
    )
    for name in ADVANTAGE_ESTIMATORS:
        adv, ret = ADVANTAGE_ESTIMATORS.get(name)(inputs)
        assert (adv.dtype, ret.dtype) == (F64, F64), name
    # float32 stays float32 (kl defaults to zeros of the rewards' type)
    inputs32 = AdvantageInputs(
        rewards=rewards.float(),
        mask=mask.bool(),
        group_size=2,
        values=torch.zeros(4, 3),
        kl_coef=0.1,
    )
    for name in ADVANTAGE_ESTIMATORS:
        adv, ret = ADVANTAGE_ESTIMATORS.get(name)(inputs32)
        assert (adv.dtype, ret.dtype) == (torch.float32, torch.float32), name


def test_whitened_by_default_names_exactly_the_estimators_that_whiten_unasked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    values = torch.tensor([[0.1, 0.2], [0.3, 0.0], [0.0, 0.5], [0.2, 0.1]], dtype=torch.float64)
    for name in ADVANTAGE_ESTIMATORS.names():
        inputs = AdvantageInputs(rewards=rewards, mask=mask, group_size=2, values=values)
        default, _ = ADVANTAGE_ESTIMATORS.get(name)(inputs)
        asked, _ = ADVANTAGE_ESTIMATORS.get(name)(replace(inputs, whiten=True))
        assert torch.allclose(default, asked) == (name in WHITENED_BY_DEFAULT), name
