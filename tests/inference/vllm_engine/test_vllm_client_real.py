"""``VLLMClient`` against a real vLLM server (the ``vllm_server`` fixture of this folder:
``.url``, ``.api_key``, ``.checkpoint``): greedy generation equals transformers', and a
push through ``update_weights`` (engine-layout names, as the builtin server takes them)
changes what is served and the version replies report.

Skipped where vLLM is not installed (the fixture skips) or the fixture's module is
absent. The server is shared by the folder's tests: each test here starts by pushing
the checkpoint's own weights under a version of its own (another test may have left
other weights or a label that is no policy version) and leaves them served.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

pytest.importorskip(
    "inference.vllm.process", reason="the vllm_server fixture's module is not in this checkout"
)

from inference.client import RetryPolicy, VersionSpan  # noqa: E402
from inference.engine.weights import export_weights  # noqa: E402
from inference.vllm.client import VLLMClient  # noqa: E402
from skyrl_train.trainer.weight_sync import WeightSyncer  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [40, 41, 42], [7, 7, 7, 7, 7, 7], [100, 3, 250, 9]]
STEPS = 8
# bf16 serving vs the fp32 reference: a greedy step whose top two fp32 logprobs are this
# close may flip; the comparison stops there (never seen on these tiny models, but a
# random checkpoint can have one).
NEAR_TIE = 0.02
RETRY = RetryPolicy(max_attempts=3, attempt_timeout_s=120.0, deadline_s=300.0)


def _model(checkpoint: Any, *, perturb_seed: int | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    if perturb_seed is not None:
        # "A second checkpoint": the same architecture, other weights, deterministic.
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * p.float().std().nan_to_num(0.02) * torch.randn(p.shape, generator=gen))
    return model


def _greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """fp32 greedy continuation and each step's top-1 minus top-2 logprob."""
    tokens, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(STEPS):
            row = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = row.topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
    return tokens[len(prompt) :], margins


def _assert_greedy_matches(served: list[int], model: Any, prompt: list[int]) -> None:
    expected, margins = _greedy(model, prompt)
    for i, (got, want) in enumerate(zip(served, expected, strict=True)):
        if got != want:
            assert margins[i] < NEAR_TIE, (
                f"prompt {prompt} step {i}: served {served}, transformers {expected} "
                f"(fp32 margin {margins[i]:.4f})"
            )
            return


async def _push(client: VLLMClient, model: Any, version: int) -> None:
    # 64 KiB buckets: several files and /update_weights calls per push.
    await WeightSyncer(bucket_bytes=64 << 10).push(
        [client], export_weights(model).items(), policy_version=version
    )


async def _serve_all(client: VLLMClient) -> list[Any]:
    params = {"max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
    return [await client.generate(prompt_token_ids=p, sampling_params=params) for p in PROMPTS]


def test_greedy_generate_equals_transformers(vllm_server: Any) -> None:
    model = _model(vllm_server.checkpoint)

    async def main() -> list[Any]:
        async with VLLMClient(vllm_server.url, api_key=vllm_server.api_key, retry=RETRY) as client:
            await _push(client, model, 100)
            return await _serve_all(client)

    for prompt, result in zip(PROMPTS, asyncio.run(main()), strict=True):
        assert len(result.response_ids) == STEPS and result.finish_reason == "length"
        _assert_greedy_matches(result.response_ids, model, prompt)
        assert result.policy_version == 100
        assert result.policy_version_spans == [VersionSpan(100, 0, STEPS)]
        assert all(lp <= 0 for lp in result.logprobs) and result.num_clamped_logprobs == 0


def test_a_push_changes_served_greedy_and_the_reported_version(vllm_server: Any) -> None:
    first = _model(vllm_server.checkpoint)
    second = _model(vllm_server.checkpoint, perturb_seed=1)

    async def main() -> tuple[list[Any], list[Any], dict[str, Any]]:
        async with VLLMClient(vllm_server.url, api_key=vllm_server.api_key, retry=RETRY) as client:
            await _push(client, first, 200)
            before = await _serve_all(client)
            await _push(client, second, 201)
            after = await _serve_all(client)
            health = await client.health()
            await _push(client, first, 202)  # leave the fixture's weights served
            return before, after, health

    before, after, health = asyncio.run(main())
    for prompt, result in zip(PROMPTS, after, strict=True):
        _assert_greedy_matches(result.response_ids, second, prompt)
        assert result.policy_version == 201 and result.policy_versions == (201,)
    assert [r.response_ids for r in before] != [r.response_ids for r in after]
    assert all(r.policy_version == 200 for r in before)
    assert health["weight_version"] == "201" and health["policy_version"] == 201


def test_a_push_the_server_pulls_over_http(vllm_server: Any) -> None:
    """``URLBucketSender``: the worker announces itself at the handshake and fetches
    each bucket from the trainer's URL, served once per announced worker (here on
    loopback; another host is the same request to another address), and serves exactly
    what the same weights pushed as files serve."""
    from inference.vllm.senders import URLBucketSender

    first = _model(vllm_server.checkpoint)
    second = _model(vllm_server.checkpoint, perturb_seed=1)

    sender = URLBucketSender("127.0.0.1")

    async def main() -> tuple[list[Any], list[Any], int]:
        async with (
            VLLMClient(
                vllm_server.url, api_key=vllm_server.api_key, retry=RETRY, sender=sender
            ) as pulled,
            VLLMClient(vllm_server.url, api_key=vllm_server.api_key, retry=RETRY) as files,
        ):
            await _push(pulled, second, 300)
            by_url = await _serve_all(pulled)
            await _push(files, first, 301)
            await _push(files, second, 302)
            by_file = await _serve_all(files)
            await _push(files, first, 303)  # leave the fixture's weights served
            return by_url, by_file, sender.workers

    by_url, by_file, workers = asyncio.run(main())
    assert workers == 1  # the server's one worker announced itself
    assert all(r.policy_version == 300 for r in by_url)
    assert [r.response_ids for r in by_url] == [r.response_ids for r in by_file]
    assert [r.logprobs for r in by_url] == [r.logprobs for r in by_file]
    for prompt, result in zip(PROMPTS, by_url, strict=True):
        _assert_greedy_matches(result.response_ids, second, prompt)
