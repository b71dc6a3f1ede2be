"""A rank's checkpoint contract (``runs/rank_contract.py``): the typed layout a worker
reports, stored under the key names every rank file since layouts were recorded has, a
trainer that records the reported layout rather than a backend's config, and workers
that import nothing of ``runs`` but the contract (docs/design.md, "A rank's
checkpoint")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.rank_contract import Checkpointable, ParallelLayout, config_key
from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
from skyrl_train.runs.resume import load_rank_state
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.base import RankInfo
from skyrl_train.workers.fsdp.checkpoint import parallel_layout as fsdp_layout
from skyrl_train.workers.megatron.placement import parallel_layout as megatron_layout
from tests.skyrl_train.workers.test_worker_seam import members, reaches
from tests.test_layering import runtime_imports

REPO = Path(__file__).resolve().parents[3]
STORED = {
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "expert_model_parallel_size": 1,
    "tensor_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
}
"""What a rank file of the default layout has recorded (Megatron's and FSDP's alike)."""


def test_the_reported_layouts_keep_the_stored_record() -> None:
    assert megatron_layout(MegatronConfig(), world=1).record() == STORED
    assert fsdp_layout(4).record() == STORED
    assert fsdp_layout(4) == ParallelLayout(
        backend="fsdp", world=4, tp=1, pp=1, vpp=None, ep=1, etp=1, dp=4
    )
    mc = MegatronConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
    )
    layout = megatron_layout(mc, world=8)
    assert (layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp, layout.dp) == (
        2,
        2,
        2,
        2,
        2,  # null ETP is TP
        2,
    )
    assert ParallelLayout.from_record(layout.record(), backend="megatron", world=8) == layout


def test_an_old_record_reads_as_etp_equal_to_tp_and_tp_1() -> None:
    without_etp = {k: v for k, v in STORED.items() if k != "expert_tensor_parallel_size"}
    at_tp_2 = {**without_etp, "tensor_model_parallel_size": 2}
    assert ParallelLayout.from_record(at_tp_2, backend="megatron", world=2).etp == 2
    without_tp = {k: v for k, v in without_etp.items() if k != "tensor_model_parallel_size"}
    old = ParallelLayout.from_record(without_tp, backend="megatron", world=2)
    assert (old.tp, old.etp, old.dp) == (1, 1, 2)


def test_a_mismatch_names_the_key_the_backend_sets(tmp_path: Path) -> None:
    assert config_key("megatron", "tensor_model_parallel_size") == (
        "trainer.policy.megatron_config.tensor_model_parallel_size"
    )
    # FSDP configures none of these sizes: its strategy fixes them.
    assert config_key("fsdp", "tensor_model_parallel_size") == "trainer.strategy"
    state = {"world_size": 1, "layout": STORED, "model": {"w": torch.zeros(2)}}
    save_rank_state(checkpoint_file(tmp_path, 0), state)
    other = {**STORED, "expert_model_parallel_size": 2}
    with pytest.raises(ConfigValidationError) as info:
        load_rank_state(tmp_path, rank=0, world_size=1, layout=other, backend="fsdp")
    assert info.value.path == "trainer.strategy"
    assert "the checkpoint's 1 to resume" in info.value.reason and info.value.got == "2"


def test_the_trainer_records_the_layout_its_worker_reported(tmp_path: Path) -> None:
    cfg = load_config([f"trainer.run_dir={tmp_path}", "trainer.ref.log_kl=false"])
    assert cfg.trainer.policy.megatron_config.tensor_model_parallel_size == 1
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    with pytest.raises(RuntimeError, match=r"^info.layout: expected the worker's layout"):
        trainer._layout()
    reported = megatron_layout(MegatronConfig(tensor_model_parallel_size=2), world=2)
    trainer.info = RankInfo(
        rank=0, world_size=2, dp_rank=0, dp_size=1, ep_size=1, tp_size=2, layout=reported
    )
    # Not the config's TP 1: the trainer reads no backend config for the layout.
    assert trainer._layout() == {
        **STORED,
        "tensor_model_parallel_size": 2,
        "expert_tensor_parallel_size": 2,
    }


def test_the_resume_reaches_a_worker_only_through_its_checkpoint_pair() -> None:
    used = reaches(REPO / "skyrl_train/runs/resume.py", owner=("worker",))
    assert used == {"checkpoint_state"} and used <= members(Checkpointable)


def test_workers_import_only_the_contract_of_runs() -> None:
    found = []
    for path in sorted((REPO / "skyrl_train" / "workers").rglob("*.py")):
        for line, module in runtime_imports(ast.parse(path.read_text())):
            if module.startswith("skyrl_train.runs") and module != "skyrl_train.runs.rank_contract":
                found.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert found == []
