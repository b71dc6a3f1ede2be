"""Collate per-trajectory routes ``[rows, L, K]`` into one packed ``[T, L, K]`` array.

Trajectory i's tokens 0..n_i-1 (prompt then response, ``n_i`` = prompt + response
tokens) lie one after another, ``T = sum n_i``, with ``cu_seqlens`` ``[B + 1]`` where
each starts. Its route row t lands at packed token ``cu_seqlens[i] + t``; uncaptured
tokens (``t >= rows``, e.g. the last sampled token) hold ``route_filler`` and are True
in ``router_padding_mask``. No ``[B, S, L, K]`` rectangle is built: on SkyRL's
``typical_rl`` spread (shortest row 1/16 of the longest) about half of it is padding
(scripts/bench_packed_route_collation.py). The batch carries them as
``dataset/route_rows.PackedRouteRows``; a backend that runs padded rows builds one
microbatch's rectangle from them (``PackedRouteRows.rectangle``).

The padded collation's rules hold here, from the same code (``route_batch``): the same
checks and ``CollationError`` messages, serially and before anything is allocated; the
widest sample dtype; ``np.empty`` buffers whose every byte one ``fill_batch_rows``
callback writes once, top down (last trajectory first, each from its end), since the
first write into fresh memory, the kernel's zeroing of the page, is most of the cost
and the lines it zeroed last are the ones still in cache (``routes``' docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from skyrl_train.dataset.route_batch import (
    Piece,
    check_batch,
    check_samples,
    padding_block,
    write_top_down,
)
from skyrl_train.utils.parallel import check_workers, fill_batch_rows

__all__ = [
    "PackedRouteCollator",
    "PackedRoutes",
    "collate_packed_routes",
    "prepare_packed_route_collation",
]


@dataclass(frozen=True)
class PackedRoutes:
    """The packed batch routes; all three arrays freshly allocated and writable."""

    routed_experts: np.ndarray
    """[T, L, K] in the widest sample dtype; uncaptured tokens hold ``route_filler``."""
    router_padding_mask: np.ndarray
    """[T] bool, True on uncaptured tokens."""
    cu_seqlens: np.ndarray
    """[B + 1] int64: trajectory i is ``routed_experts[cu_seqlens[i]:cu_seqlens[i + 1]]``."""

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def lengths(self) -> np.ndarray:
        """[B] int64 tokens of each trajectory."""
        return np.diff(self.cu_seqlens)


class PackedRouteCollator:
    """A validated batch of routes with its packed buffers allocated, ready to fill.

    Build it with ``prepare_packed_route_collation``; call ``fill_row(i)`` once per
    trajectory (from any thread: segments are disjoint), then ``result()``.
    """

    def __init__(self, routes: list[np.ndarray], tokens: list[int], dtype: np.dtype) -> None:
        self._routes = routes
        self._cu = np.zeros(len(routes) + 1, dtype=np.int64)
        np.cumsum(tokens, out=self._cu[1:])
        layers, topk = routes[0].shape[1:]
        total = int(self._cu[-1])
        self._out = np.empty((total, layers, topk), dtype=dtype)
        self._mask = np.empty(total, dtype=np.bool_)
        self._padding = padding_block(layers, topk, dtype)

    @property
    def batch_size(self) -> int:
        return len(self._routes)

    def fill_row(self, index: int) -> None:
        """Fill trajectory ``batch_size - 1 - index``: trajectories go last to first."""
        row = len(self._routes) - 1 - index
        src = self._routes[row]
        first, end = int(self._cu[row]), int(self._cu[row + 1])
        rows = src.shape[0]
        pieces: tuple[Piece, ...] = ((0, rows, src, False), (rows, end - first, None, True))
        write_top_down(self._out[first:end], self._mask[first:end], pieces, self._padding)

    def result(self) -> PackedRoutes:
        return PackedRoutes(
            routed_experts=self._out, router_padding_mask=self._mask, cu_seqlens=self._cu
        )


def prepare_packed_route_collation(
    routes: Sequence[np.ndarray],
    *,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
) -> PackedRouteCollator:
    """Validate every trajectory's routes (as ``prepare_route_collation`` does), then
    allocate the packed buffers. Raises ``CollationError`` naming field and trajectory."""
    prompts, responses = check_batch(routes, prompt_lengths, response_lengths)
    samples, dtype = check_samples(routes, prompts, responses)
    tokens = [p + r for p, r in zip(prompts, responses, strict=True)]
    return PackedRouteCollator(samples, tokens, dtype)


def collate_packed_routes(
    routes: Sequence[np.ndarray],
    *,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    workers: int | None = None,
) -> PackedRoutes:
    """Validate (serially), then copy every trajectory's routes into one packed array.

    ``workers`` as in ``fill_batch_rows`` (None: sized from the permitted cores).
    """
    check_workers(workers)
    collator = prepare_packed_route_collation(
        routes, prompt_lengths=prompt_lengths, response_lengths=response_lengths
    )
    fill_batch_rows(collator.fill_row, collator.batch_size, workers=workers)
    return collator.result()
