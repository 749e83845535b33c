"""Pieces of the math verifier: extraction, normalisation, the LaTeX parser and options."""

import pytest
import sympy

from rl_rewards import get_reward
from rl_rewards.math.equivalence import is_equivalent
from rl_rewards.math.extract import extract_answer, last_boxed
from rl_rewards.math.latex import LatexParseError, parse_latex
from rl_rewards.math.normalize import normalize_answer


def test_last_boxed_handles_nested_braces_and_fbox():
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{1} then \\fbox{2}") == "2"
    assert last_boxed("\\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None


def test_extraction_order_and_strict_mode():
    assert extract_answer("The answer is $\\frac{1}{2}$.") == "\\frac{1}{2}"
    assert extract_answer("we had $x$ and then $y+1$") == "y+1"
    assert extract_answer("numbers 3 and 4") == "4"
    assert extract_answer("The answer is 5", fallback=False) is None
    assert get_reward("math", strict_box=True)("The answer is 5", "5") == 0.0
    assert get_reward("math", strict_box=True)("\\boxed{5}", "5") == 1.0


def test_normalize_reports_percent_and_strips_units():
    assert normalize_answer("50\\%").text == "50"
    assert normalize_answer("50\\%").percent
    assert normalize_answer("\\text{5 cm}").text == "5"
    assert normalize_answer("x = \\dfrac{1}{2}").text == "\\frac{1}{2}"
    assert normalize_answer("1,234").text == "1234"
    assert normalize_answer("(1,234)").text == "(1,234)"  # a tuple keeps its comma


def test_parser_builds_exact_sympy_values():
    x = sympy.Symbol("x")
    assert parse_latex("\\frac{1}{2}") == sympy.Rational(1, 2)
    assert parse_latex("0.1") == sympy.Rational(1, 10)
    assert parse_latex("3x^2") == 3 * x**2
    assert parse_latex("\\sqrt[3]{8}") == 2
    assert parse_latex("2^3^2") == 2**9  # right-associative


@pytest.mark.parametrize("text", ["10^{10^{10}}", "1000!", "\\frac{1}{", "\\unknowncmd{2}", "2+"])
def test_parser_refuses_huge_or_malformed_input(text):
    with pytest.raises(LatexParseError):
        parse_latex(text)


def test_rel_tol_option_controls_decimal_matching():
    assert not is_equivalent("0.333", "\\frac{1}{3}")
    assert is_equivalent("0.333", "\\frac{1}{3}", rel_tol=1e-2)
    assert get_reward("math", rel_tol=1e-2)("\\boxed{3.14}", "\\pi") == 1.0


def test_equivalence_is_symmetric_on_a_sample():
    pairs = [("\\frac{1}{2}", "0.5"), ("(1,2]", "(1,2)"), ("x^2-1", "(x-1)(x+1)"), ("50\\%", "0.5")]
    for a, b in pairs:
        assert is_equivalent(a, b) == is_equivalent(b, a)


def test_label_with_boxed_solution_uses_the_box():
    assert get_reward("math")("\\boxed{7}", "so we get \\boxed{7}.") == 1.0


def test_math_without_label_is_a_value_error():
    with pytest.raises(ValueError, match="label"):
        get_reward("math")("\\boxed{1}", None)


def test_deepscaler_requires_closed_thinking_and_a_box():
    reward = get_reward("deepscaler")
    assert reward("<think>hmm</think> so \\boxed{4}", "4") == 1.0
    assert reward("<think>hmm so \\boxed{4}", "4") == 0.0
    assert reward("<think>\\boxed{4}</think> it is 4", "4") == 0.0
    assert reward("<think>x</think>\\boxed{5}", ["4", "5"]) == 1.0
