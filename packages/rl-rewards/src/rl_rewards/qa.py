"""Question-answering rewards: SQuAD-style ``exact_match``, ``prefix_match`` and token ``f1``, and ``gsm8k``.

A label may be one gold string or a list of them; the best match over the golds counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from fractions import Fraction

from rl_rewards.registry import register_reward

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
# A number starts with a digit (or its point): ``[\d,]*`` from every comma of a long run of
# commas made the search quadratic in the text.
_GSM8K_NUMBER_RE = re.compile(r"-?(?:\d[\d,]*)?\.?\d+")


def normalize_squad(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = _ARTICLES_RE.sub(" ", str(text).lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def _golds(label: object) -> list[str]:
    if label is None:
        raise ValueError("QA rewards need a label: a gold answer string or a list of them")
    return [str(g) for g in label] if isinstance(label, list | tuple) else [str(label)]


def _f1(prediction: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_squad(prediction).split(), normalize_squad(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@register_reward("exact_match", "SQuAD-normalised exact match against one or several golds; 1/0")
def exact_match_reward(response: str, label: object) -> float:
    """1.0 when the normalised response equals a normalised gold answer."""
    prediction = normalize_squad(response)
    return float(any(prediction == normalize_squad(g) for g in _golds(label)))


@register_reward("prefix_match", "the SQuAD-normalised response starts with a gold answer; 1/0")
def prefix_match_reward(response: str, label: object) -> float:
    """1.0 when the normalised response begins with a normalised gold answer (whatever
    follows it is ignored: for tasks whose answer comes first and the rest is free)."""
    prediction = normalize_squad(response)
    return float(any(prediction.startswith(normalize_squad(g)) for g in _golds(label)))


@register_reward("f1", "SQuAD token-overlap F1 against one or several golds (best); in [0, 1]")
def f1_reward(response: str, label: object) -> float:
    """Best token F1 between the response and any gold answer."""
    return max(_f1(response, g) for g in _golds(label))


def _parse_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_answer(text: str, *, strict: bool = False) -> str | None:
    """The number after the last ``####``; without one (and not ``strict``) the last number."""
    if "####" in text:
        found = _GSM8K_NUMBER_RE.findall(text.rsplit("####", 1)[1])
        return found[0] if found else None
    if strict:
        return None
    found = _GSM8K_NUMBER_RE.findall(text)
    return found[-1] if found else None


@register_reward("gsm8k", "GSM8K: number after '####' (or the last number unless strict); 1/0")
def gsm8k_reward(response: str, label: object, *, strict: bool = False) -> float:
    """1.0 when the response's final number equals the label's (``#### 72`` or ``72``)."""
    gold_text = gsm8k_answer(str(label)) if label is not None else None
    if gold_text is None:
        raise ValueError(f"gsm8k label must contain a number, got {label!r}")
    answer = gsm8k_answer(response, strict=strict)
    if answer is None:
        return 0.0
    prediction, gold = _parse_number(answer), _parse_number(gold_text)
    return float(prediction is not None and prediction == gold)
