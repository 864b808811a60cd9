"""The daemon's allocator settings (mount.tune_malloc): a FUSE request's copy reuses warm heap memory."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap

import pytest

# A fresh process: tune_malloc, then 100 fresh 1 MiB bytes objects, as pyfuse3 makes one per WRITE.
PROBE = textwrap.dedent("""
    import resource
    from fsmount.mount import tune_malloc
    tune_malloc()
    source = bytearray(1 << 20)
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    before = faults()
    for _ in range(100):
        copy = bytes(source)
        del copy
    print(faults() - before)
""")


@pytest.mark.skipif(ctypes.util.find_library("c") != "libc.so.6", reason="glibc's mallopt only")
def test_a_fresh_copy_of_a_write_takes_no_fresh_pages() -> None:
    """With glibc's defaults (or a 1 MiB mmap threshold, as before) every copy is a new mmap, 256 page
    faults each (25,700 for the 100 here); tuned, the heap hands back the same warm memory."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60)
    faults = int(out.stdout)
    assert faults < 100 * 256 // 10, f"{faults} page faults for 100 copies of 1 MiB"
