"""Weight uploads: the safetensors header is checked whole before any data is read,
poisoned tensors are refused with the old weights still serving, uploads never
interleave, and a valid upload still round-trips."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import torch
from safetensors.torch import save

from inference.engine.hf_engine import HFMoEEngine
from inference.engine.weights import parameter_shapes
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from inference.server import ServerConfig, start_server
from inference.server.weights_upload import _tensor, parse_header, upload_caps

UPLOAD = "/skyrl/v1/update_weights"
GEN = "/skyrl/v1/generate"
OCTETS = {"Content-Type": "application/octet-stream"}
GREEDY = {
    "token_ids": [72, 101, 108, 108, 111],
    "sampling_params": {"max_tokens": 6, "temperature": 0},
}
HEAD = "lm_head.weight"  # [264, 64]
GATE = "model.layers.0.mlp.gate.weight"  # [8, 64]
NORM = "model.norm.weight"  # [64]


def with_length(raw_header: bytes) -> bytes:
    return struct.pack("<Q", len(raw_header)) + raw_header


def safetensors_body(header: Any, data: bytes = b"") -> bytes:
    return with_length(json.dumps(header).encode()) + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def gate_and_norm(**changes: dict[str, Any]) -> bytes:
    """A valid two-tensor F32 body (gate, then norm); ``changes`` replace entries."""
    header = {GATE: entry("F32", [8, 64], 0, 2048), NORM: entry("F32", [64], 2048, 2304)}
    header.update(changes)
    return safetensors_body(header, bytes(2304))


VALID_SIZE = len(gate_and_norm())


async def chunks(body: bytes, *, pieces: int = 3) -> AsyncIterator[bytes]:
    """The body as a chunked upload (no Content-Length)."""
    step = max(1, len(body) // pieces)
    for low in range(0, len(body), step):
        yield body[low : low + step]


async def post(
    session: aiohttp.ClientSession, url: str, data: Any, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with session.post(url, data=data, headers=headers) as response:
        return response.status, orjson.loads(await response.read())


def headers_for(live_server, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {live_server.api_key}", **OCTETS, **(extra or {})}


def greedy_tokens(session: aiohttp.ClientSession, live_server) -> Any:
    async def go() -> list[int]:
        headers = {"Authorization": f"Bearer {live_server.api_key}"}
        async with session.post(live_server.url + GEN, json=GREEDY, headers=headers) as r:
            assert r.status == 200
            return orjson.loads(await r.read())["choices"][0]["token_ids"]

    return go()


def upload_then_generate(live_server, data: Any, extra: dict[str, str] | None = None):
    """(status, error, tokens before, tokens after) for one upload on the live server."""

    async def main():
        async with aiohttp.ClientSession() as session:
            before = await greedy_tokens(session, live_server)
            status, reply = await post(
                session, live_server.url + UPLOAD, data, headers_for(live_server, extra)
            )
            after = await greedy_tokens(session, live_server)
            return status, reply, before, after

    return asyncio.run(main())


def test_poisoned_upload_is_refused_by_name_and_the_old_weights_keep_serving(live_server) -> None:
    # Valid tensors that would change the output, listed before and after the bad one.
    poisoned = torch.zeros(8, 64)
    poisoned[3, 17] = float("nan")
    body = save(
        {
            HEAD: torch.zeros(264, 64),
            GATE: poisoned,
            NORM: torch.full((64,), 3.0),
            "model.embed_tokens.weight": torch.zeros(264, 64, dtype=torch.bfloat16),
        }
    )
    status, reply, before, after = upload_then_generate(live_server, body)
    assert status == 400, reply
    assert reply["error"]["field"] == f"{GATE}[3, 17]"
    assert reply["error"]["message"] == (
        f"{GATE}[3, 17]: expected a finite value in bfloat16 (the engine's dtype), got nan"
    )
    assert after == before  # nothing was copied: the zero head would give other tokens


def test_infinite_value_is_refused_too(live_server) -> None:
    status, reply, before, after = upload_then_generate(
        live_server, save({NORM: torch.full((64,), float("-inf"))})
    )
    assert status == 400 and reply["error"]["field"] == f"{NORM}[0]"
    assert after == before


# (id, body, text the message must contain); each is a 400 before data is used.
HEADER_CASES: list[tuple[str, bytes, str]] = [
    (
        "unknown-name",
        safetensors_body({"lm_head.weightz": entry("F32", [264, 64], 0, 67584)}, bytes(67584)),
        "body.header: expected names of engine parameters such as 'model.embed_tokens.weight', "
        "got 'lm_head.weightz'",
    ),
    (
        "wrong-shape",
        gate_and_norm(**{GATE: entry("F32", [8, 65], 0, 2048)}),
        f'body.header["{GATE}"].shape: expected [8, 64], got [8, 65]',
    ),
    (
        "integer-dtype",
        gate_and_norm(**{GATE: entry("I64", [8, 64], 0, 2048)}),
        f"body.header[\"{GATE}\"].dtype: expected a floating dtype, one of ['BF16', 'F16', "
        "'F32'], got 'I64'",
    ),
    (
        "f64-dtype",
        gate_and_norm(**{NORM: entry("F64", [64], 2048, 2560)}),
        f'body.header["{NORM}"].dtype',
    ),
    (
        "overlapping-offsets",
        gate_and_norm(**{NORM: entry("F32", [64], 2000, 2256)}),
        f'body.header["{NORM}"].data_offsets: expected to start at 2048, where '
        f"'{GATE}' ends (contiguous, no overlap), got [2000, 2256]",
    ),
    (
        "gap-before-first",
        gate_and_norm(
            **{GATE: entry("F32", [8, 64], 8, 2056), NORM: entry("F32", [64], 2056, 2312)}
        ),
        f'body.header["{GATE}"].data_offsets: expected to start at 0',
    ),
    (
        "offsets-not-dtype-size",
        gate_and_norm(**{NORM: entry("F32", [64], 2048, 2300)}),
        f'body.header["{NORM}"].data_offsets: expected [begin, begin + 256] (64 x 4-byte F32)',
    ),
    (
        "negative-offsets",
        gate_and_norm(**{NORM: entry("F32", [64], -256, 0)}),
        f'body.header["{NORM}"].data_offsets',
    ),
    (
        "out-of-bounds-offsets",  # the header claims more data than the body holds
        gate_and_norm()[:-256],
        f"Content-Length: expected {VALID_SIZE} (8 + a {VALID_SIZE - 2312}-byte header + "
        f"2304 bytes of data), got {VALID_SIZE - 256}",
    ),
    (
        "duplicate-name",
        with_length(
            f'{{"{NORM}":{{"dtype":"F32","shape":[64],"data_offsets":[0,256]}},'
            f'"{NORM}":{{"dtype":"F32","shape":[64],"data_offsets":[0,256]}}}}'.encode()
        )
        + bytes(256),
        f"body.header[\"{NORM}\"]: expected each key once, got 'a repeat'",
    ),
    ("not-json", with_length(b"{oops") + bytes(16), "body.header: expected a UTF-8 JSON"),
    ("not-utf8", with_length(b'{"\xff": 1}'), "body.header: expected a UTF-8 JSON"),
    ("not-an-object", safetensors_body([1, 2]), "body.header: expected a JSON object"),
    ("no-tensors", safetensors_body({}), "body.header: expected at least one tensor"),
    (
        "metadata-not-strings",
        safetensors_body(
            {"__metadata__": {"step": 3}, NORM: entry("F32", [64], 0, 256)}, bytes(256)
        ),
        "body.header.__metadata__: expected an object of strings",
    ),
    (
        "oversized-header-length",
        struct.pack("<Q", 512 * 1024 * 1024) + b"{}",
        "body.header_length: expected an int in [2, ",
    ),
    ("tiny-header-length", struct.pack("<Q", 1) + b"{", "body.header_length"),
    ("shorter-than-the-length", b"\x01\x02\x03", "body: expected a safetensors file"),
    ("trailing-bytes", gate_and_norm() + b"extra", f"Content-Length: expected {VALID_SIZE} (8 + a"),
]


@pytest.mark.parametrize(
    ("body", "text"), [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES]
)
def test_bad_header_is_a_400_naming_the_tensor_or_field(
    live_server, body: bytes, text: str
) -> None:
    status, reply, before, after = upload_then_generate(live_server, body)
    assert status == 400, reply
    assert text in reply["error"]["message"], reply["error"]["message"]
    assert reply["error"]["message"].startswith(reply["error"]["field"] + ": expected")
    assert after == before


@pytest.mark.parametrize(
    ("body", "text"),
    [
        # Without a Content-Length the server only learns of a short body at its end.
        (
            gate_and_norm()[:-100],
            f'body.header["{NORM}"].data_offsets: expected [2048, 2304] inside',
        ),
        (gate_and_norm()[:-300], f'body.header["{GATE}"].data_offsets: expected [0, 2048] inside'),
        (
            gate_and_norm() + b"extra",
            f"body: expected the end of the body after {VALID_SIZE} bytes",
        ),
        (b"\x00garbage" * 3, "body.header_length"),
    ],
    ids=["truncated-in-last", "truncated-in-first", "trailing-bytes", "garbage"],
)
def test_chunked_upload_refuses_truncated_and_trailing_bodies(
    live_server, body: bytes, text: str
) -> None:
    status, reply, before, after = upload_then_generate(live_server, chunks(body))
    assert status == 400, reply
    assert text in reply["error"]["message"], reply["error"]["message"]
    assert after == before


def test_declared_body_over_the_model_size_is_a_413_before_reading(live_server) -> None:
    header_cap, body_cap = upload_caps(parameter_shapes(tiny_model()))
    # 478,912 parameters x 4 bytes (F32, the widest accepted) + 8 + the header cap.
    assert body_cap == 478912 * 4 + 8 + header_cap

    async def main():
        async with aiohttp.ClientSession() as session:
            sent = 0

            async def endless() -> AsyncIterator[bytes]:
                nonlocal sent
                while sent < 64 * 1024 * 1024:  # far more than the server will take
                    sent += 1 << 16
                    yield bytes(1 << 16)

            headers = headers_for(live_server, {"Content-Length": str(body_cap + 1)})
            try:
                status, reply = await post(session, live_server.url + UPLOAD, endless(), headers)
            except aiohttp.ClientError:  # the server may close while the client still writes
                status, reply = 413, None
            return status, reply, await greedy_tokens(session, live_server)

    status, reply, _ = asyncio.run(main())
    assert status == 413
    if reply is not None:
        assert reply["error"]["field"] == "Content-Length"
        assert f"expected at most {body_cap} bytes" in reply["error"]["message"]


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "text/plain", "multipart/form-data; boundary=x"]
)
def test_upload_needs_the_octet_stream_content_type(live_server, content_type: str | None) -> None:
    async def main():
        async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session:
            headers = {"Authorization": f"Bearer {live_server.api_key}"}
            if content_type is not None:
                headers["Content-Type"] = content_type
            return await post(session, live_server.url + UPLOAD, gate_and_norm(), headers)

    status, reply = asyncio.run(main())
    assert status == 415
    assert set(reply["error"]) == {"message", "type", "field"}
    assert reply["error"]["field"] == "Content-Type"
    assert reply["error"]["message"] == (
        f"Content-Type: expected application/octet-stream (a charset, if any, utf-8), "
        f"got {content_type!r}"
    )


def test_valid_upload_round_trips_in_any_float_dtype(live_server) -> None:
    original = tiny_model(seed=live_server.spec.seed).state_dict()

    async def main():
        async with aiohttp.ClientSession() as session:
            before = await greedy_tokens(session, live_server)
            url, headers = live_server.url + UPLOAD, headers_for(live_server)
            mixed = {  # one of each accepted dtype
                "model.layers.0.self_attn.q_norm.weight": torch.ones(16, dtype=torch.bfloat16),
                NORM: torch.full((64,), 0.5, dtype=torch.float16),
                HEAD: torch.zeros(264, 64),
            }
            loaded = await post(session, url, save(mixed), headers)
            changed = await greedy_tokens(session, live_server)
            restore = {name: original[name] for name in mixed}
            restored = await post(session, url, save(restore), headers)
            return before, loaded, changed, restored, await greedy_tokens(session, live_server)

    before, loaded, changed, restored, after = asyncio.run(main())
    unversioned = {"num_loaded": 3, "num_staged": 0, "policy_version": 0}
    assert loaded == (200, unversioned) and restored == (200, unversioned)
    assert changed != before and after == before


def test_parse_header_orders_entries_and_misaligned_tensors_are_copied_out() -> None:
    shapes = {"a": (3,), "b": (2,)}
    # An odd-length bf16 tensor first leaves the f32 one 2 bytes off alignment.
    header = {
        "__metadata__": {"k": "v"},
        "b": entry("F32", [2], 6, 14),
        "a": entry("BF16", [3], 0, 6),
    }
    entries = parse_header(json.dumps(header).encode(), shapes)
    assert [(e.name, e.dtype, e.begin, e.end) for e in entries] == [
        ("a", torch.bfloat16, 0, 6),
        ("b", torch.float32, 6, 14),
    ]
    data = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16).view(torch.uint8)
    data = torch.cat([data, torch.tensor([4.0, 5.0]).view(torch.uint8)])
    a, b = (_tensor(data, e) for e in entries)
    assert a.tolist() == [1.0, 2.0, 3.0] and b.tolist() == [4.0, 5.0]


def tiny_model(seed: int = 0) -> Any:
    return build_hf_model(TinyMoEConfig(), seed=seed, dtype=torch.bfloat16)


class RecordingEngine:
    """A real engine whose loads take 0.2 s and are recorded, to catch interleaving."""

    def __init__(self) -> None:
        self.inner = HFMoEEngine.from_config(seed=0, dtype="float32", num_threads=None)
        self.events: list[tuple[str, float]] = []

    @property
    def info(self) -> Any:
        return self.inner.info

    async def generate(self, requests: Any) -> Any:
        return await self.inner.generate(requests)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(self.inner.model)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def load_weights(self, named_tensors: Any, *, policy_version: int | None = None) -> int:
        self.events.append(("start", time.monotonic()))
        time.sleep(0.2)
        count = self.inner.load_weights(named_tensors, policy_version=policy_version)
        self.events.append(("end", time.monotonic()))
        return count

    async def close(self) -> None:
        await self.inner.close()


def test_concurrent_uploads_load_one_at_a_time() -> None:
    engine = RecordingEngine()

    async def main():
        server = await start_server(engine, ServerConfig())
        try:
            async with aiohttp.ClientSession() as session:
                bodies = [save({NORM: torch.full((64,), float(i))}) for i in range(4)]
                return await asyncio.gather(
                    *(post(session, server.url + UPLOAD, b, OCTETS) for b in bodies)
                )
        finally:
            await server.stop()

    replies = asyncio.run(main())
    unversioned = {"num_loaded": 1, "num_staged": 0, "policy_version": 0}
    assert all(reply == (200, unversioned) for reply in replies)
    kinds = [kind for kind, _ in engine.events]
    assert kinds == ["start", "end"] * 4  # never two starts in a row
