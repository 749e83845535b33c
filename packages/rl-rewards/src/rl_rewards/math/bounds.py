"""Limits that bound the work of verifying one answer, whatever text it comes from.

Model outputs are prose as often as maths, and a verifier that takes minutes on one sample
stalls a whole rollout batch. So the cost is bounded by what is parsed, not by a timer:

- ``MAX_TOKENS`` / ``MAX_NESTING`` / ``MAX_TOWER``: a scalar expression longer, deeper or
  with more symbolic exponents stacked is not parsed (it is compared as text), so sympy
  never builds a huge tree, no recursion runs deep, and sympy's assumption queries on power
  towers (about 7x slower per level: ``0.5^{0.5^{...^{x}}}`` of height 7 took 17 s) stay
  cheap.
- ``MAX_DIGITS``: no exact number with more digits is built; powers, binomials and roots
  are checked before sympy evaluates them (``check_power``, ``check_binomial``,
  ``check_exact``).
- ``numeric.evaluate`` computes each node once at a fixed precision and stops at the first
  value beyond the double range (towers such as ``e^{e^{e^{x}}}``, ``x^{10^{500}}``).
- ``MAX_LEAVES`` / ``MAX_DEPTH`` (used by ``structure``): answers with more items or
  deeper brackets are compared as text, which keeps pairwise set matching small.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sympy

MAX_TOKENS = 256
MAX_NESTING = 32
MAX_TOWER = 2
MAX_DIGITS = 2000
MAX_ROOT_DIGITS = 300  # roots of larger exact numbers make sympy search for perfect powers
MAX_LEAVES = 100
MAX_DEPTH = 8
_LOG10_2 = math.log10(2)


class TooLarge(ValueError):
    """Building this value exactly would take too long."""


def log10_size(number: sympy.Rational) -> float:
    """About how many digits the larger of numerator and denominator has (0 for 0, 1, -1)."""
    return (max(abs(number.p).bit_length(), number.q.bit_length()) - 1) * _LOG10_2


def _exact_size(expr: sympy.Expr) -> float:
    """Digits of the largest exact number inside ``expr`` (what a power would raise)."""
    import sympy

    return max((log10_size(r) for r in expr.atoms(sympy.Rational)), default=0.0)


def check_exact(value: sympy.Expr) -> sympy.Expr:
    """``value`` itself, or TooLarge when its rational coefficient has too many digits."""
    coefficient = value.as_coeff_Mul()[0]
    if coefficient.is_Rational and log10_size(coefficient) > MAX_DIGITS:
        raise TooLarge("number with too many digits")
    return value


def tower_height(expr: sympy.Expr) -> int:
    """How many symbolic exponents are stacked in ``expr``: 0 for ``x^2``, 1 for ``e^x``,
    2 for ``x^{y^z}``."""
    heights = [tower_height(arg) for arg in expr.args]
    if expr.is_Pow and not expr.exp.is_Number:
        heights.append(1 + heights[1])
    elif type(expr).__name__ == "exp":
        heights.append(1 + heights[0])
    return max(heights, default=0)


def check_tower(exponent: sympy.Expr) -> None:
    """TooLarge when raising to ``exponent`` would stack more than ``MAX_TOWER`` exponents."""
    if not exponent.is_Number and 1 + tower_height(exponent) > MAX_TOWER:
        raise TooLarge(f"power tower higher than {MAX_TOWER}")


def check_power(base: sympy.Expr, exponent: sympy.Expr) -> None:
    """TooLarge when sympy would compute ``base ** exponent`` exactly at a great cost.

    sympy raises exact numbers inside the base (``(2x)^n`` gives ``2^n x^n``), and takes
    roots of them by searching for perfect powers; symbolic bases and exponents stay
    unevaluated (their size is ``numeric.evaluate``'s business).
    """
    check_tower(exponent)
    if not exponent.is_Rational:
        return
    size = _exact_size(base)
    if size == 0:
        return
    if exponent.q != 1 and size > MAX_ROOT_DIGITS:
        raise TooLarge("root of a number with too many digits")
    if log10_size(exponent) > 6 or abs(exponent.p) / exponent.q * size > MAX_DIGITS:
        raise TooLarge("power too large to evaluate")


def check_binomial(n: sympy.Expr, k: sympy.Expr) -> None:
    """TooLarge for a binomial coefficient that sympy would multiply out at length: with an
    integer ``k`` and a constant ``n`` it builds a product of ``min(k, n - k)`` factors."""
    if not (k.is_Integer and n.is_number):
        return
    if not n.is_Rational:
        raise TooLarge("binomial of an irrational number: not an answer")
    steps = min(abs(k), abs(n - k)) if n.is_Integer and n >= 0 else abs(k)
    if steps * max(log10_size(n), 1.0) > MAX_DIGITS:
        raise TooLarge("binomial too large to evaluate")
