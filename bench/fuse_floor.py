"""The FUSE floor: what a pyfuse3 + trio file system costs when it has every byte in memory already.

A minimal read-only file system (no modelfs code) with one file, `floor.bin`, of --size bytes of a
deterministic pattern, held as WINDOW_PERIODS periods of it (plus one push's length) in one anonymous mmap
(`Content`). READs are answered with memoryview slices of it (no copy of ours: pyfuse3 hands the buffer to
fuse_reply_buf). Mounted like modelfs (fsmount/mount.py):
pyfuse3.default_options + fsname/subtype/ro, FileInfo(keep_cache=True) (direct_io off), 60 s entry/attr
timeouts, st_blksize 1 MiB, and the mount's bdi read_ahead_kb raised to 16 MiB, so a `cat` gets READs
of the size modelfs gets (1 MiB: libfuse's max_pages of 256).

    .venv/bin/python bench/fuse_floor.py MOUNTPOINT --size 1.6G [--push-threads K] [--stats FILE] [--max-background N]
    .venv/bin/python bench/fuse_floor.py compare [--size 1G] [--rounds 3] [--pin] \\
        [--variants reads,push1,push2,push4,pread] [--max-background N] [--out FILE.json]
    .venv/bin/python bench/fuse_floor.py pread FILE [--block 1M]

Serving runs in the foreground until unmounted (fusermount3 -u) or SIGTERM/SIGINT, then exits 0; it
prints READY once the mount answers, and at exit the READ count, READ sizes and CPU (JSON, to stderr and
--stats). With --push-threads K (K >= 1) the first open() starts K plain threads that push the file into
the kernel page cache with pyfuse3.notify_store, consecutive 8 MiB chunks, thread i taking chunks i,
i+K, ...; READs are still answered for whatever was not pushed yet; a PUSH_DONE line (JSON: wall seconds,
CPU per thread) follows the last push. (A mountpoint literally named `compare` or `pread`: write ./compare.)

`compare` mounts each variant in a fresh process on a temp mountpoint, drops the page cache, runs the
reader and reads the server's user+sys CPU from /proc/PID/stat before and after:
  reads        `cat MP/floor.bin > /dev/null`, the whole command timed; every byte through READs
  pushK        the same with --push-threads K (K = 1, 2, 4, ...)
  pread        a Python reader's 1 MiB os.preadv calls into one buffer (read loop timed); READs only
  pushK-only   no reader: open the file, wait for PUSH_DONE (seconds = the push's wall time)
It prints medians per variant: seconds, server CPU-s per GB, reader CPU-s per GB, READs and server CPU per
READ. With --pin everything (this process, the server, the reader) runs on CPU 1.

--max-background N sets the FUSE connection's max_background (kernel default 12) and congestion_threshold
(default 9; set to 3N/4) through /sys/fs/fuse/connections, with modelfs's own function (default: modelfs's
--fuse-max-background; pyfuse3 cannot set them at init). With the kernel's defaults and a 16 MiB
read_ahead_kb, FUSE declines readahead it is congested for and the kernel frees the folios it had just
allocated (read_pages -> filemap_remove_folio), which costs
the reader CPU and time; cat's FADV_SEQUENTIAL (a 32 MiB window) makes it worse.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import mmap
import os
import random
import resource
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(REPO_ROOT))

from fsmount.config import DEFAULT_FUSE_MAX_BACKGROUND, DEFAULT_KERNEL_READAHEAD, parse_size  # noqa: E402

FILE_NAME = b"floor.bin"
FILE_INODE = 2  # pyfuse3.ROOT_INODE is 1
#: The pattern repeats with a period that is no power of two, so bytes put at a wrong offset show.
PATTERN_SEED = 20240601
PATTERN_BYTES = (1 << 20) + 4093
PUSH_CHUNK = 8 << 20
# The file is served from this many periods of the pattern (~64 MiB: more than a CPU cache holds, so READ
# replies copy from memory as modelfs's do), not from a buffer of the whole file. A floor that held a 1 GiB
# file allocated it just before each measurement, took the memory freed last (still the guest's) and left
# its READ replies' page-cache pages to come from memory the VM had handed back to its host (see
# bench/README.md, the host's state): in one run it cost 0.34, then 1.91 and 1.51 CPU-s per 1.07 GB read,
# while modelfs's daemon, between those rounds, cost 0.79-0.90.
WINDOW_PERIODS = 64
TTL_S = 60.0  # modelfs's default --metadata-ttl
BLKSIZE = 1 << 20  # st_blksize as modelfs reports it: cat reads 1 MiB at a time
READ_AHEAD_KB = DEFAULT_KERNEL_READAHEAD >> 10  # modelfs's default --kernel-readahead
GB = 1e9
READY = "READY"
PUSH_DONE = "PUSH_DONE"
READY_TIMEOUT_S = 60.0
PUSH_TIMEOUT_S = 120.0
READER_TIMEOUT_S = 300.0
SAMPLES = 64
DEFAULT_VARIANTS = "reads,push1,push2,push4,pread"


def pattern_block() -> bytes:
    return random.Random(PATTERN_SEED).randbytes(PATTERN_BYTES)


def expected(block: bytes, offset: int, length: int) -> bytes:
    """The file's bytes [offset, offset + length)."""
    out = bytearray()
    while len(out) < length:
        start = (offset + len(out)) % len(block)
        out += block[start:start + length - len(out)]
    return bytes(out)


class Content:
    """The file's bytes [offset, offset + length) as a slice of one buffer that repeats the pattern: the
    whole file if it is no bigger than the window, else the window's bytes at the same offset modulo its
    whole periods (the file's byte at `offset` is the pattern's at `offset % PATTERN_BYTES`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.span = WINDOW_PERIODS * PATTERN_BYTES
        self.buffer = make_content(min(size, self.span + PUSH_CHUNK))
        self.view = memoryview(self.buffer)

    def slice(self, offset: int, length: int) -> memoryview:
        length = max(0, min(length, self.size - offset))
        if self.size <= len(self.view):
            return self.view[offset:offset + length]
        assert length <= PUSH_CHUNK, length
        start = offset % self.span
        return self.view[start:start + length]


def make_content(size: int) -> mmap.mmap:
    """An anonymous mapping of `size` bytes filled with the pattern (generated once, touched once)."""
    block = pattern_block()
    buffer = mmap.mmap(-1, max(size, 1))
    for offset in range(0, size, len(block)):
        n = min(len(block), size - offset)
        buffer[offset:offset + n] = block[:n]
    return buffer


# ---- the file system ------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Pusher:
    """K plain threads storing the file into the page cache with notify_store, chunk i on thread i % K."""

    def __init__(self, content: Content, size: int, threads: int) -> None:
        self.content = content
        self.size = size
        self.threads = threads
        self.stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._running = 0
        self.started_at: float | None = None
        self.per_thread: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None

    def start(self) -> None:
        if self._workers or self.threads < 1:
            return
        import pyfuse3

        self.started_at = time.perf_counter()
        self._process_cpu_at_start = _process_cpu()
        self._running = self.threads
        for index in range(self.threads):
            worker = threading.Thread(target=self._push, args=(pyfuse3, index), name=f"push-{index}", daemon=True)
            self._workers.append(worker)
            worker.start()

    def _push(self, pyfuse3: Any, index: int) -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        calls = stored = errors = 0
        in_call = 0.0
        last_error = ""
        for chunk in range(index, (self.size + PUSH_CHUNK - 1) // PUSH_CHUNK, self.threads):
            if self.stop.is_set():
                break
            offset = chunk * PUSH_CHUNK
            data = self.content.slice(offset, PUSH_CHUNK)
            t0 = time.perf_counter()
            try:
                pyfuse3.notify_store(FILE_INODE, offset, data)
                stored += len(data)
            except OSError as exc:
                errors += 1
                last_error = str(exc)
                if exc.errno in (errno.ENOSYS, errno.ENODEV, errno.EBADF, errno.ENOTCONN):
                    break
            finally:
                in_call += time.perf_counter() - t0
                calls += 1
        mine = {"thread": index, "calls": calls, "bytes": stored, "errors": errors, "last_error": last_error,
                "cpu_s": time.thread_time() - cpu0, "wall_s": time.perf_counter() - wall0, "in_call_s": in_call}
        with self._lock:
            self.per_thread.append(mine)
            self._running -= 1
            last = self._running == 0
        if last:
            assert self.started_at is not None
            wall = time.perf_counter() - self.started_at
            cpu = sum(_process_cpu()) - sum(self._process_cpu_at_start)
            pushed = sum(t["bytes"] for t in self.per_thread)
            self.summary = {
                "threads": self.threads, "wall_s": wall, "bytes": pushed,
                "gb_per_s": pushed / GB / wall if wall else None,
                "thread_cpu_s": sum(t["cpu_s"] for t in self.per_thread),
                "process_cpu_s": cpu, "errors": sum(t["errors"] for t in self.per_thread),
                "per_thread": sorted(self.per_thread, key=lambda t: t["thread"]),
            }
            log(f"{PUSH_DONE} {json.dumps(self.summary)}")

    def join(self, timeout: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))


def _process_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def make_operations(content: Content, size: int, pusher: Pusher) -> Any:
    import pyfuse3

    uid, gid = os.getuid(), os.getgid()
    mount_ns = time.time_ns()

    class FloorFS(pyfuse3.Operations):
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0
            self.read_bytes = 0
            self.read_sizes: dict[int, int] = {}

        def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
            attr = pyfuse3.EntryAttributes()
            attr.st_ino = inode
            attr.generation = 0
            attr.entry_timeout = TTL_S
            attr.attr_timeout = TTL_S
            if inode == pyfuse3.ROOT_INODE:
                attr.st_mode = stat.S_IFDIR | 0o555
                attr.st_nlink = 2
                attr.st_size = 0
            else:
                attr.st_mode = stat.S_IFREG | 0o444
                attr.st_nlink = 1
                attr.st_size = size
            attr.st_uid, attr.st_gid = uid, gid
            attr.st_blksize = BLKSIZE
            attr.st_blocks = (attr.st_size + 511) // 512
            attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = mount_ns
            return attr

        async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
            if inode not in (pyfuse3.ROOT_INODE, FILE_INODE):
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attributes(inode)

        async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
            if parent_inode != pyfuse3.ROOT_INODE or name != FILE_NAME:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attributes(FILE_INODE)

        async def opendir(self, inode: int, ctx: Any) -> int:
            if inode != pyfuse3.ROOT_INODE:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            return inode

        async def readdir(self, fh: int, start_id: int, token: Any) -> None:
            if start_id == 0:
                pyfuse3.readdir_reply(token, FILE_NAME, self._attributes(FILE_INODE), 1)

        async def releasedir(self, fh: int) -> None:
            return None

        async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
            if inode != FILE_INODE:
                raise pyfuse3.FUSEError(errno.EISDIR if inode == pyfuse3.ROOT_INODE else errno.ENOENT)
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise pyfuse3.FUSEError(errno.EROFS)
            pusher.start()
            return pyfuse3.FileInfo(fh=inode, keep_cache=True)

        async def read(self, fh: int, off: int, size_: int) -> memoryview:
            self.reads += 1
            self.read_sizes[size_] = self.read_sizes.get(size_, 0) + 1
            data = content.slice(off, size_)
            self.read_bytes += len(data)
            return data

        async def release(self, fh: int) -> None:
            return None

        async def flush(self, fh: int) -> None:
            return None

    return FloorFS()


def tune_like_modelfs(mountpoint: str, max_background: int) -> str:
    """The kernel settings modelfs applies to its mount, by modelfs's own functions: bdi read_ahead_kb,
    and fusectl's max_background / congestion_threshold (pyfuse3 cannot set those at init). A note of what
    was set: the same lines modelfs logs."""
    import logging

    from fsmount.mount import raise_fuse_background, raise_kernel_readahead

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("fsmount.mount")
    logger.setLevel(logging.INFO)
    logger.addHandler(keep := Keep())
    try:
        dev = os.stat(mountpoint).st_dev  # the mount answers (announce_ready's probe): its own device
        raise_kernel_readahead(mountpoint, dev, READ_AHEAD_KB)
        raise_fuse_background(mountpoint, dev, max_background)
    finally:
        logger.removeHandler(keep)
    return "; ".join(lines)


def serve(args: argparse.Namespace) -> int:
    import pyfuse3
    import trio

    mountpoint = str(Path(args.mountpoint).absolute())
    content = Content(args.size)
    pusher = Pusher(content, args.size, args.push_threads)
    ops = make_operations(content, args.size, pusher)
    options = set(pyfuse3.default_options) | {"fsname=floor", "subtype=fusefloor", "ro"}
    marks: dict[str, Any] = {}

    async def announce_ready() -> None:
        def probe() -> str:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                try:
                    os.stat(mountpoint)
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOTCONN or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            return tune_like_modelfs(mountpoint, args.max_background)

        # Never stat the mountpoint from the trio thread: its answer comes from this very loop.
        note = await trio.to_thread.run_sync(probe)
        marks["trio_cpu_at_ready"] = time.thread_time()  # this is the trio thread
        marks["cpu_at_ready"] = _process_cpu()
        log(f"{READY} {mountpoint} ({note})")

    async def watch_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for _ in signals:
                pyfuse3.terminate()
                return

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals)
            nursery.start_soon(announce_ready)
            await pyfuse3.main()
            marks["trio_cpu_at_exit"] = time.thread_time()
            nursery.cancel_scope.cancel()

    pyfuse3.init(ops, mountpoint, options)
    try:
        trio.run(main)
    finally:
        pusher.join(timeout=30.0)  # no notify_store may run once the session is gone
        pyfuse3.close(unmount=True)
    cpu = _process_cpu()
    ready_cpu = marks.get("cpu_at_ready", (0.0, 0.0))
    trio_cpu = marks.get("trio_cpu_at_exit", 0.0) - marks.get("trio_cpu_at_ready", 0.0)
    stats = {
        "size": args.size, "push_threads": args.push_threads, "reads": ops.reads, "read_bytes": ops.read_bytes,
        "read_sizes": {str(k): v for k, v in sorted(ops.read_sizes.items())},
        "server_cpu_user_s": cpu[0] - ready_cpu[0], "server_cpu_sys_s": cpu[1] - ready_cpu[1],
        "trio_thread_cpu_s": trio_cpu,
        "trio_thread_cpu_us_per_read": trio_cpu / ops.reads * 1e6 if ops.reads else None,
        "push": pusher.summary,
    }
    log(f"STATS {json.dumps(stats)}")
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n")
    return 0


# ---- readers ----------------------------------------------------------------------------------------------


def pread_reader(args: argparse.Namespace) -> int:
    """Read FILE with --block-byte os.preadv calls into one reused buffer; print one JSON line."""
    buffer = bytearray(args.block)
    fd = os.open(args.file, os.O_RDONLY)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        offset = calls = 0
        while True:
            n = os.preadv(fd, [buffer], offset)
            calls += 1
            if n == 0:
                break
            offset += n
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        os.close(fd)
    print(json.dumps({"seconds": seconds, "bytes": offset, "calls": calls,
                      "cpu_user_s": after.ru_utime - before.ru_utime,
                      "cpu_sys_s": after.ru_stime - before.ru_stime}), flush=True)
    return 0


def run_measured(argv: list[str], capture: bool) -> tuple[float, float, str]:
    """(wall seconds, user+sys CPU seconds, stdout) of one command, its own rusage from wait4; without
    `capture` its stdout goes to /dev/null (`cat FILE > /dev/null`)."""
    out = tempfile.TemporaryFile()
    with out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out if capture else subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        killer = threading.Timer(READER_TIMEOUT_S, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # blocking: no polling beside the measured reader
        finally:
            killer.cancel()
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}")
    return seconds, usage.ru_utime + usage.ru_stime, text


# ---- compare ----------------------------------------------------------------------------------------------


def parse_variant(name: str) -> tuple[str, int]:
    """(reader, push threads): reader is cat, pread or none."""
    if name == "reads":
        return "cat", 0
    if name == "pread":
        return "pread", 0
    if name.startswith("push"):
        rest = name.removeprefix("push")
        only = rest.endswith("-only")
        threads = int(rest.removesuffix("-only"))
        if threads >= 1:
            return ("none" if only else "cat"), threads
    raise ValueError(f"unknown variant {name!r}: reads, pread, pushK or pushK-only")


def wait_for_line(path: Path, marker: str, timeout: float, proc_alive: Any) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith(marker):
                    return line
        if not proc_alive():
            return None
        time.sleep(0.01)
    return None


def check_samples(path: Path, size: int, block: bytes) -> str | None:
    """Compare SAMPLES 4 KiB pieces of the file at odd offsets with the pattern; None if all match."""
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            offset = min(max(0, size - 4096), i * (size // SAMPLES) + 4093 * i)
            f.seek(offset)
            got = f.read(4096)
            if got != expected(block, offset, len(got)):
                return f"wrong bytes at offset {offset}"
    return None


def measure(args: argparse.Namespace, work: Path, variant: str, round_index: int, block: bytes) -> dict[str, Any]:
    sys.path[:0] = [str(BENCH_DIR)]
    import mounts
    from run import drop_caches

    reader, threads = parse_variant(variant)
    mountpoint = work / "mnt"
    stats_path = work / f"stats-{variant}-{round_index}.json"
    log_path = work / f"server-{variant}-{round_index}.log"
    pin = ["taskset", "-c", "1"] if args.pin else []
    argv = [*pin, sys.executable, str(Path(__file__).resolve()), str(mountpoint), "--size", str(args.size),
            "--push-threads", str(threads), "--stats", str(stats_path), "--max-background", str(args.max_background)]
    record: dict[str, Any] = {"variant": variant, "round": round_index, "error": None}
    daemon = mounts.MountedDaemon(mounts.DaemonCommand(argv, mounts.base_env()), mountpoint, log_path)
    try:
        daemon.start()
        alive = lambda: daemon.proc is not None and daemon.proc.poll() is None  # noqa: E731
        ready = wait_for_line(log_path, READY, READY_TIMEOUT_S, alive)
        if ready is None:
            raise RuntimeError(f"no {READY} line:\n{daemon.log_tail()}")
        record["server_note"] = ready
        if "could not" in ready:
            raise RuntimeError(ready)
        record["cache_dropped"] = drop_caches()
        pid = daemon.pid
        assert pid is not None
        before = mounts.cpu_seconds(pid) or (0.0, 0.0)
        target = mountpoint / FILE_NAME.decode()
        if reader == "cat":
            seconds, reader_cpu, _ = run_measured([*pin, "cat", str(target)], capture=False)
        elif reader == "pread":
            _, _, text = run_measured([*pin, sys.executable, str(Path(__file__).resolve()), "pread", str(target),
                                       "--block", str(args.block)], capture=True)
            result = json.loads(text.strip().splitlines()[-1])
            if result["bytes"] != args.size:
                raise RuntimeError(f"pread read {result['bytes']} of {args.size} bytes")
            seconds, reader_cpu = result["seconds"], result["cpu_user_s"] + result["cpu_sys_s"]
        else:
            fd = os.open(target, os.O_RDONLY)
            try:
                if wait_for_line(log_path, PUSH_DONE, PUSH_TIMEOUT_S, alive) is None:
                    raise RuntimeError(f"no {PUSH_DONE} line:\n{daemon.log_tail()}")
            finally:
                os.close(fd)
            seconds, reader_cpu = None, 0.0
        after = mounts.cpu_seconds(pid) or (0.0, 0.0)
        record.update(seconds=seconds, reader_cpu_s=reader_cpu, server_cpu_s=sum(after) - sum(before),
                      server_cpu_user_s=after[0] - before[0], server_cpu_sys_s=after[1] - before[1])
        if threads:
            if wait_for_line(log_path, PUSH_DONE, PUSH_TIMEOUT_S, alive) is None:
                raise RuntimeError(f"no {PUSH_DONE} line:\n{daemon.log_tail()}")
            final = mounts.cpu_seconds(pid) or after
            record["server_cpu_with_push_s"] = sum(final) - sum(before)
        record["check"] = check_samples(target, args.size, block)
        if record["check"]:
            record["error"] = record["check"]
    except (RuntimeError, OSError, mounts.MountError, json.JSONDecodeError, ValueError) as exc:
        record["error"] = str(exc)[-1500:]
    finally:
        daemon.stop()  # fusermount3 -u, then SIGTERM/SIGKILL by pid, then abort the connection
        if daemon.notes:
            record["stop_notes"] = daemon.notes
    with contextlib.suppress(OSError, json.JSONDecodeError):
        stats = json.loads(stats_path.read_text())
        record["reads"] = stats["reads"]
        record["read_bytes"] = stats["read_bytes"]
        record["read_sizes"] = stats["read_sizes"]
        record["trio_thread_cpu_s"] = stats["trio_thread_cpu_s"]
        record["push"] = stats["push"]
        if record.get("seconds") is None and stats["push"]:
            record["seconds"] = stats["push"]["wall_s"]
        # More READ bytes than the file has: pages were evicted mid-run and read again. On a shared machine
        # that is someone else's drop_caches; the run is kept but marked.
        record["reread_bytes"] = max(0, stats["read_bytes"] - args.size)
    return record


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(records: list[dict[str, Any]], variants: list[str], size: int) -> list[dict[str, Any]]:
    rows = []
    gb = size / GB
    for variant in variants:
        ok = [r for r in records if r["variant"] == variant and not r.get("error")]
        errors = [r["error"] for r in records if r["variant"] == variant and r.get("error")]
        reads = [r["reads"] for r in ok if r.get("reads") is not None]
        per_read = [r["server_cpu_s"] / r["reads"] * 1e6 for r in ok if r.get("reads")]
        trio_per_read = [r["trio_thread_cpu_s"] / r["reads"] * 1e6 for r in ok if r.get("reads")]
        pushes = [r["push"] for r in ok if r.get("push")]
        sizes: dict[str, int] = {}
        for r in ok:
            for k, v in (r.get("read_sizes") or {}).items():
                sizes[k] = sizes.get(k, 0) + v
        rows.append({
            "variant": variant, "runs": len(ok),
            "seconds": median([r["seconds"] for r in ok if r.get("seconds") is not None]),
            "server_cpu_s_per_gb": median([r["server_cpu_s"] / gb for r in ok]),
            "server_cpu_with_push_s_per_gb": median([r["server_cpu_with_push_s"] / gb for r in ok
                                                     if r.get("server_cpu_with_push_s") is not None]),
            "reader_cpu_s_per_gb": median([r["reader_cpu_s"] / gb for r in ok]),
            "reads": median(reads),
            "server_cpu_us_per_read": median(per_read),
            "trio_cpu_us_per_read": median(trio_per_read),
            "push_wall_s": median([p["wall_s"] for p in pushes]),
            "push_thread_cpu_s": median([p["thread_cpu_s"] for p in pushes]),
            "read_size_top": max(sizes, key=sizes.__getitem__) if sizes else None,
            "note": (errors[0][:200] if errors else "") + (
                f"{disturbed} run(s) re-read evicted pages" if (disturbed := sum(
                    1 for r in ok if r.get("reread_bytes"))) else ""),
        })
    return rows


def markdown(rows: list[dict[str, Any]], size: int) -> str:
    def f(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    lines = [
        "| variant | runs | seconds | GB/s | server CPU-s/GB | incl. push tail | reader CPU-s/GB | READs | "
        "most common READ | server CPU µs/READ | trio thread µs/READ | push wall s | push threads CPU-s | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rate = size / GB / r["seconds"] if r["seconds"] else None
        top = f"{int(r['read_size_top']) >> 10} KiB" if r["read_size_top"] else ""
        lines.append(
            f"| {r['variant']} | {r['runs']} | {f(r['seconds'], '.3f')} | {f(rate, '.2f')} | "
            f"{f(r['server_cpu_s_per_gb'], '.3f')} | {f(r['server_cpu_with_push_s_per_gb'], '.3f')} | "
            f"{f(r['reader_cpu_s_per_gb'], '.3f')} | {f(r['reads'], '.0f')} | {top} | "
            f"{f(r['server_cpu_us_per_read'], '.0f')} | {f(r['trio_cpu_us_per_read'], '.0f')} | "
            f"{f(r['push_wall_s'], '.3f')} | {f(r['push_thread_cpu_s'], '.3f')} | {r['note']} |")
    return "\n".join(lines)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def compare(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so `finally` unmounts
    for tool in ("fusermount3", *(("taskset",) if args.pin else ())):
        if shutil.which(tool) is None:
            log(f"{tool} not found")
            return 2
    if args.pin:
        os.sched_setaffinity(0, {1})
    started = time.time()
    block = pattern_block()
    work = Path(tempfile.mkdtemp(prefix="fuse-floor-", dir="/var/tmp"))
    records: list[dict[str, Any]] = []
    try:
        for round_index in range(args.rounds):
            for variant in args.variants:
                record = measure(args, work, variant, round_index, block)
                records.append(record)
                shown = record.get("error") or (
                    f"{record['seconds']:.3f} s, server {record['server_cpu_s']:.3f} CPU-s, "
                    f"reader {record['reader_cpu_s']:.3f} CPU-s, {record.get('reads')} READs")
                log(f"[{time.time() - started:6.1f}s] round {round_index + 1}: {variant}: {shown}")
    finally:
        sys.path[:0] = [str(BENCH_DIR)]
        import mounts

        mounts.remove_tree(work)  # leaves it (and says so) if a mount is somehow still inside
    rows = summarize(records, args.variants, args.size)
    print(markdown(rows, args.size))
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "size": args.size, "pin": args.pin,
                                              "records": records, "summary": rows}, indent=2) + "\n")
    return 0 if all(not r.get("error") for r in records) else 1


# ---- command line -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        p = argparse.ArgumentParser(prog="fuse_floor.py compare", description="READs vs notify_store pushes")
        p.add_argument("--size", type=parse_size, default=parse_size("1G"))
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--pin", action="store_true", help="everything on CPU 1 (taskset -c 1)")
        p.add_argument("--variants", default=DEFAULT_VARIANTS,
                       help=f"comma-separated: reads, pread, pushK, pushK-only (default {DEFAULT_VARIANTS})")
        p.add_argument("--block", type=parse_size, default=parse_size("1M"), help="pread size of the pread variant")
        p.add_argument("--max-background", type=int, default=DEFAULT_FUSE_MAX_BACKGROUND, metavar="N",
                       help="passed to every server (default modelfs's, %(default)s; 0: the kernel's 12)")
        p.add_argument("--out", help="write every run and the summary as JSON here")
        args = p.parse_args(argv[1:])
        args.variants = [v for v in (s.strip() for s in args.variants.split(",")) if v]
        for variant in args.variants:
            try:
                parse_variant(variant)
            except ValueError as exc:
                p.error(str(exc))
        return compare(args)
    if argv[:1] == ["pread"]:
        p = argparse.ArgumentParser(prog="fuse_floor.py pread", description="read a file with pread calls")
        p.add_argument("file")
        p.add_argument("--block", type=parse_size, default=parse_size("1M"))
        return pread_reader(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="fuse_floor.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("mountpoint")
    p.add_argument("--size", type=parse_size, default=parse_size("1.6G"))
    p.add_argument("--push-threads", type=int, default=0, metavar="K",
                   help="push the file with notify_store from K threads on the first open (0: READs only)")
    p.add_argument("--stats", help="write the READ count, READ sizes, CPU and push results here (JSON) at exit")
    p.add_argument("--max-background", type=int, default=DEFAULT_FUSE_MAX_BACKGROUND, metavar="N",
                   help="the connection's max_background (congestion_threshold 3N/4), set through fusectl as "
                        "modelfs sets it (default modelfs's, %(default)s; 0: the kernel's 12 / 9)")
    args = p.parse_args(argv)
    if args.push_threads < 0 or args.size < 0:
        p.error("--push-threads and --size must be >= 0")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
