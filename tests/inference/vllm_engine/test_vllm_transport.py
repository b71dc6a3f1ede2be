"""The transport contract both sides import: update_info checking and the pause query."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from inference.vllm import process, transport
from inference.vllm.transport import (
    PAUSE_QUERY,
    check_update_info,
    file_update_info,
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
    assert ours == {"inference.vllm.transport"}
    staged = {module.removesuffix(".py").replace("/", ".") for module in process._STAGED_MODULES}
    assert {"inference.vllm.transport", "inference.vllm.worker_extension"} <= staged
