"""CPU per chunk, measured in isolation (issue #13): one thread's own CPU clock, no mount.

Three measurements, each in this one process, medians of `--rounds` rounds:

- `get`: ranged GETs over a real socket from a private SeaweedFS on loopback, one thread, sequential, into one
  reused buffer: through the project's client (`Boto3Store.get_range`: retries loop, `RangeGetter`, its checks and
  `SO_RCVLOWAT`) and through the floor (one `http.client` connection, a URL signed once, the same headers, a bare
  `readinto` loop). Thread CPU per GET, user and system (`RUSAGE_THREAD`; the kernel samples that split, so
  compare totals), for `--chunk-size` GETs and for 4 KiB ones (the per-request part alone).
- `python`: the same two paths against a fake socket that answers every request from memory (a 206 header and a
  4 KiB body): the Python of one GET with no system call.
- `engine`: the trio thread's CPU per chunk a `ChunkEngine` fetches and completes (16 workers; a store that
  hands the buffer back untouched), against bare `trio.to_thread.run_sync` hand-offs.

    .venv/bin/python bench/chunk_cpu.py                 # all three
    .venv/bin/python bench/chunk_cpu.py --only engine,python --rounds 9
"""

from __future__ import annotations

import argparse
import http.client
import io
import os
import resource
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsmount.config import StoreConfig  # noqa: E402
from fsmount.data.boto3_store import Boto3Store  # noqa: E402
from fsmount.data.engine import ChunkEngine  # noqa: E402
from fsmount.data.identity import ObjectVersion  # noqa: E402
from fsmount.data.presigned import RangeGetter  # noqa: E402
from fsmount.testing.seaweed import SeaweedServer  # noqa: E402

OBJECT_SIZE = 256 << 20
SMALL = 4096
ETAG = '"0123456789abcdef0123456789abcdef"'

Get = Callable[[int, bytearray], None]


def _thread_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


def _bare_get(conn: http.client.HTTPConnection, target: str, etag: str, length: int) -> Get:
    def get(start: int, buffer: bytearray) -> None:
        conn.putrequest("GET", target, skip_accept_encoding=True)
        conn.putheader("Range", f"bytes={start}-{start + length - 1}")
        conn.putheader("Accept-Encoding", "identity")
        conn.putheader("If-Match", etag)
        conn.endheaders()
        resp = conn.getresponse()
        view, got = memoryview(buffer), 0
        while got < length:
            n = resp.readinto(view[got:])
            if not n:
                raise RuntimeError("short body")
            got += n
        if resp.read(1):
            raise RuntimeError("long body")
    return get


def _per_get(get: Get, length: int, count: int) -> tuple[float, float]:
    """User and system CPU ms of this thread per GET of `length` bytes, over `count` GETs."""
    buffer = bytearray(length)
    get(0, buffer)
    spots = OBJECT_SIZE // length
    user, system = _thread_cpu()
    for i in range(count):
        get((i % spots) * length, buffer)
    user2, system2 = _thread_cpu()
    return (user2 - user) / count * 1e3, (system2 - system) / count * 1e3


def measure_gets(args: argparse.Namespace) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory(prefix="chunk-cpu-") as tmp, SeaweedServer(tmp, buckets=["models"]) as s3:
        os.environ.update(s3.env())
        client = s3.client()
        client.put_object(Bucket="models", Key="blob", Body=os.urandom(OBJECT_SIZE))
        etag = client.head_object(Bucket="models", Key="blob")["ETag"]
        store = Boto3Store(StoreConfig("models", endpoint_url=s3.endpoint_url, addressing_style="path"))
        url = urllib.parse.urlsplit(store._presign("blob"))
        conn = http.client.HTTPConnection(url.hostname or "", url.port)
        target = f"{url.path}?{url.query}"
        for length, count in ((args.chunk_size, args.gets), (SMALL, 3 * args.gets)):
            paths: dict[str, Get] = {
                "project": lambda start, buffer, n=length: store.get_range("blob", etag, start, start + n, buffer),
                "bare": _bare_get(conn, target, etag, length)}
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, get in paths.items():
                    got[name].append(_per_get(get, length, count))
            for name, rounds in got.items():
                totals = [u + s for u, s in rounds]
                lines.append(f"get {length} B {name}: {statistics.median(totals):.3f} ms/GET (user "
                             f"{statistics.median(u for u, _ in rounds):.3f}, sys "
                             f"{statistics.median(s for _, s in rounds):.3f}; rounds "
                             f"{', '.join(f'{t:.3f}' for t in totals)})")
        conn.close()
    return lines


class _CannedSocket:
    """Answers every request with a 206 of SMALL bytes from memory: no system call."""

    start = 0

    def sendall(self, data: bytes) -> None:
        pass

    def makefile(self, mode: str) -> io.BytesIO:
        end = self.start + SMALL - 1
        head = (f"HTTP/1.1 206 Partial Content\r\nAccept-Ranges: bytes\r\nContent-Length: {SMALL}\r\n"
                f"Content-Range: bytes {self.start}-{end}/{OBJECT_SIZE}\r\nContent-Type: application/octet-stream\r\n"
                f"Date: Mon, 07 Dec 2026 01:40:00 GMT\r\nEtag: {ETAG}\r\nLast-Modified: Mon, 07 Dec 2026 01:30:00 GMT"
                "\r\nServer: SeaweedFS\r\nX-Amz-Request-Id: 1\r\n\r\n")
        return io.BytesIO(head.encode() + bytes(SMALL))

    def settimeout(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass


def measure_python(args: argparse.Namespace) -> list[str]:
    url = ("http://127.0.0.1:8333/models/blob?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=key%2F20261207%2F"
           "us-east-1%2Fs3%2Faws4_request&X-Amz-Date=20261207T013000Z&X-Amz-Expires=1200&X-Amz-SignedHeaders=host"
           "&X-Amz-Signature=" + "0" * 64)
    sock = _CannedSocket()
    conn = http.client.HTTPConnection("127.0.0.1", 8333)
    conn.sock = sock  # type: ignore[assignment]
    getter = RangeGetter(lambda key: url, bucket="models", pool_size=4, connect_timeout=5, read_timeout=60)
    getter._idle.append((("http", "127.0.0.1", 8333), conn))
    paths: dict[str, Get] = {"project": lambda start, buffer: getter.get_into("blob", ETAG, start, buffer, "GET"),
                             "bare": _bare_get(conn, url.split("8333", 1)[1], ETAG, SMALL)}
    count = 50 * args.gets
    got: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, get in paths.items():
            buffer = bytearray(SMALL)
            started = time.thread_time()
            for i in range(count):
                sock.start = i * SMALL
                get(i * SMALL, buffer)
            got[name].append((time.thread_time() - started) / count * 1e6)
    return [f"python {name}: {statistics.median(v):.1f} us/GET (rounds {', '.join(f'{x:.1f}' for x in v)})"
            for name, v in got.items()]


class _NullStore:
    bucket = "bucket"

    def get_range(self, key: str, etag: str, start: int, end: int, buffer: Any = None,
                  size: int | None = None) -> Any:
        return buffer


async def _engine_round(chunk_size: int, chunks: int) -> float:
    engine = ChunkEngine(_NullStore(), chunk_size=chunk_size, memory_limit=64 * chunk_size,  # type: ignore[arg-type]
                         max_connections=16, read_timeout=60)
    obj = ObjectVersion("k", '"e"', chunks * chunk_size)
    owner = object()
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        started = time.thread_time()
        ahead: dict[int, Any] = {}
        for index in range(chunks):
            ahead[index] = engine.fetch(obj, index, owner)
            if index >= 32:
                part = ahead.pop(index - 32)
                if hasattr(part, "wait"):
                    await part.wait()
        for part in ahead.values():
            if hasattr(part, "wait"):
                await part.wait()
        spent = time.thread_time() - started
        nursery.cancel_scope.cancel()
    return spent / chunks * 1e3


async def _handoff_round(chunks: int) -> float:
    limiter = trio.CapacityLimiter(16)
    started = time.thread_time()

    async def one() -> None:
        await trio.to_thread.run_sync(lambda: None, limiter=limiter)
    async with trio.open_nursery() as nursery:
        for _ in range(chunks):
            nursery.start_soon(one)
    return (time.thread_time() - started) / chunks * 1e3


def measure_engine(args: argparse.Namespace) -> list[str]:
    chunks = 2 * args.gets
    engine = [trio.run(_engine_round, args.chunk_size, chunks) for _ in range(args.rounds)]
    handoff = [trio.run(_handoff_round, chunks) for _ in range(args.rounds)]
    return [f"engine trio thread: {statistics.median(engine):.3f} ms/chunk (rounds "
            f"{', '.join(f'{x:.3f}' for x in engine)})",
            f"bare to_thread hand-off: {statistics.median(handoff):.3f} ms (rounds "
            f"{', '.join(f'{x:.3f}' for x in handoff)})"]


MEASUREMENTS = {"get": measure_gets, "python": measure_python, "engine": measure_engine}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help="comma-separated: get, python, engine")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gets", type=int, default=128, help="GETs of --chunk-size a round (scaled for the others)")
    parser.add_argument("--chunk-size", type=int, default=8 << 20)
    args = parser.parse_args(argv)
    for name in args.only.split(","):
        if name not in MEASUREMENTS:
            parser.error(f"unknown measurement {name!r}")
        for line in MEASUREMENTS[name](args):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
