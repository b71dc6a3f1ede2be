"""``sampling_params.logprobs_mode`` over HTTP: the processed logprobs equal log q
recomputed from the same request's raw kept-set logprobs, the support side channel
carries processed values and each position's kept-set size."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import orjson

from inference.client import RemoteGenerateClient

GEN = "/skyrl/v1/generate"
PROMPT = [72, 101, 108, 108, 111]


def _generate(live_server, **options: Any) -> Any:
    async def main() -> Any:
        async with RemoteGenerateClient(live_server.url, api_key=live_server.api_key) as client:
            return await client.generate(prompt_token_ids=PROMPT, **options)

    return asyncio.run(main())


def test_processed_logprobs_are_log_q_of_the_raw_kept_set(live_server) -> None:
    params = {"max_tokens": 12, "temperature": 2.0, "top_k": 5, "seed": 7}
    raw = _generate(
        live_server,
        sampling_params={**params, "logprobs_mode": "raw_logprobs"},
        return_sample_support=5,
    )
    processed = _generate(
        live_server,
        sampling_params={**params, "logprobs_mode": "processed_logprobs"},
        return_sample_support=5,
    )
    assert processed.response_ids == raw.response_ids  # the mode only changes reports
    assert np.array_equal(processed.sample_support_ids, raw.sample_support_ids)
    assert (processed.sample_support_size == 5).all() and processed.sample_support_size.shape == (
        len(processed.response_ids),
    )
    # log q_t = raw_t / T - logsumexp over the kept set of raw / T (log Z cancels).
    scaled = raw.sample_support_logprobs.astype(np.float64) / 2.0
    log_z = np.log(np.exp(scaled).sum(axis=1))
    want_support = scaled - log_z[:, None]
    assert np.allclose(processed.sample_support_logprobs, want_support, atol=2e-3)
    token_col = [
        int(np.flatnonzero(ids == t)[0])
        for ids, t in zip(raw.sample_support_ids, raw.response_ids, strict=True)
    ]
    want = want_support[np.arange(len(token_col)), token_col]
    assert np.allclose(processed.logprobs, want, atol=2e-3)
    assert np.allclose(
        raw.logprobs, raw.sample_support_logprobs[np.arange(len(token_col)), token_col]
    )
    assert not np.allclose(processed.logprobs, raw.logprobs, atol=0.05)


def test_a_support_narrower_than_the_kept_set_shows_its_size(live_server) -> None:
    reply = _generate(
        live_server,
        sampling_params={"max_tokens": 6, "temperature": 1.0, "top_k": 12, "seed": 1},
        return_sample_support=4,
    )
    assert (reply.sample_support_size == 12).all()
    assert (reply.sample_support_ids >= 0).all() and reply.sample_support_ids.shape[1] == 4


def test_an_unknown_mode_is_refused_naming_the_field(live_server) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"logprobs_mode": "processed"}}

    async def main() -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {live_server.api_key}"}
        async with aiohttp.ClientSession() as session:
            async with session.post(live_server.url + GEN, json=body, headers=headers) as r:
                return r.status, orjson.loads(await r.read())

    status, reply = asyncio.run(main())
    assert status == 400
    assert reply["error"]["field"] == "$.sampling_params.logprobs_mode"
    assert reply["error"]["message"] == (
        "$.sampling_params.logprobs_mode: expected one of ['raw_logprobs', "
        "'processed_logprobs'], got 'processed'"
    )
