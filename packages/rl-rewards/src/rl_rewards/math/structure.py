"""Split a normalised answer into its shape: a scalar, an equation, a set, an ordered tuple or
interval (with its bracket kinds), a union of intervals, or a matrix.

An ``Answer`` tree is compared item by item in ``equivalence``; leaves are strings that
``latex.parse_latex`` turns into sympy. Text with more than ``bounds.MAX_LEAVES`` items or
brackets nested deeper than ``bounds.MAX_DEPTH`` stays one scalar (compared as text), which
bounds the pairwise work of comparing sets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rl_rewards.math import bounds

_MATRIX_RE = re.compile(r"^\\begin\{([pbvBV]?matrix|array)\}(?:\{[^}]*\})?(.*)\\end\{\1\}$", re.S)
_OPENERS = {"(": ")", "[": "]", "{": "}"}


class _TooLarge(Exception):
    """The answer has more items or deeper brackets than ``bounds`` allows."""


@dataclass(frozen=True)
class Answer:
    """One node: ``kind`` is scalar | equation | set | tuple | union | matrix.

    ``items`` are child Answers (for a scalar, ``text`` holds the expression); ``brackets``
    is the opening and closing bracket of a tuple/interval, e.g. "(]" for (a, b].
    """

    kind: str
    text: str = ""
    items: tuple[Answer, ...] = ()
    brackets: str = ""


def split_top_level(text: str, separator: str) -> list[str]:
    """Split ``text`` at ``separator`` where no bracket is open."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        char = text[i]
        if text.startswith("\\left", i) or text.startswith("\\right", i):
            i += 5
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + len(separator)
            i = start
            continue
        i += 1
    parts.append(text[start:])
    return [part.strip() for part in parts]


def _closes_at_end(text: str) -> bool:
    """True when the bracket opening ``text[0]`` closes at its last character."""
    depth = 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0:
            return i == len(text) - 1
    return False


def _matrix(body: str, depth: int) -> Answer:
    rows = [row for row in (r.strip() for r in body.split("\\\\")) if row]
    cells = [
        Answer("tuple", items=tuple(_parse(c, depth) for c in row.split("&")), brackets="()")
        for row in rows
    ]
    return Answer("matrix", items=tuple(cells))


def _num_leaves(answer: Answer) -> int:
    return sum(_num_leaves(item) for item in answer.items) if answer.items else 1


def parse_structure(text: str) -> Answer:
    """The ``Answer`` tree of one normalised answer string."""
    text = text.strip()
    try:
        answer = _parse(text, 0)
    except _TooLarge:
        return Answer("scalar", text)
    return answer if _num_leaves(answer) <= bounds.MAX_LEAVES else Answer("scalar", text)


def _parse(text: str, depth: int) -> Answer:
    if depth > bounds.MAX_DEPTH:
        raise _TooLarge
    text, depth = text.strip(), depth + 1
    matrix = _MATRIX_RE.match(text)
    if matrix:
        return _matrix(matrix.group(2), depth)
    union = split_top_level(text, "\\cup")
    if len(union) > 1:
        return Answer("union", items=tuple(_parse(part, depth) for part in union))
    if text.startswith("\\{") and text.endswith("\\}"):
        inner = split_top_level(text[2:-2], ",")
        return Answer("set", items=tuple(_parse(p, depth) for p in inner))
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]" and _closes_at_end(text):
        parts = split_top_level(text[1:-1], ",")
        if len(parts) > 1:
            items = tuple(_parse(p, depth) for p in parts)
            return Answer("tuple", items=items, brackets=text[0] + text[-1])
    parts = split_top_level(text, ",")
    if len(parts) > 1:
        return Answer("set", items=tuple(_parse(p, depth) for p in parts))
    if "\\pm" in text:
        plus, minus = text.replace("\\pm", "+", 1), text.replace("\\pm", "-", 1)
        return Answer("set", items=(Answer("scalar", plus), Answer("scalar", minus)))
    sides = split_top_level(text, "=")
    if len(sides) == 2 and all(sides):
        return Answer("equation", items=(Answer("scalar", sides[0]), Answer("scalar", sides[1])))
    return Answer("scalar", text)
