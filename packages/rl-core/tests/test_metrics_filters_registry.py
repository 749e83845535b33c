import math

import pytest

from rl_core.filters import GROUP_FILTERS, nonzero_std, split_groups
from rl_core.metrics import pass_at_k, pass_at_k_groups, summarize
from rl_core.registry import Registry


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # only 2 wrong: any 3 include a right one
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_pass_at_k_groups():
    groups = [[True, False, False, False], [False, False], [True, True, True, True]]
    out = pass_at_k_groups(groups, ks=[1, 4])
    assert out["pass@1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert out["pass@4"] == pytest.approx((1.0 + 1.0) / 2)  # group of 2 skipped for k=4


def test_summarize_counts_nonfinite():
    out = summarize([1.0, 3.0, float("nan"), float("inf")], "reward")
    assert out == {
        "reward/count": 2.0,
        "reward/nonfinite": 2.0,
        "reward/mean": 2.0,
        "reward/std": 1.0,
        "reward/min": 1.0,
        "reward/max": 3.0,
    }


def test_filters():
    assert nonzero_std([0.0, 1.0])
    assert not nonzero_std([1.0, 1.0, 1.0])
    assert not nonzero_std([1.0])
    # unbiased std: [0, 1.5e-6] has sample std 1.06e-6 > 1e-6 (population std 0.75e-6)
    assert nonzero_std([0.0, 1.5e-6]) and not nonzero_std([0.0, 1.4e-6])
    assert GROUP_FILTERS.get("not_all_correct")([1.0, 0.0])
    assert not GROUP_FILTERS.get("not_all_correct")([1.0, 1.0])
    assert GROUP_FILTERS.get("any_correct")([0.0, 1.0])
    assert GROUP_FILTERS.get("keep_all")([0.0, 0.0])
    kept, dropped = split_groups([[0, 1], [1, 1], [0, 0], [0.5, 1]], nonzero_std)
    assert kept == [0, 3] and dropped == [1, 2]
    with pytest.raises(ValueError, match="any_correct, keep_all, nonzero_std, not_all_correct"):
        GROUP_FILTERS.get("zero_std")


def test_registry_rejects_duplicates_and_unknowns():
    things = Registry("widget")
    things.register("a")(1)
    assert things.get("a") == 1 and "a" in things and len(things) == 1
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        things.register("a")(2)
    with pytest.raises(ValueError, match="unknown widget 'b'; choose one of: a"):
        things.get("b")
