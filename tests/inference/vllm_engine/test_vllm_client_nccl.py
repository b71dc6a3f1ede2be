"""``VLLMClient``'s weight push with the NCCL sender, the broadcast faked
(``FakeBroadcast``): the push's control flow, and an update refused before the
collective cancelling the broadcast."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from inference.errors import GenerateHTTPError
from inference.vllm.senders import NCCLBucketSender
from skyrl_train.trainer.weight_sync import WeightSyncer
from tests.inference.vllm_engine._vllm_client_helpers import (
    COMMIT,
    PUSH,
    run,
    serving,
)
from tests.inference.vllm_engine.fake_vllm import (
    FakeVLLM,
    reply_with,
)


class FakeBroadcast:
    """Rank 0 of a fake NCCL group: ``open`` and ``broadcast`` only return once the
    server side is inside the matching request, as a real collective would."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.joined = asyncio.Event()
        self.server_in_init = asyncio.Event()
        self.sent: asyncio.Queue[list[str]] = asyncio.Queue()
        self.server_in_update = asyncio.Event()
        self.closed = False
        self.init_infos: list[dict[str, Any]] = []  # what the server's workers were sent

    def worker_init_info(self) -> dict[str, Any]:
        return {
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
        }

    async def open(self) -> None:
        await asyncio.wait_for(self.server_in_init.wait(), 5)
        self.events.append(("open", None))
        self.joined.set()

    async def broadcast(self, tensors: Sequence[tuple[str, Any]]) -> None:
        await asyncio.wait_for(self.server_in_update.wait(), 5)
        self.server_in_update.clear()
        names = [name for name, _ in tensors]
        self.events.append(("broadcast", names))
        await self.sent.put(names)

    async def close(self) -> None:
        self.closed = True


def _nccl_server(fake: FakeVLLM, rank0: FakeBroadcast) -> None:
    fake.update_mode = "nccl"

    async def init(info: dict[str, Any]) -> None:
        rank0.init_infos.append(info)
        rank0.server_in_init.set()
        await asyncio.wait_for(rank0.joined.wait(), 5)  # the rendezvous needs both sides

    async def update(info: dict[str, Any]) -> None:
        rank0.server_in_update.set()
        received = await asyncio.wait_for(rank0.sent.get(), 5)
        assert received == info["names"]

    fake.nccl_init = init
    fake.nccl_update = update


def test_nccl_push_control_flow() -> None:
    rank0 = FakeBroadcast()

    async def main() -> FakeVLLM:
        async with serving(client={"sender": NCCLBucketSender(rank0)}) as (fake, vllm):
            _nccl_server(fake, rank0)
            tensors = [("a", torch.ones(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
            await WeightSyncer(bucket_bytes=8).push([vllm], tensors, policy_version=1)
            await WeightSyncer(bucket_bytes=8).push([vllm], tensors, policy_version=2)
            return fake

    fake = run(main())
    push = [*PUSH, "/update_weights", "/update_weights", *COMMIT]
    assert fake.calls() == ["/init_weight_transfer_engine", *push, *push]  # init once
    assert rank0.init_infos == [rank0.worker_init_info()]
    updates = [h.body["update_info"] for h in fake.hits if h.path == "/update_weights"]
    assert updates[:2] == [
        {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]},
        {"names": ["b"], "dtype_names": ["float32"], "shapes": [[4]]},
    ]
    assert [e for e in rank0.events if e[0] == "broadcast"] == [
        ("broadcast", ["a"]),
        ("broadcast", ["b"]),
    ] * 2
    assert fake.version == "2" and rank0.closed


def test_nccl_update_refused_before_the_collective_cancels_the_broadcast() -> None:
    rank0 = FakeBroadcast()
    cancelled: list[bool] = []

    async def never(tensors: Any) -> None:
        try:
            await asyncio.sleep(30)  # a broadcast whose peers never come
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> FakeVLLM:
        faults = {"/update_weights": [reply_with(400, {"error": "bad update_info"})]}
        async with serving(client={"sender": NCCLBucketSender(rank0)}, faults=faults) as (
            fake,
            vllm,
        ):
            _nccl_server(fake, rank0)
            rank0.broadcast = never  # type: ignore[method-assign]
            with pytest.raises(GenerateHTTPError, match="bad update_info"):
                await asyncio.wait_for(
                    vllm.update_weights({"a": torch.ones(1)}, policy_version=1), 10
                )
            return fake

    fake = run(main())
    assert cancelled == [True]
    assert fake.calls() == ["/init_weight_transfer_engine", *PUSH, "/update_weights", *COMMIT]
