"""The engine seam: what the server asks of any inference backend.

The embedded default is a transformers model on CPU; a vLLM-backed engine can slot
in later by implementing ``InferenceEngine`` without touching the server or client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    """0.0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 means no top-k cut."""
    seed: int | None = None
    """Seeds this request's sampler; the same seed and prompt give the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids; the engine's eos id always stops too unless ``ignore_eos``."""
    ignore_eos: bool = False
    """Keep generating past eos (fixed-length benchmarks); ``stop_token_ids`` still stop."""


@dataclass(frozen=True)
class EngineRequest:
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0
    """Route rows before this prompt position are not returned (already sent)."""
    sample_support_k: int = 0
    """When > 0, return the top-k candidate ids and logprobs at every sampled position."""


@dataclass
class EngineOutput:
    token_ids: list[int]
    finish_reason: str
    """"stop" (a stop token was sampled, and is included) or "length"."""
    logprobs: list[float]
    """Logprob of each sampled token under the sampling distribution's model logits."""
    routed_experts: np.ndarray | None = None
    """[P - start + G - 1, layers, topk] integer expert ids when requested: row i is the
    routing of token start+i when it was fed. The last sampled token was never fed."""
    sample_support_ids: np.ndarray | None = None
    """[G, k] int32 candidate ids, trailing -1 padding, when requested."""
    sample_support_logprobs: np.ndarray | None = None
    """[G, k] float32 logprobs of those candidates, when requested."""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    dtype: str


@runtime_checkable
class InferenceEngine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
        """Generate for a batch of requests; one output per request, in order."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load weights named in the engine's own layout; returns how many were loaded."""
        ...

    async def close(self) -> None: ...
