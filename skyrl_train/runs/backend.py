"""Which trainer backend wrote a checkpoint, and what a backend's checkpoint pair
(``runs.reshard.Checkpointable``) may refuse.

A rank file names its backend (``STRATEGY_KEY``, from the worker's
``checkpoint_state``); a file that names none is Megatron's, the only backend before
FSDP. Megatron's and FSDP's rank files have nothing in common (parameter names, shards,
placement keys), so a resume under another ``trainer.strategy`` is refused before any
rank loads: at launch (``checkpoint.verify_resume``) and again by each rank
(``reshard.restore_rank``), naming the key, the checkpoint's backend and the run's.
"""

from __future__ import annotations

from pathlib import Path

from skyrl_train.errors import ConfigValidationError, SkyRLTrainError

STRATEGY_KEY = "strategy"
"""A rank file's backend, as ``trainer.strategy`` names it."""
UNNAMED_STRATEGY = "megatron"
"""The backend of a rank file that names none (written by Megatron's worker)."""
STRATEGY_CONFIG_KEY = "trainer.strategy"


def check_strategy(folder: Path, saved: str, *, strategy: str) -> None:
    """Refuse resuming ``folder``, written by the ``saved`` backend, under ``strategy``."""
    if saved != strategy:
        raise ConfigValidationError(
            STRATEGY_CONFIG_KEY,
            expected=f"the checkpoint's strategy {saved!r} to resume {str(folder)!r}",
            got=repr(strategy),
        )


class StateMismatch(SkyRLTrainError, ValueError):
    """A ``checkpoint_state`` entry that does not fit the worker loading it (a missing
    parameter, another shape or dtype, another backend's state), raised by
    ``load_checkpoint_state`` before it changes anything; the resume re-raises it as a
    ``CheckpointError`` naming the rank file (``reshard.restore_rank``)."""

    def __init__(self, where: str, *, expected: str, got: str) -> None:
        self.where = where
        self.expected = expected
        self.got = got
        super().__init__(f"{where}: expected {expected}, got {got}")
