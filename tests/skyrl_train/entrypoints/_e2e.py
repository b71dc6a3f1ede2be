"""Shared by the end-to-end launch tests: tiny run sizes, a fixed-seed probe of a
server's weights, and the Ray daemons / actor processes alive on this machine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.client import RemoteGenerateClient

SMALL = [
    "trainer.num_steps=2",
    "trainer.ckpt_interval=1",
    "trainer.eval_interval=2",
    "trainer.eval_batch_size=2",
    "trainer.train_batch_size=2",
    "trainer.policy_mini_batch_size=2",
    "trainer.micro_train_batch_size_per_gpu=4",
    "trainer.micro_forward_batch_size_per_gpu=4",
    "generator.n_samples_per_prompt=4",
    # A random model earns this format credit ~10% of turns (the right letter: 0.4%),
    # so groups hold different rewards and every step really moves the weights.
    "environment.env_class=repeat_letter",
    "+environment.skyrl_gym.repeat_letter.format_credit=0.5",
    "generator.max_turns=2",
    "generator.max_tokens_per_turn=4",
    # fp32 rollouts make the resumed step reproducible bit for bit; bf16 is the
    # default and is what the other runs exercise.
    "generator.inference_engine.dtype=float32",
    "logging.progress_bar=false",
    # Delta sync end to end (full is the default and what the other runs exercise):
    # the weights-changed checks then prove changed tensors really are sent.
    "trainer.weight_sync.mode=delta",
    # The served-weights check after every push (the default is every 10th), so every
    # layout the e2e runs cover (data, expert, pipeline parallel) scores the probe.
    "generator.inference_engine.verify_weights_interval=1",
    "logging.plot=true",
    "ray.num_cpus=2",
]
PROBE = {"max_tokens": 8, "temperature": 1.0, "seed": 1234}


def with_overrides(base: list[str], *overrides: str) -> list[str]:
    """``base`` with each ``key=value`` in ``overrides`` replacing the same key."""
    keys = {item.split("=", 1)[0] for item in overrides}
    return [item for item in base if item.split("=", 1)[0] not in keys] + list(overrides)


def probe(url: str, api_key: str) -> list[float]:
    """Logprobs of a fixed-seed sample: they change when the server's weights do."""

    async def go() -> list[float]:
        async with RemoteGenerateClient(url, api_key=api_key) as client:
            result = await client.generate(
                prompt_token_ids=[257, 65, 66, 10], sampling_params=PROBE
            )
            return list(result.logprobs)

    return asyncio.run(go())


def reload_and_probe(job: Any, checkpoint: Path) -> list[float]:
    """Load ``checkpoint`` on every trainer rank, push the weights again and probe: a
    rank that restored another rank's shard (experts, stages) changes the answer."""

    async def reload() -> None:
        await job.loop.load_checkpoint(checkpoint)
        await job.policy.push_weights(job.server_urls, api_key=job.api_key)

    asyncio.run(reload())
    return probe(job.server_urls[0], job.api_key)


def new_pids(
    current: Callable[[], set[int]], before: set[int], *, timeout_s: float = 30
) -> set[int]:
    """Processes in ``current()`` not in ``before``, once they stop disappearing.

    Ray reaps actor workers and daemons asynchronously after ``ray.shutdown()`` and
    ``ray.kill()``; a process may need a moment to go, but none may stay.
    """
    deadline = time.monotonic() + timeout_s
    while (left := current() - before) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def ray_daemon_pids() -> set[int]:
    return _pids(
        lambda pid: Path(f"/proc/{pid}/comm").read_text().strip() in ("raylet", "gcs_server")
    )


def ray_actor_pids(class_name: str) -> set[int]:
    """Processes Ray titled ``ray::<class_name>`` (an actor's worker, alive or idle)."""
    marker = f"ray::{class_name}".encode()
    return _pids(lambda pid: Path(f"/proc/{pid}/cmdline").read_bytes().startswith(marker))


def _pids(matches) -> set[int]:  # type: ignore[no-untyped-def]
    pids = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if matches(pid):
                    pids.add(int(pid))
            except OSError:
                continue
    return pids


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it (Ray's daemons are the driver's
    children, its workers the raylet's)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; fields resume after ")".
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every listening TCP socket the ``pids`` hold,
    read from /proc so that nothing but the kernel's own table is trusted."""
    listening: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A":  # TCP_LISTEN
                listening[inode] = _decode_address(local)
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found.append((pid, *listening[target[8:-1]]))
    return found


def _decode_address(hex_address: str) -> tuple[str, int]:
    import ipaddress

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc prints the address as native-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped), int(port, 16)
    return str(address), int(port, 16)


REPO = Path(__file__).resolve().parents[3]


def export_with_script(checkpoint: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``scripts/export_hf.py`` run on ``checkpoint`` into ``out`` (the ranks rebuilt
    from the checkpoint's run config, on a Ray of its own); asserts it succeeded."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "export_hf.py"),
            "--checkpoint",
            str(checkpoint),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def safetensors_weights(folder: Path) -> dict[str, Any]:
    """Every tensor of an export's safetensors files, by name."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out
