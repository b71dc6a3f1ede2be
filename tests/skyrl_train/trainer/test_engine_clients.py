"""``engine_clients``: one factory makes every client a run uses, by backend, and a
vLLM client carries what a ``--skip-tokenizer-init`` server lacks (EOS ids, routes'
shape)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from inference.client import RemoteGenerateClient, RouteShape
from inference.models.checkpoint import inspect_checkpoint
from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.vllm.client import VLLMClient
from inference.vllm.senders import FileBucketSender, URLBucketSender
from skyrl_train.config import load_config
from skyrl_train.trainer.engine_clients import ClientOptions, make_client
from tests.inference.vllm_engine.fake_vllm import fake_vllm
from tests.inference.vllm_engine.harness import VLLM_SIZES


def test_the_backend_picks_the_client() -> None:
    builtin = make_client("http://127.0.0.1:1", ClientOptions(api_key="k"))
    assert type(builtin) is RemoteGenerateClient
    shape = RouteShape(num_layers=2, top_k=2, num_experts=6)
    vllm = make_client(
        "http://127.0.0.1:1",
        ClientOptions(
            backend="vllm", api_key="k", eos_token_ids=(7,), route_shape=shape, family="mixtral"
        ),
    )
    assert isinstance(vllm, VLLMClient)
    assert vllm.eos_token_ids == (7,) and vllm.route_shape == shape
    assert vllm.family == "mixtral"  # pushed weights get the names vLLM's Mixtral loads
    assert isinstance(vllm._push.sender, FileBucketSender)  # the default: same host
    pulled = make_client(
        "http://127.0.0.1:1", ClientOptions(backend="vllm", weight_url_host="10.0.0.5")
    )
    assert isinstance(pulled, VLLMClient) and isinstance(pulled._push.sender, URLBucketSender)
    assert pulled._push.sender.host == "10.0.0.5"
    with pytest.raises(ValueError, match=r"^generator.inference_engine.backend: expected"):
        ClientOptions(backend="sglang")
    assert "secret-key" not in repr(ClientOptions(api_key="secret-key"))


def test_run_options_come_from_the_checkpoint(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=0, sizes=VLLM_SIZES)
    info = inspect_checkpoint(folder)
    cfg = load_config(["generator.inference_engine.backend=vllm"])
    options = ClientOptions.for_run(cfg, info, api_key="k")
    arch = info.architecture
    assert options.backend == "vllm" and options.eos_token_ids == info.eos_token_ids
    assert options.eos_token_ids  # the checkpoint names at least one
    assert options.family == "qwen3_moe"
    assert options.route_shape == RouteShape(
        num_layers=arch.num_moe_layers, top_k=arch.num_experts_per_tok, num_experts=arch.num_experts
    )


def test_vllm_requests_carry_the_checkpoint_eos_unless_ignore_eos() -> None:
    # vLLM started with --skip-tokenizer-init has no EOS id of its own.
    async def main() -> list[dict]:
        async with fake_vllm() as fake:
            async with VLLMClient(fake.url, eos_token_ids=(2, 5)) as vllm:
                for params in (
                    {"max_tokens": 2, "stop_token_ids": [5, 9]},
                    {"max_tokens": 2},
                    {"max_tokens": 2, "stop_token_ids": [9], "ignore_eos": True},
                ):
                    await vllm.generate(prompt_token_ids=[1], sampling_params=params)
            return [hit.body["sampling_params"] for hit in fake.hits]

    sent = asyncio.run(main())
    assert [p.get("stop_token_ids") for p in sent] == [[5, 9, 2], [2, 5], [9]]
    with pytest.raises(ValueError, match=r"^eos_token_ids: expected"):
        VLLMClient("http://127.0.0.1:1", eos_token_ids=(-1,))
