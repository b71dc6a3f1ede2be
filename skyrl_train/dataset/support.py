"""Collate each trajectory's sampler kept sets (``GeneratorOutput.rollout_sample_support``)
into ``TrainingBatch.sample_support``, the sets the trainer scores tokens over.

A row lists the ids the rollout's sampler kept at that response position, -1 after
the last one; observation tokens (loss mask 0) were not sampled and have empty rows.
Every generated token must be in its own row: a token outside the set it was drawn
from has probability 0 there, and its log-probability would be -inf in the loss. All
rows are checked before any buffer is filled, so a bad trajectory fails by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from skyrl_train.errors import CollationError


def collate_sample_support(
    support: Sequence[object],
    *,
    responses: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    response_width: int,
) -> torch.Tensor:
    """``[B, R, k]`` int64 kept-set ids, -1 padded (k the widest row of the batch)."""
    if len(support) != len(responses):
        raise CollationError(
            "rollout_sample_support",
            expected=f"{len(responses)} entries (one per trajectory, like prompt_token_ids)",
            got=str(len(support)),
        )
    rows = [
        _check(value, i, response=response, loss_mask=mask)
        for i, (value, response, mask) in enumerate(
            zip(support, responses, loss_masks, strict=True)
        )
    ]
    width = max((r.shape[1] for r in rows), default=0)
    out = np.full((len(rows), response_width, width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : r.shape[0], : r.shape[1]] = r
    return torch.from_numpy(out)


def _check(value: object, i: int, *, response: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    field = f"rollout_sample_support[{i}]"
    arr = np.asarray(value) if isinstance(value, np.ndarray | list) else None
    if arr is None or arr.ndim != 2 or arr.dtype.kind not in "iu":
        got = type(value).__name__ if arr is None else f"{arr.dtype} array of shape {arr.shape}"
        raise CollationError(field, expected="a 2-D int array [response tokens, k]", got=got)
    if arr.shape[0] != len(response):
        raise CollationError(
            field,
            expected=f"{len(response)} rows (one per response token)",
            got=str(arr.shape[0]),
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < -1:
        raise CollationError(field, expected="ids >= 0 or -1 padding", got=str(int(arr.min())))
    listed = arr >= 0
    # -1 only after the last id: a row is a prefix of ids, as the engine sends it.
    if (listed[:, 1:] & ~listed[:, :-1]).any():
        row = int(np.flatnonzero((listed[:, 1:] & ~listed[:, :-1]).any(axis=1))[0])
        raise CollationError(
            f"{field} row {row}",
            expected="ids then trailing -1 padding",
            got=str(arr[row].tolist()),
        )
    generated = loss_mask.astype(bool)
    inside = (arr == response[:, None]).any(axis=1)
    missing = generated & ~inside
    if missing.any():
        row = int(np.flatnonzero(missing)[0])
        raise CollationError(
            f"{field} row {row}",
            expected=f"the kept set to hold the sampled token {int(response[row])}",
            got=str(arr[row][listed[row]].tolist()),
        )
    if (listed[~generated]).any():
        row = int(np.flatnonzero(listed.any(axis=1) & ~generated)[0])
        raise CollationError(
            f"{field} row {row}",
            expected="no kept set on an observation token (loss mask 0)",
            got=str(arr[row][listed[row]].tolist()),
        )
    return arr
