"""`--writable` under faults: a store that fails parts, an origin gone at close, a daemon killed mid-write,
and memory held to `--memory-limit` while several writers stream. Mounted on moto through the fault proxy
(`fsmount.testing.fault_proxy`), or on SeaweedFS where the volume matters.

What every test asserts: a file is in the bucket whole and exact, or not at all; a failure reaches the
writer as an errno (EIO at close); no upload is left behind except by a killed daemon, and
`modelfs cleanup` finds and aborts those.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsmount.config import StoreConfig
from fsmount.data import Boto3Store
from fsmount.data.boto3_store import within
from fsmount.data.store import TimedOut, TransientError, Unreachable
from fsmount.data.uploads import Uploads
from fsmount.testing.fault_proxy import Down, Fault, FaultProxy
from tests.helpers import (
    MiB,
    S3Server,
    daemon_env,
    delete_bucket,
    mount_stats,
    mounted,
    mounted_at,
    mounted_via,
    new_bucket,
    proc_status,
    put_objects,
    random_bytes,
    run_modelfs,
    sha,
    via,
    wait_for,
)
from tests.mount.test_faults import failing_task

WRITE_ARGS = ("--writable", "--write-part-size", "5M", "--read-timeout", "5", "--max-connections", "4")


def uploads_in(server: S3Server, bucket: str) -> list[str]:
    return [u["Key"] for u in server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", ())]


def objects_in(server: S3Server, bucket: str) -> list[str]:
    return [o["Key"] for o in server.client().list_objects_v2(Bucket=bucket).get("Contents", ())]


def cleanup(server: S3Server, bucket: str, *args: str) -> subprocess.CompletedProcess:
    return run_modelfs("cleanup", bucket, "--endpoint-url", server.endpoint_url, *args, env=daemon_env(server))


def test_5xx_on_parts_and_completion_are_retried(moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    bucket = new_bucket(moto_server)
    data = random_bytes(17 * MiB, 11)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS) as m:
        parts = proxy.inject(Fault.ERROR, status=500, kind="parts", times=3)
        completes = proxy.inject(Fault.ERROR, status=503, kind="completes", times=1)
        (mountpoint / "a.bin").write_bytes(data)
        assert parts.hits == 3 and completes.hits == 1
        assert mount_stats(m.path)["writes"]["files_stored"] == 1
    got = moto_server.client().get_object(Bucket=bucket, Key="a.bin")["Body"].read()
    assert sha(got) == sha(data)
    assert uploads_in(moto_server, bucket) == []
    delete_bucket(moto_server, bucket)


def test_parts_refused_for_good_fail_the_close_and_store_nothing(moto_server: S3Server, proxy: FaultProxy,
                                                                 mountpoint: Path) -> None:
    bucket = new_bucket(moto_server)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS,
                     allowed=(r"will not be stored", r"part \d+")):
        proxy.inject(Fault.ERROR, status=500, kind="parts")
        with pytest.raises(OSError) as info:
            with open(mountpoint / "a.bin", "wb") as f:
                for _ in range(12):
                    f.write(random_bytes(MiB, 1))
        assert info.value.errno == errno.EIO
        assert not (mountpoint / "a.bin").exists()
        proxy.clear()
    assert objects_in(moto_server, bucket) == []
    assert uploads_in(moto_server, bucket) == []
    delete_bucket(moto_server, bucket)


def test_origin_down_at_close_is_eio_no_object_and_the_advised_cleanup_removes_those_parts_only(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """The warning's `modelfs cleanup BUCKET --prefix KEY --older-than 0` found nothing (the prefix became 'KEY/')
    and named no endpoint: now it names the key and the mount's endpoint, and removes that upload and no other."""
    bucket = new_bucket(moto_server)
    moto_server.client().create_multipart_upload(Bucket=bucket, Key="a.bin.other")  # another writer's, live
    # Not `mounted_via`, which brings the origin back before the unmount.
    with mounted(via(proxy, moto_server), bucket, mountpoint, *WRITE_ARGS,
                 allowed=(r"will not be stored", r"could not be aborted", r"cannot reach", r"timed out",
                          r"aborting the upload")) as m:
        f = open(mountpoint / "a.bin", "wb")
        f.write(random_bytes(11 * MiB, 2))  # two parts sent
        f.flush()
        wait_for("parts uploaded", lambda: mount_stats(mountpoint)["writes"]["parts_uploaded"], lambda n: n >= 2)
        proxy.origin_down(Down.REFUSE)
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            f.close()
        assert info.value.errno == errno.EIO
        assert time.monotonic() - started < 5 + 10 + 5  # --read-timeout, the abort's bound, slack
        # (That the file left the tree is test_parts_refused_for_good_fail_the_close_and_store_nothing's: a stat
        # now needs the origin.)
        advised = re.search(r"could not be aborted .*; `(modelfs cleanup [^`]*)` removes it", m.log())
    # Back only once the daemon is gone: an abort given up on at --read-timeout may be inside botocore's own
    # backoff between retries, and then lands once the origin is back (a clean-clone run saw it). It would be
    # aborted then, which is what the warning's command is for; this test is of the command.
    proxy.origin_back()
    assert objects_in(moto_server, bucket) == []
    # The abort could not reach the origin either: the parts wait for `modelfs cleanup`.
    assert sorted(uploads_in(moto_server, bucket)) == ["a.bin", "a.bin.other"]
    assert advised, "the warning names no cleanup command"
    assert advised[1] == f"modelfs cleanup {bucket} --endpoint-url {proxy.endpoint_url} --key a.bin --older-than 0"
    done = run_modelfs(*shlex.split(advised[1])[1:], env=daemon_env(moto_server))
    assert done.returncode == 0, done.stderr
    assert "aborted a.bin " in done.stdout and "aborted 1" in done.stdout, done.stdout
    assert uploads_in(moto_server, bucket) == ["a.bin.other"]
    done = cleanup(moto_server, bucket, "--older-than", "0")
    assert "aborted a.bin.other" in done.stdout, done.stdout
    delete_bucket(moto_server, bucket)


def test_a_restart_of_the_origin_shorter_than_the_read_timeout_costs_a_write_only_time(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """The origin refuses connections for 2 s (a server restarting) while a file is written: its parts are tried
    again until it is back, and the file is stored whole (a 20 s restart lost the checkpoint at once)."""
    bucket = new_bucket(moto_server)
    data = random_bytes(23 * MiB, 3)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS) as m:
        with open(mountpoint / "a.bin", "wb") as f:
            f.write(data[:6 * MiB])
            f.flush()
            wait_for("a part uploaded", lambda: mount_stats(mountpoint)["writes"]["parts_uploaded"], lambda n: n >= 1)
            proxy.origin_down(Down.REFUSE)
            f.write(data[6 * MiB:17 * MiB])  # two more parts, sent while refused
            f.flush()
            time.sleep(2)
            proxy.origin_back()
            f.write(data[17 * MiB:])
        assert mount_stats(m.path)["writes"]["files_stored"] == 1
    got = moto_server.client().get_object(Bucket=bucket, Key="a.bin")["Body"].read()
    assert sha(got) == sha(data)
    assert uploads_in(moto_server, bucket) == []
    delete_bucket(moto_server, bucket)


WRITER = """
    import os, sys
    block = os.urandom(1 << 20)
    with open(sys.argv[1], "wb") as f:
        for i in range(int(sys.argv[2])):
            f.write(block)
            if i == 12:
                print("written", flush=True)
        f.flush()
        sys.stdin.read()  # held open until the test kills the daemon
"""


@contextlib.contextmanager
def writer_with_parts_sent(path: Path) -> Iterator[None]:
    """A process writing 20 MiB to `path` on a mount, holding it open once two parts were uploaded; killed
    when the block ends."""
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(path), "20"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        wait_for("parts uploaded", lambda: mount_stats(path.parent)["writes"]["parts_uploaded"], lambda n: n >= 2)
        yield
    finally:
        writer.kill()
        writer.wait(10)


def test_kill_9_mid_write_leaves_no_object_and_cleanup_aborts_the_parts(seaweed_server: S3Server,
                                                                        mountpoint: Path) -> None:
    s3 = seaweed_server
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITE_ARGS, check_log=False) as m:
        with writer_with_parts_sent(mountpoint / "ckpt.bin"):
            m.proc.send_signal(signal.SIGKILL)
            m.proc.wait(10)
    assert objects_in(s3, bucket) == []
    assert uploads_in(s3, bucket) == ["ckpt.bin"]
    # A day by default: a running mount may own a young upload (moto dates every upload 2010: not there).
    young = cleanup(s3, bucket)
    assert young.returncode == 0 and uploads_in(s3, bucket) == ["ckpt.bin"], young.stdout + young.stderr
    listed = cleanup(s3, bucket, "--older-than", "0", "--dry-run")
    assert "would abort ckpt.bin" in listed.stdout and uploads_in(s3, bucket) == ["ckpt.bin"]
    assert listed.stdout.strip().endswith("; would abort 1"), listed.stdout  # it said "would abort 0"
    done = cleanup(s3, bucket, "--older-than", "0")
    assert done.returncode == 0 and "aborted ckpt.bin" in done.stdout, done.stdout + done.stderr
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_stopping_the_daemon_aborts_the_uploads_of_files_still_open(seaweed_server: S3Server,
                                                                    mountpoint: Path) -> None:
    """SIGTERM (systemctl stop) with a file half written: the daemon aborts its upload before it exits."""
    s3 = seaweed_server
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITE_ARGS, check_log=False) as m:
        with writer_with_parts_sent(mountpoint / "half.bin"):
            assert uploads_in(s3, bucket) == ["half.bin"]
            m.proc.send_signal(signal.SIGTERM)
            assert m.proc.wait(30) == 0
        assert "uploads could not be aborted" not in m.log()
        assert "half.bin was still being written when the mount stopped: it is not stored" in m.log()
    assert objects_in(s3, bucket) == []
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_task_of_the_mount_that_fails_aborts_the_uploads_of_files_still_open(moto_server: S3Server,
                                                                            mountpoint: Path, tmp_path: Path) -> None:
    """A task of the mount that fails (injected) with a file half written: the daemon stops on the error (B127, B140)
    and its writer gets ENOTCONN, but the upload's parts stayed in the bucket, billed until `modelfs cleanup` or a
    lifecycle rule removed them: a clean end's aborts wait on the writes' tasks, left out on that path. They are
    aborted now, straight through the store, before the daemon exits (B147)."""
    s3 = moto_server
    wrap, fail_now = failing_task(tmp_path)
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITE_ARGS, check_log=False, wrap=wrap) as m:
        with writer_with_parts_sent(mountpoint / "half.bin"):
            assert uploads_in(s3, bucket) == ["half.bin"]
            fail_now.touch()
            assert m.proc.wait(30) != 0
    log = m.log()
    assert "daemon stopped on an error" in log and "a bug of a task of the mount's" in log, log[-4000:]
    assert objects_in(s3, bucket) == []
    assert uploads_in(s3, bucket) == [], log[-4000:]
    assert "half.bin was still being written when the mount failed: it is not stored" in log, log[-4000:]
    assert "could not be aborted" not in log, log[-4000:]
    delete_bucket(s3, bucket)


def test_a_stop_unmounts_before_its_drains_and_a_second_stop_leaves_no_mount(moto_server: S3Server,
                                                                             proxy: FaultProxy,
                                                                             mountpoint: Path) -> None:
    """After a SIGTERM the daemon drains (aborts uploads, writes fetched chunks to the caches, drops claims: up
    to about a minute). The mount stayed in place meanwhile with nobody reading its requests: a `stat` of the
    mount point hung until the drains ended, and a second SIGTERM (the default action by then) ended the daemon
    with its mount in place, ENOTCONN until someone unmounted it. The mount now goes before the drains, and a second
    SIGTERM cuts the drains short with exit status 1 (B692)."""
    bucket = new_bucket(moto_server)
    with mounted(via(proxy, moto_server), bucket, mountpoint, *WRITE_ARGS, check_log=False) as m:
        with writer_with_parts_sent(mountpoint / "half.bin"):
            abort = proxy.inject(Fault.LATENCY, seconds=8, kind="other")  # the upload's abort: a drain of seconds
            m.proc.send_signal(signal.SIGTERM)
            wait_for("the drain's abort", lambda: abort.hits, lambda n: n >= 1, timeout=15)
            wait_for("the mount to go", lambda: mounted_at(mountpoint), lambda mounted: not mounted, timeout=3)
            looked = threading.Thread(target=lambda: os.path.exists(mountpoint / "half.bin"), daemon=True)
            looked.start()
            looked.join(3)
            assert not looked.is_alive(), "a stat of the mount point hung during the drain"
            m.proc.send_signal(signal.SIGTERM)  # a second stop cuts the drains short (B692): exit status 1
            assert m.proc.wait(10) == 1
            assert not mounted_at(mountpoint)
    delete_bucket(moto_server, bucket)


def test_a_stop_during_the_drains_after_an_unmount_ends_the_daemon_cleanly(moto_server: S3Server, proxy: FaultProxy,
                                                                             mountpoint: Path) -> None:
    """The mount gone by the operator's hand (`umount -f`, `modelfs unmount`), the daemon drains; a stop then
    (`systemctl stop`) called into the closed session: a SIGSEGV and a core dump (the review). That stop is the
    first: the drains go on and the exit status is 0 (B820: it was taken as a second one, exit status 1)."""
    bucket = new_bucket(moto_server)
    with mounted(via(proxy, moto_server), bucket, mountpoint, *WRITE_ARGS, check_log=False) as m:
        with writer_with_parts_sent(mountpoint / "half.bin"):
            abort = proxy.inject(Fault.LATENCY, seconds=8, kind="other")  # the drain's abort takes seconds
            subprocess.run(["umount", "-f", str(mountpoint)], capture_output=True)
            wait_for("the drain's abort", lambda: abort.hits, lambda n: n >= 1, timeout=15)
            m.proc.send_signal(signal.SIGTERM)  # the first stop: the drains go on, exit status 0 (B820)
            assert m.proc.wait(20) == 0, m.log()[-3000:]
    assert "received SIGTERM: already unmounted, the stop's drains go on" in m.log()
    assert "the stop was cut short" not in m.log()
    delete_bucket(moto_server, bucket)


def test_memory_bound_held_while_4_writers_stream_1_gb_each(seaweed_server: S3Server, mountpoint: Path) -> None:
    s3 = seaweed_server
    bucket = new_bucket(s3)
    limit_mib, blocks = 256, 1024
    with mounted(s3, bucket, mountpoint, "--writable", "--memory-limit", f"{limit_mib}M") as m:
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], proc_status(m.proc.pid, "VmRSS"))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            writers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER).replace("sys.stdin.read()", ""),
                                         str(mountpoint / f"w{i}.bin"), str(blocks)], stdout=subprocess.DEVNULL)
                       for i in range(4)]
            for w in writers:
                assert w.wait(600) == 0
        finally:
            done.set()
            sampler.join()
        assert peak[0] <= (limit_mib + 64) * 1024, f"daemon RSS peaked at {peak[0] // 1024} MiB"
        assert mount_stats(mountpoint)["writes"]["files_stored"] == 4
    sizes = {o["Key"]: o["Size"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert sizes == {f"w{i}.bin": blocks * MiB for i in range(4)}
    delete_bucket(s3, bucket)


def test_a_rename_right_after_closing_an_empty_file_stores_it_under_the_new_name(moto_server: S3Server,
                                                                                 proxy: FaultProxy,
                                                                                 mountpoint: Path) -> None:
    """`touch tmp && mv tmp DONE` (a trainer's marker): an empty file is stored at RELEASE, which the kernel sends
    after close(2) returned, so the rename came while its PUT was under way, only renamed it in the mount, and the
    bucket got `tmp` (the audit). The PUTs are slowed down here so that every rename lands during one."""
    bucket = new_bucket(moto_server)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS):
        proxy.inject(Fault.LATENCY, seconds=0.5, data_only=False, kind="other")  # PUTs and DELETEs
        for i in range(3):
            (mountpoint / "tmp").touch()
            os.rename(mountpoint / "tmp", mountpoint / f"DONE{i}")
        assert sorted(os.listdir(mountpoint)) == ["DONE0", "DONE1", "DONE2"]
    assert objects_in(moto_server, bucket) == ["DONE0", "DONE1", "DONE2"]
    delete_bucket(moto_server, bucket)


def _uploads_of(server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> Uploads:
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return Uploads(Boto3Store(StoreConfig(bucket, endpoint_url=server.endpoint_url, addressing_style="path")))


def test_a_moves_delete_takes_the_old_key_only_if_it_holds_what_was_copied(s3: S3Server,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A rename's delete of the old key is If-Match on the version it copied (writes.move_object): another mount's
    file stored under the old name meanwhile stays. On the wire of both servers."""
    bucket = new_bucket(s3)
    client = s3.client()
    old = client.put_object(Bucket=bucket, Key="log", Body=b"first")["ETag"]
    new = client.put_object(Bucket=bucket, Key="log", Body=b"theirs")["ETag"]
    uploads = _uploads_of(s3, bucket, monkeypatch)
    assert uploads.delete_version("log", old) is False
    assert client.get_object(Bucket=bucket, Key="log")["Body"].read() == b"theirs"
    assert uploads.delete_version("log", new) is True
    assert uploads.delete_version("log", new) is True  # gone already: nothing to keep
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    delete_bucket(s3, bucket)


def test_a_server_that_refuses_a_conditional_delete_gets_the_plain_one(moto_server: S3Server, proxy: FaultProxy,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An S3-compatible server without conditional deletes, which answers If-Match on DELETE with 501: the move's
    delete is sent again without it, as before, so renames leave no stray object there."""
    bucket = new_bucket(moto_server)
    etag = moto_server.client().put_object(Bucket=bucket, Key="tmp", Body=b"x")["ETag"]
    rule = proxy.inject(Fault.ERROR, status=501, code="NotImplemented", kind="other", times=1)
    uploads = _uploads_of(via(proxy, moto_server), bucket, monkeypatch)
    with caplog.at_level(logging.INFO):
        assert uploads.delete_version("tmp", etag) is True
    assert rule.hits == 1 and "refused it with If-Match" in caplog.text
    assert moto_server.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def stored_or_failed(server: S3Server, bucket: str, key: str, data: bytes, write: Callable[[], None]) -> int | None:
    """Run `write`; its errno, or None. Either way the bucket holds `data` whole under `key` only if it returned 0."""
    try:
        write()
        error = None
    except OSError as exc:
        error = exc.errno
    try:
        got = server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except server.client().exceptions.NoSuchKey:
        got = None
    if error is None:
        assert got is not None and sha(got) == sha(data), f"close returned 0, the bucket holds {got and len(got)} bytes"
    else:
        assert error == errno.EIO
        assert got is None, f"close failed ({errno.errorcode[error]}), yet the bucket holds {len(got)} bytes"
    return error


@pytest.mark.parametrize("op", ["start", "complete", "put"])
def test_a_write_answer_cut_short_never_stores_other_bytes_nor_fails_a_stored_file(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, op: str) -> None:
    """A 200 whose body is cut short before any byte (FIN where the Content-Length promised more) reaches botocore as a
    success with nothing in it. CreateMultipartUpload's had no UploadId: a KeyError left the file half set up, its
    first part's bytes were dropped, and the close stored what followed them alone (here: an empty object for the
    5 MiB the write said it wrote), returning 0 (the fault fuzzer).
    CompleteMultipartUpload's had no ETag: the close got EIO, and the RELEASE after it completed the upload again, so
    the failed file was in the bucket. Now either the close returns 0 and the file is whole, or EIO and nothing (and
    an upload the cut start began is named for `modelfs cleanup`)."""
    bucket = new_bucket(moto_server)
    data = random_bytes(MiB if op == "put" else 13 * MiB, 21)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS,
                     allowed=(r"will not be stored", r"cut short", r"may have begun")):
        cut = proxy.inject(Fault.TRUNCATE, after_bytes=0, op=op, times=1)
        fd = os.open(mountpoint / "a.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            written = os.write(fd, data)  # one call: what it says it wrote is what a close of 0 must store
        except OSError as exc:
            assert exc.errno == errno.EIO
            written = 0
        stored_or_failed(moto_server, bucket, "a.bin", data[:written], lambda: os.close(fd))
        assert cut.hits == 1
    delete_bucket(moto_server, bucket)


@pytest.mark.parametrize("op,size", [("put", MiB), ("complete", 13 * MiB)])
def test_a_lost_answer_to_the_last_request_of_a_create_only_file_is_not_a_failure(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, op: str, size: int) -> None:
    """The server stored the file and its answer was lost (a connection reset on the way back): botocore sends the
    create-only PUT again, which finds the key, its own, and got 412; the close said EIO ("created meanwhile by
    another writer") for a file the bucket holds whole, and a trainer saving again got EPERM (the fault fuzzer). The
    bucket is asked (HEAD): holding exactly this file, the close returns 0."""
    bucket = new_bucket(moto_server)
    data = random_bytes(size, 22)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS, allowed=(r"will not be stored",)):
        lost = proxy.inject(Fault.DROP, op=op, times=1)
        assert stored_or_failed(moto_server, bucket, "a.bin", data,
                                lambda: (mountpoint / "a.bin").write_bytes(data)) is None
        assert lost.hits == 1
        assert (mountpoint / "a.bin").read_bytes() == data
    delete_bucket(moto_server, bucket)


@pytest.mark.parametrize("op,size", [("put", MiB), ("complete", 13 * MiB)])
def test_a_lost_answer_to_the_last_request_of_a_rewrite_that_keeps_its_version_is_not_a_failure(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, op: str, size: int) -> None:
    """A rewrite that keeps the version it opened (an append to an empty stored file) is stored If-Match on that
    version (B308). The server stored it and its answer was lost: botocore sends it again, and the key holds this
    rewrite's own object now, not the version opened, so the PUT's retry gets 412.
    That is no other writer: the bucket holds exactly this file, and the close returns 0 (the review of B308)."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"a.log": b""})
    data = random_bytes(size, 28)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS, "--allow-overwrite") as m:
        lost = proxy.inject(Fault.DROP, op=op, times=1)
        fd = os.open(mountpoint / "a.log", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        assert lost.hits == 1
        log = m.log()
        assert "refused a store with If-Match" not in log  # its own object is not a server refusing its ETag
        if op == "put":  # moto completes an upload again (SeaweedFS: NoSuchUpload, asked the same way)
            assert "the bucket holds this object whole: stored" in log, log[-2000:]
        assert (mountpoint / "a.log").read_bytes() == data
    assert moto_server.client().get_object(Bucket=bucket, Key="a.log")["Body"].read() == data
    assert uploads_in(moto_server, bucket) == []
    delete_bucket(moto_server, bucket)


def test_an_upload_begun_twice_by_a_retry_leaves_no_parts_unnamed(moto_server: S3Server, proxy: FaultProxy,
                                                                   mountpoint: Path) -> None:
    """CreateMultipartUpload's answer lost, botocore begins the upload again: the first one, which the server did
    begin, was never aborted nor named, and stayed in the bucket (billed) with nothing in the log (the fault fuzzer).
    Its key is now named with the `modelfs cleanup --key` that removes it."""
    bucket = new_bucket(moto_server)
    data = random_bytes(13 * MiB, 23)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS, allowed=(r"may have begun",)) as m:
        lost = proxy.inject(Fault.DROP, op="start", times=1)
        (mountpoint / "a.bin").write_bytes(data)
        assert lost.hits == 1
        log = m.log()
    left = uploads_in(moto_server, bucket)
    assert left == ["a.bin"]  # botocore does not tell which upload the lost answer began
    advised = re.search(r"`(modelfs cleanup [^`]*--key a\.bin[^`]*)`", log)
    assert advised, "the upload left behind is named nowhere"
    done = run_modelfs(*shlex.split(advised[1])[1:], env=daemon_env(moto_server))
    assert done.returncode == 0 and uploads_in(moto_server, bucket) == [], done.stdout + done.stderr
    assert moto_server.client().get_object(Bucket=bucket, Key="a.bin")["Body"].read() == data
    delete_bucket(moto_server, bucket)


def test_a_start_retried_after_slow_downs_names_no_upload(moto_server: S3Server, proxy: FaultProxy,
                                                         mountpoint: Path) -> None:
    """A CreateMultipartUpload answered 503 (SlowDown) began nothing, so the start botocore retries after it leaves
    nothing behind: every retried start warned that an upload "may have begun", naming a `modelfs cleanup` to run,
    a warning per file under throttling. Only a try left unanswered (the test above) is named now."""
    bucket = new_bucket(moto_server)
    data = random_bytes(13 * MiB, 26)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS) as m:
        refused = proxy.inject(Fault.ERROR, status=503, code="SlowDown", op="start", times=2)
        (mountpoint / "a.bin").write_bytes(data)
        assert refused.hits == 2
        assert "may have begun" not in m.log()
    assert uploads_in(moto_server, bucket) == []
    assert moto_server.client().get_object(Bucket=bucket, Key="a.bin")["Body"].read() == data
    delete_bucket(moto_server, bucket)


def test_a_start_answered_with_its_document_cut_short_names_the_upload(moto_server: S3Server, proxy: FaultProxy,
                                                                      mountpoint: Path) -> None:
    """CreateMultipartUpload answered 200 with its XML cut short (a Content-Length that says so): the server began an
    upload, and botocore's parser raises before any response-received, so the start took it for a try that began
    nothing: the file was stored by a start after it, and the first upload stayed in the bucket (billed), named
    nowhere. It is named with the `modelfs cleanup --key` that removes it."""
    bucket = new_bucket(moto_server)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS,
                     allowed=(r"will not be stored", r"may have begun", r"cut short", r"parse")) as m:
        cut = proxy.inject(Fault.SHORT, after_bytes=60, op="start", times=1)
        data = random_bytes(13 * MiB, 27)
        (mountpoint / "a.bin").write_bytes(data)  # the file's next start goes through
        assert cut.hits == 1
        log = m.log()
    assert moto_server.client().get_object(Bucket=bucket, Key="a.bin")["Body"].read() == data
    assert uploads_in(moto_server, bucket) == ["a.bin"]
    advised = re.search(r"`(modelfs cleanup [^`]*--key a\.bin[^`]*)`", log)
    assert advised, "the upload left behind is named nowhere"
    done = run_modelfs(*shlex.split(advised[1])[1:], env=daemon_env(moto_server))
    assert done.returncode == 0 and uploads_in(moto_server, bucket) == [], done.stdout + done.stderr
    delete_bucket(moto_server, bucket)


def test_a_start_try_not_sent_past_its_deadline_names_no_upload(moto_server: S3Server,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A try of a start that its deadline stops before it is sent (botocore's retry after a SlowDown, its backoff
    past --read-timeout; here the first try) reached no server, yet was counted as one left unanswered: the failed
    file warned that an upload "may have begun" and named a `modelfs cleanup` that found nothing."""
    bucket = new_bucket(moto_server)
    uploads = _uploads_of(moto_server, bucket, monkeypatch)
    named: list[str] = []
    uploads.on_unknown_upload = named.append
    with pytest.raises(TimedOut):
        within(time.monotonic() - 1, uploads.start, "a.bin")
    assert named == [] and uploads_in(moto_server, bucket) == []
    delete_bucket(moto_server, bucket)


def test_a_rename_given_up_on_is_not_done_later_by_botocore_retrying_it(moto_server: S3Server, proxy: FaultProxy,
                                                                        mountpoint: Path) -> None:
    """A request given up on at --read-timeout went on in its abandoned thread: botocore kept trying it after its
    backoff, so a rename whose copy met 5xx answers past the deadline got EIO, and the copy landed seconds later, the
    file under both names with this mount showing only the old one (the fault fuzzer). No try of a write request
    begins after its deadline now: the rename either succeeds or leaves the new name empty for good."""
    bucket = new_bucket(moto_server)
    data = random_bytes(MiB, 24)
    put_objects(moto_server, bucket, {"a.bin": data})
    args = ("--writable", "--allow-delete", "--allow-overwrite", "--read-timeout", "2")
    with mounted_via(proxy, moto_server, bucket, mountpoint, *args, allowed=(r"timed out",)):
        (mountpoint / "a.bin").stat()
        # Four SlowDowns (throttling: botocore backs off 0-1, 0-2, 0-4, 0-8 s), then the copy would go through: its
        # fifth try comes past the 2 s deadline but about once in a hundred.
        refused = proxy.inject(Fault.ERROR, status=503, op="copy", times=4)
        try:
            os.rename(mountpoint / "a.bin", mountpoint / "b.bin")
            renamed = True
        except OSError as exc:
            assert exc.errno == errno.EIO
            renamed = False
        time.sleep(16)  # longer than any backoff left
        assert refused.hits >= 1
    keys = objects_in(moto_server, bucket)
    assert keys == (["b.bin"] if renamed else ["a.bin"]), f"renamed: {renamed}, the bucket: {keys}"
    delete_bucket(moto_server, bucket)


def test_a_rename_whose_copy_answer_is_cut_after_its_status_line_is_done(moto_server: S3Server, proxy: FaultProxy,
                                                                          mountpoint: Path) -> None:
    """CopyObject answered with its head cut after the status line (a 200 with no body: botocore parses it as an answer
    with nothing in it, and sends nothing again): the server had made the copy, the rename got EIO, and the bucket held
    the file under both names, the new one replaced (the write fault fuzzer, seed 3 with --allow-overwrite). A copy
    pinned to its source's version is the same done twice: sent once more, it gives the answer the rename needs."""
    bucket = new_bucket(moto_server)
    data, old = random_bytes(MiB, 26), random_bytes(3000, 27)
    put_objects(moto_server, bucket, {"a.bin": data, "b.bin": old})
    args = ("--writable", "--allow-delete", "--allow-overwrite", "--read-timeout", "5")
    with mounted_via(proxy, moto_server, bucket, mountpoint, *args):
        assert (mountpoint / "a.bin").stat().st_size == len(data) and (mountpoint / "b.bin").stat().st_size == 3000
        cut = proxy.inject(Fault.CUT_HEADERS, op="copy", times=1)
        os.rename(mountpoint / "a.bin", mountpoint / "b.bin")
        assert cut.hits == 1
        assert (mountpoint / "b.bin").read_bytes() == data and not (mountpoint / "a.bin").exists()
    assert objects_in(moto_server, bucket) == ["b.bin"]
    assert moto_server.client().get_object(Bucket=bucket, Key="b.bin")["Body"].read() == data
    delete_bucket(moto_server, bucket)


def test_a_create_only_rename_whose_completion_answer_is_cut_after_its_status_line_is_done(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """Without --allow-overwrite a rename copies in parts, create-only, and completes that upload: its answer cut after
    the status line (a 200 with no body: no ETag in it, which botocore does not send again), the server had made the
    copy, the rename got EIO, and the bucket held the file under both names (B163). A key that holds what the parts
    make (their multipart ETag) is the copy done, as a new file's close takes it. (An answer lost instead, botocore
    sends the completion again, which moto answers as the first: that passed before.)"""
    bucket = new_bucket(moto_server)
    data = random_bytes(MiB, 28)
    put_objects(moto_server, bucket, {"a.bin": data})
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--allow-delete", "--read-timeout", "5"):
        assert (mountpoint / "a.bin").stat().st_size == len(data)
        rule = proxy.inject(Fault.CUT_HEADERS, op="complete", times=1)
        os.rename(mountpoint / "a.bin", mountpoint / "c.bin")
        assert rule.hits == 1
        assert (mountpoint / "c.bin").read_bytes() == data and not (mountpoint / "a.bin").exists()
    assert objects_in(moto_server, bucket) == ["c.bin"]
    assert moto_server.client().get_object(Bucket=bucket, Key="c.bin")["Body"].read() == data
    delete_bucket(moto_server, bucket)


@pytest.mark.parametrize("what", ["empty-file", "directory"])
def test_a_rename_whose_put_of_an_empty_object_is_answered_cut_after_its_status_line_is_done(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, what: str) -> None:
    """A rename that PUTs an empty object at the new name, then deletes the old key: an empty file's, create-only
    (without --allow-overwrite: nothing to copy), or an empty directory's marker. Its answer cut after the status line
    (a 200 with no headers: no ETag, which botocore does not send again), the server had stored it, the rename got
    EIO, and the bucket held the file, or the directory, under both names (B164). An object with the empty body's ETag
    at the new name is the PUT done."""
    bucket = new_bucket(moto_server)
    old, new = ("a.bin", "c.bin") if what == "empty-file" else ("d/", "e/")
    put_objects(moto_server, bucket, {old: b""})
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--allow-delete", "--read-timeout", "5"):
        assert (mountpoint / old).exists()
        rule = proxy.inject(Fault.CUT_HEADERS, op="put", times=1)
        os.rename(mountpoint / old, mountpoint / new)
        assert rule.hits == 1
        assert (mountpoint / new).exists() and not (mountpoint / old).exists()
    assert objects_in(moto_server, bucket) == [new]
    delete_bucket(moto_server, bucket)


def test_an_upload_begun_after_its_start_was_given_up_on_is_named(moto_server: S3Server, proxy: FaultProxy,
                                                                 mountpoint: Path) -> None:
    """CreateMultipartUpload answered late (a slow server; here held by the proxy past --read-timeout, then
    forwarded): the file fails with EIO, and the upload the server then begins is one whose id never came back.
    It stayed in the bucket, named nowhere (the write fault fuzzer: a rename given up on). It is named now with the
    `modelfs cleanup --key` that removes it."""
    bucket = new_bucket(moto_server)
    args = ("--writable", "--write-part-size", "5M", "--read-timeout", "2")
    with mounted_via(proxy, moto_server, bucket, mountpoint, *args,
                     allowed=(r"will not be stored", r"may have begun", r"timed out")) as m:
        held = proxy.inject(Fault.STALL, seconds=4, op="start", times=1)
        with pytest.raises(OSError) as info:
            (mountpoint / "a.bin").write_bytes(random_bytes(13 * MiB, 25))
        assert info.value.errno == errno.EIO and held.hits == 1
        wait_for("the held start to reach the server", lambda: uploads_in(moto_server, bucket), timeout=15)
        log = m.log()
    assert objects_in(moto_server, bucket) == []
    advised = re.search(r"`(modelfs cleanup [^`]*--key a\.bin[^`]*)`", log)
    assert advised, "the upload left behind is named nowhere"
    done = run_modelfs(*shlex.split(advised[1])[1:], env=daemon_env(moto_server))
    assert done.returncode == 0 and uploads_in(moto_server, bucket) == [], done.stdout + done.stderr
    delete_bucket(moto_server, bucket)


@pytest.mark.parametrize("op", ["part", "part_copy"])
def test_a_part_whose_answer_is_cut_after_its_status_line_is_sent_again(s3: S3Server, mountpoint: Path,
                                                                        op: str) -> None:
    """UploadPart (a new file's part) or UploadPartCopy (a create-only rename's) answered with its head cut after the
    status line: a 200 with no ETag, which botocore does not send again. The server had stored the part, but the
    write failed with EIO at close, or the rename with EIO (B166). A part sent again under its number replaces the one
    stored: sent once more, it gives the ETag the completion needs. On moto and SeaweedFS (how each keeps a part sent
    twice is its own)."""
    bucket = new_bucket(s3)
    data = random_bytes(13 * MiB if op == "part" else MiB, 29)
    if op == "part_copy":
        put_objects(s3, bucket, {"a.bin": data})
    with FaultProxy(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, mountpoint, *WRITE_ARGS, "--allow-delete"):
        rule = proxy.inject(Fault.CUT_HEADERS, op=op, times=1)
        if op == "part":
            (mountpoint / "c.bin").write_bytes(data)
        else:
            assert (mountpoint / "a.bin").stat().st_size == len(data)
            os.rename(mountpoint / "a.bin", mountpoint / "c.bin")
        assert rule.hits == 1
        assert (mountpoint / "c.bin").read_bytes() == data and not (mountpoint / "a.bin").exists()
    assert objects_in(s3, bucket) == ["c.bin"]
    assert s3.client().get_object(Bucket=bucket, Key="c.bin")["Body"].read() == data
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_mkdir_whose_marker_put_is_answered_cut_after_its_status_line_is_done(s3: S3Server,
                                                                                 mountpoint: Path) -> None:
    """mkdir PUTs the directory's marker: its answer cut after the status line (a 200 with no ETag, which botocore does
    not send again), the server had stored it, but mkdir got EIO, and a second mkdir EEXIST (B167). An object with the
    empty body's ETag at the marker's key is the PUT done, as for a rename's (B164)."""
    bucket = new_bucket(s3)
    with FaultProxy(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, mountpoint, "--writable", "--read-timeout", "5"):
        rule = proxy.inject(Fault.CUT_HEADERS, op="put", times=1)
        (mountpoint / "d").mkdir()
        assert rule.hits == 1
        assert (mountpoint / "d").is_dir()
        (mountpoint / "d" / "a.bin").write_bytes(b"x")
    assert sorted(objects_in(s3, bucket)) == ["d/", "d/a.bin"]
    delete_bucket(s3, bucket)


def test_a_start_whose_answer_is_cut_after_its_status_line_is_sent_again(moto_server: S3Server, proxy: FaultProxy,
                                                                         mountpoint: Path) -> None:
    """CreateMultipartUpload answered with its head cut after the status line: a 200 with no UploadId, which botocore
    does not send again, and the file's write got EIO although nothing else had failed (B220). Sent once more, the
    file is stored; the upload the cut try began is named with the `modelfs cleanup --key` that removes it."""
    bucket = new_bucket(moto_server)
    data = random_bytes(13 * MiB, 30)
    with mounted_via(proxy, moto_server, bucket, mountpoint, *WRITE_ARGS, allowed=(r"may have begun",)) as m:
        cut = proxy.inject(Fault.CUT_HEADERS, op="start", times=1)
        (mountpoint / "a.bin").write_bytes(data)
        assert cut.hits == 1
        log = m.log()
    assert moto_server.client().get_object(Bucket=bucket, Key="a.bin")["Body"].read() == data
    assert uploads_in(moto_server, bucket) == ["a.bin"]  # the cut try's
    advised = re.search(r"`(modelfs cleanup [^`]*--key a\.bin[^`]*)`", log)
    assert advised, "the upload left behind is named nowhere"
    done = run_modelfs(*shlex.split(advised[1])[1:], env=daemon_env(moto_server))
    assert done.returncode == 0 and uploads_in(moto_server, bucket) == [], done.stdout + done.stderr
    delete_bucket(moto_server, bucket)


@pytest.mark.parametrize("second", ["past-the-deadline", "cut-too", "refused"])
def test_a_start_sent_again_after_a_cut_answer_keeps_its_deadline_and_names_the_cut_upload(
        moto_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, second: str) -> None:
    """The start sent again after a cut answer (B220): answered past the deadline, the second try is never sent
    (TimedOut, as any try past it); cut too, the start fails; its connection refused (a server restarting after
    the cut), the start is Unreachable, which `Writes.call` starts again: the cut upload was named nowhere (B222).
    Each way the upload the cut try began is named."""
    bucket = new_bucket(moto_server)
    uploads = _uploads_of(via(proxy, moto_server), bucket, monkeypatch)
    named: list[str] = []
    uploads.on_unknown_upload = named.append
    if second == "past-the-deadline":  # the cut answer comes 3 s after its status line: past the deadline
        # (2 s for the first try to be sent: on a loaded host a 0.5 s deadline could stop it before it was)
        cut = proxy.inject(Fault.CUT_HEADERS, seconds=3, op="start", times=1)
        with pytest.raises(TimedOut):
            within(time.monotonic() + 2, uploads.start, "a.bin")
        assert cut.hits == 1 and uploads_in(moto_server, bucket) == ["a.bin"]
    elif second == "cut-too":
        cut = proxy.inject(Fault.CUT_HEADERS, op="start", times=2)
        with pytest.raises(TransientError, match="cut short"):
            within(time.monotonic() + 10, uploads.start, "a.bin")
        assert cut.hits == 2 and uploads_in(moto_server, bucket) == ["a.bin", "a.bin"]
    if second == "refused":
        cut = proxy.inject(Fault.CUT_HEADERS, op="start", times=1)
        send = uploads._client.create_multipart_upload
        sent: list[str] = []

        def restarting(**kwargs: Any) -> Any:
            sent.append(kwargs["Key"])
            if len(sent) == 2:  # the server goes down after its cut answer, before the start is sent again
                proxy.origin_down(Down.REFUSE)
            return send(**kwargs)

        monkeypatch.setattr(uploads._client, "create_multipart_upload", restarting)
        try:
            with pytest.raises(Unreachable):
                within(time.monotonic() + 30, uploads.start, "a.bin")
        finally:
            proxy.origin_back()
        assert cut.hits == 1 and sent == ["a.bin", "a.bin"] and uploads_in(moto_server, bucket) == ["a.bin"]
    assert named == ["a.bin"]
    client = moto_server.client()
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ()):
        client.abort_multipart_upload(Bucket=bucket, Key="a.bin", UploadId=upload["UploadId"])
    delete_bucket(moto_server, bucket)


@pytest.mark.parametrize("fault,kind", [(Fault.CUT_HEADERS, "lists"), (Fault.DROP, "lists"),
                                        (Fault.CUT_HEADERS, "heads")])
def test_a_create_whose_probe_of_the_bucket_is_answered_cut_is_asked_again(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, fault: Fault, kind: str) -> None:
    """A create asks the bucket whether the name is free: a HEAD of it (create-only, as here), and a one-key listing
    of `name/` for a directory of that name (B45). That listing answered with its head cut after the status line (a
    200 with no listing in it, B125, which botocore does not send again) failed the create with EIO (B221): asked
    again now. A connection cut (botocore sends it again) and a HEAD cut so (a listing finds its size) passed."""
    bucket = new_bucket(moto_server)
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--read-timeout", "5"):
        assert os.listdir(mountpoint) == []  # the lookup of the new name is answered from this listing
        rule = proxy.inject(fault, kind=kind, times=1)
        (mountpoint / "a.bin").write_bytes(b"new bytes")
        assert rule.hits == 1
        assert (mountpoint / "a.bin").read_bytes() == b"new bytes"
    assert objects_in(moto_server, bucket) == ["a.bin"]
    delete_bucket(moto_server, bucket)


def test_a_start_answered_late_after_a_lost_answer_names_the_lost_one(moto_server: S3Server, proxy: FaultProxy,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """CreateMultipartUpload whose answer was lost (botocore sends it again) and whose second try is answered past
    the deadline: the late one's upload is aborted, and the lost answer's, begun all the same, was named nowhere
    (B223). It is named now."""
    bucket = new_bucket(moto_server)
    uploads = _uploads_of(via(proxy, moto_server), bucket, monkeypatch)
    named: list[str] = []
    uploads.on_unknown_upload = named.append
    lost = proxy.inject(Fault.DROP, op="start", times=1)
    held = proxy.inject(Fault.STALL, seconds=5, op="start", times=1)
    # 3 s for botocore's second try (its backoff is under 1 s) to be sent before the deadline, on a loaded host.
    with pytest.raises(TimedOut, match="answered after its deadline"):
        within(time.monotonic() + 3, uploads.start, "a.bin")
    assert lost.hits == 1 and held.hits == 1
    assert uploads_in(moto_server, bucket) == ["a.bin"]  # the lost answer's: the late one's is aborted
    assert named == ["a.bin"]
    client = moto_server.client()
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ()):
        client.abort_multipart_upload(Bucket=bucket, Key="a.bin", UploadId=upload["UploadId"])
    delete_bucket(moto_server, bucket)
