"""A Ray cluster of several nodes on this machine, every Ray process on 127.0.0.1: a
multi-node launch tried on one machine (docs/cluster-and-security.md).

    RAY_AUTH_MODE=token python scripts/loopback_ray_cluster.py --num-cpus 2 --num-cpus 1

One node (a raylet with its own resources) per ``--num-cpus``, the first the head. It
prints each node's id and ``ray.address=127.0.0.1:PORT``, then runs until SIGINT or
SIGTERM and stops every process it started, and only those: Ray's sessions and its
address file go to a private folder (``RAY_TMPDIR``), so a plain ``ray.init()`` of
another process on the machine never joins this cluster, and ``ray stop`` is not needed.

Why not ``ray start --head`` and ``ray start --address`` (Ray 2.60, measured): on Linux
Ray rewrites ``--node-ip-address=127.0.0.1`` to the host's outward address and the GCS
and raylet listen on every interface (``::``); with its loopback switch
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) the head stays on 127.0.0.1, but then
``ray start --address`` refuses to add a node. ``ray.cluster_utils.Cluster``, the tool
Ray's testing guide names for several nodes on one machine, starts the same processes
with the node address kept as given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading

LOOPBACK = "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--num-cpus",
        type=int,
        action="append",
        required=True,
        help="CPUs of one node; once per node, the head first",
    )
    parser.add_argument(
        "--temp-dir",
        default=None,
        help="Ray's folder (sessions, logs); default: a fresh one, removed at the end",
    )
    args = parser.parse_args(argv)
    folder = args.temp_dir or tempfile.mkdtemp(prefix="ray2n-")
    # Read when ray is imported, and inherited by every Ray process started below.
    os.environ["RAY_TMPDIR"] = folder
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    from ray.cluster_utils import Cluster

    cluster = Cluster()
    try:
        for i, cpus in enumerate(args.num_cpus):
            node = cluster.add_node(
                node_ip_address=LOOPBACK,
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=100 * 2**20,
            )
            print(f"node {i}: {node.node_id} ({cpus} CPUs)", flush=True)
        print(f"ray.address={cluster.address}", flush=True)
        stop.wait()
    finally:
        cluster.shutdown()
        if args.temp_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
