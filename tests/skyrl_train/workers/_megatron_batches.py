"""Helpers shared by the Megatron worker tests: build a TrainingBatch in SkyRL's layout
(prompt left-padded, response right-padded) and compute HF reference logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from skyrl_train.dataset.batch import TrainingBatch

PAD_ID = 256  # the tokenizer's EOS doubles as pad


def make_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    num_layers: int,
    top_k: int,
    routes: Sequence[np.ndarray | torch.Tensor] | None = None,
    rollout_logprobs: Sequence[Sequence[float]] | None = None,
) -> TrainingBatch:
    """``routes[b]`` is ``[rows, L, K]`` for tokens 0..rows-1 of prompt+response."""
    batch = len(prompts)
    width = max(map(len, prompts))
    actions = max(max(map(len, responses)), 1)
    seq = width + actions
    sequences = torch.full((batch, seq), PAD_ID, dtype=torch.int64)
    attention = torch.zeros(batch, seq, dtype=torch.int64)
    response_mask = torch.zeros(batch, actions, dtype=torch.int64)
    all_routes = torch.arange(top_k).repeat(batch, seq, num_layers, 1)
    padding = torch.ones(batch, seq, dtype=torch.bool)
    logprobs = torch.zeros(batch, actions)
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        shift = width - len(prompt)
        sequences[b, shift:width] = torch.tensor(prompt)
        sequences[b, width : width + len(response)] = torch.tensor(response, dtype=torch.int64)
        attention[b, shift : width + len(response)] = 1
        response_mask[b, : len(response)] = 1
        if rollout_logprobs is not None:
            logprobs[b, : len(response)] = torch.tensor(rollout_logprobs[b])
        if routes is not None:
            rows = torch.as_tensor(np.asarray(routes[b]).astype(np.int64))
            all_routes[b, shift : shift + rows.shape[0]] = rows
            padding[b, shift : shift + rows.shape[0]] = False
    return TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response_mask,
        loss_mask=response_mask.clone(),
        rewards=torch.zeros(batch),
        token_rewards=torch.zeros(batch, actions),
        rollout_logprobs=logprobs if rollout_logprobs is not None else None,
        routed_experts=all_routes if routes is not None else None,
        router_padding_mask=padding if routes is not None else None,
    )


def hf_response_logprobs(hf_model: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
    """Reference [B, R] logprobs: each row run unpadded through the HF model in fp32."""
    width = batch.sequences.shape[1] - batch.num_actions
    out = torch.zeros(batch.batch_size, batch.num_actions)
    with torch.no_grad():
        for b in range(batch.batch_size):
            real = batch.attention_mask[b].bool()
            tokens = batch.sequences[b][real][None]
            prompt_len = int(real[:width].sum())
            logits = hf_model(tokens).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
            count = int(batch.response_mask[b].sum())
            out[b, :count] = logp[prompt_len - 1 : prompt_len - 1 + count]
    return out


def random_routes(
    batch: int, seq: int, num_layers: int, num_experts: int, top_k: int, *, seed: int
) -> torch.Tensor:
    """[B, S, L, K] valid routes: K distinct experts per row, uniformly at random."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, seq, num_layers, num_experts, generator=gen).argsort(-1)[..., :top_k]
