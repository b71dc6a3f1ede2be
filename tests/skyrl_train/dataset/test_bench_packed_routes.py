"""Smoke: scripts/bench_packed_route_collation.py runs small with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_packed_route_collation_small_json() -> None:
    sequences, longest, layers, topk = 4, 64, 2, 3
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_packed_route_collation.py"),
            "--json",
            *("--sequences", str(sequences), "--longest", str(longest)),
            *("--layers", str(layers), "--topk", str(topk), "--iterations", "1"),
            *("--spreads", "uniform", "typical_rl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cpu"] and report["skyrl_python"] is None
    assert set(report["results"]) == {"uniform", "typical_rl"}
    for spread, cases in report["results"].items():
        assert set(cases) == {f"ours {lay} {w}t" for lay in ("padded", "packed") for w in (1, 2)}
        tokens = cases["ours packed 1t"]["tokens"]
        assert (tokens == sequences * longest) == (spread == "uniform")
        for name, case in cases.items():
            rows = tokens if "packed" in name else sequences * longest
            assert case["out_bytes"] == rows * layers * topk * 2  # int16
            assert case["min_s"] <= case["median_s"] <= case["max_s"]
            assert case["peak_bytes"] >= 0
