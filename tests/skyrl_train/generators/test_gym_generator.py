"""The gym generator against a real server and the tiny fp32 model."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import skyrl_gym
from inference.errors import GenerateProtocolError
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_train.config.schema import GeneratorConfig, InferenceEngineConfig, SamplingParamsConfig
from skyrl_train.errors import ConfigValidationError, RouteTraceError
from skyrl_train.generators import (
    ChatTemplateRenderer,
    GeneratorInput,
    GeneratorOutput,
    GymGenerator,
)
from tests.skyrl_train.generators.conftest import IgnoringPromptStartEngine, serving

L, K = 4, 2  # TinyMoEConfig defaults


class EchoEnv(BaseTextEnv):
    """Never finishes by itself; answers every turn with the same short observation."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.max_turns = (extras or {}).get("turns", 64)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        return {
            "observations": [{"role": "user", "content": "ok"}],
            "reward": 0.25,
            "done": self.turns >= self.max_turns,
            "metadata": {},
        }


@pytest.fixture(autouse=True, scope="module")
def _echo_env() -> Any:
    skyrl_gym.register("gen_test_echo", EchoEnv)
    yield
    skyrl_gym.deregister("gen_test_echo")


def batch(env_name: str, n: int, *, seed: int = 0, **extras: Any) -> GeneratorInput:
    if env_name == "gen_test_echo":
        prompts = [[{"role": "user", "content": f"echo {i}"}] for i in range(n)]
        return GeneratorInput(prompts, [env_name] * n, [dict(extras) for _ in range(n)])
    tasks = skyrl_gym.make_dataset(env_name, num_prompts=n, seed=seed)
    return GeneratorInput(
        [t.prompt for t in tasks], [t.env_name for t in tasks], [t.env_extras for t in tasks]
    )


def config(*, return_routed_experts: bool = True, **overrides: Any) -> GeneratorConfig:
    """A ``generator`` node; ``temperature``/``top_p``/``top_k`` go to ``sampling_params``."""
    sampling = {k: overrides.pop(k) for k in ("temperature", "top_p", "top_k") if k in overrides}
    return GeneratorConfig(
        **{"max_turns": 3, "max_tokens_per_turn": 6, **overrides},
        sampling_params=SamplingParamsConfig(**sampling),
        inference_engine=InferenceEngineConfig(enable_return_routed_experts=return_routed_experts),
    )


def generator(clients: Any, tokenizer: Any, cfg: GeneratorConfig, **kwargs: Any) -> GymGenerator:
    """A ``GymGenerator`` with no tqdm bar in the test output."""
    return GymGenerator(clients, tokenizer, cfg, progress=False, **kwargs)


class Wrapper:
    """A client wrapper that records calls and can rewrite requests or results."""

    def __init__(
        self, inner: Any, *, rewrite_start: Any = None, rewrite_result: Any = None
    ) -> None:
        self.inner = inner
        self.calls: list[dict[str, Any]] = []
        self.rewrite_start = rewrite_start
        self.rewrite_result = rewrite_result

    @property
    def supported_logprobs_modes(self) -> tuple[str, ...]:
        return self.inner.supported_logprobs_modes

    @property
    def supports_packed_body(self) -> bool:
        return self.inner.supports_packed_body

    async def generate(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if self.rewrite_start is not None:
            kwargs = dict(kwargs, routed_experts_prompt_start=self.rewrite_start(kwargs))
        result = await self.inner.generate(**kwargs)
        if self.rewrite_result is not None:
            result = self.rewrite_result(len(self.calls) - 1, kwargs, result)
        return result


def check_consistent(out: GeneratorOutput, n: int) -> None:
    """Every per-token list lines up; routes cover tokens 0..N-2 (the last was never fed)."""
    for name in (
        "prompt_token_ids",
        "response_ids",
        "loss_masks",
        "rewards",
        "token_rewards",
        "stop_reasons",
    ):
        assert len(getattr(out, name)) == n, name
    assert out.rollout_logprobs is not None
    for i in range(n):
        r = len(out.response_ids[i])
        assert (
            len(out.loss_masks[i]) == len(out.token_rewards[i]) == len(out.rollout_logprobs[i]) == r
        )
        masks = np.array(out.loss_masks[i])
        logprobs = np.array(out.rollout_logprobs[i])
        assert (logprobs[masks == 0] == 0.0).all() and (logprobs[masks == 1] < 0).all()
        # Rewards sit only on a reply's last token (each turn's own reward there).
        ends = {j for j in np.flatnonzero(masks) if j + 1 == r or masks[j + 1] == 0}
        assert all(v == 0.0 for j, v in enumerate(out.token_rewards[i]) if j not in ends)
        assert sum(out.token_rewards[i]) == pytest.approx(out.rewards[i])


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_stitched_routes_equal_one_fp32_forward_of_the_final_sequence(tokenizer):
    async def main() -> None:
        async with serving() as client:
            gen = generator(client, tokenizer, config(max_turns=3))
            out = await gen.generate(batch("guess_number", 6))
            check_consistent(out, 6)
            assert out.rollout_metrics["generate/mean_turns"] >= 2
            assert out.routed_experts is not None
            for i in range(6):
                tokens = out.prompt_token_ids[i] + out.response_ids[i]
                ref = await client.generate(
                    prompt_token_ids=tokens,
                    sampling_params={"max_tokens": 1, "temperature": 0.0},
                    return_routed_experts=True,
                    routed_experts_prompt_start=0,
                )
                routes = out.routed_experts[i]
                # One prefill over N tokens routes all N; the trace holds N-1 (the last
                # sampled token was never fed) and must match them row for row.
                assert ref.routed_experts.shape == (len(tokens), L, K)
                assert routes.shape == (len(tokens) - 1, L, K)
                np.testing.assert_array_equal(routes, ref.routed_experts[: len(tokens) - 1])

    run(main())


def test_route_bytes_grow_linearly_with_turns(tokenizer):
    async def main() -> dict[int, list[int]]:
        per_turn: dict[int, list[int]] = {}
        async with serving() as client:
            for k in (2, 4, 8):
                sizes: list[int] = []

                def measure(i: int, kwargs: Any, result: Any, sizes: list[int] = sizes) -> Any:
                    sizes.append(result.routed_experts.nbytes)
                    return result

                wrapper = Wrapper(client, rewrite_result=measure)
                cfg = config(max_turns=k, max_tokens_per_turn=4, max_response_tokens=1024)
                out = await generator(wrapper, tokenizer, cfg, stop_token_ids=()).generate(
                    batch("gen_test_echo", 1)
                )
                tokens = len(out.prompt_token_ids[0]) + len(out.response_ids[0])
                assert (
                    out.rollout_metrics["generate/route_bytes"]
                    == sum(sizes)
                    == (tokens - 1) * L * K
                )
                per_turn[k] = sizes
        return per_turn

    per_turn = run(main())
    assert [len(v) for v in per_turn.values()] == [2, 4, 8]
    # Turn 0 carries the prompt; every later turn carries only its own new rows
    # (observation + generated), at most (4 + 25) * L * K bytes however long the
    # conversation already is. Quadratic growth would make turn 7 ~7x turn 1.
    later = [b for sizes in per_turn.values() for b in sizes[1:]]
    assert max(later) <= (4 + 25) * L * K
    totals = {k: sum(v) for k, v in per_turn.items()}
    assert totals[8] - totals[4] <= 2.2 * (totals[4] - totals[2])


def test_single_turn_path_appends_no_eos_and_routes_every_loss_token(tokenizer):
    async def main() -> None:
        async with serving() as client:
            # Length-cut replies: the response is exactly the sampled tokens, no EOS added.
            out = await generator(
                client, tokenizer, config(max_tokens_per_turn=3), stop_token_ids=()
            ).generate(batch("single_digit_sum", 4))
            check_consistent(out, 4)
            for i in range(4):
                n = len(out.prompt_token_ids[i]) + len(out.response_ids[i])
                assert (
                    out.loss_masks[i] == [1] * len(out.response_ids[i])
                    and out.stop_reasons[i] == "done"
                )
                assert out.routed_experts[i].shape[0] == n - 1
            # Every token a stop token: one sampled stop token per reply, loss mask 1,
            # predicted from the last prompt token whose row is captured.
            out = await generator(
                client, tokenizer, config(max_tokens_per_turn=3), stop_token_ids=range(264)
            ).generate(batch("single_digit_sum", 2))
            for i in range(2):
                p = len(out.prompt_token_ids[i])
                assert len(out.response_ids[i]) == 1 and out.loss_masks[i] == [1]
                assert out.routed_experts[i].shape[0] == p

    run(main())


def test_uint8_then_int16_routes_widen_without_changing_values(tokenizer):
    def widen(i: int, kwargs: Any, result: Any) -> Any:
        if kwargs["routed_experts_prompt_start"]:  # every turn after the first
            result.routed_experts = result.routed_experts.astype(np.int16)
        return result

    async def main() -> None:
        async with serving() as client:
            plain = await generator(client, tokenizer, config()).generate(batch("repeat_letter", 3))
            wide = await generator(
                Wrapper(client, rewrite_result=widen), tokenizer, config()
            ).generate(batch("repeat_letter", 3))
        assert plain.response_ids == wide.response_ids
        for a, b in zip(plain.routed_experts, wide.routed_experts, strict=True):
            assert a.dtype == np.uint8 and b.dtype == np.int16
            np.testing.assert_array_equal(a, b)

    run(main())


def test_a_server_that_returns_the_whole_prefix(tokenizer):
    async def main() -> None:
        # Real server ignoring the prompt start: the client refuses the reply by its row
        # count (a protocol error, never retried), naming trajectory and turn.
        async with serving(IgnoringPromptStartEngine) as client:
            gen = generator(client, tokenizer, config())
            with pytest.raises(GenerateProtocolError, match=r"routed_experts.shape\[0\]") as info:
                await gen.generate(batch("repeat_letter", 2))
            assert any("turn 1" in note and "trajectory #" in note for note in info.value.__notes__)
        # A path where the whole prefix gets through (a client asking with start 0): the
        # trace recognises it by its row count and keeps alignment.
        async with serving() as client:
            plain = await generator(client, tokenizer, config()).generate(batch("repeat_letter", 2))
            sloppy = Wrapper(client, rewrite_start=lambda kwargs: 0)
            whole = await generator(sloppy, tokenizer, config()).generate(batch("repeat_letter", 2))
        assert whole.rollout_metrics["generate/whole_prefix_replies"] == 2 * (3 - 1)
        assert (
            whole.rollout_metrics["generate/route_bytes"]
            > plain.rollout_metrics["generate/route_bytes"]
        )
        for a, b in zip(plain.routed_experts, whole.routed_experts, strict=True):
            np.testing.assert_array_equal(a, b)

    run(main())


class RewritingRenderer(ChatTemplateRenderer):
    """A renderer that rewrites an earlier token, as a whitespace-stripping re-render does."""

    def extend(self, token_ids: Any, observations: Any) -> list[int]:
        ids = super().extend(token_ids, observations)
        ids[len(token_ids) - 1] = ord(" ")
        return ids


def test_a_prompt_that_does_not_extend_the_previous_turn_is_refused(tokenizer):
    async def main() -> None:
        async with serving() as client:
            gen = generator(client, tokenizer, config(), renderer=RewritingRenderer(tokenizer))
            with pytest.raises(
                RouteTraceError,
                match=r"trajectory #0 turn 1: prompt_token_ids\[\d+\]: expected \d+ \(the prompt must extend the previous turn's \d+ tokens\), got 32",
            ):
                await gen.generate(batch("repeat_letter", 1))

    run(main())


def test_routed_requests_ask_for_the_packed_body_and_parse_it_packed(tokenizer, monkeypatch):
    """With routes on, every reply's ids and logprobs come as envelopes: one packed
    splice and one packed-choice decode per request, nothing through per-token JSON."""
    import inference.client.client as client_module
    import inference.client.side_channels as side_channels

    counts = {"splice": 0, "decode": 0}

    def counted(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        side_channels, "load_packed_body", counted("splice", side_channels.load_packed_body)
    )
    monkeypatch.setattr(
        client_module,
        "decode_packed_choice",
        counted("decode", client_module.decode_packed_choice),
    )

    async def main() -> GeneratorOutput:
        async with serving() as client:
            wrapper = Wrapper(client)
            out = await generator(wrapper, tokenizer, config()).generate(batch("guess_number", 3))
        assert wrapper.calls and all(c["return_packed_body"] is True for c in wrapper.calls)
        assert counts == {"splice": len(wrapper.calls), "decode": len(wrapper.calls)}
        return out

    out = run(main())
    check_consistent(out, 3)  # logprobs arrive (negative) for every generated token
    assert out.routed_experts is not None


def test_routes_off_requests_and_keeps_nothing_about_routes(tokenizer):
    async def main() -> None:
        async with serving() as client:
            wrapper = Wrapper(client)
            out = await generator(wrapper, tokenizer, config(return_routed_experts=False)).generate(
                batch("guess_number", 3)
            )
        check_consistent(out, 3)
        assert out.routed_experts is None
        assert not any(k.startswith("generate/route") for k in out.rollout_metrics)
        assert wrapper.calls and all(
            c["return_routed_experts"] is False
            and c["routed_experts_prompt_start"] is None
            and c["return_packed_body"] is False
            for c in wrapper.calls
        )

    run(main())


def test_token_budget_truncates_ids_masks_logprobs_and_routes_together(tokenizer):
    async def main() -> None:
        async with serving() as client:
            cfg = config(max_turns=4, max_tokens_per_turn=8, max_response_tokens=20)
            gen = generator(client, tokenizer, cfg, stop_token_ids=())
            out = await gen.generate(batch("gen_test_echo", 2))
        check_consistent(out, 2)
        for i in range(2):
            p = len(out.prompt_token_ids[i])
            assert out.stop_reasons[i] == "budget" and len(out.response_ids[i]) == 20
            assert out.loss_masks[i] == [1] * 8 + [0] * 12  # the observation is what got cut
            assert out.routed_experts[i].shape[0] == p + 8 - 1
            assert out.token_rewards[i][7] == out.rewards[i] == 0.25
        assert out.rollout_metrics["generate/stop_budget"] == 1.0

    run(main())


class TurnPaysEnv(BaseTextEnv):
    """Turn t pays 10**t, so each turn's reward is told apart in the output."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.max_turns = 3

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        return {
            "observations": [{"role": "user", "content": "ok"}],
            "reward": 10.0 ** (self.turns - 1),
            "done": self.turns >= self.max_turns,
            "metadata": {},
        }


def test_each_turns_reward_sits_on_that_turns_last_reply_token(tokenizer):
    async def main() -> None:
        async with serving() as client:
            cfg = config(return_routed_experts=False, max_tokens_per_turn=2)
            gen = generator(client, tokenizer, cfg, stop_token_ids=())
            prompt = [{"role": "user", "content": "go"}]
            out = await gen.generate(
                GeneratorInput([prompt] * 2, ["gen_test_turn_pays"] * 2, [{}, {}])
            )
        check_consistent(out, 2)
        for i in range(2):
            masks = out.loss_masks[i]
            ends = [
                j for j, m in enumerate(masks) if m and (j + 1 == len(masks) or not masks[j + 1])
            ]
            assert [out.token_rewards[i][j] for j in ends] == [1.0, 10.0, 100.0]
            assert out.rewards[i] == 111.0

    skyrl_gym.register("gen_test_turn_pays", TurnPaysEnv)
    try:
        run(main())
    finally:
        skyrl_gym.deregister("gen_test_turn_pays")


def test_several_clients_round_robin_and_seeds_are_reproducible(tokenizer):
    async def main() -> None:
        async with serving() as client:
            a, b = Wrapper(client), Wrapper(client)
            gen = generator([a, b], tokenizer, config(max_concurrent_trajectories=2))
            await gen.generate(batch("gen_test_echo", 4, turns=2))
            first = await generator(client, tokenizer, config()).generate(batch("guess_number", 4))
            again = await generator(client, tokenizer, config()).generate(batch("guess_number", 4))
            gen = generator(client, tokenizer, config())
            await gen.generate(batch("guess_number", 4))
            second = await gen.generate(batch("guess_number", 4))

        def echoed(w: Wrapper) -> set[str]:
            return {tokenizer.decode(c["prompt_token_ids"][6:12]) for c in w.calls}

        # Trajectory i talks to client i mod 2 on every turn.
        assert len(a.calls) == len(b.calls) == 4
        assert echoed(a) == {"echo 0", "echo 2"} and echoed(b) == {"echo 1", "echo 3"}
        assert first.response_ids == again.response_ids  # same seed, same call number
        assert first.response_ids != second.response_ids  # the next call samples afresh

    run(main())


def test_a_calls_seed_gives_a_new_generators_first_call_seeds(tokenizer):
    """The loop keeps one generator per run and passes each round's seed."""

    async def main() -> tuple[list[int], list[int]]:
        async with serving() as client:
            kept, fresh = Wrapper(client), Wrapper(client)
            gen = generator(kept, tokenizer, config(), seed=5)
            await gen.generate(batch("guess_number", 3))
            kept.calls.clear()
            await gen.generate(batch("guess_number", 3), seed=7)
            await generator(fresh, tokenizer, config(), seed=7).generate(batch("guess_number", 3))
        return (
            sorted(c["sampling_params"]["seed"] for c in kept.calls),
            sorted(c["sampling_params"]["seed"] for c in fresh.calls),
        )

    kept, fresh = run(main())
    assert kept == fresh and len(set(kept)) == len(kept) > 0


def test_bad_inputs_fail_before_any_request(tokenizer):
    wrapper = Wrapper(ScriptedClient())
    # A node built in Python skipped launch validation: the constructor checks it.
    with pytest.raises(
        ConfigValidationError, match=r"^generator.max_turns: expected an int >= 1, got 0"
    ):
        generator(wrapper, tokenizer, config(max_turns=0))
    with pytest.raises(ConfigValidationError, match=r"^generator.sampling_params.temperature"):
        generator(wrapper, tokenizer, config(temperature=-1.0))
    # The server refuses a top_k wider than the vocabulary on every request.
    with pytest.raises(
        ConfigValidationError, match=r"^generator.sampling_params.top_k: .* got 300"
    ):
        generator(wrapper, tokenizer, config(top_k=300), vocab_size=264)
    bad_eval = config()
    bad_eval.eval_sampling_params.temperature = -1.0  # checked only where it is used
    generator(wrapper, tokenizer, bad_eval)
    with pytest.raises(ConfigValidationError, match=r"^generator.eval_sampling_params.temp"):
        generator(wrapper, tokenizer, bad_eval, evaluation=True)
    gen = generator(wrapper, tokenizer, config())
    with pytest.raises(skyrl_gym.EnvError, match="make.id"):
        run(gen.generate(GeneratorInput([[{"role": "user", "content": "x"}]], ["nope"])))
    with pytest.raises(ValueError, match="expected env_names and env_extras of length 2"):
        run(gen.generate(GeneratorInput([[], []], ["guess_number"])))
    assert wrapper.calls == []


class SolveEnv(BaseTextEnv):
    """Solved at turn ``solve_on`` (-1: never); ``report=False`` never says ``solved``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.max_turns = 3
        self.solve_on, self.report = extras.get("solve_on", -1), extras.get("report", True)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        solved = self.turns - 1 == self.solve_on
        metadata = {"solved": solved} if self.report else {}
        done = solved or self.turns >= self.max_turns
        return {
            "observations": [] if done else [{"role": "user", "content": "no"}],
            "reward": 0.0,
            "done": done,
            "metadata": metadata,
        }


class ScriptedClient:
    """No server: every request gets the same two tokens back."""

    supported_logprobs_modes = ("raw_logprobs", "processed_logprobs")

    async def generate(self, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(
            response_ids=[65, 66], logprobs=[-0.5, -0.5], finish_reason="stop", routed_experts=None
        )


def test_evaluation_samples_with_the_eval_params_and_requests_no_routes(tokenizer):
    cfg = config(temperature=0.7, top_k=5)  # routes on, for training

    async def main(evaluation: bool) -> Wrapper:
        async with serving() as client:
            wrapper = Wrapper(client)
            gen = generator(wrapper, tokenizer, cfg, evaluation=evaluation)
            await gen.generate(batch("repeat_letter", 2))
        return wrapper

    for evaluation, sampling, routed in ((False, (0.7, 5), True), (True, (0.0, -1), False)):
        calls = run(main(evaluation)).calls
        assert calls and all(
            (c["sampling_params"]["temperature"], c["sampling_params"]["top_k"]) == sampling
            and c["return_routed_experts"] is routed
            for c in calls
        )
        # Training asks for the sampler's own logprobs and its kept sets (top_k wide).
        mode, support = ("raw_logprobs", 0) if evaluation else ("processed_logprobs", 5)
        assert all(
            c["sampling_params"]["logprobs_mode"] == mode and c["return_sample_support"] == support
            for c in calls
        )


def test_kept_sets_line_up_with_every_response_token_and_collate(tokenizer):
    from skyrl_train.dataset.preprocess import convert_to_training_batch

    cfg = config(temperature=1.5, top_k=5, max_turns=3)

    async def main() -> GeneratorOutput:
        async with serving() as client:
            return await generator(client, tokenizer, cfg).generate(batch("guess_number", 4))

    out = run(main())
    assert out.rollout_sample_support is not None
    for ids, mask, rows in zip(
        out.response_ids, out.loss_masks, out.rollout_sample_support, strict=True
    ):
        assert rows.shape == (len(ids), 5)
        for token, generated, row in zip(ids, mask, rows, strict=True):
            kept = row[row >= 0].tolist()
            assert (token in kept) if generated else kept == []
    assert any(0 in m for m in out.loss_masks)  # observations were appended
    collated = convert_to_training_batch(out, pad_token_id=0)
    assert collated.sample_support is not None and collated.sample_support.shape[2] == 5


def test_solved_comes_from_step_metadata(tokenizer):
    skyrl_gym.register("gen_test_solve", SolveEnv)
    try:
        gen = generator(ScriptedClient(), tokenizer, config(return_routed_experts=False))
        extras = [{"solve_on": 1}, {"solve_on": -1}, {"report": False}]
        prompt = [{"role": "user", "content": "go"}]
        out = run(gen.generate(GeneratorInput([prompt] * 3, ["gen_test_solve"] * 3, extras)))
        # solved on its second turn (after an unsolved one); never; never reported
        assert out.solved == [True, False, None]
        assert [len(m) - sum(m) > 0 for m in out.loss_masks] == [True, True, True]
        silent = [{"report": False}] * 2
        out = run(gen.generate(GeneratorInput([prompt] * 2, ["gen_test_solve"] * 2, silent)))
        assert out.solved is None
    finally:
        skyrl_gym.deregister("gen_test_solve")


@pytest.mark.parametrize("clients", [[], ()])
def test_no_clients_is_refused_as_a_callers_mistake(tokenizer, clients):
    with pytest.raises(ValueError, match=r"^clients: expected at least one client, got none$"):
        generator(clients, tokenizer, config())
