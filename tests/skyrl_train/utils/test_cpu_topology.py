"""cpu_topology against fake cgroup trees: quotas, nesting, garbage, pool sizing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skyrl_train.utils.cpu_topology import (
    CgroupPaths,
    affinity_cores,
    cgroup_v1_quota_cores,
    cgroup_v2_quota_cores,
    cpu_description,
    permitted_cpu_cores,
    pool_workers,
)


def _tree(tmp_path: Path, proc: str | None, files: dict[str, str]) -> CgroupPaths:
    paths = CgroupPaths(
        proc_self_cgroup=tmp_path / "proc_self_cgroup",
        v2_root=tmp_path / "v2",
        v1_cpu_root=tmp_path / "v1cpu",
    )
    paths.v2_root.mkdir(parents=True)
    paths.v1_cpu_root.mkdir(parents=True)
    if proc is not None:
        paths.proc_self_cgroup.write_text(proc)
    for rel, text in files.items():
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    return paths


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [
        ("200000 100000", 2),
        ("150000 100000", 2),  # ceil: a 1.5-core quota lets two threads progress
        ("50000 100000", 1),
        ("100000 100000", 1),
        ("max 100000", None),
        ("max", None),
        ("garbage", None),
        ("1 2 3", None),
        ("abc 100000", None),
        ("0 100000", None),
        ("100000 0", None),
        ("-5 100000", None),
        ("", None),
    ],
)
def test_v2_cpu_max_parsing(tmp_path: Path, cpu_max: str, cores: int | None) -> None:
    paths = _tree(tmp_path, "0::/\n", {"v2/cpu.max": cpu_max})
    assert cgroup_v2_quota_cores(paths) == cores


def test_v2_tightest_ancestor_wins(tmp_path: Path) -> None:
    paths = _tree(
        tmp_path,
        "0::/ray/worker\n",
        {
            "v2/ray/worker/cpu.max": "400000 100000",
            "v2/ray/cpu.max": "300000 100000",
            "v2/cpu.max": "max 100000",
        },
    )
    assert cgroup_v2_quota_cores(paths) == 3


def test_v2_missing_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_v2_quota_cores(_tree(tmp_path, None, {})) is None
    assert cgroup_v2_quota_cores(_tree(tmp_path / "x", "garbage line\n", {})) is None


def test_v2_host_path_outside_mount_falls_back_to_root(tmp_path: Path) -> None:
    # No cgroup namespace: /proc/self/cgroup names the host path, the container's
    # limits sit at the mount root.
    paths = _tree(tmp_path, "0::/docker/abc123\n", {"v2/cpu.max": "100000 100000"})
    assert cgroup_v2_quota_cores(paths) == 1


@pytest.mark.parametrize(
    ("quota", "period", "cores"),
    [
        ("250000", "100000", 3),
        ("100000", "100000", 1),
        ("-1", "100000", None),  # negative means unlimited
        ("junk", "100000", None),
        ("100000", "0", None),
        ("100000", None, None),
        (None, "100000", None),
    ],
)
def test_v1_quota_parsing(
    tmp_path: Path, quota: str | None, period: str | None, cores: int | None
) -> None:
    files = {}
    if quota is not None:
        files["v1cpu/cpu.cfs_quota_us"] = quota
    if period is not None:
        files["v1cpu/cpu.cfs_period_us"] = period
    paths = _tree(tmp_path, "4:cpu,cpuacct:/\n0::/\n", files)
    assert cgroup_v1_quota_cores(paths) == cores


def test_v1_follows_the_cpu_controller_line(tmp_path: Path) -> None:
    paths = _tree(
        tmp_path,
        "5:memory:/elsewhere\n4:cpuacct,cpu:/kube/pod1\n0::/\n",
        {
            "v1cpu/kube/pod1/cpu.cfs_quota_us": "200000",
            "v1cpu/kube/pod1/cpu.cfs_period_us": "100000",
            "v1cpu/cpu.cfs_quota_us": "-1",
            "v1cpu/cpu.cfs_period_us": "100000",
        },
    )
    assert cgroup_v1_quota_cores(paths) == 2


def test_permitted_is_the_smallest_limit(tmp_path: Path) -> None:
    paths = _tree(
        tmp_path,
        "4:cpu:/\n0::/\n",
        {
            "v2/cpu.max": "300000 100000",
            "v1cpu/cpu.cfs_quota_us": "200000",
            "v1cpu/cpu.cfs_period_us": "100000",
        },
    )
    assert permitted_cpu_cores(paths, affinity=16) == 2
    assert permitted_cpu_cores(paths, affinity=1) == 1
    unlimited = _tree(tmp_path / "u", "0::/\n", {"v2/cpu.max": "max 100000"})
    assert permitted_cpu_cores(unlimited, affinity=6) == 6


def test_real_host_values_are_sane() -> None:
    assert affinity_cores() == len(os.sched_getaffinity(0))
    assert 1 <= permitted_cpu_cores() <= affinity_cores()


@pytest.mark.parametrize(
    ("cap", "reserved", "cores", "expected"),
    [
        (8, 1, 2, 1),
        (8, 0, 2, 2),
        (8, 1, 64, 8),
        (4, 2, 5, 3),
        (8, 4, 2, 1),  # never below one
        (1, 0, 32, 1),
    ],
)
def test_pool_workers_formula(cap: int, reserved: int, cores: int, expected: int) -> None:
    assert pool_workers(cap=cap, reserved=reserved, cores=cores) == expected


def test_pool_workers_defaults_to_permitted_cores() -> None:
    assert pool_workers(cap=1000, reserved=0) == permitted_cpu_cores()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cap": 0, "reserved": 0}, ValueError, r"cap: expected an int >= 1, got 0"),
        ({"cap": -2, "reserved": 0}, ValueError, r"cap: expected an int >= 1, got -2"),
        ({"cap": 2.0, "reserved": 0}, TypeError, r"cap: expected int, got float"),
        ({"cap": True, "reserved": 0}, TypeError, r"cap: expected int, got bool"),
        ({"cap": 2, "reserved": -1}, ValueError, r"reserved: expected an int >= 0, got -1"),
        ({"cap": 2, "reserved": "1"}, TypeError, r"reserved: expected int, got str"),
        ({"cap": 2, "reserved": 0, "cores": 0}, ValueError, r"cores: expected an int >= 1"),
    ],
)
def test_pool_workers_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        pool_workers(**kwargs)


def test_cpu_description_names_family_and_model_after_the_name() -> None:
    # Two "AMD EPYC" machines ran the default to different curves: the numbers say which.
    block = {"model name": "AMD EPYC", "cpu family": "23", "model": "49"}
    assert cpu_description(block) == "AMD EPYC (family 23, model 49)"
    assert cpu_description({"model name": "Intel Xeon"}) == "Intel Xeon"
