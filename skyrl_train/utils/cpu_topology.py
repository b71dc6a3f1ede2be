"""How many CPU cores this process may really use, and thread-pool sizes from it.

Under Ray, containers and cpusets ``os.cpu_count()`` reports the host's cores, not
the ones this process may run on. Pools sized from it oversubscribe the node and slow
every actor sharing it. Two limits apply and the smaller one wins:

- the CPU affinity mask (cpusets, ``taskset``, Ray's ``num_cpus`` pinning);
- the CFS bandwidth quota of the process's cgroup (``docker --cpus``, Kubernetes CPU
  limits): cgroup v2 ``cpu.max`` = ``"<quota> <period>"`` or ``"max <period>"``;
  cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, quota -1 meaning unlimited.

Quota cores are ``ceil(quota / period)``: a 1.5-core quota still lets two threads make
progress, and flooring would turn a 0.5-core quota into zero. Nested cgroups are
walked up to the mount root and the tightest quota wins, since every ancestor's
limit applies. A missing, unreadable or garbage file means "no quota": topology
detection must never stop a training run.

Every path is injectable (``CgroupPaths``) so tests run against fake cgroup trees.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CgroupPaths",
    "affinity_cores",
    "cgroup_v1_quota_cores",
    "cgroup_v2_quota_cores",
    "permitted_cpu_cores",
    "pool_workers",
]


@dataclass(frozen=True)
class CgroupPaths:
    """Where the cgroup files live; the defaults are the Linux ones."""

    proc_self_cgroup: Path = Path("/proc/self/cgroup")
    """Lines ``hierarchy:controllers:path``; ``0::/path`` is the v2 entry."""
    v2_root: Path = Path("/sys/fs/cgroup")
    """The cgroup v2 mount (pure v2 hosts mount the unified hierarchy here)."""
    v1_cpu_root: Path = Path("/sys/fs/cgroup/cpu")
    """The cgroup v1 ``cpu`` controller mount (often a link to ``cpu,cpuacct``)."""


DEFAULT_CGROUP_PATHS = CgroupPaths()


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _own_cgroup(paths: CgroupPaths, *, v2: bool) -> str | None:
    """This process's cgroup path in the v2 hierarchy, or in the v1 ``cpu`` one."""
    text = _read_text(paths.proc_self_cgroup)
    if text is None:
        return None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, cgroup = parts
        if v2 and hierarchy == "0" and controllers == "":
            return cgroup
        if not v2 and "cpu" in controllers.split(","):
            return cgroup
    return None


def _candidate_dirs(root: Path, cgroup: str | None) -> list[Path]:
    """The process's cgroup directory and its ancestors up to ``root``.

    Inside a container without a cgroup namespace ``/proc/self/cgroup`` names a
    host path (``/docker/<id>``) that is not under the container's mount; the
    container's own limits then sit at the mount root, which is always included.
    """
    dirs: list[Path] = []
    if cgroup:
        parts = [p for p in cgroup.strip("/").split("/") if p and p not in (".", "..")]
        while parts:
            dirs.append(root.joinpath(*parts))
            parts.pop()
    dirs.append(root)
    return dirs


def _quota_cores(quota: int, period: int) -> int | None:
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _parse_v2_cpu_max(text: str | None) -> int | None:
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        return _quota_cores(int(fields[0]), int(fields[1]))
    except ValueError:
        return None


def _parse_v1_quota(quota_text: str | None, period_text: str | None) -> int | None:
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    return _quota_cores(quota, period)  # negative quota (-1) means unlimited


def _tightest(values: list[int | None]) -> int | None:
    found = [v for v in values if v is not None]
    return min(found) if found else None


def cgroup_v2_quota_cores(paths: CgroupPaths = DEFAULT_CGROUP_PATHS) -> int | None:
    """Cores allowed by the cgroup v2 ``cpu.max`` quota; None when unlimited or unknown."""
    dirs = _candidate_dirs(paths.v2_root, _own_cgroup(paths, v2=True))
    return _tightest([_parse_v2_cpu_max(_read_text(d / "cpu.max")) for d in dirs])


def cgroup_v1_quota_cores(paths: CgroupPaths = DEFAULT_CGROUP_PATHS) -> int | None:
    """Cores allowed by the cgroup v1 CFS quota; None when unlimited or unknown."""
    dirs = _candidate_dirs(paths.v1_cpu_root, _own_cgroup(paths, v2=False))
    return _tightest(
        [
            _parse_v1_quota(_read_text(d / "cpu.cfs_quota_us"), _read_text(d / "cpu.cfs_period_us"))
            for d in dirs
        ]
    )


def affinity_cores() -> int:
    """Cores in this process's CPU affinity mask (``os.cpu_count()`` where unsupported)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return max(1, len(getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def permitted_cpu_cores(
    paths: CgroupPaths = DEFAULT_CGROUP_PATHS, *, affinity: int | None = None
) -> int:
    """The smaller of the affinity mask and the cgroup v2/v1 quotas, at least 1.

    ``affinity`` overrides the mask (tests); both cgroup versions are read because
    hybrid hosts mount v1 controllers next to an empty v2 hierarchy.
    """
    limits = [affinity if affinity is not None else affinity_cores()]
    limits += [q for q in (cgroup_v2_quota_cores(paths), cgroup_v1_quota_cores(paths)) if q]
    return max(1, min(limits))


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def pool_workers(*, cap: int, reserved: int, cores: int | None = None) -> int:
    """Threads for a pool: ``max(1, min(cap, cores - reserved))``.

    ``cores`` defaults to ``permitted_cpu_cores()``; ``reserved`` keeps cores free
    for whatever shares the node (Ray's raylet and GCS, the caller's event loop).
    """
    _check_count("cap", cap, minimum=1)
    _check_count("reserved", reserved, minimum=0)
    if cores is None:
        cores = permitted_cpu_cores()
    else:
        _check_count("cores", cores, minimum=1)
    return max(1, min(cap, cores - reserved))


def cpu_model() -> str:
    """The CPU's model name, for benchmark reports: the project's machines differ
    (Intel Xeon copies fresh memory at ~3.5 GB/s, AMD EPYC at ~11 GB/s). The CPU family
    and model numbers follow the name: two machines that both report "AMD EPYC" ran the
    same default run to different curves (docs/experiments.md), so the name alone does
    not say which machine a figure came from."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():  # the first processor's block is enough
                break
        if "model name" in fields:
            return cpu_description(fields)
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_description(fields: dict[str, str]) -> str:
    """``model name`` from one /proc/cpuinfo block, then ``(family F, model M)`` when
    the block has them."""
    name = fields["model name"]
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name
