"""Helpers shared by the FSDP worker tests: the Megatron and FSDP workers built from one
checkpoint folder on the same weights, and a batch that exercises the layout (left
and right padding, two or more microbatches) with random rollout routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _megatron_batches import make_batch, random_routes

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.schema import FSDPConfig, MegatronConfig, OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.policy import checkpoint_weights
from skyrl_train.workers.fsdp import FSDPPolicyWorker


def policy_loss(logprobs: torch.Tensor, mb: TrainingBatch, entropy: torch.Tensor) -> torch.Tensor:
    """A token-mean policy-gradient-like loss with an entropy bonus: every input the
    step differentiates reaches it."""
    mask = mb.loss_mask.to(logprobs.dtype)
    assert mb.rollout_logprobs is not None
    advantage = mb.rollout_logprobs.to(logprobs.device) + 0.5
    return -((logprobs * advantage + 0.01 * entropy) * mask).sum() / mask.sum()


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference."""
    return float((a - b).abs().max())


def build_megatron(
    checkpoint: Path,
    architecture: MoEArchitecture,
    *,
    optimizer: OptimizerConfig,
    pad_token_id: int,
    temperature: float = 1.0,
) -> Any:
    # Here, not at import: the FSDP-only tests load no megatron.
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    worker = MegatronPolicyWorker(
        architecture,
        MegatronConfig(moe_enable_routing_replay=True),
        optimizer=optimizer,
        pad_token_id=pad_token_id,
        temperature=temperature,
    ).setup()
    worker.load_weights(checkpoint_weights(checkpoint))
    return worker


def build_fsdp(
    checkpoint: Path,
    architecture: MoEArchitecture,
    *,
    optimizer: OptimizerConfig,
    pad_token_id: int,
    temperature: float = 1.0,
    fsdp_config: FSDPConfig | None = None,
    routing_replay: bool = True,
    remove_microbatch_padding: bool = False,
) -> FSDPPolicyWorker:
    worker = FSDPPolicyWorker(
        checkpoint,
        architecture,
        fsdp_config or FSDPConfig(),
        optimizer=optimizer,
        pad_token_id=pad_token_id,
        temperature=temperature,
        routing_replay=routing_replay,
        remove_microbatch_padding=remove_microbatch_padding,
    ).setup()
    worker.load_weights(checkpoint_weights(checkpoint))
    return worker


def build_pair(
    checkpoint: Path,
    architecture: MoEArchitecture,
    *,
    optimizer: OptimizerConfig,
    pad_token_id: int,
    temperature: float = 1.0,
) -> tuple[Any, FSDPPolicyWorker]:
    """Both backends' workers on ``checkpoint``'s weights (the Megatron one first: it
    starts this process's one-rank group, which the FSDP one then shards over)."""
    megatron = build_megatron(
        checkpoint,
        architecture,
        optimizer=optimizer,
        pad_token_id=pad_token_id,
        temperature=temperature,
    )
    fsdp = build_fsdp(
        checkpoint,
        architecture,
        optimizer=optimizer,
        pad_token_id=pad_token_id,
        temperature=temperature,
    )
    return megatron, fsdp


def layout_batch(
    architecture: MoEArchitecture, *, vocab: int, seed: int = 0, rows: int = 5
) -> TrainingBatch:
    """``rows`` rows of random tokens with ragged prompts (left padding) and responses
    (right padding), random valid rollout routes on every real token, and rollout
    logprobs; the last row is the only one at full width."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for b in range(rows):
        p_len, r_len = 2 + (3 * b) % 5, 1 + (2 * b + 1) % 5
        if b == rows - 1:
            p_len, r_len = 6, 5
        prompts.append(torch.randint(0, vocab, (p_len,), generator=gen).tolist())
        responses.append(torch.randint(0, vocab, (r_len,), generator=gen).tolist())
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    moe, top_k = len(architecture.moe_layers), architecture.num_experts_per_tok
    all_routes = random_routes(
        rows, max(lengths), moe, architecture.num_experts, top_k, seed=seed + 1
    )
    routes = [all_routes[b, : lengths[b]] for b in range(rows)]
    logprobs = [(-torch.rand(len(r), generator=gen)).tolist() for r in responses]
    return make_batch(
        prompts,
        responses,
        num_layers=moe,
        top_k=top_k,
        routes=routes,
        rollout_logprobs=logprobs,
    )
