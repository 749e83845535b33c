"""f1, exact match, gsm8k, gpqa and dapo with hand-computed expected values."""

import time

import pytest

from rl_rewards import get_reward
from rl_rewards.choice import extract_choice
from rl_rewards.qa import normalize_squad


def test_squad_normalisation():
    assert normalize_squad("The  Cat, sat!") == "cat sat"
    assert normalize_squad("An apple a day") == "apple day"


def test_exact_match_and_f1_hand_values():
    em, f1 = get_reward("exact_match"), get_reward("f1")
    assert em("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert em("Eiffel", ["Paris", "Eiffel tower"]) == 0.0
    # pred tokens {eiffel, tower, paris}, gold {eiffel, tower}: P = 2/3, R = 1, F1 = 0.8
    assert f1("Eiffel Tower Paris", "the Eiffel Tower") == pytest.approx(0.8)
    assert f1("nothing shared", "Eiffel Tower") == 0.0
    assert f1("Paris", ["London", "paris"]) == 1.0


def test_prefix_match_ignores_what_follows_the_answer():
    reward = get_reward("prefix_match")
    assert reward("7 then anything", "7") == 1.0
    assert reward("The Eiffel tower, in Paris", ["London", "eiffel tower"]) == 1.0
    assert reward("17", "7") == 0.0  # the answer must come first
    assert reward("", "7") == 0.0


def test_gsm8k_marker_last_number_and_strict():
    reward = get_reward("gsm8k")
    assert reward("so 3 + 4 = 7\n#### 7", "#### 7") == 1.0
    assert reward("The total is $1,234.", "1234") == 1.0
    assert reward("#### 72.0", "72") == 1.0
    assert reward("I think 5 then 6", "5") == 0.0
    assert get_reward("gsm8k", strict=True)("the answer is 7", "7") == 0.0
    with pytest.raises(ValueError, match="number"):
        reward("7", "no number")


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("Answer: C", "C"),
        ("The answer is (B).", "B"),
        ("the correct option is D", "D"),
        ("I pick option A", "A"),
        ("\\boxed{B}", "B"),
        ("\\boxed{\\text{(C)}}", "C"),
        ("Reasoning...\n**D**\n", "D"),
        ("Answer: **A**", "A"),
        ("Nothing chosen", None),
    ],
)
def test_choice_extraction_phrasings(response, letter):
    assert extract_choice(response) == letter


def test_gpqa_reward_letter_or_index_label():
    reward = get_reward("gpqa")
    assert reward("The answer is (C)", "C") == 1.0
    assert reward("The answer is (C)", 2) == 1.0
    assert reward("The answer is (C)", "(A)") == 0.0
    with pytest.raises(ValueError, match="A-J"):
        reward("C", "Z9")


def test_dapo_plus_minus_one_and_format_rules():
    reward = get_reward("dapo")
    assert reward("work...\nAnswer: \\frac{1}{2}", "\\frac{1}{2}") == 1.0
    assert reward("work...\nAnswer: 3", "4") == -1.0
    assert reward("no answer line, just 4", "4") == -1.0
    assert reward("Answer: 4" + " padding" * 100, "4") == -1.0  # outside the last 300 chars
    assert reward("Answer: 0.5", "\\frac{1}{2}") == -1.0  # strict string match
    assert get_reward("dapo", use_equivalence=True)("Answer: 0.5", "\\frac{1}{2}") == 1.0


N = 10_000  # characters of each adversarial text
ADVERSARIAL_CHOICES = {
    "answer, spaces, no letter": "answer" + " " * N + "x",  # 66 s at 200 spaces before
    "answer, tabs and newlines": "answer" + " \t\n" * (N // 3) + "x",
    "answer is, spaces": "The answer is" + " " * N + "x",
    "correct option, spaces": "the correct option is" + " " * N + "x",
    "option, spaces": "option" + " " * N + "x",
    "many answers": "answer " * (N // 7),
    "blank lines": "\n" * N + "x",
    "a letter, then spaces": "C" + " " * N + "x",
    "lone letter, then spaces": "C" + " " * N + "\nx",
    "lines of spaces": (" " * 100 + "\n") * (N // 101) + "x",
    "boxed, spaces": "\\boxed{" + " " * N,
    "stars": "answer " + "*" * N + "x",
}


@pytest.mark.parametrize("name", ADVERSARIAL_CHOICES)
def test_gpqa_takes_linear_time_on_adversarial_text(name):
    """Text built to make adjacent ``\\s*`` backtrack: each 10,000-character case is decided
    in well under a second (the first took 66 s at 200 spaces before the patterns were
    made possessive). The bound is loose for a loaded machine; a quadratic pattern takes
    seconds here, a cubic one hours."""
    text = ADVERSARIAL_CHOICES[name]
    start = time.perf_counter()
    assert get_reward("gpqa")(text, "C") == float(name.startswith("lone"))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "text",
    ["," * N + "x", "1" + "," * N + ".x", "-" * N, ". " * (N // 2), "1," * (N // 2) + ".x"],
    ids=["commas", "a digit then commas", "minus signs", "points", "digit comma pairs"],
)
def test_gsm8k_takes_linear_time_on_long_text(text):
    """``[\\d,]*`` at every comma of a long run made the last-number search quadratic
    (0.8 s at 8,000 commas); numbers now start at a digit. 10,000 characters: < 1 s."""
    start = time.perf_counter()
    get_reward("gsm8k")(text, "1")
    get_reward("gsm8k", strict=True)("#### " + text, "1")
    assert time.perf_counter() - start < 1.0


def test_choice_patterns_still_read_spaced_and_starred_answers():
    """The possessive rewrite keeps what the greedy patterns found."""
    assert extract_choice("The answer is   (**B**)  because") == "B"
    assert extract_choice("answer:\n\n  C") == "C"
    assert extract_choice("I think\n\n   (D).  \nmore text") == "D"
    assert extract_choice("the best choice is: E and not F") == "E"
    assert extract_choice("\\boxed{ \\text{(C)} }") == "C"
    assert extract_choice("the answer is Apples") is None  # "A" starts a word here
