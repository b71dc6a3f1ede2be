"""Weight sync from the trainer to every inference server, streamed in buckets.

The trainer's export yields engine-layout tensors one at a time; they are grouped
into buckets of at most ``bucket_bytes`` so peak extra memory stays one bucket (two
for a versioned push, which holds one back; plus, in delta mode, the snapshot of what
the servers already hold), and every bucket goes to all servers concurrently. Delta
mode compares each tensor with the last one sent and sends only those that changed:
frozen or untouched tensors (embeddings of bytes never sampled under a sparse
optimizer, frozen layers) then cost nothing.

A push given a ``policy_version`` lands on each server as one step, however many
buckets it takes: every bucket but the last is staged (``X-Weight-Commit: false``) and
the last commits them all with ``X-Policy-Version: v`` (every bucket names v, so a
server drops the staging of a push that was abandoned half way). Replies generated
meanwhile still come from the previous version's weights, tagged with that version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference.client.protocol import WeightUpdateClient
from inference.engine.base import check_policy_version
from skyrl_train.config.schema import WeightSyncConfig
from skyrl_train.utils.cpu_topology import pool_workers
from skyrl_train.utils.parallel import fill_batch_rows

SYNC_MODES = ("full", "delta")


@dataclass
class SyncStats:
    tensors_total: int
    tensors_sent: int
    bytes_sent: int
    requests: int
    seconds: float


class WeightSyncer:
    """Pushes engine-layout weights to clients (``WeightUpdateClient``: the builtin
    server's ``RemoteGenerateClient`` or vLLM's ``VLLMClient``).

    Clients are passed per push because an aiohttp session belongs to one event loop,
    while the delta snapshot must outlive the loop of any single sync.
    """

    def __init__(
        self,
        *,
        mode: str = "full",
        bucket_bytes: int = 32 << 20,
        max_threads: int = 2,
    ) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"trainer.weight_sync.mode: expected 'full' or 'delta', got {mode!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes: expected >= 1, got {bucket_bytes}")
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        # Comparing tensors for delta mode is the CPU-heavy part; size its pool like
        # every other pool here, so it does not oversubscribe a node shared with Ray.
        self.workers = pool_workers(cap=max_threads, reserved=0)
        self._sent: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, node: WeightSyncConfig) -> WeightSyncer:
        """The syncer ``trainer.weight_sync`` describes (bucket size: the default)."""
        return cls(mode=node.mode, max_threads=node.max_threads)

    async def push(
        self,
        clients: Sequence[WeightUpdateClient],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        policy_version: int | None = None,
    ) -> SyncStats:
        """Sends ``named_tensors`` to every client; with ``policy_version`` the servers
        load the whole push in one step as that version (see the module docstring)."""
        check_policy_version(policy_version, field="policy_version", optional=True)
        start = time.perf_counter()
        total = sent = nbytes = requests = 0
        # Delta snapshot of a versioned push: recorded once the commit succeeded, so a
        # push that fails half way is sent whole again next time.
        pending: dict[str, torch.Tensor] = {}
        held: list[tuple[str, torch.Tensor]] | None = None
        last: tuple[str, torch.Tensor] | None = None

        async def send(bucket: list[tuple[str, torch.Tensor]], *, commit: bool) -> None:
            nonlocal sent, nbytes, requests
            payload = dict(bucket)
            options: dict[str, Any] = {}
            if policy_version is not None:
                options["policy_version"] = policy_version
            if not commit:
                options["commit"] = False
            await asyncio.gather(*(c.update_weights(payload, **options) for c in clients))
            for name, tensor in bucket:
                if self.mode == "delta":
                    # A clone: exported tensors may be views of live parameters,
                    # which the next optimizer step would change under the snapshot.
                    snapshot = pending if policy_version is not None else self._sent
                    snapshot[name] = tensor.clone()
                nbytes += tensor.numel() * tensor.element_size()
            sent += len(bucket)
            requests += len(clients)

        for bucket in self._buckets(named_tensors):
            total += len(bucket)
            last = bucket[-1]
            changed = self._changed(bucket)
            if not changed:
                continue
            if policy_version is None:
                await send(changed, commit=True)
                continue
            # One bucket behind: only at the end is it known which bucket is the last.
            if held is not None:
                await send(held, commit=False)
            held = changed
        if policy_version is not None:
            if held is None:
                # Nothing changed (delta mode): the version must still advance, and an
                # upload carries at least one tensor, so the last one goes again.
                if last is None:
                    raise ValueError(
                        "named_tensors: expected at least one tensor to carry policy "
                        f"version {policy_version}, got none"
                    )
                held = [last]
            await send(held, commit=True)
            self._sent.update(pending)
        return SyncStats(total, sent, nbytes, requests, time.perf_counter() - start)

    def _buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            tensor = tensor.detach().to("cpu").contiguous()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _changed(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if self.mode == "full":
            return bucket
        same = [False] * len(bucket)

        def compare(i: int) -> None:
            name, tensor = bucket[i]
            previous = self._sent.get(name)
            same[i] = previous is not None and torch.equal(previous, tensor)

        fill_batch_rows(compare, len(bucket), workers=self.workers)
        return [item for item, unchanged in zip(bucket, same, strict=True) if not unchanged]
