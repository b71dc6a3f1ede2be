"""What the padded (``routes``) and packed (``packed_routes``) route collations share.

The checks of a batch of per-trajectory routes ``[rows, L, K]``, so both layouts refuse
the same bad batch with the same ``CollationError``, and the top-down block copy that
writes one trajectory's pieces (``routes``' docstring has the measured reasons for the
order and the block size).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference.wire import ROUTE_DTYPES, route_filler
from skyrl_train.errors import CollationError

__all__ = [
    "FIELD",
    "Piece",
    "check_batch",
    "check_lengths",
    "check_samples",
    "check_width",
    "padding_block",
    "write_top_down",
]

FIELD = "routed_experts"
# Small enough that a block's zeroed destination lines are still in L2 (512 KiB-2 MiB
# per core); larger blocks measured no faster, smaller ones pay per-call overhead.
_BLOCK_BYTES = 256 * 1024

Piece = tuple[int, int, np.ndarray | None, bool | np.ndarray]
"""``(first, end, routes, mask)``: columns ``first:end`` of one trajectory's output take
``routes`` (None: the padding block) and ``mask`` (a bool, or the mask's own values)."""


def check_lengths(name: str, values: Sequence[int], batch_size: int | None) -> list[int]:
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


def check_width(name: str, width: int | None, needed: int) -> int:
    if width is None:
        return needed
    if isinstance(width, bool) or not isinstance(width, int | np.integer) or width < needed:
        raise CollationError(
            name, expected=f"an int >= {needed} (the longest trajectory)", got=repr(width)
        )
    return int(width)


def check_batch(
    routes: Sequence[np.ndarray], prompt_lengths: Sequence[int], response_lengths: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The routes list and both length lists; returns the lengths as ints."""
    if isinstance(routes, np.ndarray) or not isinstance(routes, Sequence):
        raise CollationError(
            FIELD, expected="a list of per-trajectory arrays", got=type(routes).__name__
        )
    batch = len(routes)
    if batch == 0:
        raise CollationError(FIELD, expected="at least one trajectory", got="0")
    prompts = check_lengths("prompt_lengths", prompt_lengths, batch)
    responses = check_lengths("response_lengths", response_lengths, batch)
    return prompts, responses


def _check_sample(index: int, sample: object, trailing: tuple[int, int] | None) -> np.ndarray:
    field = f"{FIELD}[{index}]"
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
        expected = f"[rows, {trailing[0]}, {trailing[1]}] like {FIELD}[0]"
        raise CollationError(f"{field}.shape", expected=expected, got=str(sample.shape))
    return sample


def check_samples(
    routes: Sequence[np.ndarray], prompts: list[int], responses: list[int]
) -> tuple[list[np.ndarray], np.dtype]:
    """Each sample in trajectory order, then the batch dtype (the widest sample dtype).

    A sample is an ndarray in one of the wire's ``ROUTE_DTYPES``, 3-D, with the same
    ``[L, K]`` as trajectory 0, and ``1 <= rows <= prompt + response tokens``.
    """
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
            raise CollationError(f"{FIELD}[{i}].shape[0]", expected=expected, got=str(rows))
        samples.append(checked)

    dtype = np.result_type(*{s.dtype for s in samples})
    topk = samples[0].shape[2]
    if topk - 1 > np.iinfo(dtype).max:
        raise CollationError(
            f"{FIELD}[0].shape[2]",
            expected=f"topk <= {np.iinfo(dtype).max + 1} for {dtype}",
            got=str(topk),
        )
    return samples, dtype


def padding_block(layers: int, topk: int, dtype: np.dtype) -> np.ndarray:
    """One block of ``route_filler`` rows: copying a slice of it is a plain memcpy, while
    copying a broadcast filler runs an inner loop of only K elements (7x slower)."""
    rows = max(1, _BLOCK_BYTES // (layers * topk * dtype.itemsize))
    block = np.empty((rows, layers, topk), dtype=dtype)
    block[...] = route_filler(topk, dtype)
    return block


def write_top_down(
    dst: np.ndarray, mask: np.ndarray, pieces: Sequence[Piece], pad: np.ndarray
) -> None:
    """Write ``pieces`` (in column order, together covering ``dst``) last to first, each
    in blocks of ``len(pad)`` rows from its end down."""
    for first, end, piece, flags in reversed(pieces):
        mask[first:end] = flags
        for hi in range(end, first, -len(pad)):
            lo = max(first, hi - len(pad))
            dst[lo:hi] = pad[: hi - lo] if piece is None else piece[lo - first : hi - first]
