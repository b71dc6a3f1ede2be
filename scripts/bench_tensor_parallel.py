"""A replayed train step's time at TP=1 (one process) and TP=2 (two gloo processes,
sequence parallelism on) on the built-in model, and what slicing the routes for each
rank costs within it (docs/parallel-layouts.md).

    OMP_NUM_THREADS=1 python scripts/bench_tensor_parallel.py --steps 5

Each rank runs one thread; on a 2-core machine TP=2 has a core per rank while TP=1
leaves one idle, so the ratio says what the collectives and the sharded work cost
here, not what TP buys on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "skyrl_train" / "workers"))


def _rank(rank: int, world: int, rendezvous: str, steps: int, rows: int, seq: int) -> None:
    torch.set_num_threads(1)
    from _megatron_batches import PAD_ID, make_batch, random_routes

    from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
    from skyrl_train.config.schema import MegatronConfig
    from skyrl_train.workers.megatron import MegatronPolicyWorker, replay

    if world > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
        )
    cfg = TinyMoEConfig()
    worker = MegatronPolicyWorker(
        cfg.architecture(),
        MegatronConfig(moe_enable_routing_replay=True, tensor_model_parallel_size=world),
        pad_token_id=PAD_ID,
    ).setup()
    worker.load_weights(build_hf_model(cfg, seed=1).state_dict().items())
    gen = torch.Generator().manual_seed(0)
    prompt, response = seq // 2, seq - seq // 2
    prompts = [torch.randint(0, 250, (prompt,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(0, 250, (response,), generator=gen).tolist() for _ in range(rows)]
    routes = random_routes(rows, seq, cfg.num_layers, cfg.num_experts, 2, seed=1)
    batch = make_batch(
        prompts,
        responses,
        num_layers=cfg.num_layers,
        top_k=2,
        routes=[r[: seq - 1] for r in routes],
    )
    assert worker.routers is not None
    step_times, slice_times = [], []
    for _ in range(steps + 1):  # the first is a warm-up
        start = time.perf_counter()
        worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=rows // 2)
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        # What the replay driver does per microbatch: slice the routes to this rank.
        for half in (batch.routed_experts[: rows // 2], batch.routed_experts[rows // 2 :]):
            replay.to_sequence_first(half, worker.routers)
        slice_times.append(time.perf_counter() - start)
    if rank == 0:
        step, sliced = statistics.median(step_times[1:]), statistics.median(slice_times[1:])
        print(
            f"TP={world}: {rows} rows x {seq} tokens, median step {step * 1e3:.1f} ms, "
            f"route slicing {sliced * 1e3:.3f} ms ({100 * sliced / step:.2f}% of the step)"
        )
    if world > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            rendezvous = str(Path(tmp) / "rendezvous")
            mp.start_processes(
                _rank,
                args=(world, rendezvous, args.steps, args.rows, args.seq),
                nprocs=world,
                join=True,
            )


if __name__ == "__main__":
    main()
