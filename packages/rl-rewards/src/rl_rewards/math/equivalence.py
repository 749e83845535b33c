"""Decide whether two final answers are mathematically the same.

Policy (documented because graders differ):
- Exact values compare exactly (``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``2\\sqrt{2}`` = ``\\sqrt{8}``).
- When either side is written with a decimal point, a relative tolerance ``rel_tol``
  (default 1e-6) applies, so ``0.333333`` matches ``1/3`` but ``0.333`` does not (strict).
- Expressions with variables are equal when they agree numerically at several fixed points
  (mixed signs), which decides identities such as ``(x+1)^2`` = ``x^2+2x+1`` without a slow
  ``simplify``.
- Equations match when ``lhs - rhs`` agree up to a non-zero constant factor.
- An integer written right before an integer ``\\frac`` is a mixed number
  (``2\\frac{1}{2}`` = 5/2), as in school answers and math-verify.
- A percent on one side also accepts the value divided by 100 (``50\\%`` = ``0.5`` = ``50``).
- Tuples and intervals compare in order with the same brackets; sets and bare comma lists
  compare as multisets; matrices cell by cell.
- What cannot be parsed is compared as text (case, spaces and ``\\text`` ignored).
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import TYPE_CHECKING

from rl_rewards.math.normalize import normalize_answer
from rl_rewards.math.structure import Answer, parse_structure

if TYPE_CHECKING:
    import sympy

_DECIMAL_RE = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)$")
_FRAC_RE = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{(\d+)\}$")
_SLASH_RE = re.compile(r"^([-+]?\d+)\s*/\s*(\d+)$")
_MIXED_RE = re.compile(r"^([-+]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}$")
_POINTS = (0.5377, 1.8339, -2.2588, 0.8622, 0.3188, -1.3077, -0.4336, 0.3426, 3.5784, 2.7694)
_EXACT_TOL = 1e-10
_WORD_RE = re.compile(
    r"(?<![\\a-zA-Z])(?!(?:sqrt|sin|cos|tan|cot|sec|csc|log|exp|arc|sinh|cosh|tanh)\b)[a-zA-Z]{3,}"
)


def _as_number(text: str) -> Fraction | None:
    """The exact value of a plain integer, decimal or integer fraction, else None."""
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


def _numeric(expr: sympy.Expr, subs: dict) -> complex | None:
    try:
        value = complex(expr.evalf(20, subs=subs))
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    return None if value != value else value  # NaN check


def _sympy_equal(a: sympy.Expr, b: sympy.Expr, tol: float) -> bool:
    import sympy

    if a == b:
        return True
    if any(x.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) for x in (a, b)):
        return False
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    for offset in range(3 if symbols else 1):
        subs = {s: _POINTS[(offset + 3 * k) % len(_POINTS)] for k, s in enumerate(symbols)}
        va, vb = _numeric(a, subs), _numeric(b, subs)
        if va is None or vb is None or not _close(va, vb, tol):
            return False
    return True


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
        diff = abs(pred_number - gold_number)
        return diff == 0 or (
            inexact and diff <= Fraction(repr(tol)) * max(abs(pred_number), abs(gold_number))
        )
    pred_expr, gold_expr = _to_sympy(pred), _to_sympy(gold)
    if pred_expr is None or gold_expr is None:
        return _text_key(pred) == _text_key(gold)
    return _sympy_equal(pred_expr, gold_expr, tol)


def _equations_equal(pred: Answer, gold: Answer, rel_tol: float) -> bool:
    (pl, pr), (gl, gr) = ((x.text for x in side.items) for side in (pred, gold))
    if scalars_equal(pl, gl, rel_tol) and scalars_equal(pr, gr, rel_tol):
        return True
    exprs = [_to_sympy(x) for x in (pl, pr, gl, gr)]
    if any(e is None for e in exprs):
        return False
    return _proportional(exprs[0] - exprs[1], exprs[2] - exprs[3])


def _proportional(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True when ``a = c * b`` for one non-zero constant c, judged at several points."""
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    ratios = []
    for offset in range(3):
        subs = {s: _POINTS[(offset + 3 * k) % len(_POINTS)] for k, s in enumerate(symbols)}
        va, vb = _numeric(a, subs), _numeric(b, subs)
        if va is None or vb is None or abs(vb) < 1e-12 or abs(va) < 1e-12:
            return False
        ratios.append(va / vb)
    return all(_close(r, ratios[0], _EXACT_TOL) for r in ratios)


def _multiset_equal(pred: tuple[Answer, ...], gold: tuple[Answer, ...], rel_tol: float) -> bool:
    if len(pred) != len(gold):
        return False
    unused = list(pred)
    for item in gold:
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
