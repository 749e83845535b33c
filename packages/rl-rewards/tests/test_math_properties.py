"""Property tests of the math verifier: invariances that must hold for any numbers."""

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from rl_rewards.math.equivalence import is_equivalent

numerators = st.integers(min_value=-10_000, max_value=10_000)
denominators = st.integers(min_value=1, max_value=500)


@settings(max_examples=60, deadline=None)
@given(numerators, denominators, st.integers(min_value=2, max_value=9))
def test_scaled_fraction_forms_are_equal_and_off_by_one_is_not(a, b, k):
    value = Fraction(a, b)
    latex = f"\\frac{{{a}}}{{{b}}}"
    assert is_equivalent(f"\\dfrac{{{a * k}}}{{{b * k}}}", latex)
    assert is_equivalent(f"{value.numerator}/{value.denominator}", latex)
    assert not is_equivalent(f"\\frac{{{a + 1}}}{{{b}}}", latex)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1000, max_value=10**9))
def test_thousands_separators_and_trailing_zeros(n):
    assert is_equivalent(f"{n:,}", str(n))
    assert is_equivalent(f"{n}.00", str(n))
    assert not is_equivalent(f"{n:,}", str(n + 1))


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=-20, max_value=20), st.integers(min_value=-20, max_value=20))
def test_factored_and_expanded_quadratics_agree(p, q):
    expanded = f"x^2 + ({p + q})x + ({p * q})"
    assert is_equivalent(f"(x + ({p}))(x + ({q}))", expanded)
    assert not is_equivalent(f"(x + ({p}))(x + ({q + 1}))", expanded)
