"""CPU of a READ and of a model stream's chunk in the trio thread, measured in isolation (issue #13): no mount.

What a cold `cat` costs the trio thread, less the kernel: one process builds what a mount builds (a real
`Namespace`, `ChunkEngine`, `PageCachePusher`, `ModelStreamer` and `Operations`, with the mount's defaults) over an
in-memory store whose GETs hand their buffer back untouched (a safetensors header in the first bytes, so that the
stream parses one), and measures `time.thread_time` of the trio thread, medians of `--rounds` rounds, each on a
fresh set of them:

- `read`: READs of `--read-size` bytes in offset order through `Operations.read`: the handle, read-ahead, the
  pusher's reading marks, the engine's request/collect. Handed to the handler as pyfuse3 does: `--workers`
  long-lived tasks, each waiting a scheduler checkpoint (pyfuse3's wait for /dev/fuse to be readable) and then
  awaiting `operations.read` and taking the reply's buffer (`PyObject_GetBuffer`). Against the same loop with the
  FUSE floor's handler (`bench/fuse_floor.py`: a memoryview slice of a buffer and three counters) and with a handler
  that returns a view kept ready (the loop alone). The reply's copy into /dev/fuse is the kernel's and the same for
  all three: not in these figures. Three cases: `ops-bin`, a `model.bin` (no stream) whose chunks are all in memory;
  `ops-stream`, a `model.safetensors` likewise, its stream running beside the READs (which run ahead of it and take
  every chunk first, so it pushes none: it skips them, as it skipped 57-59 % of a cold `cat`'s chunks, RESULTS.md);
  `ops-cold`, the `model.bin` with nothing in memory, each chunk fetched by the READs (demand and read-ahead) as
  they come.
- `stream`: a `.safetensors` file opened and streamed to its end with no reader, `pyfuse3.notify_store` a no-op
  (the kernel's copy left out, its thread hand-off kept): the trio thread's CPU per chunk, against the same chunks
  fetched by a bare loop of `ChunkEngine.fetch` 32 ahead (what `bench/chunk_cpu.py` calls `engine`), and against
  the stream with pushes refused (`--pagecache-push-limit 0`'s path: fetch and skip).
- `--receive BYTES`: each GET reads `/dev/zero` into its buffer BYTES a system call, so the fetch threads give the
  GIL back and take it again as `recv_into` does; with `--cpu N` every thread shares one CPU, as the pinned bed's
  client side.

`--profile N` prints cProfile's top N functions (on the thread's CPU clock, so slower) of one more round of each.

    .venv/bin/python bench/read_cpu.py                 # both, 7 rounds of a 1 GiB file
    .venv/bin/python bench/read_cpu.py --only read --profile 25
    .venv/bin/python bench/read_cpu.py --receive 262144 --cpu 1
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import struct
import sys
import time
import types
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsmount.pagecache  # noqa: E402
from fsmount.config import DEFAULT_KERNEL_READAHEAD, DEFAULT_MAX_READAHEAD  # noqa: E402
from fsmount.data import ChunkEngine, ListingPage, ObjectMeta  # noqa: E402
from fsmount.data.engine import DEMAND  # noqa: E402
from fsmount.namespace import ROOT_INODE, Namespace  # noqa: E402
from fsmount.operations import Operations, Owner  # noqa: E402
from fsmount.pagecache import PageCachePusher  # noqa: E402
from fsmount.streaming import ModelStreamer  # noqa: E402

MiB = 1 << 20
ETAG = '"0123456789abcdef0123456789abcdef"'
CTX = types.SimpleNamespace(pid=os.getpid(), uid=0, gid=0, umask=0o022)


def safetensors_header(size: int) -> bytes:
    """The first bytes of a safetensors file of `size` bytes holding one tensor of u8 over all its data."""
    probe = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    length = (len(probe) + 7) // 8 * 8 + 8  # room for the data size's own digits shrinking
    data = size - 8 - length
    header = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).encode()
    return struct.pack("<Q", length) + header.ljust(length, b" ")


class _MemoryStore:
    """Two objects of `size` bytes, `model.bin` and `model.safetensors`; a GET hands its buffer back with only the
    header written (the bytes are not what is measured), so no copy runs in the fetch threads."""

    bucket = "bucket"

    def __init__(self, size: int, piece: int = 0):
        self.size = size
        self.header = safetensors_header(size)
        self.piece = piece  # > 0: a GET reads /dev/zero into its buffer this many bytes a call (see --receive)
        self._zero = os.open("/dev/zero", os.O_RDONLY) if piece else -1

    def _meta(self, key: str) -> ObjectMeta:
        return ObjectMeta(key, self.size, ETAG, 1_700_000_000_000_000_000)

    def check_bucket(self, prefix: str) -> None:
        return None

    def head(self, key: str) -> ObjectMeta | None:
        return self._meta(key) if key in ("model.bin", "model.safetensors") else None

    def list_pages(self, prefix: str) -> Iterator[ListingPage]:
        objects = [self._meta(k) for k in ("model.bin", "model.safetensors")] if prefix == "" else []
        yield ListingPage(objects, [], [], last=True)

    def has_children(self, prefix: str) -> bool:
        return False

    def get_range(self, key: str, etag: str, start: int, end: int, buffer: Any = None,
                  size: int | None = None) -> Any:
        if buffer is None:
            buffer = bytearray(end - start)
        if self.piece:
            # As a socket's recv_into loop: a system call a piece, the GIL released in each, the bytes written.
            view = memoryview(buffer)
            for at in range(0, end - start, self.piece):
                os.readv(self._zero, [view[at:at + self.piece]])
        if start < len(self.header):
            head = self.header[start:end]
            buffer[:len(head)] = head
        return buffer


class _Mount:
    """What `mount.Mount` builds around the FUSE session, with the same defaults (1 GiB file: 2 GiB of chunks)."""

    def __init__(self, size: int, chunk_size: int, push_limit: int, piece: int = 0):
        self.store = _MemoryStore(size, piece)
        memory = max(2 * size, 64 * chunk_size)
        kernel_window = min(DEFAULT_KERNEL_READAHEAD, memory // 8)
        self.engine = ChunkEngine(self.store, chunk_size=chunk_size, memory_limit=memory,  # type: ignore[arg-type]
                                  max_connections=16, read_timeout=60)

        async def call(fn: Callable[..., Any], *args: Any) -> Any:
            return fn(*args)

        self.ns = Namespace(self.store, call, prefix="", ttl=60)  # type: ignore[arg-type]
        self.pusher = PageCachePusher(push_limit, kernel_readahead=kernel_window)
        self.streamer = ModelStreamer(self.engine, self.pusher, max_connections=16,
                                      readers=lambda: self.ops.readers)
        self.ops = Operations(self.ns, self.engine, self.streamer, self.pusher, max_readahead=DEFAULT_MAX_READAHEAD,
                              owner=Owner(0, 0, 0o444, 0o555), kernel_window=kernel_window)

    async def run(self, body: Callable[[], Awaitable[float]]) -> float:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            await nursery.start(self.streamer.run)
            spent = await body()
            self.streamer.stop()
            nursery.cancel_scope.cancel()
        return spent

    async def open(self, name: str) -> tuple[int, int]:
        node = await self.ns.lookup(ROOT_INODE, name.encode())
        info = await self.ops.open(node.ino, os.O_RDONLY, CTX)  # type: ignore[arg-type]
        return node.ino, info.fh

    async def fill(self, name: str) -> None:
        """Every chunk of `name` fetched into memory, as if the origin had answered before the READs came."""
        obj = self.ns.node((await self.ns.lookup(ROOT_INODE, name.encode())).ino).version("")
        fetches = [self.engine.fetch(obj, i, self, DEMAND) for i in self.engine.chunk_range(obj, 0, obj.size)]
        for part in fetches:
            if hasattr(part, "wait"):
                await part.wait()


async def _serve(handler: Callable[[int, int, int], Awaitable[Any]], fh: int, size: int, read_size: int,
                 workers: int) -> None:
    """READs of [0, size) in offset order, `read_size` each, through `workers` tasks as pyfuse3's _session_loop."""
    offsets = iter(range(0, size, read_size))

    async def worker() -> None:
        for off in offsets:
            await trio.lowlevel.checkpoint()  # pyfuse3 waits for /dev/fuse to be readable
            buf = await handler(fh, off, read_size)
            memoryview(buf).release()  # PyObject_GetBuffer / PyBuffer_Release around fuse_reply_buf
    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)


def _read_round(args: argparse.Namespace, variant: str, profiler: cProfile.Profile | None = None) -> float:
    """Trio thread CPU per READ (us) of one variant: `ops-bin`, `ops-stream`, `ops-cold`, `floor`, `loop`."""
    gc.collect()  # the rounds before left cycles holding a GiB of buffers: not freed on this round's clock
    mount = _Mount(args.size, args.chunk_size, push_limit=args.size * 4, piece=args.receive)
    if variant in ("floor", "loop"):
        content = memoryview(bytearray(64 * MiB))
        ready = content[:args.read_size]
        counts = types.SimpleNamespace(reads=0, read_bytes=0, read_sizes={})

        async def floor(fh: int, off: int, size: int) -> memoryview:  # bench/fuse_floor.py's read
            counts.reads += 1
            counts.read_sizes[size] = counts.read_sizes.get(size, 0) + 1
            start = off % len(content)
            data = content[start:start + size]
            counts.read_bytes += len(data)
            return data

        async def loop(fh: int, off: int, size: int) -> memoryview:
            return ready
        handler: Callable[[int, int, int], Awaitable[Any]] = floor if variant == "floor" else loop
    else:
        handler = mount.ops.read
    name = "model.safetensors" if variant == "ops-stream" else "model.bin"

    async def body() -> float:
        if variant != "ops-cold":
            await mount.fill(name)
        _, fh = await mount.open(name)
        if profiler is not None:
            profiler.enable()
        started = time.thread_time()
        await _serve(handler, fh, args.size, args.read_size, args.workers)
        spent = time.thread_time() - started
        if profiler is not None:
            profiler.disable()
        await mount.ops.release(fh)
        return spent / (args.size // args.read_size) * 1e6
    return trio.run(mount.run, body)


def _stream_round(args: argparse.Namespace, variant: str, profiler: cProfile.Profile | None = None) -> float:
    """Trio thread CPU per chunk (us) of one variant: `stream` (pushes), `stream-nopush`, `engine` (bare fetches),
    `handoff` (one bare `trio.to_thread.run_sync` of a no-op per chunk, one at a time, as a push's)."""
    gc.collect()
    mount = _Mount(args.size, args.chunk_size, push_limit=0 if variant == "stream-nopush" else args.size * 4,
                   piece=args.receive)
    chunks = -(-args.size // args.chunk_size)

    async def body() -> float:
        if profiler is not None:
            profiler.enable()
        started = time.thread_time()
        if variant == "handoff":
            for _ in range(chunks):
                await trio.to_thread.run_sync(lambda: None)
        elif variant == "engine":
            obj = mount.ns.node((await mount.ns.lookup(ROOT_INODE, b"model.safetensors")).ino).version("")
            ahead: dict[int, Any] = {}
            for index in range(chunks):
                ahead[index] = mount.engine.fetch(obj, index, mount)
                if index >= 32:
                    part = ahead.pop(index - 32)
                    if hasattr(part, "wait"):
                        await part.wait()
            for part in ahead.values():
                if hasattr(part, "wait"):
                    await part.wait()
        else:
            ino, fh = await mount.open("model.safetensors")
            job = next(iter(mount.streamer._active.values()))
            await job.done.wait()
        spent = time.thread_time() - started
        if profiler is not None:
            profiler.disable()
        if variant not in ("engine", "handoff"):
            assert job.pushed == (0 if variant == "stream-nopush" else args.size), (job.pushed, variant)
            await mount.ops.release(fh)
        return spent / chunks * 1e6
    return trio.run(mount.run, body)


def _measure(args: argparse.Namespace, run: Callable[..., float], variants: list[str], unit: str) -> list[str]:
    got: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            got[variant].append(run(args, variant))
    lines = [f"{variant}: {statistics.median(v):.1f} us/{unit} (rounds {', '.join(f'{x:.1f}' for x in v)})"
             for variant, v in got.items()]
    if args.profile:
        for variant in variants:
            profiler = cProfile.Profile(time.thread_time)
            run(args, variant, profiler)
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
            lines.append(f"--- profile of {variant} (tottime, thread CPU) ---\n{out.getvalue()}")
    return lines


def measure_read(args: argparse.Namespace) -> list[str]:
    return _measure(args, _read_round, ["loop", "floor", "ops-bin", "ops-stream", "ops-cold"], "READ")


def measure_stream(args: argparse.Namespace) -> list[str]:
    return _measure(args, _stream_round, ["handoff", "engine", "stream-nopush", "stream"], "chunk")


MEASUREMENTS = {"read": measure_read, "stream": measure_stream}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help="comma-separated: read, stream")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=1 << 30, help="bytes of the file (default 1 GiB)")
    parser.add_argument("--chunk-size", type=int, default=8 * MiB)
    parser.add_argument("--read-size", type=int, default=MiB, help="bytes a READ asks (default 1 MiB)")
    parser.add_argument("--workers", type=int, default=16, help="request tasks, as pyfuse3's max_tasks")
    parser.add_argument("--receive", type=int, default=0, metavar="BYTES",
                        help="GETs read /dev/zero into their buffers BYTES a system call (the fetch threads then "
                             "take the GIL back after each, as recv_into does); default 0: buffers untouched")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process (every thread) to this one CPU")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N of each")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # before any thread starts: they all inherit it
    # The kernel's copy is left out of both measurements: a push's notify_store does nothing (its thread stays).
    fsmount.pagecache.pyfuse3.notify_store = lambda ino, offset, data: None
    for name in args.only.split(","):
        if name not in MEASUREMENTS:
            parser.error(f"unknown measurement {name!r}")
        for line in MEASUREMENTS[name](args):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
