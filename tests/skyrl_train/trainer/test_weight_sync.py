"""WeightSyncer: buckets, fan-out to every server, and delta mode's snapshot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from skyrl_train.trainer.weight_sync import WeightSyncer


class RecordingClient:
    """Stands in for RemoteGenerateClient.update_weights (the HTTP path is covered by
    the server tests and the end-to-end run)."""

    def __init__(self, *, fail_commits: int = 0) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self.options: list[dict[str, object]] = []
        self.fail_commits = fail_commits

    async def update_weights(self, named_tensors: dict[str, torch.Tensor], **options) -> int:
        if options.get("commit", True) and options.get("policy_version") is not None:
            if self.fail_commits:
                self.fail_commits -= 1
                raise ConnectionResetError("the commit never arrived")
        self.calls.append({k: v.clone() for k, v in named_tensors.items()})
        self.options.append(options)
        return len(named_tensors)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(16, 16) for i in range(5)}


def _push(
    syncer: WeightSyncer,
    clients: list[RecordingClient],
    weights: dict,
    policy_version: int | None = None,
) -> Any:
    return asyncio.run(syncer.push(clients, iter(weights.items()), policy_version=policy_version))


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


def test_a_versioned_push_stages_every_bucket_but_the_last_which_commits() -> None:
    weights = _weights()
    clients = [RecordingClient(), RecordingClient()]
    syncer = WeightSyncer(mode="full", bucket_bytes=2 * 16 * 16 * 4)
    stats = _push(syncer, clients, weights, policy_version=3)
    assert stats.tensors_sent == 5 and stats.requests == 6
    for client in clients:
        assert [len(call) for call in client.calls] == [2, 2, 1]
        assert client.options == [
            {"policy_version": 3, "commit": False},
            {"policy_version": 3, "commit": False},
            {"policy_version": 3},
        ]
    plain = RecordingClient()
    _push(WeightSyncer(bucket_bytes=2 * 16 * 16 * 4), [plain], weights)
    assert plain.options == [{}, {}, {}]  # no version: exactly as before versions
    with pytest.raises(ValueError, match="policy_version: expected None or an int >= 0"):
        _push(syncer, clients, weights, policy_version=-1)


def test_a_versioned_delta_push_with_nothing_changed_still_commits_the_version() -> None:
    weights = _weights()
    client = RecordingClient()
    syncer = WeightSyncer(mode="delta", bucket_bytes=2 * 16 * 16 * 4)
    _push(syncer, [client], weights, policy_version=1)
    stats = _push(syncer, [client], weights, policy_version=2)
    assert stats.tensors_sent == 1  # one tensor carries the commit
    assert list(client.calls[-1]) == ["layer4.weight"]
    assert client.options[-1] == {"policy_version": 2}
    with pytest.raises(ValueError, match="at least one tensor"):
        _push(syncer, [client], {}, policy_version=3)


def test_a_delta_push_whose_commit_failed_is_sent_whole_next_time() -> None:
    weights = _weights()
    client = RecordingClient(fail_commits=1)
    syncer = WeightSyncer(mode="delta", bucket_bytes=2 * 16 * 16 * 4)
    with pytest.raises(ConnectionResetError):
        _push(syncer, [client], weights, policy_version=1)
    client.calls.clear()
    stats = _push(syncer, [client], weights, policy_version=1)
    assert stats.tensors_sent == 5
    assert {k for call in client.calls for k in call} == set(weights)
    assert _push(syncer, [client], weights, policy_version=2).tensors_sent == 1


def test_a_versioned_push_in_several_buckets_lands_whole_on_a_real_server() -> None:
    from inference.client import RemoteGenerateClient
    from inference.engine.hf_engine import HFMoEEngine
    from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
    from inference.server import ServerConfig, start_server

    pushed = build_hf_model(TinyMoEConfig(), seed=1, dtype=torch.float32).state_dict()
    syncer = WeightSyncer(mode="full", bucket_bytes=256 << 10)  # the model is ~1.9 MB

    async def main():
        engine = HFMoEEngine.from_config(seed=0, dtype="float32")
        server = await start_server(engine, ServerConfig())
        try:
            async with RemoteGenerateClient(server.url) as client:
                stats = await syncer.push([client], iter(pushed.items()), policy_version=6)
                reply = await client.generate(
                    prompt_token_ids=[5, 6, 7], sampling_params={"max_tokens": 2}
                )
                return stats, reply, await client.health(), engine.state_dict()
        finally:
            await server.stop()

    stats, reply, health, served = asyncio.run(main())
    assert stats.requests > 2 and stats.tensors_sent == len(pushed)
    assert health["policy_version"] == 6 and reply.policy_version == 6
    assert health["counters"]["weight_updates"] == 1  # one load, however many buckets
    assert served.keys() == pushed.keys()
    assert all(torch.equal(served[name], pushed[name]) for name in pushed)


def test_the_syncer_from_its_config_node() -> None:
    from skyrl_train.config.schema import WeightSyncConfig

    syncer = WeightSyncer.from_config(WeightSyncConfig(mode="delta", max_threads=1))
    assert syncer.mode == "delta" and syncer.workers == 1
