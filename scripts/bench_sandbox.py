"""Cost of one sandboxed execution, beside a plain ``subprocess.run`` (SkyRL's way).

    python scripts/bench_sandbox.py [-n 200] [--leak-check 1000]

Prints the CPU model, the mean and median wall time per execution of a trivial
program for the baseline (no isolation) and for ``run_python``, and their ratio.
``--leak-check N`` then runs N sandboxed executions in a row and compares the
number of processes and of temp-dir entries before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from skyrl_gym.sandbox import isolation, run_python
from skyrl_gym.sandbox.runner import MARKER

PROGRAM = "print(sum(range(100)))"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def timed(fn: Callable[[], object], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def baseline() -> None:
    subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=10)


def baseline_no_site() -> None:
    """The same interpreter flags as the sandbox (``-I -S``), to isolate its own cost."""
    subprocess.run(
        [sys.executable, "-I", "-S", "-c", PROGRAM], capture_output=True, text=True, timeout=10
    )


def sandboxed() -> None:
    result = run_python(PROGRAM)
    if result.stdout != "4950\n":
        raise SystemExit(f"sandboxed run failed: {result}")


def process_count() -> int:
    return sum(entry.isdigit() for entry in os.listdir("/proc"))


def sandbox_processes() -> int:
    """Live processes carrying a sandbox run's marker (other users' processes vary)."""
    count = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                count += f"{MARKER}=".encode() in f.read()
        except OSError:
            continue
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="executions per variant")
    parser.add_argument("--leak-check", type=int, default=0, metavar="N")
    args = parser.parse_args()
    print(f"cpu: {cpu_model()} ({os.cpu_count()} cores visible)")
    print(f"python: {sys.version.split()[0]}  isolation: {', '.join(isolation().layers)}")
    timed(sandboxed, 3)  # warm the probe and the page cache
    rows = {
        "baseline subprocess.run": timed(baseline, args.n),
        "baseline python -I -S": timed(baseline_no_site, args.n),
        "sandbox run_python": timed(sandboxed, args.n),
    }
    for name, times in rows.items():
        print(
            f"{name:26s} mean {statistics.mean(times) * 1e3:7.1f} ms  "
            f"median {statistics.median(times) * 1e3:7.1f} ms  (n={len(times)})"
        )
    base, bare, ours = (statistics.mean(t) for t in rows.values())
    print(f"ratio sandbox/baseline (mean): {ours / base:.2f}; sandbox/-I -S: {ours / bare:.2f}")
    if args.leak_check:
        procs, entries = process_count(), set(os.listdir(tempfile.gettempdir()))
        start = time.perf_counter()
        for _ in range(args.leak_check):
            sandboxed()
        elapsed = time.perf_counter() - start
        new_entries = set(os.listdir(tempfile.gettempdir())) - entries
        leaked = sorted(e for e in new_entries if e.startswith("skyrl-sandbox-"))
        print(
            f"leak check: {args.leak_check} runs in {elapsed:.1f} s; processes {procs} -> "
            f"{process_count()} (host-wide, other users vary); sandbox processes left: "
            f"{sandbox_processes()}; new temp entries {len(new_entries)} "
            f"(sandbox dirs left: {len(leaked)})"
        )


if __name__ == "__main__":
    main()
