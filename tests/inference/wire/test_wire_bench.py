"""Smoke: scripts/bench_wire.py runs small with --json and round-trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[3]


def test_bench_wire_small_json() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_wire.py"),
            "--json",
            "--choices",
            "2",
            "--tokens",
            "32",
            "--layers",
            "3",
            "--topk",
            "2",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    report = orjson.loads(proc.stdout)
    assert report["roundtrip_ok"] is True
    assert {"python", "numpy", "orjson", "pybase64", "pybase64_simd"} <= report["versions"].keys()
    assert set(report["bodies"]) == {"lean", "rich", "packed"}
    for entry in report["bodies"].values():
        assert entry["roundtrip_ok"] is True
        for path in ("naive", "ours", "floor"):
            assert entry[path]["min_ms"] <= entry[path]["median_ms"] <= entry[path]["max_ms"]
        assert entry["naive_over_ours"] > 0
    assert report["bodies"]["lean"]["peak_traced_mib"]["naive"] > 0
    assert "packed_ours_over_lean_naive" in report
