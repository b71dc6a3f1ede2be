"""pass@k from n samples of a prompt, and an evaluation's figures per data source.

pass@k is the chance that at least one of k samples is correct. From n samples of a
row with c correct, the unbiased estimate (Chen et al. 2021, the Codex paper) is the
chance that k of the n drawn without replacement are not all wrong:
``1 - C(n - c, k) / C(n, k)``. It is computed here from exact integers as
``(C(n, k) - C(n - c, k)) / C(n, k)``, one division Python rounds correctly, so the
float is the exact value rounded once at any n: the usual float product
``1 - prod(1 - k / i)`` rounds at each of its c factors, and a ratio of factorials in
floats overflows past n = 170.

A sample is correct when its environment reported ``solved: True`` in a step's
metadata. An environment that never reports ``solved`` has no notion of success of its
own; there a reward above 0 counts as correct (SkyRL's rule for its pass@n), and each
group's ``correct_if`` says which rule its figures used.

Nothing here imports Ray or torch: the evaluation command and tests use it as plain
arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RowSamples", "is_correct", "pass_at_k", "pass_at_k_levels", "summarize"]


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"pass_at_k.{name}: expected an int, got {value!r}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one row with ``c`` correct among ``n`` samples; needs
    ``1 <= k <= n`` and ``0 <= c <= n`` (ints), else ``ValueError``/``TypeError``."""
    n, c, k = _count(n, "n"), _count(c, "c"), _count(k, "k")
    if n < 1:
        raise ValueError(f"pass_at_k.n: expected at least 1 sample, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k.c: expected 0 <= c <= n = {n}, got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k.k: expected 1 <= k <= n = {n}, got {k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def pass_at_k_levels(n: int) -> list[int]:
    """The k an evaluation of ``n`` samples per row reports: the powers of two up to
    ``n``, and ``n`` itself (pass@n: any sample correct)."""
    n = _count(n, "n")
    if n < 1:
        raise ValueError(f"pass_at_k.n: expected at least 1 sample, got {n}")
    levels = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return levels if levels[-1] == n else [*levels, n]


@dataclass(frozen=True)
class RowSamples:
    """One dataset row's samples as the evaluation scored them, one entry per sample."""

    data_source: str
    rewards: tuple[float, ...]
    solved: tuple[bool | None, ...]
    """The environment's ``solved``; None for a sample whose environment never said."""
    response_lengths: tuple[int, ...]
    """Tokens after the prompt: generated and observation tokens (training's
    ``response_length``)."""
    generated_tokens: tuple[int, ...]
    """The model's own tokens among them."""

    def __post_init__(self) -> None:
        n = len(self.rewards)
        sizes = (len(self.solved), len(self.response_lengths), len(self.generated_tokens))
        if n < 1 or any(size != n for size in sizes):
            raise ValueError(
                f"RowSamples ({self.data_source}): expected one or more samples with "
                f"every field of that length, got rewards {n}, solved, lengths, "
                f"generated {sizes}"
            )

    @property
    def correct(self) -> int:
        return sum(map(is_correct, self.rewards, self.solved))


def is_correct(reward: float, solved: bool | None) -> bool:
    """``solved`` when the environment reported it, else ``reward > 0``."""
    return bool(solved) if solved is not None else reward > 0


def summarize(
    rows: Sequence[RowSamples], *, ks: Sequence[int], failed_rows: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """``{"overall": figures, "by_data_source": {source: figures}}`` over ``rows``.

    ``failed_rows``: rows left out per data source (their environment failed), counted
    so that a source whose rows all failed still appears. ``overall`` pools every row
    (each row weighs the same in pass@k, each sample in the means), so it is not the
    mean of the sources'. Figures of a group with no scored row are None.
    """
    failed = dict(failed_rows or {})
    sizes = {len(row.rewards) for row in rows}
    if len(sizes) > 1:
        raise ValueError(f"rows: expected one sample count for every row, got {sorted(sizes)}")
    if rows and not all(1 <= k <= min(sizes) for k in ks):
        raise ValueError(f"ks: expected 1 <= k <= {min(sizes)} (samples per row), got {list(ks)}")
    sources = sorted({row.data_source for row in rows} | set(failed))
    return {
        "overall": _figures(rows, ks=ks, failed=sum(failed.values())),
        "by_data_source": {
            source: _figures(
                [row for row in rows if row.data_source == source],
                ks=ks,
                failed=failed.get(source, 0),
            )
            for source in sources
        },
    }


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _figures(rows: Sequence[RowSamples], *, ks: Sequence[int], failed: int) -> dict[str, Any]:
    rewards = [r for row in rows for r in row.rewards]
    solved = [s for row in rows for s in row.solved]
    reported = [bool(s) for s in solved if s is not None]
    mean = _mean(rewards)
    variance = None if mean is None else _mean([(r - mean) ** 2 for r in rewards])
    figures: dict[str, Any] = {
        "rows": len(rows),
        "failed_rows": failed,
        "samples": len(rewards),
        "reward_mean": mean,
        "reward_std": None if variance is None else math.sqrt(variance),
        # Among the samples whose environment reported it, as the training metric.
        "success_rate": _mean([float(s) for s in reported]),
    }
    for k in ks:
        figures[f"pass@{k}"] = _mean([pass_at_k(len(row.rewards), row.correct, k) for row in rows])
    figures["response_length_mean"] = _mean([n for row in rows for n in row.response_lengths])
    figures["generated_tokens_mean"] = _mean([n for row in rows for n in row.generated_tokens])
    if not rewards:
        figures["correct_if"] = None
    elif len(reported) == len(solved):
        figures["correct_if"] = "solved"
    else:
        figures["correct_if"] = "reward > 0" if not reported else "solved, else reward > 0"
    return figures
