"""The CPU inference engine: a transformers MoE causal LM with route capture.

Serves any family of ``inference.models.families`` (Qwen3-MoE, Qwen2-MoE, OLMoE,
Mixtral) from a checkpoint folder. ``generate`` is a batching front: requests from
concurrent callers that arrive within ``batch_window_ms`` (up to ``max_batch_size``)
share one batched run in a single worker thread, so the asyncio loop stays responsive
and throughput grows with load (a forward at batch 64 costs ~3x one at batch 1 on the
built-in model). The window closes early once ``max_batch_size`` requests wait: a full
batch gains nothing by waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from inference.engine.base import EngineInfo, EngineOutput, EngineRequest, check_policy_version
from inference.engine.capture import RouteCapture
from inference.engine.decode import run_batch, validate_request
from inference.engine.weights import export_weights, load_named_tensors, parameter_shapes
from inference.errors import RequestValidationError
from inference.models.architecture import MoEArchitecture
from inference.models.batch_invariant import enable_batch_invariance
from inference.models.families import family_named
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from inference.models.tokenizer import EOS_TOKEN_ID

__all__ = ["HFMoEEngine", "resolve_dtype"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")


class HFMoEEngine:
    """``InferenceEngine`` over a transformers MoE causal LM on CPU.

    Build with ``from_pretrained`` (a checkpoint folder of any supported family: the
    normal path) or ``from_config`` (random init from ``TinyMoEConfig``, for tests).
    bf16 by default, as inference engines run; pass ``dtype="float32"`` for exact
    comparisons. ``architecture`` defaults to ``describe(model.config)``, which needs
    the config's ``architectures`` (every saved checkpoint has it).

    ``eos_token_ids`` all stop a request (a checkpoint's generation config may list
    several); ``pad_token_id`` fills the left padding of prompts.

    ``batch_invariant`` (default on) switches the model to the forward of
    ``inference.models.batch_invariant``: a request's output then depends on its
    prompt and seed only, not on what the batching front put next to it. Off is the
    stock transformers forward, where 61 of 64 seeded bf16 prompts changed tokens
    between running alone and in one batch (scripts/bench_batch_invariance.py).
    """

    def __init__(
        self,
        model: Any,
        *,
        architecture: MoEArchitecture | None = None,
        model_name: str = "tiny-moe",
        eos_token_ids: Sequence[int] = (EOS_TOKEN_ID,),
        pad_token_id: int = EOS_TOKEN_ID,
        max_batch_size: int = 64,
        batch_window_ms: float = 5.0,
        num_threads: int | None = 1,
        batch_invariant: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected an int >= 1, got {max_batch_size!r}")
        if not batch_window_ms >= 0:
            raise ValueError(f"batch_window_ms: expected a number >= 0, got {batch_window_ms!r}")
        vocab = model.config.vocab_size
        if isinstance(eos_token_ids, int) or not all(
            isinstance(i, int) and 0 <= i < vocab for i in eos_token_ids
        ):
            raise ValueError(
                f"eos_token_ids: expected a sequence of token ids in [0, {vocab}), "
                f"got {eos_token_ids!r}"
            )
        if architecture is None:
            from inference.models.families import describe

            architecture = describe(model.config)
        if num_threads is not None:
            # Two threads on the shared 2-core CI machine ran 35x slower than one.
            torch.set_num_threads(num_threads)
        if batch_invariant:
            enable_batch_invariance(model)
        self.model = model.eval()
        self.architecture = architecture
        self.dtype = next(model.parameters()).dtype
        self._info = EngineInfo(
            model_name=model_name,
            # The route tensor's layer axis (and /health's): MoE layers only.
            num_layers=architecture.num_moe_layers,
            num_experts=architecture.num_experts,
            top_k=architecture.num_experts_per_tok,
            vocab_size=vocab,
            dtype=str(self.dtype).removeprefix("torch."),
            batch_invariant=batch_invariant,
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_window_ms = batch_window_ms
        self.capture = RouteCapture(
            model,
            num_experts=architecture.num_experts,
            moe_layers=architecture.moe_layers,
            capture_point=family_named(architecture.family).capture_point,
        )
        # One worker thread: the model and its hooks are not safe to run concurrently.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-engine")
        self._model_lock = threading.Lock()
        # Read and written under _model_lock only, so a batch runs under one version.
        self._policy_version = 0
        self._pending: list[tuple[EngineRequest, asyncio.Future[EngineOutput]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._closed = False

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: TinyMoEConfig | None = None,
        *,
        seed: int = 0,
        dtype: str | torch.dtype = torch.bfloat16,
        **options: Any,
    ) -> HFMoEEngine:
        """The built-in Qwen3-MoE model, randomly initialised from ``seed`` (tests)."""
        config = config or TinyMoEConfig()
        model = build_hf_model(config, seed=seed, dtype=resolve_dtype(dtype))
        return cls(model, architecture=config.architecture(), **options)

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, *, dtype: str | torch.dtype = torch.bfloat16, **options: Any
    ) -> HFMoEEngine:
        """A checkpoint folder of any supported family (``AutoModelForCausalLM``, local
        files only), checked first by ``inspect_checkpoint``, whose
        ``CheckpointFormatError`` (a missing file, an unsupported family) propagates.

        EOS and pad ids come from the checkpoint unless ``options`` name them.
        """
        from transformers import AutoModelForCausalLM

        from inference.models.checkpoint import inspect_checkpoint

        info = inspect_checkpoint(folder)
        model = AutoModelForCausalLM.from_pretrained(
            str(info.path), dtype=resolve_dtype(dtype), local_files_only=True
        )
        options.setdefault("eos_token_ids", info.eos_token_ids)
        options.setdefault("pad_token_id", info.pad_token_id)
        engine = cls(model, architecture=info.architecture, **options)
        engine.checkpoint = info.path
        return engine

    checkpoint: Path | None = None
    """The folder ``from_pretrained`` read, whose tokenizer ``save_pretrained`` copies."""

    def save_pretrained(self, folder: str | Path, *, with_tokenizer: bool = True) -> Path:
        """Writes a checkpoint ``from_pretrained`` (and ``AutoTokenizer``) can load.

        The tokenizer is the source checkpoint's when the engine was loaded from one,
        else the built-in byte tokenizer (``from_config``).
        """
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        with self._model_lock:
            self.model.save_pretrained(str(path))
        if with_tokenizer:
            if self.checkpoint is not None:
                from inference.models.checkpoint import load_checkpoint_tokenizer

                load_checkpoint_tokenizer(self.checkpoint).save_pretrained(str(path))
            else:
                from inference.models.tokenizer import save_byte_tokenizer

                save_byte_tokenizer(path)
        return path

    # -- InferenceEngine ----------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    def validate(self, requests: Sequence[EngineRequest]) -> None:
        """Raises ``RequestValidationError`` for the first bad field (``requests[i]...``)."""
        cfg = self.model.config
        for i, req in enumerate(requests):
            validate_request(
                req,
                field=f"requests[{i}]",
                vocab_size=cfg.vocab_size,
                max_positions=cfg.max_position_embeddings,
            )

    def generate_sync(self, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
        """Blocking generation of ``requests`` in batches of ``max_batch_size``."""
        self._check_open()
        reqs = list(requests)
        self.validate(reqs)
        outputs: list[EngineOutput] = []
        for lo in range(0, len(reqs), self.max_batch_size):
            outputs.extend(self._run(reqs[lo : lo + self.max_batch_size]))
        return outputs

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
        self._check_open()
        reqs = list(requests)
        self.validate(reqs)
        if not reqs:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[EngineOutput]] = [loop.create_future() for _ in reqs]
        self._ensure_dispatcher(loop)
        self._pending.extend(zip(reqs, futures, strict=True))
        assert self._wake is not None and self._full is not None
        self._wake.set()
        if len(self._pending) >= self.max_batch_size:
            self._full.set()
        return list(await asyncio.gather(*futures))

    @property
    def policy_version(self) -> int:
        """The policy version of the weights serving now (0 at start)."""
        return self._policy_version

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        policy_version: int | None = None,
    ) -> int:
        """Loads engine-layout tensors between batches; see ``load_named_tensors``.

        With ``policy_version`` the version changes under the same model lock as the
        copy, once every tensor is in: a batch (which holds that lock for its whole
        run) sees the old weights and version or the new ones, never a mix. A version
        below the current one is a ``RequestValidationError`` (status 409), and nothing
        is loaded then.
        """
        self._check_open()
        if policy_version is not None:
            check_policy_version(policy_version, field="policy_version")
        with self._model_lock:
            if policy_version is not None and policy_version < self._policy_version:
                raise RequestValidationError(
                    "policy_version",
                    f"an int >= {self._policy_version} (the engine's version)",
                    policy_version,
                    status=409,
                )
            count = load_named_tensors(self.model, named_tensors)
            if policy_version is not None:
                self._policy_version = policy_version
            return count

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """What ``load_weights`` accepts (``DescribesWeights``), without copying."""
        return parameter_shapes(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of all weights in engine layout (for tests and weight sync)."""
        with self._model_lock:
            return export_weights(self.model)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dispatcher is not None and not self._dispatcher.done():
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except (asyncio.CancelledError, RuntimeError):
                pass
        self._fail_pending(RuntimeError("engine closed before the request ran"))
        self._executor.shutdown(wait=True)
        self.capture.remove()

    # -- batching front -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: expected an open engine, got one that was closed")

    def _run(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        with self._model_lock:
            return run_batch(
                self.model,
                requests,
                capture=self.capture,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                policy_version=self._policy_version,
            )

    def _ensure_dispatcher(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop and self._dispatcher is not None and not self._dispatcher.done():
            return
        # A new event loop (tests run several) gets its own event and dispatcher;
        # requests left from a dead loop cannot be answered there.
        self._fail_pending(RuntimeError("engine: the event loop of this request ended"))
        self._loop = loop
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._dispatcher = loop.create_task(self._dispatch_forever(), name="moe-engine-batcher")

    async def _dispatch_forever(self) -> None:
        assert self._wake is not None and self._full is not None and self._loop is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._full.clear()
            if 0 < len(self._pending) < self.max_batch_size and self.batch_window_ms > 0:
                # Let concurrent callers join, until the window ends or a batch is full.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.batch_window_ms / 1000)
            while self._pending:
                # Requests that arrive while a batch runs queue up and form the next.
                batch = self._pending[: self.max_batch_size]
                del self._pending[: self.max_batch_size]
                live = [(r, f) for r, f in batch if not f.done()]
                if not live:
                    continue
                try:
                    outs = await self._loop.run_in_executor(
                        self._executor, self._run, [r for r, _ in live]
                    )
                except Exception as exc:  # the batch failed: every caller hears why
                    for _, fut in live:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), out in zip(live, outs, strict=True):
                    if not fut.done():
                        fut.set_result(out)

    def _fail_pending(self, exc: Exception) -> None:
        pending, self._pending = self._pending, []
        for _, fut in pending:
            if not fut.done() and not fut.get_loop().is_closed():
                fut.set_exception(exc)
