"""Collate per-trajectory routes ``[rows, L, K]`` into one padded ``[B, S, L, K]`` array.

The layout is ``TrainingBatch``'s: prompt left-padded to ``P``, response right-padded
to ``R``, ``S = P + R``. Row ``t`` of trajectory ``i`` (token ``t`` of prompt+response)
lands in the column where that token sits, so each trajectory is copied as two
contiguous chunks (its prompt part and its response part). Every other column is
padding: ``route_filler`` (``arange(K)``) and ``True`` in ``router_padding_mask``.
Uncaptured tokens (``t >= rows``, e.g. the last sampled token) are padding too; the
mask is never derived from the loss mask, since prompt and observation tokens still
replay.

Validation is serial and runs before anything is allocated, so the same bad batch
always fails with the same message. The buffers are then allocated with ``np.empty``
and every byte is written exactly once, by one ``fill_batch_rows`` callback per
trajectory, so each worker faults in its own rows: fresh memory is zeroed by the
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

from inference.wire import ROUTE_DTYPES, route_filler
from skyrl_train.errors import CollationError
from skyrl_train.utils.parallel import check_workers, fill_batch_rows

__all__ = [
    "CollatedRoutes",
    "RouteCollator",
    "collate_routed_experts",
    "prepare_route_collation",
]

_FIELD = "routed_experts"
# Small enough that a block's zeroed destination lines are still in L2 (512 KiB-2 MiB
# per core); larger blocks measured no faster, smaller ones pay per-call overhead.
_BLOCK_BYTES = 256 * 1024


@dataclass(frozen=True)
class CollatedRoutes:
    """The collated batch routes, both arrays freshly allocated and writable."""

    routed_experts: np.ndarray
    """[B, S, L, K] in the widest sample dtype; padding rows hold ``route_filler``."""
    router_padding_mask: np.ndarray
    """[B, S] bool, True on padding and uncaptured rows."""


def _check_lengths(name: str, values: Sequence[int], batch_size: int | None) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | np.ndarray):
        raise CollationError(name, expected="a sequence of ints", got=type(values).__name__)
    if batch_size is not None and len(values) != batch_size:
        raise CollationError(
            name, expected=f"{batch_size} entries (one per trajectory)", got=str(len(values))
        )
    out: list[int] = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise CollationError(f"{name}[{i}]", expected="an int >= 0", got=repr(value))
        out.append(int(value))
    return out


def _check_width(name: str, width: int | None, needed: int) -> int:
    if width is None:
        return needed
    if isinstance(width, bool) or not isinstance(width, int | np.integer) or width < needed:
        raise CollationError(
            name, expected=f"an int >= {needed} (the longest trajectory)", got=repr(width)
        )
    return int(width)


def _check_sample(index: int, sample: object, trailing: tuple[int, int] | None) -> np.ndarray:
    field = f"{_FIELD}[{index}]"
    if not isinstance(sample, np.ndarray):
        raise CollationError(
            field, expected="a numpy.ndarray [rows, layers, topk]", got=type(sample).__name__
        )
    # The wire's dtypes only: int64 would make a [64, 8192, 48, 8] batch 1.6 GB instead of
    # 200 MB in uint8, and the wire is native little-endian, so ">i2" is refused too.
    if sample.dtype not in ROUTE_DTYPES:
        names = "/".join(ROUTE_DTYPES)
        raise CollationError(
            f"{field}.dtype",
            expected=f"one of {names} (native byte order)",
            got=sample.dtype.str,
        )
    if sample.ndim != 3:
        raise CollationError(
            f"{field}.shape", expected="3-D [rows, layers, topk]", got=str(sample.shape)
        )
    if trailing is None:
        if sample.shape[1] < 1 or sample.shape[2] < 1:
            raise CollationError(
                f"{field}.shape", expected="layers >= 1 and topk >= 1", got=str(sample.shape)
            )
    elif sample.shape[1:] != trailing:
        expected = f"[rows, {trailing[0]}, {trailing[1]}] like {_FIELD}[0]"
        raise CollationError(f"{field}.shape", expected=expected, got=str(sample.shape))
    return sample


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
        # One block of padding rows: copying a slice of it is a plain memcpy, while
        # copying a broadcast filler runs an inner loop of only K elements (7x slower).
        block_rows = max(1, _BLOCK_BYTES // (layers * topk * dtype.itemsize))
        self._padding = np.empty((block_rows, layers, topk), dtype=dtype)
        self._padding[...] = route_filler(topk, dtype)

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
        dst, mask, pad = self._out[row], self._mask[row], self._padding
        pieces = (  # (first column, end column, routes or None for padding)
            (0, start, None),
            (start, start + in_prompt, src[:in_prompt]),
            (start + in_prompt, mid, None),
            (mid, mid + in_response, src[in_prompt:]),
            (mid + in_response, dst.shape[0], None),
        )
        for first, end, piece in reversed(pieces):
            mask[first:end] = piece is None
            for hi in range(end, first, -len(pad)):
                lo = max(first, hi - len(pad))
                dst[lo:hi] = pad[: hi - lo] if piece is None else piece[lo - first : hi - first]

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
    if isinstance(routes, np.ndarray) or not isinstance(routes, Sequence):
        raise CollationError(
            _FIELD, expected="a list of per-trajectory arrays", got=type(routes).__name__
        )
    batch = len(routes)
    if batch == 0:
        raise CollationError(_FIELD, expected="at least one trajectory", got="0")
    prompts = _check_lengths("prompt_lengths", prompt_lengths, batch)
    responses = _check_lengths("response_lengths", response_lengths, batch)
    p_width = _check_width("prompt_width", prompt_width, max(prompts))
    r_width = _check_width("response_width", response_width, max(responses))

    samples: list[np.ndarray] = []
    trailing: tuple[int, int] | None = None
    for i, sample in enumerate(routes):
        checked = _check_sample(i, sample, trailing)
        trailing = (checked.shape[1], checked.shape[2])
        tokens = prompts[i] + responses[i]
        rows = checked.shape[0]
        if not 1 <= rows <= tokens:
            expected = (
                f"1 <= rows <= {tokens} (prompt {prompts[i]} + response {responses[i]} tokens)"
            )
            raise CollationError(f"{_FIELD}[{i}].shape[0]", expected=expected, got=str(rows))
        samples.append(checked)

    dtype = np.result_type(*{s.dtype for s in samples})
    topk = samples[0].shape[2]
    if topk - 1 > np.iinfo(dtype).max:
        raise CollationError(
            f"{_FIELD}[0].shape[2]",
            expected=f"topk <= {np.iinfo(dtype).max + 1} for {dtype}",
            got=str(topk),
        )
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
