"""Table-driven test of the ``math`` reward (cases in ``math_cases.py``)."""

import pytest
from math_cases import ALL_CASES, EXTRACTION

from rl_rewards import get_reward

math_reward = get_reward("math")


def test_table_is_large_enough():
    assert len(ALL_CASES) >= 150
    assert sum(not expected for _, _, expected in ALL_CASES) >= 40


def _as_response(prediction: str, case: tuple) -> str:
    """Extraction cases are whole responses; the others are answers, written in a box."""
    return prediction if case in EXTRACTION else f"So the result is \\boxed{{{prediction}}}."


@pytest.mark.parametrize(("prediction", "reference", "expected"), ALL_CASES)
def test_math_table(prediction, reference, expected):
    response = _as_response(prediction, (prediction, reference, expected))
    assert math_reward(response, reference) == (1.0 if expected else 0.0)
