"""The value of a parsed answer at one point, in bounded time.

sympy's ``evalf`` guarantees its digits by evaluating sub-expressions again at a rising
precision; on nested powers, floors or complex intermediate values that took seconds (at
depth 8) to hours, and huge arguments (``e^{e^{e^{x}}}``) ran out of memory. Here each node
is computed once, with mpmath at a fixed 128 bits (about 38 digits, ample for the 1e-10
tolerance of exact answers), and a node whose magnitude leaves the double range ends the
evaluation: no later node ever works on a huge argument. The cost is linear in the size of
the expression, which ``latex`` bounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mpmath

if TYPE_CHECKING:
    import sympy

_CTX = mpmath.MPContext()  # a private context: its precision is never changed
_CTX.prec = 128
_LIMIT = _CTX.mpf(2) ** 1023  # largest magnitude kept: a double holds it
_MAX_BINOMIAL_ARGUMENT = 10**6  # mpmath's gamma functions slow down beyond
_FUNCTIONS = {
    name: getattr(_CTX, name)
    for name in (
        "exp",
        "log",
        "sin",
        "cos",
        "tan",
        "cot",
        "sec",
        "csc",
        "asin",
        "acos",
        "atan",
        "sinh",
        "cosh",
        "tanh",
    )
}


class _Unbounded(ArithmeticError):
    """A value is undefined, infinite or too large, or of a kind the parser never builds."""


def evaluate(expr: sympy.Expr, values: dict) -> complex | None:
    """``expr`` with each free symbol set to its float in ``values``; None where a part of it
    is undefined (pole, log of 0), beyond about 1e308 in magnitude, or not understood."""
    try:
        return complex(_evaluate(expr, values))
    except (_Unbounded, ZeroDivisionError, ValueError, KeyError):
        return None


def _bounded(value: mpmath.mpf | mpmath.mpc) -> mpmath.mpf | mpmath.mpc:
    if not _CTX.isfinite(value) or abs(value) > _LIMIT:
        raise _Unbounded("not finite or too large")
    return value


def _evaluate(expr: sympy.Expr, values: dict) -> mpmath.mpf | mpmath.mpc:
    if expr.is_Symbol:
        return _CTX.mpf(values[expr])
    if expr.is_Rational:
        return _bounded(_CTX.mpf(expr.p) / expr.q)
    if expr.is_Float or expr.is_NumberSymbol:  # pi, E, ...: sympy gives their digits
        return _CTX.mpf(expr.evalf(45)._mpf_)
    if type(expr).__name__ == "ImaginaryUnit":
        return _CTX.mpc(0, 1)
    if expr.is_Atom:  # infinities, nan
        raise _Unbounded(f"{expr} has no finite value")
    args = [_evaluate(arg, values) for arg in expr.args]
    if expr.is_Add:
        return _bounded(_CTX.fsum(args))
    if expr.is_Mul:
        return _bounded(_CTX.fprod(args))
    if expr.is_Pow:
        exponent = int(expr.exp) if expr.exp.is_Integer else args[1]
        return _bounded(_CTX.power(args[0], exponent))
    return _bounded(_function(type(expr).__name__, args))


def _function(name: str, args: list) -> mpmath.mpf | mpmath.mpc:
    if name in _FUNCTIONS and len(args) == 1:
        return _FUNCTIONS[name](args[0])
    if name == "Abs":
        return abs(args[0])
    if name in ("floor", "ceiling"):
        if _CTX.im(args[0]) != 0:
            raise _Unbounded("floor or ceiling of a complex number")
        rounded = _CTX.floor if name == "floor" else _CTX.ceil
        return rounded(_CTX.re(args[0]))
    if name == "binomial" and all(abs(a) <= _MAX_BINOMIAL_ARGUMENT for a in args):
        return _CTX.binomial(*args)
    raise _Unbounded(f"no rule for {name}")
