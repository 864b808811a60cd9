"""Which pages of a file the kernel's page cache holds now: mincore(2) over a mapping of the file that is
never touched, so nothing is read or faulted in.

The daemon asks this of its own mount's files (mount.Daemon.resident opens them through the mount from a
worker thread; Operations answers that OPEN without starting a stream). It is the truth that a READ only
hints at: a READ of a page believed held shows the kernel lacks that page, not how much of the file went
with it. The kernel drops a whole file at `drop_caches` or `POSIX_FADV_DONTNEED`, a few pages at a time under
reclaim, and some hosts reclaim cold page cache proactively with memory free (DAMON's `pageout`, as the dev
box's VM does: pushed pages nobody has touched yet are the coldest), so guessing "the whole file" made model
streaming fetch a 128 MiB shard again for 1 MiB lost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

from fsmount.capabilities import CAP_FOWNER, has_capability

PAGE = mmap.PAGESIZE
# mincore's vector: bit 0 of each byte says whether that page is resident; the other bits are reserved.
_RESIDENT_BIT = bytes(b & 1 for b in range(256))

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(fd: int, length: int) -> bytes:
    """One byte per page of the first `length` bytes of the file open at `fd`: 1 where the page cache holds
    the page, 0 where not. Raises OSError."""
    if length <= 0:
        return b""
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    try:
        vec = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
        if _libc.mincore(addr, length, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        return vec.raw.translate(_RESIDENT_BIT)
    finally:
        _libc.munmap(addr, length)


def whole_ranges(pages: bytes, ranges: list[tuple[int, int]]) -> list[bool]:
    """For each byte range [start, end), whether the page cache holds every page of it (`pages` as
    `resident_pages` gives them; a range past them is not held)."""
    held = []
    for start, end in ranges:
        first, last = start // PAGE, (end - 1) // PAGE + 1
        held.append(end > start and last <= len(pages) and pages.count(0, first, last) == 0)
    return held


class NotTold(OSError):
    """The kernel would not say: mincore reports every page of a file as resident unless the caller owns the file,
    has CAP_FOWNER, or may write it (`can_do_mincore`); a daemon under the systemd unit (no CAP_FOWNER) with
    `--uid` someone else, on a read-only mount, would have believed every chunk held."""


def may_ask(owner: int, status: str = "/proc/self/status") -> bool:
    """Whether mincore tells this process the truth about a file owned by `owner` (read-only descriptors)."""
    return owner == os.geteuid() or has_capability(CAP_FOWNER, status)


def held_ranges(path: str, ino: int, ranges: list[tuple[int, int]]) -> list[bool] | None:
    """`whole_ranges` of the file at `path`, or None if it could not be opened or is not inode `ino` (replaced
    or deleted since). Raises OSError if the kernel would not say (mmap or mincore refused: a seccomp filter
    without mincore; NotTold: not the files' owner). Blocks: run it in a thread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_ino != ino:
            return None
        if not may_ask(st.st_uid):
            raise NotTold(f"mincore answers only the files' owner or CAP_FOWNER, and the files are uid {st.st_uid}")
        end = max((e for _, e in ranges), default=0)
        return whole_ranges(resident_pages(fd, end), ranges)
    finally:
        os.close(fd)
