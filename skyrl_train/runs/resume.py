"""Resuming a trainer rank: the checks a launch makes before Ray starts, what a rank
saves, and the choice each rank makes between its own rank file (same layout) and
resharding (``runs/reshard.py``).

A checkpoint is refused, naming the config key, when another backend wrote it
(``trainer.strategy``: Megatron's and FSDP's rank files have nothing in common), or when
its rank files predate placement records and this run's layout is not theirs (the
world size, ``trainer.placement.num_trainers``; a Megatron size, the key the backend
reports for it: ``rank_contract.config_key``).

The tower, arrows one way: ``resume`` -> ``reshard`` -> ``rank_file`` -> ``checkpoint``,
and ``resume`` and ``reshard`` -> ``rank_contract``, the part a worker imports
(docs/design.md, "A rank's checkpoint").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, Checkpoint, verify_checkpoint
from skyrl_train.runs.rank_contract import (
    PLACEMENT_KEY,
    STRATEGY_KEY,
    UNNAMED_STRATEGY,
    Checkpointable,
    config_key,
    saved_value,
)

if TYPE_CHECKING:
    from skyrl_train.config.schema import PPOConfig
    from skyrl_train.runs.reshard import Resharded

STRATEGY_CONFIG_KEY = "trainer.strategy"
WORLD_SIZE_KEY = "trainer.placement.num_trainers"

# rank_file and reshard (torch) are imported inside the functions that read rank files:
# the launch's checks (verify_resume) run before Ray starts, and verifying a folder
# needs only the standard library.


def check_strategy(folder: Path, saved: str, *, strategy: str) -> None:
    """Refuse resuming ``folder``, written by the ``saved`` backend, under ``strategy``."""
    if saved != strategy:
        raise ConfigValidationError(
            STRATEGY_CONFIG_KEY,
            expected=f"the checkpoint's strategy {saved!r} to resume {str(folder)!r}",
            got=repr(strategy),
        )


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
    from skyrl_train.runs.rank_file import read_rank_file

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
    rank file as it is; a key the file predates reads as ``rank_contract.saved_value`` says."""
    if saved.world_size != world_size:
        return False
    return all(saved_value(saved.layout, name) == value for name, value in layout.items())


def load_rank_state(
    folder: Path,
    *,
    rank: int,
    world_size: int,
    layout: Mapping[str, Any] | None = None,
    backend: str = UNNAMED_STRATEGY,
) -> dict[str, Any]:
    """Rank ``rank``'s saved state, read with ``torch.load(weights_only=True)``
    (``rank_file.read_rank_file``: what it refuses about the file itself).

    Refuses a checkpoint taken at another world size (its expert shards and data order
    would not line up with this run's ranks) or, given this run's ``layout``
    (``ParallelLayout.record``), another pipeline, tensor or expert layout, naming the
    key that sets it under ``backend`` (``rank_contract.config_key``).
    """
    from skyrl_train.runs.rank_file import read_rank_file

    state = read_rank_file(folder, rank)
    saved = state.get("world_size")
    if saved != world_size:
        raise ConfigValidationError(
            WORLD_SIZE_KEY,
            expected=f"the checkpoint's world size {saved} to resume {str(folder)!r}",
            got=str(world_size),
        )
    # Files written before layouts were recorded carry none; world size is their check.
    recorded = state.get("layout") or layout or {}
    for name, value in (layout or {}).items():
        if (had := saved_value(recorded, name)) != value:
            raise ConfigValidationError(
                config_key(backend, name),
                expected=f"the checkpoint's {had!r} to resume {str(folder)!r}",
                got=repr(value),
            )
    return state


def rank_checkpoint(
    worker: Checkpointable, *, world_size: int, layout: Mapping[str, Any]
) -> dict[str, Any]:
    """What a trainer rank saves (``rank_file.save_rank_state`` writes it): its
    ``checkpoint_state`` (model, AdamW state and ``placement``), RNG states and the
    layout it ran under (``ParallelLayout.record``)."""
    from skyrl_train.runs.rank_file import rng_state

    return {
        "world_size": world_size,
        "layout": dict(layout),
        **worker.checkpoint_state(),
        "rng": rng_state(),
    }


def restore_rank(
    folder: Path,
    worker: Checkpointable,
    *,
    rank: int,
    world_size: int,
    layout: Mapping[str, Any],
    strategy: str | None = None,
) -> Resharded | None:
    """Restore a trainer rank from ``folder``: its own rank file when the checkpoint
    was written under this layout (None returned), else resharded
    (``reshard.load_resharded``).

    A checkpoint without placement records (written before resharding) goes the
    same-layout way, whose checks refuse another layout naming the config key. Given
    this run's ``strategy`` (its backend), a checkpoint another backend wrote is
    refused first.
    """
    from skyrl_train.runs.rank_file import RngState, checkpoint_file
    from skyrl_train.runs.reshard import load_checked, load_resharded

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
    state = load_rank_state(
        folder,
        rank=rank,
        world_size=world_size,
        layout=layout,
        backend=strategy or UNNAMED_STRATEGY,
    )
    # Checked before anything is restored: a bad RNG field leaves the model as it was.
    rng = RngState.read(state, checkpoint_file(folder, rank))
    load_checked(worker, state, checkpoint_file(folder, rank))
    rng.restore()
    return None


# ------------------------------------------------------------- the launch's checks


def verify_resume(cfg: PPOConfig) -> Checkpoint | None:
    """The launch-time check of ``trainer.resume_from`` (None when not resuming), a
    checkpoint folder (``latest`` is resolved first: ``runs.folder``): the whole
    folder against its manifest, and ``check_resumable``."""
    if not cfg.trainer.resume_from:
        return None
    found = verify_checkpoint(cfg.trainer.resume_from)
    check_resumable(
        found, strategy=cfg.trainer.strategy, num_trainers=cfg.trainer.placement.num_trainers
    )
    return found


def check_resumable(found: Checkpoint, *, strategy: str, num_trainers: int) -> None:
    """Refuse resuming ``found`` under another ``trainer.strategy`` than the backend
    that wrote it, or at another ``trainer.placement.num_trainers`` when its rank files
    cannot be resharded: written before they recorded their placement
    (``runs/reshard.py``), each holds a shard only its own layout can place. Rank 0's
    file is read once for both (mapped: its tensors are not read)."""
    saved: SavedLayout | None
    try:
        saved = saved_layout(found.folder)
    except CheckpointError:
        saved = None  # the rank that reads the file names what is wrong with it
    if saved is not None:
        check_strategy(found.folder, saved.strategy, strategy=strategy)
    if found.world_size != num_trainers and not (saved is not None and saved.reshardable):
        raise ConfigValidationError(
            WORLD_SIZE_KEY,
            expected=f"the world size {found.world_size} that {str(found.folder)!r} was "
            f"saved at ({DRIVER_FILE}): its rank files predate resharding",
            got=str(num_trainers),
        )
