"""What an operator who runs modelfs for weeks does to a live mount: remove the cache by hand, rotate logs, read
its numbers. Each test is a defect such an operator hit."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import Fault, FaultProxy
from fsmount.writes import ABORT_TIMEOUT_S
from tests.helpers import (
    MiB,
    S3Server,
    bucket_with,
    daemon_env,
    free_port,
    mount_stats,
    mounted,
    mounted_at,
    random_bytes,
    run_modelfs,
    tmpfs,
    unmount,
    via,
    wait_for,
)
from tests.mount.test_cli_mount import daemon_pid


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def test_chunks_removed_by_hand_under_a_mount_are_no_longer_counted(s3: S3Server, mountpoint: Path,
                                                                   tmp_path: Path) -> None:
    """`rm -rf CACHE/chunks` to free the disk while mounted (`modelfs cache clear` refuses then): `modelfs stats` and
    `modelfs_disk_cache_used_bytes` went on saying the cache held the chunks, until each was read again or evicted.
    Readers get the bytes from the origin meanwhile, and the cache fills again, also after an `rm -rf CACHE`."""
    data = random_bytes(20 * MiB, seed=7)
    bucket = bucket_with(s3, {"m/a.bin": data, "b.bin": data[::-1]})
    cache, port = tmp_path / "cache", free_port()
    with mounted(s3, bucket, mountpoint, "--cache-dir", str(cache), "--metrics-addr", f"127.0.0.1:{port}"):
        assert (mountpoint / "m/a.bin").read_bytes() == data
        assert run_modelfs("prefetch", str(mountpoint / "m")).returncode == 0  # returns once the cache holds them
        assert mount_stats(mountpoint)["disk_cache"]["chunks"] == 3
        shutil.rmtree(cache / "chunks")
        wait_for("the chunks removed counted out", lambda: mount_stats(mountpoint)["disk_cache"],
                 lambda st: (st["chunks"], st["bytes_used"]) == (0, 0), timeout=20)
        assert metric(port, "modelfs_disk_cache_used_bytes") == 0
        assert metric(port, "modelfs_disk_cache_chunks") == 0
        # The whole cache dir (B56): made again by the next put, without a warning (`mounted` checks the log).
        shutil.rmtree(cache)
        assert (mountpoint / "b.bin").read_bytes() == data[::-1]
        assert run_modelfs("prefetch", str(mountpoint / "b.bin")).returncode == 0
        assert mount_stats(mountpoint)["disk_cache"]["chunks"] == 3 and len(list(cache.glob("chunks/*/*"))) == 3


def test_a_log_file_whose_directory_was_removed_does_not_take_the_mount_down(moto_server: S3Server, mountpoint: Path,
                                                                             tmp_path: Path) -> None:
    """`rm -rf` of the --log-file's directory (a cleanup, a tmpfs wiped): the next line logged, a reload's (SIGHUP)
    for one, raised from the log call, and the daemon died: every reader then got ENOTCONN. Now the lines are dropped
    (`test_log_file.py`: said once on stderr) and written again at the log's path once it can be opened."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--log-file",
                          str(logs / "modelfs.log"), "--log-level", "info", env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        pid = daemon_pid(mountpoint)
        shutil.rmtree(logs)
        for _ in range(2):
            os.kill(pid, signal.SIGHUP)  # logs a line
            assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        logs.mkdir()
        os.kill(pid, signal.SIGHUP)
        wait_for("a new log file", lambda: (logs / "modelfs.log").exists() and "received SIGHUP" in
                 (logs / "modelfs.log").read_text())
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        unmount(mountpoint)


def test_a_cache_dir_whose_disk_is_not_mounted_yet_is_retried_not_made_on_the_root_disk(
        moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """`--cache-dir /nvme/modelfs` started before /nvme was mounted: the mount made /nvme/modelfs on the disk below and
    filled it to --cache-size of that disk (B262). Now exit status 1 (the unit starts it again) until the directory the
    cache dir goes in is there, and nothing is made above the cache dir."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    nvme = tmp_path / "nvme"
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--cache-dir",
            str(nvme / "modelfs"))
    try:
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 1, res.stderr
        assert f"{nvme}, the directory it goes in, does not exist (a disk not mounted yet?)" in res.stderr, res.stderr
        assert not nvme.exists() and not mounted_at(mountpoint)
        nvme.mkdir()  # the disk is mounted
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        assert (nvme / "modelfs" / "chunks").is_dir()
    finally:
        unmount(mountpoint)


def test_a_missing_profile_is_retried_by_the_unit_and_mounts_once_it_appears(moto_server: S3Server, mountpoint: Path,
                                                                             tmp_path: Path) -> None:
    """The unit's choice for a `--profile` not (yet) in the credentials file: exit status 1, which
    `Restart=on-failure` starts again every RestartSec, not 2 (a setting only an edit mends, never retried). Credentials
    often arrive after boot (an agent writes them), and a start once they are there mounts without anyone's help."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    creds = tmp_path / "credentials"
    env = {k: v for k, v in daemon_env(moto_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(tmp_path / "config"))
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--profile", "models")
    try:
        res = run_modelfs(*args, env=env)
        assert res.returncode == 1 and "--profile models: the AWS configuration files are not there yet" in res.stderr
        assert str(creds) in res.stderr, res.stderr
        creds.write_text(f"[models]\naws_access_key_id = {moto_server.env['AWS_ACCESS_KEY_ID']}\n"
                         f"aws_secret_access_key = {moto_server.env['AWS_SECRET_ACCESS_KEY']}\n")
        res = run_modelfs(*args, env=env)
        assert res.returncode == 0, res.stderr
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        unmount(mountpoint)


def test_a_profile_missing_from_config_files_that_exist_is_refused_for_good(moto_server: S3Server, mountpoint: Path,
                                                                          tmp_path: Path) -> None:
    """B690: `--profile nosuch` with a credentials file that holds other profiles exited 1 ("The config profile
    (nosuch) could not be found"), which the unit started again every 5 s for good: only an edit mends it. Now exit 2
    (RestartPreventExitStatus), naming the profile and the files looked in; nothing is mounted."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {moto_server.env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {moto_server.env['AWS_SECRET_ACCESS_KEY']}\n")
    env = {k: v for k, v in daemon_env(moto_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(tmp_path / "config"))
    try:
        res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url,
                          "--profile", "nosuch", env=env)
        assert res.returncode == 2, res.stderr
        assert f"--profile nosuch: no such profile in {creds}" in res.stderr, res.stderr
        assert not mounted_at(mountpoint)
    finally:
        unmount(mountpoint)


def test_a_mount_after_a_lazy_unmount_says_what_still_holds_the_cache_dir(moto_server: S3Server, mountpoint: Path,
                                                                         tmp_path: Path) -> None:
    """`modelfs unmount` of a mount with a file open advises `--lazy`; the mount after it was refused with "in use by
    another modelfs mount: unmount it first", though it had just been unmounted: the detached mount's daemon serves
    the files still open, and holds the cache dir until they are closed. The refusal says so; once they are closed,
    the mount goes."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--cache-dir",
            str(tmp_path / "cache"))
    env = daemon_env(moto_server)
    try:
        assert run_modelfs(*args, env=env).returncode == 0
        pid = daemon_pid(mountpoint)
        with open(mountpoint / "a.bin", "rb") as reader:
            res = run_modelfs("unmount", str(mountpoint))
            assert res.returncode == 1 and "use --lazy" in res.stderr, res.stderr
            assert run_modelfs("unmount", "--lazy", str(mountpoint)).returncode == 0
            res = run_modelfs(*args, env=env)
            assert res.returncode == 1 and "a mount detached with `unmount --lazy` keeps its daemon, and the cache " \
                "dir, until the files open on it are closed" in res.stderr, res.stderr
            assert reader.read() == b"a" * 100  # still served
        wait_for("the detached mount's daemon gone", lambda: not os.path.exists(f"/proc/{pid}"))
        res = run_modelfs(*args, env=env)
        assert res.returncode == 0, res.stderr
    finally:
        unmount(mountpoint)


def test_prefetch_onto_a_full_cache_disk_does_not_say_it_warmed_it(moto_server: S3Server, mountpoint: Path,
                                                                  tmp_path: Path) -> None:
    """The cache disk filled by something else, after one chunk's write failed: writes pause 30 s (one warning), and
    every chunk fetched meanwhile is skipped. `modelfs prefetch` counted only the write errors, so it exited 0, the
    model "warmed", with nothing of it in the NVMe cache (an mmap loader started on that word then needs the origin
    after all). It fails now, naming the chunks not written; `modelfs stats` and Prometheus count them."""
    data = random_bytes(16 * MiB, seed=5)
    bucket = bucket_with(moto_server, {"a.bin": data[:8 * MiB], "m/b.bin": data})
    port = free_port()
    with tmpfs(tmp_path / "fs", "size=64m") as fs:
        with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(fs / "cache"), "--metrics-addr",
                     f"127.0.0.1:{port}", allowed=(r"disk cache .*: write failed",)):
            with open(fs / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
                while True:  # something else fills the cache's disk
                    filler.write(b"\0" * MiB)
            assert (mountpoint / "a.bin").read_bytes() == data[:8 * MiB]  # its chunk's write fails: writes pause
            wait_for("the failed write", lambda: mount_stats(mountpoint)["disk_cache"]["write_errors"],
                     lambda n: n == 1)
            res = run_modelfs("prefetch", str(mountpoint / "m"))
            assert res.returncode == 1 and "2 fetched chunks were not written to a cache level" in res.stderr, res
            assert mount_stats(mountpoint)["disk_cache"]["writes_skipped"] == 2
            assert metric(port, "modelfs_disk_cache_writes_skipped_total") == 2
            assert "2 not written (writes paused after a failure, or no room)" in \
                run_modelfs("stats", str(mountpoint)).stdout


# From a second stop signal to the daemon's exit: the session's end (bounded by a few seconds) and, with files open for
# writing, the uploads' abort (ABORT_TIMEOUT_S each, all at once); well under the grace a first stop gives.
CUT_EXIT_S = 3.0


def in_thread(fn, *args) -> tuple[threading.Thread, list[object]]:  # noqa: ANN001
    """`fn(*args)` in a daemon thread; the list gets its result or its OSError's errno."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except OSError as exc:
            out.append(exc.errno)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_second_sigterm_cuts_a_stop_short_saying_so(moto_server: S3Server, proxy: FaultProxy,
                                                      mountpoint: Path) -> None:
    """B692: a second SIGTERM while the daemon waited for a READ stalled on the origin (its stop's 5 s grace) was
    taken by nobody: the stop went on to its grace's end and exited 0; one during the drains after it ended the daemon
    at once (143) without a word. Now a second stop cuts the stop short: the READ ends now, the log says what was
    cut, the mount is gone, and the exit status is 1."""
    bucket = bucket_with(moto_server, {"stall.bin": random_bytes(2 * MiB, 3)})
    with mounted(via(proxy, moto_server), bucket, mountpoint, "--read-timeout", "90", "--chunk-size", "1M",
                 "--max-readahead", "0", "--no-model-prefetch", check_log=False) as m:
        fd = os.open(mountpoint / "stall.bin", os.O_RDONLY)
        try:
            proxy.inject(Fault.STALL, seconds=100)
            reader, got = in_thread(os.pread, fd, MiB, 0)
            reader.join(1.0)
            assert reader.is_alive()  # its READ waits on the stalled GET
            m.proc.send_signal(signal.SIGTERM)
            wait_for("the first stop", lambda: "received SIGTERM, unmounting with 1 file open" in m.log(), timeout=5)
            time.sleep(0.5)
            m.proc.send_signal(signal.SIGTERM)
            t = time.monotonic()
            try:
                m.proc.wait(CUT_EXIT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the daemon was still running {CUT_EXIT_S:g} s after a second SIGTERM")
            assert m.proc.returncode == 1, (m.proc.returncode, m.log()[-3000:])
            assert time.monotonic() - t < CUT_EXIT_S
            reader.join(5)
            assert not reader.is_alive() and isinstance(got[0], int), got
        finally:
            proxy.clear()
            with contextlib.suppress(OSError):
                os.close(fd)
    assert not mounted_at(mountpoint)
    log = m.log()
    assert "received SIGTERM while stopping: the stop is cut short, requests still in flight are cut short now" in log
    assert "(the stop was cut short: exit status 1)" in log


@pytest.mark.parametrize("closing", [True, False], ids=["close-in-flight", "file-held-open"])
def test_a_second_stop_during_a_writable_mount_s_stop_says_what_it_dropped(moto_server: S3Server, proxy: FaultProxy,
                                                                          mountpoint: Path, closing: bool) -> None:
    """B692: a person's second Ctrl-C while a writable mount's stop waited for a close storing a checkpoint (the
    origin stalled): swallowed, the stop waited out its 20 s grace. And a second stop during the uploads' abort (a
    file still held open, the loop over) ended the daemon at once (143), its upload left in the bucket without a
    word. Now it cuts the stop short: a close under way fails, the log names the file that may not be stored, the
    upload's abort is still tried (bounded) and one it could not abort is named for `modelfs cleanup`, the mount is
    gone, exit status 1."""
    bucket = bucket_with(moto_server, {"a.bin": b"a"})
    with mounted(via(proxy, moto_server), bucket, mountpoint, "--writable", "--write-part-size", "5M",
                 check_log=False) as m:
        fd = os.open(mountpoint / "ckpt.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, random_bytes(6 * MiB, 4))  # one part sent: an upload in flight
            proxy.inject(Fault.STALL, seconds=100, data_only=False)
            if closing:
                closer, got = in_thread(os.close, fd)
                closer.join(1.0)
                assert closer.is_alive()  # its FLUSH waits on the stalled upload
            m.proc.send_signal(signal.SIGTERM)
            wait_for("the first stop", lambda: "received SIGTERM, unmounting with 1 file open" in m.log(), timeout=5)
            if not closing:  # the loop is over: the stop is in the uploads' abort, which the stalled origin holds
                wait_for("the loop's end", lambda: "when the mount stopped" in m.log(), timeout=5)
            time.sleep(0.5)
            m.proc.send_signal(signal.SIGINT)
            bound = CUT_EXIT_S + ABORT_TIMEOUT_S
            try:
                m.proc.wait(bound)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the daemon was still running {bound:g} s after a second stop")
            assert m.proc.returncode == 1, (m.proc.returncode, m.log()[-3000:])
            if closing:
                closer.join(5)
                assert not closer.is_alive() and got and got[0] is not None, got  # the close failed
        finally:
            proxy.clear()
            if not closing:
                with contextlib.suppress(OSError):
                    os.close(fd)
    assert not mounted_at(mountpoint)
    log = m.log()
    assert "received SIGINT while stopping: the stop is cut short" in log, log[-3000:]
    if closing:
        assert "1 file open for writing may not be stored" in log, log[-3000:]
    # Its last part was under way (not stored), or its complete (the bucket may or may not hold it): said either way.
    assert re.search(r"ckpt\.bin was (being stored|still being written) when the mount stopped", log), log[-3000:]
    assert "the upload of ckpt.bin could not be aborted" in log and "modelfs cleanup" in log, log[-3000:]
    assert "(the stop was cut short: exit status 1)" in log


def test_a_cache_dir_the_daemon_may_not_write_is_refused_for_good(moto_server: S3Server, mountpoint: Path,
                                                                tmp_path: Path) -> None:
    """A cache dir refused for its permissions (here `chattr +i`, which root's CAP_DAC_OVERRIDE does not pass, as an
    NFS root_squash or another user's directory) exited 1, which the unit started again every 5 s for good: only an
    operator mends it (a chattr, a chmod, another path). Now exit 2, as a --log-file refused so, naming the cache dir;
    nothing is mounted, and it mounts once mended."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--cache-dir",
            str(disk / "modelfs"))
    if subprocess.run(["chattr", "+i", str(disk)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 2, res.stderr
        assert f"cannot use cache dir {disk / 'modelfs'}: Operation not permitted" in res.stderr, res.stderr
        assert not mounted_at(mountpoint) and not (disk / "modelfs").exists()
        subprocess.run(["chattr", "-i", str(disk)], check=True)
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        subprocess.run(["chattr", "-i", str(disk)], capture_output=True)
        unmount(mountpoint)


def test_a_cache_dir_with_a_lock_file_modelfs_did_not_write_is_refused_for_good(
        moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """`--cache-dir` given an existing folder with a `lock` of its own (an operator's file, a FIFO): the mount refused
    it ("is not a modelfs lock file ... move it away") with exit status 1, which the unit started again every 5 s for
    good: only an operator mends it. Now exit 2 (B1043); the file is left as it was, and the mount comes up once it
    is moved away."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    cache = tmp_path / "cache"
    cache.mkdir()
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--cache-dir", str(cache))
    try:
        for make in (lambda p: p.write_text("the operator's notes\n"), lambda p: os.mkfifo(p)):
            make(cache / "lock")
            res = run_modelfs(*args, env=daemon_env(moto_server))
            assert res.returncode == 2, res.stderr
            assert f"cannot use cache dir {cache}: {cache / 'lock'} is not a" in res.stderr, res.stderr
            assert not mounted_at(mountpoint)
            if (cache / "lock").is_fifo():
                os.unlink(cache / "lock")
            else:
                assert (cache / "lock").read_text() == "the operator's notes\n"
                (cache / "lock").rename(tmp_path / "notes")
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        unmount(mountpoint)
