"""Payloads produced by vLLM's own code, for tests that pin our reading of its formats.

vLLM is not importable in the project's environment: this runs a short script in the
vLLM venv (``$SKYRL_R3_VLLM_PYTHON``, else ``~/.cache/skyrl_r3/vllm-venv``) that
serialises fixed inputs with vLLM's ``numpy2base64`` (its ``routed_experts`` writer) and
renders whole ``/inference/v1/generate`` replies with its response models and
``JSONResponse``, exactly as its server does. Importing vLLM takes ~9 s on the 2-core
machine, so it runs once per test process (:func:`vllm_reference`), and tests skip with
the reason when the venv is absent.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

# Inputs (the arrays are built here and in the script from the same list literals).
ROUTE_ARRAYS: dict[str, tuple[str, list[int], list[int]]] = {
    # name: (dtype, shape, flat values)
    "uint8": ("uint8", [5, 3, 2], [(i * 37) % 256 for i in range(30)]),
    "uint16_small": ("uint16", [4, 2, 3], [(i * 53) % 300 for i in range(24)]),
    "uint16_large": ("uint16", [3, 2, 2], [(i * 4001) % 40000 for i in range(12)]),
    "int32": ("int32", [4, 2, 2], [i % 8 for i in range(16)]),
    "empty": ("uint8", [0, 3, 2], []),
}
# name: (token_ids, finish_reason, logprobs [(token_id, logprob, rank)] or None,
#        routes (a ROUTE_ARRAYS name) or None, weight_versions [(label, start, end)] or None)
REPLIES: dict[str, tuple[list[int], str, Any, str | None, Any]] = {
    "spanning": (
        [5, 6, 7],
        "length",
        [(5, -0.5, 1), (6, -1.25, 2), (7, -9999.0, None)],
        "uint8",
        [("default", 0, 1), ("7", 1, 3)],
    ),
    "plain": ([9], "stop", [(9, -0.125, 1)], None, None),
}

_SCRIPT = r"""
import json, sys
import numpy as np
from starlette.responses import JSONResponse
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateLogProb, GenerateLogProbs, GenerateLogProbsContent, GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.outputs import WeightVersionSpan
from vllm.utils.serial_utils import numpy2base64

spec = json.load(sys.stdin)
npy = {
    name: numpy2base64(np.array(values, dtype=dtype).reshape(shape))
    for name, (dtype, shape, values) in spec["arrays"].items()
}
bodies = {}
for name, (ids, finish, logprobs, routes, spans) in spec["replies"].items():
    content = None
    if logprobs is not None:
        content = GenerateLogProbs(content=[
            GenerateLogProbsContent(
                token_id=t, logprob=lp, rank=rank,
                top_logprobs=[] if rank is None else [GenerateLogProb(token_id=t, logprob=lp, rank=rank)],
            )
            for t, lp, rank in logprobs
        ])
    choice = GenerateTokensChoice(
        index=0, token_ids=ids, finish_reason=finish, logprobs=content,
        routed_experts=None if routes is None else npy[routes],
        weight_versions=None if spans is None else [WeightVersionSpan(*s) for s in spans],
    )
    reply = GenerateTokensResponse(request_id="r", model="m", created=1, choices=[choice])
    bodies[name] = JSONResponse(content=reply.model_dump()).body.decode()
print(json.dumps({"npy": npy, "bodies": bodies}))
"""


def vllm_python() -> str | None:
    """The vLLM venv's interpreter, or None when it is not installed."""
    explicit = os.environ.get("SKYRL_R3_VLLM_PYTHON")
    candidates = [Path(explicit)] if explicit else []
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    candidates.append(home / "skyrl_r3" / "vllm-venv" / "bin" / "python")
    for python in candidates:
        if os.access(python, os.X_OK):
            return str(python)
    return None


def route_array(name: str) -> np.ndarray:
    dtype, shape, values = ROUTE_ARRAYS[name]
    return np.array(values, dtype=dtype).reshape(shape)


@functools.lru_cache(maxsize=1)
def vllm_reference() -> dict[str, dict[str, str]] | None:
    """``{"npy": {array name: base64}, "bodies": {reply name: JSON text}}`` written by
    vLLM's code, or None when vLLM is not installed."""
    python = vllm_python()
    if python is None:
        return None
    spec = {"arrays": ROUTE_ARRAYS, "replies": REPLIES}
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run(
        [python, "-c", _SCRIPT],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM reference script failed:\n{done.stderr[-3000:]}")
    result: dict[str, dict[str, str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


SKIP_REASON = "vLLM is not installed: run scripts/install_vllm.sh (or set SKYRL_R3_VLLM_PYTHON)"
