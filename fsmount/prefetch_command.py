"""`modelfs prefetch PATH...`: warm a mounted tree by reading it through the mount, in parallel, with a
progress bar. The daemon does the fetching; reading fills its NVMe cache and (unless told not to) the
kernel page cache. Then it waits until the daemon has written what it fetched to its cache levels (the
NVMe cache, and the shared tier, whose writes trail the load): once it returns, the tier is warm for the
fleet. It runs in the user's process, never inside the daemon. A file replaced in the bucket since the mount
listed it, whose read the daemon fails with EIO, is opened again once and read as the bucket holds it now: only
where the daemon says it refused a read for its version since the prefetch began (`versions_gone`), as that open
asks the origin, and on one that answers nothing took a second read timeout.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from fsmount.mountinfo import Mount, holding, mounts, top_at

# Large reads keep many chunks in flight in the daemon; several threads per file spread them.
BLOCK = 8 << 20
THREADS = 8
MODELFS_FSTYPE = "fuse.modelfs"
# How often the daemon's pending cache writes are looked at while waiting for them.
WRITES_POLL_S = 0.2


class WarmError(Exception):
    pass


class PartlyWarmed(WarmError):
    """Some paths given or files under them could not be read; the others were (`done` bytes read in all)."""

    def __init__(self, message: str, done: int):
        super().__init__(message)
        self.done = done


# A prefetch names at most this many of the files it could not read (and counts the rest).
FAILURES_NAMED = 5


def mount_fstype(path: str) -> str | None:
    """The file system type of the mount holding `path` (from /proc/self/mountinfo)."""
    return mount_of(path)[1]


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo", resolve: bool = True) -> tuple[str, str | None]:
    """(mount point, file system type) of the mount holding `path` (from /proc/self/mountinfo). With
    `resolve=False` the path is taken as it is (absolute, no symlinks): nothing is asked of any file system,
    not even the mount's own daemon, which may be stopped or hung."""
    return _holding(os.path.realpath(path) if resolve else os.path.abspath(path), mounts(mountinfo))


def _holding(path: str, listed: list[Mount]) -> tuple[str, str | None]:
    """(mount point, file system type) of the mount of `listed` holding the absolute `path` (`mountinfo.holding`: the
    one the path reaches); ("", None) if none does."""
    on = holding(os.fsencode(path), listed)
    return ("", None) if on is None else (os.fsdecode(on.point), os.fsdecode(on.fstype))


# Symlinks followed in one path before `resolve_unasked` gives up on it (the kernel's limit, ELOOP).
MAX_SYMLINKS = 40


def resolve_unasked(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """`os.path.realpath(path)`, asking no modelfs daemon: a part that is a mount point (a mount's root is never a
    symlink) or that lies in a modelfs mount (which has no symlinks) is taken as it is; the others are read as realpath
    reads them (readlink). realpath's lstat of a mount's root went to its daemon, and one stopped or hung never
    answered: `modelfs unmount --stale` of a symlink to its mount (the unit's MOUNTPOINT) hung until TimeoutStartSec
    (B343). A symlink loop (more than MAX_SYMLINKS) leaves the rest of the path as it is, as realpath does."""
    listed = mounts(mountinfo)
    points = {os.fsdecode(m.point) for m in listed}

    def unasked(candidate: str) -> bool:
        return candidate in points or _holding(candidate, listed)[1] == MODELFS_FSTYPE

    parts = os.path.join(os.getcwd(), path).split("/")[::-1]  # a stack: the next part last
    resolved, links = "/", 0
    while parts:
        name = parts.pop()
        if name in ("", "."):
            continue
        if name == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, name)
        target = None
        if links < MAX_SYMLINKS and not unasked(candidate):
            try:
                target = os.readlink(candidate)
            except OSError:  # not a symlink (EINVAL), or not there: as it is
                pass
        if target is None:
            resolved = candidate
            continue
        links += 1
        resolved = "/" if target.startswith("/") else resolved
        parts.extend(target.split("/")[::-1])
    return resolved


def closed_to_you(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """Why `path` may be refused (EACCES) to this user: it is on another user's modelfs mount made without
    --allow-other, which the kernel keeps to that user alone, whatever the modes say; "" where that is not so."""
    real = os.path.realpath(path)
    on = holding(os.fsencode(real), mounts(mountinfo))
    owner = _user_id(on) if on is not None and on.fstype == MODELFS_FSTYPE.encode() else None
    if on is None or owner is None or owner == os.getuid() or b"allow_other" in on.options.split(b","):
        return ""
    best = os.fsdecode(on.point)
    import pwd

    try:
        whose = f"{pwd.getpwuid(owner).pw_name} (uid {owner})"
    except KeyError:
        whose = f"uid {owner}"
    return (f"{best} is the modelfs mount of {whose}, made without --allow-other, so no other user may enter it; its "
            "owner can mount it with --allow-other to let others in")


def mount_owner(path: str, mountinfo: str = "/proc/self/mountinfo") -> int | None:
    """The uid of the user who made the FUSE mount at exactly `path` (its `user_id=` in the mount's options; the
    topmost mount there), or None where there is none or it says no user. fusermount3 lets a user other than root
    unmount only their own mounts, and says of any other "entry ... not found in /etc/mtab"."""
    top = top_at(os.fsencode(path), mounts(mountinfo))
    return _user_id(top) if top is not None else None


def _user_id(mount: Mount) -> int | None:
    """The `user_id=` of a FUSE mount's options, or None where it has none."""
    for option in mount.options.split(b","):
        if option.startswith(b"user_id=") and option[len(b"user_id="):].isdigit():
            return int(option[len(b"user_id="):])
    return None


def _raise(exc: OSError) -> None:
    raise exc  # a directory that cannot be listed is a failure, not an empty directory


def files_under(paths: list[str]) -> Iterator[tuple[str, str, int]]:
    """(path, where it is, size) of every file under `paths`. Where it is: under the real path of the path given, so
    that a file named through a symlink to the mount (or to a directory in it) and by its own path is one file. Only
    the paths given are resolved: the mount has no symlinks, and realpath of each file would lstat every component."""
    for path in paths:
        real = os.path.realpath(path)
        if os.path.isdir(path):
            for dirpath, dirnames, filenames in os.walk(path, onerror=_raise):
                dirnames.sort()
                for name in sorted(filenames):
                    p = os.path.join(dirpath, name)
                    yield p, os.path.join(real, os.path.relpath(p, path)), os.stat(p).st_size
        else:
            yield path, real, os.stat(path).st_size


def warm(paths: list[str], *, keep_pagecache: bool = True, threads: int = THREADS,
         progress: bool = True) -> int:
    """Read every file under `paths`; returns bytes read. A file that cannot be opened or read does not stop the
    others, nor does a path given that cannot be found or is not on a modelfs mount (a stale shard named on the command
    line, or a local copy's path beside the mount's, read nothing at all): PartlyWarmed at the end names what failed
    (a stale shard left a fleet warm-up mostly cold), as `cp` and `rm` go on past a bad operand. Only where no path
    given is on a modelfs mount and found, or the daemon of one is gone, is it WarmError before any read."""
    failures: list[str] = []
    found: list[str] = []
    for path in paths:
        try:
            os.stat(path)
            os.statvfs(path)  # always asks the daemon: a stat may be answered from cached attributes
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise WarmError(f"{path}: the daemon of its mount is gone (transport endpoint is not connected); "
                                "`modelfs unmount` it and mount again") from None
            why = closed_to_you(path) if exc.errno == errno.EACCES else ""
            failures.append(f"{path}: {exc.strerror.lower() if exc.strerror else exc}" + (f" ({why})" if why else ""))
            continue
        if mount_fstype(path) != MODELFS_FSTYPE:  # not read: warming a local disk's files is no prefetch
            failures.append(f"{path} is not on a modelfs mount")
            continue
        found.append(path)
    if not found:  # named as the failures at the end are: a stale list of 60 shards made a 60-path message
        raise WarmError(_named(failures))
    try:
        # Each file once, however many of the paths name it (a directory and a file in it, a path twice, a symlink to
        # the mount beside the mount's own path).
        listed = {where: (path, size) for path, where, size in files_under(found)}
    except OSError as exc:
        raise WarmError(f"{exc.filename or found[0]}: {exc.strerror or exc}") from None
    files = list(listed.values())
    where_of = {path: where for where, (path, _) in listed.items()}
    # Reads each mount's daemon had refused for their version before the first open (None: it does not say).
    gone_before = {mount: versions_gone(mount) for mount in mounts_of(found)}

    def found_gone(path: str) -> bool:
        """Whether the daemon of `path`'s mount refused a read for its version since the prefetch began: an EIO
        may then be of a file replaced since the mount listed it (`_replaced`). Asked of the daemon alone."""
        mount = mount_of(where_of[path], resolve=False)[0]
        before = gone_before.get(mount)
        now = versions_gone(mount) if before is not None else None
        return now is not None and before is not None and now > before

    total = sum(size for _, size in files)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="prefetch",
                   file=sys.stderr, dynamic_ncols=True)
    lock = threading.Lock()
    done = 0

    def read_block(fd: int, offset: int, size: int) -> None:
        nonlocal done
        left, pos = size, offset
        while left > 0:
            got = os.pread(fd, min(left, BLOCK), pos)
            if not got:
                raise WarmError(f"unexpected end of file at {pos}")
            pos += len(got)
            left -= len(got)
        if not keep_pagecache:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
        with lock:
            done += size
            if bar is not None:
                bar.update(size)

    # Files whose blocks are submitted and not yet waited for, oldest first: up to `threads` of them, so that
    # small files are read side by side too (one at a time, 3000 files of 4 KB took 14 s).
    open_files: collections.deque[tuple[str, int, list[Future[None]]]] = collections.deque()
    # Files read again as the version the bucket holds now (`_replaced`): each at most once.
    read_again: set[str] = set()

    def submit(path: str, fd: int, size: int) -> None:
        open_files.append((path, fd, [pool.submit(read_block, fd, off, min(BLOCK, size - off))
                                      for off in range(0, size, BLOCK)]))

    def finish() -> None:
        path, fd, futures = open_files.popleft()
        try:
            concurrent.futures.wait(futures)  # every block, failed or not, before its descriptor closes
            errors = [fut.exception() for fut in futures if fut.exception() is not None]
            if errors and path not in read_again and found_gone(path):
                again = _replaced(path, fd, errors[0])
                if isinstance(again, int):
                    read_again.add(path)
                    size = os.fstat(again).st_size
                    if bar is not None:
                        bar.total += size
                        bar.refresh()
                    submit(path, again, size)
                    return
                if again:
                    failures.append(f"{path}: {again}")
                    return
            if errors:
                failures.append(f"{path}: {_reason(errors[0])}")
        finally:
            os.close(fd)

    def open_waiting(path: str) -> int:
        # Descriptors can run out before `threads` files are open (--threads 256 at `ulimit -n` 128 failed every
        # file past the limit with EMFILE): the oldest file open is finished, and its descriptor taken.
        while True:
            try:
                return os.open(path, os.O_RDONLY)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE) or not open_files:
                    raise
                finish()

    try:
        with ThreadPoolExecutor(threads) as pool:
            for path, listed in files:
                try:
                    fd = open_waiting(path)
                except OSError as exc:
                    failures.append(f"{path}: {_reason(exc)}")
                    continue
                # The size of the version opened, not the one listed: past --metadata-ttl the open may find another
                # version (a revision pushed while a long prefetch ran), which the listed size read short, said to be
                # warm, or failed as "unexpected end of file" where the new one is smaller.
                size = os.fstat(fd).st_size
                if size != listed and bar is not None:
                    bar.total += size - listed
                    bar.refresh()
                submit(path, fd, size)
                while len(open_files) > threads:
                    finish()
            while open_files:
                finish()
    finally:
        for _, fd, _ in open_files:  # a failure left these: the pool has waited for their blocks
            os.close(fd)
        if bar is not None:
            bar.close()
    if failures:
        # A path given not found or not on a modelfs mount is a path not read (a directory, a local copy's), not a
        # file (B1085); "the other 0 were" where none was read, "the other 1 were" for one: words that read as cut
        # short (B234).
        unread = len(paths) - len(found)
        failed = len(failures) - unread
        read = len(files) - failed
        said = [f"{unread} of {len(paths)} paths given {'was' if unread == 1 else 'were'} not read"] if unread else []
        if failed:
            said.append(f"{failed} of {len(files)} files could not be read")
        if not read:
            rest = ""
        elif not unread:
            rest = "; the other one was read" if read == 1 else f"; the other {read} were read"
        else:
            rest = (f"; the other {'file was' if read == 1 else f'{read} files were'} read" if failed else
                    f"; {'one file was' if read == 1 else f'{read} files were'} read")
        raise PartlyWarmed(f"{' and '.join(said)} ({_named(failures)}){rest}", done)
    return done


def _named(failures: list[str]) -> str:
    """The first FAILURES_NAMED of `failures`, and how many more."""
    more = f"; and {len(failures) - FAILURES_NAMED} more" if len(failures) > FAILURES_NAMED else ""
    return "; ".join(failures[:FAILURES_NAMED]) + more


def _replaced(path: str, fd: int, error: BaseException) -> int | str | None:
    """After a read of `path` (open as `fd`) failed with `error`: a descriptor of the version the bucket holds now
    where the one read was replaced in the bucket since the mount listed it (the daemon answers EIO for the old
    version and gives the new one a new inode at once, whatever its --metadata-ttl: a prefetch run right after a
    new revision was pushed read the new one in a second run only); what to say where the file was deleted
    meanwhile; None where it was not replaced (the EIO is the daemon's: origin down, read timeout). Called only
    where the daemon refused some read for its version since the prefetch began (`versions_gone`): the open asks the
    origin, and one that answers nothing held it a second read timeout."""
    if not isinstance(error, OSError) or error.errno != errno.EIO:
        return None
    try:
        again = os.open(path, os.O_RDONLY)  # a superseded inode's open is ESTALE: the kernel looks the path up again
    except FileNotFoundError:
        return "deleted from the bucket since the mount listed it"
    except OSError:
        return None
    if os.fstat(again).st_ino != os.fstat(fd).st_ino:
        return again
    os.close(again)
    return None


def versions_gone(mountpoint: str) -> int | None:
    """READs the daemon of `mountpoint` refused because the bucket no longer held their version, so far; None where
    it does not say (a daemon of an older version, no modelfs mount there)."""
    from fsmount.stats_table import StatsUnavailable, read_stats

    try:
        count = read_stats(mountpoint).get("versions_gone")
    except StatsUnavailable:
        return None
    return count if isinstance(count, int) else None


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def answering(paths: list[str]) -> None:
    """Before anything touches the mounts of `paths`: each daemon answers within stats' timeout. A stopped or
    hung daemon otherwise held the prefetch in the kernel (D state, deaf to Ctrl-C) until it woke up. Found
    from the paths as written (no symlink resolved, so nothing asks the mount yet); a path reached through a
    symlink is checked by what follows."""
    from fsmount.stats_table import DaemonSilent, StatsUnavailable, read_stats

    mounts = (mount_of(path, resolve=False) for path in paths)
    for mount in sorted({mnt for mnt, fstype in mounts if fstype == MODELFS_FSTYPE}):
        try:
            read_stats(mount)
        except DaemonSilent as exc:
            raise WarmError(str(exc)) from None
        except StatsUnavailable:
            pass  # a daemon gone, a mount of another version: the checks that follow say so in prefetch's words


def pending_writes(mountpoint: str) -> int:
    """Chunks the daemon of `mountpoint` fetched and has not yet written to its cache levels."""
    from fsmount.stats_table import StatsUnavailable, read_stats

    try:
        stats = read_stats(mountpoint)
    except StatsUnavailable as exc:
        raise WarmError(str(exc)) from None
    if "cache_writes_pending" not in stats:  # a daemon of an older version
        raise WarmError(f"{mountpoint}: its daemon runs another version of modelfs, which does not say what it has "
                        "still to write to its caches: restart the mount to run this version, or pass "
                        "--write-wait 0")
    return int(stats["cache_writes_pending"])


def mounts_of(paths: list[str]) -> list[str]:
    """The modelfs mount points holding `paths`, each once. Not the mount of a path given that was not found, on
    another file system (`modelfs prefetch /models/m /tmp/typo`): `warm` named it, and its mount has no daemon to
    wait for."""
    return sorted({mnt for mnt, fstype in map(mount_of, paths) if fstype == MODELFS_FSTYPE})


def unwritten(paths: list[str]) -> int:
    """Chunks the daemons of the mounts holding `paths` have failed to write to a cache level so far (the NVMe
    cache's write errors, the shared tier's, and chunks each level was skipped for while failing or refusing
    writes): a prefetch that adds to it did not warm the caches it was run for."""
    from fsmount.stats_table import StatsUnavailable, read_stats

    total = 0
    for mount in mounts_of(paths):
        try:
            s = read_stats(mount)
        except StatsUnavailable:
            continue  # not a (live) modelfs mount: what warms it says so
        # The NVMe cache's skipped writes too: while its writes pause after a failure (a full disk), every chunk is
        # skipped, and a prefetch then said it warmed a cache that got none of them.
        levels = (("disk_cache", ("write_errors", "writes_skipped")),
                  ("shared_cache", ("chunk_write_errors", "writes_skipped")))
        for level, keys in levels:
            if s.get(level):
                total += sum(int(s[level].get(k, 0)) for k in keys)
    return total


def fetched_chunks(n: int) -> str:
    """'1 fetched chunk', '3 fetched chunks': a prefetch that left one chunk said "waiting for 1 fetched chunks"."""
    return f"{n} fetched chunk{'' if n == 1 else 's'}"


def wait_for_writes(paths: list[str], timeout: float, *, say: Callable[[str], None] = lambda line: None,
                    clock: Callable[[], float] = time.monotonic) -> int:
    """Wait until the daemons of the mounts holding `paths` have no cache write pending, up to `timeout`
    seconds; the number still pending then (0: all written)."""
    mounts = mounts_of(paths)
    deadline = clock() + timeout
    said = False
    while True:
        pending = sum(pending_writes(m) for m in mounts)
        if not pending or clock() >= deadline:
            return pending
        if not said:
            say(f"waiting for {fetched_chunks(pending)} to be written to the cache levels")
            said = True
        time.sleep(WRITES_POLL_S)
