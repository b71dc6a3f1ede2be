"""Which logprobs mode a generator asks for: each client declares the modes its engine
can report (``supported_logprobs_modes``) and the generator picks, for its purpose, the
first mode it accepts that every one of its clients declares. Evaluation on a stock
vLLM server (one server-wide mode, ``processed_logprobs``) used to be refused by the
client before anything was sent."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import skyrl_gym
from inference.client import RemoteGenerateClient
from inference.errors import RequestValidationError
from inference.vllm.client import VLLMClient
from skyrl_train.config import load_config
from skyrl_train.dataset.prompts import RowRef
from skyrl_train.errors import ConfigValidationError
from skyrl_train.generators import GeneratorInput, GymGenerator
from skyrl_train.trainer.engine_clients import ClientOptions, make_client
from skyrl_train.trainer.evaluation import EvalRow, evaluate
from tests.inference.vllm_engine.fake_vllm import fake_vllm
from tests.skyrl_train.generators.conftest import serving

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"


def test_each_client_declares_the_modes_its_engine_reports() -> None:
    # The builtin engine computes either per request; vLLM fixes one per server.
    assert RemoteGenerateClient("http://127.0.0.1:1").supported_logprobs_modes == (
        RAW,
        PROCESSED,
    )
    assert VLLMClient("http://127.0.0.1:1").supported_logprobs_modes == (PROCESSED,)


@pytest.mark.parametrize("client_class", [RemoteGenerateClient, VLLMClient])
def test_a_mode_the_client_does_not_declare_is_refused_before_sending(
    client_class: type,
) -> None:
    async def main() -> None:
        # Nothing listens on port 1: any attempt to send would be a transport error.
        async with client_class("http://127.0.0.1:1") as client:
            await client.generate(
                prompt_token_ids=[1], sampling_params={"logprobs_mode": "processed"}
            )

    with pytest.raises(RequestValidationError) as info:
        asyncio.run(main())
    assert info.value.path == "$.sampling_params.logprobs_mode"
    assert str(info.value).endswith("got 'processed'")


def test_evaluation_against_a_vllm_server_is_scored(tokenizer: Any) -> None:
    """The evaluation command's own path (``evaluate``, the run's client factory) on a
    vLLM server: every row is scored, and each request asks for logprobs in the one
    mode the server has."""
    cfg = load_config(
        ["generator.inference_engine.backend=vllm", "generator.max_tokens_per_turn=4"]
    )
    tasks = skyrl_gym.make_dataset("guess_number", num_prompts=3, seed=0)
    rows = [EvalRow(i, RowRef("data.val_data", None, i), task) for i, task in enumerate(tasks)]

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with fake_vllm() as fake:
            client = make_client(fake.url, ClientOptions(backend="vllm", eos_token_ids=(0,)))
            try:
                report = await evaluate(cfg, [client], tokenizer, rows)
            finally:
                await client.close()
            return report, [hit.body for hit in fake.hits if hit.path.endswith("/generate")]

    report, sent = asyncio.run(main())
    assert report["overall"]["rows"] == 3 and report["failed_rows"] == []
    assert report["overall"]["samples"] == 3
    assert len(sent) >= 3
    # vLLM's mode is its server's (--logprobs-mode): the request names none, and asks
    # for the sampled token's logprob (logprobs 0).
    assert all(
        "logprobs_mode" not in body["sampling_params"] and body["sampling_params"]["logprobs"] == 0
        for body in sent
    )


class DeclaredClient:
    """A client stand-in that reports the modes it declares and records each request."""

    def __init__(self, modes: tuple[str, ...]) -> None:
        self.supported_logprobs_modes = modes
        self.supports_packed_body = False
        self.modes_asked: list[Any] = []

    async def generate(self, **kwargs: Any) -> Any:
        from inference.client import GenerateResult

        self.modes_asked.append(kwargs["sampling_params"].get("logprobs_mode"))
        return GenerateResult(response_ids=[65], finish_reason="stop", logprobs=[-0.5])


def _config() -> Any:
    return load_config(
        [
            "generator.max_turns=1",
            "generator.inference_engine.enable_return_routed_experts=false",
        ]
    ).generator


@pytest.mark.parametrize(
    ("modes", "evaluation", "chosen"),
    [
        ((RAW, PROCESSED), True, RAW),
        ((PROCESSED,), True, PROCESSED),
        ((RAW, PROCESSED), False, PROCESSED),
        ((PROCESSED,), False, PROCESSED),
        ((PROCESSED, RAW), True, RAW),  # the purpose's preference, not the client's order
    ],
)
def test_the_generator_asks_for_a_mode_its_client_declares(
    tokenizer: Any, modes: tuple[str, ...], evaluation: bool, chosen: str
) -> None:
    client = DeclaredClient(modes)
    gen = GymGenerator(client, tokenizer, _config(), evaluation=evaluation, progress=False)
    assert gen.logprobs_mode == chosen
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    asyncio.run(gen.generate(GeneratorInput(prompts, ["guess_number"] * 2, [{"target": 3}] * 2)))
    assert client.modes_asked == [chosen, chosen]
    assert chosen in modes


def test_clients_of_one_generator_agree_on_one_mode(tokenizer: Any) -> None:
    """Every trajectory of an output is in one mode, whichever server it went to."""
    clients = [DeclaredClient((RAW, PROCESSED)), DeclaredClient((PROCESSED,))]
    gen = GymGenerator(clients, tokenizer, _config(), evaluation=True, progress=False)
    assert gen.logprobs_mode == PROCESSED


def test_a_purpose_no_client_mode_serves_is_refused_before_any_request(tokenizer: Any) -> None:
    # Training scores tokens under the distribution they were drawn from: raw won't do.
    with pytest.raises(ConfigValidationError) as info:
        GymGenerator(DeclaredClient((RAW,)), tokenizer, _config(), progress=False)
    assert info.value.path == "generator.inference_engine.backend"
    assert "processed_logprobs" in str(info.value) and "['raw_logprobs']" in str(info.value)


def test_the_builtin_server_still_gives_evaluation_raw_logprobs(tokenizer: Any) -> None:
    """Greedy evaluation on the builtin engine keeps the model's own logprobs (log
    softmax of the logits): under processed_logprobs every greedy token would read 0."""

    async def main() -> list[list[float]]:
        async with serving() as client:
            gen = GymGenerator(client, tokenizer, _config(), evaluation=True, progress=False)
            prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(2)]
            out = await gen.generate(
                GeneratorInput(prompts, ["guess_number"] * 2, [{"target": 3}] * 2)
            )
            assert out.rollout_logprobs is not None
            return out.rollout_logprobs

    logprobs = asyncio.run(main())
    assert any(lp < 0 for row in logprobs for lp in row)
