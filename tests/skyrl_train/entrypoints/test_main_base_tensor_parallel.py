"""End to end with tensor parallelism (TP=2, sequence parallelism on) on Ray (gloo) and
R3: two GRPO steps with every route replayed, weights pushed from both TP ranks'
shards (the served-weights check compares the engine's logprobs with the trainer's),
per-rank checkpoints that restore the same served weights, an HF export gathered from
the shards, and the first step against the same step on one rank (fp32 rollouts give
both runs the same batch). TP=2 x EP=2 at expert tensor size 1 on 4 ranks (two
data-parallel ranks; each rank half the experts, whole) trains the same two steps with
every route replayed and the one rank's first step; its checkpoint, resume under
another layout and export at 4 and 8 ranks are by hand (test_main_base_many_ranks.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _e2e import (
    SMALL,
    export_with_script,
    probe,
    reload_and_probe,
    safetensors_weights,
    with_overrides,
)

from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import PPOConfig
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.trainer.policy import RankInfo

pytestmark = pytest.mark.slow


MC = "trainer.policy.megatron_config"
TENSOR_PARALLEL = with_overrides(
    SMALL,
    "trainer.num_steps=2",
    "trainer.eval_interval=0",
    "trainer.micro_train_batch_size_per_gpu=2",
    "trainer.micro_forward_batch_size_per_gpu=2",
    "trainer.placement.num_trainers=2",
    "trainer.placement.cpus_per_trainer=0.5",
    f"{MC}.tensor_model_parallel_size=2",
    "logging.plot=false",
    "trainer.hf_save_interval=1",
)
TENSOR_X_EXPERT = with_overrides(
    TENSOR_PARALLEL,
    # 4 ranks in the one Ray CPU the engine leaves: attention TP=2 x DP=2, experts
    # EP=2 folded over the same ranks (issue 51; it replaced the 2-rank launch here
    # rather than adding one, the suite being at its time budget).
    "trainer.placement.num_trainers=4",
    "trainer.placement.cpus_per_trainer=0.25",
    f"{MC}.expert_model_parallel_size=2",
    f"{MC}.expert_tensor_parallel_size=1",
    "trainer.ckpt_interval=0",  # checkpoints: the TP=2 run above
)
ONE_RANK = with_overrides(
    TENSOR_PARALLEL,
    "trainer.num_steps=1",
    "trainer.ckpt_interval=0",
    "trainer.placement.num_trainers=1",
    "trainer.placement.cpus_per_trainer=1",
    f"{MC}.tensor_model_parallel_size=1",
)


@dataclass
class Run:
    cfg: PPOConfig
    history: list[dict[str, float]]
    ranks: list[RankInfo]
    before: list[float]
    after: list[float]
    after_reload: list[float]


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("r3_tp2") / "run"
    cfg = load_config([*TENSOR_PARALLEL, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        before = probe(job.server_urls[0], job.api_key)
        history = job.train()
        after = probe(job.server_urls[0], job.api_key)
        after_reload = reload_and_probe(job, run_dir / "checkpoints" / "step_000002")
        ranks = list(job.policy.ranks)
    return Run(cfg, history, ranks, before, after, after_reload)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, float], Path]:
    run_dir = tmp_path_factory.mktemp("r3_tp1") / "run"
    cfg = load_config([*ONE_RANK, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        (metrics,) = job.train()
    return metrics, run_dir


@pytest.fixture(scope="module")
def tensor_x_expert(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("r3_tp2xep2") / "run"
    cfg = load_config([*TENSOR_X_EXPERT, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        before = probe(job.server_urls[0], job.api_key)
        history = job.train()
        after = probe(job.server_urls[0], job.api_key)
        ranks = list(job.policy.ranks)
    return Run(cfg, history, ranks, before, after, after_reload=[])


def test_two_tensor_parallel_ranks_train_with_every_route_replayed(tensor_parallel: Run) -> None:
    assert [(r.rank, r.dp_rank, r.dp_size, r.tp_size) for r in tensor_parallel.ranks] == [
        (0, 0, 1, 2),
        (1, 0, 1, 2),
    ]
    assert len(tensor_parallel.history) == 2
    for metrics in tensor_parallel.history:
        assert metrics["r3/router_agreement_trained"] == 1.0
        for key in ("train/policy_loss", "train/grad_norm", "policy/entropy"):
            assert math.isfinite(metrics[key]), key
        # The engine serves what the shards gathered: fp32 engine, same logprobs.
        assert metrics["served_weights/median_abs_logp_diff"] <= 1e-4, metrics
    assert tensor_parallel.before != tensor_parallel.after
    # Each rank reloads its own shard file; the push gathers them again.
    assert tensor_parallel.after_reload == tensor_parallel.after


def assert_the_one_rank_step(first: dict[str, float], single: dict[str, float]) -> None:
    """A layout's first step is the one-rank run's: the same rollouts, and its loss,
    norms, entropy, mismatch and router figures within 1e-5 relative."""
    assert first["reward/mean"] == single["reward/mean"]  # the same rollouts
    for key in (
        "train/policy_loss",
        "train/grad_norm",
        "policy/entropy",
        "mismatch_trained/mean_abs_logp_diff",
        "r3/router_agreement_native",
        "r3/num_token_layers",
    ):
        assert first[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key


def test_the_first_step_is_the_one_rank_step(
    tensor_parallel: Run, one_rank: tuple[dict[str, float], Path]
) -> None:
    assert_the_one_rank_step(tensor_parallel.history[0], one_rank[0])


def test_the_export_script_gathers_both_shards_of_a_checkpoint(
    tensor_parallel: Run, tmp_path: Path
) -> None:
    """``scripts/export_hf.py`` rebuilds the TP=2 ranks from the step-1 checkpoint and
    writes, tensor for tensor, the export the run wrote after the same step."""
    run_dir = Path(tensor_parallel.cfg.trainer.run_dir)
    out = tmp_path / "exported"
    proc = export_with_script(run_dir / "checkpoints" / "step_000001", out)
    assert "experts 1, tensor 2;" in proc.stdout, proc.stdout
    exported, in_run = (
        safetensors_weights(out),
        safetensors_weights(run_dir / "exports" / "global_step_1"),
    )
    assert exported.keys() == in_run.keys()
    assert all(torch.equal(exported[name], in_run[name]) for name in exported)


def test_the_export_gathers_whole_tensors(
    tensor_parallel: Run, one_rank: tuple[dict[str, float], Path]
) -> None:
    step = Path("exports") / "global_step_1"
    sharded = safetensors_weights(Path(tensor_parallel.cfg.trainer.run_dir) / step)
    single = safetensors_weights(one_rank[1] / step)
    assert {n: t.shape for n, t in sharded.items()} == {n: t.shape for n, t in single.items()}
    # AdamW's first step turns rounding in near-zero gradients into weight differences
    # (docs/parallel-layouts.md); the rest of the update is the one rank's. Measured on
    # the 2-core AMD EPYC: 6 of 478,912 elements beyond 1e-5, the largest 4.8e-5.
    total = sum(t.numel() for t in single.values())
    beyond = sum(int((sharded[n] - single[n]).abs().gt(1e-5).sum()) for n in single)
    assert beyond <= 1e-4 * total, beyond
    assert max(float((sharded[n] - single[n]).abs().max()) for n in single) <= 1e-3


def test_tensor_x_expert_parallel_trains_with_every_route_replayed_as_one_rank(
    tensor_x_expert: Run, one_rank: tuple[dict[str, float], Path]
) -> None:
    """TP=2 x EP=2 (ETP=1) on 4 ranks: two data-parallel ranks of two tensor-parallel
    ranks each, the experts over each pair."""
    run = tensor_x_expert
    assert [(r.rank, r.dp_rank, r.dp_size, r.tp_size, r.ep_size) for r in run.ranks] == [
        (0, 0, 2, 2, 2),
        (1, 0, 2, 2, 2),
        (2, 1, 2, 2, 2),
        (3, 1, 2, 2, 2),
    ]
    assert len(run.history) == 2
    for metrics in run.history:
        assert metrics["r3/router_agreement_trained"] == 1.0
        assert metrics["served_weights/median_abs_logp_diff"] <= 1e-4, metrics
    assert run.before != run.after
    assert_the_one_rank_step(run.history[0], one_rank[0])
    # The export gathers experts over EP (not TP): whole tensors, the one rank's update.
    step = Path("exports") / "global_step_1"
    sharded = safetensors_weights(Path(run.cfg.trainer.run_dir) / step)
    whole = safetensors_weights(one_rank[1] / step)
    assert {n: t.shape for n, t in sharded.items()} == {n: t.shape for n, t in whole.items()}
    total = sum(t.numel() for t in whole.values())
    beyond = sum(int((sharded[n] - whole[n]).abs().gt(1e-5).sum()) for n in whole)
    assert beyond <= 1e-4 * total, beyond


RESHARDED = with_overrides(ONE_RANK, "trainer.num_steps=2", "trainer.hf_save_interval=0")


def test_a_tensor_parallel_checkpoint_resumes_on_one_rank_resharded(
    tensor_parallel: Run, tmp_path: Path
) -> None:
    """The TP=2 run's step-1 checkpoint resumed by one TP=1 rank (runs/reshard.py,
    issue 39 item 5): its step 2 is the TP=2 run's step 2, the same rollouts (the engine
    is pushed the same weights) and the update within the one-rank tolerance above."""
    checkpoint = Path(tensor_parallel.cfg.trainer.run_dir) / "checkpoints" / "step_000001"
    cfg = load_config(
        [*RESHARDED, f"trainer.run_dir={tmp_path / 'run'}", f"trainer.resume_from={checkpoint}"]
    )
    with launch(cfg) as job:
        (resumed,) = job.train()
        (rank,) = job.policy.ranks
    assert (rank.world_size, rank.tp_size) == (1, 1)
    want = tensor_parallel.history[1]
    assert resumed["reward/mean"] == want["reward/mean"]
    assert resumed["r3/router_agreement_trained"] == 1.0
    for key in (
        "train/policy_loss",
        "train/grad_norm",
        "policy/entropy",
        "mismatch_trained/mean_abs_logp_diff",
        "r3/router_agreement_native",
        "r3/num_token_layers",
    ):
        assert resumed[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
