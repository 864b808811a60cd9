"""Faults on metadata requests: 5xx storms, stalls, resets and truncated XML injected into the listings
behind `readdir` and the HEADs and probes behind `lookup`, through the fault proxy on moto.

What each test asserts:
- a listing that fails on any page (here page 3 of 5) fails whole, with EIO: never a partial directory
  served as if it were complete, and nothing partial cached;
- a failing metadata request ends within one `--read-timeout` plus slack (the same bound as reads);
- a listing or a name the mount already knows keeps serving while metadata requests fail;
- once the fault ends, the same mount lists and resolves everything: at once after an origin that answered
  with errors, within DOWN_FAST_FAIL_S after one that did not answer (a stall: the requests after it fail at
  once for that long instead of each waiting out the timeout).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from fsmount.namespace import DOWN_FAST_FAIL_S, KNOWN_NAME_WAIT_S
from fsmount.testing.fault_proxy import Fault, FaultProxy, synthetic_body
from tests.helpers import (
    FAILING_READ_BOUND_S,
    FETCH_FAILED,
    ORIGIN_UNAVAILABLE,
    READ_FAILED,
    READ_TIMEOUT_S,
    S3Server,
    drop_kernel_caches,
    failing_read_bound,
    mounted_via,
    new_bucket,
    put_objects,
    timed,
)

PAGES = 5
NAMES = [f"w{i:05d}.bin" for i in range(PAGES * 1000 - 500)]  # 5 pages of at most 1000 keys
META_ARGS = ("--read-timeout", f"{READ_TIMEOUT_S:g}", "--metadata-ttl", "300", "--no-model-prefetch")
META_FAILED = r"(opendir|lookup|getattr) failed: "

# fault, inject() arguments. SHORT is truncated XML with a Content-Length that matches it, so only the
# parser notices; TRUNCATE promises the whole body and closes early; CUT_HEADERS closes after the status line
# (a 200 with no headers and no body to http.client: a HEAD without a size, a listing without a listing).
FAULTS = {
    "500": (Fault.ERROR, {"status": 500}),
    "503-SlowDown": (Fault.ERROR, {"status": 503}),
    "stall": (Fault.STALL, {"seconds": 100.0}),
    "stall-mid-body": (Fault.STALL, {"seconds": 100.0, "after_bytes": 300}),
    "reset": (Fault.RESET, {"after_bytes": 300}),
    "truncated-xml": (Fault.SHORT, {"after_bytes": 300}),
    "truncated-connection": (Fault.TRUNCATE, {"after_bytes": 300}),
    "cut-after-the-status-line": (Fault.CUT_HEADERS, {}),
}


# Faults under which a request gets no answer within --read-timeout: the stalls, and SlowDown, whose retries'
# backoff outlasts this test's timeout. After them the namespace fails requests at once for DOWN_FAST_FAIL_S.
NO_ANSWER = {"stall", "stall-mid-body", "503-SlowDown"}


def fault_ended(proxy: FaultProxy, fault: str) -> None:
    """Ends the fault; after one that left requests unanswered, waits out the namespace's fast-fail window."""
    proxy.clear()
    if fault in NO_ANSWER:
        time.sleep(DOWN_FAST_FAIL_S)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_listing_failing_on_page_3_of_5_is_eio_never_partial(moto_server: S3Server, proxy: FaultProxy,
                                                               mountpoint: Path, fault: str) -> None:
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="big/", Body=b"")
    proxy.serve_directory(bucket, "big/", NAMES, size=16)
    kind, kwargs = FAULTS[fault]
    with mounted_via(proxy, moto_server, bucket, mountpoint, *META_ARGS, allowed=(META_FAILED,)):
        assert (mountpoint / "big").is_dir()  # resolved now; only the listing's pages remain
        lists_before = proxy.counts()["lists"]
        # Pages 1 and 2 pass; page 3 and every retry of it fail.
        rule = proxy.inject(kind, kind="lists", skip=2, **kwargs)
        got, took = timed(os.listdir, mountpoint / "big")
        assert got == errno.EIO, f"a listing failing on page 3 gave {got if isinstance(got, int) else len(got)}"
        assert took <= FAILING_READ_BOUND_S, took
        assert rule.hits >= 1 and proxy.counts()["lists"] - lists_before >= 3
        # Nothing partial was kept: asked again while the fault holds, it fails again.
        got, took = timed(os.listdir, mountpoint / "big")
        assert got == errno.EIO and took <= FAILING_READ_BOUND_S, (got, took)
        fault_ended(proxy, fault)
        assert sorted(os.listdir(mountpoint / "big")) == NAMES
        assert (mountpoint / "big" / NAMES[-1]).read_bytes() == synthetic_body(f"big/{NAMES[-1]}".encode(), 16)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_lookup_of_a_new_name_fails_with_eio_within_the_timeout(moto_server: S3Server, proxy: FaultProxy,
                                                                mountpoint: Path, fault: str) -> None:
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"d/known.txt": b"known", "d/new.txt": b"new bytes", "d/sub/x": b"x"})
    kind, kwargs = FAULTS[fault]
    if "after_bytes" in kwargs:
        # The directory probe's empty listing is a few hundred bytes: cut it early. (A HEAD has no body,
        # so a body fault leaves it whole and the probe's failure alone must give EIO.)
        kwargs = {**kwargs, "after_bytes": 20}
    # ORIGIN_UNAVAILABLE: where the kernel forgot `d` or `d/known.txt` meanwhile (memory pressure, another test's
    # drop_caches), their lookups are answered from what the mount knew, with that warning (B246).
    with mounted_via(proxy, moto_server, bucket, mountpoint, *META_ARGS, allowed=(META_FAILED, ORIGIN_UNAVAILABLE)):
        assert (mountpoint / "d" / "known.txt").read_bytes() == b"known"  # resolved by HEAD, not listed
        # Every metadata request fails: the HEAD of the name and the probe for a directory of that name.
        proxy.inject(kind, data_only=False, **kwargs)
        for name in ("new.txt", "sub", "missing"):
            got, took = timed(os.stat, mountpoint / "d" / name)
            assert got == errno.EIO, (name, got)
            assert took <= FAILING_READ_BOUND_S, (name, took)
        # A name the mount knows still resolves (from its metadata, within the TTL) and reads.
        assert (mountpoint / "d" / "known.txt").read_bytes() == b"known"
        fault_ended(proxy, fault)
        assert (mountpoint / "d" / "new.txt").read_bytes() == b"new bytes"
        assert os.listdir(mountpoint / "d" / "sub") == ["x"]
        assert sorted(os.listdir(mountpoint / "d")) == ["known.txt", "new.txt", "sub"]
        with pytest.raises(FileNotFoundError):
            os.stat(mountpoint / "d" / "missing")


def test_known_listings_and_names_keep_serving_while_metadata_fails(moto_server: S3Server, proxy: FaultProxy,
                                                                    mountpoint: Path) -> None:
    """Within the TTL nothing is asked; past it, the expired listing and known names are served while the
    requests that would refresh them fail."""
    ttl = 2.0
    bucket = new_bucket(moto_server)
    files = {f"m/f{i}.bin": os.urandom(1000 + i) for i in range(3)}
    put_objects(moto_server, bucket, files)
    args = ("--read-timeout", f"{READ_TIMEOUT_S:g}", "--metadata-ttl", f"{ttl:g}", "--no-model-prefetch")
    with mounted_via(proxy, moto_server, bucket, mountpoint, *args,
                     allowed=(META_FAILED, ORIGIN_UNAVAILABLE)):
        listed_at = time.monotonic()
        assert sorted(os.listdir(mountpoint / "m")) == ["f0.bin", "f1.bin", "f2.bin"]
        for key, body in files.items():
            assert (mountpoint / key).read_bytes() == body
        proxy.inject(Fault.ERROR, status=500, data_only=False)
        assert sorted(os.listdir(mountpoint / "m")) == ["f0.bin", "f1.bin", "f2.bin"]  # cached listing
        # Past the TTL: the listing and the names are asked for again and fail; what is known is served.
        time.sleep(max(0.0, listed_at + ttl + 0.5 - time.monotonic()))
        got, took = timed(os.listdir, mountpoint / "m")
        assert got == ["f0.bin", "f1.bin", "f2.bin"] or sorted(got) == ["f0.bin", "f1.bin", "f2.bin"], got
        assert took <= FAILING_READ_BOUND_S, took
        for key, body in files.items():
            assert (mountpoint / key).read_bytes() == body
        assert proxy.counts()["faulted"] >= 1  # the refresh really was attempted and failed


def test_a_file_replaced_while_its_directory_is_listed_opens_its_new_version(moto_server: S3Server, proxy: FaultProxy,
                                                                             mountpoint: Path) -> None:
    """`ls d` under way while `d/f`, held open, is replaced and a stat of it finds so: the listing landed naming the
    old version, and every open of `d/f` was ESTALE until the listing expired (the audit)."""
    ttl = 4.0
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"d/f": b"old"})
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--read-timeout", "20", "--metadata-ttl", f"{ttl:g}",
                     "--no-model-streaming"):
        path = mountpoint / "d" / "f"
        with open(path, "rb") as held:  # a reader holds the file (a HEAD: d is not listed)
            assert held.read() == b"old"
            time.sleep(ttl + 0.2)  # its attributes are due for a refresh
            os.stat(mountpoint / "d")  # d's own entry is due too: its LOOKUP now, not in the `ls`
            proxy.inject(Fault.STALL, kind="lists", after_bytes=1, seconds=1.5, times=1)
            ls = threading.Thread(target=os.listdir, args=(mountpoint / "d",))
            ls.start()
            time.sleep(0.5)  # the listing has read the bucket; its answer is held up
            put_objects(moto_server, bucket, {"d/f": b"new version"})
            os.fstat(held.fileno())  # GETATTR -> HEAD: another ETag, the held inode is superseded
            ls.join()
        with open(path, "rb") as f:
            assert f.read() == b"new version"


def test_a_file_found_replaced_then_opened_while_the_origin_is_down_is_eio_not_estale(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """A GET of an open file's next chunk finds it replaced (412): the mount supersedes that version. The origin then
    goes down, and a new open of the path (its entry expired) is answered from what the mount knows: it must not
    be the superseded version, whose open is ESTALE, as is the kernel's retry of it (ESTALE reached the reader:
    "Stale file handle"). Found by test_fault_fuzz.py on SeaweedFS."""
    bucket = new_bucket(moto_server)
    chunk = 64 * 1024
    put_objects(moto_server, bucket, {"d/f.bin": b"1" * (4 * chunk)})
    path = mountpoint / "d" / "f.bin"
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--read-timeout", f"{READ_TIMEOUT_S:g}",
                     "--chunk-size", "64K", "--max-readahead", "0", "--no-model-prefetch", "--metadata-ttl", "1",
                     allowed=(META_FAILED, ORIGIN_UNAVAILABLE, r"fetching chunk \d+ of .* failed", "read failed",
                              "open failed", "object changed")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            assert os.pread(fd, 1, 0) == b"1"
            put_objects(moto_server, bucket, {"d/f.bin": b"2" * (4 * chunk)})
            with pytest.raises(OSError) as exc:  # 412: the handle's version is gone
                os.pread(fd, 1, 3 * chunk)
            assert exc.value.errno == errno.EIO
            proxy.origin_down()
            time.sleep(1.5)  # the kernel's entry (TTL 1 s) expires: the open looks the name up
            result, took = timed(os.open, path, os.O_RDONLY)
            if not isinstance(result, int):
                os.close(result)
            # EIO (the origin is down, and the version the mount knew is gone), never ESTALE.
            assert result == errno.EIO, f"open gave {errno.errorcode.get(result, result)}"
            assert took <= FAILING_READ_BOUND_S
        finally:
            os.close(fd)
        proxy.origin_back()
        time.sleep(DOWN_FAST_FAIL_S + 0.5)
        assert path.read_bytes() == b"2" * (4 * chunk)


def test_slow_metadata_requests_at_once_keep_their_connections(proxy: FaultProxy, moto_server: S3Server,
                                                               mountpoint: Path) -> None:
    """Ten directories listed at once, then a missing name looked up in each at once, while every request takes
    half a second, on a mount of `--max-connections 2`: every answer is right and the daemon logs nothing. Its boto3
    client kept max-connections + 4 connections while up to METADATA_THREADS (8) metadata requests run at once
    (beside the writes' own): urllib3 dropped the spare ones with a WARNING each ("Connection pool is full,
    discarding connection") and connected again for the next requests."""
    dirs = [f"d{i}" for i in range(10)]
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {f"{d}/{n}": b"x" for d in dirs for n in ("a", "b")})
    with mounted_via(proxy, moto_server, bucket, mountpoint, *META_ARGS, "--max-connections", "2"):
        assert sorted(os.listdir(mountpoint)) == dirs
        proxy.inject(Fault.LATENCY, seconds=0.5, data_only=False)
        barrier = threading.Barrier(len(dirs))

        def listing(d: str) -> tuple[list[str], bool]:
            barrier.wait()
            names = sorted(os.listdir(mountpoint / d))
            barrier.wait()
            return names, (mountpoint / d / "missing").exists()

        with ThreadPoolExecutor(len(dirs)) as pool:
            assert list(pool.map(listing, dirs)) == [(["a", "b"], False)] * len(dirs)



HELD_READ_TIMEOUT_S = 8.0


@pytest.mark.parametrize("data_gets", ["slow", "stalled"])
def test_a_read_of_a_file_held_open_past_the_ttl_waits_no_head(s3: S3Server, mountpoint: Path, data_gets: str) -> None:
    """The kernel asks GETATTR before a READ once a file's attributes are past --metadata-ttl. A file held open
    reads the version it opened: its GETATTR is answered at once, its HEAD runs behind it, and a pread from a slow
    origin takes its own fetch's time (or fails at its own --read-timeout), never the HEAD's on top (B790)."""
    data = os.urandom(4 << 20)
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {"held.bin": data})
    args = ("--read-timeout", f"{HELD_READ_TIMEOUT_S:g}", "--metadata-ttl", "1", "--chunk-size", "1M",
            "--max-readahead", "0", "--no-model-prefetch")
    with FaultProxy(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, mountpoint, *args,
                        allowed=(META_FAILED, ORIGIN_UNAVAILABLE, FETCH_FAILED, READ_FAILED)):
        fd = os.open(mountpoint / "held.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            assert os.pread(fd, 1 << 20, 0) == data[:1 << 20]
            heads = proxy.inject(Fault.STALL, seconds=100.0, kind="heads")  # HEADs get no answer
            if data_gets == "slow":
                proxy.inject(Fault.LATENCY, seconds=2.0)  # every data GET comes after 2 s
            else:
                proxy.inject(Fault.STALL, seconds=100.0)
            time.sleep(1.5)  # past the TTL
            got, took = timed(os.pread, fd, 1 << 20, 2 << 20)
            assert heads.hits >= 1  # the GETATTR before the READ asked one (behind the answer now)
            if data_gets == "slow":
                assert got == data[2 << 20:3 << 20]
                assert took < HELD_READ_TIMEOUT_S - 1, took  # its fetch's 2 s and slack; the HEAD first: 10 s
            else:
                assert got == errno.EIO
                assert took <= failing_read_bound(HELD_READ_TIMEOUT_S), took  # the HEAD first: 16 s
            got, took = timed(os.fstat, fd)
            assert not isinstance(got, int) and got.st_size == len(data) and took < 1, took  # from what is known
        finally:
            os.close(fd)


FROZEN_READ_TIMEOUT_S = 20.0


@contextmanager
def known_model_frozen(moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> Iterator[dict[str, bytes]]:
    """A mount (TTL 1 s) that listed and stat'ed the 20 files of a model (yielded), the TTL past, and the origin
    frozen: every request held, none answered, within FROZEN_READ_TIMEOUT_S."""
    bucket = new_bucket(moto_server)
    files = {f"m/f{i:02d}.bin": os.urandom(1000 + i) for i in range(20)}
    put_objects(moto_server, bucket, files)
    args = ("--read-timeout", f"{FROZEN_READ_TIMEOUT_S:g}", "--metadata-ttl", "1", "--no-model-prefetch")
    with mounted_via(proxy, moto_server, bucket, mountpoint, *args, allowed=(META_FAILED, ORIGIN_UNAVAILABLE)):
        assert sorted(os.listdir(mountpoint / "m")) == sorted(key[2:] for key in files)
        for key in files:
            assert (mountpoint / key).stat().st_size == len(files[key])
        time.sleep(1.5)  # past the TTL
        proxy.inject(Fault.STALL, seconds=100.0, data_only=False)
        try:
            yield files
        finally:
            proxy.clear()


def stats_answered_at_once(mountpoint: Path, files: dict[str, bytes]) -> None:
    """A `stat` of each file answers its known size within KNOWN_NAME_WAIT_S and slack for a loaded host, none a
    --read-timeout."""
    start = time.monotonic()
    for key in files:
        got, took = timed(os.stat, mountpoint / key)
        assert not isinstance(got, int) and got.st_size == len(files[key]), (key, got)
        assert took <= KNOWN_NAME_WAIT_S + 3.0, (key, took)
    assert time.monotonic() - start < FROZEN_READ_TIMEOUT_S / 2


def test_ls_l_of_known_names_on_a_frozen_origin_waits_no_timeout_per_name(moto_server: S3Server, proxy: FaultProxy,
                                                                         mountpoint: Path) -> None:
    """The origin frozen (it takes connections and answers nothing), the kernel's entries dropped (`drop_caches`), the
    TTL past: a `stat` of each name of a directory the mount had listed waited the whole --read-timeout before the
    known answer was served, and once DOWN_FAST_FAIL_S had passed the next one waited it again: an `ls -l` of a
    model's 20 files took minutes at the default 120 s. A known name's lookup now waits KNOWN_NAME_WAIT_S at most for
    the bucket's answer, and none while an earlier request has gone unanswered that long."""
    with known_model_frozen(moto_server, proxy, mountpoint) as files:
        drop_kernel_caches(3)
        stats_answered_at_once(mountpoint, files)


def test_ls_l_of_a_listed_directory_on_a_frozen_origin_waits_no_timeout(moto_server: S3Server, proxy: FaultProxy,
                                                                        mountpoint: Path) -> None:
    """The origin frozen, the TTL past: `ls -l` of a directory the mount had listed waited the whole --read-timeout for
    its listing, then the GETATTR of each entry (attributes past the TTL) waited its HEAD's once DOWN_FAST_FAIL_S had
    passed. The expired listing and the known attributes are now answered after KNOWN_NAME_WAIT_S at most, the
    requests going on behind; an open still waits for its HEAD (and, the origin frozen, is served the known version
    after its --read-timeout, as before)."""
    with known_model_frozen(moto_server, proxy, mountpoint) as files:
        got, took = timed(os.listdir, mountpoint / "m")
        assert not isinstance(got, int) and sorted(got) == sorted(key[2:] for key in files), got
        assert took <= KNOWN_NAME_WAIT_S + 3.0, took
        stats_answered_at_once(mountpoint, files)
