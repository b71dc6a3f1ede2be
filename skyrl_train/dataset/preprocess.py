"""Turn a ``GeneratorOutput`` into a padded ``TrainingBatch``.

Everything is validated serially first (list lengths, per-trajectory types, lengths
and values, then the routes), so a bad batch fails deterministically with a
``CollationError`` naming the field and trajectory before any batch buffer exists.
Rows are then filled with ``fill_batch_rows``: each callback writes its whole row of
every tensor, padding included, into ``np.empty`` buffers (see ``routes`` for why).
Tensors wrap the NumPy buffers with ``torch.from_numpy`` (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.packed_routes import (
    PackedRouteCollator,
    PackedRoutes,
    prepare_packed_route_collation,
)
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.dataset.support import collate_sample_support
from skyrl_train.errors import CollationError
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.utils.parallel import check_workers, fill_batch_rows

__all__ = ["convert_to_training_batch"]


def _describe(arr: np.ndarray) -> str:
    return f"{arr.dtype} array of shape {arr.shape}"


def _per_trajectory(output: GeneratorOutput, name: str, batch: int) -> Sequence:
    values = getattr(output, name)
    if isinstance(values, (str, bytes, np.ndarray)) or not isinstance(values, Sequence):
        raise CollationError(
            name, expected="a list with one entry per trajectory", got=type(values).__name__
        )
    if len(values) != batch:
        raise CollationError(
            name,
            expected=f"{batch} entries (one per trajectory, like prompt_token_ids)",
            got=str(len(values)),
        )
    return values


def _vector(value: object, field: str, *, kinds: str, dtype: type) -> np.ndarray:
    """A 1-D array of ``dtype`` from a list or array whose dtype kind is in ``kinds``."""
    if not isinstance(value, list | tuple | np.ndarray):
        raise CollationError(field, expected="a list", got=type(value).__name__)
    if len(value) == 0:
        return np.zeros(0, dtype=dtype)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nesting
        raise CollationError(
            field, expected="a flat list of numbers", got=f"{type(exc).__name__}: {exc}"
        ) from None
    if arr.ndim != 1 or arr.dtype.kind not in kinds:
        names = {"b": "bool", "i": "int", "u": "uint", "f": "float"}
        wanted = "/".join(names[k] for k in kinds)
        raise CollationError(field, expected=f"a flat list of {wanted} values", got=_describe(arr))
    return arr.astype(dtype, copy=False)


def _check_tokens(value: object, field: str, *, min_len: int) -> np.ndarray:
    arr = _vector(value, field, kinds="iu", dtype=np.int64)
    if len(arr) < min_len:
        raise CollationError(field, expected=f"at least {min_len} token(s)", got=str(len(arr)))
    if len(arr) and int(arr.min()) < 0:
        raise CollationError(field, expected="token ids >= 0", got=str(int(arr.min())))
    return arr


def _check_aligned(
    value: object, field: str, *, length: int, kinds: str, dtype: type
) -> np.ndarray:
    arr = _vector(value, field, kinds=kinds, dtype=dtype)
    if len(arr) != length:
        raise CollationError(
            field, expected=f"{length} values (one per response token)", got=str(len(arr))
        )
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise CollationError(
            field, expected="finite values", got=f"{int((~np.isfinite(arr)).sum())} non-finite"
        )
    return arr


@dataclass
class _Trajectory:
    prompt: np.ndarray
    response: np.ndarray
    loss_mask: np.ndarray
    token_rewards: np.ndarray
    logprobs: np.ndarray | None


def _validate(output: GeneratorOutput) -> tuple[list[_Trajectory], np.ndarray]:
    prompts = output.prompt_token_ids
    if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
        raise CollationError(
            "prompt_token_ids",
            expected="a list with one entry per trajectory",
            got=type(prompts).__name__,
        )
    batch = len(prompts)
    if batch == 0:
        raise CollationError("prompt_token_ids", expected="at least one trajectory", got="0")
    lists = {
        name: _per_trajectory(output, name, batch)
        for name in ("response_ids", "loss_masks", "token_rewards", "stop_reasons", "rewards")
    }
    logprobs = None
    if output.rollout_logprobs is not None:
        logprobs = _per_trajectory(output, "rollout_logprobs", batch)
    rewards = _vector(list(lists["rewards"]), "rewards", kinds="iuf", dtype=np.float32)
    if not np.isfinite(rewards).all():
        bad = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise CollationError(
            f"rewards[{bad}]", expected="a finite number", got=str(float(rewards[bad]))
        )

    trajectories = []
    for i in range(batch):
        response = _check_tokens(lists["response_ids"][i], f"response_ids[{i}]", min_len=0)
        n = len(response)
        loss_mask = _check_aligned(
            lists["loss_masks"][i], f"loss_masks[{i}]", length=n, kinds="biu", dtype=np.int64
        )
        if n and not np.isin(loss_mask, (0, 1)).all():
            raise CollationError(
                f"loss_masks[{i}]",
                expected="values in {0, 1}",
                got=str(np.unique(loss_mask).tolist()),
            )
        trajectories.append(
            _Trajectory(
                prompt=_check_tokens(prompts[i], f"prompt_token_ids[{i}]", min_len=1),
                response=response,
                loss_mask=loss_mask,
                token_rewards=_check_aligned(
                    lists["token_rewards"][i],
                    f"token_rewards[{i}]",
                    length=n,
                    kinds="iuf",
                    dtype=np.float32,
                ),
                logprobs=None
                if logprobs is None
                else _check_aligned(
                    logprobs[i], f"rollout_logprobs[{i}]", length=n, kinds="iuf", dtype=np.float32
                ),
            )
        )
    return trajectories, rewards


class _TokenFiller:
    """Owns the token-level buffers; ``fill_row(i)`` writes row i of each in full."""

    def __init__(self, trajectories: list[_Trajectory], pad_token_id: int, with_logprobs: bool):
        self._trajs = trajectories
        self._pad = pad_token_id
        batch = len(trajectories)
        self.prompt_width = max(len(t.prompt) for t in trajectories)
        self.response_width = max(len(t.response) for t in trajectories)
        seq, resp = self.prompt_width + self.response_width, self.response_width
        self.sequences = np.empty((batch, seq), dtype=np.int64)
        self.attention_mask = np.empty((batch, seq), dtype=np.int64)
        self.response_mask = np.empty((batch, resp), dtype=np.int64)
        self.loss_mask = np.empty((batch, resp), dtype=np.int64)
        self.token_rewards = np.empty((batch, resp), dtype=np.float32)
        self.logprobs = np.empty((batch, resp), dtype=np.float32) if with_logprobs else None

    def fill_row(self, i: int) -> None:
        traj = self._trajs[i]
        p, r, mid = len(traj.prompt), len(traj.response), self.prompt_width
        seq, attn = self.sequences[i], self.attention_mask[i]
        seq[: mid - p] = self._pad
        seq[mid - p : mid] = traj.prompt
        seq[mid : mid + r] = traj.response
        seq[mid + r :] = self._pad
        attn[:] = 0
        attn[mid - p : mid + r] = 1
        self.response_mask[i, :r] = 1
        self.response_mask[i, r:] = 0
        for buf, src in (
            (self.loss_mask, traj.loss_mask),
            (self.token_rewards, traj.token_rewards),
        ):
            buf[i, :r] = src
            buf[i, r:] = 0
        if self.logprobs is not None and traj.logprobs is not None:
            self.logprobs[i, :r] = traj.logprobs
            self.logprobs[i, r:] = 0.0


def convert_to_training_batch(
    output: GeneratorOutput, *, pad_token_id: int, workers: int | None = None
) -> TrainingBatch:
    """Pad and collate a generator batch (routes included when present).

    ``workers`` as in ``fill_batch_rows`` (None: sized from the permitted cores).
    Raises ``CollationError`` naming the field and trajectory for any bad sample.
    """
    if not isinstance(output, GeneratorOutput):
        raise TypeError(f"output: expected GeneratorOutput, got {type(output).__name__}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id: expected an int >= 0, got {pad_token_id!r}")
    check_workers(workers)
    trajectories, rewards = _validate(output)
    tokens = _TokenFiller(trajectories, pad_token_id, output.rollout_logprobs is not None)
    routes: PackedRouteCollator | None = None
    if output.routed_experts is not None:
        _per_trajectory(output, "routed_experts", len(trajectories))
        # Packed by row: the padded [B, S, L, K] is never built on the driver
        # (dataset/route_rows.py).
        routes = prepare_packed_route_collation(
            output.routed_experts,
            prompt_lengths=[len(t.prompt) for t in trajectories],
            response_lengths=[len(t.response) for t in trajectories],
        )

    def fill_row(i: int) -> None:
        tokens.fill_row(i)
        if routes is not None:
            routes.fill_row(i)

    fill_batch_rows(fill_row, len(trajectories), workers=workers)
    collated = routes.result() if routes is not None else None
    support = None
    if output.rollout_sample_support is not None:
        support = collate_sample_support(
            output.rollout_sample_support,
            responses=[t.response for t in trajectories],
            loss_masks=[t.loss_mask for t in trajectories],
            response_width=tokens.response_width,
        )
    route_rows = padding = None
    if collated is not None:
        route_rows, padding = _route_rows(
            collated, trajectories, tokens.prompt_width, tokens.prompt_width + tokens.response_width
        )
    return TrainingBatch(
        sequences=torch.from_numpy(tokens.sequences),
        attention_mask=torch.from_numpy(tokens.attention_mask),
        response_mask=torch.from_numpy(tokens.response_mask),
        loss_mask=torch.from_numpy(tokens.loss_mask),
        rewards=torch.from_numpy(rewards),
        token_rewards=torch.from_numpy(tokens.token_rewards),
        rollout_logprobs=None if tokens.logprobs is None else torch.from_numpy(tokens.logprobs),
        routed_experts=None if collated is None else route_rows,
        router_padding_mask=None if collated is None else padding,
        sample_support=support,
        trajectory_rows=torch.arange(len(trajectories)),
    )


def _route_rows(
    collated: PackedRoutes, trajectories: Sequence[_Trajectory], prompt_width: int, width: int
) -> tuple[PackedRouteRows, torch.Tensor]:
    """The packed routes as the batch carries them, and the ``[B, S]`` router padding
    mask (1 byte a token: the rows' uncaptured tokens and every padding column)."""
    starts = torch.tensor([prompt_width - len(t.prompt) for t in trajectories], dtype=torch.int64)
    rows = PackedRouteRows(
        values=torch.from_numpy(collated.routed_experts),
        cu_seqlens=torch.from_numpy(collated.cu_seqlens),
        starts=starts,
        width=width,
    )
    padding = torch.ones(len(trajectories) * width, dtype=torch.bool)
    padding[rows.batch_index()] = torch.from_numpy(collated.router_padding_mask)
    return rows, padding.view(len(trajectories), width)
