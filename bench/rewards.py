"""Benchmark: the rl-rewards ``math`` verifier against math-verify on 10,000 mixed cases.

Run from the repository root (math-verify is installed only by the ``bench`` group):

    uv run --package rl-rewards --group bench python bench/rewards.py [--cases 10000] [--workers 2]

Prints one JSON object: samples/s for rl-rewards in one process and with worker processes,
math-verify's samples/s measured in the same run, their ratio, the agreement rate and every
disagreement (gold, response, both verdicts), plus the hardware and the command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time
from fractions import Fraction
from pathlib import Path

from rl_rewards import get_reward
from rl_rewards.batch import score_batch

WRAPPERS = [
    "{}",
    "The answer is $\\boxed{{{}}}$.",
    "Let me work through this carefully.\nAdding the parts gives the total.\nTherefore, the final answer is $\\boxed{{{}}}$. I hope it is correct.",
    "We simplify step by step: first the numerator, then the denominator.\n\\[ \\boxed{{{}}} \\]",
]


def _frac(value: Fraction) -> str:
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _integers(rng):
    n = rng.randint(-50, 5000)
    right = [str(n), f"{n}.0", f"{n:,}" if abs(n) >= 1000 else str(n), f"x = {n}"]
    return str(n), rng.choice(right), str(n + rng.choice([-10, -1, 1, 2, 100]))


def _fractions(rng):
    value = Fraction(rng.randint(1, 40), rng.randint(2, 13)) * rng.choice([1, -1])
    k = rng.randint(2, 4)
    scaled = Fraction(value.numerator * k, value.denominator * k)
    right = [
        _frac(value),
        _frac(value).replace("\\frac", "\\dfrac"),
        f"{'-' if scaled < 0 else ''}\\frac{{{abs(value.numerator) * k}}}{{{value.denominator * k}}}",
        f"{value.numerator}/{value.denominator}",
    ]
    if value.denominator in (2, 4, 5, 8, 10):
        right.append(str(float(value)))
    return _frac(value), rng.choice(right), _frac(value + Fraction(1, value.denominator))


def _decimals(rng):
    value = Fraction(rng.randint(1, 9999), 100)
    text = f"{float(value):.2f}"
    return text, rng.choice([text, _frac(value), text.rstrip("0")]), f"{float(value) + 0.1:.2f}"


def _radicals(rng):
    a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10])
    right = [f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"\\sqrt{{{b}}} \\cdot {a}"]
    return f"{a}\\sqrt{{{b}}}", rng.choice(right), f"{a + 1}\\sqrt{{{b}}}"


def _pi(rng):
    a, b = rng.randint(1, 9), rng.choice([2, 3, 4, 6])
    right = [f"\\frac{{{a}\\pi}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}\\pi", f"{a}\\pi/{b}"]
    return f"\\frac{{{a}\\pi}}{{{b}}}", rng.choice(right), f"\\frac{{{a}\\pi}}{{{b + 1}}}"


def _polynomials(rng):
    p, q = rng.randint(-6, 6), rng.randint(1, 6)
    expanded = (
        f"x^2 {'+' if p + q >= 0 else '-'} {abs(p + q)}x {'+' if p * q >= 0 else '-'} {abs(p * q)}"
    )
    factored = f"(x {'+' if p >= 0 else '-'} {abs(p)})(x + {q})"
    return expanded, rng.choice([factored, expanded]), f"(x + {q})^2"


def _intervals(rng):
    a, b = sorted(rng.sample(range(-20, 20), 2))
    left, right = rng.choice("[("), rng.choice("])")
    flip = {"[": "(", "(": "[", "]": ")", ")": "]"}
    gold = f"{left}{a}, {b}{right}"
    pred = rng.choice([gold, f"\\left{left} {a}, {b} \\right{right}", f"{left}{a},{b}{right}"])
    return gold, pred, f"{left}{a}, {b}{flip[right]}"


def _tuples(rng):
    a, b = rng.randint(-9, 9), rng.randint(-9, 9)
    return f"({a}, {b})", rng.choice([f"({a},{b})", f"\\left({a}, {b}\\right)"]), f"({b}, {a + 1})"


def _formats(rng):
    n = rng.randint(1, 180)
    pairs = [
        (f"{n}", f"{n}^\\circ"),
        (f"{n}", f"{n} \\text{{ cm}}"),
        (f"{n}", f"\\${n}"),
        (f"{n}\\%", f"{n}\\%"),
        (f"{n}", f"\\text{{{n}}}"),
        (f"{n}", f"{n} \\text{{ degrees}}"),
    ]
    gold, pred = rng.choice(pairs)
    return gold, pred, str(n + 1)


TRICKY = [  # (gold, an equivalent form, a near miss)
    ("\\frac{1}{3}", "0.333333", "0.333"),
    ("\\{1, 2\\}", "\\{2, 1\\}", "\\{1, 3\\}"),
    ("x + y = 1", "2x + 2y = 2", "x + y = 2"),
    ("\\text{Evelyn}", "Evelyn", "Eve"),
    (
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        "\\begin{pmatrix} 1 & 2 \\\\ 4 & 3 \\end{pmatrix}",
    ),
    ("2\\frac{1}{2}", "\\frac{5}{2}", "\\frac{1}{2}"),
    ("(-\\infty, 3]", "(-\\infty,3]", "(-\\infty, 3)"),
    ("x^2 - 1", "(x-1)(x+1)", "(x-1)^2"),
    ("50\\%", "50", "5"),
    ("1, 2", "2, 1", "1, 3"),
    ("\\sqrt{x^2+1}", "\\sqrt{1+x^2}", "x+1"),
    ("e^{2}", "e^2", "2e"),
    ("\\log_2 8", "3", "4"),
    ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", "\\frac{\\sqrt2}{2}"),
    ("1000000", "1,000,000", "100000"),
    ("-\\frac{7}{4}", "-1.75", "1.75"),
]


def _tricky(rng):
    return rng.choice(TRICKY)


GENERATORS = [
    _integers,
    _fractions,
    _decimals,
    _radicals,
    _pi,
    _polynomials,
    _intervals,
    _tuples,
    _formats,
    _tricky,
]


def make_cases(num_cases: int, seed: int = 0) -> list[tuple[str, str]]:
    """(gold, response) pairs: every category, right and wrong answers, four response styles."""
    rng = random.Random(seed)
    cases = []
    for i in range(num_cases):
        gold, right, wrong = GENERATORS[i % len(GENERATORS)](rng)
        answer = right if rng.random() < 0.6 else wrong
        wrapper = rng.choice(WRAPPERS[1:]) if answer != right or rng.random() < 0.9 else WRAPPERS[1]
        cases.append((gold, wrapper.format(answer)))
    return cases


def time_ours(cases, workers: int) -> tuple[list[float], float]:
    golds, responses = [g for g, _ in cases], [r for _, r in cases]
    start = time.perf_counter()
    if workers == 0:
        reward = get_reward("math")
        scores = [reward(r, g) for g, r in cases]
    else:
        scores = score_batch("math", responses, golds, workers=workers, timeout_s=10).scores
    return scores, time.perf_counter() - start


def time_math_verify(cases) -> tuple[list[float], float]:
    from math_verify import parse, verify

    start = time.perf_counter()
    scores = [float(verify(parse(f"${g}$"), parse(r))) for g, r in cases]
    return scores, time.perf_counter() - start


def table_cases() -> list[tuple[str, str]]:
    """The unit-test table (tests/math_cases.py) as (gold, response) pairs, boxed like the test."""
    path = Path(__file__).parents[1] / "packages/rl-rewards/tests/math_cases.py"
    spec = importlib.util.spec_from_file_location("math_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    extraction = set(module.EXTRACTION)
    return [
        (gold, pred if (pred, gold, ok) in extraction else f"So the result is \\boxed{{{pred}}}.")
        for pred, gold, ok in module.ALL_CASES
    ]


def disagreements_of(cases, ours, theirs) -> list[dict]:
    return [
        {"gold": g, "response": r, "rl_rewards": a, "math_verify": b}
        for (g, r), a, b in zip(cases, ours, theirs, strict=True)
        if a != b
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    cases = make_cases(args.cases)
    get_reward("math")("\\boxed{\\sqrt{2}x}", "x\\sqrt{2}")  # import sympy before timing
    ours, ours_s = time_ours(cases, 0)
    cold_start_s = time_ours(cases[:2], args.workers)[1]  # starts the forkserver (imports sympy)
    pooled, pooled_s = time_ours(cases, args.workers)
    theirs, theirs_s = time_math_verify(cases)
    disagreements = disagreements_of(cases, ours, theirs)
    table = table_cases()
    table_ours, table_theirs = time_ours(table, 0)[0], time_math_verify(table)[0]
    table_disagreements = disagreements_of(table, table_ours, table_theirs)
    n = len(cases)
    print(
        json.dumps(
            {
                "benchmark": "math verifier: rl-rewards vs math-verify",
                "num_cases": n,
                "rl_rewards_samples_per_s": round(n / ours_s, 1),
                f"rl_rewards_{args.workers}_workers_samples_per_s": round(n / pooled_s, 1),
                "math_verify_samples_per_s": round(n / theirs_s, 1),
                "throughput_ratio_single_process": round(theirs_s / ours_s, 2),
                f"throughput_ratio_{args.workers}_workers": round(theirs_s / pooled_s, 2),
                "workers_first_call_start_s": round(cold_start_s, 2),
                "agreement_rate": round(1 - len(disagreements) / n, 5),
                "workers_match_single_process": pooled == ours,
                "mean_score_rl_rewards": round(sum(ours) / n, 4),
                "mean_score_math_verify": round(sum(theirs) / n, 4),
                "disagreements": disagreements,
                "table_num_cases": len(table),
                "table_agreement_rate": round(1 - len(table_disagreements) / len(table), 4),
                "table_disagreements": table_disagreements,
                "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"Python {platform.python_version()}",
                "command": "uv run --package rl-rewards --group bench python " + " ".join(sys.argv),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
