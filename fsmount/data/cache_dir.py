"""The layout of a cache directory and what guards it: a flock on the directory itself (held by the one process
using it; `root/lock` names that process's pid where it can write it, and /proc/locks where it cannot),
`root/chunks/<d[:2]>/<d>` where d = ChunkId.digest(), temp files `*.tmp` beside them, a stat-only scan of what is
there, and the size a `--cache-size` names.

Plain functions; the cache (disk_cache) and the `modelfs cache` commands (cache_admin) both use them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Iterator

from fsmount.config import CacheSize

# 2 hex chars -> 256 shard dirs. At 8 MiB chunks an 8 TB NVMe holds ~1M chunks, ~4k per dir, which
# ext4/xfs hashed directories handle well; one level keeps the open-time scan at 256 scandir calls.
SHARD_HEX_CHARS = 2
CHUNKS_DIR = "chunks"
# Where a --writable mount keeps local copies of the files being written (write_staging.py). What a killed one left
# there is garbage to whoever holds the dir's lock next: no mount is writing there then.
WRITES_DIR = "writes"
# The names of those copies: write_staging numbers them 1, 2, ... (itertools.count). Only regular files named so are
# removed: an existing folder given as --cache-dir may have a `writes/` of its own, and it lost all of it (rmtree).
_STAGED_NAME = re.compile(r"[1-9][0-9]*")
log = logging.getLogger(__name__)

LOCK_FILE = "lock"
# What modelfs writes in `lock`: a pid, and DRAINING after it, a line each time (_write_holder); a crash between its
# write and its truncate can leave a second line. An existing folder given as --cache-dir may have a `lock` of its
# own: anything else there, or more than LOCK_MAX_BYTES, is not ours to write over.
_LOCK_LINE = re.compile(r"[0-9]+( draining)?")
LOCK_MAX_BYTES = 64
# Written after the holder's pid in `lock` once its mount is gone and it only writes what it fetched (mark_draining):
# the next comer waits for it, up to DRAINING_WAIT_S, instead of being refused. A restart script's `modelfs unmount
# X && modelfs mount X` failed "cache dir in use" while the old daemon wrote its last chunks to a shared tier (2.7 s).
DRAINING = "draining"
# How long the next comer waits: a read-only mount's drains take at most 40 s (cache writes 30 s, tier claims 10 s);
# well below the 120 s `modelfs mount` and the systemd unit give a daemon to come up, its other checks included.
DRAINING_WAIT_S = 60.0
# A holder that does not say it is draining may be about to: its mount is gone and it writes the word next
# (mark_draining). The next comer looks again this long before it is refused.
DRAINING_GRACE_S = 1.0
TMP_SUFFIX = ".tmp"
# Where a mount keeps the names it learnt (saved_names.py): one file per bucket and prefix, named by a digest.
NAMES_DIR = "names"
_NAMES_FILE = re.compile(r"[0-9a-f]{32}\.json(\.tmp)?")
_HEX = frozenset("0123456789abcdef")


class CacheDirBusy(Exception):
    """Another process (another modelfs mount, or a cache maintenance command) holds the cache dir: `pid`, where it
    is known."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


def chunk_path(chunks_dir: str, digest: str) -> str:
    """Where the chunk file of `digest` lives under `root/chunks`."""
    return os.path.join(chunks_dir, digest[:SHARD_HEX_CHARS], digest)


def free_bytes(path: str) -> int:
    """Bytes free on the filesystem of `path`; sys.maxsize on one that reports a size of 0 (a FUSE or virtual
    filesystem that does not say): there only --cache-size, and ENOSPC from a write, bound the cache."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize if st.f_blocks else sys.maxsize


def real_dir(path: str) -> None:
    """OSError unless `path` is a directory itself, not a symlink to one: the cache removes and writes files
    below its directories, and a `chunks` linked elsewhere had files outside the cache dir deleted."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise OSError(errno.ENOTDIR, f"{path} is {what}: the cache keeps its chunks only in a directory of its own")


def staged_writes(root: str) -> tuple[int, int]:
    """(files, bytes) in `root`'s WRITES_DIR: copies of files a --writable mount was writing."""
    files = total = 0
    for _path, size in _staged_copies(root)[0]:
        files, total = files + 1, total + size
    return files, total


def counted(n: int, one: str, many: str) -> str:
    """`n` and the noun for it, in the number it takes ("1 chunk", "0 chunks"): what the cache's log lines and
    commands say of what they found or removed."""
    return f"{n} {one if n == 1 else many}"


def human_size(n: float) -> str:
    """`n` bytes in the largest binary unit under which it is >= 1 ("512 B", "3.00 MiB"): what the cache's log lines
    and commands, and `modelfs stats`, say of a size."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def sweep_staged_writes(root: str) -> tuple[int, int]:
    """Remove the copies in `root`'s WRITES_DIR (regular files named as write_staging names them, never a folder nor
    a symlink), and say what they were (staged_writes). Anything else there is left alone, with a log line; so is a
    WRITES_DIR that is a symlink or not a directory. The caller holds the dir's lock."""
    copies, others = _staged_copies(root)
    path = os.path.join(root, WRITES_DIR)
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        log.info("cache dir %s: left %s alone: it is not a directory of the cache's own", root, path)
    files = total = 0
    for path, size in copies:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        files, total = files + 1, total + size
    if others:
        log.info("cache dir %s: left %s in %s/ that modelfs did not write there (%s)", root,
                 counted(len(others), "entry", "entries"), WRITES_DIR,
                 ", ".join(sorted(others)[:5]) + (", ..." if len(others) > 5 else ""))
    return files, total


def sweep_saved_names(root: str) -> int:
    """Remove the files of names in `root`'s NAMES_DIR (regular files named as saved_names names them); how many.
    Anything else there is left alone. The caller holds the dir's lock."""
    path = os.path.join(root, NAMES_DIR)
    try:
        entries = list(os.scandir(path)) if not os.path.islink(path) else []
    except (FileNotFoundError, NotADirectoryError):
        return 0
    removed = 0
    for entry in entries:
        if _NAMES_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed


def _staged_copies(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """((path, size) of each copy write_staging made in `root`'s WRITES_DIR, names of the other entries there)."""
    path = os.path.join(root, WRITES_DIR)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return [], []
    if not stat.S_ISDIR(st.st_mode):  # not ours to count, nor to remove, nor to look into (a symlink)
        return [], []
    copies, others = [], []
    for entry in scandir(path):
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if _STAGED_NAME.fullmatch(entry.name) and stat.S_ISREG(st.st_mode):
            copies.append((entry.path, st.st_size))
        else:
            others.append(entry.name)
    return copies, others


def scan_chunk_files(chunks_dir: str, sweep_tmp: bool) -> tuple[list[tuple[int, str, int, str]], int]:
    """(mtime_ns, digest, size, path) of every chunk file, stat only, and the number of temp files
    removed. Names that are neither are left alone; so is a `chunks_dir` that is a symlink (OSError)."""
    if os.path.lexists(chunks_dir):  # none yet: nothing to scan
        real_dir(chunks_dir)
    found: list[tuple[int, str, int, str]] = []
    swept = 0
    for shard in scandir(chunks_dir):
        if len(shard.name) != SHARD_HEX_CHARS or not shard.is_dir(follow_symlinks=False):
            continue
        for entry in scandir(shard.path):
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                if sweep_tmp:  # left by a crash or kill mid-put; never renamed, so never indexed
                    try:
                        os.unlink(entry.path)
                        swept += 1
                    except OSError:
                        pass  # gone meanwhile, or a read-only cache dir: left there, never indexed
                continue
            if len(name) != 64 or not name.startswith(shard.name) or not _HEX.issuperset(name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.is_file(follow_symlinks=False):
                found.append((st.st_mtime_ns, name, st.st_size, entry.path))
    return found, swept


def scandir(path: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            yield from entries
    except FileNotFoundError:
        return


def acquire_dir_lock(root: str, wait: bool = True) -> int:
    """Take the cache dir for this process: a flock on the directory itself (a flock on its `lock` file alone let a
    second daemon in once an operator's `rm -rf CACHE/*` had removed that file: two indexes evicting each other's
    files, each within its own --cache-size). The `lock` file names the holder's pid, for the next comer, and is
    flocked too where it can be opened (older versions lock only it); it may be missing or unwritable (a read-only
    cache dir). Returns the descriptor to give to release_dir_lock. `wait=False`: refused at once where another holds
    it, without the waits for a holder about to drain or draining (a mount asking again under its cache lock)."""
    path = os.path.join(root, LOCK_FILE)
    # A read-only descriptor (flock ignores the mode): one open for writing would make the filesystem refuse a
    # remount read-only while we run.
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    file_fd = None
    try:
        # The `lock` file's flock too, which modelfs versions before this one take: a daemon of one still running
        # after an upgrade excludes `modelfs cache clear` and new mounts, and is excluded by them.
        file_fd = _open_lock_file(path, os.O_RDONLY | os.O_CREAT)
        for held in (fd, file_fd):
            if held is not None:
                _flock_or_wait_for_draining(held, root, path, wait)
        if file_fd is not None:
            _check_ours(file_fd, path)
        _write_pid(path)
    except BaseException:
        if file_fd is not None:
            os.close(file_fd)
        os.close(fd)
        raise
    if file_fd is not None:
        _LOCK_FILES[fd] = file_fd
    return fd


def _flock_or_wait_for_draining(fd: int, root: str, path: str, wait: bool = True) -> None:
    """flock `fd`; while another holds it, and says it is draining, wait for it up to DRAINING_WAIT_S (if `wait`)."""
    deadline, grace = None, time.monotonic() + DRAINING_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _holder(path).split() or ["unknown"]
            real = _flock_holders(fd)
            if real and 0 not in real and not any(holder[0] in _pid_names(pid) for pid in real):
                # `lock` names a process that does not hold the dir: a holder that could not write it (a read-only
                # cache dir) left the last writer's text, "PID draining" of a daemon long gone, which had the next
                # comer wait DRAINING_WAIT_S for a live mount and then name that dead pid. The kernel's word counts.
                holder = [str(min(real))]
            if wait and holder[1:] != [DRAINING] and time.monotonic() < grace:
                time.sleep(0.1)
                continue
            if not wait or holder[1:] != [DRAINING] or (deadline is not None and time.monotonic() > deadline):
                raise CacheDirBusy(
                    f"cache dir {root} is in use by another modelfs mount or cache command (pid {holder[0]}); a "
                    f"cache dir serves one mount or command at a time: unmount it (or let the command finish) first, "
                    f"or use another cache dir (a mount detached with `unmount --lazy` keeps its daemon, and the cache "
                    f"dir, until the files open on it are closed)",
                    int(holder[0]) if holder[0].isdigit() else None) from None
            if deadline is None:
                deadline = time.monotonic() + DRAINING_WAIT_S
                log.info("cache dir %s: waiting for the daemon of the mount before (pid %s), unmounted, to finish "
                         "writing what it fetched (up to %g s)", root, holder[0], DRAINING_WAIT_S)
            time.sleep(0.1)


def _flock_holders(fd: int) -> set[int] | None:
    """The pids that /proc/locks shows holding a flock on the file of `fd` (0 for a holder outside this process's pid
    namespace); None where it cannot tell (no /proc)."""
    st = os.fstat(fd)
    # /proc/locks names the file "MAJOR:MINOR:INODE", the device numbers in hex: "1: FLOCK  ADVISORY  WRITE 4565
    # fe:00:15360195 0 EOF" (a waiter's line has "->" after the number, and so one field more before the pid).
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file_id and fields[4].isdigit():
            pids.add(int(fields[4]))
    return pids


def _pid_names(pid: int) -> set[str]:
    """`pid` and what the process is called in the pid namespaces below this one (NSpid: a daemon in a container
    wrote its own number in `lock`)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return {str(pid), *line.split()[1:]}
    except OSError:
        pass
    return {str(pid)}


def mark_draining(root: str) -> None:
    """Say in `lock` that this holder's mount is gone and it only finishes its writes (DRAINING). Best effort, never
    raised (a lock file removed, a read-only cache dir): the next comer is then refused as before."""
    try:
        _write_holder(os.path.join(root, LOCK_FILE), f"{os.getpid()} {DRAINING}\n")
    except OSError as exc:
        log.debug("cache dir %s: cannot say it is draining: %s", root, exc)


# The `lock` file descriptors held beside each directory lock (acquire_dir_lock), by the directory's descriptor.
_LOCK_FILES: dict[int, int] = {}


def _open_lock_file(path: str, flags: int) -> int | None:
    """A descriptor of `lock`, or None where it cannot be opened so (a read-only cache dir, one of another owner).
    Never through a symlink (a pid written there truncated the linked file: /etc/passwd, had it pointed there), nor
    of anything but a regular file, nor waiting for a FIFO's other end: all three are refused."""
    try:
        lock_fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symlink: the lock is a file of the cache dir's own") from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise OSError(errno.EINVAL, f"{path} is not a regular file") from None
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise
    if not stat.S_ISREG(os.fstat(lock_fd).st_mode):
        os.close(lock_fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return lock_fd


def _check_ours(lock_fd: int, path: str) -> None:
    """OSError unless `lock` is empty or holds what modelfs writes there (_LOCK_LINE): a file of the operator's by that
    name had its content replaced by a pid. Read under the flock, so that no modelfs holder is writing it."""
    data = os.pread(lock_fd, LOCK_MAX_BYTES + 1, 0)
    text = data.decode("ascii", "replace")
    if len(data) > LOCK_MAX_BYTES or not all(_LOCK_LINE.fullmatch(line) for line in text.splitlines()):
        raise OSError(errno.EINVAL, f"{path} is not a modelfs lock file (modelfs writes its pid there): move it "
                                    f"away, or use another cache dir")


def still_on(path: str, dev: int, what: str) -> None:
    """Refuse (ENODEV) to make `path` again unless the nearest of it and its parents that exists is on the filesystem
    `dev` (the cache dir's at the mount): a cache disk unmounted lazily under the mount leaves the path on the one
    below it (the root filesystem), which `what`, sized for the disk, would fill."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.stat(existing).st_dev != dev:
        raise OSError(errno.ENODEV, f"{existing} is no longer on the cache dir's filesystem (was its disk "
                                    f"unmounted?): {what} is not made again there")


def is_cache_dir(root: str) -> bool:
    """Whether `root` is a cache dir: it has `chunks/`, or a `lock` that names a modelfs holder (an operator's
    `rm -rf CACHE/chunks` under a live mount, which makes it again at its next put, left only that)."""
    if os.path.isdir(os.path.join(root, CHUNKS_DIR)):
        return True
    text = _holder(os.path.join(root, LOCK_FILE))
    return bool(text) and all(_LOCK_LINE.fullmatch(line) for line in text.splitlines())


def _holder(path: str) -> str:
    """What the holder wrote in `lock`: its pid, and DRAINING after it if so."""
    try:
        pid_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "unknown"
    try:
        return os.pread(pid_fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
    except OSError:
        return "unknown"
    finally:
        os.close(pid_fd)


def _write_pid(path: str) -> None:
    """This process's pid into `lock`, for the next comer's message. A read-only cache dir keeps the file it has,
    or none."""
    _write_holder(path, f"{os.getpid()}\n")


def _write_holder(path: str, text: str) -> None:
    """`text` into `lock`: written over the old text, then cut to its length, so that a reader never finds the
    file empty. A read-only cache dir keeps the file it has, or none."""
    pid_fd = _open_lock_file(path, os.O_WRONLY | os.O_CREAT)
    if pid_fd is None:
        return
    try:
        data = text.encode()
        os.pwrite(pid_fd, data, 0)
        os.ftruncate(pid_fd, len(data))
    finally:
        os.close(pid_fd)


def release_dir_lock(fd: int) -> None:
    file_fd = _LOCK_FILES.pop(fd, None)
    if file_fd is not None:
        os.close(file_fd)
    os.close(fd)  # closing the only descriptor of the open directory drops the flock


def bytes_for_fraction(root: str | os.PathLike[str], fraction: float) -> int:
    """`--cache-size 80%`: that fraction of the total size of the filesystem that holds (or will hold)
    root. The nearest existing parent is measured when root does not exist yet."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cache size fraction must be in (0, 1], got {fraction}")
    path = os.path.abspath(os.fspath(root))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    if st.f_blocks == 0:
        raise ValueError(f"the filesystem of {path} reports a size of 0 (a FUSE or virtual filesystem?), so "
                         f"--cache-size cannot be a share of it: give it in bytes, or use a local disk")
    return int(st.f_blocks * st.f_frsize * fraction)


def cache_bytes(size: CacheSize, root: str) -> int:
    """The bytes a `--cache-size` names for a cache at `root` (a fraction is of its filesystem)."""
    if size.fraction is None:
        return size.bytes
    os.makedirs(root, mode=0o700, exist_ok=True)
    return bytes_for_fraction(root, size.fraction)
