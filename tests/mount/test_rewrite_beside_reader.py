"""A reader of a file beside a rewrite in place (open O_TRUNC, write, close) of the same name through the same
`--writable --allow-overwrite` mount: the rewrite keeps the inode, so the reader's page cache and the kernel's size
of the file are the writer's too. Whatever the reader does (`pread` at offsets around the old end and the pages,
`read` from the start, `mmap`), each page it gets is the old version's or the new one's bytes at that offset,
short, or EIO (SIGBUS for the mmap), never bytes no version held (the zeros the kernel fills a short READ's pages
with); once the rewrite is stored it reads the new version, and so does any other process (RELIABILITY B95)."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import Fault, FaultProxy
from tests.helpers import S3Server, delete_bucket, mounted, mounted_via, new_bucket

WRITABLE = ("--writable", "--allow-overwrite", "--metadata-ttl", "60")
PAGE = 4096

# One process holds the reader and the writer, and touches its mapping in forked children, which a SIGBUS ends
# (not it, which writes on). It prints one JSON line per step: the bytes a read got at an offset, or its errno.
SCENARIO = textwrap.dedent("""
    import errno, json, mmap, os, random, signal, sys
    path, how, old_size, new_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    new = random.Random(2).randbytes(new_size)
    half = new_size // 2
    offsets = sorted({0, 1, PAGE - 1, PAGE, old_size - 1, old_size, old_size + 1, half - 1, half, new_size - 1})
    offsets = [o for o in offsets if o >= 0]

    def say(phase, what, off, got=None, err=0):
        print(json.dumps({"phase": phase, "what": what, "off": off, "hex": None if got is None else got.hex(),
                          "errno": err}), flush=True)

    def touch(phase, mm, off, size):
        # In a forked child, which a SIGBUS ends, not this process, which writes on.
        out, into = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(into, mm[off:off + size] if off < len(mm) else b"")
            os._exit(0)
        os.close(into)
        _, status = os.waitpid(pid, 0)
        got = os.read(out, 1 << 20)
        os.close(out)
        if os.WIFSIGNALED(status):
            say(phase, "mmap", off, err="SIGBUS" if os.WTERMSIG(status) == signal.SIGBUS else os.WTERMSIG(status))
        else:
            say(phase, "mmap", off, got)

    def reads(phase, r, mm):
        for off in offsets:
            for size in (1, 3 * PAGE):
                if mm is not None:
                    touch(phase, mm, off, size)
                    continue
                try:
                    say(phase, "pread", off, os.pread(r, size, off))
                except OSError as exc:
                    say(phase, "pread", off, err=exc.errno)
        if how == "read":
            os.lseek(r, 0, os.SEEK_SET)
            got = bytearray()
            try:
                while block := os.read(r, 3000):
                    got += block
                say(phase, "read", 0, bytes(got))
            except OSError as exc:
                say(phase, "read", 0, bytes(got), exc.errno)

    r = os.open(path, os.O_RDONLY)
    # The old version in the inode's pages, its last page filled with zeros past its end: the rewrite drops them.
    say("before", "pread", 0, os.pread(r, old_size + PAGE, 0))
    w = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.open(path, os.O_RDONLY)
        say("writing", "open", 0, b"")
    except OSError as exc:  # opened during the rewrite: EBUSY until it is stored
        say("writing", "open", 0, err=exc.errno)
    os.write(w, new[:half])
    mm = None
    if how == "mmap":
        mm = mmap.mmap(r, half, prot=mmap.PROT_READ)  # the kernel's size now: what was written
    reads("writing", r, mm)
    os.write(w, new[half:])  # past the pages the reads above filled
    reads("writing", r, mm)
    os.close(w)
    if mm is not None:
        mm.close()
        mm = mmap.mmap(r, new_size, prot=mmap.PROT_READ) if new_size else None
    reads("stored", r, mm)
""").replace("PAGE", str(PAGE))


def versions(old_size: int, new_size: int) -> tuple[bytes, bytes]:
    return random.Random(1).randbytes(old_size), random.Random(2).randbytes(new_size)


def of_a_version(got: bytes, off: int, versions: tuple[bytes, ...]) -> bool:
    """Each page of `got` (read at `off`) is some version's bytes at that offset."""
    pos = off
    while pos < off + len(got):
        end = min(off + len(got), (pos // PAGE + 1) * PAGE)
        piece = got[pos - off:end - off]
        if not any(v[pos:end] == piece for v in versions):
            return False
        pos = end
    return True


def check(lines: list[dict], old: bytes, new: bytes) -> list[str]:
    bad = []
    for line in lines:
        got = bytes.fromhex(line["hex"] or "")  # what a read() got before its error
        where = f"{line['phase']} {line['what']} at {line['off']}"
        if line["what"] == "open":
            if line["errno"] != errno.EBUSY:
                bad.append(f"{where}: {line}")
        elif line["errno"] not in (0, errno.EIO, "SIGBUS"):
            bad.append(f"{where}: errno {line['errno']}")
        elif line["phase"] == "before":
            if got != old:
                bad.append(f"{where}: {len(got)} bytes, not the old version")
        elif line["phase"] == "stored":
            if line["errno"] or got != new[line["off"]:line["off"] + len(got)] or (line["what"] == "read"
                                                                                   and got != new):
                bad.append(f"{where}: {got[:16].hex() if got else got}..., not the stored version")
        elif not of_a_version(got, line["off"], (old, new)):
            bad.append(f"{where}: {len(got)} bytes {got[:16].hex()}... are no version's (old {len(old)} bytes, new "
                       f"{len(new)})")
    return bad


def run_scenario(path: Path, how: str, old: bytes, new: bytes) -> list[str]:
    res = subprocess.run([sys.executable, "-c", SCENARIO, str(path), how, str(len(old)), str(len(new))],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return check([json.loads(line) for line in res.stdout.splitlines()], old, new)


SIZES = [(0, 30000), (5000, 30000), (30000, 5000)]
SIZE_IDS = ["old-empty", "longer", "shorter"]


@pytest.mark.parametrize("cache_dir", [False, True], ids=["streamed", "cache-dir"])
def test_a_reader_beside_a_rewrite_in_place_reads_only_versions_bytes(s3: S3Server, mountpoint: Path,
                                                                     tmp_path: Path, cache_dir: bool) -> None:
    """B95: a reader of the old version whose READ came back short while this mount rewrote the file got the
    kernel's zero-fill of the READ's pages, kept in the inode's page cache: an mmap, or a read once the writer's
    size went past them, read zeros that no version held."""
    extra = ["--cache-dir", str(tmp_path / "cache")] if cache_dir else []
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, *extra):
        bad = []
        for (old_size, new_size), size_id in zip(SIZES, SIZE_IDS, strict=True):
            old, new = versions(old_size, new_size)
            for how in ("pread", "read", "mmap"):
                name = f"{size_id}-{how}.bin"
                s3.client().put_object(Bucket=bucket, Key=name, Body=old)
                bad += [f"{name}: {b}" for b in run_scenario(mountpoint / name, how, old, new)]
                # Another process, after the store: the inode's pages hold the new version only.
                assert (mountpoint / name).read_bytes() == new, name
                assert s3.client().get_object(Bucket=bucket, Key=name)["Body"].read() == new, name
        assert not bad, "\n".join(bad[:20])
    delete_bucket(s3, bucket)


def test_a_read_whose_read_is_answered_after_a_write_of_the_rewrite_gets_no_zeros(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """B95, the crowd test's failure: a READ of the old version in flight (its GET slow) while the writer's WRITE was
    answered. The kernel keeps the size the WRITE gave (it cuts the size back at a short READ only where nothing
    changed it meanwhile), so the read() that sent the READ copied the zeros past the old version's end."""
    bucket = new_bucket(moto_server)
    old, new = versions(5000, 30000)
    moto_server.client().put_object(Bucket=bucket, Key="f.bin", Body=old)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITABLE):
        path = mountpoint / "f.bin"
        proxy.inject(Fault.LATENCY, seconds=1.0)  # the old version's GETs
        r = os.open(path, os.O_RDONLY)
        w = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(w, new[:20000])
            writer = threading.Timer(0.3, os.write, (w, new[20000:]))  # while the READ below waits on its GET
            writer.start()
            started = time.monotonic()
            try:
                got = os.pread(r, 100, 6000)  # past the old end, inside what was written
            except OSError as exc:
                assert exc.errno == errno.EIO
                got = b""
            took = time.monotonic() - started
            writer.join()
            assert took > 0.5, "the write did not come while the READ was out"
            assert of_a_version(got, 6000, (old, new)), f"{len(got)} bytes {got[:16].hex()}... are no version's"
        finally:
            os.close(w)
            os.close(r)
        assert path.read_bytes() == new
    delete_bucket(moto_server, bucket)
