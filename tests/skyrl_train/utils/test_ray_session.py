"""A local launch's Ray: loopback only, token authentication on, shut down after; a
placement group it cannot make is refused at its deadline."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_train.utils.ray_session import start_ray

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from _e2e import listening_sockets, process_tree  # noqa: E402


def _join_attempt(gcs_address: str, env: dict[str, str], *, wait_s: float) -> tuple[bool, str]:
    """Tries ``ray.init(address=...)`` in another process; (joined, its stderr)."""
    code = f"import ray; ray.init(address={gcs_address!r}); print('JOINED', flush=True)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        # Ray retries a refused handshake for minutes; being refused for this long
        # with the auth error in its log is the answer.
        proc.kill()
        out, err = proc.communicate()
    return "JOINED" in out, err


def test_local_ray_listens_on_loopback_and_refuses_a_wrong_token(tmp_path: Path) -> None:
    session = start_ray(address=None, num_cpus=1, runtime_env={})
    try:
        assert session.started and session.node_ip == "127.0.0.1"

        @ray.remote
        def node_ip() -> str:
            return ray.util.get_node_ip_address()

        assert ray.get(node_ip.remote()) == "127.0.0.1"
        gcs = ray.get_runtime_context().gcs_address
        sockets = listening_sockets(process_tree(os.getpid()))
        assert int(gcs.rsplit(":", 1)[1]) in {port for _, _, port in sockets}
        exposed = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
        assert exposed == [], exposed

        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token" * 4, HOME=str(tmp_path))
        # From outside: Ray's client turns 127.0.0.1 into this host's outward address,
        # as a process on another machine would use, and finds nothing listening.
        joined, err = _join_attempt(gcs, env, wait_s=12)
        assert not joined
        assert "Failed to connect to GCS" in err, err[-2000:]
        # From this machine, on loopback itself: the wrong token is refused.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        joined, err = _join_attempt(gcs, env, wait_s=12)
        assert not joined
        assert "InvalidAuthToken" in err or "Unauthenticated" in err, err[-2000:]
    finally:
        session.shutdown()
    assert not ray.is_initialized()


def test_an_initialised_ray_is_used_and_left_running_and_refuses_an_unplaceable_group(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # ray.address=null starts a local Ray even where another is announced on this
    # machine (RAY_ADDRESS, or the file a `ray start` writes): ray.init() alone joins
    # that one, and refuses num_cpus there.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    session = start_ray(address=None, num_cpus=1, runtime_env={})
    assert session.started and ray.get_runtime_context().gcs_address != "127.0.0.1:9"
    try:
        again = start_ray(address=None, num_cpus=1, runtime_env={})
        assert not again.started
        again.shutdown()
        assert ray.is_initialized()
        # On the same one-node Ray: a Ray start costs seconds on the 2-core machine.
        _an_unplaceable_group_is_refused_at_its_deadline(monkeypatch, caplog)
        _an_actors_error_reaches_the_caller_as_itself()
    finally:
        session.shutdown()
    assert not ray.is_initialized()


def _an_actors_error_reaches_the_caller_as_itself() -> None:
    """Before the trees pickled by their attributes, a rank's ConfigValidationError
    reached the driver as Ray's UnserializableException (``tests/test_errors_pickle.py``)."""
    from inference.errors import GenerateTransportError
    from skyrl_train.errors import DatasetError

    class Failing:  # defined here: pickled by value, the test module is not importable there
        def config(self) -> None:
            raise DatasetError(
                "data.train_data[0]",
                "/d.parquet",
                row=4,
                field="prompt",
                expected="a list",
                got="3",
            )

        def transport(self) -> None:
            raise GenerateTransportError("connection reset")

    actor = ray.remote(num_cpus=0)(Failing).remote()
    with pytest.raises(DatasetError) as info:
        ray.get(actor.config.remote())
    assert (info.value.path, info.value.row, info.value.field) == (
        "data.train_data[0]",
        4,
        "prompt",
    )
    assert "prompt: expected a list, got 3" in str(info.value)
    with pytest.raises(GenerateTransportError, match="connection reset"):
        ray.get(actor.transport.remote())
    ray.kill(actor)


def _an_unplaceable_group_is_refused_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A local Ray has one node: two bundles STRICT_SPREAD can never be placed, and Ray
    queues the group without a message (an export of the two-node recipe's checkpoint
    waited forever). The wait is logged, then refused naming the key, the group
    removed; a group Ray can place is returned."""
    from skyrl_train.errors import ConfigValidationError
    from skyrl_train.utils import ray_session

    monkeypatch.setattr(ray_session, "_RESERVE_WARN_S", 0.5)
    keys = {"key": "trainer.placement.strategy", "timeout_key": "trainer.placement.timeout_s"}
    with (
        caplog.at_level("WARNING", logger=ray_session.__name__),
        pytest.raises(ConfigValidationError) as info,
    ):
        ray_session.reserve_bundles(
            [{"CPU": 0.5}] * 2, strategy="STRICT_SPREAD", timeout_s=2.0, **keys
        )
    assert info.value.path == "trainer.placement.strategy"
    message = str(info.value)
    assert "2 bundles of {'CPU': 0.5} by STRICT_SPREAD" in message, message
    assert "within trainer.placement.timeout_s (2 s)" in message, message
    assert "alive nodes: " in message and ": 1 CPUs" in message, message
    assert "trainer.placement.strategy=STRICT_SPREAD: waiting for Ray" in caplog.text
    states = {g["state"] for g in ray.util.placement_group_table().values()}
    assert states == {"REMOVED"}, states
    group = ray_session.reserve_bundles([{"CPU": 0.5}] * 2, strategy="PACK", timeout_s=60, **keys)
    assert ray.util.placement_group_table(group)["state"] == "CREATED"
    ray.util.remove_placement_group(group)


def test_auth_disabled_by_the_user_is_honoured_with_a_warning(monkeypatch, caplog) -> None:
    from skyrl_train.utils import ray_session

    calls = []
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_session, "_init_on_loopback", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    with caplog.at_level("WARNING", logger=ray_session.__name__):
        session = start_ray(address=None, num_cpus=1, runtime_env={})
    assert session.started and calls == [{"num_cpus": 1, "runtime_env": None}]
    assert "without token authentication" in caplog.text


def test_a_local_ray_off_loopback_is_refused_and_shut_down(monkeypatch) -> None:
    from skyrl_train.utils import ray_session

    running: list[bool] = []  # a Ray that comes up on the outward address
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(running))
    monkeypatch.setattr(ray_session, "_init_on_loopback", lambda **kw: running.append(True))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.2")
    monkeypatch.setattr(ray, "shutdown", running.clear)
    with pytest.raises(RuntimeError, match="expected a local Ray on 127.0.0.1, got node"):
        start_ray(address=None, num_cpus=1, runtime_env={})
    assert running == []


@pytest.mark.parametrize(
    ("address", "on_loopback"),
    [
        ("127.0.0.1:6379", True),
        ("localhost:6379", True),
        ("[::1]:6379", True),
        ("192.0.2.2:6379", False),
        ("head.example:6379", False),
        ("auto", False),
    ],
)
def test_a_cluster_on_loopback_is_joined_on_loopback(
    monkeypatch, address: str, on_loopback: bool
) -> None:
    # Ray's switch on (Linux's default) rewrites 127.0.0.1 to the outward address, where
    # a loopback-only cluster does not listen (test_main_base_two_nodes.py joins one).
    from ray._private import ray_constants

    from skyrl_train.utils import ray_session

    seen = []
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(ray_constants.ENABLE_RAY_CLUSTER))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    session = ray_session.start_ray(address=address, num_cpus=None, runtime_env={})
    assert session.started and seen == [not on_loopback]
    assert ray_constants.ENABLE_RAY_CLUSTER  # restored
