"""A step's metrics as the sums they are made of, divided once at the end.

A step's metrics come from several microbatches and trainer ranks. Each producer says
how its value combines when it records it (``MetricSums.mean``, ``total``,
``maximum``, ``minimum``), never the key's name: a mean is kept as its numerator and
its own denominator (tokens kept in the loss for the TIS weight, rows for a row share,
token-layers for router agreement), both are summed over microbatches and ranks, and
the division happens once, in ``result``. A mean of rank means weighted by anything
else is wrong whenever the ranks' denominators differ in proportion: with one rank's
sequences masked, ``off_policy/weight_mean`` weighted by loss tokens came out 0.525
where the whole batch gives 1.05 (issue 38).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Literal

Reduction = Literal["mean", "sum", "max", "min"]


@dataclass(frozen=True)
class _Entry:
    kind: Reduction
    value: float
    """A mean's numerator, else the value itself."""
    denominator: float = 0.0
    """A mean's denominator (unused otherwise)."""
    empty: float = 0.0
    """A mean's value while its denominator is 0 (nothing was counted)."""


class MetricSums(Mapping[str, float]):
    """Metrics kept as sums, read as plain floats.

    Recording a key that is already there adds to it (a mean's numerator and
    denominator, a sum) or keeps the extreme (max, min); ``merge`` does the same for
    a whole other ``MetricSums`` (another microbatch or rank). As a ``Mapping`` it
    reads every key's final value: a mean divided by its summed denominator, or its
    ``empty`` value when that is 0. Picklable, so a Ray actor can return it.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    # ---- recording ------------------------------------------------------------------

    def mean(self, key: str, numerator: float, denominator: float, *, empty: float = 0.0) -> None:
        """Add ``numerator / denominator`` to the mean ``key``; ``empty`` is its value
        while no denominator has been counted (0.0, or 1.0 for an agreement)."""
        value = _finite(key, numerator)
        count = _finite(key, denominator)
        if count < 0:
            raise ValueError(f"metrics[{key!r}]: expected a denominator >= 0, got {count}")
        self._add(key, _Entry("mean", value, count, _finite(key, empty)))

    def total(self, key: str, value: float) -> None:
        """Add ``value`` to the sum ``key`` (counts: tokens, rows)."""
        self._add(key, _Entry("sum", _finite(key, value)))

    def maximum(self, key: str, value: float) -> None:
        self._add(key, _Entry("max", _finite(key, value)))

    def minimum(self, key: str, value: float) -> None:
        self._add(key, _Entry("min", _finite(key, value)))

    def merge(self, other: MetricSums) -> MetricSums:
        """Add every entry of ``other`` into this one; returns ``self``."""
        for key, entry in other._entries.items():
            self._add(key, entry)
        return self

    @classmethod
    def combine(cls, parts: Iterable[MetricSums]) -> MetricSums:
        """One ``MetricSums`` holding the sums of all ``parts`` (ranks, microbatches)."""
        combined = cls()
        for part in parts:
            combined.merge(part)
        return combined

    def _add(self, key: str, entry: _Entry) -> None:
        old = self._entries.get(key)
        if old is None:
            self._entries[key] = entry
            return
        if old.kind != entry.kind:
            raise ValueError(
                f"metrics[{key!r}]: expected a {old.kind} as recorded before, got a {entry.kind}"
            )
        if entry.kind == "mean":
            new = replace(
                old, value=old.value + entry.value, denominator=old.denominator + entry.denominator
            )
        elif entry.kind == "sum":
            new = replace(old, value=old.value + entry.value)
        elif entry.kind == "max":
            new = replace(old, value=max(old.value, entry.value))
        else:
            new = replace(old, value=min(old.value, entry.value))
        self._entries[key] = new

    # ---- reading --------------------------------------------------------------------

    def kind(self, key: str) -> Reduction:
        """How ``key`` combines, as its producer recorded it."""
        return self._entries[key].kind

    def parts(self, key: str) -> tuple[float, float]:
        """A mean's numerator and denominator, to record it under another key too."""
        entry = self._entries[key]
        if entry.kind != "mean":
            raise ValueError(f"metrics[{key!r}]: expected a mean, got a {entry.kind}")
        return entry.value, entry.denominator

    def __getitem__(self, key: str) -> float:
        entry = self._entries[key]
        if entry.kind != "mean":
            return entry.value
        return entry.value / entry.denominator if entry.denominator > 0 else entry.empty

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def result(self) -> dict[str, float]:
        """Every key's value, divided once, sorted by key."""
        return {key: self[key] for key in self}

    def __repr__(self) -> str:
        return f"MetricSums({self.result()!r})"


def _finite(key: str, value: float) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"metrics[{key!r}]: expected a finite number, got {number}")
    return number
