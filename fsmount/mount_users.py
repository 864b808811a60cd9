"""What keeps a mount busy, read from /proc alone (for `modelfs unmount` of a busy mount): the processes whose
working directory, root, open files or mappings are on it, and the mounts made inside it. Nothing here asks the
mount's daemon, which may be stopped or hung: the kernel answers every read (B144, B157, B159). Plain blocking reads,
run by the CLI, never by the daemon."""

from __future__ import annotations

import os

from fsmount.prefetch_command import mountinfo_path


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


def mount_at(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[int, tuple[int, int]] | None:
    """(mount id, device (major, minor)) of the mount at `mountpoint`: the one on top where mounts are stacked
    there, as `umount` takes it; None if nothing is mounted there."""
    found = None
    try:
        with open(mountinfo, "rb") as f:
            for line in f:
                fields = line.split()
                if mountinfo_path(fields[4]) == mountpoint:
                    major, minor = fields[2].split(b":")
                    found = (int(fields[0]), (int(major), int(minor)))
    except (OSError, ValueError):
        return None
    return found


def mounts_inside(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The mounts made on a directory of the mount at `mountpoint`, as 'PATH (TYPE)': each keeps it busy, whoever
    uses it. Only those mounted on it directly (the ones below them are theirs to unmount)."""
    mount = mount_at(mountpoint, mountinfo)
    if mount is None:
        return []
    found = []
    try:
        with open(mountinfo, "rb") as f:
            for line in f:
                fields = line.split()
                if int(fields[1]) == mount[0]:
                    path = mountinfo_path(fields[4])
                    found.append(f"{path} ({os.fsdecode(fields[fields.index(b'-') + 1])})")
    except (OSError, ValueError):
        return []
    return found


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


def mount_users(mountpoint: str) -> list[str]:
    """What keeps `mountpoint` busy, as 'NAME (pid N: what)', from /proc alone: nothing asks the mount's daemon
    (which may be stopped or hung). A path under the mountpoint is not enough: a shell whose working directory
    was the mountpoint's own directory before the mount shows the same path, and does not hold the mount. So a
    working directory, root or open file counts where its mount id is the mount's, and a mapped file where its
    device is. This process is left out (a `modelfs unmount .` run from inside the mount: its shell, which made it
    so, is named). A process in another mount namespace, or one this user may not inspect, is not seen."""
    mount = mount_at(mountpoint)
    if mount is None:
        return []
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

    named: list[str] = []
    more = 0
    try:
        pids = sorted((e for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()), key=int)
    except OSError:
        return []
    for pid in pids:
        what = []
        if holds(pid, "cwd"):
            what.append("working directory")
        if holds(pid, "root"):
            what.append("root directory")
        count = open_files(pid)
        if count:
            what.append(f"{count} open file{'s' if count > 1 else ''}")
        if any(under(t) for t in mapped_paths(f"/proc/{pid}/maps", dev)):
            what.append("mapped files")
        if not what:
            continue
        if len(named) == MOUNT_USERS_NAMED:
            more += 1
            continue
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                name = os.fsdecode(f.read().strip()) or "?"
        except OSError:
            name = "?"
        named.append(f"{name} (pid {pid}: {', '.join(what)})")
    if more:
        named.append(f"{more} more")
    return named
