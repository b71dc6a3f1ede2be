"""What a checkpoint costs to save, to load under its own layout, and to load resharded
under another (``runs/resume.py``, ``runs/reshard.py``), on two gloo processes
(docs/parallel-layouts.md, "Resharding").

    OMP_NUM_THREADS=1 python scripts/bench_reshard.py --repeats 3

Each rank saves its file as the trainer does (``resume.rank_checkpoint`` then
``rank_file.save_rank_state``: plain data, fsynced) after one AdamW step, so the file
holds the weights and both moments. A figure is the slowest rank's, the median over
``--repeats``; files were just written, so loads read from the page cache.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "TP=1 (DP=2)": {},
    "TP=2": {"tensor_model_parallel_size": 2},
    "EP=2": {"expert_model_parallel_size": 2},
    "PP=2 x VPP=2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
}
PAIRS = [
    ("TP=1 (DP=2)", "TP=2"),
    ("TP=2", "TP=1 (DP=2)"),
    ("TP=1 (DP=2)", "EP=2"),
    ("EP=2", "TP=2"),
    ("TP=1 (DP=2)", "PP=2 x VPP=2"),
    ("PP=2 x VPP=2", "TP=1 (DP=2)"),
]


def _record(policy: Any) -> dict[str, Any]:
    """The layout record the trainer writes: what the worker reports (``RankInfo.layout``)."""
    layout = policy.rank_info().layout
    assert layout is not None
    return layout.record()


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def _rank(rank: int, rendezvous: str, folder: str, sizes: dict[str, int], repeats: int) -> None:
    torch.set_num_threads(1)
    from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
    from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
    from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
    from skyrl_train.runs.resume import rank_checkpoint, restore_rank
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD
    )
    cfg = TinyMoEConfig(**sizes)
    hf_state = build_hf_model(cfg, seed=1).state_dict()

    def worker(name: str) -> Any:
        built = MegatronPolicyWorker(
            cfg.architecture(),
            MegatronConfig(**LAYOUTS[name]),
            optimizer=OptimizerConfig(lr=1e-3),
        ).setup()
        built.load_weights(hf_state.items())
        return built

    root = Path(folder)
    report: dict[str, Any] = {"save": {}, "load": {}, "reshard": {}, "bytes": {}}
    for name in LAYOUTS:
        policy = worker(name)
        record = _record(policy)
        # One AdamW step so the file holds both moments, as after training.
        sum((p.float() ** 2).sum() for p in policy.model.parameters()).backward()
        policy.optimizer.step()
        saves, loads = [], []
        for attempt in range(repeats):
            out = root / f"{name}-{attempt}".replace(" ", "_").replace("=", "")
            out.mkdir(exist_ok=True)
            torch.distributed.barrier()
            started = time.perf_counter()
            state = rank_checkpoint(policy, world_size=WORLD, layout=record)
            save_rank_state(checkpoint_file(out, rank), state)
            saves.append(_slowest(time.perf_counter() - started))
            torch.distributed.barrier()
            started = time.perf_counter()
            same = restore_rank(out, policy, rank=rank, world_size=WORLD, layout=record)
            loads.append(_slowest(time.perf_counter() - started))
            assert same is None
        report["save"][name] = statistics.median(saves)
        report["load"][name] = statistics.median(loads)
        report["bytes"][name] = checkpoint_file(out, rank).stat().st_size
    for src, dst in PAIRS:
        policy = worker(dst)
        record = _record(policy)
        times = []
        for attempt in range(repeats):
            source = root / f"{src}-{attempt}".replace(" ", "_").replace("=", "")
            torch.distributed.barrier()
            started = time.perf_counter()
            done = restore_rank(source, policy, rank=rank, world_size=WORLD, layout=record)
            times.append(_slowest(time.perf_counter() - started))
            assert done is not None and done.moments == done.parameters
        report["reshard"][f"{src} -> {dst}"] = statistics.median(times)
    report["params"] = sum(t.numel() for t in hf_state.values())
    torch.save(report, root / f"report{rank}.pt")
    torch.distributed.destroy_process_group()


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    sizes = {
        "hidden_size": args.hidden,
        "num_experts": args.experts,
        "moe_intermediate_size": args.expert_ffn,
        "num_layers": args.layers,
        "head_dim": args.hidden // 4,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(f"{tmp}/rendezvous", tmp, sizes, args.repeats), nprocs=WORLD
        )
        reports = [torch.load(Path(tmp) / f"report{r}.pt") for r in range(WORLD)]
    report = reports[0]
    mib = 2**20
    print(f"CPU: {_cpu()} ({os.cpu_count()} cores); 2 gloo ranks, 1 thread each")
    print(
        f"model: built-in MoE, {report['params'] / 1e6:.1f} M parameters ({sizes}); "
        f"median of {args.repeats}, slowest rank"
    )
    print(f"{'layout':<16} {'file/rank MiB':>14} {'save s':>8} {'MiB/s':>7} {'load s':>8}")
    for name in LAYOUTS:
        size = max(r["bytes"][name] for r in reports) / mib
        save = report["save"][name]
        print(
            f"{name:<16} {size:>14.1f} {save:>8.3f} {size / save:>7.0f} "
            f"{report['load'][name]:>8.3f}"
        )
    print(f"{'resharded load':<34} {'s':>8} {'x own-layout load':>18}")
    for pair, seconds in report["reshard"].items():
        own = report["load"][pair.split(" -> ")[1]]
        print(f"{pair:<34} {seconds:>8.3f} {seconds / own:>18.1f}")


if __name__ == "__main__":
    main()
