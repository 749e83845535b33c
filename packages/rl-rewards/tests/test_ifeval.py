"""One unit test per instruction checker (a passing and a failing response), plus the reward."""

import pytest

from rl_rewards import get_reward
from rl_rewards.ifeval import CHECKERS, check_instruction

CASES = [  # id, kwargs, passing response, failing response
    (
        "length_constraints:number_words",
        {"num_words": 3, "relation": "at least"},
        "one two three",
        "one two",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "at most"},
        "Hi. Bye!",
        "A. B. C?",
    ),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "p1\n\np2", "p1\n\np2\n\np3"),
    ("keywords:existence", {"keywords": ["apple", "pear"]}, "An Apple and a pear", "only apple"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "badge is fine", "this is bad"),
    (
        "keywords:frequency",
        {"keyword": "cat", "frequency": 2, "relation": "exactly"},
        "cat Cat dog",
        "cat dog",
    ),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "at least"},
        "zoo Zap",
        "zoo",
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n- b", "* a\n* b\n* c"),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*one* and *two*",
        "*one* only",
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\na\nSection 2\nb",
        "Section 1 only",
    ),
    ("detectable_format:title", {}, "<<My Title>>\ntext", "no title"),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("change_case:english_lowercase", {}, "all lower here", "Not lower"),
    ("change_case:english_capital", {}, "ALL CAPS HERE", "ALL CAPS hEre"),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "less than"},
        "ONE word",
        "ONE TWO words",
    ),
    ("startend:start_checker", {"start_phrase": "Dear Sir"}, "dear sir, hello", "Hello, dear sir"),
    (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        "Done. Any other questions?",
        "Any other questions? Done.",
    ),
    ("startend:quotation", {}, '"wrapped"', 'not "wrapped"'),
    ("punctuation:no_comma", {}, "no commas here", "a, b"),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "[name] at [address]",
        "[name] only",
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "Body\nP.S. more",
        "Body only",
    ),
]


def test_every_checker_has_a_case():
    assert {case[0] for case in CASES} == set(CHECKERS)


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "good", "bad"), CASES, ids=[c[0] for c in CASES]
)
def test_checker_accepts_good_and_rejects_bad(instruction_id, kwargs, good, bad):
    assert check_instruction(instruction_id, good, **kwargs) is True
    assert check_instruction(instruction_id, bad, **kwargs) is False


def test_unknown_instruction_and_relation_are_value_errors():
    with pytest.raises(ValueError, match="punctuation:no_comma"):
        check_instruction("punctuation:no_commas", "x")
    with pytest.raises(ValueError, match="at least"):
        check_instruction("length_constraints:number_words", "x", num_words=1, relation="around")


def test_reward_fraction_and_all_modes_and_label_forms():
    label = [
        {"id": "punctuation:no_comma"},
        {"id": "change_case:english_lowercase"},
        {
            "id": "length_constraints:number_words",
            "kwargs": {"num_words": 10, "relation": "at least"},
        },
    ]
    response = "short and lower"
    assert get_reward("ifeval")(response, label) == pytest.approx(2 / 3)
    assert get_reward("ifeval", mode="all")(response, label) == 0.0
    ifeval_form = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"unused": None}]}
    assert get_reward("ifeval")(response, ifeval_form) == 1.0
    assert get_reward("ifeval")(response, {"instructions": label[:1]}) == 1.0
    with pytest.raises(ValueError, match="mode"):
        get_reward("ifeval", mode="any")(response, label)
