"""Multi-turn tool use: a calculator the model calls as ``<calc>expr</calc>``.

Each turn the first ``<calc>…</calc>`` in the reply is evaluated and answered with a
``<result>…</result>`` message; a reply with a final answer (``#### N`` or
``\\boxed{N}``) ends the episode with reward 1.0 when it equals the ground truth, else
0.0; a reply with neither gets a one-line hint. Running out of turns scores 0.

The evaluator is a hand-written recursive-descent parser over exact fractions, not
``eval`` nor ``ast.parse`` (which recurses before any check could run): numbers,
``+ - * / // % **`` (``^`` is read as ``**``, as calculators do), unary signs and
parentheses, nothing else. Every limit is checked before the work it bounds:
expressions are at most 200 characters, nested at most 32 deep, and no number may
reach 10**100 (a power is refused from its operands' sizes before it is computed), so
any input is answered in well under a millisecond. Tool errors are observations
(``<result>error: …</result>``), never exceptions.

The tool is a ``ToolGroup`` (``CalculatorToolGroup``), called through
``BaseTextEnv._execute_tool`` as any SkyRL tool is. ``max_turns`` is a setting
(``environment.skyrl_gym.calculator.max_turns``, 4).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from skyrl_gym.core import Message, action_text
from skyrl_gym.envs._checks import (
    check_settings,
    int_setting,
)
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.answers import (
    answers_match,
    check_extra_info,
    check_reward_spec,
    extract_answer,
)
from skyrl_gym.envs.arith_problems import sample_graded
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.error import EnvError
from skyrl_gym.tools.core import ToolGroup, tool

MAX_EXPR_CHARS = 200
MAX_DEPTH = 32
MAX_MAGNITUDE = 10**100
"""Numerators and denominators stay below this: ~333 bits, so every operation is cheap."""
_MAX_BITS = MAX_MAGNITUDE.bit_length()
RESULT_DIGITS = 10
"""Non-integer results are shown rounded to this many decimal places."""

OPEN, CLOSE = "<calc>", "</calc>"
HINT = "Use <calc>expression</calc> to calculate, or answer with '#### <number>'."
TOOL_HELP = (
    "You may use a calculator: write <calc>expression</calc> with numbers, "
    "+ - * / // % ** and parentheses, and the result comes back as <result>...</result>. "
    "When you know the answer, write it on the last line as '#### <number>'."
)

# Every non-space character falls into one group, so finditer skips only whitespace.
_TOKEN = re.compile(
    r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(?P<op>\*\*|//|[-+*/%^()])"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<bad>\S)"
)


class CalcError(EnvError):
    """A tool error; its message is shown to the model after ``error: ``."""


def _bounded(x: Fraction) -> Fraction:
    if abs(x.numerator) >= MAX_MAGNITUDE or x.denominator >= MAX_MAGNITUDE:
        raise CalcError("number out of range (limit 10**100)")
    return x


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalcError("only whole-number exponents are supported")
    e = exponent.numerator
    if base == 0 and e < 0:
        raise CalcError("division by zero")
    if base not in (0, 1, -1):
        # |result| >= 2**(|e| * (bits - 1)) for the larger of numerator/denominator,
        # so this refuses 9**9**9 before computing it, and whatever passes is <= ~700 bits.
        bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
        if abs(e) * (bits - 1) >= _MAX_BITS:
            raise CalcError("number out of range (limit 10**100)")
    return _bounded(base**e)


_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: Fraction(a // b),
    "%": lambda a, b: a % b,
}


class _Parser:
    """expr := term (("+"|"-") term)* ; term := unary (("*"|"/"|"//"|"%") unary)* ;
    unary := ("+"|"-") unary | power ; power := atom (("**"|"^") unary)? ;
    atom := number | "(" expr ")". Python's precedence: -2**2 == -4, 2**-1 == 0.5."""

    def __init__(self, tokens: list[str | Fraction]) -> None:
        self.tokens = tokens
        self.i = 0

    def peek(self) -> str | Fraction | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str | Fraction | None:
        token = self.peek()
        self.i += 1
        return token

    def parse(self) -> Fraction:
        value = self.expr(0)
        if self.i < len(self.tokens):
            raise CalcError(f"unexpected {_show(self.peek())}")
        return value

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while (op := self.peek()) in ("+", "-"):
            self.take()
            value = _bounded(_BINARY[str(op)](value, self.term(depth)))
        return value

    def term(self, depth: int) -> Fraction:
        value = self.unary(depth)
        while (op := self.peek()) in ("*", "/", "//", "%"):
            self.take()
            value = _bounded(_BINARY[str(op)](value, self.unary(depth)))
        return value

    def unary(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalcError(f"expression nested deeper than {MAX_DEPTH}")
        if (op := self.peek()) in ("+", "-"):
            self.take()
            value = self.unary(depth + 1)
            return -value if op == "-" else value
        base = self.atom(depth)
        if self.peek() in ("**", "^"):
            self.take()
            return _power(base, self.unary(depth + 1))
        return base

    def atom(self, depth: int) -> Fraction:
        token = self.take()
        if isinstance(token, Fraction):
            return token
        if token == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise CalcError("missing ')'")
            return value
        raise CalcError(f"expected a number, got {_show(token)}")


def _show(token: str | Fraction | None) -> str:
    return "end of expression" if token is None else f"'{token}'"


def _tokens(expr: str) -> list[str | Fraction]:
    tokens: list[str | Fraction] = []
    for m in _TOKEN.finditer(expr):
        if m["num"] is not None:
            tokens.append(_bounded(Fraction(m["num"])))
        elif m["op"] is not None:
            tokens.append(m["op"])
        elif m["name"] is not None:
            raise CalcError(f"names are not allowed: '{m['name']}'")
        else:
            raise CalcError(f"unexpected character '{m['bad']}'")
    return tokens


def evaluate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression; raises ``CalcError`` otherwise."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens = _tokens(expr)
    if not tokens:
        raise CalcError("empty expression")
    try:
        return _Parser(tokens).parse()
    except ZeroDivisionError:
        raise CalcError("division by zero") from None


def format_number(x: Fraction) -> str:
    """An integer as is; otherwise a decimal rounded to ``RESULT_DIGITS`` places."""
    if x.denominator == 1:
        return str(x.numerator)
    scaled = round(x * 10**RESULT_DIGITS)
    whole, frac = divmod(abs(scaled), 10**RESULT_DIGITS)
    digits = str(frac).rjust(RESULT_DIGITS, "0").rstrip("0")
    sign = "-" if scaled < 0 else ""
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def run_tool(expr: str) -> tuple[str, bool]:
    """The ``<result>`` text for one call, and whether it was an error."""
    try:
        return format_number(evaluate(expr)), False
    except CalcError as exc:
        return f"error: {exc}", True


def find_call(text: str) -> str | None:
    """The text inside the first complete ``<calc>…</calc>``, or None.

    ``str.find`` rather than a lazy regex: a reply of many unclosed ``<calc>`` tags
    would make a lazy search rescan the tail for each one (quadratic)."""
    start = text.find(OPEN)
    if start < 0:
        return None
    end = text.find(CLOSE, start + len(OPEN))
    return None if end < 0 else text[start + len(OPEN) : end]


def calculator_prompt(question: str) -> list[Message]:
    return [{"role": "user", "content": f"{question.strip()}\n{TOOL_HELP}"}]


class CalculatorToolGroup(ToolGroup):
    def __init__(self) -> None:
        super().__init__(name="CalculatorToolGroup")

    @tool
    def calc(self, expr: str) -> str:
        """The ``<result>`` message for one expression (an error is a result too)."""
        result, _failed = run_tool(expr)
        return f"<result>{result}</result>"


NAME = "calculator"


class CalculatorEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_settings(env_config, NAME, ("max_turns",))
        extras = extras if extras is not None else {}
        self.ground_truth = check_reward_spec(NAME, extras.get("reward_spec"))
        self.extra_info = check_extra_info(NAME, extras.get("extra_info"))
        self.max_turns = int_setting(env_config, NAME, "max_turns", 4, low=1, high=64)
        self.tools = CalculatorToolGroup()
        self.init_tool_groups([self.tools])
        self.tool_calls = 0
        self.tool_errors = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        text = action_text(action)
        answer = extract_answer(text, strict=True)
        if answer is not None:
            solved = answers_match(answer, self.ground_truth)
            return end_turn(
                self,
                observations=[],
                reward=1.0 if solved else 0.0,
                done=True,
                metadata=self._metadata(solved, answer),
            )
        expr = find_call(text)
        if expr is None:
            message = HINT
        else:
            message = self._execute_tool(self.tools.name, "calc", (expr,))
            self.tool_calls += 1
            self.tool_errors += message.startswith("<result>error: ")
        return end_turn(
            self,
            observations=[{"role": "user", "content": message}],
            reward=0.0,
            done=False,
            metadata=self._metadata(False, None),
        )

    def _metadata(self, solved: bool, extracted: str | None) -> dict[str, Any]:
        return {
            "solved": solved,
            "extracted": extracted,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
        }

    def get_metrics(self) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors}

    @classmethod
    def sample_task(
        cls, rng: random.Random, *, difficulty: int = 1
    ) -> tuple[list[Message], dict[str, Any]]:
        problem, extras = sample_graded(rng, difficulty=difficulty)
        return calculator_prompt(problem.question), extras
