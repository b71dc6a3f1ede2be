"""The run's inference engines: started as Ray actors on the run's checkpoint folder
(``generator.inference_engine.backend``: our server or a stock vLLM server per engine),
or the servers the user started (``remote_urls``); stopped, every process of them,
whatever ended the run.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_train.config.schema import InferenceEngineConfig

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 60.0
"""A vLLM stop waits up to 15 s for SIGTERM and 5 s after SIGKILL (``VLLMServerProcess``);
killing the actor before that returns would skip the group kill."""
_KEY = "generator.inference_engine"


@dataclass
class Engines:
    """The URLs to generate against and push weights to, and the actors this launch
    started for them (none with ``remote_urls``)."""

    config: InferenceEngineConfig
    sample_support_k: int = 0
    """The widest kept set a rollout asks for (``generator.max_sample_support_k``): the
    builtin server's own limit on ``return_sample_support`` is raised to it."""
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
            handle, url = (
                self._start_vllm(checkpoint, api_key)
                if eng.backend == "vllm"
                else self._start_builtin(checkpoint, api_key)
            )
            self.handles.append(handle)
            self.urls.append(url)
            logger.info("inference engine %d (%s): %s", i, eng.backend, url)

    def _start_builtin(self, checkpoint: Path, api_key: str) -> tuple[Any, str]:
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
        )

    def _start_vllm(self, checkpoint: Path, api_key: str) -> tuple[Any, str]:
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
        )
        handle, url, _ = create_vllm_server_actor(spec, num_cpus=eng.num_cpus_per_engine)
        return handle, url

    def check_alive(self) -> None:
        """Raise, naming the engine and its exit, when a started server ended on its
        own: called after a run failed, so a killed server is reported as such rather
        than as the connection error it caused."""
        import ray

        dead = []
        for i, handle in enumerate(self.handles):
            try:
                if self.config.backend != "vllm":
                    ray.get(handle.url.remote(), timeout=30)  # raises once the actor died
                    continue
                code = ray.get(handle.exit_code.remote(), timeout=30)
                if code is None:
                    continue
                tail = ray.get(handle.log_tail.remote(20), timeout=30)
                dead.append(
                    f"engine {i} ({self.urls[i]}): the vLLM server exited with code {code}; "
                    f"its last log lines:\n{tail}"
                )
            except Exception as exc:  # the actor itself is gone
                dead.append(f"engine {i} ({self.urls[i]}): its actor is gone ({exc!r})")
        if dead:
            raise RuntimeError(
                f"{_KEY}: expected every {self.config.backend} engine to run until the end, "
                f"got {len(dead)} that stopped mid-run: " + "\n".join(dead)
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
