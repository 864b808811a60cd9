"""Helpers shared by the unit and the mount tests: test data and digests, `/proc` readers, pollers, the
daemon's log patterns, S3 uploads, launching `modelfs` (a mount, through the fault proxy, or a command),
reads on a mount, tmpfs mounts, and the in-process chunk engine in virtual time.

Fixtures live in the conftest files: `tests/conftest.py` (the log checker, unit/mount marking) and
`tests/mount/conftest.py` (S3 servers, the fault proxy, the mountpoint).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
import numpy as np
import pytest
import trio
from botocore.config import Config

from fsmount.data import ChunkEngine
from fsmount.testing.models import write_model
from fsmount.testing.seaweed import dying_with_parent

if TYPE_CHECKING:
    from fsmount.testing.fault_proxy import FaultProxy
    from tests.unit.fake_store import FakeStore

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
KiB = 1 << 10
MiB = 1 << 20
MOUNT_TIMEOUT = 30.0
UNMOUNT_TIMEOUT = 30.0
TEST_KEY, TEST_SECRET, TEST_REGION = "modelfs-test-key", "modelfs-test-secret-0123456789", "us-east-1"


# -- the daemon's log -----------------------------------------------------------------------------

# Daemon log lines at these levels fail the test unless the test allowed them by pattern.
BAD_LOG_LEVELS = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback")
# What the daemon logs when a fetch or a request fails.
FETCH_FAILED = r"fetching chunk \d+ of .* failed"
READ_FAILED = r"read failed: "
# What the daemon logs (once) when it answers a lookup from cached metadata because the origin is down.
STALE_METADATA = r"origin unavailable \(.*\); serving cached metadata"
ORIGIN_UNAVAILABLE = r"origin unavailable"
# The disk cache's warnings (a daemon log line, or a log record's message).
CORRUPT_WARNING = r"disk cache .*: dropped corrupt chunk file"
WRITE_FAILED_WARNING = r"disk cache .*: write failed"
# The names kept in the cache dir (saved_names.py) could not be written: said once per mount.
NAMES_WRITE_FAILED = r"the names learnt could not be written to .*: a remount while the origin is away may not"


def warning_lines(log: str) -> list[str]:
    """The lines of a daemon log at WARNING or above (or a traceback)."""
    return [line for line in log.splitlines() if BAD_LOG_LEVELS.search(line)]


def expects_warning(pattern: str) -> pytest.MarkDecorator:
    """Feeds the shared log checker (tests/conftest.py `allowed_logs`); the test then asserts the count."""
    return pytest.mark.parametrize("allowed_logs", [[pattern]], ids=["warns"])


# -- test data and digests ------------------------------------------------------------------------

def random_bytes(n: int, seed: int) -> bytes:
    """n reproducible random bytes (numpy: fast, and not limited to 256 MiB like random.randbytes)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def model_bytes(tmp_path: Path, size: int, seed: int = 0) -> bytes:
    """The bytes of a safetensors model of about `size` bytes, also left at tmp_path/m<seed>.safetensors."""
    path = tmp_path / f"m{seed}.safetensors"
    write_model(path, size, seed=seed)
    return path.read_bytes()


def sha(data: bytes) -> str:
    """sha256 hex digest of bytes."""
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path, new_hash: Callable[[], Any] = hashlib.sha256, drop_page_cache: bool = False) -> str:
    """Hex digest of a file, read in 4 MiB blocks (sha256 unless `new_hash` says otherwise). drop_page_cache
    first evicts the kernel's cached pages of it, so a re-read within one mount really reaches the daemon
    (open keeps the page cache for an unchanged ETag)."""
    h = new_hash()
    with open(path, "rb", buffering=0) as f:
        if drop_page_cache:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


# -- /proc and the kernel's caches ----------------------------------------------------------------

def proc_status(pid: int, field: str) -> int:
    """A number field of /proc/<pid>/status (VmRSS and VmHWM are in KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def fd_count(pid: int) -> int:
    """File descriptors open in the process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def fds_by_kind(pid: int) -> tuple[int, int]:
    """(sockets, everything else) open in the process."""
    sockets = other = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:"):
            sockets += 1
        else:
            other += 1
    return sockets, other


def drop_kernel_caches(level: int) -> None:
    """echo level > /proc/sys/vm/drop_caches: 1 the page cache, 2 dentries and inodes, 3 both (root only)."""
    Path("/proc/sys/vm/drop_caches").write_text(str(level))


def drop_page_cache(path: Path) -> None:
    """Evict the kernel's cached pages of one file, so its next reads reach the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_for(what: str, probe: Callable[[], T], done: Callable[[T], bool] = bool, timeout: float = 30.0,
             interval: float = 0.05) -> T:
    """Poll `probe` until `done(value)` (by default: until it is truthy); fail with the last value after
    `timeout` seconds. Returns the value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still {value!r} after {timeout:g} s")
        time.sleep(interval)


# -- S3 -------------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """What a test needs of a server: an endpoint, credentials for the daemon, a client."""

    def __init__(self, name: str, endpoint_url: str, env: dict[str, str]):
        self.name = name
        self.endpoint_url = endpoint_url
        self.env = env

    def client(self):  # noqa: ANN201
        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], region_name=TEST_REGION,
                            config=Config(s3={"addressing_style": "path"}, max_pool_connections=32))


_bucket_counter = iter(range(1, 1_000_000))


def new_bucket(server: S3Server, prefix: str = "t") -> str:
    """A new, empty bucket with a name unique to this test run."""
    name = f"{prefix}-{os.getpid()}-{next(_bucket_counter)}"
    server.client().create_bucket(Bucket=name)
    return name


def bucket_with(server: S3Server, files: dict[str, bytes | Path], prefix: str = "t") -> str:
    """A new bucket holding `files`, uploaded with `upload`."""
    bucket = new_bucket(server, prefix)
    upload(server, bucket, files)
    return bucket


def upload(server: S3Server, bucket: str, files: dict[str, bytes | Path]) -> None:
    """boto3's managed upload of {key: bytes or a local file}, 8 at a time (multipart above 8 MiB)."""
    client = server.client()

    def one(key: str, body: bytes | Path) -> None:
        if isinstance(body, Path):
            client.upload_file(str(body), bucket, key)
        else:
            client.upload_fileobj(io.BytesIO(body), bucket, key)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, files, files.values()))


def delete_bucket(server: S3Server, bucket: str) -> None:
    """Empty and delete a bucket. The session's SeaweedFS gives each bucket volumes of its own out of a
    fixed number, so tests that write much (or create many buckets) give theirs back."""
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


def put_objects(server: S3Server, bucket: str, files: dict[str, bytes]) -> None:
    """One PutObject per key (a single-part ETag whatever the size), 16 at a time."""
    client = server.client()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), files.items()))


# -- launching modelfs ----------------------------------------------------------------------------

def modelfs_cmd(*args: str) -> list[str]:
    """The argv of `modelfs ARGS` for this checkout."""
    return [sys.executable, "-m", "fsmount", *args]


def modelfs_env() -> dict[str, str]:
    """This environment, with this checkout first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


def daemon_env(server: S3Server) -> dict[str, str]:
    """modelfs_env() with the server's credentials in place of any AWS_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env)
    env["PYTHONPATH"] = str(REPO)
    return env


def run_modelfs(*args: str, env: dict[str, str] | None = None,
                timeout: float | None = 60) -> subprocess.CompletedProcess:
    """`modelfs ARGS` to completion, text output captured (modelfs_env() unless `env` is given)."""
    return subprocess.run(modelfs_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=env or modelfs_env())


class Mount:
    """A running daemon: its mountpoint, its process and its log."""

    def __init__(self, path: Path, proc: subprocess.Popen, log_path: Path):
        self.path = path
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def mounted_at(mountpoint: Path) -> bool:
    """Whether `mountpoint` is a mount point, asked without a request to it (a mount nobody serves hangs a stat)."""
    return any(line.split()[4] == str(mountpoint) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def unmount(path: Path) -> None:
    """fusermount3 -u, lazily if that fails; nothing if `path` is not a mountpoint (one whose daemon died is one:
    its stat fails with ENOTCONN, so `ismount` says no)."""
    if not os.path.ismount(path) and not mounted_at(path):
        return
    res = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
    if res.returncode != 0:
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


@contextlib.contextmanager
def mounted(server: S3Server, bucket: str, mountpoint: Path, *extra: str,
            allowed: tuple[str, ...] = (), check_log: bool = True, wrap: tuple[str, ...] = (),
            cwd: Path | None = None) -> Iterator[Mount]:
    """A foreground daemon in a subprocess (started by the command `wrap`, if given, with the daemon's
    command line after it); always unmounted; its log checked for warnings."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    log_path = mountpoint.parent / f"{mountpoint.name}.daemon.log"
    cmd = [*wrap, *modelfs_cmd("mount", bucket, str(mountpoint), "--foreground", "--endpoint-url",
                               server.endpoint_url, "--log-level", "debug", *extra)]
    with open(log_path, "wb") as log:
        # SIGTERM if this test run dies before the finally below: the daemon then unmounts itself.
        proc = subprocess.Popen(dying_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT,
                                env=daemon_env(server), cwd=cwd)
    m = Mount(mountpoint, proc, log_path)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not (os.path.ismount(mountpoint) and "mounted bucket" in m.log()):
            if proc.poll() is not None:
                pytest.fail(f"daemon exited with {proc.returncode}:\n{m.log()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"mount did not come up:\n{m.log()[-4000:]}")
            time.sleep(0.05)
        yield m
    finally:
        unmount(mountpoint)
        try:
            proc.wait(UNMOUNT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("daemon did not exit after unmount")
    if check_log:
        bad = [line for line in warning_lines(m.log()) if not any(re.search(p, line) for p in allowed)]
        if bad:
            pytest.fail("daemon logged unexpected warnings/errors:\n" + "\n".join(bad[:20]))
        assert proc.returncode == 0, f"daemon exit status {proc.returncode}"


def via(proxy: FaultProxy, server: S3Server) -> S3Server:
    """The daemon talks to the proxy; the test keeps uploading to the server itself."""
    return S3Server(f"{server.name} via proxy", proxy.endpoint_url, server.env)


@contextlib.contextmanager
def mounted_via(proxy: FaultProxy, server: S3Server, bucket: str, mountpoint: Path, *args: str,
                allowed: tuple[str, ...] = ()) -> Iterator[Mount]:
    """`mounted` through the proxy. Faults end before the unmount, so that no test but
    test_unmount_during_stall_exits_promptly depends on how the daemon exits with fetches stalled."""
    with mounted(via(proxy, server), bucket, mountpoint, *args, allowed=allowed) as m:
        try:
            yield m
        finally:
            proxy.clear()
            proxy.origin_back()


def mount_stats(mountpoint: Path) -> dict:
    """The daemon's stats snapshot (the `user.modelfs.stats` xattr of the mount's root)."""
    return json.loads(os.getxattr(mountpoint, "user.modelfs.stats"))


# -- reads on a mount, and how long a failing one may take -----------------------------------------

# The --read-timeout of the fault tests.
READ_TIMEOUT_S = 5.0
# Scheduling slack on a loaded 2-core machine: FUSE round trips, thread hand-offs, the GIL of the
# test process (which also runs the proxy).
TIMEOUT_MARGIN_S = 3.0
# After a fault ends, how long the same mount may take to serve the bytes again: the fetch in flight
# finishes its current attempt or backoff (botocore's throttling backoff alone can reach 8 s).
RECOVERY_S = 30.0


def failing_read_bound(read_timeout_s: float) -> float:
    """How long a read(2) that fails may take: one --read-timeout (the READ the kernel re-sends at once after
    a failure joins the timed-out fetch and fails at once, fix B1), plus the margin."""
    return read_timeout_s + TIMEOUT_MARGIN_S


FAILING_READ_BOUND_S = failing_read_bound(READ_TIMEOUT_S)


def open_random(path: Path) -> int:
    """An fd with kernel read-ahead off, so a pread asks the daemon for its own range only."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


@contextlib.contextmanager
def opened_random(path: Path) -> Iterator[int]:
    """open_random(path), always closed."""
    fd = open_random(path)
    try:
        yield fd
    finally:
        os.close(fd)


def timed(fn: Callable[..., T], *args: Any) -> tuple[T | int, float]:
    """(fn's result, or the errno of the OSError it raised; seconds it took)."""
    start = time.monotonic()
    try:
        result: T | int = fn(*args)
    except OSError as exc:
        result = exc.errno
    return result, time.monotonic() - start


def timed_pread(fd: int, size: int, offset: int) -> tuple[bytes | int, float]:
    """The bytes read, or the errno of the failure; and how long it took."""
    return timed(os.pread, fd, size, offset)


def read_all_exact(fd: int, data: bytes, step: int = MiB) -> None:
    """pread the whole file in `step`s; every block must be exactly `data`'s."""
    for off in range(0, len(data), step):
        assert os.pread(fd, step, off) == data[off:off + step], f"wrong bytes at {off}"


# -- tmpfs ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A fresh tmpfs mounted at `path` (created) with `options`; always unmounted (lazily if busy). Root only."""
    if os.geteuid() != 0:
        pytest.skip("mounting tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


# -- the chunk engine in-process, in trio's virtual time (unit tests) -------------------------------

CHUNK = 1 * MiB  # the engine's chunk size
LATENCY = 0.05  # virtual seconds per GET


def virtual_latency_runner(store: FakeStore, latency: float = LATENCY):  # noqa: ANN201
    """Run 'blocking' calls inline after a virtual-time sleep, under the engine's limiter."""
    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        async with limiter:
            if fn.__name__ == "get_range":
                await trio.sleep(latency)
            return fn(*args)
    return run


def make_engine(store: FakeStore, *, memory=64 * MiB, conns=4, timeout=30.0, latency=LATENCY) -> ChunkEngine:  # noqa: ANN001
    """A ChunkEngine of CHUNK-sized chunks over the fake store, its GETs taking `latency` virtual seconds."""
    return ChunkEngine(store, chunk_size=CHUNK, memory_limit=memory, max_connections=conns,
                       read_timeout=timeout, run_blocking=virtual_latency_runner(store, latency))


async def run_engine(engine: ChunkEngine, body) -> None:  # noqa: ANN001
    """Run `await body()` with the engine running beside it; stop the engine after."""
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        await body()
        nursery.cancel_scope.cancel()


def version(store: FakeStore, key: str):  # noqa: ANN201
    """The ObjectVersion of a key of the fake store."""
    from fsmount.data import ObjectVersion
    m = store.meta(key)
    return ObjectVersion(m.key, m.etag, m.size)


class _NotS3(http.server.BaseHTTPRequestHandler):
    """What a web server that does not speak S3 answers to everything: an error status and no S3 error document
    (SeaweedFS's filer, the port a SeaweedFS user knows, answers 404 so; its volume server 400)."""

    status = 404

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def not_an_s3_server(status: int) -> Iterator[str]:
    """An HTTP server on loopback that answers `status` to every request; its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_NotS3,), {"status": status}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
