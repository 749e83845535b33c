"""String-level LaTeX clean-up applied to an extracted answer before parsing.

``normalize_answer`` removes what never changes a value (math delimiters, spacing commands,
``\\left``/``\\right``, text wrappers, units, degree signs, thousands separators, ``x =``
prefixes) and reports whether a percent sign was present (the caller decides what it means).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DELETE = (
    "\\left",
    "\\right",
    "\\bigl",
    "\\bigr",
    "\\Bigl",
    "\\Bigr",
    "\\big",
    "\\Big",
    "\\displaystyle",
    "\\textstyle",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\quad",
    "\\qquad",
    "{,}",
    "^\\circ",
    "^{\\circ}",
    "\\circ",
    "\\degree",
    "°",
    "^{\\prime}",
    "\\$",
    "$",
)
_REPLACE = {
    "\\dfrac": "\\frac",
    "\\tfrac": "\\frac",
    "\\dbinom": "\\binom",
    "\\tbinom": "\\binom",
    "\\le ": "\\leq ",
    "\\ge ": "\\geq ",
    "\\neq": "\\ne",
    "−": "-",
    "×": "\\times ",
    "·": "\\cdot ",
    "÷": "\\div ",
    "π": "\\pi ",
    "∞": "\\infty ",
    "√": "\\sqrt",
    "\\ ": " ",
    "~": " ",
    "\\lbrace": "\\{",
    "\\rbrace": "\\}",
    "\\lvert": "|",
    "\\rvert": "|",
    "\\vert": "|",
    "\\mid": "|",
    "\\varnothing": "\\emptyset",
    "\\infin": "\\infty",
}
_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mathsf|mbox|operatorname|boldsymbol|hbox)\s*\{([^{}]*)\}"
)
_UNIT_WORDS = """
units unit cm km mm meters meter metres metre feet foot ft inches inch miles mile mph
kmh hours hour hrs hr minutes minute mins min seconds second sec days day weeks week
months month years year dollars dollar cents cent degrees degree deg radians rad pounds
pound lbs lb kg grams gram mg liters liter litres ml gallons gallon square sq cubic
points point people students percent sqft ounces oz tons ton
"""
_UNITS = frozenset(_UNIT_WORDS.split())
_UNIT_POWER = re.compile(r"\^\{?\d\}?$")
_ASCII_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PREFIX = re.compile(r"^\s*(?:[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+)\s*(?:=|\\in)\s*(?!.*=)")
_ROW_BREAK = "\x00"  # protects the matrix row separator "\\\\" from "\\ " handling
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_HALF = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\d)")
_FRAC_FIRST = re.compile(r"\\frac\s*(\d)\s*\{")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\d+|[a-zA-Z])")


@dataclass(frozen=True)
class Normalized:
    """A cleaned answer string and whether it carried a percent sign."""

    text: str
    percent: bool


def _unwrap(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, _WRAPPERS.sub(r"\1", text)
    return text


def _strip_delimiters(text: str) -> str:
    text = text.strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]"), ("$$", "$$"), ("$", "$")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text


def _word_tail_start(text: str, end: int) -> int:
    """Start of the longest tail of ``text[:end]`` made of ASCII letters, spaces and dots
    that each follow a letter."""
    start = end
    while start > 0:
        char = text[start - 1]
        dot_after_letter = char == "." and start > 1 and text[start - 2] in _ASCII_LETTERS
        if not (char in _ASCII_LETTERS or char.isspace() or dot_after_letter):
            break
        start -= 1
    return start


def _unit_split(text: str, end: int) -> int | None:
    """The shortest value ``text[:split]`` (one line, ending in a digit, ``}`` or ``.``) that
    a run of words ``text[split:end]`` follows (spaces, then a letter first), or None.

    Linear by construction: only positions inside the word tail can split. (A regex with a
    nested repeat of words did this before and backtracked exponentially on prose.)
    """
    first_newline = text.find("\n")
    last = end - 1 if first_newline < 0 else min(end - 1, first_newline)
    for split in range(max(_word_tail_start(text, end), 1), last + 1):
        if not (text[split - 1].isdecimal() or text[split - 1] in "}."):
            continue
        first = split
        while first < end and text[first].isspace():
            first += 1
        if first < end and text[first] in _ASCII_LETTERS:
            return split
    return None


def _strip_units(text: str) -> str:
    """``text`` without a tail of unit words (``5 cm``, ``3 sq. ft^2``, ``2 hours``)."""
    power = _UNIT_POWER.search(text)
    end = power.start() if power else len(text)
    split = _unit_split(text, end)
    if split is None:
        return text
    if all(w.rstrip(".").lower() in _UNITS for w in text[split:end].split()):
        return text[:split]
    return text


def _expand_shortcuts(text: str) -> str:
    text = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", text)
    text = _FRAC_HALF.sub(r"\\frac{\1}{\2}", text)
    text = _FRAC_FIRST.sub(r"\\frac{\1}{", text)
    return _SQRT_SHORT.sub(r"\\sqrt{\1}", text)


def normalize_answer(answer: str) -> Normalized:
    """Clean one extracted answer (see the module docstring)."""
    text = _unwrap(_strip_delimiters(answer)).replace("\\\\", _ROW_BREAK)
    for old, new in _REPLACE.items():
        text = text.replace(old, new)
    for token in _DELETE:
        text = text.replace(token, "")
    text = text.replace(_ROW_BREAK, "\\\\")
    percent = "%" in text
    text = text.replace("\\%", "").replace("%", "").strip().rstrip(".").strip()
    text = _strip_units(text).strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    text = _PREFIX.sub("", text, count=1).strip()
    text = _expand_shortcuts(text)
    if text.startswith("."):
        text = "0" + text
    return Normalized(" ".join(text.split()), percent)
