"""The run's inference engines: started as Ray actors on the run's checkpoint folder
(``generator.inference_engine.backend``: our server or a stock vLLM server per engine),
or the servers the user started (``remote_urls``); stopped, every process of them,
whatever ended the run.

Each started server writes its own log to ``<log_dir>/engine-<i>.log`` (a launch passes
``<run_dir>/engines``), which nothing deletes; an engine that stops mid-run ends the
launch with ``EngineStoppedError`` naming it, with that log's last lines
(docs/vllm.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.errors import EngineStoppedError, log_excerpt
from skyrl_train.config.schema import InferenceEngineConfig

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 60.0
"""A vLLM stop waits up to 15 s for SIGTERM and 5 s after SIGKILL (``VLLMServerProcess``);
killing the actor before that returns would skip the group kill."""
_KEY = "generator.inference_engine"
_TAIL_LINES = 40
"""Last log lines quoted per stopped engine, after the log's first error."""


def engine_log(log_dir: Path, index: int) -> Path:
    """Engine ``index``'s log file under ``log_dir``."""
    return log_dir / f"engine-{index}.log"


@dataclass
class Engines:
    """The URLs to generate against and push weights to, and the actors this launch
    started for them (none with ``remote_urls``)."""

    config: InferenceEngineConfig
    sample_support_k: int = 0
    """The widest kept set a rollout asks for (``generator.max_sample_support_k``): the
    builtin server's own limit on ``return_sample_support`` is raised to it."""
    log_dir: Path | None = None
    """Where each started server writes ``engine-<i>.log``; None: the builtin server
    logs nowhere and vLLM in a private temporary folder that ``stop`` removes."""
    urls: list[str] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)
    handles: list[Any] = field(default_factory=list)

    def start(self, checkpoint: Path, *, api_key: str) -> None:
        """Start ``num_engines`` servers on ``checkpoint`` with the run's ``api_key``, or
        take ``remote_urls`` and the key from ``remote_api_key_env``. Each handle is
        kept as soon as it exists, so ``stop`` ends the ones started before a failure."""
        eng = self.config
        if eng.remote_urls:
            self.urls = list(eng.remote_urls)
            env = eng.remote_api_key_env
            # Validated non-empty before Ray started; read only now, never stored in cfg.
            self.api_key = os.environ[env] if env is not None else None
            return
        self.api_key = api_key
        for i in range(eng.num_engines):
            log = None if self.log_dir is None else str(engine_log(self.log_dir, i))
            handle, url = (
                self._start_vllm(checkpoint, api_key, log)
                if eng.backend == "vllm"
                else self._start_builtin(checkpoint, api_key, log)
            )
            self.handles.append(handle)
            self.urls.append(url)
            logger.info("inference engine %d (%s): %s, log %s", i, eng.backend, url, log)

    def _start_builtin(self, checkpoint: Path, api_key: str, log: str | None) -> tuple[Any, str]:
        from inference.server.actor import create_server_actor
        from inference.server.app import ServerConfig
        from inference.server.launch import EngineSpec

        eng = self.config
        spec = EngineSpec(
            checkpoint=str(checkpoint),
            dtype=eng.dtype,
            model_name=eng.model_name,
            max_batch_size=eng.max_batch_size,
            batch_window_ms=eng.batch_window_ms,
            batch_invariant=eng.batch_invariant,
        )
        return create_server_actor(
            spec,
            ServerConfig(
                host=eng.host,
                port=eng.port,
                api_key=api_key,
                max_sample_support_k=max(ServerConfig.max_sample_support_k, self.sample_support_k),
            ),
            num_cpus=eng.num_cpus_per_engine,
            log_file=log,
        )

    def _start_vllm(self, checkpoint: Path, api_key: str, log: str | None) -> tuple[Any, str]:
        from inference.vllm.actor import create_vllm_server_actor
        from inference.vllm.spec import VLLMServerSpec

        eng, vllm = self.config, self.config.vllm
        spec = VLLMServerSpec(
            checkpoint=str(checkpoint),
            python=vllm.python,
            host=eng.host,
            port=eng.port,
            api_key=api_key,
            dtype=eng.dtype,
            kv_cache_memory_bytes=vllm.kv_cache_memory_bytes,
            startup_timeout_s=vllm.startup_timeout_s,
            extra_flags=dict(vllm.engine_init_kwargs),
            log_file=log,
        )
        handle, url, _ = create_vllm_server_actor(spec, num_cpus=eng.num_cpus_per_engine)
        return handle, url

    def check_alive(self) -> None:
        """Raise ``EngineStoppedError``, naming each engine this launch started that no
        longer serves (its process exited, its actor died, ``/health`` is not 200) with
        its log's first error and last lines: called after a run failed, so a dead engine is reported as
        such rather than as the connection error or HTTP 500 it caused."""
        import ray

        stopped = []
        for i, handle in enumerate(self.handles):
            log = None if self.log_dir is None else engine_log(self.log_dir, i)
            try:
                reason = ray.get(handle.failure.remote(), timeout=30)
                if reason is None:
                    continue
                excerpt = ray.get(handle.log_excerpt.remote(_TAIL_LINES), timeout=30)
            except Exception as exc:  # the actor itself is gone: read its log here
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                reason = f"its actor is gone ({type(exc).__name__}: {first})"
                excerpt = "" if log is None else log_excerpt(log, _TAIL_LINES)
            stopped.append(
                (f"engine {i} ({self.urls[i]})", reason, excerpt, None if log is None else str(log))
            )
        if stopped:
            raise EngineStoppedError(
                f"{_KEY}: expected every {self.config.backend} engine to run until the end, "
                f"got {len(stopped)} that stopped mid-run:",
                stopped,
            )

    def stop(self) -> None:
        """Stop and remove every actor this launch started (each server's whole process
        group); one that fails to stop does not keep the others alive."""
        import ray

        for handle in self.handles:
            try:
                ray.get(handle.stop.remote(), timeout=_STOP_TIMEOUT_S)
            except Exception as exc:
                logger.warning("inference server did not stop cleanly: %r", exc)
            ray.kill(handle)
        self.handles.clear()
