"""Decide whether two final answers are mathematically the same.

Policy (documented because graders differ):
- Exact values compare exactly (``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``2\\sqrt{2}`` = ``\\sqrt{8}``).
- When either side is written with a decimal point, a relative tolerance ``rel_tol``
  (default 1e-6) applies, so ``0.333333`` matches ``1/3`` but ``0.333`` does not (strict).
- Expressions with variables are equal when they agree numerically at three points (each
  variable's values are fixed by its name, with mixed signs), which decides identities such
  as ``(x+1)^2`` = ``x^2+2x+1`` without a slow ``simplify``. An expression undefined or
  beyond about 1e308 at a point is not compared numerically (``numeric.evaluate``).
- Equations match when ``lhs - rhs`` agree up to a non-zero constant factor.
- An integer written right before an integer ``\\frac`` is a mixed number
  (``2\\frac{1}{2}`` = 5/2), as in school answers and math-verify.
- A percent on one side also accepts the value divided by 100 (``50\\%`` = ``0.5`` = ``50``).
- Tuples and intervals compare in order with the same brackets; sets and bare comma lists
  compare as multisets; matrices cell by cell.
- What cannot be parsed is compared as text (case, spaces and ``\\text`` ignored); so is
  what is too large to parse quickly (see ``bounds``).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from fractions import Fraction
from typing import TYPE_CHECKING

from rl_rewards.math import bounds
from rl_rewards.math.normalize import normalize_answer
from rl_rewards.math.structure import Answer, parse_structure

if TYPE_CHECKING:
    import sympy

_DECIMAL_RE = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)$")
_FRAC_RE = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{(\d+)\}$")
_SLASH_RE = re.compile(r"^([-+]?\d+)\s*/\s*(\d+)$")
_MIXED_RE = re.compile(r"^([-+]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}$")
_NUM_POINTS = 3
_EXACT_TOL = 1e-10
_WORD_RE = re.compile(
    r"(?<![\\a-zA-Z])(?!(?:sqrt|sin|cos|tan|cot|sec|csc|log|exp|arc|sinh|cosh|tanh)\b)[a-zA-Z]{3,}"
)


@functools.lru_cache(maxsize=8192)
def _as_number(text: str) -> Fraction | None:
    """The exact value of a plain integer, decimal or integer fraction, else None (also for
    numbers longer than ``bounds.MAX_DIGITS``, which are compared as text)."""
    if len(text) > bounds.MAX_DIGITS:
        return None
    if _DECIMAL_RE.match(text):
        return Fraction(text)
    mixed = _MIXED_RE.match(text)
    if mixed and int(mixed.group(4)) != 0:  # 2\frac{1}{2} is the mixed number 5/2
        value = int(mixed.group(2)) + Fraction(int(mixed.group(3)), int(mixed.group(4)))
        return -value if mixed.group(1) == "-" else value
    match = _FRAC_RE.match(text) or _SLASH_RE.match(text)
    if match is None:
        return None
    groups = match.groups()
    sign, numerator, denominator = ("", *groups) if len(groups) == 2 else groups
    if int(denominator) == 0:
        return None
    value = Fraction(int(numerator), int(denominator))
    return -value if sign == "-" else value


@functools.lru_cache(maxsize=8192)
def _to_sympy(text: str) -> sympy.Expr | None:
    """The sympy value of ``text``; None for words (3+ letters: text, not a product) or junk."""
    if _WORD_RE.search(text):
        return None
    from rl_rewards.math.latex import LatexParseError, parse_latex  # sympy: only when needed

    try:
        return parse_latex(text)
    except (LatexParseError, TypeError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _close(a: complex, b: complex, tol: float) -> bool:
    scale = max(abs(a), abs(b))
    return scale < 1e-12 or abs(a - b) <= tol * scale


def _fractions_close(a: Fraction, b: Fraction, inexact: bool, tol: float) -> bool:
    diff = abs(a - b)
    return diff == 0 or (inexact and diff <= Fraction(repr(tol)) * max(abs(a), abs(b)))


def _point(symbol: sympy.Symbol, offset: int) -> float:
    """The value of ``symbol`` at test point ``offset``: fixed by its name (so an expression's
    values do not depend on what it is compared with, and are computed once), in
    [0.3, 3.6), negative at the last point."""
    digest = hashlib.blake2b(f"{symbol.name}/{offset}".encode(), digest_size=8).digest()
    magnitude = 0.3 + 3.3 * int.from_bytes(digest, "big") / 2**64
    return -magnitude if offset == _NUM_POINTS - 1 else magnitude


@functools.lru_cache(maxsize=8192)
def _values(expr: sympy.Expr) -> tuple[complex, ...] | None:
    """``expr`` at the test points (one point when it has no symbols), or None where it is
    undefined or too large there (``numeric.evaluate``)."""
    from rl_rewards.math.numeric import evaluate

    symbols = expr.free_symbols
    values = []
    for offset in range(_NUM_POINTS if symbols else 1):
        value = evaluate(expr, {s: _point(s, offset) for s in symbols})
        if value is None:
            return None
        values.append(value)
    return tuple(values)


def _paired(a: sympy.Expr, b: sympy.Expr) -> list[tuple[complex, complex]] | None:
    """The values of ``a`` and ``b`` at the same test points, or None."""
    va, vb = _values(a), _values(b)
    if va is None or vb is None:
        return None
    return [(va[i % len(va)], vb[i % len(vb)]) for i in range(max(len(va), len(vb)))]


def _sympy_equal(a: sympy.Expr, b: sympy.Expr, inexact: bool, tol: float) -> bool:
    if a == b:
        return True
    if a.is_Rational and b.is_Rational:  # exact numbers: no need to evaluate
        return _fractions_close(Fraction(a.p, a.q), Fraction(b.p, b.q), inexact, tol)
    pairs = _paired(a, b)
    if pairs is None or not all(_close(va, vb, tol) for va, vb in pairs):
        return False
    return inexact or not _differ_by_a_constant(a, b)


def _differ_by_a_constant(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True when ``a`` and ``b`` are one expression plus two different exact constants: at a
    large scale their values agree to every digit (``P^{300}`` and ``P^{300} + 1``), yet they
    are not equal."""
    (const_a, rest_a), (const_b, rest_b) = a.as_coeff_Add(), b.as_coeff_Add()
    return const_a != const_b and rest_a == rest_b


def _text_key(text: str) -> str:
    return re.sub(r"[\s{}()\\]|text", "", text).lower()


def scalars_equal(pred: str, gold: str, rel_tol: float) -> bool:
    """Two scalar answers: fast exact numbers first, then sympy, then text."""
    if pred == gold:
        return True
    inexact = "." in pred or "." in gold
    tol = rel_tol if inexact else _EXACT_TOL
    pred_number, gold_number = _as_number(pred), _as_number(gold)
    if pred_number is not None and gold_number is not None:
        return _fractions_close(pred_number, gold_number, inexact, tol)
    pred_expr = _to_sympy(pred)  # prose stops here, before the label is parsed
    gold_expr = _to_sympy(gold) if pred_expr is not None else None
    if pred_expr is None or gold_expr is None:
        return _text_key(pred) == _text_key(gold)
    return _sympy_equal(pred_expr, gold_expr, inexact, tol)


def _equations_equal(pred: Answer, gold: Answer, rel_tol: float) -> bool:
    (pl, pr), (gl, gr) = ((x.text for x in side.items) for side in (pred, gold))
    if scalars_equal(pl, gl, rel_tol) and scalars_equal(pr, gr, rel_tol):
        return True
    exprs = [_to_sympy(x) for x in (pl, pr, gl, gr)]
    if any(e is None for e in exprs):
        return False
    return _proportional(exprs[0] - exprs[1], exprs[2] - exprs[3])


def _proportional(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True when ``a = c * b`` for one non-zero constant c, judged at the test points."""
    pairs = _paired(a, b)
    if pairs is None or any(abs(va) < 1e-12 or abs(vb) < 1e-12 for va, vb in pairs):
        return False
    ratios = [va / vb for va, vb in pairs]
    return all(_close(r, ratios[0], _EXACT_TOL) for r in ratios)


def _multiset_equal(pred: tuple[Answer, ...], gold: tuple[Answer, ...], rel_tol: float) -> bool:
    """Same items in any order: identical items pair off first (hashing), the rest pairwise
    (at most ``bounds.MAX_LEAVES`` squared comparisons)."""
    if len(pred) != len(gold):
        return False
    unused_counts = Counter(pred)
    rest = []
    for item in gold:
        if unused_counts[item]:
            unused_counts[item] -= 1
        else:
            rest.append(item)
    unused = list(unused_counts.elements())
    for item in rest:
        match = next((p for p in unused if trees_equal(p, item, rel_tol)), None)
        if match is None:
            return False
        unused.remove(match)
    return True


def trees_equal(pred: Answer, gold: Answer, rel_tol: float) -> bool:
    """Structural comparison of two ``Answer`` trees (see the module docstring)."""
    if pred.kind == "set" and len(pred.items) == 1 and gold.kind != "set":
        return trees_equal(pred.items[0], gold, rel_tol)
    if gold.kind == "set" and len(gold.items) == 1 and pred.kind != "set":
        return trees_equal(pred, gold.items[0], rel_tol)
    if pred.kind != gold.kind:
        return False
    if pred.kind == "scalar":
        return scalars_equal(pred.text, gold.text, rel_tol)
    if pred.kind == "equation":
        return _equations_equal(pred, gold, rel_tol)
    if pred.kind in ("set", "union"):
        return _multiset_equal(pred.items, gold.items, rel_tol)
    if pred.brackets != gold.brackets or len(pred.items) != len(gold.items):
        return False
    return all(trees_equal(p, g, rel_tol) for p, g in zip(pred.items, gold.items, strict=True))


def is_equivalent(prediction: str, reference: str, *, rel_tol: float = 1e-6) -> bool:
    """True when the answer ``prediction`` equals ``reference`` (both already extracted)."""
    pred, gold = normalize_answer(prediction), normalize_answer(reference)
    if not pred.text or not gold.text:
        return False
    if pred.text == gold.text or trees_equal(
        parse_structure(pred.text), parse_structure(gold.text), rel_tol
    ):
        return True
    if pred.percent != gold.percent:
        scaled, other = (pred, gold) if pred.percent else (gold, pred)
        return scalars_equal(f"\\frac{{{scaled.text}}}{{100}}", other.text, rel_tol)
    return False
