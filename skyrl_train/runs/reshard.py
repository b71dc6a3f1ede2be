"""Resuming a checkpoint under another layout: Megatron's TP, PP, VPP, EP, ETP or DP size, or
another number of FSDP ranks.

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
saves, and a state of the same form to load. A resume under another backend than
the one that wrote the checkpoint is refused first (``runs/backend.py``).

Why not megatron-core's ``dist_checkpointing``: its torch_dist backend reads the
checkpoint's ``.metadata`` with ``pickle.load`` (torch.distributed.checkpoint's
FileSystemReader), which runs whatever code the file names: the thing
``runs/rank_state.py`` refuses (docs/parallel-layouts.md, "Resharding").

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
from typing import Any, Protocol

import torch

from skyrl_train.errors import CheckpointError
from skyrl_train.runs.backend import STRATEGY_KEY, UNNAMED_STRATEGY, StateMismatch, check_strategy
from skyrl_train.runs.checkpoint import RESUME_KEY
from skyrl_train.runs.rank_state import RngState, checkpoint_file, read_rank_file, saved_value
from skyrl_train.utils.shards import cut_shard, join_shards

PLACEMENT_KEY = "placement"
"""A rank file's record of where its parameters sit (``Checkpointable.checkpoint_state``)."""
_MOMENTS = ("exp_avg", "exp_avg_sq")
_FIELDS = ("key", "dim", "tp_rank", "tp_size", "gated")


@dataclass(frozen=True)
class Placement:
    """Where one local parameter sits in the whole model."""

    key: str
    """Layout-free: ``decoder.layers.<global layer>.mlp.experts.local_experts.<global
    expert>.linear_fc1.weight``, ``embedding.word_embeddings.weight``, ..."""
    dim: int
    """The tensor-parallel partition dim (0 when the parameter is whole; FSDP's: 0)."""
    tp_rank: int
    tp_size: int
    """Under FSDP, the rank's shard index and the shard count (``utils/shards.py``)."""
    gated: bool
    """A gated ``linear_fc1``: ``[gate_r; up_r]`` (``tensor_parallel.is_gated``)."""


class Checkpointable(Protocol):
    """A trainer rank's checkpoint pair, the only way this module reaches a worker
    (``workers.base.PolicyWorker`` includes it)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's state as plain data (tensors, numbers, strings, lists, dicts):
        ``"model"``, the model's state dict (every parameter under its
        ``named_parameters`` name); ``"optimizer"``, the optimizer's (AdamW's, its state
        indexed in parameter order); and ``PLACEMENT_KEY``, one record per parameter in
        that same order (``Placement`` fields and ``"name"``); optionally
        ``STRATEGY_KEY``, the backend's name."""
        ...

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Load ``"model"`` and ``"optimizer"`` of a ``checkpoint_state`` of this layout
        (its placement is not read); may raise ``StateMismatch``, before changing
        anything, for an entry that does not fit."""
        ...


@dataclass(frozen=True)
class SavedLayout:
    """What rank 0's file says about the layout that wrote the checkpoint."""

    world_size: int | None
    layout: dict[str, Any]
    reshardable: bool
    """Its rank files record their placement (written since resharding was added)."""
    strategy: str = UNNAMED_STRATEGY
    """The backend that wrote it (``trainer.strategy``)."""


def saved_layout(folder: Path) -> SavedLayout:
    """The world size and layout rank 0's file of ``folder`` was written under (its
    tensors are mapped, not read)."""
    state = read_rank_file(folder, 0, mmap=True)
    layout = state.get("layout")
    return SavedLayout(
        world_size=state.get("world_size"),
        layout=dict(layout) if isinstance(layout, dict) else {},
        reshardable=isinstance(state.get(PLACEMENT_KEY), list),
        strategy=str(state.get(STRATEGY_KEY, UNNAMED_STRATEGY)),
    )


def same_layout(saved: SavedLayout, *, world_size: int, layout: Mapping[str, Any]) -> bool:
    """Whether a rank of this run (``world_size`` ranks, ``layout``) resumes its own
    rank file as it is; a key the file predates reads as ``rank_state.saved_value`` says."""
    if saved.world_size != world_size:
        return False
    return all(saved_value(saved.layout, name) == value for name, value in layout.items())


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
        entry["name"]: Placement(**{f: entry[f] for f in _FIELDS})
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
    _load(
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
        return entry["name"], Placement(**{f: entry[f] for f in _FIELDS})
    except (KeyError, TypeError) as exc:
        raise CheckpointError(
            RESUME_KEY,
            path,
            expected=f"{PLACEMENT_KEY}[{index}]: a dict of name, {', '.join(_FIELDS)}",
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


# ------------------------------------------------------------ a trainer rank's file


def rank_checkpoint(
    worker: Checkpointable, *, world_size: int, layout: dict[str, Any]
) -> dict[str, Any]:
    """What a trainer rank saves (``rank_state.save_rank_state`` writes it): its
    ``checkpoint_state`` (model, AdamW state and ``placement``), RNG states and the
    layout it ran under."""
    from skyrl_train.runs.rank_state import rng_state

    return {
        "world_size": world_size,
        "layout": layout,
        **worker.checkpoint_state(),
        "rng": rng_state(),
    }


def restore_rank(
    folder: Path,
    worker: Checkpointable,
    *,
    rank: int,
    world_size: int,
    layout: dict[str, Any],
    strategy: str | None = None,
) -> Resharded | None:
    """Restore a trainer rank from ``folder``: its own rank file when the checkpoint
    was written under this layout (None returned), else resharded (``load_resharded``).

    A checkpoint without placement records (written before resharding) goes the
    same-layout way, whose checks refuse another layout naming the config key. Given
    this run's ``strategy``, a checkpoint another backend wrote is refused first.
    """
    from skyrl_train.runs.rank_state import load_rank_state

    try:
        saved: SavedLayout | None = saved_layout(folder)
    except CheckpointError:
        saved = None  # load_rank_state names what is wrong with the file
    if saved is not None and strategy is not None:
        check_strategy(folder, saved.strategy, strategy=strategy)
    if (
        saved is not None
        and saved.reshardable
        and not same_layout(saved, world_size=world_size, layout=layout)
    ):
        assert saved.world_size is not None
        return load_resharded(folder, worker, rank=rank, saved_world_size=saved.world_size)
    state = load_rank_state(folder, rank=rank, world_size=world_size, layout=layout)
    # Checked before anything is restored: a bad RNG field leaves the model as it was.
    rng = RngState.read(state, checkpoint_file(folder, rank))
    _load(worker, state, checkpoint_file(folder, rank))
    rng.restore()
    return None


def _load(worker: Checkpointable, state: Mapping[str, Any], source: Path) -> None:
    """``worker.load_checkpoint_state(state)``, a ``StateMismatch`` named after ``source``."""
    try:
        worker.load_checkpoint_state(state)
    except StateMismatch as exc:
        raise CheckpointError(
            RESUME_KEY, source, expected=f"{exc.where}: {exc.expected}", got=exc.got
        ) from None
