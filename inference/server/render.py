"""One engine output -> the JSON reply bytes of a generate route (docs/design.md §2)."""

from __future__ import annotations

from typing import Any

import numpy as np

from inference.engine.base import EngineOutput, EngineRequest
from inference.wire import LOGPROB_FLOOR, PackedField, clamp_logprobs, dumps_generate_response


def render_generate_reply(
    output: EngineOutput,
    request: EngineRequest,
    *,
    model: str,
    side_channels: bool,
    packed_body: bool = False,
) -> tuple[bytes, int]:
    """The reply body and how many sampled logprobs were clamped to -9999.0.

    The reply's top-level ``policy_version`` is the engine's version when the output's
    batch ran (``EngineOutput.policy_version``), not the version serving now.

    With ``side_channels`` the choice carries every registered side-channel key, each
    an envelope when requested and null otherwise; without, none of them. With
    ``packed_body`` the token ids and sampled logprobs travel as 1-D envelopes
    (``packed_token_ids`` int32, ``packed_logprobs`` float32) and ``token_ids`` and
    ``logprobs`` are null: the client then parses no per-token JSON at all.
    """
    logprobs = clamp_logprobs(output.logprobs)
    # An engine that returned fewer logprobs than tokens is clamped per missing token,
    # so the reply still has one entry per token and the shortfall is counted.
    missing = len(output.token_ids) - len(logprobs.values)
    values = logprobs.values[: len(output.token_ids)] + [LOGPROB_FLOOR] * max(0, missing)
    clamped = logprobs.num_clamped + max(0, missing)
    choice: dict[str, Any] = {
        "index": 0,
        "token_ids": None if packed_body else output.token_ids,
        "finish_reason": output.finish_reason,
        "logprobs": None if packed_body else {"content": [{"logprob": v} for v in values]},
    }
    if packed_body:
        choice[PackedField.PACKED_TOKEN_IDS.key] = np.asarray(output.token_ids, dtype=np.int32)
        choice[PackedField.PACKED_LOGPROBS.key] = np.asarray(values, dtype=np.float32)
    if side_channels:
        routes = output.routed_experts if request.return_routed_experts else None
        if request.return_routed_experts and routes is None:
            raise RuntimeError("engine: expected routed_experts (requested), got None")
        support = request.sample_support_k > 0
        if support and (
            output.sample_support_ids is None
            or output.sample_support_logprobs is None
            or output.sample_support_size is None
        ):
            raise RuntimeError("engine: expected sample support (requested), got None")
        choice[PackedField.ROUTED_EXPERTS.key] = routes
        choice[PackedField.ROLLOUT_SAMPLE_SUPPORT.key] = (
            output.sample_support_ids if support else None
        )
        choice[PackedField.ROLLOUT_SAMPLE_SUPPORT_LOGPROBS.key] = (
            output.sample_support_logprobs if support else None
        )
        choice[PackedField.ROLLOUT_SAMPLE_SUPPORT_SIZE.key] = (
            output.sample_support_size if support else None
        )
    body = dumps_generate_response(
        [choice],
        extra={
            "model": model,
            "num_clamped_logprobs": clamped,
            "policy_version": output.policy_version,
        },
    )
    return body, clamped
