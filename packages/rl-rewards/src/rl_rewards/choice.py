"""Multiple-choice (``gpqa``) and ``dapo`` "Answer: X" rewards."""

from __future__ import annotations

import re

from rl_rewards.math.equivalence import is_equivalent
from rl_rewards.math.normalize import normalize_answer
from rl_rewards.registry import register_reward

# Whitespace and stars before the letter are matched possessively (``*+``): each run is
# consumed once, never shared out between the adjacent ``\s*`` again on a failure, so a
# pattern costs time linear in the text ("answer" + 200 spaces + "x" took 66 s before).
# What follows the letter stays greedy: the look-ahead may need a space given back.
_LETTER = r"\(?\**+\s*+([A-J])\s*\**\)?"
_HSPACE = r"[^\S\n]*+"  # spaces within one line: a lone letter's line is not searched
# from every blank line above it
_CHOICE_PATTERNS = [
    re.compile(r"\\boxed\{\s*+(?:\\text\{)?\(?([A-J])\)?\}?\s*+\}"),
    re.compile(
        r"(?i)answer\s*+(?:is|:)?\s*+(?:option|choice)?\s*+:?\s*+" + _LETTER + r"(?![a-zA-Z])"
    ),
    re.compile(
        r"(?i)(?:correct|best|right)\s++(?:option|choice|answer)\s++(?:is\s*+)?:?\s*+"
        + _LETTER
        + r"(?![a-zA-Z])"
    ),
    re.compile(r"(?i)(?:option|choice)\s++" + _LETTER + r"(?![a-zA-Z])"),
    re.compile(rf"^{_HSPACE}\(?\**+{_HSPACE}([A-J]){_HSPACE}\**+\)?[.):]?{_HSPACE}$", re.MULTILINE),
]
_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def extract_choice(text: str) -> str | None:
    """The chosen letter (A-J) in its common phrasings; the last match of the first pattern
    that matches (boxed, "answer is (C)", "the correct option is C", "option C", a lone "C")."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].upper()
    return None


def _gold_letter(label: object) -> str:
    if isinstance(label, int) and 0 <= label < 10:
        return "ABCDEFGHIJ"[label]
    letter = str(label).strip().strip("()").upper()
    if len(letter) != 1 or letter not in "ABCDEFGHIJ":
        raise ValueError(f"gpqa label must be a letter A-J or an index 0-9, got {label!r}")
    return letter


@register_reward("gpqa", "multiple choice: letter from 'Answer: C', '(C)', \\boxed{C}, ...; 1/0")
def gpqa_reward(response: str, label: object) -> float:
    """1.0 when the extracted letter is the gold letter (label 'C' or index 2)."""
    return float(extract_choice(response) == _gold_letter(label))


def _dapo_key(answer: str) -> str:
    return normalize_answer(answer).text.replace(" ", "")


@register_reward(
    "dapo", "DAPO: last 'Answer: X' in the final 300 chars, normalised exact match; +1/-1"
)
def dapo_reward(
    response: str, label: object, *, tail_chars: int = 300, use_equivalence: bool = False
) -> float:
    """+1.0 for a correct "Answer: X" line, -1.0 for a wrong or missing one.

    Only the last ``tail_chars`` characters are searched (DAPO's format rule). Matching is
    string equality after normalisation, or full math equivalence with ``use_equivalence``.
    """
    if label is None:
        raise ValueError("dapo reward needs a label (the reference answer)")
    found = _DAPO_ANSWER_RE.findall(response[-tail_chars:])
    if not found:
        return -1.0
    answer = found[-1].strip().rstrip(".")
    if use_equivalence:
        return 1.0 if is_equivalent(answer, str(label)) else -1.0
    return 1.0 if _dapo_key(answer) == _dapo_key(str(label)) else -1.0
