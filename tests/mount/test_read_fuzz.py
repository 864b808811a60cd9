"""Differential fuzzing of the read path through a real mount: seeded random sequences of what readers do, every
byte compared with the bytes the test uploaded.

What it explores, mostly on 64 KiB chunks (`--chunk-size 64K`, the smallest: files span many chunks and most reads
cross a boundary):
- files of awkward sizes: 0, 1, a chunk -1, a chunk, a chunk +1, sizes that are no multiple of 4 KiB, a ~1.3 MiB
  blob, and a safetensors model (model streaming pushes its chunks into the page cache while readers read);
- what readers do: several handles on one file at once (opened and closed at random, some `O_DIRECT`), `pread` at
  random offsets and lengths (around chunk boundaries, at and past EOF), sequential `read` after `lseek`, aligned
  `O_DIRECT` reads, `mmap` and random slices of it (with `madvise` hints), `posix_fadvise` hints (WILLNEED,
  SEQUENTIAL, RANDOM, DONTNEED), `lseek` SEEK_DATA / SEEK_HOLE, `fstat`, `ls -l` of the directory, the page cache
  dropped between steps (`drop_caches` 1, 2 or 3, DONTNEED), and bursts of threads reading one file at once (through one
  shared descriptor, or one each);
- configurations: the defaults; `--memory-limit` at its minimum (4 chunks); model streaming off with
  `--get-client boto3`; `--metadata-ttl 0` with chunks that are no multiple of a page (100,000 bytes); `--cache-dir`
  cold, then a second mount on the same cache dir (warm); SeaweedFS at the minimum memory;
- objects replaced in the bucket between steps (same size, another size, empty) under `--metadata-ttl 1`: a handle
  opened before keeps reading its version or fails with EIO (never bytes of two versions), and an open more than a
  TTL after the change reads the new one.

Every operation must also end within `--read-timeout` (plus a margin): a reader is never hung. With a healthy origin
nothing may fail at all. A failure names the seed and the operations that led to it. Each run is bounded (a few
hundred operations, fixed seeds) to keep its place in the suite.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import mmap
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsmount.testing.models import write_model
from tests.helpers import (
    KiB,
    MiB,
    S3Server,
    drop_kernel_caches,
    mount_stats,
    mounted,
    new_bucket,
    put_objects,
    random_bytes,
    wait_for,
)

CHUNK = 64 * KiB
READ_TIMEOUT_S = 10.0
# An operation (a few reads at most) taking longer than this is a hung reader.
OP_BOUND_S = READ_TIMEOUT_S + 5.0
BASE = ("--read-timeout", f"{READ_TIMEOUT_S:g}")
SMALL_CHUNKS = ("--chunk-size", "64K")
PAGE = mmap.PAGESIZE
# To explore beyond the suite's fixed seeds: MODELFS_FUZZ_RUNS=N runs N seeds one after another where a test runs one
# (its seed, seed + 1, ...), each of MODELFS_FUZZ_STEPS operations if that is set; MODELFS_FUZZ_SEED_SHIFT=N moves
# every test's first seed on by N (read fuzz 1000 + 6000 runs 7000), to run seeds the suite never ran.
RUNS = int(os.environ.get("MODELFS_FUZZ_RUNS", "1"))
STEPS = int(os.environ.get("MODELFS_FUZZ_STEPS", "0"))
SHIFT = int(os.environ.get("MODELFS_FUZZ_SEED_SHIFT", "0"))


AWKWARD_SIZES = {"empty.bin": 0, "one.bin": 1, "chunk-1.bin": CHUNK - 1, "chunk.bin": CHUNK, "chunk+1.bin": CHUNK + 1,
                 "odd.bin": 3 * CHUNK + 4095, "blob.bin": 1300 * KiB + 17}


def awkward_files(tmp_path: Path, seed: int, sizes: dict[str, int] = AWKWARD_SIZES,
                  model_size: int = 1 * MiB + 4321) -> dict[str, bytes]:
    """Keys and bytes under `d/`: files of these sizes (by default the ones the module docstring names), and a
    safetensors model of about `model_size`."""
    model = tmp_path / f"model{seed}.safetensors"
    write_model(model, model_size, seed=seed)
    files = {f"d/{name}": random_bytes(size, seed * 100 + i) for i, (name, size) in enumerate(sizes.items())}
    files["d/model.safetensors"] = model.read_bytes()
    return files


# -- what the test knows of each file -------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Version:
    data: bytes
    since: float  # monotonic: just before its upload began
    until: float | None = None  # monotonic: once the upload that replaced it had returned


@dataclasses.dataclass(eq=False)
class Handle:
    """An open descriptor and the versions it may be reading (one, unless the object was replaced about when it
    was opened: then each read narrows them down; never to none)."""

    fd: int
    key: str
    direct: bool
    candidates: list[Version]


class Fuzzer:
    # The longest one system call may take (a few READs at most) before the reader counts as hung.
    op_bound = OP_BOUND_S
    # What may run while no descriptor is open.
    free_ops = ("op_open", "op_replace", "op_listdir")

    def __init__(self, server: S3Server, bucket: str, root: Path, files: dict[str, bytes], seed: int, *,
                 chunk: int = CHUNK, ttl: float | None = None, replace: bool = False):
        self.server, self.bucket, self.root = server, bucket, root
        self.chunk = chunk
        self.rng = random.Random(seed)
        self.seed = seed
        self.ttl = ttl
        self.replace = replace
        self.history: dict[str, list[Version]] = {k: [Version(v, -1.0)] for k, v in files.items()}
        self.handles: list[Handle] = []
        self.log: list[str] = []
        self.replacements = 0
        self.eio = 0
        self.slowest = (0.0, "")  # the slowest single operation: seconds, what

    def thread_bound(self, length: int) -> float:
        """The longest one `pread` of `length` bytes may take among a burst of threads (op_threads)."""
        return self.op_bound

    # -- bookkeeping ------------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        recent = "\n  ".join(self.log[-25:])
        pytest.fail(f"seed {self.seed}: {what}\n last operations:\n  {recent}")

    def current(self, key: str) -> Version:
        return self.history[key][-1]

    def openable(self, key: str, t0: float, t1: float) -> list[Version]:
        """The versions an open between t0 and t1 may get: the current one, and those replaced less than a TTL
        (and some slack: the kernel's entry, a listing begun earlier) before t0."""
        slack = 1.0
        return [v for v in self.history[key]
                if v.since <= t1 and (v.until is None or (self.ttl is not None and v.until > t0 - self.ttl - slack))]

    def may_be_gone(self, h: Handle) -> bool:
        """Whether the handle may read a version the bucket no longer holds (EIO is then allowed)."""
        return any(v is not self.current(h.key) for v in h.candidates)

    def narrow(self, h: Handle, what: str, got: bytes, start: int, length: int) -> None:
        """The handle read `got` for [start, start+length): keep the versions that hold those bytes there. Where the
        handle may read a version the bucket no longer holds, a read may also be short (exact bytes up to a READ that
        failed: the kernel's rule in RELIABILITY's first promise), which counts as the failure it is."""
        left = [v for v in h.candidates if v.data[start:start + length] == got]
        if not left and got and self.may_be_gone(h):
            left = [v for v in h.candidates if v is not self.current(h.key) and v.data[start:start + len(got)] == got]
            if left:
                self.eio += 1
                self.log.append(f"  -> {len(got)} of {length} bytes (allowed: a replaced version, short)")
        if not left:
            sizes = [len(v.data) for v in h.candidates]
            first_bad = next((i for i in range(len(got)) if all(
                i >= len(v.data) - start or v.data[start + i] != got[i] for v in h.candidates)), None)
            self.fail(f"{what} of {h.key} (fd {h.fd}{', O_DIRECT' if h.direct else ''}): {len(got)} bytes that no "
                      f"version holds there (sizes {sizes}), first wrong byte at +{first_bad}")
        h.candidates = left

    def errored(self, h: Handle, what: str, exc: OSError) -> None:
        if exc.errno in (errno.EIO, errno.ESTALE) and self.may_be_gone(h):
            self.eio += 1
            h.candidates = [v for v in h.candidates if v is not self.current(h.key)]
            self.log.append(f"  -> {errno.errorcode[exc.errno]} (allowed: a replaced version)")
            return
        self.fail(f"{what} of {h.key}: {exc!r}")

    def timed(self, what: str, fn, *args):  # noqa: ANN001, ANN202
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            took = time.monotonic() - start
            self.slowest = max(self.slowest, (took, what))
            if took > self.op_bound:
                self.fail(f"{what} took {took:.1f}s, past the bound of {self.op_bound:g}s")

    # -- choices ----------------------------------------------------------------------------------

    def offset(self, size: int) -> int:
        r = self.rng.random()
        if size == 0 or r < 0.12:
            return self.rng.choice([0, size, size + self.rng.randrange(1, 3 * self.chunk)])
        if r < 0.55:  # around a chunk boundary
            k = self.rng.randrange(0, size // self.chunk + 1)
            return max(0, k * self.chunk + self.rng.randrange(-7, 8))
        return self.rng.randrange(0, size)

    def length(self) -> int:
        c = self.chunk
        return self.rng.choice([1, 2, 7, 4095, 4096, c - 1, c, c + 1, 2 * c + 3, self.rng.randrange(1, 5 * c), MiB,
                                2 * MiB + 1])

    def pick(self) -> Handle:
        return self.rng.choice(self.handles)

    # -- operations -------------------------------------------------------------------------------

    def op_open(self) -> None:
        key = self.rng.choice(sorted(self.history))
        direct = self.rng.random() < 0.25
        t0 = time.monotonic()
        self.log.append(f"open {key}{' O_DIRECT' if direct else ''}")
        fd = self.timed(f"open {key}", os.open, self.root / key, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        t1 = time.monotonic()
        h = Handle(fd, key, direct, self.openable(key, t0, t1))
        self.handles.append(h)
        self.log.append(f"open {key} -> fd {fd}{' O_DIRECT' if direct else ''} "
                        f"(versions {[self.history[key].index(v) for v in h.candidates]})")
        self.op_fstat(h)

    def op_close(self) -> None:
        h = self.pick()
        self.handles.remove(h)
        os.close(h.fd)
        self.log.append(f"close fd {h.fd}")

    def op_fstat(self, h: Handle | None = None) -> None:
        h = h or self.pick()
        size = self.timed("fstat", os.fstat, h.fd).st_size
        left = [v for v in h.candidates if len(v.data) == size]
        if not left:
            self.fail(f"fstat of {h.key} (fd {h.fd}): size {size}, versions {[len(v.data) for v in h.candidates]}")
        h.candidates = left

    def _pread(self, h: Handle, offset: int, length: int, what: str) -> None:
        self.log.append(f"{what} fd {h.fd} {h.key} at {offset} len {length}")
        try:
            if h.direct:
                offset, length = offset // PAGE * PAGE, max(PAGE, -(-length // PAGE) * PAGE)
                buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT asks
                n = self.timed(what, os.preadv, h.fd, [buf], offset)
                got = bytes(buf[:n])
                buf.close()
            else:
                got = self.timed(what, os.pread, h.fd, length, offset)
        except OSError as exc:
            self.errored(h, what, exc)
            return
        self.narrow(h, what, got, offset, length)

    def op_pread(self) -> None:
        h = self.pick()
        size = len(h.candidates[0].data)
        self._pread(h, self.offset(size), self.length(), "pread")

    def op_sequential(self) -> None:
        h = self.pick()
        if h.direct:
            return self.op_pread()
        size = len(h.candidates[0].data)
        start = self.offset(size)
        block = self.rng.choice([4096, 65536, 128 * KiB + 3, MiB])
        budget = self.rng.choice([self.chunk, 4 * self.chunk, size])
        self.log.append(f"sequential fd {h.fd} {h.key} from {start} in {block} for {budget}")
        try:
            os.lseek(h.fd, start, os.SEEK_SET)
            pos, parts = start, []
            while pos - start < budget:
                got = self.timed("read", os.read, h.fd, block)
                if not got:
                    break
                if len(got) < block and not self.may_be_gone(h) and all(pos + len(got) < len(v.data)
                                                                        for v in h.candidates):
                    # Only a failing READ makes one short (RELIABILITY's first promise), and none fails here.
                    self.fail(f"read(2) of {h.key} at {pos}: {len(got)} of {block} bytes, before EOF")
                parts.append(got)
                pos += len(got)
        except OSError as exc:
            self.errored(h, "sequential read", exc)
            return
        got = b"".join(parts)
        self.narrow(h, "sequential read", got, start, len(got))
        if pos - start < budget and all(pos < len(v.data) for v in h.candidates):
            self.fail(f"sequential read of {h.key} ended at {pos}, before EOF")

    def op_mmap(self) -> None:
        """Slices of a mapping of the file. Never beside a fault proxy in this process (tests.helpers.mounted_via): a
        page fault holds the process's mmap lock until its READ is answered, and the proxy's threads, which answer
        the READ's GET, may need that lock (a probe of this kind hung at --read-timeout, then died of SIGBUS)."""
        h = self.pick()
        if h.direct or len(h.candidates) != 1 or self.may_be_gone(h):
            return self.op_pread()  # a page that fails to read is SIGBUS for the whole test process
        data = h.candidates[0].data
        if not data:
            return self.op_lseek()
        self.log.append(f"mmap fd {h.fd} {h.key}")
        m = mmap.mmap(h.fd, 0, prot=mmap.PROT_READ)
        try:
            advice = self.rng.choice([None, mmap.MADV_RANDOM, mmap.MADV_SEQUENTIAL, mmap.MADV_WILLNEED,
                                      mmap.MADV_DONTNEED])
            if advice is not None:
                m.madvise(advice)
            for _ in range(self.rng.randrange(1, 6)):
                a = self.offset(len(data))
                b = a + self.length()
                got = self.timed("mmap slice", m.__getitem__, slice(a, b))
                self.log.append(f"  slice [{a}:{b}] advice {advice}")
                self.narrow(h, "mmap slice", got, a, b - a)
        finally:
            m.close()

    def op_fadvise(self) -> None:
        h = self.pick()
        advice = self.rng.choice([os.POSIX_FADV_WILLNEED, os.POSIX_FADV_SEQUENTIAL, os.POSIX_FADV_RANDOM,
                                  os.POSIX_FADV_NORMAL, os.POSIX_FADV_DONTNEED])
        size = len(h.candidates[0].data)
        offset, length = self.rng.choice([(0, 0), (self.offset(size), self.length())])
        self.log.append(f"fadvise fd {h.fd} {h.key} {advice} at {offset} len {length}")
        self.timed("posix_fadvise", os.posix_fadvise, h.fd, offset, length, advice)

    def op_lseek(self) -> None:
        h = self.pick()
        size = len(h.candidates[0].data)
        offset = self.offset(size)
        for whence, name in ((os.SEEK_DATA, "SEEK_DATA"), (os.SEEK_HOLE, "SEEK_HOLE")):
            self.log.append(f"lseek fd {h.fd} {h.key} {offset} {name}")
            try:
                got: int | str = os.lseek(h.fd, offset, whence)
            except OSError as exc:
                got = errno.errorcode.get(exc.errno, str(exc.errno))
            # One hole, at the end: the data runs from 0 to the size (ENXIO at or past it).
            want = "ENXIO" if offset >= size else offset if whence == os.SEEK_DATA else size
            if len(h.candidates) == 1 and got != want:
                self.fail(f"lseek({offset}, {name}) of {h.key} (size {size}): {got!r}, expected {want!r}")

    def op_listdir(self) -> None:
        """`ls -l` of the files' directory: every name, each with the size of a version it may show."""
        t0 = time.monotonic()
        names = sorted(self.timed("listdir", os.listdir, self.root / "d"))
        sizes = {name: self.timed("stat", os.stat, self.root / "d" / name).st_size for name in names}
        t1 = time.monotonic()
        self.log.append("listdir + stat")
        want = sorted(key.removeprefix("d/") for key in self.history)
        if names != want:
            self.fail(f"listdir: {names}, expected {want}")
        for name, size in sizes.items():
            versions = self.openable(f"d/{name}", t0, t1)
            if size not in [len(v.data) for v in versions]:
                self.fail(f"stat of d/{name}: size {size}, versions {[len(v.data) for v in versions]}")

    def op_drop(self) -> None:
        if self.rng.random() < 0.3:
            # 1: the page cache; 2: dentries and inodes too (the daemon gets FORGETs of the files not open); 3: both.
            level = self.rng.choice([1, 2, 3])
            self.log.append(f"drop_caches {level}")
            drop_kernel_caches(level)
        elif self.handles:
            h = self.pick()
            self.log.append(f"fadvise DONTNEED fd {h.fd} {h.key} (whole file)")
            os.posix_fadvise(h.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def op_threads(self) -> None:
        """Several threads read one file at once: through one shared descriptor, or each through its own."""
        h = self.pick()
        shared = not h.direct and self.rng.random() < 0.5  # (unaligned reads of an O_DIRECT descriptor: EINVAL)
        nthreads = self.rng.randrange(2, 6)
        size = len(h.candidates[0].data)
        plans = [[(self.offset(size), self.length()) for _ in range(self.rng.randrange(3, 9))]
                 for _ in range(nthreads)]
        self.log.append(f"threads x{nthreads} on {h.key} ({'fd ' + str(h.fd) if shared else 'own fds'})")
        fds = [h.fd] * nthreads if shared else []
        if not shared:
            for _ in range(nthreads):
                t0 = time.monotonic()
                fd = os.open(self.root / h.key, os.O_RDONLY)
                fds.append(fd)
                self.handles.append(Handle(fd, h.key, False, self.openable(h.key, t0, time.monotonic())))
        handles = {hh.fd: hh for hh in self.handles}

        def run(fd: int, plan: list[tuple[int, int]]) -> list[tuple[int, int, bytes | OSError, float]]:
            out = []
            for offset, length in plan:
                start = time.monotonic()
                try:
                    got: bytes | OSError = os.pread(fd, length, offset)
                except OSError as exc:
                    got = exc
                out.append((offset, length, got, time.monotonic() - start))
            return out

        with ThreadPoolExecutor(nthreads) as pool:
            results = list(pool.map(run, fds, plans))
        for fd, result in zip(fds, results, strict=True):
            for offset, length, got, took in result:
                if took > self.thread_bound(length):
                    self.fail(f"a thread's pread of {h.key} at {offset} len {length} took {took:.1f}s")
                if isinstance(got, OSError):
                    self.errored(handles[fd], "threaded pread", got)
                else:
                    self.narrow(handles[fd], f"threaded pread at {offset} len {length}", got, offset, length)
        if not shared:
            for fd in fds:
                self.handles.remove(handles[fd])
                os.close(fd)

    def op_replace(self) -> None:
        key = self.rng.choice(sorted(self.history))
        old = self.current(key).data
        size = self.rng.choice([len(old), len(old), max(0, len(old) - self.rng.randrange(1, 3 * self.chunk)),
                                len(old) + self.rng.randrange(1, 3 * self.chunk), 0])
        self.replacements += 1
        data = random_bytes(size, 10_000 * self.seed + self.replacements)
        self.log.append(f"replace {key}: {len(old)} -> {size} bytes")
        version = Version(data, time.monotonic())
        put_objects(self.server, self.bucket, {key: data})
        self.history[key][-1].until = time.monotonic()
        self.history[key].append(version)

    def read_every_file(self) -> None:
        """Each file read whole by a new open, once what a TTL let the mount keep has expired: its current version."""
        if any(v.until is not None for versions in self.history.values() for v in versions):
            assert self.ttl is not None
            time.sleep(self.ttl + 1.0)
        for key in sorted(self.history):
            got, want = self.timed(f"read of {key}", (self.root / key).read_bytes), self.current(key).data
            if got != want:
                self.fail(f"{key} read whole: {len(got)} bytes, not its current version's {len(want)}")

    def op_failed(self, what: str, exc: OSError) -> None:
        """An operation raised `exc` where the test does not expect one: with a healthy origin, nothing fails."""
        self.fail(f"{what}: {exc!r}")

    def ops(self) -> list[tuple[Callable[[], None], int]]:
        """The operations and their weights."""
        return [(self.op_open, 8), (self.op_close, 5), (self.op_pread, 30), (self.op_sequential, 8),
                (self.op_mmap, 8), (self.op_fadvise, 5), (self.op_lseek, 4), (self.op_fstat, 3),
                (self.op_drop, 3), (self.op_threads, 4), (self.op_listdir, 2),
                (self.op_replace, 3 if self.replace else 0)]

    def run(self, steps: int) -> None:
        steps = STEPS or steps
        ops = self.ops()
        fns = [fn for fn, _ in ops]
        weights = [w for _, w in ops]
        ran: collections.Counter[str] = collections.Counter()
        try:
            for _ in range(steps):
                fn = self.rng.choices(fns, weights)[0]
                if not self.handles and fn.__name__ not in self.free_ops:
                    fn = self.op_open
                elif fn is self.op_close and len(self.handles) < 2:
                    continue
                elif fn is self.op_open and len(self.handles) >= 24:
                    fn = self.op_close
                ran[fn.__name__] += 1
                try:
                    fn()
                except OSError as exc:
                    self.op_failed(fn.__name__, exc)
        finally:
            for h in self.handles:
                os.close(h.fd)
            self.handles.clear()
        self.read_every_file()
        self.ran = ran
        self.check_coverage(ops)

    def check_coverage(self, ops: list[tuple[Callable[[], None], int]]) -> None:
        """Every operation ran (the choices follow from the seed alone while nothing fails)."""
        assert {fn.__name__ for fn, w in ops if w} <= set(self.ran), f"operations never chosen: {self.ran}"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    return awkward_files(tmp_path, seed=1)


def settled(mountpoint: Path) -> dict:
    """Once every descriptor is closed: no file open, no fetch in flight and no page-cache push counted against the
    limit of the files open (pagecache.py), and the chunk memory within its limit. The daemon's stats."""
    stats = wait_for("files open, fetches in flight or pushes counted after every descriptor closed",
                     lambda: mount_stats(mountpoint), lambda st: (st["open_files"], st["fetches_inflight"],
                                                                 st["pagecache_pushed_bytes"]) == (0, 0, 0),
                     timeout=15)
    assert stats["memory_used_bytes"] <= stats["memory_limit_bytes"], stats
    return stats


# name: (chunk size, options after BASE)
CONFIGS = {
    "defaults": (CHUNK, ()),
    "min-memory": (CHUNK, ("--memory-limit", "256K")),
    "no-streaming-boto3": (CHUNK, ("--no-model-streaming", "--get-client", "boto3")),
    # Chunks that are no multiple of a page: pushes and READs meet mid-page.
    "ttl-0-odd-chunks": (100_000, ("--metadata-ttl", "0")),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_reader_sequences_read_exact_bytes(moto_server: S3Server, mountpoint: Path,
                                                   files: dict[str, bytes], config: str) -> None:
    """With a healthy origin and nothing replaced, every read of every kind returns exactly the bytes uploaded, in
    time, and nothing fails; afterwards nothing is left open, in flight or counted."""
    seed = SHIFT + 1000 + list(CONFIGS).index(config)
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, files)
    chunk, args = CONFIGS[config]
    with mounted(moto_server, bucket, mountpoint, *BASE, "--chunk-size", str(chunk), *args):
        for run in range(RUNS):
            fuzz = Fuzzer(moto_server, bucket, mountpoint, files, seed + run, chunk=chunk)
            fuzz.run(300)
            assert fuzz.eio == 0
            print(f"seed {seed + run}: {dict(fuzz.ran)}; slowest {fuzz.slowest}")
        settled(mountpoint)


@pytest.mark.seaweedfs
def test_random_reader_sequences_read_exact_bytes_on_seaweedfs(seaweed_server: S3Server, mountpoint: Path,
                                                                files: dict[str, bytes]) -> None:
    """The same on SeaweedFS (whose ETags, ranges and listings are another server's), in 4 chunks of memory."""
    bucket = new_bucket(seaweed_server)
    put_objects(seaweed_server, bucket, files)
    with mounted(seaweed_server, bucket, mountpoint, *BASE, *SMALL_CHUNKS, "--memory-limit", "256K"):
        for run in range(RUNS):
            fuzz = Fuzzer(seaweed_server, bucket, mountpoint, files, SHIFT + 2000 + run)
            fuzz.run(200)
            assert fuzz.eio == 0
            print(f"seed {SHIFT + 2000 + run}: slowest {fuzz.slowest}")
        settled(mountpoint)


@pytest.mark.parametrize("chunk", [CHUNK, 100_000], ids=["64K-chunks", "odd-chunks"])
def test_random_reader_sequences_on_a_cache_dir_cold_then_warm(moto_server: S3Server, tmp_path: Path,
                                                               files: dict[str, bytes], chunk: int) -> None:
    """The same sequence twice, on two mounts of one --cache-dir: cold (filling it), then warm (reading from it), in 4
    to 8 chunks of memory. Chunks of 100,000 bytes are no multiple of the cache's O_DIRECT block."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, files)
    cache = tmp_path / "cache"
    args = (*BASE, "--chunk-size", str(chunk), "--cache-dir", str(cache), "--memory-limit", str(8 * chunk))
    for run in ("cold", "warm"):
        mountpoint = tmp_path / f"mnt-{run}"
        with mounted(moto_server, bucket, mountpoint, *args):
            for seed in range(SHIFT + 3000, SHIFT + 3000 + RUNS):
                fuzz = Fuzzer(moto_server, bucket, mountpoint, files, seed, chunk=chunk)
                fuzz.run(200)
                assert fuzz.eio == 0
                print(f"{run} seed {seed}: slowest {fuzz.slowest}")
            stats = settled(mountpoint)
        if run == "warm":
            assert stats["cache_chunk_hits"] > 0, stats


@pytest.mark.parametrize("memory", ["default-memory", "min-memory"])
def test_objects_replaced_between_steps_never_mix_versions(moto_server: S3Server, mountpoint: Path,
                                                           files: dict[str, bytes], memory: str) -> None:
    """Objects replaced (same size, another size, empty) between the steps: each handle reads one version or gets
    EIO; an open more than a TTL after a change reads the new version. In 4 chunks of memory, old handles find most
    of their chunks gone from memory, and their GETs refused (If-Match)."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, files)
    allowed = ("object changed", "fetching chunk", "read failed", "not found")
    args = ("--memory-limit", "256K") if memory == "min-memory" else ()
    seed = SHIFT + (4000 if memory == "default-memory" else 5000)
    with mounted(moto_server, bucket, mountpoint, *BASE, *SMALL_CHUNKS, "--metadata-ttl", "1", *args,
                 allowed=allowed):
        for run in range(RUNS):
            fuzz = Fuzzer(moto_server, bucket, mountpoint, files, seed + run, ttl=1.0, replace=True)
            fuzz.run(300)
            assert fuzz.replacements > 0
            print(f"seed {seed + run}: {fuzz.replacements} replacements, {fuzz.eio} EIO; slowest {fuzz.slowest}")
            files = {key: fuzz.current(key).data for key in files}  # the next run starts from what the bucket holds
        settled(mountpoint)
