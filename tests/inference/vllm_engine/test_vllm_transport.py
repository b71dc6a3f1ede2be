"""The transport contract both sides import: update_info checking, the pause query,
and where a worker may read a bucket from (the transport's folder, the sender's origin,
within a size cap): the checks the worker extension runs, here in the trainer's
environment against real files and a real sender."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import torch
from aiohttp import web
from safetensors.torch import load

from inference.vllm import process, transport
from inference.vllm.senders import URLBucketSender
from inference.vllm.transport import (
    PAUSE_QUERY,
    bucket_dir,
    check_init_info,
    check_update_info,
    file_update_info,
    prepare_bucket_dir,
    pull_bucket,
    read_bucket_file,
    url_init_info,
    url_update_info,
)


def test_update_infos_as_built_pass_the_check() -> None:
    assert check_update_info(file_update_info("/dev/shm/b0.safetensors")) == {
        "path": "/dev/shm/b0.safetensors"
    }
    info = url_update_info("http://10.0.0.2:9000/buckets/0", api_key="k")
    assert check_update_info(info) == info
    assert check_update_info(url_update_info("https://h/b")) == {"url": "https://h/b"}


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (["path"], "update_info: expected an object, got list"),
        ({}, r"update_info: expected exactly one of 'path' or 'url', got \[\]"),
        ({"path": "/a", "url": "http://h/b"}, "expected exactly one of 'path' or 'url'"),
        ({"file": "/a"}, r"update_info: expected keys among .*, got \['file'\]"),
        ({"path": ""}, "update_info.path: expected a non-empty string, got ''"),
        ({"path": 3}, "update_info.path: expected a non-empty string, got 3"),
        ({"path": "/a", "api_key": "k"}, "update_info.api_key: expected only with 'url'"),
        ({"url": "file:///etc/passwd"}, "update_info.url: expected an http"),
        (
            {"url": "http://h/b", "api_key": 7},
            "update_info.api_key: expected a non-empty string, got int",
        ),
    ],
)
def test_bad_update_infos_fail_loudly(info: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_update_info(info)


def test_the_pause_query_keeps_requests_and_clears_their_cache() -> None:
    query = parse_qs(PAUSE_QUERY, strict_parsing=True)
    assert query == {"mode": ["keep"], "clear_cache": ["true"]}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    return names | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }


def test_the_contract_imports_only_the_standard_library() -> None:
    # It is imported inside vLLM's environment, where the project's dependencies are not.
    imported = {name.split(".")[0] for name in _imports(Path(transport.__file__))}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_the_worker_extension_imports_only_what_vllm_has_and_what_is_staged() -> None:
    imported = _imports(Path(transport.__file__).with_name("worker_extension.py"))
    roots = {name.split(".")[0] for name in imported}
    assert roots - set(sys.stdlib_module_names) <= {
        "__future__",
        "torch",
        "safetensors",
        "vllm",
        "inference",
    }
    ours = {name for name in imported if name.split(".")[0] == "inference"}
    assert ours == {"inference.vllm.transport", "inference.vllm.seeded_sampling"}
    # What the extension imports of ours imports nothing of ours in turn, and nothing
    # vLLM's environment lacks.
    for module in sorted(ours):
        path = Path(transport.__file__).with_name(module.rsplit(".", 1)[1] + ".py")
        nested = {name.split(".")[0] for name in _imports(path)}
        assert nested - set(sys.stdlib_module_names) <= {"__future__", "torch", "vllm"}, module
    staged = {module.removesuffix(".py").replace("/", ".") for module in process._STAGED_MODULES}
    assert ours | {"inference.vllm.worker_extension"} <= staged


# ---- where the worker extension may read a bucket from --------------------------------

CAP = 1 << 20


@pytest.fixture
def in_bucket_dir() -> Iterator[Path]:
    """A fresh subfolder of the transport's folder, removed after the test."""
    folder = Path(tempfile.mkdtemp(dir=prepare_bucket_dir()))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_a_bucket_file_in_the_transport_folder_is_read(in_bucket_dir: Path) -> None:
    path = in_bucket_dir / "b.safetensors"
    path.write_bytes(b"x" * 100)
    assert read_bucket_file(str(path), max_bytes=100) == b"x" * 100
    assert stat.S_IMODE(os.stat(bucket_dir()).st_mode) == 0o700


def test_files_outside_the_transport_folder_are_refused(
    in_bucket_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"weights of someone else")
    link = in_bucket_dir / "escape.safetensors"
    link.symlink_to(outside)
    for path in (
        str(outside),
        f"{bucket_dir()}/../{outside.relative_to('/')}",  # ../ out of the folder
        f"{in_bucket_dir}/../../../{outside.relative_to('/')}",
        str(link),  # a symlink inside pointing out
        "/etc/passwd",
        bucket_dir(),  # the folder itself
    ):
        with pytest.raises(ValueError, match=r"^update_info.path: expected a file inside "):
            read_bucket_file(path, max_bytes=CAP)


def test_an_oversized_bucket_file_is_refused(in_bucket_dir: Path) -> None:
    path = in_bucket_dir / "big.safetensors"
    path.write_bytes(b"x" * 101)
    with pytest.raises(
        ValueError, match=r"^update_info.path: expected a bucket of at most 100 bytes .* got 101"
    ):
        read_bucket_file(str(path), max_bytes=100)


def test_a_bucket_folder_another_user_could_touch_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    for folder in (loose, link):
        with pytest.raises(ValueError, match=rf"^bucket folder {folder}: expected a folder owned"):
            prepare_bucket_dir(str(folder))
    assert prepare_bucket_dir(str(tmp_path / "fresh")) == str(tmp_path / "fresh")
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700


def test_init_info_names_the_origin_of_every_pull() -> None:
    assert url_init_info("http://Node-1:8000") == {"bucket_origin": "http://node-1:8000"}
    assert check_init_info(url_init_info("http://[::1]:9")) == {"bucket_origin": "http://[::1]:9"}
    assert check_init_info({}) == {}
    keyed = url_init_info("http://h:1", announce_key="k")
    assert check_init_info(keyed) == {"bucket_origin": "http://h:1", "announce_key": "k"}
    for info, message in (
        ({"bucket_origin": "ftp://h:1"}, "init_info.bucket_origin: expected an http"),
        ({"bucket_origin": 3}, "init_info.bucket_origin: expected a string"),
        (
            {"master_port": 1},
            r"init_info: expected keys among \['announce_key', 'bucket_origin'\]",
        ),
        ({"announce_key": "k"}, "init_info.announce_key: expected only with bucket_origin"),
        (
            {"bucket_origin": "http://h:1", "announce_key": ""},
            "init_info.announce_key: expected a non-empty string, got str",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            check_init_info(info)


async def _pull(url: str, api_key: str | None, origin: str | None, max_bytes: int) -> bytes:
    return await asyncio.to_thread(
        pull_bucket, url, api_key=api_key, origin=origin, max_bytes=max_bytes, timeout_s=30
    )


def test_pulls_only_from_the_senders_origin_and_within_the_cap() -> None:
    bucket = {"w": torch.arange(8, dtype=torch.float32)}
    outcomes: list[Any] = []

    async def main() -> None:
        sender = URLBucketSender("127.0.0.1")
        init: dict[str, str] = {}

        async def post_init(info: dict[str, str]) -> None:
            init.update(info)
            await asyncio.to_thread(
                transport.announce_worker,
                info["bucket_origin"],
                api_key=info["announce_key"],
                worker="w0",
                timeout_s=30,
            )

        async def attempt(info: dict[str, str]) -> None:
            url, key = info["url"], info["api_key"]
            origin = init["bucket_origin"]
            port = int(origin.rsplit(":", 1)[1])
            elsewhere = [  # refused before any request: the bucket stays
                url.replace("127.0.0.1", "127.0.0.2"),
                url.replace(f":{port}/", f":{port + 1}/"),
                url.replace("http://", "https://"),
            ]
            for other in elsewhere:
                outcomes.append(await _capture(_pull(other, key, origin, CAP)))
            outcomes.append(await _capture(_pull(url, key, None, CAP)))  # no init yet
            outcomes.append(await _capture(_pull(url, key, origin, 10)))  # over the cap
            outcomes.append(await _capture(_pull(url, key, origin, CAP)))  # pulled already

        async def good(info: dict[str, str]) -> None:
            data = await _pull(info["url"], info["api_key"], init["bucket_origin"], CAP)
            outcomes.append(load(data))

        await sender.connect(post_init)
        try:
            await sender.send(bucket, attempt)
            await sender.send(bucket, good)
        finally:
            await sender.close()

    asyncio.run(main())
    *refused, loaded = outcomes
    messages = [str(e) for e in refused]
    assert all(isinstance(e, ValueError) for e in refused), refused
    for message in messages[:3]:
        assert re.match(r"^update_info.url: expected a URL at http://127.0.0.1:\d+ \(init", message)
    assert messages[3].startswith("update_info.url: expected a URL at the origin the trainer")
    assert re.match(r"^update_info.url: expected a bucket of at most 10 bytes", messages[4])
    assert messages[5] == "update_info.url: expected a 200 reply, got HTTP 404"
    assert torch.equal(loaded["w"], bucket["w"])


def test_a_redirect_is_not_followed() -> None:
    async def main() -> BaseException | bytes:
        app = web.Application()

        async def redirect(request: web.Request) -> web.StreamResponse:
            raise web.HTTPFound("http://127.0.0.2:1/elsewhere")

        app.router.add_get("/b", redirect)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            origin = f"http://127.0.0.1:{port}"
            return await _capture(_pull(f"{origin}/b", None, origin, CAP))
        finally:
            await runner.cleanup()

    error = asyncio.run(main())
    assert str(error) == "update_info.url: expected a 200 reply, got HTTP 302"


async def _capture(pull: Awaitable[bytes]) -> BaseException | bytes:
    try:
        return await pull
    except Exception as exc:
        return exc
