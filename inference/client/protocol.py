"""The generate contract, written once: what a generate call takes (``GenerateRequest``)
and returns (``GenerateResult``), and the client seams the trainer codes against
(``GenerateClient``, ``WeightUpdateClient``), satisfied by ``RemoteGenerateClient``
(our server) and ``VLLMClient`` (a stock vLLM server). The generator only generates,
the weight syncer only pushes.

Logprobs modes: each client declares the ``sampling_params.logprobs_mode`` values its
engine can report (``supported_logprobs_modes``; the names are
``inference.wire.LOGPROBS_MODES``), and a caller asks for one of those: the builtin
engine computes either per request, a vLLM server only the one it was started with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class GenerateRequest:
    """One generate call, as ``GenerateClient.generate`` takes it (for batches)."""

    prompt_token_ids: Sequence[int]
    sampling_params: Any = field(default_factory=dict)
    """A mapping of wire sampling params or an ``inference.engine.base.SamplingParams``."""
    return_routed_experts: bool = False
    routed_experts_prompt_start: int | None = None
    return_sample_support: bool | int = False
    session_id: str | None = None
    return_packed_body: bool = False


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of a reply were generated under ``policy_version``."""

    policy_version: int
    start: int
    end: int


@dataclass
class GenerateResult:
    """One prompt's completion.

    ``routed_experts`` is present only when requested: ``[P - s + G - 1, layers, topk]``
    integer expert ids (uint8/int16/int32: as sent by our server; a vLLM reply's
    uint16/int32 narrowed to the canonical dtype), row i the routing of prompt token
    s + i when it was fed. ``sample_support_ids`` / ``sample_support_logprobs``
    are present only when requested: ``[G, k]`` int32 candidate ids (trailing -1
    padding) and their float32 logprobs.
    """

    response_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None
    """Sampled-token logprobs, one per response id, in the request's logprobs mode;
    None when the server sent none. Values the server could not compute are -9999.0
    (see ``num_clamped_logprobs``)."""
    routed_experts: np.ndarray | None = None
    sample_support_ids: np.ndarray | None = None
    sample_support_logprobs: np.ndarray | None = None
    sample_support_size: np.ndarray | None = None
    """``[G]`` int32 kept-set size per generated token (with the support; None from a
    server that does not send it): above k, the listed candidates are cut short."""
    num_clamped_logprobs: int = 0
    """How many of this reply's logprobs the server clamped to -9999.0."""
    policy_version: int | None = None
    """The server's policy version when it generated this reply; None when the reply
    has no ``policy_version`` (a server from before versions). A reply whose tokens
    span a weight push (vLLM keeps in-flight requests across one) reports its oldest
    version here and all of them in ``policy_version_spans``."""
    policy_version_spans: list[VersionSpan] | None = None
    """Per-token versions as contiguous spans over ``response_ids``, one span per
    version, in order; None when the server reports one version for the whole reply
    (the builtin server: one batch runs under one version)."""

    @property
    def policy_versions(self) -> tuple[int, ...] | None:
        """Every policy version this reply's tokens came from, oldest first (two or
        more when it spans a push); None when the server reported none."""
        if self.policy_version_spans:
            return tuple(sorted({span.policy_version for span in self.policy_version_spans}))
        return None if self.policy_version is None else (self.policy_version,)


@runtime_checkable
class WeightUpdateClient(Protocol):
    """What ``WeightSyncer`` needs: one bucket of engine-layout tensors per call; all
    buckets of a versioned push but the last with ``commit=False``, the last with
    ``commit=True`` and the ``policy_version`` the weights become."""

    async def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        *,
        policy_version: int | None = None,
        commit: bool = True,
    ) -> int: ...


@runtime_checkable
class GenerateClient(WeightUpdateClient, Protocol):
    """One inference server, whatever engine serves it. The generator reads
    ``supported_logprobs_modes``, ``supports_packed_body`` (only when it asks for
    routes) and ``generate``; its stand-ins in tests need no more than those."""

    @property
    def supported_logprobs_modes(self) -> tuple[str, ...]:
        """The ``sampling_params.logprobs_mode`` values this client's engine reports
        (``inference.wire.LOGPROBS_MODES``); any other is refused before sending."""
        ...

    @property
    def supports_packed_body(self) -> bool:
        """Whether ``return_packed_body`` may be asked for (a faster parse of the same
        result); a client that cannot refuses it."""
        ...

    async def generate(
        self,
        *,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | Any,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        return_sample_support: bool | int = False,
        session_id: str | None = None,
        return_packed_body: bool = False,
    ) -> GenerateResult:
        """One completion of ``prompt_token_ids``. ``sampling_params``: a mapping of
        wire keys or an engine ``SamplingParams``; ``logprobs_mode`` among them must be
        one of ``supported_logprobs_modes`` (None or absent: the server's own).
        ``routed_experts_prompt_start`` travels inside the sampling params.
        ``return_sample_support``: True for the server's default k, or an int k.
        ``return_packed_body``: token ids and logprobs come back as envelopes too."""
        ...

    async def generate_batch(
        self, requests: Sequence[GenerateRequest], *, max_concurrency: int = 16
    ) -> list[GenerateResult]:
        """``requests`` with at most ``max_concurrency`` in flight; results in order."""
        ...

    async def health(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
