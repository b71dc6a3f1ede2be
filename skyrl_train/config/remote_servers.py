"""Launch rules that read the remote servers themselves (``remote_urls``).

A builtin server the user started (``python -m inference.server``) caps the kept set a
request may ask for at its ``--max-sample-support-k`` (64 by default), and reports the
cap on ``/health`` (``limits.max_sample_support_k``). A training rollout with a top-k or
top-p cut asks every request for ``support_request_width`` ids per token; above the cap
the server refuses every request, after Ray and every actor have started. This rule
reads each server's cap first, and only when a cut makes the width matter.
"""

from __future__ import annotations

import asyncio
from typing import Any

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.schema import PPOConfig, support_request_width
from skyrl_train.errors import ConfigValidationError

SAMPLING = "generator.sampling_params"
URLS = "generator.inference_engine.remote_urls"
FLAG = "--max-sample-support-k"
UNREPORTED_CAP = 64
"""The cap of a builtin server whose ``/health`` reports none: every server before the
flag had exactly this one, fixed."""
PROBE_ATTEMPTS = 3
PROBE_DEADLINE_S = 15.0
"""A server that does not answer ``/health`` within this would not answer the first
rollout either; the launch says so instead of starting Ray."""


def check_remote_support_cap(cfg: PPOConfig, arch: MoEArchitecture) -> None:
    """Refuse a training cut wider than a builtin ``remote_urls`` server's cap, naming
    the sampling key, the server, its cap and the flag that raises it."""
    engine = cfg.generator.inference_engine
    sampling = cfg.generator.sampling_params
    if engine.backend != "builtin" or not engine.remote_urls:
        return
    cap_k = min(cfg.generator.max_sample_support_k, arch.vocab_size)
    width = support_request_width(sampling, cap=cap_k)
    if width == 0:
        return  # no cut: no kept sets are asked for
    key, value = (
        (f"{SAMPLING}.top_k", sampling.top_k)
        if sampling.top_k > 0
        else (f"{SAMPLING}.top_p", sampling.top_p)
    )
    for i, url in enumerate(engine.remote_urls):
        health = _health(url, key=f"{URLS}[{i}]", why=f"{key}={value}")
        cap, reported = _reported_cap(health)
        if width > cap:
            source = (
                "its /health limits.max_sample_support_k"
                if reported
                else f"it reports none on /health; servers before {FLAG} cap it at {cap}"
            )
            raise ConfigValidationError(
                key,
                expected=f"a cut whose kept set fits the builtin server {url} ({URLS}[{i}]), "
                f"which caps it at {cap} ids per token ({source}); restart that server with "
                f"{FLAG} {width} or more, or cut with a top_k <= {cap}",
                got=f"{value}, which asks every request for {width} ids per token",
            )


def _reported_cap(health: dict[str, Any]) -> tuple[int, bool]:
    limits = health.get("limits")
    cap = limits.get("max_sample_support_k") if isinstance(limits, dict) else None
    if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1:
        return cap, True
    return UNREPORTED_CAP, False


def _health(url: str, *, key: str, why: str) -> dict[str, Any]:
    """``url``'s ``/health`` document (it needs no token), or a refusal naming ``key``."""
    from inference.client import RemoteGenerateClient, RetryPolicy
    from inference.errors import InferenceError

    retry = RetryPolicy(
        max_attempts=PROBE_ATTEMPTS,
        attempt_timeout_s=PROBE_DEADLINE_S,
        deadline_s=PROBE_DEADLINE_S,
    )

    async def probe() -> dict[str, Any]:
        async with RemoteGenerateClient(url, retry=retry) as client:
            return await client.health()

    try:
        return asyncio.run(probe())
    except (InferenceError, OSError) as exc:
        raise ConfigValidationError(
            key,
            expected=f"a builtin server answering /health, to read the kept-set cap that {why} "
            "needs",
            got=f"{url!r}: {type(exc).__name__}: {exc}",
        ) from exc
