"""Every path key leaves the launch absolute (``config.paths``): actors and vLLM servers
run in other folders than the user's, where a relative path names something else."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from skyrl_train.config.compose import load_config
from skyrl_train.config.paths import PATH_KEYS, resolve_paths
from skyrl_train.config.schema import PPOConfig
from tests.inference.vllm_engine.harness import find_vllm_python

REPO = Path(__file__).resolve().parents[3]


def _get(cfg: object, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _string_keys(cls: type = PPOConfig, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            keys += _string_keys(args[0], f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif str in args or tp == list[str]:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_key_that_names_a_file_or_folder_is_resolved() -> None:
    # A new path key must join PATH_KEYS: the schema's string keys whose name says path.
    named = {
        k
        for k in _string_keys()
        if k.rsplit(".", 1)[1] in ("python", "resume_from") or k.endswith(("path", "_dir", "_data"))
    }
    assert named == set(PATH_KEYS)


def test_relative_paths_become_absolute_against_the_base(tmp_path: Path) -> None:
    cfg = load_config(
        [
            "model.path=ckpt/qwen3_moe_vllm",
            "model.cache_dir='~/cache'",  # quoted: Hydra's grammar refuses a bare ~
            "data.train_data=[data/a.jsonl,/abs/b.jsonl]",
            "data.val_data=[./v.jsonl]",
            "generator.inference_engine.vllm.python=venv/bin/python",
            "trainer.export_path=out/../exports",
            "trainer.resume_from=runs/old/checkpoints/step_000002",
        ]
    )
    got = resolve_paths(cfg, base=tmp_path)
    assert got.model.path == str(tmp_path / "ckpt" / "qwen3_moe_vllm")
    assert got.model.cache_dir == str(Path.home() / "cache")
    assert got.data.train_data == [str(tmp_path / "data" / "a.jsonl"), "/abs/b.jsonl"]
    assert got.data.val_data == [str(tmp_path / "v.jsonl")]
    assert got.generator.inference_engine.vllm.python == str(tmp_path / "venv/bin/python")
    assert got.trainer.export_path == str(tmp_path / "exports")
    assert got.trainer.resume_from == str(tmp_path / "runs/old/checkpoints/step_000002")
    assert got.trainer.run_dir == str(tmp_path / "runs" / "r3_grpo")  # the default
    for key in PATH_KEYS:
        values = _get(got, key)
        for value in values if isinstance(values, list) else [values]:
            assert isinstance(value, str) and os.path.isabs(value), (key, value)
    assert resolve_paths(got, base="/elsewhere") == got  # idempotent
    assert cfg.model.path == "ckpt/qwen3_moe_vllm"  # the input is left as it was


def test_unset_keys_and_latest_stay_as_they_are(tmp_path: Path) -> None:
    got = resolve_paths(load_config(["trainer.resume_from=latest"]), base=tmp_path)
    assert got.model.path is None and got.trainer.export_path is None
    assert got.trainer.resume_from == "latest"
    assert got.generator.inference_engine.vllm.python is None


VLLM_PYTHON = find_vllm_python()


@pytest.mark.skipif(
    VLLM_PYTHON is None, reason="vLLM is not installed: run scripts/install_vllm.sh"
)
@pytest.mark.parametrize("chdir", ["false", "true"])
def test_a_missing_relative_model_folder_is_named_absolute_and_not_found(
    tmp_path: Path, chdir: str
) -> None:
    """The command line resolves against the folder it started in, even when Hydra moves
    the job elsewhere; a vLLM launch on a missing folder stops before Ray, saying
    "not found" (never a Hugging Face hub lookup)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_train.entrypoints.main_base",
            "model.path=ckpt/qwen3_moe_vllm",
            "generator.inference_engine.backend=vllm",
            f"generator.inference_engine.vllm.python={VLLM_PYTHON}",
            "generator.inference_engine.enable_return_routed_experts=false",
            "trainer.policy.megatron_config.routing_replay_source=old_policy",
            f"hydra.job.chdir={chdir}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    missing = tmp_path / "ckpt" / "qwen3_moe_vllm"
    assert f"model.path: {missing}: folder: expected an existing checkpoint folder" in done.stderr
    assert f"{missing}: not found" in done.stderr, done.stderr[-3000:]
    assert "huggingface.co" not in done.stderr and "Started a local Ray" not in done.stderr
    assert not (tmp_path / "runs").exists()  # refused before the run folder was claimed
