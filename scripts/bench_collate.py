"""Benchmark route collation against the memcpy floor for the same bytes.

    OMP_NUM_THREADS=1 python3 scripts/bench_collate.py [--workers 2] [--repeats 7] [--json]

A seeded batch (default 64 trajectories of up to 8,192 tokens, 48 layers x top-8,
uint8 ids from 128 experts) is collated serially and on ``--workers`` threads. The
baselines are one ``np.copyto`` of the output's byte count into fresh ``np.empty``
memory (page-fault bound), the same split into ``--workers`` contiguous parts copied
on as many threads (``fill_batch_rows``, the collation's pool), and into memory
touched beforehand. Each round runs all five in turn so machine noise hits them
alike; every fresh-memory run frees its output first, so it faults its pages again.
Reported: median and min-max in ms and GB/s of output bytes, plus the targets' ratios:

- serial / fresh memcpy throughput   (target >= 0.8)
- parallel speedup over serial        (target >= 1.5 with 2 workers on 2 cores), next
  to the plain memcpy's own speedup on as many threads: the memory system's ceiling

The fresh memcpy is the best case: source and destination are both page-aligned
plus the same header, so glibc copies backward, top down, which reuses the lines the
kernel just zeroed (22 ms on the 2-core AMD EPYC; 33 ms with the source shifted by
1 KiB, which makes it copy forward). Other processes share the cores: the load
average is printed before and after, and figures taken above a load of ~1.2 on two
cores are not comparable.

The round-trip check asserts the parallel result equals the serial one and that
sampled rows match a direct per-trajectory copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.dataset.routes import collate_routed_experts  # noqa: E402
from skyrl_train.utils.cpu_topology import (  # noqa: E402
    affinity_cores,
    cpu_model,
    permitted_cpu_cores,
)
from skyrl_train.utils.parallel import default_fill_workers, fill_batch_rows  # noqa: E402


def _make_batch(args: argparse.Namespace) -> tuple[list[np.ndarray], list[int], list[int]]:
    rng = np.random.default_rng(args.seed)
    dtype = np.min_scalar_type(args.experts - 1)  # the wire's smallest-dtype rule
    routes, prompts, responses = [], [], []
    for _ in range(args.batch):
        total = int(rng.integers(args.max_tokens // 4, args.max_tokens + 1))
        prompt = int(rng.integers(64, min(2048, total - 1) + 1))
        prompts.append(prompt)
        responses.append(total - prompt)
        # The last sampled token is never fed, so it has no route row.
        shape = (total - 1, args.layers, args.topk)
        routes.append(rng.integers(0, args.experts, size=shape, dtype=dtype))
    return routes, prompts, responses


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(seconds)
    return {
        "median_ms": med * 1e3,
        "min_ms": min(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "median_gb_s": nbytes / med / 1e9,
    }


def _check(serial: np.ndarray, parallel: np.ndarray, routes, prompts) -> None:
    assert np.array_equal(serial, parallel), "parallel collation differs from serial"
    width = max(prompts)
    for i in (0, len(routes) // 2, len(routes) - 1):
        rows, start = routes[i].shape[0], width - prompts[i]
        in_prompt = min(rows, prompts[i])
        assert np.array_equal(serial[i, start:width][:in_prompt], routes[i][:in_prompt])
        assert np.array_equal(serial[i, width : width + rows - in_prompt], routes[i][in_prompt:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON record")
    args = parser.parse_args()

    load_before = os.getloadavg()
    routes, prompts, responses = _make_batch(args)

    def collate(workers: int) -> np.ndarray:
        return collate_routed_experts(
            routes, prompt_lengths=prompts, response_lengths=responses, workers=workers
        ).routed_experts

    out_shape = (args.batch, max(prompts) + max(responses), args.layers, args.topk)
    out_dtype = routes[0].dtype
    nbytes = int(np.prod(out_shape)) * out_dtype.itemsize
    source = np.ones(out_shape, dtype=out_dtype)  # touched, so only the copy is timed
    touched = np.zeros(out_shape, dtype=out_dtype)

    def fresh_copy() -> None:
        np.copyto(np.empty(out_shape, dtype=out_dtype), source)

    def fresh_copy_parallel() -> None:
        out, src = np.empty(nbytes, dtype=np.uint8), source.reshape(-1).view(np.uint8)
        bounds = np.linspace(0, nbytes, args.workers + 1).astype(int)

        def part(j: int) -> None:
            np.copyto(out[bounds[j] : bounds[j + 1]], src[bounds[j] : bounds[j + 1]])

        fill_batch_rows(part, args.workers, workers=args.workers)

    # Warm-up: check correctness once and let the allocator settle.
    serial = collate(1)
    parallel = collate(args.workers)
    _check(serial, parallel, routes, prompts)
    del serial, parallel

    names = ("serial", "parallel", "fresh", "fresh_parallel", "touched")
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.repeats):
        times["serial"].append(_time(lambda: collate(1)))
        times["parallel"].append(_time(lambda: collate(args.workers)))
        times["fresh"].append(_time(fresh_copy))
        times["fresh_parallel"].append(_time(fresh_copy_parallel))
        times["touched"].append(_time(lambda: np.copyto(touched, source)))

    load_after = os.getloadavg()
    stats = {k: _summary(v, nbytes) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    record = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "affinity_cores": affinity_cores(),
        "load_avg_before": list(load_before),
        "load_avg_after": list(load_after),
        "permitted_cores": permitted_cpu_cores(),
        "default_fill_workers": default_fill_workers(),
        "workers": args.workers,
        "inputs": {
            "seed": args.seed,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "layers": args.layers,
            "topk": args.topk,
            "dtype": out_dtype.name,
            "input_mb": sum(r.nbytes for r in routes) / 1e6,
            "output_shape": list(out_shape),
            "output_mb": nbytes / 1e6,
        },
        "repeats": args.repeats,
        "stats": stats,
        "serial_vs_fresh_memcpy": med["fresh"] / med["serial"],
        "parallel_speedup": med["serial"] / med["parallel"],
        # Best-of-rounds: on a shared machine the minimum is the least disturbed run.
        "parallel_speedup_best": min(times["serial"]) / min(times["parallel"]),
        "memcpy_parallel_speedup": med["fresh"] / med["fresh_parallel"],
        "fresh_vs_touched_memcpy": med["touched"] / med["fresh"],
        "round_trip_check": "ok",
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return
    inp = record["inputs"]
    print(f"python {record['python']}  numpy {record['numpy']}  {record['platform']}")
    print(
        f"cpu: {record['cpu']}  os.cpu_count={record['os_cpu_count']}  "
        f"affinity={record['affinity_cores']}  permitted={record['permitted_cores']}  "
        f"default fill workers={record['default_fill_workers']}  bench workers={args.workers}"
    )
    print(
        "load average 1/5/15 min: before "
        + " ".join(f"{x:.2f}" for x in load_before)
        + "  after "
        + " ".join(f"{x:.2f}" for x in load_after)
    )
    print(
        f"batch: seed {args.seed}, {args.batch} trajectories <= {args.max_tokens} tokens, "
        f"{args.layers} layers x top-{args.topk} {inp['dtype']}; input {inp['input_mb']:.0f} MB, "
        f"output {tuple(out_shape)} = {inp['output_mb']:.0f} MB; {args.repeats} rounds"
    )
    for name, label in (
        ("serial", "collate, 1 worker"),
        ("parallel", f"collate, {args.workers} workers"),
        ("fresh", "memcpy into fresh memory"),
        ("fresh_parallel", f"same memcpy, {args.workers} threads"),
        ("touched", "memcpy into touched memory"),
    ):
        s = stats[name]
        print(
            f"  {label:<28} median {s['median_ms']:7.1f} ms  "
            f"[{s['min_ms']:.1f} - {s['max_ms']:.1f}]  {s['median_gb_s']:5.2f} GB/s"
        )
    serial_ratio, speedup = record["serial_vs_fresh_memcpy"], record["parallel_speedup"]
    print(
        f"serial / fresh memcpy throughput: {serial_ratio:.2f} "
        f"(target >= 0.8: {'met' if serial_ratio >= 0.8 else 'MISSED'})"
    )
    print(
        f"parallel speedup over serial:     {speedup:.2f} "
        f"(target >= 1.5: {'met' if speedup >= 1.5 else 'MISSED'}; "
        f"best-of-rounds {record['parallel_speedup_best']:.2f})"
    )
    print(f"memcpy speedup on {args.workers} threads:     {record['memcpy_parallel_speedup']:.2f}")
    print(f"fresh / touched memcpy:           {record['fresh_vs_touched_memcpy']:.2f}")
    print("round-trip check: ok")


if __name__ == "__main__":
    main()
