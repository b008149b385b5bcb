"""How many cores a process may keep busy: the demos' workers and a study's read it."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where cgroups are mounted (cgroup v2 ``cpu.max``, v1 ``cpu/cpu.cfs_*``)."""
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroup path under each hierarchy (v2: ``0::<path>``)."""


def usable_cores(cgroup_root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """Whole cores this process can keep busy: those it may run on (its affinity), fewer
    where a CPU quota on its cgroup or any cgroup above it allows less (1.5 CPUs of
    quota: 1 core). Cgroups are read under ``cgroup_root`` (default ``CGROUP_ROOT``),
    this process's path in them from ``proc_cgroup`` (default ``PROC_SELF_CGROUP``)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    directories = _cgroup_directories(
        CGROUP_ROOT if cgroup_root is None else cgroup_root,
        PROC_SELF_CGROUP if proc_cgroup is None else proc_cgroup,
    )
    quotas = [quota for d in directories if (quota := _cpu_quota(d)) is not None]
    return max(1, min(cores, int(min(quotas))) if quotas else cores)


def _cgroup_directories(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup directories that exist, each hierarchy's up to its root:
    the quota that binds may sit on any of them (a systemd slice above a service). A
    container sees its own cgroup as the root, so the roots are always read."""
    paths = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # cgroup v2
                paths.append((root, path))
            elif "cpu" in controllers.split(","):  # v1; mounted as cpu or cpu,cpuacct
                paths.append((root / "cpu", path))
    except (OSError, ValueError):
        pass
    directories = [root, root / "cpu"]
    for base, path in paths:
        directory = base.joinpath(*Path(path).parts[1:])
        while directory != base and directory.is_relative_to(base):
            if directory.is_dir():
                directories.append(directory)
            directory = directory.parent
    return directories


def _cpu_quota(directory: Path) -> float | None:
    """CPUs of quota (quota / period) set on one cgroup, or None where none is set or
    none can be read."""
    try:
        if (directory / "cpu.max").is_file():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        if quota == "max" or int(quota) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None
