"""LiveCodeBench-style grading: pull the program out of a reply, run it on the tests.

Test kinds (``testtype``), as in LiveCodeBench rows:

* ``stdin``: the program reads ``input`` on stdin; its stdout must match ``output``
  line by line: both are stripped, split on newlines, each line stripped; lines must
  be equal as text, or as lists of numbers read as ``Decimal`` ("1.50" == "1.5").
  Line counts must agree.
* ``functional``: ``input`` holds one JSON value per line, the arguments of
  ``Solution().<func_name>`` (``func_name`` from the first test's ``metadata``), or
  of a top-level function of that name when the program has no ``Solution``; the
  result must equal ``output`` (JSON) once tuples are read as lists.

A few standard modules and names (``PRELUDE``: typing, collections, ...) are
defined before the program runs, as LeetCode-style solutions often assume them.
Each test is a separate sandboxed run, and grading stops at the first failure.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from skyrl_gym.error import EnvError
from skyrl_gym.sandbox import SandboxLimits, run_python

TESTTYPES = ("stdin", "functional")
FIELD = "lcb.extras.reward_spec.ground_truth"
PRELUDE = (
    "import bisect, collections, functools, heapq, itertools, math, operator, random, re, "
    "string, sys\n"
    "from bisect import bisect_left, bisect_right, insort\n"
    "from collections import Counter, OrderedDict, defaultdict, deque\n"
    "from functools import cache, cmp_to_key, lru_cache, reduce\n"
    "from heapq import heapify, heappop, heappush, heappushpop, nlargest, nsmallest\n"
    "from itertools import accumulate, chain, combinations, permutations, product\n"
    "from math import ceil, comb, floor, gcd, inf, isqrt, log2, sqrt\n"
    "from typing import *\n"
)
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class Test:
    input: str
    output: str
    testtype: str


@dataclass(frozen=True)
class Outcome:
    passed: int
    total: int
    failure: str | None
    """None when every test passed; else ``wrong_answer`` or the run's sandbox status."""
    status: str | None
    """The sandbox status of the first failing test's run."""


def extract_code(reply: str) -> str | None:
    """The last ```python block of the reply, else its last fenced block, else None."""
    blocks = [(lang.strip().lower(), body) for lang, body in _FENCE.findall(reply)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    chosen = python[-1] if python else blocks[-1][1] if blocks else None
    if chosen is None or not chosen.strip():
        return None
    return chosen.strip("\n")


def parse_tests(ground_truth: Any) -> tuple[list[Test], str | None]:
    """The tests of a row (a JSON string, or its decoded list), and ``func_name``."""
    raw = ground_truth
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise EnvError(
                f"{FIELD}: expected a JSON list of tests, got {ground_truth!r:.80} ({exc})"
            ) from None
    if not isinstance(raw, list) or not raw:
        raise EnvError(f"{FIELD}: expected a non-empty list of tests, got {raw!r:.80}")
    tests = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise EnvError(
                f"{FIELD}[{i}]: expected an object with input/output/testtype, got {item!r:.80}"
            )
        for key in ("input", "output"):
            if not isinstance(item.get(key), str):
                raise EnvError(f"{FIELD}[{i}].{key}: expected a str, got {item.get(key)!r:.80}")
        kind = item.get("testtype", "stdin")
        if kind not in TESTTYPES:
            raise EnvError(f"{FIELD}[{i}].testtype: expected one of {TESTTYPES}, got {kind!r}")
        tests.append(Test(item["input"], item["output"], kind))
    func_name = None
    if any(t.testtype == "functional" for t in tests):
        metadata = raw[0].get("metadata", {})
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                metadata = None
        func_name = metadata.get("func_name") if isinstance(metadata, dict) else None
        if not isinstance(func_name, str) or not func_name.isidentifier():
            raise EnvError(
                f"{FIELD}[0].metadata.func_name: expected a function name, got {func_name!r}"
            )
    return tests, func_name


def _numbers(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except (InvalidOperation, ValueError):
        return None


def outputs_match(actual: str, expected: str) -> bool:
    """The ``stdin`` comparison (see the module docstring)."""
    got = [line.strip() for line in actual.strip().split("\n")]
    want = [line.strip() for line in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        numbers_a, numbers_b = _numbers(a), _numbers(b)
        if numbers_a is None or numbers_b is None or numbers_a != numbers_b:
            return False
    return True


def _stdin_program(code: str) -> str:
    return f"__name__ = '__main__'\nexec({PRELUDE!r}, globals())\nexec(compile({code!r}, 'solution.py', 'exec'), globals())\n"


def _functional_program(code: str, func_name: str, args_text: str, nonce: str) -> str:
    return (
        "import json as _json\n"
        f"_ns = {{'__name__': 'solution'}}\n"
        f"exec({PRELUDE!r}, _ns)\n"
        f"exec(compile({code!r}, 'solution.py', 'exec'), _ns)\n"
        f"_args = [_json.loads(line) for line in {args_text!r}.split('\\n') if line.strip()]\n"
        f"_target = _ns['Solution']() if 'Solution' in _ns else _ns\n"
        f"_fn = getattr(_target, {func_name!r}) if 'Solution' in _ns else _ns[{func_name!r}]\n"
        "_result = _fn(*_args)\n"
        f"print('\\n' + {nonce!r} + _json.dumps(_result))\n"
    )


def _functional_match(stdout: str, expected: str, nonce: str) -> bool:
    """The last line the harness printed, decoded and compared with ``expected``."""
    lines = [line for line in stdout.split("\n") if line.startswith(nonce)]
    if not lines:
        return False
    try:
        return json.loads(lines[-1][len(nonce) :]) == json.loads(expected)
    except json.JSONDecodeError:
        return False


def run_tests(
    code: str, tests: list[Test], func_name: str | None, limits: SandboxLimits
) -> Outcome:
    """Run ``code`` on each test in order, stopping at the first failure."""
    for passed, test in enumerate(tests):
        if test.testtype == "functional":
            nonce = f"@@result-{secrets.token_hex(8)}@@"
            program = _functional_program(code, str(func_name), test.input, nonce)
            result = run_python(program, limits=limits)
            right = result.ok and _functional_match(result.stdout, test.output, nonce)
        else:
            result = run_python(_stdin_program(code), stdin=test.input, limits=limits)
            right = result.ok and outputs_match(result.stdout, test.output)
        if not right:
            failure = "wrong_answer" if result.ok else result.status
            return Outcome(passed, len(tests), failure, result.status)
    return Outcome(len(tests), len(tests), None, None)
