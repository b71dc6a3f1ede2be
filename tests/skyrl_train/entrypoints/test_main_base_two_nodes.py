"""A launch on a two-node Ray cluster on this machine (two raylets with their own
CPUs, every Ray process on 127.0.0.1, started by scripts/loopback_ray_cluster.py as
docs/cluster-and-security.md shows): the trainer ranks on different nodes
(``trainer.placement.strategy=STRICT_SPREAD``), rank 0 beside the driver and the
engine on the other node, the experts gathered and the weights pushed across nodes,
nothing listening beyond loopback, and the cluster's processes gone after it."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from _e2e import (
    SMALL,
    listening_sockets,
    new_pids,
    process_tree,
    ray_actor_pids,
    with_overrides,
)

from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import launch
from skyrl_train.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "loopback_ray_cluster.py"
TWO_NODES = with_overrides(
    SMALL,
    "trainer.ckpt_interval=0",
    "trainer.eval_interval=0",
    "trainer.hf_save_interval=-1",
    "trainer.placement.num_trainers=2",
    "trainer.placement.cpus_per_trainer=1",
    "trainer.placement.strategy=STRICT_SPREAD",
    # Fits only on the second node (_start_cluster(1, 3)), whichever is placed first.
    "generator.inference_engine.num_cpus_per_engine=2",
    # Experts sharded over the two nodes: every push gathers them across nodes first.
    "trainer.policy.megatron_config.expert_model_parallel_size=2",
    "trainer.micro_train_batch_size_per_gpu=2",
    "trainer.micro_forward_batch_size_per_gpu=2",
    "logging.plot=false",
)


def _start_cluster(*cpus: int) -> tuple[subprocess.Popen[str], str, list[str]]:
    """The script as a user runs it, in its own session; (process, address, node ids)."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *(f"--num-cpus={n}" for n in cpus)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )
    assert proc.stdout is not None
    nodes = []
    for line in proc.stdout:
        if line.startswith("node "):
            nodes.append(line.split()[2])
        elif line.startswith("ray.address="):
            return proc, line.strip().split("=", 1)[1], nodes
    raise AssertionError(f"the cluster script exited with {proc.wait()} before its address")


def _stop_cluster(proc: subprocess.Popen[str]) -> set[int]:
    """SIGTERM as a user's Ctrl-C would; the processes of its session still alive."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return new_pids(lambda: _session_pids(proc.pid), set())


def _session_pids(sid: int) -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.add(int(entry))
            except OSError:
                continue
    return pids


@contextlib.contextmanager
def _token_auth() -> Iterator[None]:
    """``RAY_AUTH_MODE=token`` in this process, as the docs' ``export`` gives a launch.
    Ray reads it into its config when first imported (here long before this test), so
    the config is read again after setting it and after restoring it."""
    from ray._raylet import Config

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "token")
        Config.initialize("")
        try:
            yield
        finally:
            patch.undo()
            Config.initialize("")


def _actor_nodes() -> dict[str, tuple[str, str]]:
    """Actor id -> (class, node id) of this job's live actors, from Ray's actor table."""
    job = ray.get_runtime_context().get_job_id()
    return {
        actor_id: (a["ActorClassName"], a["Address"]["NodeID"])
        for actor_id, a in ray._private.state.actors().items()
        if a["State"] == "ALIVE" and a["JobID"] == job
    }


def test_a_launch_spreads_its_ranks_over_two_nodes_on_loopback(tmp_path: Path) -> None:
    # A Ray already initialised here would be used as it is (start_ray): one node.
    assert not ray.is_initialized()
    # The head (where the driver attaches) has room for one rank; the other node for
    # one rank and the engine.
    proc, address, nodes = _start_cluster(1, 3)
    try:
        cfg = load_config([*TWO_NODES, f"ray.address={address}", f"trainer.run_dir={tmp_path}"])
        with _token_auth(), launch(cfg) as job:
            history = job.train()
            placed = _actor_nodes()
            ranks = [placed[actor._actor_id.hex()][1] for actor in job.policy.actors]
            (engine,) = [node for name, node in placed.values() if name == "InferenceServerActor"]
            listening = listening_sockets(process_tree(os.getpid()) | process_tree(proc.pid))
            trainer_pids = ray_actor_pids("PolicyTrainer") & process_tree(proc.pid)
    finally:
        left = _stop_cluster(proc)
    assert left == set(), f"cluster processes alive after the script stopped: {left}"

    # Rank 0 beside the driver (policy_group.rank_bundles) and across from the engine:
    # every push gathers rank 1's experts to rank 0 over gloo, then rank 0 sends them to
    # the engine on the other node.
    assert ranks == nodes and engine == nodes[1], (ranks, engine, nodes)
    # Precondition: the scan saw the ranks' gloo listeners (workers of the raylets).
    assert {pid for pid, _, _ in listening} & trainer_pids, (listening, trainer_pids)
    exposed = [s for s in listening if not ipaddress.ip_address(s[1]).is_loopback]
    assert exposed == [], f"sockets listening beyond loopback: {exposed}"

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for metrics in history:
        assert metrics["r3/router_agreement_trained"] == 1.0
        assert math.isfinite(metrics["train/grad_norm"])
        # Each step's push scored on the engine (fp32) against the trainer's forward.
        assert metrics["served_weights/median_abs_logp_diff"] <= 1e-4, metrics
