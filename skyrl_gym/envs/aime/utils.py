"""AIME scoring in SkyRL's signature: ``compute_score(solution_str, ground_truth,
strict_box_verify=False, pause_tokens_index=None) -> {"score", "acc", "pred"}``.

Two ways to read a reply, both looking only at its last 300 characters (a final
answer is short, and the cut keeps scoring a runaway reply cheap):

* default, the Minerva rule (Lewkowycz et al. 2022, as lm-evaluation-harness's
  ``hendrycks_math`` applies it): the text after the last ``Answer:`` up to the line's
  end or a ``<`` (so a chat template's ``<|im_end|>`` is not part of it), normalized
  the same way as the ground truth, must equal it;
* ``strict_box_verify``: the last ``\\boxed{...}`` within the final 100 characters must
  hold exactly the ground truth, no normalization.

Unlike SkyRL, ``pred`` is None (not ``"[INVALID]"``) when the reply gives no answer, and
an answer that normalizes to nothing never counts as right.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from skyrl_gym.core import action_text
from skyrl_gym.error import EnvError

TAIL_CHARS = 300
"""How much of the reply is read (SkyRL's cut: MATH-500's longest answer is 159 chars)."""
STRICT_TAIL_CHARS = 100
"""Where strict mode looks for the box: this many characters before the end (or before
the last pause token)."""
BOX_OPEN = "\\boxed{"

# --- Minerva normalization tables. Applied in order, by plain substring replacement. ---
_REWRITES: tuple[tuple[str, str], ...] = (
    # English articles go first, while the spaces that delimit them still exist.
    ("an ", ""),
    ("a ", ""),
    # A sentence-final period inside math, escaped dollars, forced and plain spaces.
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    # Old-style \mbox is \text; "x \text{and} y" is a list; metres are a unit to drop.
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_UNIT_WORDS: tuple[str, ...] = (
    # Units and counted nouns that MATH answers carry after the number (spaces are
    # already gone, so "5 square feet" is "5squarefeet" by now).
    *("cents", "dollars", "pounds"),
    *("cm", "feet", "inches", "km", "meters", "mph", "square", "units"),
    *("degrees", "gm", "hours", "minutes"),
    *("childrentickets", "digits", "edges", "integers", "meals", "multiples"),
    *("points", "students", "sue", "ways"),
)
_LATEX_DROPPED: tuple[str, ...] = (
    # Ellipses: \ldots must go before \dots, which it contains.
    "\\ldots",
    # What unit removal leaves of \text{...}: a plural "s", a period, an empty box
    # (with a power first, so that the "^2" goes along with it).
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3"),
    *("\\text{\n}", "\\text{}"),
    # Ordinal and degree marks.
    *("\\mathrm{th}", "^\\circ", "^{\\circ}"),
    # Thin spaces, thousands separators, quotes, the remaining ellipsis.
    *("\\;", ",\\!", "{,}", '"', "\\dots"),
)
_UNWRAPPED_COMMANDS = ("text", "textbf", "overline")
# Shorthand TeX: \fracab is \frac{a}{b}, \sqrt2 is \sqrt{2} (fixed width, linear).
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n<]+)", re.IGNORECASE)


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` in ``string``, braces balanced, or None when there is
    none or it never closes."""
    start = string.rfind(BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for index in range(start + len(BOX_OPEN) - 1, len(string)):
        char = string[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return string[start : index + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The content of ``\\boxed{content}``; ValueError for anything else."""
    if not (boxed.startswith(BOX_OPEN) and boxed.endswith("}")):
        raise ValueError(f"remove_boxed.boxed: expected '\\boxed{{...}}', got {boxed!r:.80}")
    return boxed[len(BOX_OPEN) : -1]


def _unwrap(line: str, command: str) -> str:
    """``\\command{x}`` -> ``x`` for each occurrence, up to the first ``}`` after it
    (what a lazy regex does, without its quadratic rescans of an unclosed line)."""
    opener = f"\\{command}{{"
    pieces: list[str] = []
    done = 0
    while (start := line.find(opener, done)) >= 0:
        close = line.find("}", start + len(opener))
        if close < 0:  # nothing later on the line closes either
            break
        pieces += (line[done:start], line[start + len(opener) : close])
        done = close + 1
    pieces.append(line[done:])
    return "".join(pieces)


def _normalize_line(line: str) -> str:
    """Per-line steps (the patterns they mirror never cross a newline)."""
    dollars = line.split("$", 2)
    if len(dollars) == 3:  # keep only the first $...$ span of the line
        line = f"${dollars[1]}$"
    for command in _UNWRAPPED_COMMANDS:
        line = _unwrap(line, command)
    start, close = line.find(BOX_OPEN), line.rfind("}")
    if start >= 0 and close >= start + len(BOX_OPEN):  # first box open to last brace
        line = line[:start] + line[start + len(BOX_OPEN) : close] + line[close + 1 :]
    return line


def normalize_final_answer(final_answer: str) -> str:
    """The Minerva normal form of an answer: what follows the last ``=``, without
    spaces, articles, units, dollar signs, ``\\text``/``\\boxed`` wrappers or thousands
    separators, with shorthand ``\\frac``/``\\sqrt`` arguments braced. Linear time."""
    text = final_answer.rsplit("=", 1)[-1]
    for old, new in _REWRITES:
        text = text.replace(old, new)
    for fragment in (*_UNIT_WORDS, *_LATEX_DROPPED):
        text = text.replace(fragment, "")
    text = "\n".join(_normalize_line(line) for line in text.split("\n"))
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text).replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(solution_str: str) -> str | None:
    """The raw text after the reply's last ``Answer:``, or None."""
    answers = _ANSWER_LINE.findall(solution_str)
    return answers[-1] if answers else None


def is_correct_minerva(solution_str: str, ground_truth: str) -> tuple[bool, str | None]:
    """(right?, normalized prediction or None) under the Minerva rule."""
    answer = extract_answer(solution_str)
    if answer is None:
        return False, None
    pred = normalize_final_answer(answer)
    return pred != "" and pred == normalize_final_answer(ground_truth), pred


def _check_pause_tokens(pause_tokens_index: Any) -> list[int]:
    if (
        not isinstance(pause_tokens_index, Sequence)
        or isinstance(pause_tokens_index, str)
        or len(pause_tokens_index) != 4
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in pause_tokens_index)
    ):
        raise EnvError(f"aime.pause_tokens_index: expected 4 ints, got {pause_tokens_index!r:.80}")
    return list(pause_tokens_index)


def is_correct_strict_box(
    solution_str: str, ground_truth: str, pause_tokens_index: Sequence[int] | None = None
) -> tuple[bool, str | None]:
    """(right?, boxed content or None): the last box near the end must equal the ground
    truth verbatim. With ``pause_tokens_index`` (4 positions) the window ends 100
    characters before the last pause token instead, as SkyRL slices it."""
    if pause_tokens_index is None:
        window = solution_str[-STRICT_TAIL_CHARS:]
    else:
        window = solution_str[_check_pause_tokens(pause_tokens_index)[-1] - STRICT_TAIL_CHARS :]
    boxed = last_boxed_only_string(window)
    pred = remove_boxed(boxed) if boxed is not None else None
    return pred == ground_truth, pred


def _truth_text(ground_truth: Any) -> str:
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        return str(ground_truth)  # AIME answers are integers; some datasets store them so
    if not isinstance(ground_truth, str):
        raise EnvError(f"aime.ground_truth: expected a string or int, got {ground_truth!r:.80}")
    return ground_truth


def compute_score(
    solution_str: str | bytes,
    ground_truth: str | int,
    strict_box_verify: bool = False,
    pause_tokens_index: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``{"score": 1.0 or -1.0, "acc": bool, "pred": str | None}`` for one reply.

    Never raises on the reply (any text or bytes); a bad ``ground_truth`` or
    ``pause_tokens_index`` is the caller's mistake and raises ``EnvError``.
    """
    truth = _truth_text(ground_truth)
    tail = action_text(solution_str)[-TAIL_CHARS:]
    if strict_box_verify:
        correct, pred = is_correct_strict_box(tail, truth, pause_tokens_index)
    else:
        correct, pred = is_correct_minerva(tail, truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
