"""Starting or joining Ray for a launch, without opening it to the network.

A plain local ``ray.init()`` binds GCS, raylet and every worker to all interfaces
(``*:port``) and, before Ray 2.59, runs without authentication: an earlier launch of
this project that also set ``RAY_AUTH_MODE=disabled`` let a process on another host
join through the node's address and run a task in 1.6 s. So a local launch here

- binds every Ray process to 127.0.0.1: Ray takes loopback as the node address only
  when its "clusters enabled" switch is off (it otherwise resolves 127.0.0.1 to the
  host's outward address and the gRPC servers listen on every interface), and
- keeps Ray's token authentication on: Ray 2.59+ turns it on for a new local cluster
  when ``RAY_AUTH_MODE`` is unset, generating ``~/.ray/auth_token`` on first use.

Joining a cluster (``ray.address``) uses that cluster's own authentication: set
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` (or the token file) as the cluster's
nodes have them, before the launch starts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass
class RaySession:
    """What ``start_ray`` did; ``shutdown`` undoes exactly that."""

    started: bool
    """True when this launch started a local Ray (and so must shut it down)."""
    node_ip: str

    def shutdown(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
        self.started = False


def start_ray(
    *, address: str | None, num_cpus: int | None, runtime_env: Mapping[str, Any]
) -> RaySession:
    """Joins ``address`` or starts a loopback-only, token-authenticated local Ray of
    ``num_cpus`` CPUs (None: Ray counts them; ignored when joining a cluster).

    An already initialised Ray (a test, a notebook) is used as it is and left running.
    """
    import ray

    if ray.is_initialized():
        return RaySession(started=False, node_ip=ray.util.get_node_ip_address())
    env = dict(runtime_env) or None
    if address is not None:
        with _loopback_stays_loopback(_is_loopback_address(address)):
            ray.init(address=address, runtime_env=env, include_dashboard=False)
        return RaySession(started=True, node_ip=ray.util.get_node_ip_address())

    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() == "disabled":
        logger.warning(
            "RAY_AUTH_MODE=disabled: this local Ray runs without token authentication; "
            "it listens on %s only, but any local user can run code in it",
            LOOPBACK,
        )
    _init_on_loopback(num_cpus=num_cpus, runtime_env=env)
    session = RaySession(started=True, node_ip=ray.util.get_node_ip_address())
    if not ipaddress.ip_address(session.node_ip).is_loopback:
        # A Ray release that changed how it picks the node address: never run open.
        session.shutdown()
        raise RuntimeError(
            f"ray.init: expected a local Ray on {LOOPBACK}, got node address "
            f"{session.node_ip!r}; refusing to run a cluster reachable from the network"
        )
    return session


def _init_on_loopback(*, num_cpus: int | None, runtime_env: dict[str, Any] | None) -> None:
    import ray

    with _loopback_stays_loopback(True):
        ray.init(
            # "local": a new instance even where a `ray start` cluster runs on this
            # machine; without it ray.init joins that cluster (and refuses num_cpus).
            address="local",
            num_cpus=num_cpus,
            runtime_env=runtime_env,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
        )


def _is_loopback_address(address: str) -> bool:
    """``ray.address`` names a cluster on this machine's loopback (``127.0.0.1:6379``,
    ``localhost:6379``); ``auto`` and outward addresses do not."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _loopback_stays_loopback(on: bool) -> Iterator[None]:
    """Ray reads this switch when it resolves addresses during ``ray.init``: on (Linux's
    default), it rewrites 127.0.0.1 to the host's outward address, where neither this
    launch's Ray nor a loopback-only cluster listens (a join then fails "Failed to
    connect to GCS"); off, a loopback node address stays loopback and every gRPC
    server of this process binds to it."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    if on:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


_RESERVE_WARN_S = 60.0
"""How often a placement group that Ray has not placed yet is logged as waiting."""


def reserve_bundles(
    bundles: list[dict[str, float]],
    *,
    strategy: str,
    key: str,
    timeout_s: float,
    timeout_key: str,
) -> Any:
    """A Ray placement group of ``bundles`` placed by ``strategy`` (the config ``key``
    that asked for it), once Ray has placed it. Ray queues one that does not fit
    without a message; every minute of waiting logs the key and the alive nodes'
    CPUs (a cluster may still autoscale, as ``require_cpus`` assumes). Not placed
    within ``timeout_s`` (the config ``timeout_key``): the group is removed and a
    ``ConfigValidationError`` names ``key``, what could not be placed and the nodes,
    since a queued group otherwise waits forever (seen: an export of a two-node run's
    checkpoint on a one-node Ray)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from skyrl_train.errors import ConfigValidationError

    group = placement_group(bundles, strategy=strategy)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if group.wait(timeout_seconds=max(0.0, min(_RESERVE_WARN_S, left))):
            return group
        what = f"{len(bundles)} bundles of {bundles[0] if bundles else {}}"
        if time.monotonic() >= deadline:
            remove_placement_group(group)
            raise ConfigValidationError(
                key,
                expected=f"Ray to place {what} by {strategy} within {timeout_key} "
                f"({timeout_s:g} s)",
                got=f"not placed; alive nodes: {_alive_nodes()}",
            )
        logger.warning(
            "%s=%s: waiting for Ray to place %s (%s: %g s); alive nodes: %s",
            key,
            strategy,
            what,
            timeout_key,
            timeout_s,
            _alive_nodes(),
        )


def _alive_nodes() -> str:
    import ray

    return ", ".join(
        f"{node['NodeID'][:8]}: {node['Resources'].get('CPU', 0.0):g} CPUs"
        for node in ray.nodes()
        if node["Alive"]
    )


def require_cpus(requests: Mapping[str, tuple[int, float]], *, local: bool) -> None:
    """Refuse a launch whose actors cannot all be scheduled at once.

    ``requests`` maps a config key to (actors, CPUs each), e.g.
    ``{"trainer.placement.cpus_per_trainer": (2, 1.0)}``. Ray queues an actor that does
    not fit and the others wait for it: trainer ranks block in their rendezvous
    forever (seen: two ranks of 1 CPU beside a 1-CPU server on a 2-CPU machine hung
    without a message). A local Ray cannot grow, so a shortfall is an error naming the
    keys; a cluster may autoscale, so there it is only logged.
    """
    import ray

    from skyrl_train.errors import ConfigValidationError

    have = float(ray.cluster_resources().get("CPU", 0.0))
    want = sum(count * each for count, each in requests.values())
    if want <= have + 1e-9:
        return
    parts = " + ".join(f"{count} x {each:g} ({key})" for key, (count, each) in requests.items())
    error = ConfigValidationError(
        max(requests, key=lambda k: requests[k][0] * requests[k][1]),
        expected=f"the actors' CPUs to fit Ray's {have:g} (ray.num_cpus, or what Ray counted)",
        got=f"{parts} = {want:g}",
    )
    if not local:
        logger.warning("%s; waiting for the cluster to provide them", error.reason)
        return
    raise error


def rendezvous_url() -> str:
    """A torch ``init_method`` URL where a job's other ranks meet this process.

    On a local Ray (node address on loopback, so every rank is on this machine) a file
    in a fresh private folder: no TCP store, which would listen on every interface,
    and no free-port probe to race. On a cluster, this node's address and a port
    probed free on it.
    """
    import ray

    node_ip = ray.util.get_node_ip_address()
    if ipaddress.ip_address(node_ip).is_loopback:
        folder = tempfile.mkdtemp(prefix="skyrl-rendezvous-")
        return f"file://{folder}/store"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Probed then released: gloo binds it moments later, a small race that a
        # TCP rendezvous cannot avoid.
        sock.bind(("", 0))
        port = int(sock.getsockname()[1])
    return f"tcp://{node_ip}:{port}"
