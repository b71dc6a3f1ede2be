"""Resuming under another world size, in one process (``runs/reshard.py``): two data-
parallel replicas' files resume on one rank, and one rank's file on rank 1 of two, with
the model, AdamW state and step count equal to the saved ones; a launch accepts another
``trainer.placement.num_trainers`` only for a checkpoint that records its placement; and
every file that cannot be resharded is refused naming the file and the parameter. The
layouts that need several ranks (TP, PP, VPP, EP) are resharded on two gloo ranks in
``tests/skyrl_train/workers/test_megatron_pipeline.py``."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, begin_save, commit_save
from skyrl_train.runs.rank_contract import PLACEMENT_KEY, ParallelLayout
from skyrl_train.runs.rank_file import checkpoint_file, read_plain, save_rank_state
from skyrl_train.runs.resume import restore_rank, saved_layout, verify_resume
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.utils.durable import write_file
from skyrl_train.workers.megatron import MegatronPolicyWorker
from tests.skyrl_train.runs._state_checks import assert_same_optimizer_state


def _trainer(tmp_path: Path) -> PolicyTrainer:
    cfg = load_config([f"trainer.run_dir={tmp_path}", "trainer.ref.log_kl=false"])
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    trainer.worker = MegatronPolicyWorker(
        TinyMoEConfig().architecture(),
        cfg.trainer.policy.megatron_config,
        optimizer=OptimizerConfig(lr=1e-2),
    ).setup()
    trainer.info = trainer.worker.rank_info()
    return trainer


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PolicyTrainer, ...]]:
    """(trained, fresh): the first took two AdamW steps."""
    trained = _trainer(tmp_path_factory.mktemp("trained"))
    model, optimizer = trained.worker.model, trained.worker.optimizer
    assert optimizer is not None
    for _ in range(2):
        optimizer.zero_grad()
        sum((p.float() ** 2).sum() for p in model.parameters()).backward()
        optimizer.step()
    yield trained, _trainer(tmp_path_factory.mktemp("fresh"))


def _as_rank(trainer: PolicyTrainer, rank: int, world_size: int) -> None:
    trainer.info = dataclasses.replace(
        trainer.info, rank=rank, world_size=world_size, dp_rank=rank, dp_size=world_size
    )


def _save(root: Path, trainer: PolicyTrainer, *, world_size: int, seed: int) -> Path:
    """A committed checkpoint of ``world_size`` data-parallel replicas of ``trainer``,
    rank r saved with its RNGs seeded ``seed + r``."""
    folder = begin_save(root, step=2)
    for rank in range(world_size):
        _seed(seed + rank)
        _as_rank(trainer, rank, world_size)
        trainer.save_checkpoint(str(folder))
    _as_rank(trainer, 0, 1)
    driver = {"step": 2, "world_size": world_size}
    write_file(folder / DRIVER_FILE, json.dumps(driver).encode())
    return commit_save(folder, step=2)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _draws() -> list[Any]:
    return [torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()]


def _perturb(trainer: PolicyTrainer) -> None:
    assert trainer.worker.optimizer is not None
    with torch.no_grad():
        for param in trainer.worker.model.parameters():
            param.add_(1.0)
    trainer.worker.optimizer.state.clear()


def _assert_same_state(trained: PolicyTrainer, fresh: PolicyTrainer) -> None:
    want = dict(trained.worker.model.named_parameters())
    got = dict(fresh.worker.model.named_parameters())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert_same_optimizer_state(trained, fresh)


def test_the_megatron_worker_reports_its_layout(
    trainers: tuple[PolicyTrainer, PolicyTrainer],
) -> None:
    # What the trainer records in each rank file (RankInfo.layout), under the key names
    # Megatron's files have always had.
    trained, _fresh = trainers
    layout = trained.worker.rank_info().layout
    assert layout == ParallelLayout(
        backend="megatron", world=1, tp=1, pp=1, vpp=None, ep=1, etp=1, dp=1
    )
    assert trained._layout() == {
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "expert_model_parallel_size": 1,
        "tensor_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }


def test_two_data_parallel_ranks_resume_on_one(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, fresh = trainers
    final = _save(tmp_path, trained, world_size=2, seed=7)
    _seed(7)
    expected = _draws()  # rank 0's RNGs as saved
    assert saved_layout(final).reshardable
    # The launch accepts the other world size for a checkpoint it can reshard.
    assert verify_resume(load_config([f"trainer.resume_from={final}"])) is not None
    _perturb(fresh)
    _seed(1234)
    fresh.load_checkpoint(str(final))
    assert _draws() == expected
    _assert_same_state(trained, fresh)


def test_one_rank_resumes_on_rank_1_of_two_keeping_its_own_rngs(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, fresh = trainers
    final = _save(tmp_path, trained, world_size=1, seed=7)
    _perturb(fresh)
    _as_rank(fresh, 1, 2)
    try:
        _seed(1234)
        fresh.load_checkpoint(str(final))
        got = _draws()
    finally:
        _as_rank(fresh, 0, 1)
    _seed(1234)
    assert got == _draws()  # no old rank 1: the seeded state is kept
    _assert_same_state(trained, fresh)


def _rewrite(path: Path, change: Any) -> None:
    state = read_plain(path)
    change(state)
    path.unlink()  # write_file never writes over a file
    save_rank_state(path, state)


def _refusal(folder: Path, fresh: PolicyTrainer) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        fresh.load_checkpoint(str(folder))
    return info.value


def test_files_that_cannot_be_resharded_are_refused_naming_file_and_parameter(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, fresh = trainers
    embedding = "embedding.word_embeddings.weight"

    folder = _save(tmp_path / "a", trained, world_size=2, seed=0)
    _rewrite(checkpoint_file(folder, 1), lambda s: s.pop(PLACEMENT_KEY))
    err = _refusal(folder, fresh)
    assert err.file == checkpoint_file(folder, 1)
    assert f"'{PLACEMENT_KEY}' records" in err.expected and "2 ranks" in err.got

    def drop(state: dict[str, Any]) -> None:
        state[PLACEMENT_KEY] = [e for e in state[PLACEMENT_KEY] if e["key"] != embedding]

    folder = _save(tmp_path / "b", trained, world_size=2, seed=0)
    for rank in range(2):
        _rewrite(checkpoint_file(folder, rank), drop)
    err = _refusal(folder, fresh)
    assert err.expected == f"a rank file holding {embedding} (this run's {embedding})"
    assert err.got == "none of the 2 rank files does"

    def halve(state: dict[str, Any]) -> None:
        for entry in state[PLACEMENT_KEY]:
            if entry["key"] == embedding:
                entry["tp_size"] = 2

    folder = _save(tmp_path / "c", trained, world_size=2, seed=0)
    for rank in range(2):
        _rewrite(checkpoint_file(folder, rank), halve)
    err = _refusal(folder, fresh)
    assert err.expected == f"{embedding}'s model: TP shards [0, 1]" and err.got == "shards [0]"


def test_a_launch_refuses_another_world_size_for_files_without_placement(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, _fresh = trainers
    final = _save(tmp_path, trained, world_size=2, seed=0)
    for rank in range(2):
        _rewrite(checkpoint_file(final, rank), lambda s: s.pop(PLACEMENT_KEY))
    # The manifest no longer matches the rewritten files: commit a fresh copy.
    again = begin_save(tmp_path / "again", step=2)
    for path in final.iterdir():
        if path.name != "manifest.json":
            write_file(again / path.name, path.read_bytes())
    again = commit_save(again, step=2)
    with pytest.raises(ConfigValidationError) as info:
        verify_resume(load_config([f"trainer.resume_from={again}"]))
    assert info.value.path == "trainer.placement.num_trainers"
    assert "predate resharding" in info.value.reason


def test_a_megatron_checkpoint_is_refused_under_another_strategy_before_loading(
    tmp_path: Path, trainers: tuple[PolicyTrainer, PolicyTrainer]
) -> None:
    trained, fresh = trainers
    final = _save(tmp_path, trained, world_size=1, seed=0)
    assert saved_layout(final).strategy == "megatron"  # its rank files name no backend
    with pytest.raises(ConfigValidationError) as info:
        verify_resume(load_config([f"trainer.resume_from={final}", "trainer.strategy=fsdp"]))
    assert info.value.path == "trainer.strategy" and info.value.got == "'fsdp'"
    assert info.value.expected == f"the checkpoint's strategy 'megatron' to resume {str(final)!r}"
    before = {n: p.detach().clone() for n, p in fresh.worker.model.named_parameters()}
    with pytest.raises(ConfigValidationError):
        restore_rank(final, fresh.worker, rank=0, world_size=1, layout={}, strategy="fsdp")
    after = dict(fresh.worker.model.named_parameters())
    assert all(torch.equal(after[n], value) for n, value in before.items())
