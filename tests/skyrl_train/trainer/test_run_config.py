"""A checkpoint's ``run_config.json`` round-trips: what ``run_config_record`` writes,
read back by ``scripts/export_hf.py``'s ``prepare`` (the config its ranks are placed
and built from), hands each backend's worker the arguments the run's own config did,
for a replay-off run, a two-node run and each backend; and the export's local Ray gets
a placement it can make.

The workers are stand-ins that keep their constructor's arguments (a unit test of
``workers.factory.build_worker``'s inputs): building real ones is what the launch and
export tests do (tests/skyrl_train/entrypoints/test_main_base*.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from skyrl_train.config import load_config, validate_cfg
from skyrl_train.config.megatron_unsupported import refuse_replay_incompatible
from skyrl_train.config.schema import PPOConfig
from skyrl_train.runs.checkpoint import DRIVER_FILE, RUN_CONFIG_FILE, begin_save, commit_save
from skyrl_train.trainer.policy_group import run_config_record
from skyrl_train.utils.durable import write_file

REPO = Path(__file__).resolve().parents[3]
MC = "trainer.policy.megatron_config"
CASES = {
    # Refused under replay only: the run trained it with replay off.
    "megatron_replay_off": [
        "trainer.policy.routing_replay.enabled=false",
        f"+{MC}.transformer_config_kwargs.moe_expert_capacity_factor=1.0",
        "trainer.policy.optimizer_config.lr=0.001",
        "generator.sampling_params.temperature=0.7",
        "trainer.seed=7",
    ],
    # The two-node recipe (docs/cluster-and-security.md, test_main_base_two_nodes.py).
    "megatron_two_nodes": [
        "ray.address=127.0.0.1:6379",
        "trainer.placement.num_trainers=2",
        "trainer.placement.strategy=STRICT_SPREAD",
        "trainer.placement.timeout_s=30",
        f"{MC}.expert_model_parallel_size=2",
        "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.policy.routing_replay.source=old_policy",
        "trainer.algorithm.temperature=0.9",
        "generator.sampling_params.temperature=0.9",
    ],
    "fsdp": [
        "trainer.strategy=fsdp",
        "trainer.placement.num_trainers=2",
        "trainer.placement.cpus_per_trainer=0.5",
        "trainer.placement.strategy=SPREAD",
        "trainer.micro_train_batch_size_per_gpu=16",
        "trainer.policy.fsdp_config.reshard_after_forward=false",
        "trainer.policy.routing_replay.enabled=false",
        "trainer.policy.optimizer_config.weight_decay=0.01",
        "trainer.weight_sync.mode=delta",
    ],
}


def _export_script() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import export_hf
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return export_hf


def _checkpoint(root: Path, cfg: PPOConfig) -> Path:
    """A committed checkpoint of ``cfg``'s run: its record as ``PolicyGroup``
    writes it, and stand-in rank files (``prepare`` reads none of them)."""
    world = cfg.trainer.placement.num_trainers
    folder = begin_save(root, step=3)
    for rank in range(world):
        write_file(folder / f"policy_rank{rank}.pt", b"rank")
    write_file(folder / DRIVER_FILE, json.dumps({"step": 3, "world_size": world}).encode())
    write_file(folder / RUN_CONFIG_FILE, run_config_record(cfg))
    return commit_save(folder, step=3)


class _Recorder:
    """A worker class that keeps what ``build_worker`` constructs it with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = (args, kwargs)

    def setup(self) -> _Recorder:
        return self


def _worker_arguments(cfg: PPOConfig, monkeypatch: pytest.MonkeyPatch) -> Any:
    from inference.models.checkpoint import inspect_checkpoint
    from skyrl_train.config.model_source import model_checkpoint
    from skyrl_train.workers import factory
    from skyrl_train.workers.fsdp import worker as fsdp_worker
    from skyrl_train.workers.megatron import worker as megatron_worker

    monkeypatch.setattr(fsdp_worker, "FSDPPolicyWorker", _Recorder)
    monkeypatch.setattr(megatron_worker, "MegatronPolicyWorker", _Recorder)
    folder = model_checkpoint(cfg.model)
    # world_size 1: no process group; the rank count is the placement's, compared apart.
    built = factory.build_worker(
        cfg,
        architecture=inspect_checkpoint(folder).architecture,
        checkpoint=folder,
        pad_token_id=0,
    )
    assert isinstance(built, _Recorder)
    return built.args


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_export_builds_the_ranks_the_run_had(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = load_config(CASES[case])
    validate_cfg(run)
    found = _checkpoint(tmp_path / "checkpoints", run)
    plan = _export_script().prepare(found, tmp_path / "out", model=None, ray_address=None)
    back = plan.cfg

    assert back.model == run.model and back.trainer.seed == run.trainer.seed
    assert back.trainer.strategy == run.trainer.strategy
    assert back.trainer.policy.routing_replay == run.trainer.policy.routing_replay
    assert back.trainer.weight_sync == run.trainer.weight_sync
    placed, recorded = back.trainer.placement, run.trainer.placement
    assert (placed.num_trainers, placed.cpus_per_trainer, placed.timeout_s) == (
        recorded.num_trainers,
        recorded.cpus_per_trainer,
        recorded.timeout_s,
    )
    # Every argument the run's own workers were built with, the replay mode included.
    assert _worker_arguments(back, monkeypatch) == _worker_arguments(run, monkeypatch)
    if run.trainer.strategy == "megatron":
        (_arch, built), _kwargs = _worker_arguments(back, monkeypatch)
        # The worker's own check at build (workers/megatron/model.py).
        refuse_replay_incompatible(built, key_prefix=MC)
        assert built.moe_enable_routing_replay is run.trainer.policy.routing_replay.enabled


@pytest.mark.parametrize("case", ["megatron_two_nodes", "fsdp"])
def test_a_local_ray_packs_the_ranks_and_a_cluster_keeps_the_runs_strategy(
    case: str, tmp_path: Path
) -> None:
    """One node holds every rank: ``STRICT_SPREAD`` (the two-node recipe) would be
    queued forever there."""
    run = load_config(CASES[case])
    found = _checkpoint(tmp_path / "checkpoints", run)
    export_hf = _export_script()
    local = export_hf.prepare(found, tmp_path / "out", model=None, ray_address=None)
    assert local.cfg.trainer.placement.strategy == "PACK"
    assert local.cfg.ray.address is None
    cluster = export_hf.prepare(found, tmp_path / "out", model=None, ray_address="auto")
    assert cluster.cfg.trainer.placement == run.trainer.placement
    assert cluster.cfg.ray.address == "auto"


@pytest.mark.parametrize(("alias", "enabled"), [(None, False), (True, True), (False, False)])
def test_a_record_without_the_replay_mode_is_exported_with_replay_off(
    alias: bool | None, enabled: bool, tmp_path: Path
) -> None:
    """Records of the releases that dropped the replay mode read back as replay on, and
    the ranks refused a replay-off run's capacity factor. The export runs no forward
    (the rank state is the same either way), so it builds them with replay off, and
    says so; a record with the deprecated alias set keeps what it says."""
    run = load_config(CASES["megatron_replay_off"])
    found = _checkpoint(tmp_path / "checkpoints", run)
    record = json.loads((found / RUN_CONFIG_FILE).read_bytes())
    del record["trainer"]["policy"]["routing_replay"]
    record["trainer"]["policy"]["megatron_config"]["moe_enable_routing_replay"] = alias
    older = begin_save(tmp_path / "older", step=3)
    for file in found.iterdir():
        if file.name not in ("manifest.json", RUN_CONFIG_FILE):
            write_file(older / file.name, file.read_bytes())
    write_file(older / RUN_CONFIG_FILE, json.dumps(record).encode())
    older = commit_save(older, step=3)
    plan = _export_script().prepare(older, tmp_path / "out", model=None, ray_address=None)
    assert plan.cfg.trainer.policy.routing_replay.enabled is enabled
    assert any("records no trainer.policy.routing_replay" in n for n in plan.notes) is (
        alias is None
    )


@pytest.mark.slow
@pytest.mark.by_hand  # two Ray starts and their ranks, ~40 s: the round trips above guard it
def test_a_replay_off_run_that_drops_tokens_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end on one Ray: the ranks of a replay-off run with a capacity factor (a
    setting refused only under replay) save a checkpoint as a launch does
    (``PolicyGroup.save_checkpoint`` writes the record), and ``scripts/export_hf.py``
    rebuilds them from it and writes the weights; it refused them before the replay
    mode was recorded."""
    import asyncio

    from safetensors.torch import load_file

    from skyrl_train.config.model_source import inspect_folder, model_checkpoint
    from skyrl_train.trainer.policy_group import PolicyGroup
    from skyrl_train.utils.ray_session import start_ray

    run = load_config(CASES["megatron_replay_off"])
    validate_cfg(run)
    folder = model_checkpoint(run.model)
    root = tmp_path / "checkpoints"
    session = start_ray(address=None, num_cpus=1, runtime_env={})
    try:
        group = PolicyGroup.place(
            run, checkpoint=str(folder), pad_token_id=inspect_folder(folder).pad_token_id
        )
        try:
            group.setup()
            temp = begin_save(root, step=2)
            asyncio.run(group.save_checkpoint(str(temp)))
        finally:
            group.kill()
        write_file(temp / DRIVER_FILE, json.dumps({"step": 2, "world_size": 1}).encode())
        found = commit_save(temp, step=2)
        # The script joins this Ray (start_ray leaves an initialised one running).
        out = tmp_path / "export"
        code = _export_script().main(["--checkpoint", str(found), "--out", str(out)])
        assert code == 0, capsys.readouterr().err
    finally:
        session.shutdown()
    exported = load_file(str(out / "model.safetensors"))
    source = load_file(str(folder / "model.safetensors"))
    assert exported.keys() == source.keys()
    # Nothing trained: the rank file holds the model folder's weights.
    assert all(torch.equal(exported[n].float(), source[n].float()) for n in source)
