"""The gym generator: multi-turn rollouts against inference servers, kept as tokens.

Per trajectory: build its environment as SkyRL's generator does (``make(env_class,
env_config=environment.skyrl_gym.<env_class>, extras=<the row's fields>)``), render the
prompt once; each turn send the whole conversation with ``routed_experts_prompt_start
= trace.prompt_start``, append the sampled tokens (loss mask 1, their logprobs), step
the environment on the decoded text, render its observation once and append it (loss
mask 0, logprob 0.0). Stop on done, max turns or the response token budget. Many
trajectories run at once (bounded by a semaphore); with several servers, trajectory i
always talks to server i mod n.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import skyrl_gym
from inference.errors import GenerateProtocolError
from skyrl_train.config.constraints import check_constraints
from skyrl_train.config.engine_rules import check_sampling_params
from skyrl_train.config.schema import (
    GeneratorConfig,
    SamplingParamsConfig,
    support_request_width,
)
from skyrl_train.errors import ConfigValidationError, RouteTraceError
from skyrl_train.generators.base import (
    EVALUATION_LOGPROBS_MODES,
    TRAINING_LOGPROBS_MODES,
    Episode,
    GenerateClient,
    GeneratorInput,
    GeneratorOutput,
    choose_logprobs_mode,
    reported_solved,
)
from skyrl_train.generators.postprocess import replace_reply
from skyrl_train.generators.rendering import ChatTemplateRenderer, ObservationRenderer
from skyrl_train.generators.rollout_metrics import environment_metrics, trajectory_metrics
from skyrl_train.generators.traces import RoutedExpertTrace
from skyrl_train.generators.trajectory import (
    STOP_BUDGET,
    STOP_DONE,
    Trajectory,
)


class GymGenerator:
    """``async generate(GeneratorInput) -> GeneratorOutput`` over one or more servers."""

    def __init__(
        self,
        clients: GenerateClient | Sequence[GenerateClient],
        tokenizer: Any,
        config: GeneratorConfig,
        *,
        seed: int = 0,
        evaluation: bool = False,
        progress: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        renderer: ObservationRenderer | None = None,
        vocab_size: int | None = None,
        env_configs: Mapping[str, Any] | None = None,
    ) -> None:
        """``config``: the ``generator`` node, read as it is (never copied).
        ``seed``: request seeds derive from (seed, generate call, trajectory, turn).
        ``evaluation``: sample with ``eval_sampling_params`` and request no routes;
        otherwise ``sampling_params``, with routes iff
        ``inference_engine.enable_return_routed_experts`` (R3; off, nothing about
        routes is sent or kept). Either way the logprobs mode is the first of the
        purpose's (``TRAINING_LOGPROBS_MODES``, ``EVALUATION_LOGPROBS_MODES``) that
        every client supports. ``progress``: a tqdm bar over finished trajectories.
        ``stop_token_ids``: None means the renderer's end-of-turn token.
        ``vocab_size``: the model's; with top-p alone every position's kept set is
        asked for this wide (None: ``max_sample_support_k`` wide). ``env_configs``:
        the ``environment.skyrl_gym`` node (each environment gets its own entry)."""
        self.clients = list(clients) if isinstance(clients, Sequence) else [clients]
        if not self.clients:
            # A caller's mistake, not a config key: no key holds the clients.
            raise ValueError("clients: expected at least one client, got none")
        # A node built in Python skipped launch validation: refuse it here, not mid-run.
        check_constraints(config, prefix="generator")
        sampling = "eval_sampling_params" if evaluation else "sampling_params"
        self.sampling: SamplingParamsConfig = getattr(config, sampling)
        check_sampling_params(self.sampling, f"generator.{sampling}", vocab_size=vocab_size)
        self.config = config
        self.return_routed_experts = (
            not evaluation and config.inference_engine.enable_return_routed_experts
        )
        # Asked of the clients, not fixed per purpose: a vLLM server reports one mode.
        self.logprobs_mode = choose_logprobs_mode(
            self.clients,
            EVALUATION_LOGPROBS_MODES if evaluation else TRAINING_LOGPROBS_MODES,
            purpose="evaluation" if evaluation else "training",
        )
        self.support_k = (
            0
            if evaluation
            else support_request_width(
                self.sampling,
                cap=min(config.max_sample_support_k, vocab_size or config.max_sample_support_k),
            )
        )
        self.env_configs = env_configs
        self.seed = seed
        self.progress = progress
        self.tokenizer = tokenizer
        self.renderer = renderer if renderer is not None else ChatTemplateRenderer(tokenizer)
        stops = self.renderer.stop_token_ids if stop_token_ids is None else stop_token_ids
        self._stop_ids = list(stops)
        self._calls = 0
        """generate() calls so far: seeds differ per call, so GRPO steps that revisit a
        prompt sample afresh, yet a rerun of the same sequence of calls is identical."""

    async def generate(
        self,
        batch: GeneratorInput,
        *,
        seed: int | None = None,
        make_env: Callable[..., Episode] | None = None,
    ) -> GeneratorOutput:
        """Roll out every prompt of ``batch``. ``seed``: request seeds derive from it as
        a new generator's first call with that seed would, so a caller keeping one
        generator for a run (sampling checked once) still chooses each call's seeds.
        ``make_env(name, env_config=..., extras=...)`` builds each trajectory's
        environment (None: ``skyrl_gym.make``). Calls may overlap: each keeps its seeds to itself (the
        evaluation command runs one call per dataset row)."""
        n = len(batch.prompts)
        self._calls += 1
        call_key = (self.seed, self._calls) if seed is None else (seed, 1)
        if len(batch.env_names) != n or (batch.env_extras and len(batch.env_extras) != n):
            raise ValueError(
                f"GeneratorInput: expected env_names and env_extras of length {n} (prompts), "
                f"got {len(batch.env_names)} and {len(batch.env_extras)}"
            )
        extras = batch.env_extras or [{} for _ in range(n)]
        # Environments are built up front so a bad name or kwarg fails before any request.
        make = skyrl_gym.make if make_env is None else make_env
        envs = [
            skyrl_gym.make_task_env(
                name,
                kw,
                env_configs=self.env_configs,
                max_turns=self.config.max_turns,
                factory=make,
            )
            for name, kw in zip(batch.env_names, extras, strict=True)
        ]
        episode_metrics: list[dict[str, Any]] = [{} for _ in range(n)]
        gate = asyncio.Semaphore(self.config.max_concurrent_trajectories)
        bar = _progress(n, enabled=self.progress)
        started = time.perf_counter()

        async def one(i: int) -> Trajectory:
            async with gate:
                try:
                    traj = await self._rollout(
                        i, batch.prompts[i], envs[i], batch.env_names[i], call_key
                    )
                    episode_metrics[i] = dict(getattr(envs[i], "get_metrics", dict)())
                    return traj
                finally:
                    # A stand-in environment (a test's, the evaluation's watch) may lack it.
                    getattr(envs[i], "close", lambda: None)()
                    if bar is not None:
                        bar.update(1)

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            trajectories = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if bar is not None:
                bar.close()
        output = self._output(trajectories, wall_s=time.perf_counter() - started)
        output.rollout_metrics.update(environment_metrics(batch.env_names, episode_metrics))
        return output

    async def _rollout(
        self,
        index: int,
        prompt: list[dict[str, str]],
        env: Episode,
        env_name: str,
        call_key: tuple[int, int],
    ) -> Trajectory:
        cfg = self.config
        messages, _info = env.init(prompt)
        traj = Trajectory(
            index=index, prompt_ids=self.renderer.initial(messages), call_key=call_key
        )
        if self.support_k:
            traj.support = []
        if self.return_routed_experts:
            traj.trace = RoutedExpertTrace(f"#{index}")
        client = self.clients[index % len(self.clients)]
        for turn in range(cfg.max_turns):
            room = cfg.max_response_tokens - len(traj.response_ids)
            if room < 1:
                traj.stop_reason = STOP_BUDGET
                break
            sent = traj.tokens
            result = await self._request(
                client, traj, turn, sent, max_tokens=min(cfg.max_tokens_per_turn, room)
            )
            generated = list(result.response_ids)
            if traj.trace is not None:
                traj.trace.record_generation(
                    prompt_token_count=len(sent),
                    generated_token_count=len(generated),
                    routed_experts=result.routed_experts,
                )
            traj.append(
                generated,
                mask=1,
                logprobs=result.logprobs,
                support=self._kept_sets(result, traj, turn) if self.support_k else None,
            )
            traj.turns += 1
            traj.length_finishes += result.finish_reason == "length"
            traj.versions.append(_turn_versions(result))
            reply = self.tokenizer.decode(generated, skip_special_tokens=True)
            step = skyrl_gym.read_step_output(env.step(reply), env=env_name, turn=turn)
            at = None
            if step.postprocessed_action is not None and step.postprocessed_action != reply:
                at = replace_reply(
                    traj,
                    self.tokenizer,
                    generated=generated,
                    replacement=step.postprocessed_action,
                    prompt_tokens=len(sent),
                )
            traj.score_turn(step.reward, at=at)
            if "solved" in step.metadata:
                traj.solved = bool(traj.solved) or bool(step.metadata["solved"])
            if step.done:
                traj.stop_reason = STOP_DONE
                break
            if turn == cfg.max_turns - 1:
                break
            before = traj.tokens
            extended = self.renderer.extend(before, step.observations)
            _check_extends(traj.index, turn + 1, before, extended)
            traj.append(
                extended[len(before) :], mask=0, logprobs=[0.0] * (len(extended) - len(before))
            )
            if len(traj.response_ids) >= cfg.max_response_tokens:
                # No room left to generate: cut the observation, not the policy's tokens.
                traj.truncate(cfg.max_response_tokens)
                traj.stop_reason = STOP_BUDGET
                break
        if traj.trace is not None:
            traj.routes = traj.trace.finalize(
                token_count=len(traj.tokens), loss_mask=[0] * len(traj.prompt_ids) + traj.loss_mask
            ).captured_routes
        return traj

    async def _request(
        self,
        client: GenerateClient,
        traj: Trajectory,
        turn: int,
        sent: list[int],
        *,
        max_tokens: int,
    ) -> Any:
        sp = self.sampling
        params = {
            "max_tokens": max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "seed": _request_seed(*traj.call_key, traj.index, turn),
            "stop_token_ids": self._stop_ids,
            "logprobs_mode": self.logprobs_mode,
        }
        trace = traj.trace
        try:
            result = await client.generate(
                prompt_token_ids=sent,
                sampling_params=params,
                return_routed_experts=trace is not None,
                routed_experts_prompt_start=None if trace is None else trace.prompt_start,
                # A routed reply is spliced anyway; with ids and logprobs as envelopes
                # too it parses in 0.12x the time of the lean body's naive parse, the
                # lean body's splice in 0.37x (scripts/bench_wire.py, docs/performance.md).
                # vLLM cannot send them (its client refuses the option).
                return_packed_body=trace is not None and client.supports_packed_body,
                return_sample_support=self.support_k,
            )
        except Exception as exc:
            exc.add_note(f"while generating trajectory #{traj.index} turn {turn}")
            raise
        if not result.response_ids:
            raise RouteTraceError(
                f"trajectory #{traj.index} turn {turn}: response_ids",
                expected="at least one generated token",
                got="none",
            )
        return result

    def _kept_sets(self, result: Any, traj: Trajectory, turn: int) -> np.ndarray:
        """``[G, k]`` kept-set rows of one reply, refused when the reply's side channel
        could not hold a position's whole set."""
        where = f"trajectory #{traj.index} turn {turn}"
        ids, sizes = result.sample_support_ids, result.sample_support_size
        generated = len(result.response_ids)
        if ids is None or sizes is None or ids.shape[0] != generated:
            raise GenerateProtocolError(
                f"$.choices[0].rollout_sample_support ({where})",
                f"[{generated}, {self.support_k}] kept-set rows and their sizes",
                None if ids is None else ids.shape,
            )
        widest = int(np.max(sizes)) if len(sizes) else 0
        if widest > ids.shape[1]:
            raise ConfigValidationError(
                "generator.max_sample_support_k",
                expected=f"at least the sampler's widest kept set ({widest} tokens at {where})",
                got=str(ids.shape[1]),
            )
        return ids.astype(np.int32, copy=False)

    def _output(self, trajs: list[Trajectory], *, wall_s: float) -> GeneratorOutput:
        with_logprobs = all(t.logprobs is not None for t in trajs)
        routes = [t.routes for t in trajs] if self.return_routed_experts else None
        spans = [_version_span(t.versions) for t in trajs]
        return GeneratorOutput(
            prompt_token_ids=[t.prompt_ids for t in trajs],
            response_ids=[t.response_ids for t in trajs],
            loss_masks=[t.loss_mask for t in trajs],
            rewards=[t.reward for t in trajs],
            token_rewards=[t.token_rewards() for t in trajs],
            stop_reasons=[t.stop_reason for t in trajs],
            rollout_metrics=trajectory_metrics(trajs, wall_s=wall_s),
            rollout_logprobs=[t.logprobs for t in trajs] if with_logprobs else None,  # type: ignore[misc]
            routed_experts=routes,  # type: ignore[arg-type]
            rollout_sample_support=[t.support_rows() for t in trajs] if self.support_k else None,
            solved=reported_solved([t.solved for t in trajs]),
            policy_versions=None if None in spans else spans,  # type: ignore[arg-type]
            turn_versions=[[None if v is None else list(v) for v in t.versions] for t in trajs],
        )


def _turn_versions(result: Any) -> tuple[int, ...] | None:
    """Every policy version one reply carries. A result without the fields (a stand-in,
    an older client) has none; one with only ``policy_version`` has that one."""
    versions = getattr(result, "policy_versions", None)
    if versions is not None:
        return tuple(versions)
    version = getattr(result, "policy_version", None)
    return None if version is None else (version,)


def _version_span(versions: list[tuple[int, ...] | None]) -> tuple[int, int] | None:
    """(oldest, newest) policy version over all of a trajectory's turns, tokens within
    a turn included; None if any turn's server reported none."""
    if not versions or any(not v for v in versions):
        return None
    every = [v for turn in versions if turn for v in turn]
    return min(every), max(every)


def _request_seed(seed: int, call: int, index: int, turn: int) -> int:
    return int(np.random.SeedSequence([seed, call, index, turn]).generate_state(1)[0])


def _check_extends(index: int, turn: int, before: list[int], after: list[int]) -> None:
    """The next prompt must start with every token so far, or routes would misalign."""
    if after[: len(before)] == before:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
        min(len(before), len(after)),
    )
    got = after[at] if at < len(after) else "the end of the prompt"
    raise RouteTraceError(
        f"trajectory #{index} turn {turn}: prompt_token_ids[{at}]",
        expected=f"{before[at]} (the prompt must extend the previous turn's {len(before)} tokens)",
        got=str(got),
    )


def _progress(total: int, *, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollouts", unit="traj", leave=False)
