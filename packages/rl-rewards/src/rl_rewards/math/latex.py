"""A small LaTeX-to-sympy parser for final answers (no ANTLR).

Grammar (implicit multiplication binds like ``*``; ``^`` is right-associative)::

    expr   := term (('+' | '-' | '\\pm') term)*
    term   := signed (('*' | '/' | '\\cdot' | '\\times' | '\\div' | <implicit>) signed)*
    signed := ('-' | '+') signed | power
    power  := postfix ('^' exponent)?
    postfix:= atom '!'*
    atom   := number | symbol [_sub] | '(' expr ')' | '{' expr '}' | '|' expr '|'
            | \\frac{a}{b} | \\sqrt[n]{x} | \\binom{n}{k} | function arg | constant

Numbers become exact ``Rational``s; ``e``, ``i`` and ``\\pi`` are E, I and pi. Powers and
factorials whose value would be astronomically large raise ``LatexParseError`` instead of
hanging. Anything outside the grammar raises ``LatexParseError``.
"""

from __future__ import annotations

import math
import re

import sympy

_TOKEN_RE = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\[a-zA-Z]+|\\[{}|]|[a-zA-Z]|\S)")
_GREEK_WORDS = """
alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma
tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega
"""
_GREEK = frozenset(_GREEK_WORDS.split())
_FUNCTIONS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec,
    "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh, "ln": sympy.log,
    "exp": sympy.exp, "log": sympy.log,
}  # fmt: skip
_WORD_FUNCTIONS = ("arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "sqrt", "sin", "cos",
                   "tan", "cot", "sec", "csc", "log", "exp", "ln")  # fmt: skip
_MULTIPLY = {"*", "\\cdot", "\\times", "\\ast"}
_DIVIDE = {"/", "\\div"}
_MAX_DIGITS = 2000


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


def _check_size(base: sympy.Expr, exponent: sympy.Expr) -> None:
    if not (base.is_Number and exponent.is_Number) or base == 0:
        return
    magnitude = abs(float(exponent)) * max(math.log10(abs(float(base))), 1e-3) if float(base) else 0
    if magnitude > _MAX_DIGITS:
        raise LatexParseError("power too large to evaluate")


def parse_latex(text: str) -> sympy.Expr:
    """Parse one scalar LaTeX expression (no commas, no relations) into sympy."""
    parser = _Parser(_tokenize(text))
    result = parser.expr()
    if parser.pos != len(parser.tokens):
        raise LatexParseError(f"unexpected {parser.tokens[parser.pos]!r} in {text!r}")
    return result


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.abs_depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise LatexParseError(f"expected {expected or 'more input'}, got {token!r}")
        self.pos += 1
        return token

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
                result = result * self.signed()
            elif token in _DIVIDE:
                self.take()
                divisor = self.signed()
                if divisor == 0:
                    raise LatexParseError("division by zero")
                result = result / divisor
            elif self._starts_atom(token):
                result = result * self.power()
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
        exponent = self.group() if self.peek() == "{" else self.signed_exponent()
        _check_size(base, exponent)
        return sympy.Pow(base, exponent)

    def signed_exponent(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            return -self.signed_exponent()
        return self.power()

    def postfix(self) -> sympy.Expr:
        result = self.atom()
        while self.peek() == "!":
            self.take()
            if not (result.is_Integer and 0 <= result <= 500):
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
            return numerator / denominator
        if name == "sqrt":
            return self._sqrt()
        if name == "binom":
            return sympy.binomial(self.group(), self.group())
        if name in ("lfloor", "lceil"):
            inner = self.expr()
            self.take("\\rfloor" if name == "lfloor" else "\\rceil")
            return sympy.floor(inner) if name == "lfloor" else sympy.ceiling(inner)
        if name in _FUNCTIONS:
            return self._function(name)
        raise LatexParseError(f"unsupported command {token!r}")

    def _sqrt(self) -> sympy.Expr:
        if self.peek() == "[":
            self.take("[")
            index = self.expr()
            self.take("]")
            return sympy.root(self.group(), index)
        return sympy.sqrt(self.group() if self.peek() == "{" else self.atom())

    def _function(self, name: str) -> sympy.Expr:
        base = None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.group() if self.peek() == "{" else self.atom()
        exponent = None
        if self.peek() == "^":
            self.take()
            exponent = self.group() if self.peek() == "{" else self.atom()
        argument = self.power() if self.peek() in ("(", "{") else self.term()
        value = sympy.log(argument, base) if base is not None else _FUNCTIONS[name](argument)
        return value**exponent if exponent is not None else value


_CONSTANTS = {"pi": sympy.pi, "infty": sympy.oo, "e": sympy.E, "imath": sympy.I}
_COMMAND_STOPS = frozenset(_MULTIPLY | _DIVIDE | {"\\rfloor", "\\rceil", "\\pm", "\\mp"})
