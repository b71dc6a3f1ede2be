"""The seam between the trainer and a backend (``workers/base.py``): the trainer rank
and the checkpoint code reach their worker only through the ``PolicyWorker`` Protocol
(the checkpoint code only through its ``Checkpointable`` pair), and the factory names
the backends it knows. Read from the source, so a new reach into ``worker.model`` or
``worker.optimizer`` fails here rather than on the next backend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from skyrl_train.config.schema import PPOConfig
from skyrl_train.runs.rank_contract import Checkpointable
from skyrl_train.workers.base import PolicyWorker
from skyrl_train.workers.factory import STRATEGIES, build_worker

REPO = Path(__file__).resolve().parents[3]


def members(protocol: type) -> set[str]:
    return {name for name in dir(protocol) if not name.startswith("_")}


def reaches(path: Path, *, owner: tuple[str, ...]) -> set[str]:
    """Every attribute read off the worker in ``path``: ``self.worker.X`` for owner
    ("self", "worker"), ``worker.X`` for owner ("worker",)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and tuple([value.id, *reversed(chain)]) == owner:
            found.add(node.attr)
    return found


def test_the_trainer_uses_only_the_protocol() -> None:
    used = reaches(REPO / "skyrl_train/trainer/policy.py", owner=("self", "worker"))
    assert {"forward", "train_step", "named_parameters"} <= used
    assert used - members(PolicyWorker) == set()


def test_the_checkpoint_code_uses_only_the_checkpoint_pair() -> None:
    used = reaches(REPO / "skyrl_train/runs/reshard.py", owner=("worker",))
    assert used == members(Checkpointable) == {"checkpoint_state", "load_checkpoint_state"}
    assert members(Checkpointable) <= members(PolicyWorker)


def test_the_check_sees_a_reach_past_the_protocol(tmp_path: Path) -> None:
    source = tmp_path / "policy.py"
    source.write_text("def f(self):\n    return self.worker.model.named_parameters()\n")
    assert reaches(source, owner=("self", "worker")) == {"model"}


def test_an_unknown_backend_is_refused_naming_the_known_ones() -> None:
    assert STRATEGIES == ("megatron", "fsdp")
    cfg = PPOConfig()
    cfg.trainer.strategy = "deepspeed"  # a config that skipped validation (its choices)
    with pytest.raises(
        ValueError, match=r"^trainer.strategy: expected one of megatron, fsdp, got 'deepspeed'"
    ):
        build_worker(cfg, architecture=None, checkpoint="", pad_token_id=0)  # type: ignore[arg-type]
