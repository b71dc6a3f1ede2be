"""FSDP vs Megatron worker: forward and train-step time on the built-in model.

    OMP_NUM_THREADS=1 python3 scripts/bench_fsdp_vs_megatron.py [--reps 5] [--rows 16]

Both workers are built in one process from one checkpoint folder (the built-in tiny
MoE, ``builtin_checkpoint``) on the same weights, one rank each (the FSDP one over a
one-rank mesh, through ``fully_shard``), fp32, and run the same batch: ``--rows``
rows with left-padded prompts and right-padded responses, random rollout routes
replayed (R3), ``--micro`` rows per microbatch. Each repeat times one ``forward``
(no gradient, the old-logprob pass) and one ``train_step`` (loss, backward, clip,
AdamW) on each worker, the two alternating so machine noise hits both alike; prints
the medians and min..max over ``--reps`` repeats after a warm-up, the ratio FSDP /
Megatron, the largest log-prob difference, and the CPU model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.models.checkpoint import builtin_checkpoint  # noqa: E402
from inference.models.tiny_moe import TinyMoEConfig  # noqa: E402
from skyrl_train.config.schema import FSDPConfig, MegatronConfig, OptimizerConfig  # noqa: E402
from skyrl_train.dataset.batch import TrainingBatch  # noqa: E402
from skyrl_train.trainer.policy import checkpoint_weights  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

PAD = 256


def make_batch(cfg: TinyMoEConfig, *, rows: int, prompt: int, response: int) -> TrainingBatch:
    """Ragged prompts (left padding) and responses (right padding), random routes."""
    gen = torch.Generator().manual_seed(0)
    seq = prompt + response
    layers, top_k = len(cfg.architecture().moe_layers), cfg.num_experts_per_tok
    sequences = torch.randint(0, 256, (rows, seq), generator=gen)
    attention = torch.ones(rows, seq, dtype=torch.int64)
    response_mask = torch.ones(rows, response, dtype=torch.int64)
    for b in range(rows):
        attention[b, : b % (prompt // 2)] = 0
        cut = response - b % (response // 2)
        attention[b, prompt + cut :] = 0
        response_mask[b, cut:] = 0
    sequences = sequences.masked_fill(attention == 0, PAD)
    scores = torch.rand(rows, seq, layers, cfg.num_experts, generator=gen)
    routes = scores.argsort(-1)[..., :top_k]
    return TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response_mask,
        loss_mask=response_mask.clone(),
        rewards=torch.zeros(rows),
        token_rewards=torch.zeros(rows, response),
        rollout_logprobs=-torch.rand(rows, response, generator=gen) * response_mask,
        routed_experts=routes,
        router_padding_mask=attention == 0,
    )


def loss_fn(logprobs: torch.Tensor, mb: TrainingBatch) -> torch.Tensor:
    mask = mb.loss_mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum()


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--response", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from skyrl_train.workers.fsdp import FSDPPolicyWorker
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    cfg = TinyMoEConfig()
    arch = cfg.architecture()
    optimizer = OptimizerConfig(lr=1e-5)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = builtin_checkpoint(cfg, seed=0, cache_dir=tmp)
        megatron = MegatronPolicyWorker(
            arch,
            MegatronConfig(moe_enable_routing_replay=True),
            optimizer=optimizer,
            pad_token_id=PAD,
        ).setup()
        fsdp = FSDPPolicyWorker(
            checkpoint, arch, FSDPConfig(), optimizer=optimizer, pad_token_id=PAD
        ).setup()
        for worker in (megatron, fsdp):
            worker.load_weights(checkpoint_weights(checkpoint))
    batch = make_batch(cfg, rows=args.rows, prompt=args.prompt, response=args.response)
    workers = {"megatron": megatron, "fsdp": fsdp}
    diff = (
        (
            megatron.forward(batch, micro_batch_size=args.micro, replay_routes=True).logprobs
            - fsdp.forward(batch, micro_batch_size=args.micro, replay_routes=True).logprobs
        )
        .abs()
        .max()
    )
    times: dict[str, dict[str, list[float]]] = {
        name: {"forward": [], "train_step": []} for name in workers
    }
    for rep in range(args.reps + 1):  # the first is a warm-up
        for name, worker in workers.items():
            fwd = timed(
                lambda w=worker: w.forward(batch, micro_batch_size=args.micro, replay_routes=True)
            )
            step = timed(
                lambda w=worker: w.train_step(
                    batch, loss_fn=loss_fn, micro_batch_size=args.micro, replay_routes=True
                )
            )
            if rep:
                times[name]["forward"].append(fwd)
                times[name]["train_step"].append(step)
    print(f"CPU: {cpu_model()}, torch threads 1, torch {torch.__version__}")
    print(
        f"batch: {args.rows} rows x {args.prompt}+{args.response} tokens, "
        f"micro_batch_size {args.micro}, R3 replay, fp32; {args.reps} repeats"
    )
    for what in ("forward", "train_step"):
        medians = {}
        for name in workers:
            values = times[name][what]
            medians[name] = statistics.median(values)
            print(
                f"  {what:<10} {name:<8} median {medians[name] * 1e3:7.1f} ms "
                f"({min(values) * 1e3:.1f}..{max(values) * 1e3:.1f})"
            )
        print(f"  {what:<10} fsdp / megatron = {medians['fsdp'] / medians['megatron']:.2f}")
    print(f"max |logprob difference| (R3 forward): {float(diff):.2e}")


if __name__ == "__main__":
    main()
