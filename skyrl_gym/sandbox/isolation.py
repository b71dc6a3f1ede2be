"""Which kernel isolation this host allows, probed once per process and cached.

Layers, strongest first (``isolation().layers`` names those in use):

* ``netns`` / ``pidns``: the program runs under ``unshare`` in fresh network and PID
  namespaces. No network interface is up, and when the program's first process ends
  (or is killed) the kernel kills every process it started, double forks included.
  As root ``unshare --net --pid``; otherwise with a user namespace (``-r``), which
  some hosts forbid (then there is no namespace layer).
* ``uid``: as root, the program gives up root for ``nobody`` (65534) before it runs,
  so ``RLIMIT_NPROC`` applies and the caller's home (0700) is unreadable. Skipped
  when ``nobody`` cannot run this interpreter (e.g. one installed under /root).
* ``rlimits``, ``session``, ``audithook``: always (see ``runner`` and
  ``_bootstrap``); without a PID namespace, leftover processes are found by a marker
  in their environment and killed.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

NOBODY = 65534


@dataclass(frozen=True)
class Isolation:
    prefix: tuple[str, ...]
    """The command the interpreter runs under (``unshare ...``), empty for none."""
    drop_uid: int | None
    """The uid the program switches to before it runs; None to keep the caller's."""
    layers: tuple[str, ...]

    @property
    def pid_namespace(self) -> bool:
        return "pidns" in self.layers


def _works(cmd: list[str], *, as_uid: int | None = None) -> bool:
    def drop() -> None:
        if as_uid is not None:
            os.setgroups([])
            os.setgid(as_uid)
            os.setuid(as_uid)

    try:
        done = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=20,
            preexec_fn=drop if as_uid is not None else None,  # noqa: PLW1509 - probe only
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.cache
def isolation() -> Isolation:
    """The isolation ``run_python`` uses on this host (probed on first call)."""
    layers = ["rlimits", "session", "audithook"]
    is_root = os.geteuid() == 0
    prefix: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if unshare and sys.platform.startswith("linux"):
        candidate: tuple[str, ...]
        if is_root:
            candidate = (unshare, "--net", "--pid", "--fork", "--kill-child", "--")
        else:
            candidate = (unshare, "-r", "-n", "-p", "-f", "--kill-child", "--")
        if _works([*candidate, sys.executable, "-I", "-S", "-c", "pass"]):
            prefix = candidate
            layers += ["netns", "pidns"]
    drop_uid = None
    if is_root and _works([sys.executable, "-I", "-c", "import json"], as_uid=NOBODY):
        drop_uid = NOBODY
        layers.append("uid")
    return Isolation(prefix=prefix, drop_uid=drop_uid, layers=tuple(layers))
