"""Collate per-trajectory routes ``[rows, L, K]`` into one padded ``[B, S, L, K]`` array.

Training no longer builds this rectangle: ``convert_to_training_batch`` packs the routes
by row (``packed_routes``, ``route_rows``), and a padded worker builds one microbatch's.
This collation stays as the reference those are tested against and the baseline
``scripts/bench_collate.py`` and ``scripts/bench_packed_route_collation.py`` measure.

The layout is ``TrainingBatch``'s: prompt left-padded to ``P``, response right-padded
to ``R``, ``S = P + R``. Row ``t`` of trajectory ``i`` (token ``t`` of prompt+response)
lands in the column where that token sits, so each trajectory is copied as two
contiguous chunks (its prompt part and its response part). Every other column is
padding: ``route_filler`` (``arange(K)``) and ``True`` in ``router_padding_mask``.
Uncaptured tokens (``t >= rows``, e.g. the last sampled token) are padding too; the
mask is never derived from the loss mask, since prompt and observation tokens still
replay.

Validation is serial and runs before anything is allocated, so the same bad batch
always fails with the same message (the checks, like the block copy below, are
shared with the packed collation: ``route_batch``, ``packed_routes``). The buffers
are then allocated with ``np.empty`` and every byte is written exactly once, by one
``fill_batch_rows`` callback per trajectory, so each worker faults in its own rows: fresh memory is zeroed by the
kernel on first write, and that, not the copy, is most of the cost.

Write order matters for that reason. The kernel zeroes a whole 2 MiB huge page on its
first write, and the lines it zeroed last, at the top of the page, are the ones still
in cache. So the output is written from its last byte to its first (rows last to
first, pieces and 256 KiB blocks top down). Measured on the 2-core AMD EPYC CI machine
(228 MB batch, scripts/bench_collate.py): 22 ms top down, 33 ms bottom up, like a
memcpy of the same bytes that glibc runs backward (22 ms, source and destination
4 KiB-aliased) or forward (33 ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from skyrl_train.dataset.route_batch import (
    check_batch,
    check_samples,
    check_width,
    padding_block,
    write_top_down,
)
from skyrl_train.utils.parallel import check_workers, fill_batch_rows

__all__ = [
    "CollatedRoutes",
    "RouteCollator",
    "collate_routed_experts",
    "prepare_route_collation",
]


@dataclass(frozen=True)
class CollatedRoutes:
    """The collated batch routes, both arrays freshly allocated and writable."""

    routed_experts: np.ndarray
    """[B, S, L, K] in the widest sample dtype; padding rows hold ``route_filler``."""
    router_padding_mask: np.ndarray
    """[B, S] bool, True on padding and uncaptured rows."""


class RouteCollator:
    """A validated batch of routes with its output buffers allocated, ready to fill.

    Build it with ``prepare_route_collation``; call ``fill_row(i)`` once per row (from
    any thread: rows are disjoint), then ``result()``.
    """

    def __init__(
        self,
        routes: list[np.ndarray],
        prompt_lengths: list[int],
        prompt_width: int,
        seq_width: int,
        dtype: np.dtype,
    ) -> None:
        self._routes = routes
        self._prompt_lengths = prompt_lengths
        self._prompt_width = prompt_width
        layers, topk = routes[0].shape[1:]
        shape = (len(routes), seq_width, layers, topk)
        self._out = np.empty(shape, dtype=dtype)
        self._mask = np.empty((len(routes), seq_width), dtype=np.bool_)
        self._padding = padding_block(layers, topk, dtype)

    @property
    def batch_size(self) -> int:
        return len(self._routes)

    def fill_row(self, index: int) -> None:
        """Fill trajectory ``batch_size - 1 - index``: rows go last to first."""
        row = len(self._routes) - 1 - index
        src = self._routes[row]
        prompt_len = self._prompt_lengths[row]
        start = self._prompt_width - prompt_len  # column of prompt token 0
        mid = self._prompt_width  # column of response token 0
        in_prompt = min(src.shape[0], prompt_len)
        in_response = src.shape[0] - in_prompt
        pieces = (  # (first column, end column, routes or None for padding, mask)
            (0, start, None, True),
            (start, start + in_prompt, src[:in_prompt], False),
            (start + in_prompt, mid, None, True),
            (mid, mid + in_response, src[in_prompt:], False),
            (mid + in_response, self._out.shape[1], None, True),
        )
        write_top_down(self._out[row], self._mask[row], pieces, self._padding)

    def result(self) -> CollatedRoutes:
        return CollatedRoutes(routed_experts=self._out, router_padding_mask=self._mask)


def prepare_route_collation(
    routes: Sequence[np.ndarray],
    *,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> RouteCollator:
    """Validate every trajectory's routes, then allocate the output buffers.

    Checks, in trajectory order and before any copy: each sample is an ndarray in one
    of the wire's ``ROUTE_DTYPES``, 3-D, with the same ``[L, K]`` as trajectory 0, and
    ``1 <= rows <= prompt + response tokens``. Widths default to the longest prompt
    and response. Raises ``CollationError`` naming the field and trajectory.
    """
    prompts, responses = check_batch(routes, prompt_lengths, response_lengths)
    p_width = check_width("prompt_width", prompt_width, max(prompts))
    r_width = check_width("response_width", response_width, max(responses))
    samples, dtype = check_samples(routes, prompts, responses)
    return RouteCollator(samples, prompts, p_width, p_width + r_width, dtype)


def collate_routed_experts(
    routes: Sequence[np.ndarray],
    *,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    prompt_width: int | None = None,
    response_width: int | None = None,
    workers: int | None = None,
) -> CollatedRoutes:
    """Validate (serially), then copy every trajectory's routes into one padded array.

    ``workers`` as in ``fill_batch_rows`` (None: sized from the permitted cores).
    """
    check_workers(workers)
    collator = prepare_route_collation(
        routes,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        prompt_width=prompt_width,
        response_width=response_width,
    )
    fill_batch_rows(collator.fill_row, collator.batch_size, workers=workers)
    return collator.result()
