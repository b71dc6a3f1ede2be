"""``VLLMClient``: the client interface of ``RemoteGenerateClient`` over a stock vLLM
server's token-in/token-out API (``/inference/v1/generate``) and RL API (weights).

Requests: our sampling keys map one to one onto vLLM's ``SamplingParams`` (top_k -1
means no cut in both); the client adds ``logprobs: 0`` (the sampled token's logprob,
as the server's ``--logprobs-mode processed_logprobs`` computes it) and
``detokenize: false``, and always sends ``max_tokens`` (vLLM would otherwise fill the
context). What vLLM cannot give is refused before anything is sent: sample support,
packed bodies, sessions, unknown sampling keys.

Replies: the same retry taxonomy and size caps as ``RemoteGenerateClient`` (docs/design.md §3;
vLLM's per-token JSON is larger, hence its own per-token bound), parsed in one scan
that leaves ``routed_experts`` (base64 ``.npy``) as a view of the body, then
translated by ``inference.vllm.replies``. A vLLM started with route capture sends
routes with every reply, requested or not: they are spliced, and decoded only when
requested.

Weights: ``update_weights`` drives ``inference.vllm.push`` with a bucket sender
(default: safetensors files on this host, ``transport.BACKEND``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import orjson

from inference.client.http import HTTPClientBase
from inference.client.limits import (
    SERVER_DEFAULT_MAX_TOKENS,
    SMALL_REPLY_BYTES,
    RouteShape,
    generate_reply_cap,
)
from inference.client.replies import loads_or_retry
from inference.client.results import GenerateResult
from inference.client.retry import RetryPolicy
from inference.client.sampling import positive_int, sampling_dict
from inference.client.side_channels import as_protocol_error
from inference.errors import (
    GenerateHTTPError,
    GenerateProtocolError,
    RequestValidationError,
    WireError,
)
from inference.vllm.layouts import to_vllm_layout
from inference.vllm.push import WeightPush
from inference.vllm.replies import parse_vllm_reply, policy_version_of
from inference.vllm.senders import BucketSender, FileBucketSender
from inference.vllm.spec import VLLM_LOGPROBS_MODE
from inference.wire import NpyField, load_packed_body

GENERATE_PATH: Final = "/inference/v1/generate"
HEALTH_PATH: Final = "/health"
MODELS_PATH: Final = "/v1/models"
WEIGHT_INFO_PATH: Final = "/weight_info"

SAMPLING_KEYS: Final = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "routed_experts_prompt_start",
)
VLLM_TOKEN_JSON_BYTES: Final = 256
"""Per generated token in a vLLM reply, measured on its JSON writer's widest values:
``{"token_id":2147483647,"logprob":-2.2250738585072014e-308,"rank":2147483647,
"top_logprobs":[{...the same...}]},`` is 171 bytes, the id in ``token_ids`` 11 and a
``weight_versions`` span (at most one per token) 70: 252."""

_log = logging.getLogger(__name__)


class VLLMClient(HTTPClientBase):
    """Async client of one vLLM server (``--enable-scale-out``, dev mode for the RL API).

    Options as ``RemoteGenerateClient``'s, plus: ``route_shape`` is needed to request
    routes (vLLM does not report layers and top_k) unless ``max_reply_bytes`` is given;
    ``sender`` delivers weight buckets (default :class:`FileBucketSender`: the server
    must run on this host); ``weight_timeout_s`` is the per-attempt timeout of the RL
    API calls (a bucket load can take long on a big model; vLLM's own client uses 300 s).
    ``eos_token_ids``: the checkpoint's EOS ids, added to every request's
    ``stop_token_ids`` unless it sets ``ignore_eos``, as the builtin engine adds them
    itself: a server started with ``--skip-tokenizer-init`` has no EOS id ("Using None
    for EOS token id") and would otherwise generate past EOS up to ``max_tokens``.
    ``family``: the checkpoint's family (``MoEArchitecture.family``), whose pushed
    tensors are renamed to what vLLM loads (``inference.vllm.layouts``); None sends the
    engine layout as it is, which vLLM takes for every family but Mixtral.
    """

    supports_packed_body = False
    """vLLM sends token ids and logprobs as JSON lists only."""

    def __init__(
        self,
        base_url: str,
        *,
        retry: RetryPolicy | Mapping[str, Any] | None = None,
        api_key: str | None = None,
        model: str | None = None,
        max_connections: int = 64,
        seed: int | None = None,
        max_reply_bytes: int | None = None,
        route_shape: RouteShape | None = None,
        sender: BucketSender | None = None,
        weight_timeout_s: float = 300.0,
        eos_token_ids: Sequence[int] = (),
        family: str | None = None,
    ) -> None:
        if (
            isinstance(weight_timeout_s, bool)
            or not isinstance(weight_timeout_s, int | float)
            or not 0 < weight_timeout_s < float("inf")
        ):
            raise ValueError(
                f"weight_timeout_s: expected a finite number > 0, got {weight_timeout_s!r}"
            )
        if isinstance(eos_token_ids, (str, bytes)) or not all(
            type(i) is int and i >= 0 for i in eos_token_ids
        ):
            raise ValueError(
                f"eos_token_ids: expected a sequence of token ids >= 0, got {eos_token_ids!r}"
            )
        super().__init__(
            base_url,
            retry=retry,
            api_key=api_key,
            model=model,
            max_connections=max_connections,
            seed=seed,
            max_reply_bytes=max_reply_bytes,
            route_shape=route_shape,
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.family = family
        self._control_retry = dataclasses.replace(
            self.retry,
            attempt_timeout_s=weight_timeout_s,
            deadline_s=max(self.retry.deadline_s, weight_timeout_s),
        )
        self._control_once = dataclasses.replace(self._control_retry, max_attempts=1)
        self._push = WeightPush(self._control, sender if sender is not None else FileBucketSender())

    async def close(self) -> None:
        """End a push left in progress (best effort: resume the server), close the
        sender and the HTTP session. The client may be reopened."""
        if self._push.in_progress:
            for failure in await self._push.abandon():
                _log.warning("%s: %s", self.base_url, failure)
        await self._push.sender.close()
        await super().close()

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
        """Generate one completion of ``prompt_token_ids`` (see the module docstring)."""
        if return_sample_support is not False and return_sample_support != 0:
            raise RequestValidationError(
                "return_sample_support",
                "False (vLLM's generate API returns no candidate ids or logprobs)",
                return_sample_support,
            )
        if return_packed_body:
            raise RequestValidationError(
                "return_packed_body",
                "False (vLLM sends token ids and logprobs as JSON lists; see supports_packed_body)",
                return_packed_body,
            )
        if session_id is not None:
            raise RequestValidationError(
                "session_id", "None (vLLM's generate API has no sessions)", session_id
            )
        params = sampling_dict(sampling_params)
        if routed_experts_prompt_start is not None:
            if "routed_experts_prompt_start" in params:
                raise ValueError(
                    "routed_experts_prompt_start: expected it either as an argument or in "
                    "sampling_params, got both"
                )
            params["routed_experts_prompt_start"] = routed_experts_prompt_start
        mode = params.pop("logprobs_mode", None)
        if mode not in (None, VLLM_LOGPROBS_MODE):
            # vLLM fixes the mode per server (--logprobs-mode), not per request.
            raise RequestValidationError(
                "$.sampling_params.logprobs_mode",
                f"{VLLM_LOGPROBS_MODE!r} (the mode the vLLM server was started with)",
                mode,
            )
        for key in params:
            if key not in SAMPLING_KEYS:
                raise RequestValidationError(
                    f"$.sampling_params.{key}", f"one of the keys {list(SAMPLING_KEYS)}", key
                )
        start = params.get("routed_experts_prompt_start", 0)
        if type(start) is not int:
            raise RequestValidationError(
                "$.sampling_params.routed_experts_prompt_start", "an int", start
            )
        params.setdefault("max_tokens", SERVER_DEFAULT_MAX_TOKENS)
        if self.eos_token_ids and not params.get("ignore_eos"):
            stops = list(params.get("stop_token_ids") or ())
            params["stop_token_ids"] = stops + [i for i in self.eos_token_ids if i not in stops]
        ids = (
            prompt_token_ids.tolist()
            if isinstance(prompt_token_ids, np.ndarray)
            else list(prompt_token_ids)
        )
        payload: dict[str, Any] = {
            "token_ids": ids,
            "sampling_params": {**params, "logprobs": 0, "detokenize": False},
        }
        if self._model is not None:
            payload["model"] = self._model
        body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)

        shape = self.route_shape
        if return_routed_experts and shape is None and self.max_reply_bytes is None:
            raise ValueError(
                "route_shape: expected a RouteShape (layers, top_k, experts) to request "
                "routes from vLLM, which does not report them, got None"
            )
        prompt_route_rows = len(ids) - start - 1
        want_routes = bool(return_routed_experts)

        def parse(raw: bytes) -> GenerateResult:
            try:
                # Spliced whether or not routes were asked for: a capturing server
                # sends them anyway, and a plain parse would build their huge str.
                doc = load_packed_body(raw, fields=(NpyField.ROUTED_EXPERTS,))
            except WireError as exc:
                loads_or_retry(raw, 200)  # not JSON at all: a broken hop, retried
                raise as_protocol_error(exc) from exc
            return parse_vllm_reply(
                doc,
                want_routes=want_routes,
                prompt_route_rows=prompt_route_rows,
                route_dims=None if shape is None else (shape.num_layers, shape.top_k),
            )

        cap = self.max_reply_bytes
        if cap is None:
            cap = generate_reply_cap(
                max_tokens=positive_int(params.get("max_tokens")) or SERVER_DEFAULT_MAX_TOKENS,
                prompt_route_rows=max(prompt_route_rows, 0),
                # Whenever known: a capturing server sends routes with every reply.
                route_shape=shape,
                token_json_bytes=VLLM_TOKEN_JSON_BYTES,
            )
        return await self._post(
            GENERATE_PATH, body, parse, content_type="application/json", max_reply_bytes=cap
        )

    async def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        *,
        policy_version: int | None = None,
        commit: bool = True,
    ) -> int:
        """Send one bucket of engine-layout tensors (HF names, as the builtin server
        takes them); returns how many it held. ``commit=False`` keeps the push open (the
        server stays paused) for the next bucket; ``commit=True`` ends it, naming
        ``policy_version`` (None: the server keeps its version label). See
        ``inference.vllm.push`` for the calls, retries and failure handling."""
        # Imported here, as in RemoteGenerateClient: the generate path stays torch-free.
        from inference.engine.base import check_policy_version

        check_policy_version(policy_version, field="policy_version", optional=True)
        await self._push.bucket(
            dict(to_vllm_layout(self.family, named_tensors.items())),
            policy_version=policy_version,
            commit=commit,
        )
        return len(named_tensors)

    async def health(self) -> dict[str, Any]:
        """``{"status": "ok", "models": [...], "max_model_len": n, "weight_version":
        label or None, "policy_version": int or None}`` from ``/health`` (empty when
        healthy), ``/v1/models`` and ``/weight_info`` (absent without dev mode)."""
        await self._request(
            "GET", HEALTH_PATH, None, _ignore, content_type=None, max_reply_bytes=SMALL_REPLY_BYTES
        )
        models = await self._request(
            "GET", MODELS_PATH, None, _models, content_type=None, max_reply_bytes=SMALL_REPLY_BYTES
        )
        try:
            label = await self._request(
                "GET",
                WEIGHT_INFO_PATH,
                None,
                _weight_version,
                content_type=None,
                max_reply_bytes=SMALL_REPLY_BYTES,
            )
        except GenerateHTTPError as exc:
            if exc.status != 404:
                raise
            label = None
        return {
            "status": "ok",
            "models": [card["id"] for card in models],
            "max_model_len": models[0].get("max_model_len") if models else None,
            "weight_version": label,
            "policy_version": (
                None if label is None else policy_version_of(label, path="$.weight_version")
            ),
        }

    async def _control(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: str | None = None,
        idempotent: bool,
    ) -> None:
        """One RL API call; any 2xx is success (their bodies say only "ok" in words)."""
        await self._request(
            "POST",
            path,
            None if body is None else orjson.dumps(body),
            _ignore,
            content_type=None if body is None else "application/json",
            max_reply_bytes=SMALL_REPLY_BYTES,
            query=query,
            retry=self._control_retry if idempotent else self._control_once,
        )


def _ignore(raw: bytes) -> None:
    return None


def _models(raw: bytes) -> list[dict[str, Any]]:
    reply = loads_or_retry(raw, 200)
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list) or not all(
        isinstance(card, dict) and isinstance(card.get("id"), str) for card in data
    ):
        raise GenerateProtocolError("$.data", "a list of {id, ...} model cards", data)
    return data


def _weight_version(raw: bytes) -> str:
    reply = loads_or_retry(raw, 200)
    label = reply.get("weight_version") if isinstance(reply, dict) else None
    if not isinstance(label, str):
        raise GenerateProtocolError("$.weight_version", "a string", label)
    return label
