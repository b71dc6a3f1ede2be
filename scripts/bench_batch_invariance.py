"""Batch invariance of the CPU engine: what it costs, and what it buys.

    OMP_NUM_THREADS=1 python3 scripts/bench_batch_invariance.py [--reps 7] [--json]

The default tiny MoE in bf16, two engines built from the same seed: the stock
transformers forward (``batch_invariant=False``, batch-variant) and the
batch-invariant one (``inference.models.batch_invariant``, the default). Prints:

  * throughput, generated tokens/s (wall clock), median and min..max over ``--reps``
    repeats, at batch 1, 8 and 64 (prompt lengths drawn from 8..120, temperature 1,
    fixed ``max_tokens``), plus a prefill-heavy shape like the training launch's turns
    (batch 64, prompts 64..250 tokens, 4 new tokens); the two paths alternate within
    each repeat so machine noise hits both alike, and the ratio is also given in
    CPU time of the calling thread (``generate_sync`` computes there), which other
    tenants of a shared machine disturb less than the wall clock;
  * mismatches: 64 mixed-length seeded requests run each alone and all in one batch;
    how many differ in tokens, in logprobs (exact) and in routed experts.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.engine.base import EngineOutput, EngineRequest, SamplingParams  # noqa: E402
from inference.engine.hf_engine import HFMoEEngine  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

PATHS = ("stock", "invariant")


def _requests(
    n: int, *, lengths: tuple[int, int], max_tokens: int, seed: int, routes: bool = False
) -> list[EngineRequest]:
    rng = np.random.default_rng(seed)
    return [
        EngineRequest(
            rng.integers(0, 256, int(rng.integers(lengths[0], lengths[1] + 1))).tolist(),
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True),
            return_routed_experts=routes,
        )
        for i in range(n)
    ]


def _same(a: EngineOutput, b: EngineOutput) -> tuple[bool, bool, bool]:
    routes = (
        a.routed_experts is not None
        and b.routed_experts is not None
        and a.routed_experts.shape == b.routed_experts.shape
        and bool((a.routed_experts == b.routed_experts).all())
    )
    return a.token_ids == b.token_ids, a.logprobs == b.logprobs, routes


def mismatches(engine: HFMoEEngine, n: int, max_tokens: int) -> dict[str, int]:
    reqs = _requests(n, lengths=(3, 120), max_tokens=max_tokens, seed=1, routes=True)
    alone = [engine.generate_sync([r])[0] for r in reqs]
    batched = engine.generate_sync(reqs)
    flags = [_same(a, b) for a, b in zip(alone, batched, strict=True)]
    return {
        "requests": n,
        "tokens": sum(not f[0] for f in flags),
        "logprobs": sum(not f[1] for f in flags),
        "routes": sum(not f[2] for f in flags),
    }


def throughput(
    engines: dict[str, HFMoEEngine], reqs: list[EngineRequest], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Tokens/s by wall clock and CPU seconds of the calling thread, per repeat."""
    tokens = sum(r.sampling.max_tokens for r in reqs)
    for engine in engines.values():
        engine.generate_sync(reqs)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(reps):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            t0, c0 = time.perf_counter(), time.thread_time()
            engines[name].generate_sync(reqs)
            cpu[name].append(time.thread_time() - c0)
            rates[name].append(tokens / (time.perf_counter() - t0))
    return rates, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args()

    engines = {
        name: HFMoEEngine.from_config(
            seed=0, num_threads=args.threads, batch_invariant=name == "invariant"
        )
        for name in PATHS
    }
    print(f"cpu: {cpu_model()} ({torch.backends.cpu.get_cpu_capability()})")
    print(f"torch {torch.__version__}, python {platform.python_version()}, ", end="")
    print(f"threads {torch.get_num_threads()}, model: tiny Qwen3-MoE bf16 (seed 0)")

    shapes = [
        (f"batch {b:>2}, prompts 8..120, {args.max_tokens} new", b, (8, 120), args.max_tokens)
        for b in (1, 8, 64)
    ] + [("batch 64, prompts 64..250, 4 new (training turns)", 64, (64, 250), 4)]
    report: dict[str, Any] = {"throughput": {}, "mismatches": {}}
    print(f"\nthroughput, generated tokens/s: median (min..max) over {args.reps} repeats")
    print(f"{'shape':<52}{'stock':>21}{'invariant':>21}{'inv/stock':>11}{'(cpu time)':>11}")
    for label, batch, lengths, max_tokens in shapes:
        reqs = _requests(batch, lengths=lengths, max_tokens=max_tokens, seed=batch)
        rates, cpu = throughput(engines, reqs, args.reps)
        med = {name: statistics.median(v) for name, v in rates.items()}
        cells = [f"{med[n]:8.0f} ({min(rates[n]):.0f}..{max(rates[n]):.0f})" for n in PATHS]
        ratio = med["invariant"] / med["stock"]
        cpu_ratio = statistics.median(cpu["stock"]) / statistics.median(cpu["invariant"])
        print(f"{label:<52}{cells[0]:>21}{cells[1]:>21}{ratio:>11.3f}{cpu_ratio:>11.3f}")
        report["throughput"][label] = {
            "tokens_per_s": rates,
            "cpu_s": cpu,
            "ratio_of_medians": ratio,
            "cpu_time_ratio": cpu_ratio,
        }

    print("\nalone vs in one batch of 64 (lengths 3..120, temperature 1, routes on)")
    for name in PATHS:
        m = mismatches(engines[name], 64, args.max_tokens)
        report["mismatches"][name] = m
        n = m["requests"]
        print(
            f"  {name:<10} tokens {m['tokens']}/{n} differ, logprobs {m['logprobs']}/{n}, "
            f"routed experts {m['routes']}/{n}"
        )
    for engine in engines.values():
        engine._executor.shutdown(wait=True)
        engine.capture.remove()
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
