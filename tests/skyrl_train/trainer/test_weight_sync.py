"""WeightSyncer: buckets, fan-out to every server, and delta mode's snapshot."""

from __future__ import annotations

import asyncio

import pytest
import torch

from skyrl_train.trainer.weight_sync import WeightSyncer


class RecordingClient:
    """Stands in for RemoteGenerateClient.update_weights (the HTTP path is covered by
    the server tests and the end-to-end run)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        self.calls.append({k: v.clone() for k, v in named_tensors.items()})
        return len(named_tensors)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(16, 16) for i in range(5)}


def _push(syncer: WeightSyncer, clients: list[RecordingClient], weights: dict) -> object:
    return asyncio.run(syncer.push(clients, iter(weights.items())))


def test_full_mode_sends_every_tensor_to_every_server_in_buckets() -> None:
    weights = _weights()
    clients = [RecordingClient(), RecordingClient()]
    syncer = WeightSyncer(mode="full", bucket_bytes=2 * 16 * 16 * 4)
    stats = _push(syncer, clients, weights)
    assert stats.tensors_total == stats.tensors_sent == 5
    assert stats.bytes_sent == 5 * 16 * 16 * 4
    for client in clients:
        assert [len(call) for call in client.calls] == [2, 2, 1]
        received = {k: v for call in client.calls for k, v in call.items()}
        assert received.keys() == weights.keys()
        assert all(torch.equal(received[k], weights[k]) for k in weights)
    assert stats.requests == 6
    again = _push(syncer, clients, weights)
    assert again.tensors_sent == 5  # full mode never skips


def test_delta_mode_sends_only_tensors_that_changed_since_the_last_push() -> None:
    weights = _weights()
    client = RecordingClient()
    syncer = WeightSyncer(mode="delta", max_threads=2)
    assert _push(syncer, [client], weights).tensors_sent == 5
    assert _push(syncer, [client], weights).tensors_sent == 0
    # In place, as an optimizer step changes live parameters: the snapshot must be a
    # copy, or the change would be invisible.
    weights["layer3.weight"].add_(1.0)
    stats = _push(syncer, [client], weights)
    assert stats.tensors_sent == 1
    assert list(client.calls[-1]) == ["layer3.weight"]
    assert torch.equal(client.calls[-1]["layer3.weight"], weights["layer3.weight"])


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="trainer.weight_sync.mode"):
        WeightSyncer(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightSyncer(bucket_bytes=0)
