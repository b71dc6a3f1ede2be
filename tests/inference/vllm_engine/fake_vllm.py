"""A fake vLLM server on 127.0.0.1 (aiohttp) answering in vLLM 0.32's exact formats.

Formats taken from vLLM's source (``entrypoints/scale_out/token_in_token_out`` and
``entrypoints/rl/online/api_router.py``) and pinned against vLLM's own rendering by
``test_fake_replies_match_vllms_own_rendering`` when vLLM is installed:

- ``POST /inference/v1/generate``: ``GenerateTokensResponse.model_dump()`` through
  starlette's ``JSONResponse`` (compact separators, that key order); routes as base64
  ``.npy``; ``weight_versions`` spans over output tokens; errors as
  ``{"error": {"message", "type", "param", "code"}}``;
- the RL API: ``/pause`` -> ``{"status": "paused"}``, ``/resume`` -> ``{"status":
  "resumed"}``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``
  -> ``{"message": ...}``; a worker-side failure is FastAPI's plain 500;
- ``GET /health``: an empty 200; ``/v1/models``; ``/weight_info``.

Every request is recorded (method, path, query, JSON body) so tests assert exact call
sequences and attempt counts; ``faults[path]`` scripts what attempt i of a path gets.
Generation is deterministic: token i of a reply is ``(sum(prompt) + i) % 50 + 1`` (a
sampled request adds its seed), tagged with the weight version current when it is made;
a request can be held after some tokens (``hold_after``) so a push lands inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from inference.wire.npy import encode_npy

Fault = Callable[[web.Request], Awaitable[web.StreamResponse]]

MODEL = "m"
MAX_MODEL_LEN = 4096


def choice_json(
    *,
    token_ids: list[int],
    finish_reason: str,
    logprobs: list[tuple[int, float, int | None]] | None,
    routed_experts: str | None = None,
    weight_versions: list[tuple[str, int, int]] | None = None,
) -> dict[str, Any]:
    """One ``GenerateTokensChoice.model_dump()`` (its field order: base class first)."""
    content = None
    if logprobs is not None:
        content = {
            "content": [
                {
                    "token_id": t,
                    "logprob": lp,
                    "rank": rank,
                    "top_logprobs": []
                    if rank is None
                    else [{"token_id": t, "logprob": lp, "rank": rank}],
                }
                for t, lp, rank in logprobs
            ]
        }
    return {
        "index": 0,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": token_ids,
        "routed_experts": routed_experts,
        "sampling_mask": None,
        "weight_versions": None
        if weight_versions is None
        else [{"version": v, "start": s, "end": e} for v, s, e in weight_versions],
        "logprobs": content,
    }


def reply_json(choice: dict[str, Any], *, request_id: str = "r", created: int = 1) -> bytes:
    """A ``GenerateTokensResponse`` as vLLM's server writes it."""
    body = {
        "request_id": request_id,
        "model": MODEL,
        "created": created,
        "usage": None,
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice],
    }
    # starlette's JSONResponse.render
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def error_json(message: str, *, code: int = 400) -> web.Response:
    """vLLM's ``ErrorResponse`` for a bad generate request."""
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}
    return web.json_response(body, status=code)


def internal_error() -> web.Response:
    """FastAPI's answer to an exception inside an RL route (vLLM's collective_rpc)."""
    return web.Response(status=500, text="Internal Server Error", content_type="text/plain")


@dataclass(frozen=True)
class AfterHandling:
    """A fault that answers only after the normal handler has acted on the request
    (``AfterHandling(drop_connection)``: the server did it, the client never hears)."""

    fault: Fault


@dataclass
class Hit:
    method: str
    path: str
    query: str
    body: Any


@dataclass
class FakeVLLM:
    """State and behaviour; ``url`` is set once serving."""

    url: str = ""
    hits: list[Hit] = field(default_factory=list)
    faults: dict[str, list[Fault | AfterHandling | None]] = field(default_factory=dict)
    """path -> what attempt i gets (None: the normal answer); the last entry repeats."""
    routes: tuple[int, int, str] | None = None
    """(layers, top_k, dtype): send routes with every reply, as a capturing server does."""
    route_rows_override: int | None = None
    reply_override: Callable[[dict[str, Any]], bytes] | None = None
    version: str = "default"
    paused: bool = False
    started: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    hold_after: int | None = None
    held: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    loaded: list[list[str]] = field(default_factory=list)
    """Tensor names per applied bucket."""
    bucket_files: list[str] = field(default_factory=list)
    bucket_modes: list[int] = field(default_factory=list)
    """Permission bits of each bucket file when the server read it."""
    update_mode: str = "file"
    """"file": update_info names a safetensors file; "nccl": names/dtype_names/shapes."""
    nccl_update: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    nccl_init: Callable[[dict[str, Any]], Awaitable[None]] | None = None

    def calls(
        self, *, skip: tuple[str, ...] = ("/health", "/v1/models", "/weight_info")
    ) -> list[str]:
        """Paths of the requests so far (with the query when there is one)."""
        return [
            h.path + (f"?{h.query}" if h.query else "") for h in self.hits if h.path not in skip
        ]

    def count(self, path: str) -> int:
        return sum(h.path == path for h in self.hits)

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/inference/v1/generate", self._wrap(self.generate))
        for path, handler in (
            ("/pause", self.pause),
            ("/resume", self.resume),
            ("/start_weight_update", self.start),
            ("/update_weights", self.update),
            ("/finish_weight_update", self.finish),
            ("/init_weight_transfer_engine", self.init),
        ):
            app.router.add_post(path, self._wrap(handler))
        app.router.add_get("/health", self._wrap(self.health))
        app.router.add_get("/v1/models", self._wrap(self.models))
        app.router.add_get("/weight_info", self._wrap(self.weight_info))
        return app

    def _wrap(self, handler: Callable[[web.Request, Any], Awaitable[web.StreamResponse]]) -> Any:
        async def run(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            body = json.loads(raw) if raw else None
            self.hits.append(Hit(request.method, request.path, request.query_string, body))
            script = self.faults.get(request.path)
            if script:
                attempt = sum(h.path == request.path for h in self.hits)
                fault = script[min(attempt, len(script)) - 1]
                if isinstance(fault, AfterHandling):
                    await handler(request, body)  # the server acts, then the reply is lost
                    return await fault.fault(request)
                if fault is not None:
                    return await fault(request)
            return await handler(request, body)

        return run

    # ---- generate ---------------------------------------------------------------------

    async def generate(self, request: web.Request, body: Any) -> web.StreamResponse:
        params = body["sampling_params"]
        prompt = body["token_ids"]
        if self.reply_override is not None:
            return web.Response(body=self.reply_override(body), content_type="application/json")
        if params.get("max_tokens", 0) > 64:
            return error_json("max_tokens is too large for this test server")
        sampled = params.get("temperature", 1.0) != 0
        base = sum(prompt) + ((params.get("seed") or 0) if sampled else 0)
        tokens: list[int] = []
        labels: list[str] = []
        stops = set(params.get("stop_token_ids") or [])
        finish = "length"
        for i in range(params["max_tokens"]):
            if self.hold_after is not None and i == self.hold_after:
                self.held.set()
                await self.release.wait()
            while self.paused:  # mode=keep: frozen until /resume
                self.resumed.clear()
                await self.resumed.wait()
            token = (base + i) % 50 + 1
            tokens.append(token)
            labels.append(self.version)
            if token in stops:
                finish = "stop"
                break
        spans: list[tuple[str, int, int]] = []
        for i, label in enumerate(labels):
            if spans and spans[-1][0] == label:
                spans[-1] = (label, spans[-1][1], i + 1)
            else:
                spans.append((label, i, i + 1))
        logprobs = [(t, -0.25 * (1 + i % 3), 1) for i, t in enumerate(tokens)]
        routes = None
        if self.routes is not None:
            layers, top_k, dtype = self.routes
            start = params.get("routed_experts_prompt_start", 0)
            rows = len(prompt) - start + len(tokens) - 1
            if self.route_rows_override is not None:
                rows = self.route_rows_override
            ids = (np.arange(rows * layers * top_k) % 7).reshape(rows, layers, top_k)
            routes = encode_npy(ids.astype(dtype))
        choice = choice_json(
            token_ids=tokens,
            finish_reason=finish,
            logprobs=logprobs if params.get("logprobs") is not None else None,
            routed_experts=routes,
            weight_versions=spans,
        )
        return web.Response(body=reply_json(choice), content_type="application/json")

    # ---- RL API -----------------------------------------------------------------------

    async def pause(self, request: web.Request, body: Any) -> web.StreamResponse:
        if request.query.get("mode", "abort") not in ("abort", "wait", "keep"):
            return web.json_response({"error": "Invalid pause mode"}, status=400)
        self.paused = True
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request, body: Any) -> web.StreamResponse:
        self.paused = False
        self.resumed.set()
        return web.json_response({"status": "resumed"})

    async def start(self, request: web.Request, body: Any) -> web.StreamResponse:
        if (
            self.started
        ):  # vLLM: "start_weight_update called while a weight update is already active"
            return internal_error()
        self.started = True
        return web.json_response({"message": "Weight update started"})

    async def update(self, request: web.Request, body: Any) -> web.StreamResponse:
        if not self.started:
            return internal_error()
        info = body["update_info"]
        if self.update_mode == "nccl":
            assert self.nccl_update is not None
            await self.nccl_update(info)
            self.loaded.append(list(info["names"]))
            return web.json_response({"message": "Weights updated"})
        from safetensors.torch import load_file

        path = info["path"]
        self.bucket_files.append(path)
        try:
            self.bucket_modes.append(stat.S_IMODE(os.stat(path).st_mode))
            tensors = load_file(path)
        except Exception:
            self.started = False  # vLLM's worker ends the session on a failed update
            return internal_error()
        self.loaded.append(sorted(tensors))
        return web.json_response({"message": "Weights updated"})

    async def finish(self, request: web.Request, body: Any) -> web.StreamResponse:
        if not self.started:
            return internal_error()
        self.started = False
        if body is not None and body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return web.json_response({"message": "Weight update finished"})

    async def init(self, request: web.Request, body: Any) -> web.StreamResponse:
        assert self.nccl_init is not None
        await self.nccl_init(body["init_info"])
        return web.json_response({"message": "Weight transfer initialized"})

    # ---- info -------------------------------------------------------------------------

    async def health(self, request: web.Request, body: Any) -> web.StreamResponse:
        return web.Response(status=200)

    async def models(self, request: web.Request, body: Any) -> web.StreamResponse:
        card = {
            "id": MODEL,
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": "/ckpt",
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def weight_info(self, request: web.Request, body: Any) -> web.StreamResponse:
        return web.json_response({"weight_version": self.version})


@contextlib.asynccontextmanager
async def fake_vllm(**state: Any) -> AsyncIterator[FakeVLLM]:
    fake = FakeVLLM(**state)
    runner = web.AppRunner(fake.make_app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    fake.url = f"http://{host}:{port}"
    try:
        yield fake
    finally:
        fake.release.set()
        fake.resumed.set()
        await runner.cleanup()


# ---- faults ---------------------------------------------------------------------------


async def drop_connection(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.abort()  # no status line at all: "server disconnected"
    return web.Response()


async def html_502(request: web.Request) -> web.StreamResponse:
    return web.Response(status=502, text="<html>bad gateway</html>", content_type="text/html")


def reply_with(status: int, body: Any) -> Fault:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    return answer
