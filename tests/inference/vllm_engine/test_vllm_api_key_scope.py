"""What vLLM's ``--api-key`` guards (its ``AuthenticationMiddleware``: paths under
``/v1``, ``/v2``, ``/inference``, ``/cohere``) and what it leaves open: the RL weight
routes the trainer pushes through. The warning in docs/vllm.md that a remote vLLM
server must sit on a trusted network rests on this test."""

from __future__ import annotations

from typing import Any

import pytest

from tests.inference.vllm_engine.harness import call

pytestmark = pytest.mark.slow


def test_the_api_key_guards_generation_but_not_the_weight_routes(vllm_server: Any) -> None:
    url = vllm_server.url
    wrong = "not-the-key"
    generate = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}
    assert call(url, wrong, "/inference/v1/generate", generate)[0] == 401
    assert call(url, wrong, "/v1/models")[0] == 401
    # Open to anyone who can reach the port: a pause (and whatever push follows).
    assert call(url, wrong, "/weight_info")[0] == 200
    assert call(url, wrong, "/pause?mode=keep", {})[0] == 200
    assert call(url, wrong, "/resume", {})[0] == 200
    assert call(url, vllm_server.api_key, "/inference/v1/generate", generate)[0] == 200
