"""The aiohttp application: routes, auth, size limits and the one error shape.

Routes
------
``POST /skyrl/v1/generate``
    ``Content-Type: application/json`` (a charset parameter, if any, utf-8).
    Request (JSON object; unknown keys are refused)::

        {"token_ids": [int, ...],                      # the prompt, required, >= 1 id
         "sampling_params": {"max_tokens": int,
                             "temperature": float,  # 0 (greedy) or in [1e-06, 100]
                             "top_p": float,
                             "top_k": int (-1 = off), "seed": int | null,
                             "stop_token_ids": [int, ...],
                             "routed_experts_prompt_start": int,    # used with routes
                             "logprobs_mode": "raw_logprobs" (default)
                                              | "processed_logprobs"},
         "return_routed_experts": bool,                # side channel: routes
         "return_sample_support": bool | int,          # side channel: true = default k
         "return_packed_body": bool,                   # ids and logprobs as envelopes
         "model": str | null, "session_id": str | null}

    Reply::

        {"model": str, "num_clamped_logprobs": int,
         "policy_version": int,   # the engine's version when this reply's batch ran
         "choices": [{"index": 0, "token_ids": [...], "finish_reason": "stop" | "length",
                      "logprobs": {"content": [{"logprob": x}, ...]},
                      "routed_experts": envelope | null,             # [P-s+G-1, L, K]
                      "rollout_sample_support": envelope | null,     # [G, k] int32
                      "rollout_sample_support_logprobs": envelope | null,  # [G, k]
                      "rollout_sample_support_size": envelope | null}]}    # [G] int32

    ``logprobs_mode`` picks what every reported logprob is: ``raw_logprobs``, log
    softmax of the model's logits; ``processed_logprobs``, log q of the distribution
    the token was drawn from (temperature, top-k, top-p; 0 for greedy; the definition
    is ``inference/engine/sampling.py``'s). The support lists each position's kept set,
    most likely first, -1 past it, with its logprobs in the same mode, and its size:
    above k, the listed ids are only the first k of the set.

    With ``return_packed_body`` the choice's ``token_ids`` and ``logprobs`` are null
    and ``packed_token_ids`` ([G] int32) and ``packed_logprobs`` ([G] float32) carry
    them as envelopes (docs/design.md §2). Logprobs that are missing or not finite are sent as
    -9999.0 and counted in ``num_clamped_logprobs`` (and in ``/health``).
``POST /inference/v1/generate``
    The same without side channels: a ``return_*`` key that asks for one is refused
    (false is accepted), and the choice carries only ``token_ids``, ``finish_reason``,
    ``logprobs``. Both routes' replies carry ``policy_version``: a whole batch runs
    under one version, so a reply never comes from half-updated weights.
``POST /skyrl/v1/update_weights``
    ``Content-Type: application/octet-stream``. Body: a safetensors file of named
    tensors in the engine's layout, any subset of its parameters, each once, with the
    engine's shape and dtype F16, BF16 or F32. The body may be at most the model's
    size as F32 plus a header (413 on a larger Content-Length, before reading it). The
    header is checked whole before any tensor data is read, every value must be finite
    in the engine's dtype, and uploads load one at a time, all or nothing: on any 4xx
    the old weights keep serving. Headers ``X-Policy-Version: <int >= 0>`` (the version
    the weights become; lower than the current one: 409) and ``X-Weight-Commit: true |
    false`` (default true; false stages the upload until a commit loads everything staged
    in one step) let one push span several uploads atomically; without them an upload
    loads at once and the version is unchanged. Reply ``{"num_loaded": int,
    "num_staged": int, "policy_version": int | null}``. Details:
    ``inference.server.weights_upload``.
``GET /health``
    ``{"status": "ok", "model", "policy_version": int | null, "engine": {...},
    "limits": {"max_new_tokens", "max_model_len", "max_sample_support_k",
    "default_sample_support_k"}, "counters": {...}}``; needs no token.

Every error is ``{"error": {"message", "type", "field"?}}`` with a 4xx/5xx status; a
request that fails validation names its field (expected, got) and the server keeps
serving. A missing or wrong Content-Type is a 415; a 405 carries ``Allow``. With an
``api_key`` every route but ``/health`` needs ``Authorization: Bearer <key>``, and any
other value (not UTF-8, control bytes, a header line the parser refuses) is a 401; a host
other than loopback needs an ``api_key``. Connections: idle ones close after
``keepalive_timeout_s``; a request's headers and body must arrive within
``request_read_timeout_s`` of its first byte (a slow body gets a 408, slow headers a
closed connection); past ``max_connections`` a connection gets a 503 and is closed
(``inference.server.connections``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import hdrs, web

from inference.engine.base import InferenceEngine
from inference.errors import InferenceError, RequestValidationError
from inference.server.auth import BearerToken, unauthorized
from inference.server.config import ServerConfig
from inference.server.connections import clock_of, read_before, read_deadline
from inference.server.render import render_generate_reply
from inference.server.validation import (
    RequestLimits,
    check_content_type,
    parse_generate_request,
)
from inference.server.weight_versions import StagedWeights, engine_policy_version
from inference.server.weights_upload import receive_weights

__all__ = [
    "ServerConfig",
    "ServerCounters",
    "build_app",
    "error_response",
    "refuse_malformed_request",
]

logger = logging.getLogger(__name__)

SKYRL_GENERATE = "/skyrl/v1/generate"
PLAIN_GENERATE = "/inference/v1/generate"
UPDATE_WEIGHTS = "/skyrl/v1/update_weights"
HEALTH = "/health"
HEALTH_LIMITS = (
    "max_new_tokens",
    "max_model_len",
    "max_sample_support_k",
    "default_sample_support_k",
)
"""The ``RequestLimits`` fields ``/health`` reports under ``limits``."""


@dataclass
class ServerCounters:
    requests: int = 0
    rejected: int = 0
    """Requests answered with a 4xx."""
    failed: int = 0
    """Requests answered with a 5xx."""
    clamped_logprobs: int = 0
    weight_updates: int = 0
    in_flight: int = 0
    """Generate requests accepted and not yet answered."""


_ENGINE = web.AppKey("engine", InferenceEngine)
_CONFIG = web.AppKey("config", ServerConfig)
_LIMITS = web.AppKey("limits", RequestLimits)
_COUNTERS = web.AppKey("counters", ServerCounters)
_WEIGHT_LOCK = web.AppKey("weight_lock", asyncio.Lock)
_STAGED = web.AppKey("staged_weights", StagedWeights)


def build_app(engine: InferenceEngine, config: ServerConfig) -> web.Application:
    """The application serving ``engine``; the engine is closed on app cleanup."""
    info = engine.info
    limits = RequestLimits(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_model_len=config.max_model_len,
        max_new_tokens=config.max_new_tokens,
        max_sample_support_k=config.max_sample_support_k,
        default_sample_support_k=config.default_sample_support_k,
    )
    counters = ServerCounters()
    app = web.Application(
        middlewares=[
            _clock_middleware,
            _error_middleware(counters),
            _auth_middleware(config.api_key),
        ],
        # Only request.read() would use it; bodies are read by the handlers' own
        # bounded readers (generate: max_request_bytes, weights: the model's size).
        client_max_size=config.max_request_bytes,
    )
    app[_ENGINE] = engine
    app[_CONFIG] = config
    app[_LIMITS] = limits
    app[_COUNTERS] = counters
    app[_WEIGHT_LOCK] = asyncio.Lock()
    app[_STAGED] = StagedWeights()
    app.router.add_post(SKYRL_GENERATE, _generate_handler(allow_side_channels=True))
    app.router.add_post(PLAIN_GENERATE, _generate_handler(allow_side_channels=False))
    app.router.add_post(UPDATE_WEIGHTS, _update_weights)
    app.router.add_get(HEALTH, _health)
    app.on_cleanup.append(_close_engine)
    return app


async def _close_engine(app: web.Application) -> None:
    await app[_ENGINE].close()


class Overloaded(InferenceError):
    """``max_pending_requests`` generate requests are in flight; answered with 503."""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# aiohttp's exceptions carry their own body headers; the JSON body replaces those.
_BODY_HEADERS = frozenset(
    h.lower() for h in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH, hdrs.CONTENT_ENCODING)
)


def error_response(
    status: int, message: str, error_type: str, *, field: str | None = None
) -> web.Response:
    error: dict[str, Any] = {"message": message, "type": error_type}
    if field is not None:
        error["field"] = field
    return web.Response(
        status=status, body=orjson.dumps({"error": error}), content_type="application/json"
    )


@web.middleware
async def _clock_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Hands the connection's header clock to the app for the request's lifetime."""
    clock = clock_of(request)
    if clock is None:
        return await handler(request)
    clock.begin_request()
    try:
        return await handler(request)
    finally:
        clock.end_request()


def _error_middleware(counters: ServerCounters) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        counters.requests += 1
        try:
            return await handler(request)
        except RequestValidationError as exc:
            counters.rejected += 1
            # The 4xx body keeps its "field" key (the documented HTTP format) for ``.path``.
            response = error_response(exc.status, str(exc), type(exc).__name__, field=exc.path)
            if exc.status in (408, 413):
                response.force_close()  # the rest of that body is not worth reading
            return response
        except Overloaded as exc:
            counters.failed += 1
            response = error_response(503, f"server overloaded: {exc}", "Overloaded")
            response.headers["Retry-After"] = str(request.app[_CONFIG].retry_after_s)
            return response
        except web.HTTPException as exc:  # aiohttp's own 404 / 405 / 413
            if exc.status < 400:
                raise
            counters.rejected += exc.status < 500
            response = error_response(exc.status, exc.text or exc.reason, type(exc).__name__)
            for name, value in exc.headers.items():  # 405's Allow, for one
                if name.lower() not in _BODY_HEADERS:
                    response.headers[name] = value
            return response
        except Exception as exc:
            counters.failed += 1
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    return middleware


def _auth_middleware(api_key: str | None) -> Any:
    token = BearerToken(api_key) if api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and request.path != HEALTH:
            if not token.accepts(request.headers.get(hdrs.AUTHORIZATION)):
                raise unauthorized("a missing or wrong token")
        return await handler(request)

    return middleware


def refuse_malformed_request(parse_error: str, *, needs_token: bool) -> web.Response:
    """The reply to a request whose head the HTTP parser refused (``parse_error`` names
    the parser's exception class); such a request reaches no middleware
    (``inference.server.connections``). A server with an ``api_key`` answers it 401, as it
    would any request without a valid token: it cannot carry one."""
    if needs_token:
        exc = unauthorized(f"a request head the HTTP parser refused ({parse_error})")
    else:
        exc = RequestValidationError(
            "request", "a well-formed HTTP/1.1 request head", f"one refused ({parse_error})"
        )
    return error_response(exc.status, str(exc), type(exc).__name__, field=exc.path)


async def read_limited(request: web.Request, limit: int) -> bytes:
    """The body, refusing with 413 as soon as it exceeds ``limit`` bytes, and with 408
    when it has not all arrived by the request's read deadline."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestValidationError(
            "body", f"at most {limit} bytes", f"{declared} bytes", status=413
        )

    async def read() -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise RequestValidationError(
                    "body", f"at most {limit} bytes", f"more than {limit} bytes", status=413
                )
            chunks.append(chunk)
        return b"".join(chunks)

    timeout_s = request.app[_CONFIG].request_read_timeout_s
    return await read_before(read(), read_deadline(request, timeout_s))


def _generate_handler(*, allow_side_channels: bool) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        app = request.app
        check_content_type(request.headers.get(hdrs.CONTENT_TYPE), "application/json")
        raw = await read_limited(request, app[_CONFIG].max_request_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RequestValidationError("body", "a JSON document", str(exc)) from None
        engine_request = parse_generate_request(
            body, app[_LIMITS], allow_side_channels=allow_side_channels
        )
        # Each request goes to the engine on its own: the engine batches concurrent
        # callers itself (the CPU engine within a 5 ms window, vLLM continuously).
        counters = app[_COUNTERS]
        if counters.in_flight >= app[_CONFIG].max_pending_requests:
            raise Overloaded(f"{counters.in_flight} generate requests are in flight")
        counters.in_flight += 1
        try:
            (output,) = await app[_ENGINE].generate([engine_request])
        finally:
            counters.in_flight -= 1
        reply, clamped = render_generate_reply(
            output,
            engine_request,
            model=app[_LIMITS].model_name,
            side_channels=allow_side_channels,
            packed_body=body.get("return_packed_body", False),
        )
        app[_COUNTERS].clamped_logprobs += clamped
        return web.Response(body=reply, content_type="application/json")

    return handler


async def _update_weights(request: web.Request) -> web.Response:
    app = request.app
    try:
        outcome = await receive_weights(
            request,
            app[_ENGINE],
            lock=app[_WEIGHT_LOCK],
            staged=app[_STAGED],
            header_deadline=read_deadline(request, app[_CONFIG].request_read_timeout_s),
            data_timeout_s=app[_CONFIG].weight_read_timeout_s,
        )
    except RequestValidationError:
        raise
    except (KeyError, ValueError) as exc:
        # Another engine's own refusal; its message names the tensor, so it is quoted
        # whole (a truncated "got" would cut off exactly that name).
        app[_COUNTERS].rejected += 1
        return error_response(400, f"body: {exc}", "WeightUpdateError")
    if outcome.num_loaded:
        app[_COUNTERS].weight_updates += 1  # a staged upload changes nothing yet
    return web.Response(
        body=orjson.dumps(dataclasses.asdict(outcome)), content_type="application/json"
    )


async def _health(request: web.Request) -> web.Response:
    app = request.app
    limits = app[_LIMITS]
    document = {
        "status": "ok",
        "model": limits.model_name,
        "policy_version": engine_policy_version(app[_ENGINE]),
        "engine": dataclasses.asdict(app[_ENGINE].info),
        # What a request may ask for: a trainer's launch reads max_sample_support_k to
        # refuse, before Ray starts, a top-k / top-p cut every request would be refused
        # for (skyrl_train/config/remote_servers.py).
        "limits": {name: getattr(limits, name) for name in HEALTH_LIMITS},
        "counters": dataclasses.asdict(app[_COUNTERS]),
    }
    return web.Response(body=orjson.dumps(document), content_type="application/json")
