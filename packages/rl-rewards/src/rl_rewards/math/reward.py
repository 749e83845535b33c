"""The ``math`` and ``deepscaler`` rewards: extract the final answer, compare with the label."""

from __future__ import annotations

from rl_rewards.math.equivalence import is_equivalent
from rl_rewards.math.extract import extract_answer, last_boxed
from rl_rewards.registry import register_reward


def reference_answer(label: object) -> str:
    """The gold answer string of a label (a boxed solution is reduced to its box)."""
    if label is None:
        raise ValueError("math reward needs a label (the reference answer); got None")
    text = str(label)
    return last_boxed(text) or text


@register_reward(
    "math",
    "last \\boxed{} (or 'The answer is'), LaTeX-normalised, symbolic/numeric equivalence; 1/0",
)
def math_reward(
    response: str, label: object, *, strict_box: bool = False, rel_tol: float = 1e-6
) -> float:
    """1.0 when the response's final answer equals the label, else 0.0.

    ``strict_box`` accepts only a ``\\boxed{}`` answer; ``rel_tol`` applies to decimals.
    """
    answer = extract_answer(response, fallback=not strict_box)
    if answer is None:
        return 0.0
    return 1.0 if is_equivalent(answer, reference_answer(label), rel_tol=rel_tol) else 0.0


@register_reward("deepscaler", "DeepScaleR: needs '</think>', then the boxed answer after it; 1/0")
def deepscaler_reward(response: str, label: object) -> float:
    """1.0 when a reasoning block was closed and the boxed answer after it is right."""
    if "</think>" not in response:
        return 0.0
    solution = response.split("</think>", 1)[1]
    answer = last_boxed(solution)
    if answer is None:
        return 0.0
    labels = label if isinstance(label, list | tuple) else [label]
    return 1.0 if any(is_equivalent(answer, reference_answer(g)) for g in labels) else 0.0
