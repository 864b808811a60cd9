"""The origin process dies, not just its connections: `kill -9` of the SeaweedFS server (`weed mini`, one
process) while readers are mid-read, then a restart on the same S3 port over the same data dir.

tests/mount/test_faults.py cuts connections through a proxy, between reads. Here the server itself goes away
while readers are reading and a response body is streaming: that body is cut short, new connections
are refused, and the daemon's pooled connections point at a dead process. Each test starts its own
`SeaweedServer` on a fixed S3 port (so the restart serves the endpoint the daemon was mounted with)
and mounts it with `--read-timeout 5`. Four reader threads read while weed dies: two sequential (one
per object, kernel read-ahead on, re-reading a failed offset until it succeeds) and two random (over
both objects, page cache dropped after every read so each read reaches the daemon). Every read(2) of
every reader is checked:

- it returns exactly the object's bytes (a short read counts as wrong), or fails with EIO, never
  another errno;
- a failing read takes at most `FAILING_READ_BOUND_S` (--read-timeout + 3 s), and no read fails
  before the kill or later than that bound after weed is back;
- the daemon process stays alive, and logs no warning but the fetch/read failures (and "origin
  unavailable", should a lookup reach it).

Chunks are 64 MiB: a body that long cannot sit whole in the loopback socket buffers (4 MiB of weed's
send queue plus the daemon's receive buffer), so when the kill comes while weed's send queue is full
(`UNSENT_BEFORE_KILL`, read from /proc/net/tcp), weed still had body bytes to write and the GET is cut
mid-body; each test asserts that the daemon's log shows such a GET. With 1 MiB chunks a whole body fits
in the buffers and the kill almost never cut one (measured).

Reads never cross a chunk boundary, so a read is served by one fetch and cannot be legitimately short
(a read spanning a chunk in memory and a chunk that fails returns the first part: POSIX allows it, and
test_faults.py's promise "never a short read" is checked on single-chunk reads the same way).

What the daemon does (measured, botocore 1.44): a refused connection fails a fetch in well under a
second (botocore's standard-mode backoff for connection errors is 50 ms x 2^n, 4 retries; the store
does not retry `Unreachable`), so with weed dead reads fail with EIO at once, not after --read-timeout;
a READ issued during the ~1 s restart fails too, so readers do not ride over a restart: they get EIO and
succeed when they read again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsmount.testing.seaweed import SeaweedServer, pick_port_pairs
from tests.helpers import (
    FAILING_READ_BOUND_S,
    FETCH_FAILED,
    ORIGIN_UNAVAILABLE,
    READ_FAILED,
    READ_TIMEOUT_S,
    RECOVERY_S,
    TEST_KEY,
    TEST_REGION,
    TEST_SECRET,
    TIMEOUT_MARGIN_S,
    KiB,
    MiB,
    Mount,
    S3Server,
    mounted,
    open_random,
    opened_random,
    random_bytes,
    read_all_exact,
    timed_pread,
    upload,
)

pytestmark = pytest.mark.seaweedfs

BUCKET = "origin-death"
CHUNK = 64 * MiB
# Two objects of 3 chunks the readers stream from the origin, and a small one read whole before the kill.
BIG_SIZE = 3 * CHUNK
WARM_SIZE = 8 * MiB
MOUNT_ARGS = ("--read-timeout", f"{READ_TIMEOUT_S:g}", "--chunk-size", f"{CHUNK // MiB}M", "--max-readahead", "4M",
              "--no-model-prefetch", "--metadata-ttl", "300")
# What the daemon may log while its origin is dead: failed fetches, failed READs, and cached metadata
# served for a lookup (none is expected: every file is open before the kill and the TTL is 300 s).
ALLOWED = (FETCH_FAILED, READ_FAILED, ORIGIN_UNAVAILABLE)
# How the daemon's debug log shows a GET whose body broke off (the store retries it; a refused
# connection is `Unreachable`, never retried by the store, so only a cut body logs this line).
CUT_MID_BODY = r"fsmount\.data\.boto3_store: GET .* failed \("
# The kill comes once the readers have read this much (they are streaming, not starting) ...
PROGRESS_BEFORE_KILL = 16 * MiB
# ... and one of weed's connections holds this much unsent: the daemon's receive window is full, so
# weed is blocked writing a body (see the module docstring).
UNSENT_BEFORE_KILL = 2 * MiB
# Waiting for a condition that takes seconds on an idle machine; generous for a loaded 2-core one.
CONDITION_S = 60.0
# A reader that just got EIO waits this long before reading again (the kernel's immediate re-send of
# a failed READ fails at once anyway, and a busy loop of failures floods the log).
RETRY_PAUSE_S = 0.3
# Random readers pause between reads: most of their reads are memory hits, and 2 cores are shared with
# weed, the daemon and the sequential readers.
RANDOM_PAUSE_S = 0.005
RANDOM_SIZES = (4 * KiB, 64 * KiB, 256 * KiB, MiB)


class Problem(Exception):
    """A read broke a promise; recorded by the reader thread, raised by the test."""


class Reader(threading.Thread):
    """Reads and checks every read(2); keeps a timeline of (start, took, ok)."""

    def __init__(self, objects: dict[Path, bytes], *, sequential: bool, seed: int, stop: threading.Event,
                 problems: list[str]):
        super().__init__(name=f"{'seq' if sequential else 'rand'}-{seed}", daemon=True)
        assert not sequential or len(objects) == 1
        self.objects, self.sequential, self.seed = objects, sequential, seed
        self.stop_event = stop
        self.problems = problems
        self.ok_bytes = 0
        self.events: list[tuple[float, float, bool]] = []
        self.finished = False  # sequential: every byte read exactly

    def run(self) -> None:
        try:
            (self._sequential if self.sequential else self._random)()
        except Problem as exc:
            self.problems.append(f"{self.name}: {exc}")
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.problems.append(f"{self.name}: {type(exc).__name__}: {exc}")

    def _read(self, fd: int, data: bytes, offset: int, size: int) -> bool:
        start = time.monotonic()
        result, took = timed_pread(fd, size, offset)
        if isinstance(result, int):
            self.events.append((start, took, False))
            if result != errno.EIO:
                raise Problem(f"read at {offset}+{size} failed with {errno.errorcode.get(result, result)}, not EIO")
            if took > FAILING_READ_BOUND_S:
                raise Problem(f"a failing read at {offset}+{size} took {took:.1f}s > {FAILING_READ_BOUND_S:g}s")
            return False
        if len(result) < size and offset + len(result) < len(data) and result == data[offset:offset + len(result)]:
            # The kernel's rule: a read(2) whose first pages were in the page cache and whose next READ
            # failed returns the bytes before the failure. Exact bytes, so a failure, not a wrong read; it
            # counts as one, and assert_failures_only_while_down holds it to the outage.
            self.events.append((start, took, False))
            return False
        if result != data[offset:offset + size]:
            raise Problem(f"wrong bytes at {offset}+{size} ({len(result)} bytes back)")
        self.events.append((start, took, True))
        self.ok_bytes += size
        return True

    def _sequential(self) -> None:
        [(path, data)] = self.objects.items()
        fd = os.open(path, os.O_RDONLY)  # kernel read-ahead on, as an ordinary loader
        try:
            offset = 0
            while offset < len(data) and not self.stop_event.is_set():
                size = min(MiB, len(data) - offset)
                if self._read(fd, data, offset, size):
                    offset += size
                else:
                    time.sleep(RETRY_PAUSE_S)
            self.finished = offset >= len(data)
        finally:
            os.close(fd)

    def _random(self) -> None:
        rng = random.Random(self.seed)
        fds = {path: open_random(path) for path in self.objects}
        try:
            while not self.stop_event.is_set():
                path = rng.choice(sorted(fds))
                data = self.objects[path]
                offset = rng.randrange(len(data))
                # Within one chunk (see the module docstring) and within the file.
                size = min(rng.choice(RANDOM_SIZES), CHUNK - offset % CHUNK, len(data) - offset)
                ok = self._read(fds[path], data, offset, size)
                os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_DONTNEED)  # the next read reaches the daemon
                time.sleep(RANDOM_PAUSE_S if ok else RETRY_PAUSE_S)
        finally:
            for fd in fds.values():
                os.close(fd)

    def failures(self) -> list[tuple[float, float]]:
        return [(start, took) for start, took, ok in list(self.events) if not ok]

    def first_ok_started_after(self, t: float) -> float | None:
        """When the first successful read that started at or after `t` ended."""
        return next((start + took for start, took, ok in list(self.events) if ok and start >= t), None)


@contextlib.contextmanager
def own_seaweed(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A SeaweedFS of this test only, on a fixed S3 port (and its gRPC port at +10000) so that a
    restart serves the same endpoint; always stopped."""
    port = pick_port_pairs(1)[0]
    weed = SeaweedServer(tmp_path / "weed", buckets=[BUCKET], access_key=TEST_KEY, secret_key=TEST_SECRET,
                         region=TEST_REGION, s3_port=port)
    try:
        weed.start()
        yield weed
    finally:
        weed.stop()


def as_s3(weed: SeaweedServer) -> S3Server:
    return S3Server("seaweedfs (own)", weed.endpoint_url, weed.env())


def make_objects(weed: SeaweedServer) -> dict[str, bytes]:
    objects = {"a.bin": random_bytes(BIG_SIZE, 101), "b.bin": random_bytes(BIG_SIZE + 12345, 102),
               "warm.bin": random_bytes(WARM_SIZE, 103)}
    upload(as_s3(weed), BUCKET, objects)
    return objects


def make_readers(mountpoint: Path, objects: dict[str, bytes], stop: threading.Event,
                 problems: list[str]) -> list[Reader]:
    a, b = mountpoint / "a.bin", mountpoint / "b.bin"
    both = {a: objects["a.bin"], b: objects["b.bin"]}
    return [Reader({a: both[a]}, sequential=True, seed=0, stop=stop, problems=problems),
            Reader({b: both[b]}, sequential=True, seed=1, stop=stop, problems=problems),
            Reader(both, sequential=False, seed=2, stop=stop, problems=problems),
            Reader(both, sequential=False, seed=3, stop=stop, problems=problems)]


@contextlib.contextmanager
def running(readers: list[Reader], stop: threading.Event) -> Iterator[None]:
    for r in readers:
        r.start()
    try:
        yield
    finally:
        stop.set()
        for r in readers:
            r.join(FAILING_READ_BOUND_S * 3)
        assert not any(r.is_alive() for r in readers), "a reader thread did not end"


def wait_watching(condition: Callable[[], bool], what: str, timeout_s: float, problems: list[str], m: Mount,
                  poll_s: float = 0.05) -> float:
    """Poll `condition` until it holds, like tests.helpers.wait_for, but fail at once on a reader's problem or
    a dead daemon. When it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if problems:
            pytest.fail("reader problems: " + "; ".join(problems[:5]))
        assert m.proc.poll() is None, f"the daemon exited with {m.proc.returncode}"
        if condition():
            return time.monotonic()
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(poll_s)


def unsent_response_bytes(port: int) -> int:
    """The most bytes one of weed's established connections on `port` holds in its send queue."""
    most = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "01" and int(local.split(":")[1], 16) == port:  # ESTABLISHED, weed's end
            most = max(most, int(queues.split(":")[0], 16))
    return most


def kill_mid_read(weed: SeaweedServer, readers: list[Reader], problems: list[str], m: Mount) -> tuple[float, int]:
    """SIGKILL weed (its pid only) while the readers stream and weed is blocked writing a body.
    (When, and how many bytes weed's fullest send queue held just before.)"""
    pid = weed.pid
    assert pid is not None and weed.running
    # SeaweedServer execs weed through a Python trampoline: the pid is weed itself.
    assert os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "weed", os.readlink(f"/proc/{pid}/exe")
    unsent = 0

    def streaming() -> bool:
        nonlocal unsent
        unsent = unsent_response_bytes(weed.s3_port)
        return sum(r.ok_bytes for r in readers) >= PROGRESS_BEFORE_KILL and unsent >= UNSENT_BEFORE_KILL

    wait_watching(streaming, "readers streaming with weed blocked writing a body", CONDITION_S, problems, m,
                  poll_s=0.005)
    os.kill(pid, signal.SIGKILL)
    return time.monotonic(), unsent


def restart(weed: SeaweedServer) -> tuple[float, float]:
    """Reap the killed weed and start it again on the same port and data dir. (When it answered, and how
    long the restart took.)"""
    endpoint = weed.endpoint_url
    start = time.monotonic()
    weed.stop()  # reaps it and removes the unix sockets it left behind
    weed.start()  # returns once a signed ListBuckets succeeds
    assert weed.endpoint_url == endpoint
    return time.monotonic(), time.monotonic() - start


def assert_failures_only_while_down(readers: list[Reader], killed_at: float, back_at: float) -> None:
    """No read failed before the kill, and none ended more than a failing read's bound after the
    restart (one may fail just after it: it joined a fetch whose last attempt was refused)."""
    for r in readers:
        for start, took in r.failures():
            assert start + took >= killed_at, f"{r.name}: a read failed before the kill"
            assert start + took <= back_at + FAILING_READ_BOUND_S, \
                f"{r.name}: a read failed {start + took - back_at:.1f}s after weed was back"


def bodies_cut(m: Mount) -> int:
    """GETs the daemon saw break mid-body. Usually 1-2: the kill comes while weed is blocked writing a
    body (asserted before the kill), but the kernel may still deliver what weed had queued, in which
    case the daemon's next request is simply refused."""
    return len(re.findall(CUT_MID_BODY, m.log()))


def verify_all(mountpoint: Path, objects: dict[str, bytes]) -> None:
    """Every byte of every object, through the daemon (page cache dropped first)."""
    for key, data in objects.items():
        with opened_random(mountpoint / key) as fd:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            read_all_exact(fd, data)


def summary(readers: list[Reader]) -> str:
    fails = [took for r in readers for _, took in r.failures()]
    return (f"{len(fails)} EIO (each took {min(fails, default=0):.2f}-{max(fails, default=0):.2f}s), "
            f"{sum(len(r.events) for r in readers) - len(fails)} exact reads")


def test_kill9_longer_than_read_timeout_eio_in_time_then_same_mount_recovers(tmp_path: Path) -> None:
    """Down longer than --read-timeout: every read is exact or EIO in time, and every reader still
    gets EIO for reads it starts more than --read-timeout after the kill; an object read before the kill
    keeps serving from daemon memory, with its listing and sizes; after the restart the same mount serves
    every byte of every object exactly."""
    mountpoint = tmp_path / "mnt"
    with own_seaweed(tmp_path) as weed:
        objects = make_objects(weed)
        with mounted(as_s3(weed), BUCKET, mountpoint, *MOUNT_ARGS, allowed=ALLOWED) as m:
            with opened_random(mountpoint / "warm.bin") as fd_warm:
                read_all_exact(fd_warm, objects["warm.bin"])  # now in daemon memory
                assert sorted(os.listdir(mountpoint)) == sorted(objects)  # the listing too
                stop, problems = threading.Event(), []
                readers = make_readers(mountpoint, objects, stop, problems)
                with running(readers, stop):
                    killed_at, unsent = kill_mid_read(weed, readers, problems, m)
                    # While weed is dead, what the daemon holds keeps serving.
                    os.posix_fadvise(fd_warm, 0, 0, os.POSIX_FADV_DONTNEED)
                    read_all_exact(fd_warm, objects["warm.bin"])
                    assert sorted(os.listdir(mountpoint)) == sorted(objects)
                    assert os.stat(mountpoint / "a.bin").st_size == BIG_SIZE
                    # Down longer than the read timeout: every reader still reading gets EIO for a read it
                    # started more than --read-timeout after the kill (the chunk cut at the kill, at
                    # least, stays missing).
                    late = killed_at + READ_TIMEOUT_S
                    all_failed_at = wait_watching(lambda: all(any(start >= late for start, _ in r.failures())
                                                              for r in readers if not r.finished),
                                                  "every reader got EIO > read timeout after the kill", CONDITION_S,
                                                  problems, m)
                    assert not all(r.finished for r in readers if r.sequential)
                    assert m.proc.poll() is None and not weed.running
                    back_at, restart_s = restart(weed)
                    # Recovery on the same mount: the sequential readers read on to the end, the random
                    # readers read exact bytes again.
                    done_at = wait_watching(lambda: all(r.finished for r in readers if r.sequential)
                                            and all(r.first_ok_started_after(back_at) for r in readers
                                                    if not r.sequential),
                                            "every reader reading exactly again after the restart", RECOVERY_S,
                                            problems, m)
                assert not problems, problems
                cut = bodies_cut(m)
                assert_failures_only_while_down(readers, killed_at, back_at)
                print(f"\nkill -9 ({unsent >> 10} KiB unsent, {cut} GET cut mid-body) for "
                      f"{back_at - killed_at:.1f}s: {summary(readers)}; every reader failed late "
                      f"{all_failed_at - killed_at:.1f}s after the kill; restart {restart_s:.1f}s; "
                      f"all readers exact again / done {done_at - back_at:.1f}s after it")
                verify_all(mountpoint, objects)
                assert m.proc.poll() is None


def test_kill9_and_immediate_restart_readers_finish_exact(tmp_path: Path) -> None:
    """Down for a restart's time only: reads in flight wait for it (no EIO when weed is back within the
    read timeout), none fails once weed is back, and every reader reads its object to the end, exactly."""
    mountpoint = tmp_path / "mnt"
    with own_seaweed(tmp_path) as weed:
        objects = make_objects(weed)
        with mounted(as_s3(weed), BUCKET, mountpoint, *MOUNT_ARGS, allowed=ALLOWED) as m:
            stop, problems = threading.Event(), []
            readers = make_readers(mountpoint, objects, stop, problems)
            with running(readers, stop):
                killed_at, unsent = kill_mid_read(weed, readers, problems, m)
                back_at, restart_s = restart(weed)
                # A sequential reader may have finished during the restart, from what was read ahead.
                done_at = wait_watching(lambda: all(r.finished for r in readers if r.sequential)
                                        and all(r.first_ok_started_after(back_at) for r in readers if not r.sequential),
                                        "every reader reading exactly again after the restart", RECOVERY_S, problems, m)
            assert not problems, problems
            cut = bodies_cut(m)
            assert_failures_only_while_down(readers, killed_at, back_at)
            if back_at - killed_at < READ_TIMEOUT_S - TIMEOUT_MARGIN_S:
                # Back within the read timeout: a refused connection is retried until the fetch's
                # deadline, so no reader saw the outage at all.
                assert not [f for r in readers for f in r.failures()], summary(readers)
            print(f"\nkill -9 ({unsent >> 10} KiB unsent, {cut} GET cut mid-body) and restart in {restart_s:.1f}s: "
                  f"{summary(readers)}; all readers exact again / done {done_at - back_at:.1f}s after it")
            verify_all(mountpoint, objects)
            assert m.proc.poll() is None
