"""``VLLMClient``: the client interface of ``RemoteGenerateClient`` over a stock vLLM
server's token-in/token-out API (``/inference/v1/generate``) and RL API (weights).

Requests: our sampling keys map one to one onto vLLM's ``SamplingParams`` (top_k -1
means no cut in both); the client adds ``logprobs: 0`` (the sampled token's logprob,
as the server's ``--logprobs-mode processed_logprobs`` computes it) and
``detokenize: false``, and always sends ``max_tokens`` (vLLM would otherwise fill the
context). What vLLM cannot give is refused before anything is sent: sample support,
packed bodies, sessions, unknown sampling keys, a logprobs mode other than its
server's (``supported_logprobs_modes``).

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Unpack

import orjson

from inference.client.http import GenerateCall, HTTPClientBase, HTTPOptions
from inference.client.limits import SERVER_DEFAULT_MAX_TOKENS, SMALL_REPLY_BYTES, RouteShape
from inference.client.protocol import GenerateRequest, GenerateResult
from inference.client.replies import json_object
from inference.client.side_channels import load_reply
from inference.errors import GenerateHTTPError, GenerateProtocolError, RequestValidationError
from inference.vllm.layouts import to_vllm_layout
from inference.vllm.push import WeightPush
from inference.vllm.replies import parse_vllm_reply, policy_version_of
from inference.vllm.senders import BucketSender, FileBucketSender
from inference.vllm.spec import VLLM_LOGPROBS_MODE
from inference.wire import NpyField

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

    supported_logprobs_modes = (VLLM_LOGPROBS_MODE,)
    """vLLM fixes the mode per server (``--logprobs-mode``, which the launcher sets), not
    per request: a request may name that one, which is not forwarded."""
    supports_packed_body = False
    """vLLM sends token ids and logprobs as JSON lists only."""
    generate_path = GENERATE_PATH
    token_json_bytes = VLLM_TOKEN_JSON_BYTES

    def __init__(
        self,
        base_url: str,
        *,
        sender: BucketSender | None = None,
        weight_timeout_s: float = 300.0,
        eos_token_ids: Sequence[int] = (),
        family: str | None = None,
        **options: Unpack[HTTPOptions],
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
        super().__init__(base_url, **options)
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

    def _prepare(self, call: GenerateCall) -> Callable[[bytes], GenerateResult]:
        request, params = call.request, call.params
        support = request.return_sample_support
        if support is not False and support != 0:
            raise RequestValidationError(
                "return_sample_support",
                "False (vLLM's generate API returns no candidate ids or logprobs)",
                support,
            )
        if request.return_packed_body:
            raise RequestValidationError(
                "return_packed_body",
                "False (vLLM sends token ids and logprobs as JSON lists; see supports_packed_body)",
                request.return_packed_body,
            )
        if request.session_id is not None:
            raise RequestValidationError(
                "session_id", "None (vLLM's generate API has no sessions)", request.session_id
            )
        # The base checked it against supported_logprobs_modes; vLLM takes no such key
        # (its server fixes the mode with --logprobs-mode).
        params.pop("logprobs_mode", None)
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
        params.update(logprobs=0, detokenize=False)
        shape = self.route_shape
        if request.return_routed_experts and shape is None and self.max_reply_bytes is None:
            raise ValueError(
                "route_shape: expected a RouteShape (layers, top_k, experts) to request "
                "routes from vLLM, which does not report them, got None"
            )
        want_routes = bool(request.return_routed_experts)

        def parse(raw: bytes) -> GenerateResult:
            # Spliced whether or not routes were asked for: a capturing server sends
            # them anyway, and a plain parse would build their huge str.
            return parse_vllm_reply(
                load_reply(raw, fields=(NpyField.ROUTED_EXPERTS,)),
                want_routes=want_routes,
                prompt_route_rows=call.prompt_route_rows,
                route_dims=None if shape is None else (shape.num_layers, shape.top_k),
            )

        return parse

    async def _reply_route_shape(self, request: GenerateRequest) -> RouteShape | None:
        # Whenever known: a capturing server sends routes with every reply.
        return self.route_shape

    async def _update_weights(
        self, named_tensors: Mapping[str, Any], *, policy_version: int | None, commit: bool
    ) -> int:
        """HF names, as the builtin server takes them; returns how many it held.
        ``commit=False`` keeps the push open (the server stays paused) for the next
        bucket; ``commit=True`` ends it, naming ``policy_version`` (None: the server
        keeps its version label). See ``inference.vllm.push`` for the calls, retries and
        failure handling."""
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
        await self._get(HEALTH_PATH, _ignore)
        models = await self._get(MODELS_PATH, _models)
        try:
            label = await self._get(WEIGHT_INFO_PATH, _weight_version)
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
    data = json_object(raw).get("data")
    if not isinstance(data, list) or not all(
        isinstance(card, dict) and isinstance(card.get("id"), str) for card in data
    ):
        raise GenerateProtocolError("$.data", "a list of {id, ...} model cards", data)
    return data


def _weight_version(raw: bytes) -> str:
    label = json_object(raw).get("weight_version")
    if not isinstance(label, str):
        raise GenerateProtocolError("$.weight_version", "a string", label)
    return label
