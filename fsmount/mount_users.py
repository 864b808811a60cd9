"""What keeps a mount busy, read from /proc alone (for `modelfs unmount` of a busy mount): the processes whose
working directory, root, open files or mappings are on it, and the mounts made inside it. Nothing here asks the
mount's daemon, which may be stopped or hung: the kernel answers every read (B144, B157, B159). Run by the CLI, never
by the daemon; the whole scan is bounded in time (MOUNT_USERS_SCAN_S), and the one read that may wait on another
process, its /proc/PID/maps, runs in a thread of its own that is left behind past MAPS_READ_S (B176): the scan's
state is its own; a maps reader shares only the queues it takes its reads from and gives its answers to."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import NamedTuple

from fsmount.mountinfo import MOUNTINFO, mounts, top_at

# The most `mount_users` takes: past it, what it found so far, said as not the whole of it. Reading every process's
# descriptors and maps takes ~0.1 ms a process on the test machine, so this leaves room for a busy host's thousands.
MOUNT_USERS_SCAN_S = 2.0
# The most one process's /proc/PID/maps is waited for. Its open takes the process's exec_update_lock (mm_access), and
# its read the process's memory map lock: before Linux 6.17 mmap_lock for the whole read (mmap_read_lock_killable in
# fs/proc/task_mmu.c's m_start); since, with CONFIG_PER_VMA_LOCK (this test machine's 6.18 has it), the VMAs are
# walked under RCU and per-VMA locks, and mmap_lock is still taken where a VMA is being changed
# (lock_next_vma_under_mmap_lock in mm/mmap_lock.c, fallback_to_mmap_lock in task_mmu.c). A process blocked on a hung
# mount can hold mmap_lock (a fault or a get_user_pages of the mount's pages while another of its threads waits to
# mmap or munmap, which makes every new reader wait behind that writer), so the read may wait as long as the mount
# hangs. The other reads here take no lock another process can hold: readlink and fdinfo of /proc/PID/fd (task_lock,
# a spinlock; the fdinfo of a descriptor on the mount only, and FUSE files have no show_fdinfo of their own),
# cwd and root (the same), comm. A maps reader left waiting is a daemon thread; the waits above are killable (but
# for fallback_to_mmap_lock's plain mmap_read_lock, taken where the per-VMA walk gives up on a VMA: rare), so the
# process's exit ends it.
MAPS_READ_S = 0.5


class MountUsers(NamedTuple):
    """What `mount_users` found: `named`, 'NAME (pid N: what)' for up to MOUNT_USERS_NAMED holders and 'K more';
    `complete`, whether every process was looked at whole within MOUNT_USERS_SCAN_S; `unread`, 'NAME (pid N)' of the
    processes whose maps did not answer within MAPS_READ_S (one waiting on this mount may be among them)."""

    named: list[str]
    complete: bool
    unread: list[str]


def mapped_paths(maps: str, dev: tuple[int, int]) -> set[str]:
    """The paths of the files a process maps from the file system of device `dev` (major, minor): its
    /proc/PID/maps, the sixth field where there is one and the fourth (the device, in hexadecimal) is `dev`."""
    found = set()
    try:
        with open(maps, "rb") as f:
            for line in f:
                fields = line.rstrip(b"\n").split(maxsplit=5)
                if len(fields) == 6 and tuple(int(n, 16) for n in fields[3].split(b":")) == dev:
                    found.add(os.fsdecode(fields[5]).removesuffix(" (deleted)"))
    except (OSError, ValueError):
        pass
    return found


# `modelfs unmount` of a busy mount names at most this many of the processes that hold it.
MOUNT_USERS_NAMED = 5


def mount_at(mountpoint: str, mountinfo: str = MOUNTINFO) -> tuple[int, tuple[int, int]] | None:
    """(mount id, device (major, minor)) of the mount at `mountpoint`: the one on top where mounts are stacked
    there (`mountinfo.top_at`), as `umount` takes it; None if nothing is mounted there."""
    try:
        top = top_at(os.fsencode(mountpoint), mounts(mountinfo))
        if top is None:
            return None
        major, minor = top.device.split(b":")
        return int(top.mount_id), (int(major), int(minor))
    except (OSError, ValueError):
        return None


def mounts_inside(mountpoint: str, mountinfo: str = MOUNTINFO) -> list[str]:
    """The mounts made on a directory of the mount at `mountpoint`, as 'PATH (TYPE)': each keeps it busy, whoever
    uses it. Only those mounted on it directly (the ones below them are theirs to unmount)."""
    mount = mount_at(mountpoint, mountinfo)
    if mount is None:
        return []
    try:
        return [f"{os.fsdecode(m.point)} ({os.fsdecode(m.fstype)})" for m in mounts(mountinfo)
                if int(m.parent) == mount[0]]
    except (OSError, ValueError):
        return []


def fd_mount_id(fdinfo: str) -> int | None:
    """The mount id in a /proc/PID/fdinfo/N: the mount the descriptor's file was opened through."""
    try:
        with open(fdinfo, "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def link_mount_id(link: str) -> int | None:
    """The mount id of where /proc/PID/cwd or /proc/PID/root leads. Opened O_PATH: the kernel jumps to the
    directory the process holds, and nothing asks its file system (a stopped daemon is never waited for)."""
    try:
        fd = os.open(link, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return fd_mount_id(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)


def _process_name(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return os.fsdecode(f.read().strip()) or "?"
    except OSError:
        return "?"


class _MapsReader:
    """Reads processes' /proc/PID/maps (`mapped_paths`) one at a time in a daemon thread of its own, each waited for
    at most the time `read` is given. A reader that did not answer in time is left behind, waiting where the
    process's memory map lock is held (MAPS_READ_S says which kernel code waits), told to end once it is free, and a
    new one takes the next read: a thread per read cost as much again as the scan's own reads. Used by one thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[str, tuple[int, int], queue.SimpleQueue[set[str]]] | None] | None = None

    def read(self, maps: str, dev: tuple[int, int], timeout: float) -> set[str] | None:
        """`mapped_paths(maps, dev)`, or None if it did not answer within `timeout`."""
        if self._jobs is None:
            jobs: queue.SimpleQueue[tuple[str, tuple[int, int], queue.SimpleQueue[set[str]]] | None] = \
                queue.SimpleQueue()
            try:
                threading.Thread(target=self._serve, args=(jobs,), name="modelfs-maps-reader", daemon=True).start()
            except RuntimeError:
                # No thread to be had (a pids cgroup at its limit, RLIMIT_NPROC, as where a trainer's threads filled
                # it): `modelfs unmount` failed with a traceback. Read here, without a bound, as before B176 (B192).
                return mapped_paths(maps, dev)
            self._jobs = jobs
        answer: queue.SimpleQueue[set[str]] = queue.SimpleQueue()
        self._jobs.put((maps, dev, answer))
        try:
            return answer.get(timeout=max(0.0, timeout))
        except queue.Empty:
            self.close()
            return None

    def close(self) -> None:
        """The reader ends after the read it is in, if any."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[tuple[str, tuple[int, int], queue.SimpleQueue[set[str]]] | None]) -> None:
        while (job := jobs.get()) is not None:
            maps, dev, answer = job
            answer.put(mapped_paths(maps, dev))


def mount_users(mountpoint: str) -> MountUsers:
    """What keeps `mountpoint` busy, from /proc alone: nothing asks the mount's daemon (which may be stopped or hung).
    A path under the mountpoint is not enough: a shell whose working directory was the mountpoint's own directory
    before the mount shows the same path, and does not hold the mount. So a working directory, root or open file
    counts where its mount id is the mount's, and a mapped file where its device is. This process is left out (a
    `modelfs unmount .` run from inside the mount: its shell, which made it so, is named). A process in another mount
    namespace, or one this user may not inspect, is not seen. Within MOUNT_USERS_SCAN_S: first every process's
    working directory, root and descriptors (reads no other process can hold up), then their maps, each waited for
    MAPS_READ_S at most, so a process whose maps do not answer hides no holder found the first way."""
    deadline = time.monotonic() + MOUNT_USERS_SCAN_S
    mount = mount_at(mountpoint)
    if mount is None:
        return MountUsers([], True, [])
    mnt_id, dev = mount
    inside = mountpoint.rstrip("/") + "/"

    def under(target: str) -> bool:
        return target == mountpoint or target.startswith(inside)

    def holds(pid: str, what: str) -> bool:
        try:
            target = os.readlink(f"/proc/{pid}/{what}")
        except OSError:
            return False
        return under(target.removesuffix(" (deleted)")) and link_mount_id(f"/proc/{pid}/{what}") == mnt_id

    def open_files(pid: str) -> int:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return 0
        count = 0
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if under(target.removesuffix(" (deleted)")) and fd_mount_id(f"/proc/{pid}/fdinfo/{fd}") == mnt_id:
                count += 1
        return count

    try:
        pids = sorted((e for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()), key=int)
    except OSError:
        return MountUsers([], False, [])
    holding: dict[str, list[str]] = {pid: [] for pid in pids}
    complete = True
    for pid in pids:
        if time.monotonic() >= deadline:
            complete = False
            break
        what = holding[pid]
        if holds(pid, "cwd"):
            what.append("working directory")
        if holds(pid, "root"):
            what.append("root directory")
        count = open_files(pid)
        if count:
            what.append(f"{count} open file{'s' if count > 1 else ''}")
    unread: list[str] = []
    reader = _MapsReader()
    try:
        for pid in pids if complete else []:
            left = deadline - time.monotonic()
            if left <= 0:
                complete = False
                break
            paths = reader.read(f"/proc/{pid}/maps", dev, min(MAPS_READ_S, left))
            if paths is None:
                complete = False
                if left < MAPS_READ_S:  # cut by the scan's bound, not found stuck
                    break
                unread.append(f"{_process_name(pid)} (pid {pid})")
            elif any(under(t) for t in paths):
                holding[pid].append("mapped files")
    finally:
        reader.close()
    named: list[str] = []
    more = 0
    for pid, what in holding.items():
        if not what:
            continue
        if len(named) == MOUNT_USERS_NAMED:
            more += 1
            continue
        named.append(f"{_process_name(pid)} (pid {pid}: {', '.join(what)})")
    if more:
        named.append(f"{more} more")
    return MountUsers(named, complete, unread)
