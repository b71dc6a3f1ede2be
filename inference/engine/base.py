"""The engine seam: what the server asks of any inference backend.

The embedded default is a transformers model on CPU; a vLLM-backed engine can slot
in later by implementing ``InferenceEngine`` without touching the server or client.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from inference.errors import RequestValidationError
from inference.wire.response import LOGPROBS_MODES
from inference.wire.response import PROCESSED_LOGPROBS as PROCESSED_LOGPROBS
from inference.wire.response import RAW_LOGPROBS as RAW_LOGPROBS

# The sampler divides float32 logits by the temperature (inference/engine/sampling.py).
# MIN: logits / T overflows float32 (max 3.4e38) to inf, and the softmax then gives NaN,
# once |logit| > 3.4e38 * T. At T = 1e-6 that takes |logit| > 3.4e32, far past any model
# output; at T = 1e-39 (a float32 subnormal) every |logit| > 0.34 overflows. Nothing is
# lost by the cut: float32 exp(-x) is 0 for x > 104, so at T = 1e-6 every token whose
# logit trails the top one by more than 1.04e-4 already has probability 0 (greedy).
# MAX: T is finite in float32 up to 3.4e38 (1e308 becomes inf, and -inf / inf is NaN),
# so the cap is about meaning: at T = 100 a 20-nat logit gap scales to 0.2, within a
# factor e^0.2 = 1.22 of uniform; a larger T only adds noise and is far more likely a
# unit mistake (70 sent for 0.7) than a wish.
MIN_TEMPERATURE = 1e-6
"""The smallest positive temperature; 0 means greedy."""
MAX_TEMPERATURE = 100.0
TEMPERATURE_RULE = f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"


def check_temperature(value: object, *, field: str) -> float:
    """``value`` as a float, or ``RequestValidationError(field, TEMPERATURE_RULE, value)``.

    The one check for both the HTTP request and the engine, so both say the same.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        temperature = float(value)
        if temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
            return temperature
    raise RequestValidationError(field, TEMPERATURE_RULE, value)


def check_policy_version(value: object, *, field: str, optional: bool = False) -> int | None:
    """``value`` as a policy version (an int >= 0; None too when ``optional``), or
    ``RequestValidationError`` naming ``field``: the one check for the engine, the
    client and the trainer's weight sync."""
    if value is None and optional:
        return None
    if type(value) is int and value >= 0:
        return value
    raise RequestValidationError(field, "None or an int >= 0" if optional else "an int >= 0", value)


TOP_P_RULE = "a number in (0, 1]"
TOP_K_RULE = "-1 (no cut) or an int >= 1"


def check_top_p(value: object, *, field: str) -> float:
    """``value`` as a float in (0, 1], or ``RequestValidationError(field, TOP_P_RULE, value)``;
    the one check for the HTTP request, the engine and the trainer's config."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        top_p = float(value)
        if 0 < top_p <= 1:
            return top_p
    raise RequestValidationError(field, TOP_P_RULE, value)


def check_top_k(value: object, *, field: str, vocab_size: int | None = None) -> int:
    """``value`` as -1 or an int in [1, vocab_size], or ``RequestValidationError``."""
    if type(value) is int and (value == -1 or value >= 1):
        if vocab_size is None or value <= vocab_size:
            return value
        raise RequestValidationError(field, f"{TOP_K_RULE} and <= {vocab_size}", value)
    raise RequestValidationError(field, TOP_K_RULE, value)


LOGPROBS_MODE_RULE = f"one of {list(LOGPROBS_MODES)}"


def check_logprobs_mode(value: object, *, field: str) -> str | None:
    """``value`` when it is one of ``LOGPROBS_MODES`` or None, else
    ``RequestValidationError(field, LOGPROBS_MODE_RULE, value)``: the one check for
    the HTTP request and the engine."""
    if value is None or (isinstance(value, str) and value in LOGPROBS_MODES):
        return value
    raise RequestValidationError(field, LOGPROBS_MODE_RULE, value)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    """0.0 means greedy; otherwise in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 means no top-k cut."""
    seed: int | None = None
    """Seeds this request's sampler; the same seed and prompt give the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids; the engine's EOS ids (the checkpoint's) always stop too unless ``ignore_eos``."""
    ignore_eos: bool = False
    """Keep generating past eos (fixed-length benchmarks); ``stop_token_ids`` still stop."""
    logprobs_mode: str | None = None
    """Which distribution reported logprobs are under (``LOGPROBS_MODES``); None: the
    server's own (``raw_logprobs`` here; a vLLM server's ``--logprobs-mode``). A
    trainer asks for ``processed_logprobs``, the one its tokens were sampled from.
    None rather than ``raw_logprobs`` by default: a vLLM server fixes its mode at
    launch, so a default that named one would be refused there."""


@dataclass(frozen=True)
class EngineRequest:
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0
    """Route rows before this prompt position are not returned (already sent)."""
    sample_support_k: int = 0
    """When > 0, return at every sampled position the sampler's kept set (its k most
    likely ids, -1 past the set), their logprobs and the set's size."""


@dataclass
class EngineOutput:
    token_ids: list[int]
    finish_reason: str
    """"stop" (a stop token was sampled, and is included) or "length"."""
    logprobs: list[float]
    """Logprob of each sampled token, under the request's ``logprobs_mode``."""
    policy_version: int
    """The engine's policy version when this output's batch ran; one batch runs under
    one version (weights are never loaded in the middle of a batch)."""
    routed_experts: np.ndarray | None = None
    """[P - start + G - 1, layers, topk] integer expert ids when requested: row i is the
    routing of token start+i when it was fed. The last sampled token was never fed."""
    sample_support_ids: np.ndarray | None = None
    """[G, k] int32 candidate ids, trailing -1 padding, when requested."""
    sample_support_logprobs: np.ndarray | None = None
    """[G, k] float32 logprobs of those candidates (``logprobs_mode``), when requested."""
    sample_support_size: np.ndarray | None = None
    """[G] int32 kept-set size per position, when the support is requested: a size
    above k means the listed candidates are only the k most likely of the set."""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    dtype: str
    batch_invariant: bool = False
    """True when a request's tokens, logprobs and routes do not depend on the requests
    batched with it (same prompt and seed, same output, alone or in any batch)."""


@runtime_checkable
class InferenceEngine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
        """Generate for a batch of requests; one output per request, in order."""
        ...

    @property
    def policy_version(self) -> int:
        """The policy version of the weights serving now: 0 at start, then the version
        named by the last ``load_weights`` that named one."""
        ...

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        policy_version: int | None = None,
    ) -> int:
        """Load weights named in the engine's own layout; returns how many were loaded.

        With ``policy_version`` (an int >= the current one) the engine's version becomes
        it in the same step: no output is ever tagged with a version whose weights were
        not all loaded, nor comes from weights half loaded. Without, it is unchanged.
        """
        ...

    async def close(self) -> None: ...


@runtime_checkable
class DescribesWeights(Protocol):
    """An engine that can say what ``load_weights`` accepts without copying anything.

    The server validates an upload's safetensors header against it before it reads a
    byte of tensor data.
    """

    def parameter_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Engine-layout name -> shape of every parameter ``load_weights`` accepts."""
        ...
