"""Resharding, the algorithm alone: restoring a rank from a checkpoint written under
another layout (Megatron's TP, PP, VPP, EP, ETP or DP size, or another number of FSDP
ranks). Whether a resume reshards at all is ``runs/resume.py``'s decision.

Each rank file records where every one of its parameters sits in the whole model
(``placement``, written by the backend: ``workers/megatron/placement.py``,
``workers/fsdp/checkpoint.py``): a layout-free key (the Megatron name with the global
layer number and the global expert index, no virtual-stage prefix; FSDP's: the HF
parameter name) and, for a shard, its dim, rank and count (a TP shard; FSDP's dim-0
shard, cut as ``utils/shards.py`` cuts). A rank resuming under another layout reads every old rank file
(``torch.load(weights_only=True, mmap=True)``: only the pieces it uses are paged in),
joins each of its parameters' whole tensor from the old shards and cuts its own shard
from its own placement (``utils/shards.py``, the cut the HF weight loading uses).
AdamW's ``exp_avg`` and ``exp_avg_sq`` have their parameter's shape and are resharded
the same way; its ``step`` and hyperparameters are copied.

The worker is reached only through its checkpoint pair (``Checkpointable``): what it
saves, and a state of the same form to load (``runs/rank_contract.py``). A resume
under another backend than the one that wrote the checkpoint is refused first
(``runs/resume.py``).

Why not megatron-core's ``dist_checkpointing``: its torch_dist backend reads the
checkpoint's ``.metadata`` with ``pickle.load`` (torch.distributed.checkpoint's
FileSystemReader), which runs whatever code the file names: the thing
``runs/rank_file.py`` refuses (docs/parallel-layouts.md, "Resharding").

RNG states cannot map rank to rank across world sizes: rank r restores old rank r's
torch, numpy and Python states when the old layout had a rank r, and keeps the state
``trainer.seed`` gave it otherwise (a train step draws none: dropout is 0 in
``workers/megatron/model.py``, and routing is replayed or a deterministic top-k).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skyrl_train.errors import CheckpointError
from skyrl_train.runs.checkpoint import RESUME_KEY
from skyrl_train.runs.rank_contract import (
    PLACEMENT_FIELDS,
    PLACEMENT_KEY,
    STRATEGY_KEY,
    UNNAMED_STRATEGY,
    Checkpointable,
    Placement,
    StateMismatch,
)
from skyrl_train.runs.rank_file import RngState, checkpoint_file, read_rank_file
from skyrl_train.utils.shards import cut_shard, join_shards

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Resharded:
    """What a rank restored from another layout's checkpoint."""

    parameters: int
    moments: int
    """Parameters whose AdamW state was restored (0 for a checkpoint before any step)."""
    rng_from: int | None
    """The old rank whose RNG states this rank restored; None when there was none."""


def load_resharded(
    folder: Path, worker: Checkpointable, *, rank: int, saved_world_size: int
) -> Resharded:
    """Restore ``worker``'s parameters and optimizer state (AdamW) from the
    ``saved_world_size`` rank files of ``folder``, written under another layout, and
    this rank's RNG states when the old layout had its rank.

    Every refusal is a ``CheckpointError`` naming the file and the parameter: a file
    without placement records, a parameter no file holds, shards that do not tile it.
    Nothing is loaded until every tensor of this rank was assembled.
    """
    states = [read_rank_file(folder, old, mmap=True) for old in range(saved_world_size)]
    pieces = _index(folder, states)
    current = worker.checkpoint_state()
    own = current["model"]
    mine = {
        entry["name"]: Placement(**{f: entry[f] for f in PLACEMENT_FIELDS})
        for entry in current[PLACEMENT_KEY]
    }
    if not mine.keys() <= own.keys():
        raise RuntimeError("placements: expected the model's own parameter names")
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, Any]] = {}
    group: dict[str, Any] | None = None
    for name, want in mine.items():
        found = pieces.get(want.key)
        if found is None:
            raise CheckpointError(
                RESUME_KEY,
                folder,
                expected=f"a rank file holding {want.key} (this run's {name})",
                got=f"none of the {saved_world_size} rank files does",
            )
        shape = tuple(own[name].shape)
        weights[name] = _cut(folder, found, want, shape, "model")
        first = found[0]
        state = first.optimizer.get("state", {}).get(first.index)
        if group is None:
            group = _param_group(first.file, first.optimizer)
        if state is not None:
            restored = {"step": state["step"].clone()}
            for moment in _MOMENTS:
                restored[moment] = _cut(folder, found, want, shape, moment)
            moments[name] = restored
    rng_from = rank if rank < saved_world_size else None
    # Checked before anything is restored: a bad RNG field leaves the model as it was.
    rng = None
    if rng_from is not None:
        rng = RngState.read(states[rng_from], checkpoint_file(folder, rng_from))
    order = list(mine)
    assert group is not None
    # The model's other entries (buffers) stay its own: only parameters reshard. A copy,
    # not a new dict: a state dict's ``_metadata`` (module versions) goes with it.
    model = copy.copy(own)
    model.update(weights)
    load_checked(
        worker,
        {
            "model": model,
            "optimizer": {
                "state": {order.index(name): value for name, value in moments.items()},
                "param_groups": [{**group, "params": list(range(len(order)))}],
            },
            STRATEGY_KEY: states[0].get(STRATEGY_KEY, UNNAMED_STRATEGY),
        },
        folder,
    )
    if rng is not None:
        rng.restore()
    return Resharded(parameters=len(weights), moments=len(moments), rng_from=rng_from)


# --------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Piece:
    """One old rank's shard of a parameter."""

    file: Path
    name: str
    index: int
    """Its index in that rank's AdamW state."""
    placement: Placement
    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any]


def _index(folder: Path, states: list[dict[str, Any]]) -> dict[str, list[_Piece]]:
    """Each layout-free key's shards over the old rank files; a shard that data- or
    pipeline-parallel replicas hold twice is listed once per holder."""
    pieces: dict[str, list[_Piece]] = {}
    for old, state in enumerate(states):
        path = checkpoint_file(folder, old)
        record = state.get(PLACEMENT_KEY)
        if not isinstance(record, list):
            raise CheckpointError(
                RESUME_KEY,
                path,
                expected=f"'{PLACEMENT_KEY}' records, to resume under another layout "
                "(written since resharding, docs/parallel-layouts.md)",
                got=f"none (resume it under its own layout: {state.get('layout')!r}, "
                f"{state.get('world_size')!r} ranks)",
            )
        for index, entry in enumerate(record):
            name, placement = _placement(path, index, entry)
            piece = _Piece(path, name, index, placement, state["model"], state["optimizer"])
            pieces.setdefault(placement.key, []).append(piece)
    return pieces


def _placement(path: Path, index: int, entry: Any) -> tuple[str, Placement]:
    """One placement record's parameter name and placement."""
    try:
        return entry["name"], Placement(**{f: entry[f] for f in PLACEMENT_FIELDS})
    except (KeyError, TypeError) as exc:
        raise CheckpointError(
            RESUME_KEY,
            path,
            expected=f"{PLACEMENT_KEY}[{index}]: a dict of name, {', '.join(PLACEMENT_FIELDS)}",
            got=f"{type(exc).__name__}: {exc}",
        ) from None


def _param_group(path: Path, optimizer: Mapping[str, Any]) -> dict[str, Any]:
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1:
        raise CheckpointError(
            RESUME_KEY,
            path,
            expected="one AdamW parameter group",
            got=f"{len(groups) if isinstance(groups, list) else groups!r}",
        )
    return {k: v for k, v in groups[0].items() if k != "params"}


def _cut(
    folder: Path,
    found: list[_Piece],
    want: Placement,
    shape: tuple[int, ...],
    what: str,
) -> torch.Tensor:
    """This rank's shard of ``want.key``'s whole tensor (``what``: the weight, "model",
    or an AdamW moment), joined from the old shards and cut as ``want`` places it."""
    size = found[0].placement.tp_size
    shards: dict[int, torch.Tensor] = {}
    for piece in found:
        if piece.placement.tp_size != size or piece.placement.dim != found[0].placement.dim:
            raise CheckpointError(
                RESUME_KEY,
                piece.file,
                expected=f"{piece.name} ({want.key}) split as in {found[0].file.name} "
                f"(TP {size}, dim {found[0].placement.dim})",
                got=f"TP {piece.placement.tp_size}, dim {piece.placement.dim}",
            )
        if what == "model":
            tensor = piece.model.get(piece.name)
        else:
            tensor = (piece.optimizer["state"].get(piece.index) or {}).get(what)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                RESUME_KEY,
                piece.file,
                expected=f"{piece.name}'s {what} ({want.key}), as its other shards have",
                got=type(tensor).__name__,
            )
        shards.setdefault(piece.placement.tp_rank, tensor)
    if sorted(shards) != list(range(size)):
        raise CheckpointError(
            RESUME_KEY,
            folder,
            expected=f"{want.key}'s {what}: TP shards {list(range(size))}",
            got=f"shards {sorted(shards)}",
        )
    whole = join_shards(
        [shards[r] for r in range(size)], dim=found[0].placement.dim, gated=want.gated
    )
    cut = cut_shard(whole, dim=want.dim, rank=want.tp_rank, size=want.tp_size, gated=want.gated)
    if tuple(cut.shape) != shape:
        raise CheckpointError(
            RESUME_KEY,
            found[0].file,
            expected=f"{want.key}'s {what}: a shard of shape {shape} for this layout",
            got=f"{tuple(cut.shape)} from the whole {tuple(whole.shape)}",
        )
    return cut.clone()


def load_checked(worker: Checkpointable, state: Mapping[str, Any], source: Path) -> None:
    """``worker.load_checkpoint_state(state)``, a ``StateMismatch`` named after ``source``."""
    try:
        worker.load_checkpoint_state(state)
    except StateMismatch as exc:
        raise CheckpointError(
            RESUME_KEY, source, expected=f"{exc.where}: {exc.expected}", got=exc.got
        ) from None
