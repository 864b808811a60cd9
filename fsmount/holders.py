"""Which processes still hold a file open, read from /proc. A writable mount stores a file at the close(2) of
its last descriptor; FUSE tells it of every close (FLUSH), but not which one is the last.

A FLUSH comes for each close(2) of a descriptor of the open file, in whatever process holds it: a forked
child's exit (a DataLoader worker, `multiprocessing`) and a subprocess's close-on-exec included, while the
parent goes on writing. RELEASE comes once the last descriptor is gone, but only after close(2) returned, so
it cannot report a failed upload. So at a FLUSH the mount asks here whether the process that opened the file,
or one of its descendants, still has a descriptor on it. The kernel takes the closing descriptor out of its
table before it sends the FLUSH (an exiting process's whole table, before closing any), so a holder found is
another descriptor.

What it cannot see counts as not held, and the file is then stored at that FLUSH, as if it were the last:
processes outside this daemon's PID namespace (the kernel gives their pid as 0), a descriptor passed over a
socket to a process outside the opener's tree, and the descriptors of a process the kernel does not let the
daemon inspect: another user's, or one with capabilities the daemon lacks (a root shell, when the daemon runs
with a reduced capability set, as under the systemd unit), unless the daemon has CAP_SYS_PTRACE. The first
such refusal is logged as a warning.
Everything here is plain blocking reads of /proc: callers run it in a worker thread.
"""

from __future__ import annotations

import collections
import logging
import os

log = logging.getLogger(__name__)

# At most this many processes are looked at for one question (the opener's tree, breadth first).
MAX_PROCESSES = 4096

# Whether a refusal to show a process's descriptors was logged. Set by worker threads; two of them may both
# log it, which costs a line, so no lock.
_refusal_logged = False


def thread_group(tid: int) -> int | None:
    """The process (thread group id) of thread `tid`: a FUSE request names the thread that made it."""
    if tid <= 0:
        return None
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _parents() -> dict[int, list[int]]:
    """Each process's children, from every /proc/PID/stat (the per-task `children` files need a kernel option
    that is often off)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _fields(info: bytes) -> dict[bytes, bytes]:
    """An fdinfo file's `key: value` lines."""
    out = {}
    for line in info.splitlines():
        key, _, value = line.partition(b":")
        out[key] = value.strip()
    return out


def _mount_device(pid: int, mnt_id: bytes) -> int | None:
    """The device number of mount `mnt_id` as process `pid` sees it (its mountinfo), or None."""
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            for line in f:
                fields = line.split(b" ", 3)
                if fields[0] == mnt_id:
                    major, minor = fields[2].split(b":")
                    return os.makedev(int(major), int(minor))
    except (OSError, ValueError, IndexError):
        return None
    return None


def _log_refusal(pid: int) -> None:
    global _refusal_logged
    if not _refusal_logged:
        _refusal_logged = True
        log.warning("cannot see which files process %d holds (%s: permission denied): a close(2) in one process "
                    "of a file that another process of the same writer still holds stores it as it is then. "
                    "Give the daemon CAP_SYS_PTRACE (the systemd unit does)", pid, f"/proc/{pid}/fd")


def _holds(pid: int, device: int | None, ino: int, suffix: str) -> bool:
    """Whether process `pid` has a descriptor open for writing on inode `ino` of the filesystem `device` (None:
    any) whose path ends with `suffix` ('/name'). Inode numbers repeat across mounts (another modelfs mount
    numbers its files from 2 too), hence the device, read from the process's mountinfo, never from a stat
    through the mount."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except PermissionError:
        _log_refusal(pid)
        return False
    except OSError:
        return False  # gone, or exiting (its table is already detached)
    for fd in fds:
        try:
            # " (deleted)": the kernel's entry of the name was dropped while the file stayed open (the mount changed
            # what the name is, or only had the kernel look it up again); missed, a close stored it too early. Not
            # stripped: a file whose own name ends so still matches itself (the review).
            link = os.readlink(f"{fd_dir}/{fd}")
            if not (link.endswith(suffix) or link.endswith(suffix + " (deleted)")):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                info = _fields(f.read())
        except PermissionError:
            _log_refusal(pid)
            return False
        except OSError:
            continue
        if b"ino" in info and int(info[b"ino"]) != ino:
            continue  # (a kernel without ino in fdinfo: the name has to do)
        if b"flags" in info and int(info[b"flags"], 8) & os.O_ACCMODE == os.O_RDONLY:
            # A reader of the version the file replaces (an O_TRUNC rewrite keeps the inode; opens for reading
            # of a file being written are refused): it holds the old bytes, not this file. Counted, it moved the
            # store of `with open(p, "wb")` after a reader in the same process to RELEASE, which cannot report
            # a failed upload: close(2) returned 0 before anything was stored, and a failure only reached the log.
            continue
        if device is None or b"mnt_id" not in info or _mount_device(pid, info[b"mnt_id"]) in (device, None):
            return True
    return False


def holder(opener: int, device: int | None, ino: int, name: str) -> int | None:
    """A process, `opener` or one of its descendants, that has a descriptor on inode `ino` of filesystem
    `device` (this mount's st_dev; None where not known yet), a file named `name`, or None."""
    suffix = "/" + name
    if _holds(opener, device, ino, suffix):
        return opener
    children = _parents()
    todo, seen = collections.deque(children.get(opener, ())), {opener}
    while todo and len(seen) < MAX_PROCESSES:
        pid = todo.popleft()
        if pid in seen:
            continue
        seen.add(pid)
        if _holds(pid, device, ino, suffix):
            return pid
        todo.extend(children.get(pid, ()))
    return None
