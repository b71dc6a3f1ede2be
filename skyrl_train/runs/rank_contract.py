"""What a trainer rank's checkpoint asks of a worker, and what the worker reports: the
only part of ``runs`` a backend imports (docs/design.md, "A rank's checkpoint").

- ``Checkpointable``: the worker's checkpoint pair, what it saves and a state of the
  same form to load; ``StateMismatch``: what the load may refuse, before it writes.
- ``Placement``: where one of the rank's parameters sits in the whole model, the
  record another layout's resume cuts its own shard by (``runs/reshard.py``).
- ``ParallelLayout``: the layout the rank runs under, reported by the worker through
  ``workers.base.RankInfo``; a rank file records it under Megatron's key names
  (``record``), as every file since layouts were recorded has.

A rank file names its backend (``STRATEGY_KEY``); a file that names none is Megatron's,
the only backend before FSDP.

Standard library only: a backend imports it without loading the resume machinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from skyrl_train.errors import SkyRLTrainError

STRATEGY_KEY = "strategy"
"""A rank file's backend, as ``trainer.strategy`` names it."""
UNNAMED_STRATEGY = "megatron"
"""The backend of a rank file that names none (written by Megatron's worker)."""
PLACEMENT_KEY = "placement"
"""A rank file's record of where its parameters sit (``Checkpointable.checkpoint_state``)."""
PLACEMENT_FIELDS = ("key", "dim", "tp_rank", "tp_size", "gated")

TP_KEY = "tensor_model_parallel_size"
PP_KEY = "pipeline_model_parallel_size"
VPP_KEY = "virtual_pipeline_model_parallel_size"
EP_KEY = "expert_model_parallel_size"
ETP_KEY = "expert_tensor_parallel_size"
_CONFIG_SECTION = {"megatron": "trainer.policy.megatron_config"}
"""Where a backend's layout sizes are configured; a backend missing here fixes them all
(FSDP: one shard group over the world), so ``trainer.strategy`` is what sets them."""


class StateMismatch(SkyRLTrainError, ValueError):
    """A ``checkpoint_state`` entry that does not fit the worker loading it (a missing
    parameter, another shape or dtype, another backend's state), raised by
    ``load_checkpoint_state`` before it changes anything; the resume re-raises it as a
    ``CheckpointError`` naming the rank file (``reshard.load_checked``)."""

    def __init__(self, where: str, *, expected: str, got: str) -> None:
        self.where = where
        self.expected = expected
        self.got = got
        super().__init__(f"{where}: expected {expected}, got {got}")


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
    """A trainer rank's checkpoint pair, the only way ``runs`` reaches a worker
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


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The parallel layout a trainer rank runs under, as its backend reports it."""

    backend: str
    """``trainer.strategy``: ``"megatron"`` or ``"fsdp"``."""
    world: int
    tp: int
    pp: int
    vpp: int | None
    """Virtual pipeline stages per rank; None without interleaving."""
    ep: int
    etp: int
    """Resolved (Megatron's null ETP is TP): expert weights are cut by it, so a resume
    at another ETP that read its own file would load shards of another shape."""
    dp: int

    def record(self) -> dict[str, int | None]:
        """What a rank file records (Megatron's key names, the stored format): what a
        resume compares to decide between its own file and resharding."""
        return {
            PP_KEY: self.pp,
            VPP_KEY: self.vpp,
            EP_KEY: self.ep,
            TP_KEY: self.tp,
            ETP_KEY: self.etp,
        }

    @classmethod
    def from_record(cls, saved: Mapping[str, Any], *, backend: str, world: int) -> ParallelLayout:
        """The layout a rank file's ``saved`` record names (keys it predates read as
        ``saved_value`` says); ``dp`` is the world over TP times PP."""
        tp, pp = saved_value(saved, TP_KEY), saved_value(saved, PP_KEY) or 1
        return cls(
            backend=backend,
            world=world,
            tp=tp,
            pp=pp,
            vpp=saved_value(saved, VPP_KEY),
            ep=saved_value(saved, EP_KEY) or 1,
            etp=saved_value(saved, ETP_KEY),
            dp=max(world // (tp * pp), 1),
        )


def config_key(backend: str, name: str) -> str:
    """The config key that sets layout key ``name`` (a ``record`` key) under ``backend``:
    what a refused resume names."""
    section = _CONFIG_SECTION.get(backend)
    return f"{section}.{name}" if section else "trainer.strategy"


def saved_value(saved: Mapping[str, Any], name: str) -> Any:
    """Layout key ``name`` of a rank file's recorded layout ``saved``. A key the file
    predates has the value every run had then: TP 1 (only TP=1 ran before it was
    recorded), and ETP the file's TP (null, which megatron-core reads as TP)."""
    if name in saved:
        return saved[name]
    if name == ETP_KEY:
        return saved_value(saved, TP_KEY)
    return 1 if name == TP_KEY else None
