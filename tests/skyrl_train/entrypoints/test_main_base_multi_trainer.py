"""End to end with two trainer ranks on Ray (gloo, data parallel x expert parallel 2):
one GRPO step with R3, per-rank shards, weight sync from rank 0 and per-rank checkpoints,
and the same step on one rank for reference (fp32 rollouts make both runs see the
same batch, so two ranks must take the same update up to summation order). Two FSDP
ranks (``trainer.strategy=fsdp``) take that same one-rank Megatron update too."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _e2e import (
    SMALL,
    export_with_script,
    listening_sockets,
    new_pids,
    probe,
    process_tree,
    ray_actor_pids,
    ray_daemon_pids,
    reload_and_probe,
    safetensors_weights,
    with_overrides,
)

from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import PPOConfig
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.runs.rank_file import checkpoint_file, read_plain
from skyrl_train.trainer.policy import RankInfo
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

TWO_RANKS = with_overrides(
    SMALL,
    "trainer.num_steps=1",
    "trainer.eval_interval=0",
    # B = 2 prompts x 4 samples = 8 rows: two optimizer steps of 4 rows, 2 per rank.
    "generator.n_samples_per_prompt=4",
    "trainer.policy_mini_batch_size=1",
    "trainer.micro_train_batch_size_per_gpu=2",
    "trainer.micro_forward_batch_size_per_gpu=2",
    "trainer.placement.num_trainers=2",
    "trainer.placement.cpus_per_trainer=0.5",
    "trainer.policy.megatron_config.expert_model_parallel_size=2",
    # A random model earns this format credit ~10% of turns (the right letter: 0.4%),
    # so the step's groups hold different rewards and the update moves the weights.
    "environment.env_class=repeat_letter",
    "+environment.skyrl_gym.repeat_letter.format_credit=0.5",
    "logging.plot=false",
)
ROWS = 8
ONE_RANK = with_overrides(
    TWO_RANKS,
    "trainer.placement.num_trainers=1",
    "trainer.placement.cpus_per_trainer=1",
    "trainer.policy.megatron_config.expert_model_parallel_size=1",
    "trainer.micro_train_batch_size_per_gpu=4",
    "trainer.micro_forward_batch_size_per_gpu=4",
    "trainer.ckpt_interval=0",
)

FSDP_TWO_RANKS = with_overrides(
    [item for item in TWO_RANKS if "megatron_config" not in item], "trainer.strategy=fsdp"
)


@dataclass
class TwoRankRun:
    cfg: PPOConfig
    history: list[dict[str, float]]
    ranks: list[RankInfo]
    received_rows: list[int]
    before: list[float]
    after: list[float]
    after_reload: list[float]
    daemons_before: set[int]
    actors_before: set[int]
    listening: list[tuple[int, str, int]]
    trainer_pids: set[int]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> TwoRankRun:
    run_dir = tmp_path_factory.mktemp("r3_ep2") / "run"
    cfg = load_config([*TWO_RANKS, f"trainer.run_dir={run_dir}"])
    daemons_before, actors_before = ray_daemon_pids(), ray_actor_pids("PolicyTrainer")
    with launch(cfg) as job:
        before = probe(job.server_urls[0], job.api_key)
        history = job.train()
        after = probe(job.server_urls[0], job.api_key)
        # Reload the step's checkpoint on both ranks and sync again: a rank that
        # restored another rank's expert shard would change the served weights.
        checkpoint = run_dir / "checkpoints" / "step_000001"

        after_reload = reload_and_probe(job, checkpoint)
        ranks, received = list(job.policy.ranks), list(job.policy.received_rows)
        listening = listening_sockets(process_tree(os.getpid()))
        trainer_pids = ray_actor_pids("PolicyTrainer") - actors_before
    return TwoRankRun(
        cfg,
        history,
        ranks,
        received,
        before,
        after,
        after_reload,
        daemons_before,
        actors_before,
        listening,
        trainer_pids,
    )


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, float], list[float]]:
    run_dir = tmp_path_factory.mktemp("r3_one") / "run"
    cfg = load_config([*ONE_RANK, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        (metrics,) = job.train()
        return metrics, probe(job.server_urls[0], job.api_key)


@pytest.fixture(scope="module")
def fsdp_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    run_dir = tmp_path_factory.mktemp("fsdp_two") / "run"
    cfg = load_config([*FSDP_TWO_RANKS, f"trainer.run_dir={run_dir}"])
    with launch(cfg) as job:
        (metrics,) = job.train()
        after = probe(job.server_urls[0], job.api_key)
        after_reload = reload_and_probe(job, run_dir / "checkpoints" / "step_000001")
        ranks, received = list(job.policy.ranks), list(job.policy.received_rows)
    return dict(
        metrics=metrics,
        after=after,
        after_reload=after_reload,
        ranks=ranks,
        received=received,
        run_dir=run_dir,
    )


def test_two_fsdp_ranks_take_the_update_one_megatron_rank_takes(
    fsdp_two_ranks: dict, one_rank: tuple[dict[str, float], list[float]]
) -> None:
    """Sharded over two data-parallel ranks, transformers' model with gate-hook replay
    takes Megatron's one-rank step: same loss, norm and served weights (fp32)."""
    reference, reference_probe = one_rank
    metrics = fsdp_two_ranks["metrics"]
    assert [(r.rank, r.dp_rank, r.dp_size, r.ep_size) for r in fsdp_two_ranks["ranks"]] == [
        (0, 0, 2, 1),
        (1, 1, 2, 1),
    ]
    assert fsdp_two_ranks["received"] == [ROWS // 2, ROWS // 2]
    assert metrics["reward/mean"] == reference["reward/mean"]  # the same rollouts
    assert metrics["r3/router_agreement_trained"] == 1.0
    for key in (
        "train/policy_loss",
        "train/grad_norm",
        "policy/clip_fraction",
        "train/num_rows",
        "mismatch_trained/num_tokens",
        "r3/num_token_layers",
    ):
        assert metrics[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert fsdp_two_ranks["after"] == pytest.approx(reference_probe, abs=1e-4)
    # Each rank restored its own shard: the reloaded weights serve the same answer.
    assert fsdp_two_ranks["after_reload"] == fsdp_two_ranks["after"]


def test_the_export_script_joins_the_fsdp_shards_of_a_checkpoint(
    fsdp_two_ranks: dict, tmp_path: Path
) -> None:
    """``scripts/export_hf.py`` rebuilds the two FSDP ranks from the step-1 checkpoint
    (its run config names the backend) and writes, tensor for tensor, the export the
    run wrote after the same step."""
    run_dir = fsdp_two_ranks["run_dir"]
    out = tmp_path / "exported"
    export_with_script(run_dir / "checkpoints" / "step_000001", out)
    exported = safetensors_weights(out)
    in_run = safetensors_weights(run_dir / "exports" / "global_step_1")
    assert exported.keys() == in_run.keys() and len(exported) > 0
    assert all(torch.equal(exported[name], in_run[name]) for name in exported)


def test_trainer_ranks_listen_on_loopback_only(two_ranks: TwoRankRun) -> None:
    # Precondition: the scan saw the ranks' gloo listeners.
    assert {pid for pid, _, _ in two_ranks.listening} & two_ranks.trainer_pids
    exposed = [s for s in two_ranks.listening if not ipaddress.ip_address(s[1]).is_loopback]
    assert exposed == [], f"sockets listening beyond loopback: {exposed}"


def test_two_ranks_train_one_step_with_replay(two_ranks: TwoRankRun) -> None:
    rows = read_metrics(Path(two_ranks.cfg.trainer.run_dir) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1]
    for key in (
        "reward/mean",
        "r3/router_agreement_native",
        "mismatch_trained/mean_abs_logp_diff",
        "mismatch_trained/max_abs_logp_diff",
        "train/policy_loss",
        "train/grad_norm",
    ):
        assert rows[0][key] is not None and math.isfinite(rows[0][key]), key
    (metrics,) = two_ranks.history
    assert metrics["r3/router_agreement_trained"] == 1.0
    assert metrics["train/optimizer_steps"] == 2.0
    assert metrics["reward/std"] > 0  # else advantages are 0 and nothing trains
    # Both ranks scored the probe (experts meet in the all-to-all); fp32 engine.
    assert metrics["served_weights/median_abs_logp_diff"] <= 1e-4, metrics


def test_ranks_are_data_and_expert_parallel(two_ranks: TwoRankRun) -> None:
    assert [(r.rank, r.world_size, r.dp_rank, r.dp_size, r.ep_size) for r in two_ranks.ranks] == [
        (0, 2, 0, 2, 2),
        (1, 2, 1, 2, 2),
    ]


def test_each_rank_received_only_its_own_rows(two_ranks: TwoRankRun) -> None:
    assert two_ranks.received_rows == [ROWS // 2, ROWS // 2]
    assert two_ranks.history[0]["train/num_rows"] == ROWS


def test_weights_changed_on_the_server_and_checkpoints_restore_them(
    two_ranks: TwoRankRun,
) -> None:
    assert len(two_ranks.before) == len(two_ranks.after) > 0
    assert two_ranks.before != two_ranks.after
    checkpoint = Path(two_ranks.cfg.trainer.run_dir) / "checkpoints" / "step_000001"
    assert sorted(p.name for p in checkpoint.glob("policy_rank*.pt")) == [
        "policy_rank0.pt",
        "policy_rank1.pt",
    ]
    assert two_ranks.after_reload == two_ranks.after


def test_nothing_left_running(two_ranks: TwoRankRun) -> None:
    import ray

    assert not ray.is_initialized()
    assert new_pids(ray_daemon_pids, two_ranks.daemons_before) == set()
    assert new_pids(lambda: ray_actor_pids("PolicyTrainer"), two_ranks.actors_before) == set()


def test_two_ranks_take_the_update_one_rank_takes(
    two_ranks: TwoRankRun, one_rank: tuple[dict[str, float], list[float]]
) -> None:
    # Each optimizer step sees the same global rows and divides by the same global
    # token count on either layout; measured differences were ~1e-7 relative.
    reference, reference_probe = one_rank
    (metrics,) = two_ranks.history
    assert metrics["reward/mean"] == reference["reward/mean"]  # the same rollouts
    for key in (
        "train/policy_loss",
        "train/grad_norm",
        "policy/clip_fraction",
        "train/num_rows",
        "mismatch_trained/num_tokens",
        "r3/num_token_layers",
    ):
        assert metrics[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert two_ranks.after == pytest.approx(reference_probe, abs=1e-4)


def test_a_failing_rank_setup_takes_every_actor_down(tmp_path: Path) -> None:
    # Valid for validate_cfg (a TransformerConfig field) but refused by megatron-core
    # when each rank builds its config: the launch must raise and leave nothing behind.
    bad = (
        "+trainer.policy.megatron_config.transformer_config_kwargs."
        "num_layers_in_first_pipeline_stage=1"
    )
    cfg = load_config([*TWO_RANKS, bad, f"trainer.run_dir={tmp_path / 'run'}"])
    daemons_before, actors_before = ray_daemon_pids(), ray_actor_pids("PolicyTrainer")
    with pytest.raises(ValueError, match="PP stages"), launch(cfg):
        pytest.fail("launch must not yield when a rank failed setup")
    import ray

    assert not ray.is_initialized()
    assert new_pids(ray_daemon_pids, daemons_before) == set()
    assert new_pids(lambda: ray_actor_pids("PolicyTrainer"), actors_before) == set()


def test_the_export_gathers_every_ranks_experts(two_ranks: TwoRankRun) -> None:
    """The run's end-of-run export holds each expert as the rank that owns it saved it
    (rank r: experts [r*E/2, (r+1)*E/2)), split into save_pretrained's per-expert names."""
    from safetensors.torch import load_file

    run_dir = Path(two_ranks.cfg.trainer.run_dir)
    exported = load_file(str(run_dir / "exports" / "global_step_1" / "model.safetensors"))
    checkpoint = run_dir / "checkpoints" / "step_000001"
    ranks = [read_plain(checkpoint_file(checkpoint, rank))["model"] for rank in (0, 1)]
    local = re.compile(
        r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight"
    )
    per_rank = 1 + max(int(m.group(2)) for m in map(local.fullmatch, ranks[0]) if m)
    checked = 0
    for rank, state in enumerate(ranks):
        for key, value in state.items():
            match = local.fullmatch(key)
            if match is None:
                continue
            layer, j, fc = int(match.group(1)), int(match.group(2)), match.group(3)
            prefix = f"model.layers.{layer}.mlp.experts.{rank * per_rank + j}"
            if fc == "linear_fc1":  # [gate; up]
                got = torch.cat(
                    [exported[f"{prefix}.gate_proj.weight"], exported[f"{prefix}.up_proj.weight"]]
                )
            else:
                got = exported[f"{prefix}.down_proj.weight"]
            assert torch.equal(got, value), key
            checked += 1
    assert checked == 2 * 2 * per_rank * two_ranks.cfg.model.builtin.num_layers
    assert torch.equal(
        exported["model.embed_tokens.weight"], ranks[1]["embedding.word_embeddings.weight"]
    )
