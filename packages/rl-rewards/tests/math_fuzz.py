"""Random model-like outputs for timing the math-family rewards (seeded, so reproducible).

Each text mixes prose, numbers, operators, equals signs, brackets, commas, LaTeX fragments,
``\\boxed{}``, intervals, sets, long digit strings and exponent towers, up to a length limit;
labels are either a rewriting of the text's answer (so comparisons go deep: same items in
another order, other spacing, a factor of 1) or an unrelated answer.
"""

from __future__ import annotations

import random

_WORDS_TEXT = """
the so we get answer is total left cm dollars cents saved weeks hours Dad: Mom: then and or
either final value of for every failure depending eggs survivor people calculation
"""
WORDS = _WORDS_TEXT.split()
SYMBOLS = ("x", "y", "z", "a", "b", "n", "\\pi", "e", "i", "\\alpha", "\\theta", "x_1", "x_{12}")
PLACEMENTS = ("\\boxed{{{}}}", "The answer is {}.", "${}$", "Answer: {}", "</think> \\boxed{{{}}}")


def digits(rng: random.Random, low: int, high: int) -> str:
    return str(rng.randint(1, 9)) + "".join(rng.choices("0123456789", k=rng.randint(low, high)))


def number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        return str(rng.randint(-50, 1000))
    if kind < 0.7:
        return f"{rng.randint(0, 999)}.{rng.randint(0, 99999)}"
    if kind < 0.8:
        return f"{rng.randint(1, 999):,}" + ",000" * rng.randint(1, 5)
    return digits(rng, 20, 1500)


def atom(rng: random.Random) -> str:
    return number(rng) if rng.random() < 0.5 else rng.choice(SYMBOLS)


def expression(rng: random.Random, depth: int) -> str:
    if depth <= 0 or rng.random() < 0.25:
        return atom(rng)
    a, b = expression(rng, depth - 1), expression(rng, depth - 1)
    forms = (
        f"{a}+{b}",
        f"{a}-{b}",
        f"{a}*{b}",
        f"{a} \\cdot {b}",
        f"{a}\\times {b}",
        f"{a}/{b}",
        f"{a} x {b}",
        f"{a}^{{{b}}}",
        f"{a}^{b}",
        f"({a})",
        f"\\left({a}\\right)",
        f"{a}{b}",
        f"\\frac{{{a}}}{{{b}}}",
        f"\\dfrac{{{a}}}{{{b}}}",
        f"\\sqrt{{{a}}}",
        f"\\sqrt[{b}]{{{a}}}",
        f"\\binom{{{a}}}{{{b}}}",
        f"{a}!",
        f"|{a}|",
        f"\\sin {a}",
        f"\\log_{{{b}}} {a}",
        f"\\text{{{a}}}",
        f"{a}\\%",
        f"{a}^\\circ",
        f"{a} cm",
        f"\\lfloor {a} \\rfloor",
        f"\\lceil {a} \\rceil",
        f"{a} \\pm {b}",
        f"e^{{{a}}}",
        f"\\ln({a})",
        f"{a}^{{{b}^{{{a}}}}}",
    )
    return rng.choice(forms)


def tower(rng: random.Random) -> str:
    base = rng.choice(("2", "9", "x", "10", "1.5", "e", "\\pi", "(x+10^{300})", digits(rng, 5, 50)))
    height = rng.randint(2, 12)
    if rng.random() < 0.5:
        return "^".join([base] * height)
    return base + "".join("^{" + base for _ in range(height - 1)) + "}" * (height - 1)


def collection(rng: random.Random) -> str:
    items = [expression(rng, rng.randint(0, 2)) for _ in range(rng.randint(2, 130))]
    left, right = rng.choice((("\\{", "\\}"), ("(", ")"), ("[", ")"), ("(", "]"), ("", "")))
    return left + ", ".join(items) + right


def nested(rng: random.Random) -> str:
    opener, closer = rng.choice(
        (
            ("(", ")"),
            ("{", "}"),
            ("\\{", "\\}"),
            ("[", "]"),
            ("\\sqrt{", "}"),
            ("|", "|"),
            ("\\frac{1}{", "}"),
            ("\\left(", "\\right)"),
            ("\\text{", "}"),
            ("\\boxed{", "}"),
        )
    )
    count = rng.randint(5, 600)
    inner = rng.choice(("1", "x", "1,2", "a=b", "x+1"))
    return opener * count + inner + (rng.choice(("", ",1", "+1", "=2")) + closer) * count


def prose(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(WORDS) if rng.random() < 0.7 else number(rng) for _ in range(num_words)]
    return " ".join(words) + rng.choice((".", "\n", " = ", ": ", ", "))


def answer(rng: random.Random, target: int) -> str:
    """Maths only (no prose), about ``target`` characters."""
    makers = (
        lambda: expression(rng, rng.randint(1, 6)),
        lambda: tower(rng),
        lambda: collection(rng),
        lambda: nested(rng),
        lambda: number(rng),
        lambda: f"{expression(rng, 2)} = {expression(rng, 2)}",
        lambda: " \\cup ".join(f"({atom(rng)}, {atom(rng)}]" for _ in range(rng.randint(2, 40))),
        lambda: (
            "\\begin{pmatrix}"
            + "\\\\".join(
                "&".join(atom(rng) for _ in range(rng.randint(1, 8)))
                for _ in range(rng.randint(1, 8))
            )
            + "\\end{pmatrix}"
        ),
    )
    parts = [rng.choice(makers)()]
    while sum(map(len, parts)) < target:
        parts.append(rng.choice(makers)())
    return rng.choice((" ", "", ", ", "+", "=", "\\cdot ")).join(parts)


def fragments(rng: random.Random, target: int) -> str:
    """Anything goes: prose, maths and stray symbols in random order."""
    pieces = []
    while sum(map(len, pieces)) < target:
        kind = rng.random()
        if kind < 0.3:
            pieces.append(prose(rng, rng.randint(1, 30)))
        elif kind < 0.8:
            pieces.append(answer(rng, rng.randint(1, 200)))
        else:
            pieces.append(rng.choice("=,()[]{}\n+^\\$!%*") * rng.randint(1, 20))
    return rng.choice((" ", "", "\n")).join(pieces)


def rewrite(rng: random.Random, text: str) -> str:
    """The same answer written differently, so the verifier has to compare it in depth."""
    kind = rng.random()
    if kind < 0.3:
        return ", ".join(reversed(text.split(", ")))
    if kind < 0.5:
        return text.replace("+", " + ").replace("*", " \\cdot ")
    if kind < 0.7:
        return f"1\\cdot({text})"
    if kind < 0.85:
        return text + "+0"
    return text.replace("x", "y")


def case(rng: random.Random, max_chars: int) -> tuple[str, str]:
    """One (response, label) pair; the response has at most ``max_chars`` characters."""
    size = rng.choice((rng.randint(1, 80), rng.randint(1, 600), rng.randint(1, max_chars)))
    if rng.random() < 0.3:
        return fragments(rng, size)[:max_chars], answer(rng, rng.randint(1, 60))
    final = answer(rng, size) if rng.random() < 0.8 else fragments(rng, size)
    final = final[: max(1, max_chars - 200)]
    response = prose(rng, rng.randint(0, 30))[:150] + rng.choice(PLACEMENTS).format(final)
    label = rewrite(rng, final) if rng.random() < 0.7 else answer(rng, rng.randint(1, 60))
    return response[:max_chars], label
