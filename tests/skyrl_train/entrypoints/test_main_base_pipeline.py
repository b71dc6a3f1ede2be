"""End to end with a two-stage pipeline on Ray (gloo) and R3, on Megatron's 1F1B
schedule (PP=2) and on its interleaved one (PP=2 with two virtual stages each, and
full activation recompute): two GRPO steps, weight sync gathered from both stages,
per-stage checkpoints, Hugging Face exports gathered from both stages (in the run and by
``scripts/export_hf.py`` from a checkpoint), and the first step compared with the same
step on one rank (fp32 rollouts give both runs the same batch)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _e2e import SMALL, probe, reload_and_probe, with_overrides

from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import PPOConfig
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.errors import ConfigValidationError
from skyrl_train.trainer.policy import RankInfo

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]

MC = "trainer.policy.megatron_config"
PIPELINE = with_overrides(
    SMALL,
    "trainer.num_steps=2",
    "trainer.eval_interval=0",
    # 2 prompts x 4 samples, one optimizer step of 8 rows in 4 microbatches: the
    # interleaved schedule runs two groups of two (PP=2) and overlaps their passes.
    "trainer.micro_train_batch_size_per_gpu=2",
    "trainer.micro_forward_batch_size_per_gpu=2",
    "trainer.placement.num_trainers=2",
    "trainer.placement.cpus_per_trainer=0.5",
    f"{MC}.pipeline_model_parallel_size=2",
    "logging.plot=false",
    # An export after every step: both stages stream in lockstep mid-run as well.
    "trainer.hf_save_interval=1",
    # Padded rows (packing is the default): the padded layout's launch on Megatron.
    "trainer.remove_microbatch_padding=false",
)
INTERLEAVED = [
    f"{MC}.virtual_pipeline_model_parallel_size=2",
    # Full recompute: the recomputed forwards must replay the routes too.
    f"+{MC}.transformer_config_kwargs.recompute_granularity=full",
    f"+{MC}.transformer_config_kwargs.recompute_method=uniform",
    f"+{MC}.transformer_config_kwargs.recompute_num_layers=1",
]
ONE_RANK = with_overrides(
    PIPELINE,
    "trainer.num_steps=1",
    "trainer.ckpt_interval=0",
    "trainer.placement.num_trainers=1",
    "trainer.placement.cpus_per_trainer=1",
    f"{MC}.pipeline_model_parallel_size=1",
)


@dataclass
class PipelineRun:
    cfg: PPOConfig
    history: list[dict[str, float]]
    ranks: list[RankInfo]
    before: list[float]
    after: list[float]
    after_reload: list[float]


@pytest.fixture(scope="module", params=["1f1b", "interleaved"])
def pipeline(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> PipelineRun:
    run_dir = tmp_path_factory.mktemp(f"r3_pp2_{request.param}") / "run"
    extra = INTERLEAVED if request.param == "interleaved" else []
    cfg = load_config([*PIPELINE, *extra, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        before = probe(job.server_urls[0], job.api_key)
        history = job.train()
        after = probe(job.server_urls[0], job.api_key)
        # Each stage reloads its own file and the export gathers both again: a stage
        # that restored the other's layers would change the served weights.
        checkpoint = run_dir / "checkpoints" / "step_000002"

        after_reload = reload_and_probe(job, checkpoint)
        ranks = list(job.policy.ranks)
    return PipelineRun(cfg, history, ranks, before, after, after_reload)


@dataclass
class OneRank:
    metrics: dict[str, float]
    run_dir: Path


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> OneRank:
    run_dir = tmp_path_factory.mktemp("r3_pp1") / "run"
    cfg = load_config([*ONE_RANK, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        (metrics,) = job.train()
    return OneRank(metrics, run_dir)


def test_ranks_are_the_two_pipeline_stages(pipeline: PipelineRun) -> None:
    assert [(r.rank, r.dp_size, r.pp_rank, r.pp_size) for r in pipeline.ranks] == [
        (0, 1, 0, 2),
        (1, 1, 1, 2),
    ]


def test_two_steps_train_with_every_route_replayed(pipeline: PipelineRun) -> None:
    assert len(pipeline.history) == 2
    for metrics in pipeline.history:
        assert metrics["r3/router_agreement_trained"] == 1.0
        for key in ("train/policy_loss", "train/grad_norm", "policy/entropy"):
            assert math.isfinite(metrics[key]), key
        # The last stage's logprobs of the probe, both stages forwarding; fp32 engine.
        assert metrics["served_weights/median_abs_logp_diff"] <= 1e-4, metrics
    assert pipeline.history[0]["reward/std"] > 0  # else advantages are 0 and nothing trains


def test_weights_sync_from_both_stages_and_checkpoints_restore_them(
    pipeline: PipelineRun,
) -> None:
    assert len(pipeline.before) == len(pipeline.after) > 0
    assert pipeline.before != pipeline.after
    checkpoint = Path(pipeline.cfg.trainer.run_dir) / "checkpoints" / "step_000002"
    assert sorted(p.name for p in checkpoint.glob("policy_rank*.pt")) == [
        "policy_rank0.pt",
        "policy_rank1.pt",
    ]
    assert pipeline.after_reload == pipeline.after


def test_the_pipeline_takes_the_update_one_rank_takes(
    pipeline: PipelineRun, one_rank: OneRank
) -> None:
    first, one_rank = pipeline.history[0], one_rank.metrics
    assert first["reward/mean"] == one_rank["reward/mean"]  # the same rollouts
    for key in (
        "train/policy_loss",
        "train/grad_norm",
        "policy/clip_fraction",
        "policy/entropy",
        "mismatch_trained/mean_abs_logp_diff",
        "r3/router_agreement_native",
        "r3/num_token_layers",
    ):
        assert first[key] == pytest.approx(one_rank[key], rel=1e-5, abs=1e-7), key


def test_both_stages_export_what_one_rank_exports(pipeline: PipelineRun, one_rank: OneRank) -> None:
    """The same step trains to the same bits on one rank and on two stages (fp32, the
    same microbatches), so the exports after it are equal tensor for tensor."""
    run_dir = Path(pipeline.cfg.trainer.run_dir)
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == [
        "global_step_1",
        "global_step_2",
    ]
    staged = _weights(run_dir / "exports" / "global_step_1")
    one = _weights(one_rank.run_dir / "exports" / "global_step_1")
    assert staged.keys() == one.keys()
    assert all(torch.equal(staged[name], one[name]) for name in staged)


def test_the_export_script_gathers_both_stages_of_a_checkpoint(
    pipeline: PipelineRun, one_rank: OneRank, tmp_path: Path
) -> None:
    """``scripts/export_hf.py`` on the PP=2 run's step-1 checkpoint writes, tensor for
    tensor, the export the one-rank run wrote after the same step, and the one the
    pipeline run itself wrote then."""
    mc = pipeline.cfg.trainer.policy.megatron_config
    if mc.virtual_pipeline_model_parallel_size is None:
        # One run of the script (Ray, two ranks: ~30 s) on the harder layout; 1F1B's
        # stages export in the run itself (the test above).
        pytest.skip("the interleaved layout's checkpoint covers the script")
    run_dir = Path(pipeline.cfg.trainer.run_dir)
    out = tmp_path / "exported"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "export_hf.py"),
            "--checkpoint",
            str(run_dir / "checkpoints" / "step_000001"),
            "--out",
            str(out),
            # Sharded: the index and the shard names are checked on this path too.
            "--max-shard-bytes",
            "500000",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "starting 2 trainer rank(s): pipeline 2" in proc.stdout, proc.stdout
    assert f"wrote {out}:" in proc.stdout, proc.stdout
    assert (out / "model.safetensors.index.json").is_file()
    exported = _weights(out)
    in_run = _weights(run_dir / "exports" / "global_step_1")
    one = _weights(one_rank.run_dir / "exports" / "global_step_1")
    assert exported.keys() == in_run.keys() == one.keys()
    assert all(torch.equal(exported[name], in_run[name]) for name in exported)
    assert all(torch.equal(exported[name], one[name]) for name in exported)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_ranks_that_cannot_all_be_placed_are_refused_not_waited_for(tmp_path: Path) -> None:
    # Two 1-CPU ranks beside a 1-CPU server on a 2-CPU Ray: the second rank would be
    # queued and the first would wait in its rendezvous forever.
    import ray

    cfg = load_config(
        [
            *with_overrides(PIPELINE, "trainer.placement.cpus_per_trainer=1"),
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(ConfigValidationError) as info, launch(cfg):
        pass
    assert info.value.path == "trainer.placement.cpus_per_trainer"
    assert "1 x 1 (generator.inference_engine.num_cpus_per_engine)" in info.value.reason
    assert "2 x 1 (trainer.placement.cpus_per_trainer) = 3" in info.value.reason
    assert not ray.is_initialized()
