"""`modelfs cache stats|clear|verify DIR`: maintenance of a cache directory, run in the CLI process.

`stats` only stats files and is safe beside a live mount; `clear` and `verify` delete files, so they take
the directory lock and fail with CacheDirBusy while a mount holds it.
"""

from __future__ import annotations

import contextlib
import os
import time

from fsmount.data.cache_dir import (
    CHUNKS_DIR,
    acquire_dir_lock,
    release_dir_lock,
    scan_chunk_files,
    staged_writes,
    sweep_saved_names,
    sweep_staged_writes,
)
from fsmount.data.chunk_file import Corrupt, OtherFormat, read_chunk_file


def cache_stats(root: str | os.PathLike[str]) -> dict[str, int | float | None]:
    """Counts from a stat-only scan; safe while a mount uses the dir. Access times are epoch seconds, of the stamps
    not in the future: one there was set while the clock was ahead (stepped back since), and the cache counts it as
    older than every other (disk_cache: evicted first), so it is counted apart (`future_stamps`) and neither the
    oldest access nor, a date to come, the newest."""
    found, _ = scan_chunk_files(os.path.join(os.fspath(root), CHUNKS_DIR), sweep_tmp=False)
    now = time.time_ns()
    stamps = [mtime_ns for mtime_ns, _d, _s, _p in found if mtime_ns <= now]
    staged_files, staged_bytes = staged_writes(os.fspath(root))
    return {
        "chunks": len(found),
        "bytes": sum(size for _m, _d, size, _p in found),
        "oldest_access": min(stamps) / 1e9 if stamps else None,
        "newest_access": max(stamps) / 1e9 if stamps else None,
        "future_stamps": len(found) - len(stamps),
        # Local copies of files a --writable mount is writing, or that a killed one left behind (`clear` removes
        # them, and so does the next mount of the dir).
        "staged_files": staged_files,
        "staged_bytes": staged_bytes,
    }


def cache_clear(root: str | os.PathLike[str]) -> tuple[int, int, int]:
    """Delete every chunk and temp file, the copies a killed --writable mount left in `writes/`, and the names kept in
    `names/` (without chunks, a mount started while the origin is away would list files it cannot read); (chunk and
    temp files removed, bytes of copies removed, files of names removed). Files named none of these, and anything that
    is not a shard directory, are left alone (a file there made it fail with a traceback, and it deleted what it did
    not write). CacheDirBusy while a mount holds the dir."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        return 0, 0, 0
    fd = acquire_dir_lock(root)
    try:
        found, removed = scan_chunk_files(os.path.join(root, CHUNKS_DIR), sweep_tmp=True)
        for _mtime_ns, _digest, _size, path in found:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
        return removed, sweep_staged_writes(root)[1], sweep_saved_names(root)
    finally:
        release_dir_lock(fd)


def cache_verify(root: str | os.PathLike[str]) -> tuple[int, list[str], int]:
    """Read and check every chunk file (header names the chunk its file name hashes, data checksum);
    delete the bad ones. (good count, corrupt paths, files of another version's format: unusable, not damaged).
    Takes the dir lock, as it deletes: CacheDirBusy."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        return 0, [], 0
    fd = acquire_dir_lock(root)
    try:
        found, _ = scan_chunk_files(os.path.join(root, CHUNKS_DIR), sweep_tmp=True)
        good, bad, other = 0, [], 0
        for _mtime_ns, digest, _size, path in sorted(found, key=lambda f: f[3]):
            try:
                chunk_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    stored, _data = read_chunk_file(chunk_fd, os.fstat(chunk_fd).st_size)
                finally:
                    os.close(chunk_fd)
                if stored.digest() != digest:
                    raise Corrupt("header names another chunk")
                good += 1
                continue
            except OtherFormat:
                other += 1
            except (OSError, Corrupt):
                bad.append(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return good, bad, other
    finally:
        release_dir_lock(fd)
