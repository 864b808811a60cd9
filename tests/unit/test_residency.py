"""residency.py: which pages of a file the page cache holds, asked without reading them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import pytest

from fsmount import residency
from fsmount.residency import PAGE

MiB = 1 << 20
TMPFS_MAGIC = 0x01021994


def test_whole_ranges_holds_a_range_only_if_every_page_of_it_is_held() -> None:
    pages = bytes([1, 1, 0, 1, 1, 1])
    assert residency.whole_ranges(pages, [(0, 2 * PAGE), (PAGE, 3 * PAGE), (3 * PAGE, 6 * PAGE)]) == [
        True, False, True]
    # Partial pages count whole; past the vector (beyond the length asked) is not held; empty is not held.
    assert residency.whole_ranges(pages, [(PAGE + 1, 2 * PAGE - 1), (5 * PAGE, 7 * PAGE), (PAGE, PAGE)]) == [
        True, False, False]


def test_pages_read_are_held_and_pages_dropped_are_not(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 * MiB + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages: the kernel may drop them
        os.pread(fd, 8 * MiB + 100, 0)
        ranges = [(0, 4 * MiB), (4 * MiB, 8 * MiB + 100)]
        assert residency.held_ranges(str(path), os.fstat(fd).st_ino, ranges) == [True, True]
        assert residency.held_ranges(str(path), os.fstat(fd).st_ino + 1, ranges) is None  # another file
        assert residency.held_ranges(str(tmp_path / "missing"), 1, ranges) is None
        if _is_tmpfs(path):
            pytest.skip("tmpfs keeps pages that POSIX_FADV_DONTNEED drops elsewhere")
        os.posix_fadvise(fd, 6 * MiB, 2 * MiB, os.POSIX_FADV_DONTNEED)
        pages = residency.resident_pages(fd, 8 * MiB + 100)
        assert len(pages) == 8 * MiB // PAGE + 1
        assert pages.count(0) == 2 * MiB // PAGE
        assert residency.whole_ranges(pages, ranges) == [True, False]
    finally:
        os.close(fd)


def _is_tmpfs(path: Path) -> bool:
    class StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = StatFs()
    return libc.statfs(str(path).encode(), ctypes.byref(buf)) == 0 and buf.f_type == TMPFS_MAGIC


def test_only_the_owner_or_cap_fowner_is_told(tmp_path: Path) -> None:
    """mincore reports every page resident to a caller that neither owns the file, has CAP_FOWNER, nor may write
    it: a daemon under the systemd unit (no CAP_FOWNER) with --uid someone else would have believed every chunk
    held and fetched nothing when a stream ran again. Such a daemon is told nothing (NotTold), not lied to."""
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000000008\n")  # CAP_FOWNER only
    assert residency.may_ask(os.geteuid() + 1, str(status))
    status.write_text("Name:\tx\nCapEff:\t00000000a80425f7\n")  # a root shell's set less CAP_FOWNER
    assert not residency.may_ask(os.geteuid() + 1, str(status))
    assert residency.may_ask(os.geteuid(), str(status))  # the owner
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    os.chown(path, os.geteuid() + 1, -1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(residency, "may_ask", lambda owner, status="": owner == os.geteuid())  # without CAP_FOWNER
        with pytest.raises(residency.NotTold):
            residency.held_ranges(str(path), os.stat(path).st_ino, [(0, 4096)])
