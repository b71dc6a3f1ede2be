"""The client seams the trainer codes against, satisfied by ``RemoteGenerateClient``
(our server) and ``VLLMClient`` (a stock vLLM server): the generator only generates,
the weight syncer only pushes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from inference.client.results import GenerateRequest, GenerateResult


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
    """One inference server, whatever engine serves it."""

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
    ) -> GenerateResult: ...

    async def generate_batch(
        self, requests: Sequence[GenerateRequest], *, max_concurrency: int = 16
    ) -> list[GenerateResult]: ...

    async def health(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
