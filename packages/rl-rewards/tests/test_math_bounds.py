"""The math verifier's cost is bounded by what it parses: real outputs that once ran for
minutes, limits of the parser and structure splitter, and a timed fuzz over random texts."""

import random
import re
import subprocess
import sys
import time

import pytest
from math_fuzz import case

from rl_rewards import get_reward
from rl_rewards.math import bounds
from rl_rewards.math.equivalence import is_equivalent
from rl_rewards.math.latex import LatexParseError, parse_latex
from rl_rewards.math.normalize import _UNITS, _strip_units
from rl_rewards.math.numeric import evaluate
from rl_rewards.math.structure import parse_structure

# Two outputs of a small model that each ran for more than 60 s (a unit-stripping regex
# backtracked exponentially on the prose after the last number).
EGGS = (
    "Dad: 30 + 3 = 33\nMom: 3 = 16\nDad: 16 = 24 (14 left)\nMom: 24 = 16 (1 survivor)\n\n"
    "The last one stayed in the TV, that's a failure. So, the answer is either 23 or 16 "
    "depending on other people being able to find 24 eggs somewhere.\n23, 3, or 24 x 2 = 48 = "
    "24. We're done."
)
FARMER = (
    "Mafty, I'm always up for a math brain teaser. Here's the calculation: 5 weeks * 40 cents"
    " = $20 saved\nThen you need to calculate the final value: 8 dollars * 20 cents = $80 "
    "saved\nSo the farmer saved 8 dollars for every week!"
)
PER_CALL_LIMIT_S = 2.0  # the bound is about 1 s on one core; twice that for a loaded machine


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


@pytest.mark.parametrize(("response", "label"), [(EGGS, "19"), (FARMER, "32")])
def test_real_outputs_that_hung_score_zero_at_once(response, label):
    score, seconds = _timed(get_reward("math"), response, label)
    assert score == 0.0
    assert seconds < 1.0


def test_prose_answer_is_decided_without_importing_sympy():
    script = (
        "import sys; from rl_rewards import get_reward\n"
        f"assert get_reward('math')({EGGS!r}, '19') == 0.0\n"
        "print('sympy' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


_OLD_UNIT_TAIL = re.compile(r"^(.*?[\d}.])\s*((?:[a-zA-Z]+\.?\s*)+)(?:\^\{?\d\}?)?$")


def _old_strip_units(text: str) -> str:
    match = _OLD_UNIT_TAIL.match(text)
    if match and all(w.rstrip(".").lower() in _UNITS for w in match.group(2).split()):
        return match.group(1)
    return text


def test_unit_stripping_agrees_with_the_regex_it_replaced():
    rng = random.Random(0)
    pieces = ["5", "}", ".", "cm", "c", "m", " ", "\n", "^", "{", "2", "x", "ft", "sq", "\t"]
    for _ in range(20_000):  # short texts, where the old regex is still fast
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 9))).strip()
        assert _strip_units(text) == _old_strip_units(text), text
    assert _strip_units("5 cm") == "5"
    assert _strip_units("3 sq. ft^2") == "3"
    assert _strip_units("2 hours\nlater") == "2 hours\nlater"


def test_unit_stripping_is_linear_on_long_prose():
    prose = "either 23 or 16 depending on other people being able to find 24 eggs somewhere "
    text = "1" + prose * 50
    _, seconds = _timed(_strip_units, text)
    assert seconds < 0.1


@pytest.mark.parametrize(
    "text",
    [
        "+".join(["x", "y"] * (bounds.MAX_TOKENS // 4 + 1)),  # too many tokens
        "(" * (bounds.MAX_NESTING + 1) + "x" + ")" * (bounds.MAX_NESTING + 1),
        "x^{x^{x^{x}}}",  # three symbolic exponents stacked
        "0.5^{0.5^{0.5^{x}}}",  # sympy's assumptions on such towers took seconds
        "e^{e^{e^{x}}}",
        "\\binom{1000000}{500000}",  # ran for over a minute
        "\\binom{\\sin 492}{563}",  # a 563-factor product of sines
        "(2x)^{" + "9" * 1500 + "}",  # sympy raises the 2 exactly
        "\\sqrt{" + "7" * 1500 + "}",  # a perfect-power search on 1500 digits
        "(1+10^{-300})^{1000}",  # 300000 digits although the value is near 1
        "\\lfloor 10^{300}\\pi \\rfloor",
        "1" * (bounds.MAX_DIGITS + 1) + "x",
    ],
)
def test_parser_refuses_what_would_be_slow(text):
    start = time.perf_counter()
    with pytest.raises(LatexParseError):
        parse_latex(text)
    assert time.perf_counter() - start < 0.5


def test_parser_still_builds_large_but_cheap_values():
    assert parse_latex("2^{1000}") == 2**1000
    assert parse_latex("\\binom{100}{50}") == 100891344545564193334812497256
    assert parse_latex("500!") > 10**1000
    assert parse_latex("x^{y^{z}}") is not None  # two stacked exponents are fine


def test_evaluate_stops_at_the_double_range():
    x = parse_latex("x")
    assert evaluate(parse_latex("x^{2}+1"), {x: 2.0}) == 5
    assert evaluate(parse_latex("e^{e^{x}}"), {x: 3.0}) == pytest.approx(528491311.485, rel=1e-9)
    assert evaluate(parse_latex("e^{e^{x}}"), {x: 7.0}) is None  # e^1096.6 > 1e308
    assert evaluate(parse_latex("x^{1024}"), {x: 2.0}) is None
    assert evaluate(parse_latex("\\lfloor x \\rfloor"), {x: -2.5}) == -3
    assert evaluate(parse_latex("\\frac{1}{x-2}"), {x: 2.0}) is None  # a pole


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("2^{1000}", "2^{1000}+1", False),  # exact numbers compare exactly, not to 1e-10
        ("2^{1000}", "1024^{100}", True),
        ("500!-499!", "1", False),  # was judged equal: both sides "inf" after rounding
        ("e^{1000}", "1", False),
        ("\\lceil x \\rceil", "-\\lfloor -x \\rfloor", True),  # raised AttributeError
        ("e^{e^{x}}", "\\exp(e^{x})", True),
        ("(x+y+z+1)^{300}", "(1+x+y+z)^{300}+1", False),  # same values to every digit
        ("x+10^{-20}", "x", False),  # exact constants differ: not equal
        ("x+0.00000000001", "x", True),  # a decimal: within rel_tol
        ("\\binom{n}{2}", "\\frac{n(n-1)}{2}", True),
    ],
)
def test_verdicts_at_the_bounds(prediction, reference, expected):
    assert is_equivalent(prediction, reference) == expected


def test_sets_up_to_the_item_limit_match_in_any_order():
    items = [f"\\sqrt{{{k}}}x+\\frac{{{k}}}{{3}}" for k in range(bounds.MAX_LEAVES)]
    rewritten = [f"\\frac{{{k}}}{{3}}+x\\sqrt{{{k}}}" for k in range(bounds.MAX_LEAVES)]
    pred, gold = "\\{" + ",".join(items) + "\\}", "\\{" + ",".join(reversed(rewritten)) + "\\}"
    assert _timed(is_equivalent, pred, gold)[0]
    assert not is_equivalent(pred, gold.replace("\\sqrt{7}", "\\sqrt{8}", 1))


def test_larger_or_deeper_answers_are_compared_as_text():
    many = ",".join(str(k) for k in range(bounds.MAX_LEAVES + 1))
    assert parse_structure(many).kind == "scalar"
    assert is_equivalent(many, many + " ")
    assert not is_equivalent(many, ",".join(reversed(many.split(","))))
    deep = "(" * 600 + "1" + ",1)" * 600  # raised RecursionError
    assert parse_structure(deep).kind == "scalar"
    assert not is_equivalent(deep, "1")


@pytest.mark.slow
def test_random_texts_are_each_decided_in_bounded_time():
    """Several hundred seeded texts of up to 4,000 characters; each reward call is timed."""
    rewards = {
        "math": get_reward("math"),
        "deepscaler": get_reward("deepscaler"),
        "dapo": get_reward("dapo", use_equivalence=True),
        "gsm8k": get_reward("gsm8k"),
    }
    rewards["math"]("\\boxed{x+1}", "1+x")  # imports sympy outside the timings
    rng = random.Random(1234)
    slowest = (0.0, "", "", "")
    for _ in range(400):
        response, label = case(rng, 4000)
        assert len(response) <= 4000
        for name, reward in rewards.items():
            gold = str(rng.randint(0, 10**6)) if name == "gsm8k" else label
            score, seconds = _timed(reward, response, gold)
            assert score in (-1.0, 0.0, 1.0)
            slowest = max(slowest, (seconds, name, response, gold))
    print(f"slowest reward call: {slowest[0]:.3f} s ({slowest[1]})")
    assert slowest[0] < PER_CALL_LIMIT_S, slowest
