"""A small LaTeX-to-sympy parser for final answers (no ANTLR).

Grammar (implicit multiplication binds like ``*``; ``^`` is right-associative)::

    expr   := term (('+' | '-' | '\\pm') term)*
    term   := signed (('*' | '/' | '\\cdot' | '\\times' | '\\div' | <implicit>) signed)*
    signed := ('-' | '+') signed | power
    power  := postfix ('^' exponent)?
    postfix:= atom '!'*
    atom   := number | symbol [_sub] | '(' expr ')' | '{' expr '}' | '|' expr '|'
            | \\frac{a}{b} | \\sqrt[n]{x} | \\binom{n}{k} | function arg | constant

Numbers become exact ``Rational``s; ``e``, ``i`` and ``\\pi`` are E, I and pi. Input longer
or deeper than ``bounds.MAX_TOKENS`` / ``MAX_NESTING``, and exact numbers (literals, products,
powers, roots, factorials, binomials) that would be astronomically large raise
``LatexParseError`` instead of hanging. Anything outside the grammar raises it too.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import sympy

from rl_rewards.math import bounds
from rl_rewards.math.numeric import evaluate

_TOKEN_RE = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\[a-zA-Z]+|\\[{}|]|[a-zA-Z]|\S)")
_GREEK_WORDS = """
alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma
tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega
"""
_GREEK = frozenset(_GREEK_WORDS.split())
_FUNCTIONS = {
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tan": sympy.tan,
    "cot": sympy.cot,
    "sec": sympy.sec,
    "csc": sympy.csc,
    "arcsin": sympy.asin,
    "arccos": sympy.acos,
    "arctan": sympy.atan,
    "sinh": sympy.sinh,
    "cosh": sympy.cosh,
    "tanh": sympy.tanh,
    "ln": sympy.log,
    "exp": sympy.exp,
    "log": sympy.log,
}
_WORD_FUNCTIONS = (
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "sqrt",
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "log",
    "exp",
    "ln",
)
_MULTIPLY = {"*", "\\cdot", "\\times", "\\ast"}
_DIVIDE = {"/", "\\div"}
_MAX_FACTORIAL = 500
_MAX_FLOOR_ARGUMENT = 1e30  # sympy finds the integer part of larger constants slowly


class LatexParseError(ValueError):
    """The answer is not an expression this parser understands."""


def _tokenize(text: str) -> list[str]:
    tokens = _TOKEN_RE.findall(text)
    merged: list[str] = []
    i = 0
    while i < len(tokens):  # bare words "sqrt", "sin", ... become commands
        word = next((w for w in _WORD_FUNCTIONS if tokens[i : i + len(w)] == list(w)), None)
        if word and tokens[i].isalpha():
            merged.append("\\" + word)
            i += len(word)
        else:
            merged.append(tokens[i])
            i += 1
    return merged


def _power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    bounds.check_power(base, exponent)
    return bounds.check_exact(sympy.Pow(base, exponent))


def _rounded(inner: sympy.Expr, name: str) -> sympy.Expr:
    if not inner.free_symbols and not inner.is_Rational:
        value = evaluate(inner, {})
        if value is None or abs(value) > _MAX_FLOOR_ARGUMENT:
            raise bounds.TooLarge("floor or ceiling of a huge or undefined number")
    return sympy.floor(inner) if name == "lfloor" else sympy.ceiling(inner)


def parse_latex(text: str) -> sympy.Expr:
    """Parse one scalar LaTeX expression (no commas, no relations) into sympy."""
    tokens = _tokenize(text)
    if len(tokens) > bounds.MAX_TOKENS:
        raise LatexParseError(f"expression longer than {bounds.MAX_TOKENS} tokens")
    parser = _Parser(tokens)
    try:
        result = parser.expr()
    except bounds.TooLarge as exc:
        raise LatexParseError(str(exc)) from exc
    if parser.pos != len(parser.tokens):
        raise LatexParseError(f"unexpected {parser.tokens[parser.pos]!r} in {text[:200]!r}")
    return result


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.abs_depth, self.depth = tokens, 0, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise LatexParseError(f"expected {expected or 'more input'}, got {token!r}")
        self.pos += 1
        return token

    def nested(self, parse: Callable[[], sympy.Expr]) -> sympy.Expr:
        """``parse()`` one level deeper: atoms and exponents nest, and a bound on their depth
        keeps the parser's, sympy's and ``numeric.evaluate``'s recursion short."""
        self.depth += 1
        if self.depth > bounds.MAX_NESTING:
            raise LatexParseError(f"nested deeper than {bounds.MAX_NESTING} levels")
        result = parse()
        self.depth -= 1
        return result

    def expr(self) -> sympy.Expr:
        result = self.term()
        while self.peek() in ("+", "-"):
            sign = self.take()
            right = self.term()
            result = result + right if sign == "+" else result - right
        return result

    def term(self) -> sympy.Expr:
        result = self.signed()
        while True:
            token = self.peek()
            if token in _MULTIPLY:
                self.take()
                result = bounds.check_exact(result * self.signed())
            elif token in _DIVIDE:
                self.take()
                divisor = self.signed()
                if divisor == 0:
                    raise LatexParseError("division by zero")
                result = bounds.check_exact(result / divisor)
            elif self._starts_atom(token):
                result = bounds.check_exact(result * self.power())
            else:
                return result

    def signed(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            return -self.signed()
        if self.peek() == "+":
            self.take()
            return self.signed()
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.postfix()
        if self.peek() != "^":
            return base
        self.take()
        exponent = self.nested(self.group if self.peek() == "{" else self.signed_exponent)
        return _power(base, exponent)

    def signed_exponent(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            return -self.signed_exponent()
        return self.power()

    def postfix(self) -> sympy.Expr:
        result = self.nested(self.atom)
        while self.peek() == "!":
            self.take()
            if not (result.is_Integer and 0 <= result <= _MAX_FACTORIAL):
                raise LatexParseError("factorial argument too large or not an integer")
            result = sympy.factorial(result)
        return result

    def _starts_atom(self, token: str | None) -> bool:
        if token is None:
            return False
        if token == "|":
            return self.abs_depth == 0
        if token[0].isalnum() or token[0] == "." or token in ("(", "{", "\\{"):
            return True
        return token.startswith("\\") and token[1:].isalpha() and token not in _COMMAND_STOPS

    def group(self) -> sympy.Expr:
        self.take("{")
        result = self.expr()
        self.take("}")
        return result

    def atom(self) -> sympy.Expr:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            if len(token) > bounds.MAX_DIGITS:
                raise LatexParseError(f"number longer than {bounds.MAX_DIGITS} digits")
            return sympy.Rational(token.rstrip(".") or "0")
        if token.isalpha():
            return self._symbol(token)
        if token in ("(", "["):
            result = self.expr()
            self.take(")" if token == "(" else "]")
            return result
        if token == "{":
            self.pos -= 1
            return self.group()
        if token == "|":
            self.abs_depth += 1
            inner = self.expr()
            self.take("|")
            self.abs_depth -= 1
            return sympy.Abs(inner)
        return self._command(token)

    def _symbol(self, name: str) -> sympy.Expr:
        if name == "e":
            return sympy.E
        if name == "i":
            return sympy.I
        if self.peek() == "_":
            self.take()
            sub = self.take() if self.peek() != "{" else self._raw_group()
            return sympy.Symbol(f"{name}_{sub}")
        return sympy.Symbol(name)

    def _raw_group(self) -> str:
        self.take("{")
        start = self.pos
        while self.peek() not in ("}", None):
            self.pos += 1
        text = "".join(self.tokens[start : self.pos])
        self.take("}")
        return text

    def _command(self, token: str) -> sympy.Expr:
        name = token[1:]
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name in _GREEK:
            return self._symbol(name)
        if name in ("frac", "cfrac"):
            numerator = self.group()
            denominator = self.group()
            if denominator == 0:
                raise LatexParseError("division by zero")
            return bounds.check_exact(numerator / denominator)
        if name == "sqrt":
            return self._sqrt()
        if name == "binom":
            n, k = self.group(), self.group()
            bounds.check_binomial(n, k)
            return sympy.binomial(n, k)
        if name in ("lfloor", "lceil"):
            inner = self.expr()
            self.take("\\rfloor" if name == "lfloor" else "\\rceil")
            return _rounded(inner, name)
        if name in _FUNCTIONS:
            return self._function(name)
        raise LatexParseError(f"unsupported command {token!r}")

    def _sqrt(self) -> sympy.Expr:
        if self.peek() == "[":
            self.take("[")
            index = self.expr()
            self.take("]")
            if index == 0:
                raise LatexParseError("root of index 0")
            return _power(self.group(), 1 / index)
        return _power(
            self.group() if self.peek() == "{" else self.nested(self.atom), sympy.Rational(1, 2)
        )

    def _function(self, name: str) -> sympy.Expr:
        base = None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.group() if self.peek() == "{" else self.nested(self.atom)
        exponent = None
        if self.peek() == "^":
            self.take()
            exponent = self.nested(self.group if self.peek() == "{" else self.atom)
        argument = self.power() if self.peek() in ("(", "{") else self.term()
        if name == "exp":
            bounds.check_tower(argument)
        value = sympy.log(argument, base) if base is not None else _FUNCTIONS[name](argument)
        return _power(value, exponent) if exponent is not None else value


_CONSTANTS = {"pi": sympy.pi, "infty": sympy.oo, "e": sympy.E, "imath": sympy.I}
_COMMAND_STOPS = frozenset(_MULTIPLY | _DIVIDE | {"\\rfloor", "\\rceil", "\\pm", "\\mp"})
