"""One batched generation run: validation, prefill, KV-cached left-padded decode.

Our own loop rather than ``generate()``: per-request seeds, stop sets, sample
support and route rows fall out of it directly, and finished requests leave the
batch (their cache rows are dropped) instead of decoding padding to the longest.

A batch-invariant model (``inference.models.batch_invariant``) prefills all prompts
packed into one row, without padding, and the cache is then laid out left-padded;
the stock model prefills the left-padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from inference.engine.base import (
    EngineOutput,
    EngineRequest,
    SamplingParams,
    check_logprobs_mode,
    check_temperature,
    check_top_k,
    check_top_p,
)
from inference.engine.capture import RouteCapture
from inference.engine.prefill import left_pad, packed_prefill
from inference.engine.sampling import BatchSampler
from inference.errors import RequestValidationError
from inference.models.batch_invariant import is_batch_invariant

__all__ = ["run_batch", "validate_request"]


def validate_request(
    request: EngineRequest, *, field: str, vocab_size: int, max_positions: int
) -> None:
    """Raises ``RequestValidationError`` naming ``field`` (e.g. ``requests[3]``)."""
    if not isinstance(request, EngineRequest):
        raise RequestValidationError(field, "an EngineRequest", type(request).__name__)
    prompt = request.prompt_token_ids
    if len(prompt) == 0:
        raise RequestValidationError(f"{field}.prompt_token_ids", "a non-empty list", [])
    for i, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise RequestValidationError(f"{field}.prompt_token_ids[{i}]", "an int", tok)
        if not 0 <= tok < vocab_size:
            raise RequestValidationError(
                f"{field}.prompt_token_ids[{i}]", f"a token id in [0, {vocab_size})", tok
            )
    start = request.routed_experts_prompt_start
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(prompt):
        raise RequestValidationError(
            f"{field}.routed_experts_prompt_start",
            f"an int in [0, {len(prompt)}] (the prompt length)",
            start,
        )
    k = request.sample_support_k
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab_size:
        raise RequestValidationError(f"{field}.sample_support_k", f"an int in [0, {vocab_size}]", k)
    _validate_sampling(request.sampling, field=f"{field}.sampling", vocab_size=vocab_size)
    total = len(prompt) + request.sampling.max_tokens
    if total > max_positions:
        raise RequestValidationError(
            f"{field}.sampling.max_tokens",
            f"prompt ({len(prompt)}) + max_tokens <= {max_positions} positions",
            request.sampling.max_tokens,
        )


def _validate_sampling(params: SamplingParams, *, field: str, vocab_size: int) -> None:
    if not isinstance(params, SamplingParams):
        raise RequestValidationError(field, "a SamplingParams", type(params).__name__)
    if isinstance(params.max_tokens, bool) or not isinstance(params.max_tokens, int):
        raise RequestValidationError(f"{field}.max_tokens", "an int >= 1", params.max_tokens)
    if params.max_tokens < 1:
        raise RequestValidationError(f"{field}.max_tokens", "an int >= 1", params.max_tokens)
    # The server's validation calls the same check, so HTTP and engine say the same.
    check_temperature(params.temperature, field=f"{field}.temperature")
    check_top_p(params.top_p, field=f"{field}.top_p")
    check_top_k(params.top_k, field=f"{field}.top_k")
    check_logprobs_mode(params.logprobs_mode, field=f"{field}.logprobs_mode")
    if params.seed is not None and (
        isinstance(params.seed, bool) or not isinstance(params.seed, int) or params.seed < 0
    ):
        raise RequestValidationError(f"{field}.seed", "None or an int >= 0", params.seed)
    for i, tok in enumerate(params.stop_token_ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise RequestValidationError(
                f"{field}.stop_token_ids[{i}]", f"a token id in [0, {vocab_size})", tok
            )


def _generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh nondeterministic seed: unseeded requests must differ
    else:
        gen.manual_seed(seed)
    return gen


@torch.inference_mode()
def run_batch(
    model: Any,
    requests: Sequence[EngineRequest],
    *,
    capture: RouteCapture,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    policy_version: int,
) -> list[EngineOutput]:
    """Generates for already-validated ``requests`` in one left-padded batch.

    ``eos_token_ids`` all stop a request unless it sets ``ignore_eos`` (a chat checkpoint
    ends a turn at ``<|im_end|>`` and a document at ``<|endoftext|>``); empty: none do.
    ``policy_version`` tags every output: the caller holds the model for the whole run,
    so it is the version of every weight the batch used.
    """
    batch = len(requests)
    lengths = [len(r.prompt_token_ids) for r in requests]
    longest = max(lengths)
    max_new = max(r.sampling.max_tokens for r in requests)
    vocab = model.config.vocab_size

    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, longest), dtype=torch.long)
    stop_mask = torch.zeros((batch, vocab), dtype=torch.bool)
    for b, req in enumerate(requests):
        input_ids[b, longest - lengths[b] :] = torch.as_tensor(list(req.prompt_token_ids))
        attention[b, longest - lengths[b] :] = 1
        stops = list(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stops.extend(eos_token_ids)
        stop_mask[b, stops] = True
    # Left padding shifts real tokens right; positions must still start at 0.
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    max_tokens = torch.tensor([r.sampling.max_tokens for r in requests])

    support_k = max(r.sample_support_k for r in requests)
    sampler = BatchSampler(
        [r.sampling for r in requests],
        generators=[_generator(r.sampling.seed) for r in requests],
        support_k=support_k,
    )
    capture.active = any(r.return_routed_experts for r in requests)
    tokens_buf = torch.zeros((batch, max_new), dtype=torch.long)
    logprob_buf = torch.zeros((batch, max_new), dtype=torch.float32)
    support_ids_buf = torch.full((batch, max_new, support_k), -1, dtype=torch.int32)
    support_lp_buf = torch.full((batch, max_new, support_k), float("-inf"))
    support_size_buf = torch.zeros((batch, max_new), dtype=torch.int32)
    step_routes: torch.Tensor | None = None
    generated = torch.zeros(batch, dtype=torch.long)
    finished_stop = torch.zeros(batch, dtype=torch.bool)

    try:
        from transformers import DynamicCache

        if is_batch_invariant(model):
            capture.begin(1, sum(lengths))
            prefill = packed_prefill(model, [r.prompt_token_ids for r in requests])
            packed_routes = capture.end()
            cache, logits = prefill.cache, prefill.logits
            prefill_routes = None if packed_routes is None else left_pad(packed_routes[0], lengths)
        else:
            cache = DynamicCache(config=model.config)
            capture.begin(batch, longest)
            out = model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]
            prefill_routes = capture.end()
        if prefill_routes is not None:
            step_routes = torch.zeros(
                (batch, max_new, *prefill_routes.shape[2:]), dtype=prefill_routes.dtype
            )
        alive = torch.arange(batch)
        next_pos = torch.tensor(lengths)
        step = 0
        while True:
            sample = sampler.sample(logits)
            tokens_buf[alive, step] = sample.tokens
            logprob_buf[alive, step] = sample.logprobs
            if sample.support_ids is not None:
                support_ids_buf[alive, step] = sample.support_ids
                support_lp_buf[alive, step] = sample.support_logprobs  # type: ignore[assignment]
                support_size_buf[alive, step] = sample.support_size  # type: ignore[assignment]
            generated[alive] += 1
            hit_stop = stop_mask[alive, sample.tokens]
            finished_stop[alive] = hit_stop
            done = hit_stop | (generated[alive] >= max_tokens[alive])
            if bool(done.all()):
                break
            feed = sample.tokens
            if bool(done.any()):
                rows = (~done).nonzero()[:, 0]
                cache.batch_select_indices(rows)
                sampler.select(rows)
                alive, attention, next_pos, feed = (
                    alive[rows],
                    attention[rows],
                    next_pos[rows],
                    feed[rows],
                )
            attention = torch.cat([attention, attention.new_ones((len(alive), 1))], dim=1)
            capture.begin(len(alive), 1)
            out = model(
                input_ids=feed[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                cache=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            routes = capture.end()
            if routes is not None and step_routes is not None:
                step_routes[alive, step] = routes[:, 0]
            next_pos += 1
            step += 1
    finally:
        capture.active = False

    outputs = []
    for b, req in enumerate(requests):
        g = int(generated[b])
        out_b = EngineOutput(
            token_ids=tokens_buf[b, :g].tolist(),
            finish_reason="stop" if bool(finished_stop[b]) else "length",
            logprobs=logprob_buf[b, :g].tolist(),
            policy_version=policy_version,
        )
        if req.return_routed_experts and prefill_routes is not None and step_routes is not None:
            first = longest - lengths[b] + req.routed_experts_prompt_start
            # The last sampled token was never fed, so it has no route row.
            out_b.routed_experts = np.concatenate(
                [prefill_routes[b, first:].numpy(), step_routes[b, : g - 1].numpy()]
            )
        if req.sample_support_k > 0:
            k = req.sample_support_k
            out_b.sample_support_ids = support_ids_buf[b, :g, :k].numpy().copy()
            out_b.sample_support_logprobs = support_lp_buf[b, :g, :k].numpy().copy()
            out_b.sample_support_size = support_size_buf[b, :g].numpy().copy()
        outputs.append(out_b)
    return outputs
