"""Policy versions per trajectory, from replies that carry one version or several (a vLLM
reply spanning a weight push), and packed bodies asked for only of clients that can
send them. No server: a scripted client answers."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import skyrl_gym
from inference.client import GenerateResult, VersionSpan
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_train.config.schema import GeneratorConfig, InferenceEngineConfig
from skyrl_train.generators import GeneratorInput, GymGenerator


class TwoTurnEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Any = None) -> None:
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= 2
        observations = [] if done else [{"role": "user", "content": "again"}]
        return {"observations": observations, "reward": 0.0, "done": done, "metadata": {}}


@pytest.fixture(autouse=True, scope="module")
def _env() -> Any:
    skyrl_gym.register("gen_test_versions", TwoTurnEnv)
    yield
    skyrl_gym.deregister("gen_test_versions")


class VersionedClient:
    """Trajectory i's turn t gets ``script[i][t]``: spans [(version, start, end)], an int
    (one version for the reply, as the builtin server reports), or None (no version)."""

    def __init__(self, script: list[list[Any]], *, packed: bool = True) -> None:
        self.script = script
        self.supports_packed_body = packed
        self.supported_logprobs_modes = ("raw_logprobs", "processed_logprobs")
        self.calls: list[dict[str, Any]] = []
        self.turns: dict[int, int] = {}

    async def generate(self, **kwargs: Any) -> GenerateResult:
        self.calls.append(kwargs)
        prompt = list(kwargs["prompt_token_ids"])
        index = self.tokenizer_index(prompt)
        turn = self.turns.get(index, 0)
        self.turns[index] = turn + 1
        ids = [65, 66]
        spec = self.script[index][turn]
        result = GenerateResult(response_ids=ids, finish_reason="length", logprobs=[-0.5, -0.5])
        if isinstance(spec, list):
            result.policy_version_spans = [VersionSpan(*s) for s in spec]
            result.policy_version = min(s[0] for s in spec)
        elif spec is not None:
            result.policy_version = spec
        if kwargs["return_routed_experts"]:
            start = kwargs["routed_experts_prompt_start"] or 0
            result.routed_experts = np.zeros((len(prompt) - start + len(ids) - 1, 4, 2), np.uint8)
        return result

    def tokenizer_index(self, prompt: list[int]) -> int:
        # The prompt renders "#<i>": the byte after "#" names the trajectory.
        text = bytes(t for t in prompt if t < 256)
        return int(chr(text[text.index(b"#") + 1]))


def _config(*, routes: bool) -> GeneratorConfig:
    return GeneratorConfig(
        max_turns=2,
        max_tokens_per_turn=2,
        inference_engine=InferenceEngineConfig(enable_return_routed_experts=routes),
    )


def _batch(n: int) -> GeneratorInput:
    prompts = [[{"role": "user", "content": f"#{i}"}] for i in range(n)]
    return GeneratorInput(prompts, ["gen_test_versions"] * n, [{} for _ in range(n)])


def test_a_turn_spanning_a_push_counts_both_versions(tokenizer: Any) -> None:
    client = VersionedClient(
        [
            [[(2, 0, 1), (3, 1, 2)], 3],  # turn 0 spans a push 2 -> 3: (2, 3)
            [4, [(4, 0, 1), (6, 1, 2)]],  # the last turn spans two pushes: (4, 6)
            [5, 5],  # one version throughout
        ]
    )
    gen = GymGenerator(client, tokenizer, _config(routes=False), progress=False)
    out = asyncio.run(gen.generate(_batch(3)))
    assert out.policy_versions == [(2, 3), (4, 6), (5, 5)]
    assert all(not c["return_packed_body"] for c in client.calls)  # no routes asked


def test_a_turn_without_versions_leaves_none(tokenizer: Any) -> None:
    client = VersionedClient([[[(1, 0, 2)], None], [1, 1]])
    gen = GymGenerator(client, tokenizer, _config(routes=False), progress=False)
    assert asyncio.run(gen.generate(_batch(2))).policy_versions is None


@pytest.mark.parametrize("packed", [True, False])
def test_packed_bodies_only_from_clients_that_send_them(tokenizer: Any, packed: bool) -> None:
    client = VersionedClient([[1, 1]], packed=packed)
    gen = GymGenerator(client, tokenizer, _config(routes=True), progress=False)
    out = asyncio.run(gen.generate(_batch(1)))
    assert [c["return_packed_body"] for c in client.calls] == [packed, packed]
    assert all(c["return_routed_experts"] for c in client.calls)
    assert out.routed_experts is not None and out.policy_versions == [(1, 1)]
