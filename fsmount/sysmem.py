"""How much memory this process may use: the machine's RAM and MemAvailable, bounded by the memory limit of
its cgroup (v1 or v2) and of every cgroup above it.

In a container (a Kubernetes pod with a memory limit, a systemd unit with MemoryMax=) /proc/meminfo still
describes the whole machine, but the kernel charges the pod for its processes' memory and for the page cache
they fill, pages pushed with notify_store included (they are charged to the daemon that pushes them). A pod
of 900 MiB loading a 1 GiB model fetched it 2.95-3.41 times from the origin when pushes were sized by the
host's MemAvailable: the cgroup evicted pushed pages before the loader reached them (bench/RESULTS.md).

Read when the daemon starts (the defaults of --memory-limit and --pagecache-push-limit), and `free` when the
kernel is seen to have dropped pushed pages (pagecache.py): a few small reads of procfs and cgroupfs, never
per request. Anything unreadable or malformed counts as no limit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

# A limit at or above this is "no limit" (cgroup v1 writes 2**63 rounded down to a page).
UNLIMITED = 1 << 60
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
    limit: int  # the smallest memory limit of this process's cgroup and its ancestors
    available: int  # the least, over those cgroups, of limit less what they use that is not page cache
    free: int  # the least, over those cgroups, of limit less all they use


def physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _meminfo_field(meminfo: Path, name: str) -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _lower(machine: int | None, cgroup: int | None) -> int | None:
    """The machine's figure, or the cgroup's where that is lower; None where neither is known."""
    known = [n for n in (machine, cgroup) if n is not None]
    return min(known) if known else None


def ram(proc: Path = Path("/proc/self")) -> int | None:
    """Physical RAM, or the cgroup's limit where that is lower."""
    cg = cgroup_memory(proc)
    return _lower(physical_ram(), cg.limit if cg else None)


def available(proc: Path = Path("/proc/self"), meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable, or what the cgroup has left where that is lower."""
    cg = cgroup_memory(proc)
    return _lower(_meminfo_field(meminfo, "MemAvailable"), cg.available if cg else None)


def free(proc: Path = Path("/proc/self"), meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Memory nothing holds, not even the page cache: MemFree, or what the cgroup has below its limit where
    that is less. Low while the kernel evicts page cache to make room (at the cgroup's limit, its usage is
    the limit), high after the page cache was dropped."""
    cg = cgroup_memory(proc)
    return _lower(_meminfo_field(meminfo, "MemFree"), cg.free if cg else None)


def cgroup_memory(proc: Path = Path("/proc/self")) -> CgroupMemory | None:
    """The memory limit that binds this process, or None where no cgroup on its way up has one."""
    limit = avail = unused = None
    for d in memory_cgroup_dirs(proc):
        v2 = (d / "memory.max").exists()
        n = _read_int(d / ("memory.max" if v2 else "memory.limit_in_bytes"))
        if n is None or n >= UNLIMITED:
            continue
        usage = _read_int(d / ("memory.current" if v2 else "memory.usage_in_bytes")) or 0
        stat = _read_stat(d / "memory.stat")
        # Page cache can be reclaimed to make room; what else the cgroup holds (its processes' memory) cannot.
        # v1's "total_" lines count the cgroups below too, as its usage does.
        prefix = "" if v2 else "total_"
        cache = stat.get(prefix + "inactive_file", 0) + stat.get(prefix + "active_file", 0)
        left = max(0, n - max(0, usage - cache))
        limit = n if limit is None else min(limit, n)
        avail = left if avail is None else min(avail, left)
        unused = max(0, n - usage) if unused is None else min(unused, max(0, n - usage))
    if limit is None or avail is None or unused is None:
        return None
    return CgroupMemory(limit, avail, unused)


@functools.cache
def memory_cgroup_dirs(proc: Path) -> tuple[Path, ...]:
    """The directories of this process's memory cgroup and of its ancestors up to the hierarchy's mount,
    nearest first: cgroup v1's memory hierarchy where one is mounted, else cgroup v2's. Found once per
    process (a daemon is not moved to another cgroup once it runs), so `free` costs a few small reads."""
    try:
        cgroups = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return ()
    paths: dict[str, str] = {}
    for line in cgroups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths.setdefault("v2", parts[2])
        elif "memory" in parts[1].split(","):
            paths["v1"] = parts[2]
    for version in ("v1", "v2"):
        if version not in paths:
            continue
        for line in mounts:
            head, sep, tail = line.partition(" - ")
            fields, after = head.split(), tail.split()
            if not sep or len(fields) < 5 or not after:
                continue
            fstype, options = after[0], after[2] if len(after) > 2 else ""
            if version == "v2" and fstype != "cgroup2":
                continue
            if version == "v1" and (fstype != "cgroup" or "memory" not in options.split(",")):
                continue
            root, mountpoint = _unescape(fields[3]), Path(_unescape(fields[4]))
            return tuple(_up_to(mountpoint, root, paths[version]))
    return ()


def _up_to(mountpoint: Path, root: str, path: str) -> list[Path]:
    """The cgroup at `path` (as /proc/self/cgroup names it) and its ancestors, as directories under a mount of
    the hierarchy whose root is `root` (a container sees only its own part of the hierarchy)."""
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):]
    leaf = mountpoint / path.lstrip("/")
    if not leaf.is_dir():
        leaf = mountpoint  # a path outside the mount's part of the hierarchy: only the mount's own cgroup
    dirs = [leaf]
    while dirs[-1] != mountpoint and mountpoint in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


def _unescape(text: str) -> str:
    """mountinfo writes a space, tab, newline or backslash as \\ooo."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out
