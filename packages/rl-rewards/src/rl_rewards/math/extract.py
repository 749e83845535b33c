"""Final-answer extraction from a model response.

Order of preference: the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed,
also ``\\boxed 5``), then phrases such as "The answer is X" / "Final answer: X", then the
last inline math ``$...$``, then the last number in the text.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_PHRASE_RE = re.compile(r"\banswer\b\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_INLINE_MATH_RE = re.compile(r"\$\$?([^$]+?)\$\$?")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == '{'`` and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``, or None."""
    best = -1
    for command in _BOX_COMMANDS:
        best = max(best, text.rfind(command))
    if best < 0:
        return None
    rest_start = best + (5 if text.startswith("\\fbox", best) else 6)
    rest = text[rest_start:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        found = _braced(text, rest_start + len(rest) - len(stripped))
        return found[0].strip() if found else None
    if rest[:1] == " ":  # "\boxed 5" form: up to the next space or "$"
        return re.split(r"[\s$]", stripped, maxsplit=1)[0] or None
    return None


def _from_phrase(text: str) -> str | None:
    matches = list(_PHRASE_RE.finditer(text))
    if not matches:
        return None
    answer = matches[-1].group(1).strip().split("\n")[0].strip()
    inline = _INLINE_MATH_RE.search(answer)
    if inline:
        return inline.group(1).strip()
    return re.split(r"\.\s", answer)[0].rstrip(".").strip() or None


def extract_answer(text: str, *, fallback: bool = True) -> str | None:
    """The final answer in ``text`` (see the module docstring), or None when there is none.

    With ``fallback=False`` only a boxed answer counts (a stricter format rule).
    """
    boxed = last_boxed(text)
    if boxed is not None or not fallback:
        return boxed
    phrase = _from_phrase(text)
    if phrase:
        return phrase
    inline = _INLINE_MATH_RE.findall(text)
    if inline:
        return inline[-1].strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None
