"""Route collation padded vs packed, serial vs pooled: time and peak host memory.

    OMP_NUM_THREADS=1 python3 scripts/bench_packed_route_collation.py [--quick] \
        [--workers 2] [--skyrl /path/to/python3.12]

SkyRL's route-collation benchmark (``skyrl/benchmarks/bench_packed_route_collation.py``
in SkyRL 0.4.0) at shapes scaled to this machine: by default 256 sequences of at most
8,192 tokens, 40 MoE layers, top-22, int16 (SkyRL's production shape is 1,024 x 32,768,
"~110 GiB of host RAM"). Its four length spreads, each one line in ``SPREADS``. As in
SkyRL's, every trajectory's routes are a view of one seeded template (so building the
inputs does not dominate) and are captured for all its tokens, and each timed call
allocates its output afresh, so first-touch page faults are paid as in production.

Each case (spread x layout x workers) runs in a fresh subprocess, so no case inherits
another's heap: it builds the inputs, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), collates ``--iterations`` times (each output freed before
the next) and reports the median time and the peak RSS above the inputs (``VmHWM``
minus the RSS before the first call). Target: packed peak <= 1.15x the packed routes'
bytes (``[T, L, K]``).

``--skyrl PYTHON``: an interpreter whose environment has SkyRL 0.4.0 (Python 3.12) plus
``skyrl/train/dataset/parallel_fill.py`` and ``skyrl/utils/cpu_topology.py`` from
SkyRL's repository at ``refs/pull/2079/head`` (the wheel's benchmark imports them but
the wheel does not ship them). Built by hand, never a dependency of this project::

    python3.12 -m venv /tmp/skyrl312
    /tmp/skyrl312/bin/pip install numpy torch skyrl==0.4.0
    # then copy the two files into /tmp/skyrl312/lib/python3.12/site-packages/skyrl/

Its benchmark module's own fills (``_make_fill``: ``torch.empty`` then
``fill_batch_rows`` over its pool) run in the same kind of subprocess on the same
lengths and inputs, and are printed beside ours. Nothing of SkyRL is imported here.

Prompts are 256 tokens (half the row when shorter), so the padded rectangle is
``[B, longest]`` like SkyRL's. Other processes share the cores: the load average is
printed before and after; figures taken above a load of ~1.2 on two cores are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.utils.cpu_topology import (  # noqa: E402
    affinity_cores,
    cpu_model,
    permitted_cpu_cores,
)

# Shortest length as a fraction of the longest; lengths are uniform in [shortest,
# longest] and sequence 0 is pinned to the longest (SkyRL's definitions, 0.4.0).
SPREADS = {
    "uniform": 1.0,  # every sequence at the longest: packing saves nothing
    "mild_ragged": 1 / 2,  # shortest half the longest
    "typical_rl": 1 / 16,  # shortest 1/16 of the longest: "the measured production spread"
    "heavy_tail": 1 / 64,  # shortest 1/64 of the longest
}
PEAK_TARGET = 1.15
PROMPT_TOKENS = 256

# One case, run as `python -c CHILD '<json>'` by our interpreter and by SkyRL's, so both
# are measured by the same lines. Prints one JSON line.
CHILD = r"""
import gc, json, statistics, sys, time
import numpy as np
case = json.loads(sys.argv[1])
n, longest, L, K = case["sequences"], case["longest"], case["layers"], case["topk"]
shortest = max(1, round(longest * case["fraction"]))
rng = np.random.default_rng(case["seed"])
if shortest >= longest:
    lengths = np.full(n, longest, dtype=np.int64)
else:
    lengths = rng.integers(shortest, longest + 1, size=n).astype(np.int64)
    lengths[0] = longest
template = np.random.default_rng(case["seed"] + 1).integers(
    0, 128, size=(longest, L, K), dtype=np.int16)
routes = [template[: int(m)] for m in lengths]
packed, workers = case["layout"] == "packed", case["workers"]
if case["impl"] == "ours":
    sys.path.insert(0, case["root"])
    from skyrl_train.dataset.packed_routes import collate_packed_routes
    from skyrl_train.dataset.routes import collate_routed_experts
    prompts = [min(case["prompt"], int(m) // 2) for m in lengths]
    kw = dict(prompt_lengths=prompts, response_lengths=[int(m) - p for m, p in
              zip(lengths, prompts)], workers=workers)
    def collate():
        if packed:
            return collate_packed_routes(routes, **kw).routed_experts
        return collate_routed_experts(routes, **kw).routed_experts
else:
    import torch
    import skyrl.benchmarks.bench_packed_route_collation as sk
    same = sk._sequence_lengths(case["spread"], n, longest, case["seed"])
    assert np.array_equal(same, lengths), "SkyRL's lengths differ from ours"
    fill = sk._make_fill(packed, workers)
    shape = (sk._packed_shape if packed else sk._padded_shape)(lengths, L, K)
    def collate():
        out = torch.empty(shape, dtype=sk.ROUTE_DTYPE)
        fill(out, routes, lengths)
        return out
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    reset = True
except OSError:
    reset = False
base = status("VmRSS:")
times, nbytes = [], 0
for _ in range(case["iterations"]):
    gc.collect()
    start = time.perf_counter()
    out = collate()
    times.append(time.perf_counter() - start)
    nbytes = out.nbytes
    del out
print(json.dumps({"median_s": statistics.median(times), "min_s": min(times),
                  "max_s": max(times), "out_bytes": nbytes, "tokens": int(lengths.sum()),
                  "peak_bytes": status("VmHWM:") - base, "hwm_reset": reset,
                  "input_bytes": template.nbytes}))
"""


def _run_case(python: str, case: dict, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [python, "-c", CHILD, json.dumps(case)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{case['impl']} {case['spread']} {case['layout']} workers={case['workers']}: "
            f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _arms(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    impls = ["ours"] + (["skyrl"] if args.skyrl else [])
    return [
        (impl, layout, workers)
        for impl in impls
        for layout in ("padded", "packed")
        for workers in (1, args.workers)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 x 1,024 x 8 layers, 2 rounds")
    parser.add_argument("--sequences", type=int, default=None, help="default 256")
    parser.add_argument("--longest", type=int, default=None, help="tokens, default 8,192")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers, default 40")
    parser.add_argument("--topk", type=int, default=22)
    parser.add_argument("--iterations", type=int, default=None, help="default 3")
    parser.add_argument("--workers", type=int, default=2, help="the pooled arms' threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spreads", nargs="+", default=list(SPREADS), choices=list(SPREADS))
    parser.add_argument("--skyrl", metavar="PYTHON", help="SkyRL 0.4.0's interpreter")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--json", action="store_true", help="print one JSON record")
    args = parser.parse_args()
    quick = {"sequences": 32, "longest": 1024, "layers": 8, "iterations": 2}
    full = {"sequences": 256, "longest": 8192, "layers": 40, "iterations": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    load_before = os.getloadavg()
    root = str(Path(__file__).resolve().parents[1])
    results: dict[str, dict[str, dict]] = {}
    total = len(args.spreads) * len(_arms(args))
    print(f"running {total} cases, one process each", file=sys.stderr, flush=True)
    for spread in args.spreads:
        results[spread] = {}
        for impl, layout, workers in _arms(args):
            case = {
                "impl": impl,
                "spread": spread,
                "fraction": SPREADS[spread],
                "layout": layout,
                "workers": workers,
                "sequences": args.sequences,
                "longest": args.longest,
                "layers": args.layers,
                "topk": args.topk,
                "seed": args.seed,
                "iterations": args.iterations,
                "prompt": PROMPT_TOKENS,
                "root": root,
            }
            python = args.skyrl if impl == "skyrl" else sys.executable
            results[spread][f"{impl} {layout} {workers}t"] = _run_case(python, case, args.timeout)
            print(f"  {spread} {impl} {layout} {workers}t done", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    record = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "affinity_cores": affinity_cores(),
        "permitted_cores": permitted_cpu_cores(),
        "load_avg_before": list(load_before),
        "load_avg_after": list(load_after),
        "shape": {k: getattr(args, k) for k in ("sequences", "longest", "layers", "topk")},
        "iterations": args.iterations,
        "workers": args.workers,
        "skyrl_python": args.skyrl,
        "results": results,
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return
    _print(record, args)


def _print(record: dict, args: argparse.Namespace) -> None:
    print(f"python {record['python']}  {record['platform']}")
    print(
        f"cpu: {record['cpu']}  os.cpu_count={record['os_cpu_count']}  "
        f"affinity={record['affinity_cores']}  permitted={record['permitted_cores']}  "
        f"pooled arms: {args.workers} workers"
    )
    print(
        "load average 1/5/15 min: before "
        + " ".join(f"{x:.2f}" for x in record["load_avg_before"])
        + "  after "
        + " ".join(f"{x:.2f}" for x in record["load_avg_after"])
    )
    print(
        f"shape: {args.sequences} sequences <= {args.longest} tokens, {args.layers} MoE "
        f"layers x top-{args.topk} int16; {args.iterations} rounds per case, each case in "
        f"a fresh process" + (f"; SkyRL 0.4.0 via {args.skyrl}" if args.skyrl else "")
    )
    gib = 1024**3
    for spread, cases in record["results"].items():
        first = next(iter(cases.values()))
        packed_bytes = first["tokens"] * args.layers * args.topk * 2
        padded_bytes = args.sequences * args.longest * args.layers * args.topk * 2
        print(
            f"\n{spread}: T = {first['tokens']:,} tokens; packed routes "
            f"{packed_bytes / gib:.2f} GiB, [B, longest] rectangle {padded_bytes / gib:.2f} "
            f"GiB (packing saves {1 - packed_bytes / padded_bytes:.1%}); inputs "
            f"{first['input_bytes'] / gib:.3f} GiB"
        )
        print(
            f"  {'case':<22}{'median ms':>10}{'min-max ms':>18}{'GB/s':>7}{'output GiB':>11}"
            f"{'peak GiB':>10}{'peak/packed':>12}"
        )
        for name, r in cases.items():
            span = f"{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}"
            print(
                f"  {name:<22}{r['median_s'] * 1e3:>10.0f}{span:>18}"
                f"{r['out_bytes'] / r['median_s'] / 1e9:>7.2f}{r['out_bytes'] / gib:>11.2f}"
                f"{r['peak_bytes'] / gib:>10.2f}{r['peak_bytes'] / packed_bytes:>11.2f}x"
                + ("" if r["hwm_reset"] else "  (peak mark not reset)")
            )
        _print_targets(cases, packed_bytes, args)


def _print_targets(cases: dict, packed_bytes: int, args: argparse.Namespace) -> None:
    def best(impl: str, layout: str) -> float:
        return min(cases[f"{impl} {layout} {w}t"]["median_s"] for w in (1, args.workers))

    ours = best("ours", "packed")
    peak = max(cases[f"ours packed {w}t"]["peak_bytes"] for w in (1, args.workers))
    print(
        f"  ours: packed / padded time {ours / best('ours', 'padded'):.2f}; packed peak / "
        f"packed bytes {peak / packed_bytes:.2f} (target <= {PEAK_TARGET}: "
        f"{'met' if peak <= PEAK_TARGET * packed_bytes else 'MISSED'})"
    )
    if args.skyrl:
        theirs = best("skyrl", "packed")
        print(
            f"  ours best packed {ours * 1e3:.0f} ms vs SkyRL 0.4.0 best packed "
            f"{theirs * 1e3:.0f} ms: ratio {ours / theirs:.2f} (target <= 1.00: "
            f"{'met' if ours <= theirs else 'MISSED'}); SkyRL packed peak / packed bytes "
            f"{cases[f'skyrl packed {args.workers}t']['peak_bytes'] / packed_bytes:.2f}"
        )


if __name__ == "__main__":
    main()
