"""Dynamic-sampling filters: decide per group (the samples of one prompt) whether it is kept.

A group whose rewards are all equal has zero advantage under GRPO and teaches nothing;
DAPO's dynamic sampling drops such groups and over-samples until the batch is full.
Every filter takes the group's scalar rewards and returns True to keep it.
"""

import math
from collections.abc import Callable, Sequence

from rl_core.registry import CallShape, Registry

GroupFilter = Callable[[Sequence[float]], bool]
GROUP_FILTER_SHAPE = CallShape(1, (), "fn(rewards: Sequence[float]) -> bool (True keeps the group)")
GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter", GROUP_FILTER_SHAPE)


@GROUP_FILTERS.register("nonzero_std")
def nonzero_std(rewards: Sequence[float], *, tolerance: float = 1e-6) -> bool:
    """Keep groups whose rewards are not all the same: unbiased std above ``tolerance``,
    the std that GRPO normalises by (slime's ``check_reward_nonzero_std``)."""
    if len(rewards) < 2:
        return False
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) > tolerance


@GROUP_FILTERS.register("not_all_correct")
def not_all_correct(rewards: Sequence[float], *, correct: float = 1.0) -> bool:
    """Drop groups that the policy already solves every time."""
    return any(r < correct for r in rewards)


@GROUP_FILTERS.register("any_correct")
def any_correct(rewards: Sequence[float], *, correct: float = 1.0) -> bool:
    """Keep groups with at least one correct sample."""
    return any(r >= correct for r in rewards)


@GROUP_FILTERS.register("keep_all")
def keep_all(rewards: Sequence[float]) -> bool:
    """No filtering."""
    del rewards
    return True


def split_groups(
    rewards_by_group: Sequence[Sequence[float]], group_filter: GroupFilter
) -> tuple[list[int], list[int]]:
    """Indices of the groups kept and of those dropped by ``group_filter``."""
    kept, dropped = [], []
    for index, rewards in enumerate(rewards_by_group):
        (kept if group_filter(rewards) else dropped).append(index)
    return kept, dropped
