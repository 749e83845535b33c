"""Composition: overlong penalty values, format regex, weighted sums with user functions."""

import pytest

from rl_rewards import get_reward
from rl_rewards.compose import overlong_penalty


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (101, -1.0), (85, -0.25)],
)
def test_overlong_penalty_hand_values(length, expected):
    # max_length 100, buffer 20: free up to 80, linear to -1 at 100, -1 beyond
    assert overlong_penalty(length, 100, 20) == pytest.approx(expected)


def test_overlong_reward_units_and_bad_config():
    assert get_reward("overlong", max_length=4, buffer_length=2)("a b c", None) == -0.5
    assert get_reward("overlong", max_length=4, buffer_length=2, unit="chars")("abc", None) == -0.5
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(1, 10, 20)
    with pytest.raises(ValueError, match="chars"):
        get_reward("overlong", max_length=4, buffer_length=2, unit="tokens")("a", None)


def test_format_reward_default_and_custom_pattern():
    reward = get_reward("format")
    assert reward("<think>plan</think> so \\boxed{3}", None) == 1.0
    assert reward("so \\boxed{3}", None) == 0.0
    assert get_reward("format", pattern=r".*Answer:")("x\nAnswer: 3", None) == 1.0


def test_weighted_sum_of_builtin_and_user_rewards():
    reward = get_reward(
        "weighted_sum",
        terms=[
            {"reward": "math", "weight": 1.0},
            {"reward": "format", "weight": 0.5},
            {"reward": "reward_helpers:length_reward", "weight": 0.01, "options": {"scale": 2.0}},
        ],
    )
    response = "<think>x</think>\\boxed{2}"  # 25 characters
    assert reward(response, "2") == pytest.approx(1.0 + 0.5 + 0.01 * 2.0 * 25)
    assert reward(response, "3") == pytest.approx(0.5 + 0.5)


def test_weighted_sum_rejects_bad_terms():
    with pytest.raises(ValueError):
        get_reward("weighted_sum", terms=[])("x", None)
    with pytest.raises(ValueError, match="valid names"):
        get_reward("weighted_sum", terms=[{"reward": "nope"}])("x", None)
