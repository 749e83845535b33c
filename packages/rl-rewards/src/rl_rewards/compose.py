"""Composition: weighted sums of rewards, a format reward and DAPO's overlong penalty.

get_reward("weighted_sum", terms=[
    {"reward": "math", "weight": 1.0},
    {"reward": "format", "weight": 0.1},
    {"reward": "overlong", "weight": 1.0, "options": {"max_length": 4096, "buffer_length": 512}},
    {"reward": "my_pkg.rewards:style", "weight": 0.5},   # user function by dotted path
])
"""

from __future__ import annotations

import re

from rl_rewards.registry import get_reward, register_reward

DEFAULT_FORMAT = r"^\s*<think>.*?</think>.*\\boxed\{.*\}"
_LENGTH_UNITS = ("chars", "words")


def overlong_penalty(length: int, max_length: int, buffer_length: int) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer_length``, then falling
    linearly to -1 at ``max_length``, and -1 beyond it."""
    if not 0 <= buffer_length <= max_length:
        raise ValueError(
            f"need 0 <= buffer_length <= max_length, got {buffer_length}, {max_length}"
        )
    expected = max_length - buffer_length
    if length <= expected:
        return 0.0
    if length > max_length:
        return -1.0
    return (expected - length) / buffer_length


@register_reward(
    "overlong", "DAPO overlong shaping: 0, linear to -1 over the last buffer_length, then -1"
)
def overlong_reward(
    response: str, label: object, *, max_length: int, buffer_length: int, unit: str = "words"
) -> float:
    """``overlong_penalty`` of the response length counted in ``unit`` (chars or words)."""
    if unit not in _LENGTH_UNITS:
        raise ValueError(f"unknown length unit {unit!r}; valid: {list(_LENGTH_UNITS)}")
    length = len(response) if unit == "chars" else len(response.split())
    return overlong_penalty(length, max_length, buffer_length)


@register_reward(
    "format", "1 when the response matches a regex (default: <think>...</think> then \\boxed{})"
)
def format_reward(response: str, label: object, *, pattern: str = DEFAULT_FORMAT) -> float:
    """1.0 if ``pattern`` matches at the start of the response (DOTALL), else 0.0."""
    return 1.0 if re.match(pattern, response, re.DOTALL) else 0.0


@register_reward(
    "weighted_sum", "sum of weight * reward over 'terms' (names or pkg.module:function)"
)
def weighted_sum_reward(response: str, label: object, *, terms: list[dict]) -> float:
    """Sum over ``terms`` of ``weight * reward(response, label)``; each term is
    ``{"reward": name or dotted path, "weight": float, "options": {...}}``."""
    if not terms:
        raise ValueError("weighted_sum needs terms=[{'reward': name, 'weight': w}, ...]")
    total = 0.0
    for term in terms:
        if "reward" not in term:
            raise ValueError(f"weighted_sum term {term!r} has no 'reward' key")
        fn = get_reward(term["reward"], **term.get("options", {}))
        total += float(term.get("weight", 1.0)) * fn(response, label)
    return total
