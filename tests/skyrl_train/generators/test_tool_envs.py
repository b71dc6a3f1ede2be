"""Environments that call tools, and ``postprocessed_action``, through the real generator
and a real server: tool outputs are observations (loss mask 0) whose routes still
stitch, turn rewards land on each turn's last sampled token, and a replaced reply keeps
the sampled tokens it still contains, with their logprobs and routes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.sql.local_db import DB_ID, database_file, make_database, make_text2sql_rows
from skyrl_train.generators import GeneratorInput, GeneratorOutput
from tests.skyrl_train.generators.conftest import serving
from tests.skyrl_train.generators.test_gym_generator import (
    Wrapper,
    check_consistent,
    config,
    generator,
)

CUT = 3
"""The cutting environment keeps this many characters of each reply, then adds "!"."""


class CutEnv(BaseTextEnv):
    """Two turns; each reply is replaced by its first ``CUT`` characters and "!" (the
    common case: a reply cut after its tool call, plus text the model never wrote)."""

    replies: dict[int, list[str]] = {}
    """Per trajectory (``extras["i"]``), the replies it was stepped with."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.max_turns = 2
        self.seen = CutEnv.replies.setdefault((extras or {}).get("i", 0), [])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.seen.append(action)
        done = self.turns >= self.max_turns
        return {
            "observations": [] if done else [{"role": "user", "content": "go on"}],
            "reward": float(self.turns),
            "done": done,
            "metadata": {},
            "postprocessed_action": action[:CUT] + "!",
        }


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def reference_routes(client: Any, tokens: list[int]) -> np.ndarray:
    """One prefill of the whole final sequence: the routing each token gets in context."""
    ref = await client.generate(
        prompt_token_ids=tokens,
        sampling_params={"max_tokens": 1, "temperature": 0.0},
        return_routed_experts=True,
        routed_experts_prompt_start=0,
    )
    return np.asarray(ref.routed_experts)


def test_a_replaced_reply_keeps_its_sampled_prefix_logprobs_and_routes(tokenizer) -> None:
    skyrl_gym.register("gen_test_cut", CutEnv)
    CutEnv.replies = {}
    n = 3

    async def main() -> tuple[GeneratorOutput, Wrapper, list[np.ndarray]]:
        async with serving() as client:
            wrapper = Wrapper(client)
            cfg = config(max_turns=2, max_tokens_per_turn=6, temperature=1.0)
            gen = generator(wrapper, tokenizer, cfg, stop_token_ids=())
            prompts = [[{"role": "user", "content": f"cut {i}"}] for i in range(n)]
            out = await gen.generate(
                GeneratorInput(prompts, ["gen_test_cut"] * n, [{"i": i} for i in range(n)])
            )
            refs = [
                await reference_routes(client, out.prompt_token_ids[i] + out.response_ids[i])
                for i in range(n)
            ]
        return out, wrapper, refs

    try:
        out, wrapper, refs = run(main())
    finally:
        skyrl_gym.deregister("gen_test_cut")
    check_consistent(out, n)
    assert out.rollout_metrics["generate/postprocessed_turns"] == 2 * n
    bang = tokenizer.encode("!", add_special_tokens=False)
    first_calls = [c for c in wrapper.calls if c["prompt_token_ids"] in out.prompt_token_ids]
    assert len(first_calls) == n
    for i in range(n):
        ids, mask, logprobs = out.response_ids[i], out.loss_masks[i], out.rollout_logprobs[i]
        # Turn 1: the sampled tokens whose text the replacement keeps train; the rest of
        # the replacement ("!" and whatever the cut split) is environment text.
        kept = mask.index(0)
        replacement = CutEnv.replies[i][0][:CUT] + "!"
        kept_text = tokenizer.decode(ids[:kept])
        assert replacement.startswith(kept_text) and kept >= 1
        rest = tokenizer.encode(replacement[len(kept_text) :], add_special_tokens=False)
        assert rest[-len(bang) :] == bang and ids[kept : kept + len(rest)] == rest
        assert mask[kept : kept + len(rest)] == [0] * len(rest)
        assert logprobs[kept : kept + len(rest)] == [0.0] * len(rest)
        # Each turn's reward sits on that turn's last kept sampled token.
        sampled_ends = [
            j for j in range(len(mask)) if mask[j] and (j + 1 == len(mask) or not mask[j + 1])
        ]
        assert [out.token_rewards[i][j] for j in sampled_ends] == [1.0, 2.0]
        assert sum(out.token_rewards[i]) == out.rewards[i] == 3.0
        # Routes: every captured row is the routing its token gets in the final sequence.
        routes = out.routed_experts[i]
        assert routes.shape[0] >= len(out.prompt_token_ids[i]) + kept
        np.testing.assert_array_equal(routes, refs[i][: routes.shape[0]])
        # Every loss-active token t has its predecessor's row captured.
        active = [len(out.prompt_token_ids[i]) + j for j, m in enumerate(mask) if m]
        assert max(active) - 1 < routes.shape[0]


def test_the_kept_prefix_logprobs_are_the_sampled_ones(tokenizer) -> None:
    """The logprobs of the kept tokens are the engine's, untouched by the replacement."""
    skyrl_gym.register("gen_test_cut", CutEnv)
    seen: list[list[float]] = []

    def record(i: int, kwargs: Any, result: Any) -> Any:
        seen.append(list(result.logprobs))
        return result

    async def main() -> GeneratorOutput:
        async with serving() as client:
            cfg = config(max_turns=1, max_tokens_per_turn=6, temperature=1.0)
            gen = generator(
                Wrapper(client, rewrite_result=record), tokenizer, cfg, stop_token_ids=()
            )
            prompt = [{"role": "user", "content": "cut"}]
            return await gen.generate(GeneratorInput([prompt], ["gen_test_cut"], [{}]))

    try:
        out = run(main())
    finally:
        skyrl_gym.deregister("gen_test_cut")
    kept = out.loss_masks[0].index(0)
    assert kept >= 1 and out.rollout_logprobs[0][:kept] == seen[0][:kept]
    assert out.loss_masks[0] == [1] * kept + [0] * (len(out.loss_masks[0]) - kept)


@pytest.fixture(scope="module")
def sql_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sql")
    make_database(database_file(root, DB_ID), seed=0)
    return root


class SqlScript:
    """No server, no routes: turn 1 runs a query, turn 2 answers with the gold SQL."""

    supported_logprobs_modes = ("raw_logprobs", "processed_logprobs")

    def __init__(self, tokenizer: Any, gold: str) -> None:
        self.replies = [
            tokenizer.encode(text, add_special_tokens=False)
            for text in (
                "<think>look</think><sql>SELECT name FROM departments LIMIT 2</sql>",
                f"<think>done</think><solution>{gold}</solution>",
            )
        ]
        self.turn = 0

    async def generate(self, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        ids = self.replies[min(self.turn, 1)]
        self.turn += 1
        return SimpleNamespace(
            response_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", routed_experts=None
        )


def test_text2sql_tool_output_is_an_observation_and_the_answer_pays(tokenizer, sql_root) -> None:
    (row,) = make_text2sql_rows(sql_root, count=1, seed=3)
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
    gold = row["reward_spec"]["ground_truth"]
    cfg = config(return_routed_experts=False, max_turns=3, max_tokens_per_turn=200)
    cfg.max_response_tokens = 4096
    gen = generator(
        SqlScript(tokenizer, gold),
        tokenizer,
        cfg,
        env_configs={"text2sql": {"db_path": str(sql_root)}},
    )
    out = run(gen.generate(GeneratorInput([row["prompt"]], ["text2sql"], [extras])))
    ids, mask = out.response_ids[0], out.loss_masks[0]
    observation = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "<observation>" in observation and "name" in observation
    assert "turns left" in observation  # SkyRL's reminder rides on the tool output
    assert out.rewards[0] == 1.0 and out.stop_reasons[0] == "done"
    assert out.token_rewards[0][len(ids) - 1] == 1.0  # the answer's last token
    assert out.rollout_metrics["generate/mean_turns"] == 2.0


def test_text2sql_with_a_real_server_stitches_routes_over_tool_turns(tokenizer, sql_root) -> None:
    rows = make_text2sql_rows(sql_root, count=2, seed=4)
    extras = [{k: v for k, v in r.items() if k not in ("prompt", "env_class")} for r in rows]

    async def main() -> tuple[GeneratorOutput, list[np.ndarray]]:
        async with serving() as client:
            cfg = config(max_turns=3, max_tokens_per_turn=8)
            gen = generator(
                client, tokenizer, cfg, env_configs={"text2sql": {"db_path": str(sql_root)}}
            )
            out = await gen.generate(
                GeneratorInput([r["prompt"] for r in rows], ["text2sql"] * 2, extras)
            )
            refs = [
                await reference_routes(client, out.prompt_token_ids[i] + out.response_ids[i])
                for i in range(2)
            ]
        return out, refs

    out, refs = run(main())
    check_consistent(out, 2)
    for i in range(2):
        assert 0 in out.loss_masks[i]  # the tool's observations were appended, not trained
        routes = out.routed_experts[i]  # an observation the budget cut was never fed
        np.testing.assert_array_equal(routes, refs[i][: routes.shape[0]])
        active = [len(out.prompt_token_ids[i]) + j for j, m in enumerate(out.loss_masks[i]) if m]
        assert max(active) - 1 < routes.shape[0]


HOSTILE = [
    "while True:\n    pass",
    "import os\nwhile True:\n    os.fork()",
    "x = bytearray(100 * 1024**3)",
    "print(open(__import__('os').path.expanduser('~/.ssh/id_rsa')).read())",
    "import socket\nsocket.create_connection(('127.0.0.1', 22))",
]


class CodeScript:
    """No server: trajectory i replies with program i (one fenced block)."""

    supported_logprobs_modes = ("raw_logprobs", "processed_logprobs")

    def __init__(self, tokenizer: Any, programs: list[str]) -> None:
        self.replies = {
            tuple(tokenizer.encode(f"task {i}", add_special_tokens=False)): tokenizer.encode(
                f"```python\n{program}\n```", add_special_tokens=False
            )
            for i, program in enumerate(programs)
        }

    async def generate(self, *, prompt_token_ids: Any, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        ids = next(v for k, v in self.replies.items() if _contains(prompt_token_ids, k))
        return SimpleNamespace(
            response_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", routed_experts=None
        )


def _contains(seq: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(part)]) == part for i in range(len(seq) - len(part) + 1))


def test_hostile_programs_score_zero_and_the_rollout_goes_on(tokenizer) -> None:
    import json

    programs = [*HOSTILE, "print(int(input()) * 2)"]
    tests = json.dumps([{"input": "21\n", "output": "42\n", "testtype": "stdin"}])
    extras = {"reward_spec": {"method": "rule", "ground_truth": tests}}
    cfg = config(return_routed_experts=False, max_turns=1, max_tokens_per_turn=200)
    gen = generator(
        CodeScript(tokenizer, programs),
        tokenizer,
        cfg,
        env_configs={"lcb": {"timeout_s": 1.0, "memory_mb": 256}},
    )
    prompts = [[{"role": "user", "content": f"task {i}"}] for i in range(len(programs))]
    out = run(
        gen.generate(GeneratorInput(prompts, ["lcb"] * len(programs), [extras] * len(programs)))
    )
    assert out.rewards == [0.0] * len(HOSTILE) + [1.0]
    assert out.stop_reasons == ["done"] * len(programs)
