"""Registry of verifiable instructions: ``id -> check(response, **kwargs) -> bool``.

Ids follow IFEval's names. Counting relations are "at least", "at most", "less than",
"more than" and "exactly". Every check is language-free (no dictionaries, no models).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

Checker = Callable[..., bool]
CHECKERS: dict[str, Checker] = {}
_RELATIONS = {
    "at least": lambda n, k: n >= k,
    "at most": lambda n, k: n <= k,
    "less than": lambda n, k: n < k,
    "more than": lambda n, k: n > k,
    "exactly": lambda n, k: n == k,
}
_SENTENCE_END_RE = re.compile(r"[.!?]+(?:\s|$)")
_BULLET_RE = re.compile(r"^\s*[*-]\s+\S", re.M)


def checker(instruction_id: str) -> Callable[[Checker], Checker]:
    def decorate(fn: Checker) -> Checker:
        if instruction_id in CHECKERS:
            raise ValueError(f"instruction {instruction_id!r} is already registered")
        CHECKERS[instruction_id] = fn
        return fn

    return decorate


def compare(count: int, relation: str, target: int) -> bool:
    """``count <relation> target``; ValueError naming the valid relations."""
    if relation not in _RELATIONS:
        raise ValueError(f"unknown relation {relation!r}; valid: {sorted(_RELATIONS)}")
    return _RELATIONS[relation](count, target)


def check_instruction(instruction_id: str, response: str, **kwargs) -> bool:
    """Run one instruction's check; ValueError for an unknown id (listing the valid ones)."""
    if instruction_id not in CHECKERS:
        raise ValueError(f"unknown instruction {instruction_id!r}; valid: {sorted(CHECKERS)}")
    return bool(CHECKERS[instruction_id](response, **kwargs))


def paragraphs(text: str) -> list[str]:
    """Paragraphs separated by blank lines or a line of ``***``."""
    return [p for p in re.split(r"\n\s*\*\*\*\s*\n|\n\s*\n", text.strip()) if p.strip()]


@checker("length_constraints:number_words")
def number_words(response: str, *, num_words: int, relation: str = "at least") -> bool:
    return compare(len(re.findall(r"\b\w+\b", response)), relation, num_words)


@checker("length_constraints:number_sentences")
def number_sentences(response: str, *, num_sentences: int, relation: str = "at least") -> bool:
    return compare(len(_SENTENCE_END_RE.findall(response.strip())), relation, num_sentences)


@checker("length_constraints:number_paragraphs")
def number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    return len(paragraphs(response)) == num_paragraphs


@checker("keywords:existence")
def keywords_exist(response: str, *, keywords: list[str]) -> bool:
    return all(re.search(re.escape(k), response, re.I) for k in keywords)


@checker("keywords:forbidden_words")
def forbidden_words(response: str, *, forbidden_words: list[str]) -> bool:
    return not any(re.search(rf"\b{re.escape(w)}\b", response, re.I) for w in forbidden_words)


@checker("keywords:frequency")
def keyword_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    return compare(
        len(re.findall(rf"\b{re.escape(keyword)}\b", response, re.I)), relation, frequency
    )


@checker("keywords:letter_frequency")
def letter_frequency(response: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    return compare(response.lower().count(letter.lower()), let_relation, let_frequency)


@checker("detectable_format:json_format")
def json_format(response: str) -> bool:
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", response.strip(), flags=re.I)
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@checker("detectable_format:number_bullet_lists")
def number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    return len(_BULLET_RE.findall(response)) == num_bullets


@checker("detectable_format:number_highlighted_sections")
def highlighted_sections(response: str, *, num_highlights: int) -> bool:
    found = re.findall(r"\*[^\n*]+\*", response) + re.findall(r"\*\*[^\n*]+\*\*", response)
    return len([h for h in found if h.strip("*").strip()]) >= num_highlights


@checker("detectable_format:multiple_sections")
def multiple_sections(
    response: str, *, section_spliter: str = "Section", num_sections: int
) -> bool:
    parts = re.split(rf"\s?{re.escape(section_spliter)}\s?\d+\s?", response)
    return len(parts) - 1 >= num_sections


@checker("detectable_format:title")
def title(response: str) -> bool:
    return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", response))


@checker("detectable_format:constrained_response")
def constrained_response(
    response: str,
    *,
    options: tuple[str, ...] = ("My answer is yes.", "My answer is no.", "My answer is maybe."),
) -> bool:
    return any(option in response.strip() for option in options)


@checker("change_case:english_lowercase")
def all_lowercase(response: str) -> bool:
    return response == response.lower() and any(c.isalpha() for c in response)


@checker("change_case:english_capital")
def all_capitals(response: str) -> bool:
    return response == response.upper() and any(c.isalpha() for c in response)


@checker("change_case:capital_word_frequency")
def capital_words(response: str, *, capital_frequency: int, capital_relation: str) -> bool:
    count = len(re.findall(r"\b[A-Z][A-Z]+\b", response))
    return compare(count, capital_relation, capital_frequency)


@checker("startend:start_checker")
def starts_with(response: str, *, start_phrase: str) -> bool:
    return response.strip().lower().startswith(start_phrase.strip().lower())


@checker("startend:end_checker")
def ends_with(response: str, *, end_phrase: str) -> bool:
    return response.strip().lower().endswith(end_phrase.strip().lower())


@checker("startend:quotation")
def quotation(response: str) -> bool:
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


@checker("punctuation:no_comma")
def no_comma(response: str) -> bool:
    return "," not in response


@checker("detectable_content:number_placeholders")
def placeholders(response: str, *, num_placeholders: int) -> bool:
    return len(re.findall(r"\[[^\[\]\n]+\]", response)) >= num_placeholders


@checker("detectable_content:postscript")
def postscript(response: str, *, postscript_marker: str = "P.S.") -> bool:
    return re.search(rf"^\s*{re.escape(postscript_marker)}", response, re.M | re.I) is not None
