"""pass@k: hand values and agreement with brute-force enumeration of k-subsets."""

from itertools import combinations

import pytest

from rl_rewards.metrics import pass_at_k, pass_at_k_by_group, summarize_scores


def brute_force(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def test_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k failures


@pytest.mark.parametrize("n", [1, 3, 6])
def test_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k))


def test_invalid_arguments():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_groups_and_summary():
    groups = ["a", "a", "b", "b", "b"]
    correct = [True, False, False, False, False]
    result = pass_at_k_by_group(groups, correct, [1, 2, 3])
    assert result["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert result["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert result["pass@3"] == 0.0  # only group b has 3 samples
    summary = summarize_scores([1.0, 0.0, 0.5], ["ok", "error", "timeout"], group_ids=None)
    assert summary == {"num_scored": 3, "mean": 0.5, "num_errors": 1, "num_timeouts": 1}
