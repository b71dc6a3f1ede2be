"""End to end: a real two-step GRPO run with R3 on Ray, then a resume through the CLI.

One launch (servers, policy actor, Ray) serves several checks, because starting Ray
and importing Megatron in each actor costs most of a minute on 2 cores.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import ray
import yarl
from _e2e import SMALL, listening_sockets, new_pids, probe, process_tree, ray_daemon_pids
from _export_checks import check_export

from skyrl_train.config.compose import load_config
from skyrl_train.config.model_source import model_checkpoint
from skyrl_train.config.schema import PPOConfig
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.runs.rollouts import list_dumps, read_dump
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]


@dataclass
class FirstRun:
    cfg: PPOConfig
    history: list[dict[str, float]]
    before: list[float]
    after: list[float]
    urls: list[str]
    ray_pids_before: set[int]
    listening: list[tuple[int, str, int]]
    """Every listening TCP socket of this process and its descendants mid-run."""
    gcs_address: str
    unauthenticated_status: int
    """What a server answered a generate request that carried no token."""


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    run_dir = tmp_path_factory.mktemp("r3") / "run"
    cfg = load_config([*SMALL, f"trainer.run_dir={run_dir}"])
    ray_pids_before = ray_daemon_pids()
    with launch(cfg) as job:
        before = probe(job.server_urls[0], job.api_key)
        history = job.train()
        after = probe(job.server_urls[0], job.api_key)
        urls = list(job.server_urls)
        listening = listening_sockets(process_tree(os.getpid()))
        gcs_address = ray.get_runtime_context().gcs_address
        unauthenticated = _status_without_token(urls[0])
    return FirstRun(
        cfg=cfg,
        history=history,
        before=before,
        after=after,
        urls=urls,
        ray_pids_before=ray_pids_before,
        listening=listening,
        gcs_address=gcs_address,
        unauthenticated_status=unauthenticated,
    )


def _status_without_token(url: str) -> int:
    request = urllib.request.Request(
        url + "/skyrl/v1/generate",
        data=b'{"token_ids": [65]}',
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_metrics_are_written_per_step(first_run: FirstRun) -> None:
    rows = read_metrics(Path(first_run.cfg.trainer.run_dir) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in (
            "reward/mean",
            "response_length/mean",
            "generate/mean_turns",
            "r3/router_agreement_native",
            "mismatch_trained/mean_abs_logp_diff",
            "mismatch_trained/max_abs_logp_diff",
            "mismatch_trained/k3_kl",
            "mismatch_trained/frac_abs_logp_diff_gt_ln2",
            "timing/generate_s",
            "timing/collate_s",
            "timing/train_s",
            "timing/sync_s",
            "train/policy_loss",
        ):
            assert row[key] is not None and math.isfinite(row[key]), key
    assert "eval/reward_mean" in rows[1]
    for row in rows:
        # fp32 rollouts from the batch-invariant engine: the probe's served logprobs
        # are the trainer's own (bf16 engines: test_main_base_served_weights.py).
        assert row["served_weights/median_abs_logp_diff"] <= 1e-5, row
        assert row["served_weights/max_abs_logp_diff"] <= 1e-5, row


def test_every_ray_and_server_socket_is_on_loopback(first_run: FirstRun) -> None:
    ports = {port for _, _, port in first_run.listening}
    # Precondition: the scan saw the run's own sockets (GCS and the inference server).
    assert int(first_run.gcs_address.rsplit(":", 1)[1]) in ports
    assert all(yarl.URL(url).port in ports for url in first_run.urls)
    exposed = [s for s in first_run.listening if not ipaddress.ip_address(s[1]).is_loopback]
    assert exposed == [], f"sockets listening beyond loopback: {exposed}"


def test_servers_refuse_requests_without_the_run_token(first_run: FirstRun) -> None:
    assert first_run.unauthenticated_status == 401


def test_weights_changed_on_the_server_after_sync(first_run: FirstRun) -> None:
    assert len(first_run.before) == len(first_run.after) > 0
    # Precondition: some group had different rewards, so the update was not zero.
    assert max(step["reward/std"] for step in first_run.history) > 0
    assert first_run.before != first_run.after


def test_routes_were_replayed(first_run: FirstRun) -> None:
    for metrics in first_run.history:
        assert metrics["r3/router_agreement_trained"] == 1.0
        assert metrics["generate/route_rows"] > 0


def test_each_step_and_evaluation_dumped_its_rollouts(first_run: FirstRun) -> None:
    run_dir = Path(first_run.cfg.trainer.run_dir)
    refs = list_dumps(run_dir)
    assert [(r.step, r.kind) for r in refs] == [(1, "train"), (2, "train"), (2, "eval")]
    rows = 2 * 4  # SMALL: 2 prompts x 4 samples, fewer than logging.dump_rollouts
    for ref, metrics in zip(refs[:2], first_run.history, strict=True):
        doc = read_dump(ref.path)
        assert len(doc["trajectories"]) == rows and doc["group_size"] == 4
        assert np.array(doc["expert_load"]).shape == (doc["num_layers"], doc["num_experts"])
        native_flips = 0
        for t in doc["trajectories"]:
            count = len(t["response_ids"])
            assert len(t["tokens"]) == len(t["advantages"]) == len(t["loss_mask"]) == count
            # Replay on: the trained routing is the engine's on every token and layer.
            assert t["router_flips"] == [[]] * count
            native_flips += sum(len(layers) for layers in t["router_flips_native"])
            # The trainer's logprobs are the old-logprob pass's (fp32 rollouts: close).
            sampled = [j for j in range(count) if t["loss_mask"][j]]
            gap = max(abs(t["trainer_logprobs"][j] - t["rollout_logprobs"][j]) for j in sampled)
            assert gap < 1e-3
            assert sum(turn["reward"] for turn in t["turns"]) == pytest.approx(
                t["reward"], abs=1e-4
            )
            assert all(turn["policy_versions"] == [ref.step - 1] for turn in t["turns"])
        # The native agreement metric counts the flips the dump lists.
        assert (native_flips == 0) == (metrics["r3/router_agreement_native"] == 1.0)
    evaluation = read_dump(refs[2].path)
    assert len(evaluation["trajectories"]) == 2 and evaluation["group_size"] == 1


def test_nothing_left_running(first_run: FirstRun) -> None:
    import ray

    assert not ray.is_initialized()
    for url in first_run.urls:
        parsed = yarl.URL(url)
        with pytest.raises(OSError), socket.create_connection((parsed.host, parsed.port), 2):
            pass
    # Other Ray instances on the machine (a developer's) are not ours to judge.
    assert new_pids(ray_daemon_pids, first_run.ray_pids_before) == set()


def test_resume_reproduces_the_next_step(first_run: FirstRun, tmp_path: Path) -> None:
    checkpoint = Path(first_run.cfg.trainer.run_dir) / "checkpoints" / "step_000001"
    assert (checkpoint / "driver.json").is_file()
    resumed_dir = tmp_path / "resumed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_train.entrypoints.main_base",
            *SMALL,
            f"trainer.run_dir={resumed_dir}",
            f"trainer.resume_from={checkpoint}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The step line reads bare on the console, and Hydra's job log (hydra/job_logging:
    # <run_dir>/main_base.log) holds it too, timestamped, with the launch's own lines.
    stdout_lines = proc.stdout.splitlines()
    assert any(line.startswith("step 2 reward=") for line in stdout_lines), proc.stdout[-4000:]
    job_log = (resumed_dir / "main_base.log").read_text()
    assert "][skyrl_train.trainer.loop][INFO] - step 2 reward=" in job_log, job_log[-4000:]
    assert "][skyrl_train.entrypoints.main_base][INFO] - inference servers: http" in job_log
    rows = read_metrics(resumed_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [2]
    # The resumed step's rollouts are dumped again, with the same tokens.
    assert [(r.step, r.kind) for r in list_dumps(resumed_dir)] == [(2, "train"), (2, "eval")]
    again = read_dump(list_dumps(resumed_dir)[0].path)["trajectories"]
    first = read_dump(list_dumps(first_run.cfg.trainer.run_dir)[1].path)["trajectories"]
    assert [t["response_ids"] for t in again] == [t["response_ids"] for t in first]
    assert (resumed_dir / "metrics.png").is_file()
    expected = first_run.history[1]
    for key, value in rows[0].items():
        if key == "step" or key.startswith("timing/") or key.endswith("wall_s"):
            continue
        # abs 1e-5: the engine batches concurrent requests as they arrive, and a
        # different grouping moves fp32 logprobs by ~1e-6; the rollout-vs-trainer
        # mismatch figures are differences of exactly such numbers.
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-5), key


@pytest.fixture(scope="module")
def sampled_history(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    """Three steps sampled at temperature 1.5 with top-p 0.9 (sampler replay), trained
    packed (``trainer.remove_microbatch_padding``) in token-budget microbatches."""
    run_dir = tmp_path_factory.mktemp("sampled") / "run"
    overrides = [
        *SMALL,
        f"trainer.run_dir={run_dir}",
        "trainer.num_steps=3",
        "trainer.ckpt_interval=0",
        "trainer.eval_interval=0",
        "generator.sampling_params.temperature=1.5",
        "generator.sampling_params.top_p=0.9",
        "trainer.remove_microbatch_padding=true",
        # A few rows a microbatch: more than one microbatch a step, each packed.
        "trainer.max_tokens_per_microbatch=48",
    ]
    with launch(load_config(overrides)) as job:
        return job.train()


def test_a_tempered_top_p_run_scores_tokens_as_they_were_sampled(
    first_run: FirstRun, sampled_history: list[dict[str, float]]
) -> None:
    """Rollout and trainer log-probs agree at T = 1.5, top-p 0.9 as closely as with the
    default sampler: both are log q of the sampler's distribution over its kept set.
    Scored under the raw logits instead, they would differ by tenths of a nat."""
    key = "mismatch_trained/mean_abs_logp_diff"
    assert len(sampled_history) == 3
    default = max(row[key] for row in first_run.history)
    for row in sampled_history:
        assert math.isfinite(row["train/policy_loss"])
        # Packed with R3 on: every packed token replayed the rollout's experts.
        assert row["r3/router_agreement_trained"] == 1.0
        assert row[key] <= 2 * max(default, 1e-5), (row[key], default)
    print(
        f"mean |dlogp| default {default:.3g}, T=1.5 top-p 0.9 "
        f"{max(row[key] for row in sampled_history):.3g}"
    )


# ------------------------------------------------------- the run's Hugging Face export


def test_the_end_of_run_export_is_the_trainers_model(first_run: FirstRun, tmp_path: Path) -> None:
    run_dir = Path(first_run.cfg.trainer.run_dir)
    # trainer.hf_save_interval=0 (the default): the last step only.
    assert [p.name for p in (run_dir / "exports").iterdir()] == ["global_step_2"]
    delta = check_export(
        run_dir / "exports" / "global_step_2",
        model_checkpoint(first_run.cfg.model),
        run_dir / "checkpoints" / "step_000002",
        tmp_path,
    )
    print(f"built-in model: export vs trainer max |logits delta| {delta:.3g}")


def test_an_export_is_served_by_the_server_cli_and_trained_as_model_path(
    first_run: FirstRun, tmp_path: Path
) -> None:
    """The export is the policy the run ended with: ``python -m inference.server`` on
    it, and a new run's servers started from it as ``model.path``, sample what the
    run's own server sampled after the last push (same seed, fp32, batch-invariant)."""
    export = Path(first_run.cfg.trainer.run_dir) / "exports" / "global_step_2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "R3_TEST_KEY": "k"}
    server = subprocess.Popen(
        [
            sys.executable, "-m", "inference.server", "--host", "127.0.0.1", "--port", "0",
            "--api-key-env", "R3_TEST_KEY", "--dtype", "float32", "--checkpoint", str(export),
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline().strip()
        assert first.startswith("serving "), server.stderr.read() if server.stderr else first
        served = probe(first.removeprefix("serving "), "k")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert served == first_run.after

    run_dir = tmp_path / "from_export"
    overrides = [
        *SMALL,
        "trainer.num_steps=1",
        "trainer.ckpt_interval=0",
        "trainer.eval_interval=0",
        "logging.plot=false",
        f"model.path={export}",
        f"trainer.run_dir={run_dir}",
    ]
    with launch(load_config(overrides)) as job:
        # The launch pushed the trainer's weights, read from the export, over the
        # server's own load of it (and the served-weights check compared them).
        before = probe(job.server_urls[0], job.api_key)
        (metrics,) = job.train()
    assert before == first_run.after
    assert math.isfinite(metrics["train/policy_loss"])
    assert metrics["served_weights/median_abs_logp_diff"] <= 1e-5, metrics
    assert (run_dir / "exports" / "global_step_1" / "model.safetensors").is_file()
