"""Which rows of a rank's shard go into each microbatch: by row count, or by a token budget.

``MicrobatchPlan`` is the one description both backends cut a batch by
(``batch_layout.split_microbatches``) and the trainer divides the loss by
(``algorithms/token_mean.py``: the step is a token mean whatever the plan's count).

- ``by_rows``: consecutive slices of ``micro_batch_size`` rows, the last one shorter
  (``trainer.max_tokens_per_microbatch=-1``, the default).
- ``by_tokens``: rows bin-packed so no microbatch holds more than ``max_tokens`` real
  tokens (``trainer.max_tokens_per_microbatch > 0``, SkyRL's key); a row longer than the
  budget goes alone in its own microbatch. Rows are never split.

Under FSDP every forward is a collective, and under expert parallelism the ranks of
a group exchange tokens per microbatch, so every rank must run the same number of
microbatches. ``by_tokens(..., count=n)`` reaches a count agreed beforehand (the
largest any data-parallel rank needs: ``trainer/policy.py`` takes it with one
all-reduce) by splitting its fullest microbatches, never by adding empty ones.
Importing this module loads no backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MicrobatchPlan", "row_tokens"]


def row_tokens(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row of a ``[B, S]`` attention mask: what a row costs packed."""
    return [int(n) for n in attention_mask.to(torch.int64).sum(dim=1).tolist()]


@dataclass(frozen=True)
class MicrobatchPlan:
    """Row indices of each microbatch, every row of the batch in exactly one, none empty."""

    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for m, group in enumerate(self.groups):
            if not group:
                raise ValueError(f"groups[{m}]: expected at least one row, got none")
            for row in group:
                if row in seen or row < 0:
                    raise ValueError(
                        f"groups[{m}]: expected each row once and >= 0, got row {row} again"
                        if row in seen
                        else f"groups[{m}]: expected rows >= 0, got {row}"
                    )
                seen.add(row)
        if seen != set(range(len(seen))):
            missing = sorted(set(range(max(seen, default=-1) + 1)) - seen)[:3]
            raise ValueError(f"groups: expected rows 0..{len(seen) - 1}, missing {missing}")

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def rows(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def is_consecutive(self) -> bool:
        """Each microbatch a slice of rows in batch order (no reordering to undo)."""
        flat = [row for group in self.groups for row in group]
        return flat == list(range(len(flat)))

    def order(self) -> torch.Tensor:
        """``[B]`` the rows in microbatch order (the concatenation of ``groups``)."""
        return torch.tensor([row for group in self.groups for row in group], dtype=torch.int64)

    def in_batch_order(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-microbatch results ``[b_m, ...]`` concatenated back into batch row order."""
        joined = torch.cat(list(parts))
        if self.is_consecutive:
            return joined
        inverse = torch.empty(self.rows, dtype=torch.int64)
        inverse[self.order()] = torch.arange(self.rows)
        return joined[inverse]

    @classmethod
    def by_rows(cls, rows: int, micro_batch_size: int | None) -> MicrobatchPlan:
        """Consecutive slices of ``micro_batch_size`` rows (None: one microbatch)."""
        size = rows if micro_batch_size is None else micro_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"micro_batch_size: expected a positive int, got {size!r}")
        return cls(tuple(tuple(range(s, min(s + size, rows))) for s in range(0, rows, size)))

    @classmethod
    def by_tokens(
        cls, lengths: Sequence[int], *, max_tokens: int, count: int | None = None
    ) -> MicrobatchPlan:
        """Rows bin-packed by their token ``lengths`` under ``max_tokens`` each (first fit,
        longest row first; a longer row alone), then, with ``count``, the fullest
        microbatch of two or more rows split in two until there are ``count``."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(
                f"trainer.max_tokens_per_microbatch: expected a positive int, got {max_tokens!r}"
            )
        if not lengths:
            raise ValueError("lengths: expected at least one row, got none")
        bins: list[list[int]] = []
        sums: list[int] = []
        # Longest first, ties by row index: the same lengths always give the same plan.
        for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
            n = lengths[row]
            for b, total in enumerate(sums):
                if total + n <= max_tokens:
                    bins[b].append(row)
                    sums[b] += n
                    break
            else:
                bins.append([row])
                sums.append(n)
        if count is not None:
            if not len(bins) <= count <= len(lengths):
                raise ValueError(
                    f"count: expected between {len(bins)} (the token budget's microbatches) "
                    f"and {len(lengths)} (one row each), got {count}"
                )
            while len(bins) < count:
                splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
                b = max(splittable, key=lambda i: (sums[i], -i))
                # Alternate the rows (longest first) so the two halves hold similar tokens.
                ranked = sorted(bins[b], key=lambda r: (-lengths[r], r))
                first, second = ranked[0::2], ranked[1::2]
                bins[b], sums[b] = first, sum(lengths[r] for r in first)
                bins.append(second)
                sums.append(sum(lengths[r] for r in second))
        groups = sorted(tuple(sorted(group)) for group in bins)
        return cls(tuple(groups))
