"""Packed against padded microbatches: a training step on a ragged batch, and packed
attention on many short rows against few long ones (issue 52's speed targets).

    OMP_NUM_THREADS=1 python3 scripts/bench_packed_step.py --backend fsdp [--reps 5]
    OMP_NUM_THREADS=1 python3 scripts/bench_packed_step.py --backend megatron [--reps 5]

One process, the built-in model (``builtin_checkpoint``), fp32, one rank, R3 replay.
``--rows`` rows are drawn like SkyRL's ``typical_rl`` spread: lengths uniform between
``--longest``/16 and ``--longest``, a quarter of each row its prompt (left padded) and
the rest its response (right padded), random rollout routes. The backend's two workers
(``trainer.remove_microbatch_padding`` off and on) load the same weights and run the
same batch and the same microbatches (``--micro`` rows each); each repeat times one
``train_step`` (and one ``forward``) on each, alternating so machine noise hits both
alike. Prints the medians, min..max, packed / padded (target: at most 0.7 for the
step), the real and padded token counts, the largest log-prob difference, and the CPU
model.

The second comparison times the packed attention alone (forward and backward of the
backend's per-document attention on the model's head shapes) on ``--short-rows`` rows
against ``--long-rows`` rows of the same total tokens: the short rows must not cost
more (attention grows with the sum of the rows' squares).

A backend is one entry of ``BACKENDS``: a function building its padded and packed
workers on a checkpoint, and one timing its packed attention.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.models.architecture import MoEArchitecture  # noqa: E402
from inference.models.checkpoint import builtin_checkpoint  # noqa: E402
from inference.models.tiny_moe import TinyMoEConfig  # noqa: E402
from skyrl_train.config.schema import FSDPConfig, OptimizerConfig  # noqa: E402
from skyrl_train.dataset.batch import TrainingBatch  # noqa: E402
from skyrl_train.trainer.policy import checkpoint_weights  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

PAD = 256


def ragged_batch(cfg: TinyMoEConfig, *, rows: int, longest: int, seed: int) -> TrainingBatch:
    """``typical_rl`` rows: lengths uniform in [longest/16, longest], a quarter prompt."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, longest // 16), longest + 1, (rows,), generator=gen)
    lengths[0] = longest
    prompts = [max(1, int(n) // 4) for n in lengths]
    responses = [int(n) - p for n, p in zip(lengths, prompts, strict=True)]
    width, actions = max(prompts), max(responses)
    seq = width + actions
    sequences = torch.full((rows, seq), PAD, dtype=torch.int64)
    attention = torch.zeros(rows, seq, dtype=torch.int64)
    response_mask = torch.zeros(rows, actions, dtype=torch.int64)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        attention[b, width - p : width + r] = 1
        response_mask[b, :r] = 1
    tokens = torch.randint(0, 256, (rows, seq), generator=gen)
    sequences = torch.where(attention.bool(), tokens, sequences)
    layers, top_k = len(cfg.architecture().moe_layers), cfg.num_experts_per_tok
    routes = torch.rand(rows, seq, layers, cfg.num_experts, generator=gen).argsort(-1)[..., :top_k]
    return TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response_mask,
        loss_mask=response_mask.clone(),
        rewards=torch.zeros(rows),
        token_rewards=torch.zeros(rows, actions),
        rollout_logprobs=-torch.rand(rows, actions, generator=gen) * response_mask,
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


@dataclass(frozen=True)
class Backend:
    workers: Callable[[Path, MoEArchitecture, OptimizerConfig], tuple[Any, Any]]
    """``(padded, packed)`` workers built on the checkpoint, weights loaded."""
    attention: Callable[[TinyMoEConfig, list[int]], Callable[[], None]]
    """A call running the packed attention's forward and backward on rows of those
    lengths packed into one, at the model's head shapes."""


def fsdp_workers(
    checkpoint: Path, arch: MoEArchitecture, optimizer: OptimizerConfig
) -> tuple[Any, Any]:
    from skyrl_train.workers.fsdp import FSDPPolicyWorker

    workers = []
    for packed in (False, True):
        worker = FSDPPolicyWorker(
            checkpoint,
            arch,
            FSDPConfig(),
            optimizer=optimizer,
            pad_token_id=PAD,
            remove_microbatch_padding=packed,
        ).setup()
        worker.load_weights(checkpoint_weights(checkpoint))
        workers.append(worker)
    return workers[0], workers[1]


def fsdp_attention(cfg: TinyMoEConfig, lengths: list[int]) -> Callable[[], None]:
    from skyrl_train.workers.fsdp import packed

    kernel = packed.PACKED_KERNELS[FSDPConfig().attn_implementation]
    packed.register_attention()
    from transformers import AttentionInterface

    attend = AttentionInterface()[kernel]
    module = torch.nn.Module()
    module.num_key_value_groups = cfg.num_attention_heads // cfg.num_kv_heads  # type: ignore[assignment]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.num_attention_heads, total, cfg.head_dim, generator=gen)
    k, v = (torch.randn(1, cfg.num_kv_heads, total, cfg.head_dim, generator=gen) for _ in "kv")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def run() -> None:
        out, _ = attend(module, *leaves, None, scaling=cfg.head_dim**-0.5, cu_seq_lens_q=cu)
        out.sum().backward()

    return run


class _MegatronView:
    """One Megatron worker run padded or packed: megatron-core's ``RouterReplay`` keeps
    one process-global registry of routers, so a second worker built in this process
    would leave the first unable to replay. The worker is built for packing (its core
    attention takes packed rows, and without them is megatron-core's own); each call
    sets ``remove_microbatch_padding`` to this view's before running."""

    def __init__(self, worker: Any, *, packed: bool) -> None:
        self._worker, self._packed = worker, packed

    def train_step(self, batch: TrainingBatch, **kwargs: Any) -> Any:
        self._worker.remove_microbatch_padding = self._packed
        return self._worker.train_step(batch, **kwargs)

    def forward(self, batch: TrainingBatch, **kwargs: Any) -> Any:
        self._worker.remove_microbatch_padding = self._packed
        return self._worker.forward(batch, **kwargs)


def megatron_workers(
    checkpoint: Path, arch: MoEArchitecture, optimizer: OptimizerConfig
) -> tuple[Any, Any]:
    from skyrl_train.config.schema import MegatronConfig
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    worker = MegatronPolicyWorker(
        arch,
        MegatronConfig(moe_enable_routing_replay=True),
        optimizer=optimizer,
        pad_token_id=PAD,
        remove_microbatch_padding=True,
    ).setup()
    worker.load_weights(checkpoint_weights(checkpoint))
    return _MegatronView(worker, packed=False), _MegatronView(worker, packed=True)


def megatron_attention(cfg: TinyMoEConfig, lengths: list[int]) -> Callable[[], None]:
    from skyrl_train.workers.packed_layout import document_attention

    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, cfg.num_attention_heads, cfg.head_dim, generator=gen)
    k, v = (torch.randn(total, cfg.num_kv_heads, cfg.head_dim, generator=gen) for _ in "kv")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def run() -> None:
        document_attention(*leaves, cu, scale=cfg.head_dim**-0.5).sum().backward()

    return run


BACKENDS: dict[str, Backend] = {
    "fsdp": Backend(fsdp_workers, fsdp_attention),
    "megatron": Backend(megatron_workers, megatron_attention),
}


def median_line(name: str, values: list[float]) -> str:
    return (
        f"{name:<7} median {statistics.median(values) * 1e3:8.1f} ms "
        f"({min(values) * 1e3:.1f}..{max(values) * 1e3:.1f})"
    )


def step_comparison(backend: Backend, args: argparse.Namespace) -> None:
    cfg = TinyMoEConfig()
    optimizer = OptimizerConfig(lr=1e-5)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = builtin_checkpoint(cfg, seed=0, cache_dir=tmp)
        padded, packed = backend.workers(checkpoint, cfg.architecture(), optimizer)
    batch = ragged_batch(cfg, rows=args.rows, longest=args.longest, seed=args.seed)
    real = int(batch.attention_mask.sum())
    print(
        f"batch: {args.rows} rows, typical_rl lengths {args.longest // 16}..{args.longest}, "
        f"width {batch.sequences.shape[1]}, {real} real tokens of "
        f"{batch.sequences.numel()} ({real / batch.sequences.numel():.0%}), "
        f"{args.micro} rows per microbatch, R3 replay, fp32; {args.reps} repeats"
    )
    kwargs = dict(micro_batch_size=args.micro, replay_routes=True)
    diff = padded.forward(batch, **kwargs).logprobs - packed.forward(batch, **kwargs).logprobs
    workers = {"padded": padded, "packed": packed}
    times = {name: {"train_step": [], "forward": []} for name in workers}
    for rep in range(args.reps + 1):  # the first is a warm-up
        for name, worker in workers.items():
            step = timed(lambda w=worker: w.train_step(batch, loss_fn=loss_fn, **kwargs))
            fwd = timed(lambda w=worker: w.forward(batch, **kwargs))
            if rep:
                times[name]["train_step"].append(step)
                times[name]["forward"].append(fwd)
    for what in ("train_step", "forward"):
        for name in workers:
            print(f"  {what:<10} {median_line(name, times[name][what])}")
        ratio = statistics.median(times["packed"][what]) / statistics.median(times["padded"][what])
        target = " (target <= 0.70)" if what == "train_step" else ""
        print(f"  {what:<10} packed / padded = {ratio:.2f}{target}")
    print(f"max |logprob difference| packed vs padded (R3 forward): {float(diff.abs().max()):.2e}")


def attention_comparison(backend: Backend, args: argparse.Namespace) -> None:
    cfg = TinyMoEConfig()
    total = args.short_rows * args.short_len
    long_len = total // args.long_rows
    shapes = {
        f"{args.short_rows} x {args.short_len}": [args.short_len] * args.short_rows,
        f"{args.long_rows} x {long_len}": [long_len] * args.long_rows,
    }
    calls = {name: backend.attention(cfg, lengths) for name, lengths in shapes.items()}
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for rep in range(args.reps + 1):
        for name, call in calls.items():
            took = timed(call)
            if rep:
                times[name].append(took)
    print(
        f"packed attention, forward + backward, {total} tokens in one packed row, "
        f"{cfg.num_attention_heads} heads ({cfg.num_kv_heads} kv) x {cfg.head_dim}:"
    )
    for name in shapes:
        print(f"  {median_line(name, times[name])}")
    short, long = (statistics.median(times[name]) for name in shapes)
    print(f"  short / long = {short / long:.2f} (target <= 1.00)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="fsdp")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short-rows", type=int, default=64)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--long-rows", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}, torch threads 1, torch {torch.__version__}, backend {args.backend}")
    backend = BACKENDS[args.backend]
    step_comparison(backend, args)
    attention_comparison(backend, args)


if __name__ == "__main__":
    main()
