"""Final-answer extraction and comparison for verifiable numeric rewards.

Order of evidence in a reply: the last ``#### N`` marker that holds a number (GSM8K
solutions put exactly one at the end; a model that writes several has revised itself,
so its last one is judged), then the last ``\\boxed{N}``, then, unless ``strict``, the
last number anywhere in the text.

Numbers are compared as canonical decimal strings ("3.50" == "3.5" == "3.5000",
".5" == "0.5", "1,000" == "1000", "−7" == "-7"). Fractions ("1/2") and scientific
notation are *not* numbers here: every GSM8K ground truth is a plain integer, and a
fraction policy would have to decide "2/4" and "1 1/2" too; a model asked for a number
can write 0.5. A number glued to letters ("mp3", "B12", "42kg") is part of a word, not
a quantity; "42 kg" holds 42.

Every search is one pass of a regular expression whose alternatives cannot overlap,
so a reply of 1 MB is scanned in milliseconds whatever it contains.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from skyrl_gym.error import EnvError

__all__ = [
    "RULE_METHODS",
    "answers_match",
    "check_extra_info",
    "check_reward_spec",
    "extract_answer",
    "normalize_number",
]

DASHES = "\u2010\u2011\u2012\u2013\u2014\u2212\ufe63\uff0d"
"""Hyphen, non-breaking hyphen, figure/en/em dash, minus sign, small and full-width
hyphen-minus: what models and typeset text write for a minus."""
_TO_ASCII_MINUS = str.maketrans(dict.fromkeys(DASHES, "-"))
_SIGN = f"[-+{DASHES}]"

# Digits with well-formed thousands groups, or plain digits; an optional fraction.
_CORE = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
# A number ends before anything that would make it part of a longer token: a word
# character ("12abc"), or a separator followed by a digit ("1.2.3", "3,4", "1,00").
_END = r"(?![\w]|[.,][0-9])"
# "-5", "-$5", "$-5", "$5"; LaTeX writes the dollar as "\\$".
_PREFIX = rf"(?:{_SIGN}(?:\\?\$)?|(?:\\?\$)?{_SIGN}?)"

_MARKED = re.compile(rf"####\s*(?P<num>{_PREFIX}(?:{_CORE})){_END}")
_BOXED = re.compile(rf"\\boxed\{{\s*(?P<num>{_PREFIX}(?:{_CORE}))\s*\}}")
# No sign here: whether "-" is a minus sign or a subtraction is decided in Python
# for the one match that is used (see _with_sign).
_LOOSE = re.compile(rf"(?<![\w.,])(?:{_CORE}){_END}")
_NUMBER = re.compile(
    r"(?P<sign>-?)\$?(?P<sign2>-?)(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)"
    r"(?:\.(?P<frac>[0-9]*))?"
)

RULE_METHODS = ("rule",)
"""``reward_spec["method"]`` values the rule-based environments accept."""


def normalize_number(s: str | int | float) -> str | None:
    """The canonical decimal string of ``s``, or None when ``s`` is not a number.

    Strips surrounding spaces, one ``$``, a leading ``+``, thousands commas (only in
    well-formed groups: "1,00" is refused), leading zeros and trailing fractional
    zeros; maps dash variants to "-"; "-0" is "0". ``int``/``float`` ground truths
    are accepted too (``bool`` is not a number here).
    """
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return str(s)
    if isinstance(s, float):
        if not math.isfinite(s):
            return None
        s = format(Decimal(repr(s)), "f")
    if not isinstance(s, str):
        return None
    text = s.strip().translate(_TO_ASCII_MINUS)
    if text.startswith("+") and not text.startswith(("++", "+-")):
        text = text[1:]
    m = _NUMBER.fullmatch(text)
    if m is None or (m["sign"] and m["sign2"]):
        return None
    whole = m["int"].replace(",", "").lstrip("0")
    frac = (m["frac"] or "").rstrip("0")
    if not m["int"] and not m["frac"]:  # "", "$", "-", "." hold no digit
        return None
    digits = (whole or "0") + (f".{frac}" if frac else "")
    negative = bool(m["sign"] or m["sign2"]) and digits != "0"
    return f"-{digits}" if negative else digits


def _with_sign(text: str, start: int, digits: str) -> str:
    """``digits`` with the sign written right before it (after an optional ``$``),
    when that sign is unary: "is -5", "(-5", "$-5", "-$5"; not "10-5" or "x)-5"."""
    i = start
    if i > 0 and text[i - 1] == "$":
        i -= 1
    if i > 0 and text[i - 1] in DASHES + "-":
        before = text[i - 2] if i > 1 else " "
        if not (before.isalnum() or before in "_)]"):
            return "-" + digits
    return digits


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    tail = deque(pattern.finditer(text), maxlen=1)  # drains the iterator in C
    return tail[0] if tail else None


def extract_answer(text: str, *, strict: bool = False) -> str | None:
    """The reply's final answer as a canonical number string, or None (see module doc)."""
    if not isinstance(text, str):
        return None
    for pattern in (_MARKED, _BOXED):
        last = _last(pattern, text)
        if last is not None:
            return normalize_number(last["num"].replace("\\$", "$"))
    if strict:
        return None
    loose = _last(_LOOSE, text)
    if loose is None:
        return None
    return normalize_number(_with_sign(text, loose.start(), loose.group()))


def answers_match(pred: str | int | float | None, truth: str | int | float) -> bool:
    """Whether two answers are the same number (canonical strings compared exactly)."""
    if pred is None:
        return False
    a = normalize_number(pred)
    return a is not None and a == normalize_number(truth)


def check_reward_spec(
    env: str, reward_spec: Any, *, methods: tuple[str, ...] = RULE_METHODS
) -> str:
    """The canonical ground truth of a dataset row's ``reward_spec``; raises
    ``EnvError`` naming the field when the spec is not one this environment scores."""
    if not isinstance(reward_spec, Mapping):
        raise EnvError(
            f"{env}.reward_spec: expected a mapping with 'method' and 'ground_truth', "
            f"got {reward_spec!r:.120}"
        )
    unknown = sorted(set(reward_spec) - {"method", "ground_truth"})
    if unknown:
        raise EnvError(
            f"{env}.reward_spec: expected only 'method' and 'ground_truth', got {unknown}"
        )
    method = reward_spec.get("method")
    if method not in methods:
        raise EnvError(f"{env}.reward_spec.method: expected one of {list(methods)}, got {method!r}")
    if "ground_truth" not in reward_spec:
        raise EnvError(f"{env}.reward_spec.ground_truth: expected a number, got nothing")
    truth = reward_spec["ground_truth"]
    canonical = normalize_number(truth)
    if canonical is None:
        raise EnvError(
            f"{env}.reward_spec.ground_truth: expected a number or numeric string, "
            f"got {truth!r:.120}"
        )
    return canonical


def check_extra_info(env: str, extra_info: Any) -> dict[str, Any]:
    """``extra_info`` as a dict (None is an empty one); it is carried, never scored."""
    if extra_info is None:
        return {}
    if not isinstance(extra_info, Mapping):
        raise EnvError(f"{env}.extra_info: expected a mapping or None, got {extra_info!r:.120}")
    return dict(extra_info)
