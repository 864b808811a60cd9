"""The real command in a subprocess: help and version, and every fail-fast case with its message and exit
status; a background mount. Option parsing in-process is tests/unit/test_cli.py."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsmount import __version__
from fsmount.cli import user_name
from fsmount.data.disk_cache import DiskCache
from tests.helpers import (
    REPO,
    S3Server,
    bucket_with,
    daemon_env,
    free_port,
    modelfs_cmd,
    modelfs_env,
    mounted,
    mounted_at,
    new_bucket,
    not_an_s3_server,
    run_modelfs,
    tmpfs,
    unmount,
    wait_for,
)

FAIL_FAST_LIMIT = 20.0  # seconds; every pre-flight failure must come well within this


def daemons_for(mountpoint: Path) -> list[int]:
    """The pids of daemons started for `mountpoint` (their command lines name it and --foreground, as the
    background mount's daemon's does too)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.isdigit() and os.fsencode(mountpoint) in argv and b"--foreground" in argv:
            found.append(int(entry))
    return found


def test_version_and_help() -> None:
    res = run_modelfs("--version")
    assert res.returncode == 0 and __version__ in res.stdout
    res = run_modelfs("mount", "--help")
    assert res.returncode == 0 and "examples:" in res.stdout and "--endpoint-url" in res.stdout


def test_unknown_option_is_rejected() -> None:
    res = run_modelfs("b", "/tmp", "-o", "no_such_option=1")
    assert res.returncode == 2 and "unknown mount option 'no_such_option'" in res.stderr, res.stderr
    res = run_modelfs("mount", "b", "/tmp", "--no-such-option")
    assert res.returncode == 2 and "--no-such-option" in res.stderr, res.stderr


@pytest.mark.parametrize("args, message", [
    (("mount", "b", "MP", "--chunk-size", "banana"), "argument --chunk-size: invalid size 'banana'"),
    (("b", "MP", "-o", "chunk_size=banana"), "argument --chunk-size: invalid size 'banana'"),  # the fstab form
    (("mount", "b"), "required: mountpoint"),
    (("stats",), "required: mountpoint"),
    (("cache", "info", "MP"), "invalid choice: 'info'"),
    # B495: the OS's pick of a port was said in the daemon's log alone, and was another at each start.
    (("mount", "b", "MP", "--metrics-addr", "127.0.0.1:0"), "argument --metrics-addr: invalid --metrics-addr "
     "'127.0.0.1:0': port 0 would be a new port at each start, which Prometheus cannot be told: give a fixed port"),
    (("b", "MP", "-o", "metrics_addr=:0"), "invalid --metrics-addr ':0': port 0"),
])
def test_a_bad_argument_is_one_line_not_the_usage(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    """argparse printed the usage above the error: 36 lines for `modelfs mount`, in the journal for each bad
    value in a unit's MODELFS_OPTS."""
    res = run_modelfs(*(str(tmp_path) if a == "MP" else a for a in args))
    assert res.returncode == 2 and message in res.stderr and "--help" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_invalid_memory_limit_is_a_clear_error(tmp_path: Path) -> None:
    res = run_modelfs("mount", "b", str(tmp_path), "--memory-limit", "1M")
    assert res.returncode == 2 and "--memory-limit must be at least" in res.stderr


@pytest.mark.parametrize("args, message", [
    (("--uid", "-5"), "--uid and --gid must be >= 0"),
    (("--gid", "-1"), "--uid and --gid must be >= 0"),
    (("--read-timeout", "0"), "--read-timeout must be > 0"),
    (("--read-timeout", "-1"), "--read-timeout must be > 0"),
    (("--shared-cache-bucket", "t", "--shared-cache-wait", "inf"), "--shared-cache-wait must be >= 0"),
    (("--shared-cache-bucket", "t", "--shared-cache-wait", "nan"), "--shared-cache-wait must be >= 0"),
])
def test_values_the_daemon_cannot_use_are_refused_up_front(tmp_path: Path, args: tuple[str, ...],
                                                           message: str) -> None:
    """Each used to pass the CLI and kill the daemon with a traceback (or, in the background, with "run with
    --foreground to see why")."""
    res = run_modelfs("mount", "b", str(tmp_path), *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


# -- fail fast before mounting --------------------------------------------------------------------

def assert_fails(res: subprocess.CompletedProcess, message: str, started: float, code: int = 1) -> None:
    assert res.returncode == code, res
    assert message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # one clear line
    assert time.monotonic() - started < FAIL_FAST_LIMIT


def mount_fails_fast(bucket: str, path: Path, endpoint_url: str, env: dict[str, str],
                     message: str, *extra: str, code: int = 1) -> subprocess.CompletedProcess:
    """`modelfs mount` that must fail before mounting (assert_fails), timed from just before it starts."""
    t = time.monotonic()
    res = run_modelfs("mount", bucket, str(path), "--endpoint-url", endpoint_url, *extra, env=env)
    assert_fails(res, message, t, code)
    return res


def test_bucket_missing(moto_server: S3Server, tmp_path: Path) -> None:
    mount_fails_fast("no-such-bucket-here", tmp_path, moto_server.endpoint_url, daemon_env(moto_server),
                     "bucket 'no-such-bucket-here' does not exist")
    # The bucket put in the endpoint URL as well (a path there): the error says where to look.
    bucket = new_bucket(moto_server)
    mount_fails_fast("llama", tmp_path, f"{moto_server.endpoint_url}/{bucket}", daemon_env(moto_server),
                     f"(the endpoint URL has a path, /{bucket}: the bucket is the first argument")


def test_cleanup_says_what_is_wrong_with_the_endpoint_as_mount_does(moto_server: S3Server) -> None:
    """B230: `modelfs cleanup` given an endpoint that is not the S3 API (SeaweedFS's filer port for its S3 one), or
    one with the bucket in its path, said "listing uploads under '': not found", where `modelfs mount` of the same
    says what is wrong. It now says it as mount does; a bucket that is missing and a clean run are as before."""
    env = daemon_env(moto_server)
    for status in (404, 400):
        with not_an_s3_server(status) as url:
            res = run_modelfs("cleanup", "models", "--endpoint-url", url, "--dry-run", env=env)
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"{url} answered {status} without an S3 error: is it the S3 API" in res.stderr, res.stderr
    bucket = new_bucket(moto_server)
    for extra in ((), ("--key", "run1/a.bin")):
        res = run_modelfs("cleanup", "llama", "--endpoint-url", f"{moto_server.endpoint_url}/{bucket}", *extra,
                          env=env)
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"bucket 'llama' does not exist (the endpoint URL has a path, /{bucket}: the bucket is the first " \
               "argument" in res.stderr, res.stderr
    res = run_modelfs("cleanup", f"{bucket}-typo", "--endpoint-url", moto_server.endpoint_url, env=env)
    assert res.returncode == 1 and f"bucket '{bucket}-typo' does not exist" in res.stderr, res.stderr
    assert "(the endpoint URL has a path" not in res.stderr, res.stderr
    res = run_modelfs("cleanup", bucket, "--endpoint-url", moto_server.endpoint_url, "--dry-run", env=env)
    assert res.returncode == 0 and "0 incomplete uploads" in res.stdout and not res.stderr, res


@pytest.mark.seaweedfs
def test_access_denied(seaweed_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(seaweed_server)
    env = daemon_env(seaweed_server)
    env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret"
    res = mount_fails_fast(bucket, tmp_path, seaweed_server.endpoint_url, env, "access denied")
    assert "wrong-secret" not in res.stderr
    # Anonymous requests to a bucket that is not public: no credentials to check.
    mount_fails_fast(bucket, tmp_path, seaweed_server.endpoint_url, daemon_env(seaweed_server),
                     "refused an anonymous listing (--no-sign-request): it is not public", "--no-sign-request")


@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
def test_a_missing_profile_is_named(moto_server: S3Server, tmp_path: Path, foreground: bool) -> None:
    """A profile not in the AWS configuration (botocore's ProfileNotFound, once a failure nobody foresaw in
    pre-flight) reaches the user in one line, in the background too (it said only "the daemon exited with status
    1"); with none of the files there yet, exit 1 (B690)."""
    env = {**daemon_env(moto_server), "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    mp = tmp_path / "mnt"
    mp.mkdir()
    mount_fails_fast(new_bucket(moto_server), mp, moto_server.endpoint_url, env,
                     "--profile nope: the AWS configuration files are not there yet", "--profile", "nope",
                     *(["--foreground"] if foreground else []))
    mount_fails_fast(new_bucket(moto_server), mp, moto_server.endpoint_url, env,
                     "--shared-cache-profile nope: the AWS configuration files are not there yet",
                     "--shared-cache-bucket", "tier", "--shared-cache-profile", "nope",
                     *(["--foreground"] if foreground else []))


def test_endpoint_unreachable(tmp_path: Path) -> None:
    env = {**modelfs_env(), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    mount_fails_fast("b", tmp_path, f"http://127.0.0.1:{free_port()}", env, "cannot reach the endpoint")


def test_https_to_a_plain_http_endpoint_says_so(moto_server: S3Server, tmp_path: Path) -> None:
    """SeaweedFS's or MinIO's plain-HTTP port given as https:// failed with "SSL validation failed ... wrong version
    number", which does not say what to change."""
    url = moto_server.endpoint_url.replace("http://", "https://")
    mount_fails_fast("b", tmp_path, url, moto_server.env, "the endpoint does not answer in TLS: is it http://")


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_a_signal_during_a_slow_pre_flight_is_said_in_one_line(tmp_path: Path, signum: int) -> None:
    """A logrotate postrotate (or a systemd reload) while the endpoint is slow to answer: SIGHUP's default action
    killed the daemon without a word before its own handler existed; it is ignored, and the pre-flight fails on
    its own. A stop (systemctl stop: SIGTERM) then ended it with status 143 and no word either; now it says it
    was stopped."""
    env = {**modelfs_env(), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    with contextlib.ExitStack() as stack, socket.socket() as silent:  # takes connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen(modelfs_cmd("mount", "b", str(tmp_path), "--foreground", "--endpoint-url", endpoint,
                                            "--read-timeout", "4"), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            silent.settimeout(60)
            conn, _ = silent.accept()  # the pre-flight asks the endpoint: the daemon is past its imports
            stack.enter_context(conn)  # open, unanswered
            proc.send_signal(signum)
            started = time.monotonic()
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "modelfs:" in err and "Traceback" not in err, err
    if signum == signal.SIGTERM:
        # Ended by the signal, as systemd expects of a stop (an exit status of 1 left the unit failed).
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
        assert "stopped by SIGTERM before the mount was ready" in err, err
        assert time.monotonic() - started < 3, "a stop waited for the pre-flight"
    else:
        assert proc.returncode == 1, (proc.returncode, err)  # the pre-flight's own failure, said in one line


def test_a_stop_right_after_the_mount_was_made_unmounts_it(moto_server: S3Server, tmp_path: Path) -> None:
    """SIGTERM between the mount's creation and the daemon's own signal receiver (a systemd stop while it starts):
    the default action killed the daemon with its mount in place, and the mount point gave ENOTCONN until someone
    unmounted it. The stop is noted and done once the receiver is there. The signal is sent the moment the mount
    shows in mountinfo, which lands in that window some of the time; whenever it lands, nothing is left mounted."""
    bucket = bucket_with(moto_server, {"a.bin": b"x"})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for _ in range(4):
        proc = subprocess.Popen(modelfs_cmd("mount", bucket, str(mnt), "--foreground", "--endpoint-url",
                                            moto_server.endpoint_url), env=daemon_env(moto_server),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not mounted_at(mnt) and proc.poll() is None and time.monotonic() < deadline:
                pass
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            left = mounted_at(mnt)
            if left:
                subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
        assert not left, f"a mount was left behind: {err}"
        assert "Traceback" not in err, err


def test_a_foreground_daemon_started_with_stderr_closed_mounts_and_serves(moto_server: S3Server,
                                                                          tmp_path: Path) -> None:
    """A daemon started with descriptor 2 closed (`modelfs mount --foreground ... 2>&-`, a supervisor that closes
    it): the capture of fusermount3's lines around the mount (B181) flushed sys.stderr, which Python sets to None
    then, and the AttributeError ended the daemon before it mounted, its traceback going nowhere (B204)."""
    bucket = bucket_with(moto_server, {"a.bin": b"served"})
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    proc = subprocess.Popen(modelfs_cmd("mount", bucket, str(mnt), "--foreground", "--endpoint-url",
                                        moto_server.endpoint_url, "--log-file", str(log)),
                            env=daemon_env(moto_server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: os.close(2))
    try:
        wait_for("the mount", lambda: (mounted_at(mnt) and "mounted bucket" in log.read_text())
                 or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, log.read_text() if log.exists() else "no log"
        assert (mnt / "a.bin").read_bytes() == b"served"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert not mounted_at(mnt)
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted_at(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)


def test_a_foreground_daemon_whose_stderr_pipe_is_full_still_serves(moto_server: S3Server, tmp_path: Path) -> None:
    """`modelfs mount --foreground` as a pod's main process, its stderr the container runtime's log pipe, which the
    log collector reads when it gets to it. With the pipe full, the daemon's next log line (here a stray SIGUSR2's
    warning) blocked the trio loop in write(2): `stat` and `cat` in the mount hung, `/metrics` and `modelfs stats`
    did not answer, until someone read the pipe (B900). The line is dropped now, and said once the pipe has room."""
    bucket = bucket_with(moto_server, {"a.bin": b"served"})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen(modelfs_cmd("mount", bucket, str(mnt), "--foreground", "--endpoint-url",
                                        moto_server.endpoint_url, "--log-level", "info"),
                            env=daemon_env(moto_server), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = b""

    def drain() -> None:
        nonlocal err
        os.set_blocking(proc.stderr.fileno(), False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(proc.stderr.fileno(), 1 << 16):
                err += chunk

    try:
        wait_for("the mount", lambda: mounted_at(mnt) or proc.poll() is not None, timeout=60)
        assert proc.poll() is None
        drain()
        filler = os.open(f"/proc/{proc.pid}/fd/2", os.O_WRONLY | os.O_NONBLOCK)  # what an unread log fills
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(filler, b"#" * 4096)
        os.close(filler)
        proc.send_signal(signal.SIGUSR2)  # one warning line, logged from the loop
        time.sleep(1)
        res = subprocess.run(["timeout", "10", "cat", str(mnt / "a.bin")], capture_output=True, check=False)
        drain()  # the old daemon, blocked: this lets it go on, so that it stops
        assert (res.returncode, res.stdout) == (0, b"served"), "a full stderr pipe hung the mount"
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        drain()
        assert proc.returncode == 0, err[-2000:]
        assert re.search(rb"modelfs: [1-9][0-9]* log line\(s\) dropped: stderr \(a pipe\) was full\n", err), err[-2000:]
    finally:
        if proc.poll() is None:
            drain()
            proc.kill()
            proc.wait()
        if mounted_at(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)


def test_mountpoint_problems(moto_server: S3Server, tmp_path: Path) -> None:
    """README: `modelfs mount` exits 2 where only an operator mends it, 1 where starting again may. A MOUNTPOINT that
    files were written into while nothing was mounted there, or a file at that path, exited 1: the systemd unit
    started the mount again every RestartSec for good, one error line each time (B1060). One not there yet (a disk
    that mounts later, another unit that makes it) may come: 1; so may the directory a symlink there points to, which
    B1060 made "is not a directory", 2, for good (B1160)."""
    bucket = new_bucket(moto_server)
    afile = tmp_path / "file"
    afile.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "disk" / "models")
    cases = [(tmp_path / "missing", "does not exist", 1), (afile, "is not a directory", 2),
             (full, "is not empty (use --allow-non-empty", 2),
             (link, f"does not exist (a symlink to {tmp_path / 'disk' / 'models'})", 1)]
    try:
        for path, message, code in cases:
            for foreground in ((), ("--foreground",)):
                mount_fails_fast(bucket, path, moto_server.endpoint_url, daemon_env(moto_server), message,
                                 *foreground, code=code)
    finally:
        unmount(full)
    assert (full / "something").read_text() == "x" and afile.read_text() == "x"  # nothing lost


def test_no_fusermount3(moto_server: S3Server, tmp_path: Path) -> None:
    """Only installing fuse3 mends it: exit status 2, not 1, which a unit started again every RestartSec (B1082)."""
    env = daemon_env(moto_server)
    env["PATH"] = "/nonexistent"
    mount_fails_fast(new_bucket(moto_server), tmp_path, moto_server.endpoint_url, env, "fusermount3 not found", code=2)


def test_no_dev_fuse(moto_server: S3Server, tmp_path: Path) -> None:
    """A /dev/fuse that is not the FUSE device (or none, once the unit has loaded the fuse module) exits 2 (B1082)."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to hide /dev/fuse")
    bucket = new_bucket(moto_server)
    inner = " ".join(["mount --bind /dev/null /dev/fuse &&", *modelfs_cmd("mount", bucket, str(tmp_path),
                                                                              "--endpoint-url",
                                                                              moto_server.endpoint_url)])
    t = time.monotonic()
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                         capture_output=True, text=True, timeout=60, env=daemon_env(moto_server))
    assert_fails(res, "/dev/fuse is not the FUSE device", t, 2)


def test_a_writable_mount_whose_cache_dir_holds_a_writes_file_exits_2(moto_server: S3Server, tmp_path: Path) -> None:
    """A --writable mount refuses a cache dir whose writes/ is a file: it exited 1, and a unit started it again every
    RestartSec for good, though only moving that file (or another cache dir) mends it. It exits 2 (B1083)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "writes").write_text("not a directory")
    mp = tmp_path / "mnt"
    mp.mkdir()
    mount_fails_fast(new_bucket(moto_server), mp, moto_server.endpoint_url, daemon_env(moto_server),
                     f"{cache / 'writes'} is not a directory of its own", "--writable", "--cache-dir", str(cache),
                     code=2)
    assert (cache / "writes").read_text() == "not a directory" and not mounted_at(mp)


def test_background_mount_returns_when_ready_and_unmount(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="hello.txt", Body=b"hi")
    mp = tmp_path / "mnt"
    mp.mkdir()
    log = tmp_path / "daemon.log"
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                          "--log-file", str(log), env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        assert os.path.ismount(mp)  # already mounted when the command returns
        assert (mp / "hello.txt").read_bytes() == b"hi"
        res = run_modelfs("unmount", str(mp / "missing"))  # said "inside the modelfs mount" (B339)
        assert (res.returncode, res.stderr) == (1, f"modelfs: {mp}/missing does not exist\n"), res.stderr
        link = tmp_path / "models"
        link.symlink_to(mp)
        res = run_modelfs("unmount", str(link))  # the mountpoint through a symlink to it
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(mp)
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 1 and "is not mounted" in res.stderr
        res = run_modelfs("unmount", str(tmp_path / "missing"))
        assert res.returncode == 1 and "does not exist" in res.stderr
    finally:
        unmount(mp)
    assert "mounted bucket" in log.read_text()


def test_unmount_of_a_busy_mount_names_what_holds_it(moto_server: S3Server, tmp_path: Path) -> None:
    """`modelfs unmount` of a mount that a shell had `cd`'d into said "files are open: close them or use --lazy", with
    no file open anywhere: the user was sent looking for files. It names the processes that hold it, and how (B144)."""
    bucket = bucket_with(moto_server, {"m/model.bin": b"x" * 4096})
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                          "--log-file", str(tmp_path / "daemon.log"), env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        in_it = subprocess.Popen(["sleep", "60"], cwd=mp / "m")
        reader = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                                   "print('open', flush=True); time.sleep(60)", str(mp / "m" / "model.bin")],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout is not None and reader.stdout.readline() == "open\n"
            res = run_modelfs("unmount", str(mp))
            assert res.returncode == 1, res.stderr
            assert f"in use by sleep (pid {in_it.pid}: working directory), " in res.stderr, res.stderr
            assert f"(pid {reader.pid}: 1 open file)" in res.stderr, res.stderr
            assert "files are open" not in res.stderr
        finally:
            for proc in (in_it, reader):
                proc.kill()
                proc.wait()
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 0, res.stderr
    finally:
        unmount(mp)


def test_unmount_of_a_busy_mount_names_only_what_holds_it(moto_server: S3Server, tmp_path: Path) -> None:
    """A shell whose working directory was the mountpoint's own directory before the mount (`cd /models; modelfs
    mount BUCKET /models`) shows the same path in /proc and does not hold the mount: the busy unmount named it
    among the holders, and told the user to stop it. Holders are told by the mount they hold, not by a path (a
    mapping by the mount's device). All of it without asking the daemon: it is stopped."""
    bucket = bucket_with(moto_server, {"m/model.bin": b"x" * 8192})
    mp = tmp_path / "mnt"
    mp.mkdir()
    beneath = subprocess.Popen(["sleep", "60"], cwd=mp)
    procs = [beneath]
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                          "--log-file", str(tmp_path / "daemon.log"), env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        in_it = subprocess.Popen(["sleep", "60"], cwd=mp / "m")
        procs.append(in_it)
        mapper = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
                                   "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); f.close(); m[0]; "  # keeps a dup
                                   "print('mapped', flush=True); time.sleep(60)", str(mp / "m" / "model.bin")],
                                  stdout=subprocess.PIPE, text=True)
        procs.append(mapper)
        assert mapper.stdout is not None and mapper.stdout.readline() == "mapped\n"
        daemon = daemon_pid(mp)
        os.kill(daemon, signal.SIGSTOP)
        try:
            res = run_modelfs("unmount", str(mp), timeout=20)
        finally:
            os.kill(daemon, signal.SIGCONT)
        assert res.returncode == 1, res.stderr
        assert f"sleep (pid {in_it.pid}: working directory)" in res.stderr, res.stderr
        assert f"(pid {mapper.pid}: 1 open file, mapped files)" in res.stderr, res.stderr
        assert f"pid {beneath.pid}" not in res.stderr, res.stderr
        for proc in procs[1:]:
            proc.kill()
            proc.wait()
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 0, res.stderr
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        unmount(mp)


def test_unmount_of_a_mount_with_a_mount_inside_says_so(moto_server: S3Server, tmp_path: Path) -> None:
    """A mount made on a directory of the mount (another file system over one of its directories) keeps it busy
    with no process using it: the busy unmount spoke of open files and working directories, and named nothing. It
    names the mount inside, and still the processes using the mount."""
    bucket = bucket_with(moto_server, {"m/model.bin": b"x" * 4096})
    mp = tmp_path / "mnt"
    mp.mkdir()
    in_it = None
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                          "--log-file", str(tmp_path / "daemon.log"), env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mp / "m")], check=True)
        try:
            res = run_modelfs("unmount", str(mp))
            assert res.returncode == 1, res.stderr
            assert f"(a mount inside it: {mp / 'm'} (tmpfs): unmount it first, or use --lazy)" in res.stderr, \
                res.stderr
            in_it = subprocess.Popen(["sleep", "60"], cwd=mp)
            res = run_modelfs("unmount", str(mp))
            assert res.returncode == 1, res.stderr
            assert f"(in use by sleep (pid {in_it.pid}: working directory); a mount inside it: {mp / 'm'} (tmpfs): " \
                "stop them, or leave the mount, or unmount it first, or use --lazy)" in res.stderr, res.stderr
        finally:
            subprocess.run(["umount", str(mp / "m")], check=True)
        in_it.kill()
        in_it.wait()
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 0, res.stderr
    finally:
        if in_it is not None:
            in_it.kill()
            in_it.wait()
        unmount(mp)


def test_unmount_leaves_a_mount_that_is_not_modelfs_alone(tmp_path: Path) -> None:
    """fusermount3, run as root, unmounts whatever is mounted there: `modelfs unmount /data` by mistake took a
    disk away. Only a modelfs mount is unmounted."""
    other = tmp_path / "tmpfs"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(other)], check=True)
    try:
        res = run_modelfs("unmount", str(other))
        assert res.returncode == 1 and "is a tmpfs mount, not a modelfs one: left mounted" in res.stderr, res.stderr
        assert os.path.ismount(other)
    finally:
        subprocess.run(["umount", str(other)], check=True)
    # A type that begins with a vowel is said with "an" ("/ is a ext4 mount").
    layers = {name: tmp_path / name for name in ("lower", "upper", "work", "overlay")}
    for path in layers.values():
        path.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={layers['lower']},upperdir={layers['upper']},"
                    f"workdir={layers['work']}", str(layers["overlay"])], check=True)
    try:
        res = run_modelfs("unmount", str(layers["overlay"]))
        assert res.returncode == 1 and "is an overlay mount, not a modelfs one" in res.stderr, res.stderr
    finally:
        subprocess.run(["umount", str(layers["overlay"])], check=True)


def test_a_prefix_that_matches_nothing_is_named_at_mount(s3: S3Server, tmp_path: Path) -> None:
    """`--prefix lama/` for `llama/`: an empty tree, which looks like an empty model directory; the mount warns, and
    says so where the prefix names a file. Read-only only: a writable mount's new prefix is empty by nature. So is
    virtual addressing that cannot be."""
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="llama/config.json", Body=b"{}")
    mp = tmp_path / "mnt"
    warning = "no key in bucket .* starts with 'lama/'"
    with mounted(s3, bucket, mp, "--prefix", "lama/", allowed=(warning,)) as m:
        assert os.listdir(mp) == []
    assert "starts with 'lama/': the mount is empty (is --prefix right?)" in m.log()
    # A prefix naming a file (B491): the warning says the key is a file, not only that nothing starts with 'key/'.
    warning = "no key in bucket .* starts with 'llama/config.json/'"
    with mounted(s3, bucket, mp, "--prefix", "llama/config.json", allowed=(warning,)) as m:
        assert os.listdir(mp) == []
    assert "starts with 'llama/config.json/': the mount is empty ('llama/config.json' is a file: --prefix names a " \
        "directory, such as the one it is in)" in m.log(), m.log()
    for flags in (("--prefix", "llama/"), ("--prefix", "new-run/", "--writable")):
        with mounted(s3, bucket, mp, *flags) as m:  # the log check fails the test on any warning
            os.listdir(mp)
    # In the background the warning went only to the daemon's log; `modelfs mount` prints it too.
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", s3.endpoint_url, "--prefix", "lama/",
                          "--log-file", str(tmp_path / "bg.log"), env=daemon_env(s3))
        assert res.returncode == 0 and os.path.ismount(mp), res.stderr
        assert "modelfs: warning: no key in bucket" in res.stderr and "starts with 'lama/'" in res.stderr, res.stderr
    finally:
        unmount(mp)
    # The test servers listen on 127.0.0.1: botocore uses path style there whatever is asked, and the mount says so.
    warning = "--addressing-style virtual: 127.0.0.1 is an IP address"
    with mounted(s3, bucket, mp, "--prefix", "llama/", "--addressing-style", "virtual", allowed=(warning,)) as m:
        assert os.listdir(mp) == ["config.json"]
    assert warning in m.log()


def test_python_m_entry_point() -> None:
    res = subprocess.run([sys.executable, "-m", "fsmount", "--version"], capture_output=True, text=True,
                         cwd=REPO)
    assert res.returncode == 0


def test_a_mount_whose_daemon_was_killed_is_named_so_and_unmounts(moto_server: S3Server, tmp_path: Path) -> None:
    """After kill -9 (or the OOM killer) the mountpoint answers ENOTCONN until it is unmounted: `modelfs
    unmount` undoes it, and `mount` and `prefetch` say what is wrong instead of "does not exist"."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="w.bin", Body=b"w" * 1000)
    mp = tmp_path / "mnt"
    with mounted(moto_server, bucket, mp, check_log=False) as m:
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
        prefetch = run_modelfs("prefetch", str(mp))
        assert prefetch.returncode != 0 and "daemon of its mount is gone" in prefetch.stderr, prefetch.stderr
        stats = run_modelfs("stats", str(mp))
        assert stats.returncode == 1 and f"is gone (transport endpoint is not connected); its counters went with " \
            f"it: run `modelfs unmount {mp}`" in stats.stderr, stats.stderr
        again = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                            env=daemon_env(moto_server))
        assert again.returncode == 1 and "its daemon is gone" in again.stderr, again.stderr
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(mp) and mp.is_dir()
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                          env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        assert (mp / "w.bin").read_bytes() == b"w" * 1000


def test_unmount_stale_clears_only_a_dead_mount_and_names_a_live_one(moto_server: S3Server, tmp_path: Path) -> None:
    """The unit's ExecStartPre was `-modelfs unmount --lazy MOUNTPOINT`: at every clean start it logged "is not
    mounted", and a live mount made by hand at the mountpoint was detached under its users' feet. `--stale` says
    nothing where nothing is mounted, leaves a live mount mounted naming its bucket and daemon, and clears a dead one
    (its daemon killed) (B336)."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="w.bin", Body=b"w" * 1000)
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = run_modelfs("unmount", "--stale", str(mp))
    assert (res.returncode, res.stderr) == (0, ""), res.stderr  # a clean start: nothing to say
    with mounted(moto_server, bucket, mp, check_log=False) as m:
        with open(mp / "w.bin", "rb") as held:  # a user of the live mount
            res = run_modelfs("unmount", "--stale", str(mp))
            assert res.returncode == 0, res.stderr  # the unit's start goes on: `modelfs mount` refuses it (B391)
            assert res.stderr == (f"modelfs: {mp} is a live modelfs mount (bucket {bucket}, daemon pid {m.proc.pid}, "
                                  f"mounted by {user_name(os.getuid())}): left mounted; unmount it (modelfs "
                                  f"unmount {mp}) or stop its daemon first\n"), res.stderr
            assert mounted_at(mp) and held.read() == b"w" * 1000
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
        res = run_modelfs("unmount", "--stale", str(mp))
        assert (res.returncode, res.stderr) == (0, f"modelfs: cleared the dead mount at {mp} (its daemon was "
                                                   "gone)\n"), res.stderr
        assert not mounted_at(mp) and mp.is_dir()


def test_a_mount_over_a_live_mount_exits_2_and_leaves_it_serving(moto_server: S3Server, tmp_path: Path) -> None:
    """The systemd unit at a MOUNTPOINT where a modelfs mount made by hand answered: its ExecStartPre `unmount
    --stale` refused it with exit 1, and systemd started the unit again every RestartSec for as long as that mount
    stayed (RestartPreventExitStatus counts ExecStart's status only). Now `--stale` names it and exits 0, and
    `modelfs mount` (the unit's ExecStart, --foreground; and a background one by hand) refuses the mountpoint with
    exit 2, which the unit does not restart on; the live mount keeps serving its open file (B391)."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="w.bin", Body=b"w" * 1000)
    mp = tmp_path / "mnt"
    with mounted(moto_server, bucket, mp, check_log=False) as m, open(mp / "w.bin", "rb") as held:
        res = run_modelfs("unmount", "--stale", str(mp))
        assert res.returncode == 0 and f"is a live modelfs mount (bucket {bucket}, daemon pid {m.proc.pid}" \
            in res.stderr, res.stderr
        for foreground in (("--foreground",), ()):
            t = time.monotonic()
            res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url, *foreground,
                              env=daemon_env(moto_server), timeout=FAIL_FAST_LIMIT)
            assert res.returncode == 2, (foreground, res.returncode, res.stderr)
            assert f"modelfs: mountpoint {mp} already holds a live modelfs mount: left mounted; unmount it first " \
                f"(modelfs unmount {mp}), or mount elsewhere\n" in res.stderr, res.stderr
            assert time.monotonic() - t < FAIL_FAST_LIMIT
        assert Path("/proc/self/mountinfo").read_text().count(f" {mp} ") == 1 and m.proc.poll() is None
        assert held.read() == b"w" * 1000 and (mp / "w.bin").read_bytes() == b"w" * 1000


def test_a_mount_over_another_file_system_s_mount_exits_2_naming_its_type(moto_server: S3Server,
                                                                          tmp_path: Path) -> None:
    """The systemd unit at a MOUNTPOINT where another file system is mounted (a disk, a tmpfs): `unmount --stale`
    leaves it and the start goes on, and `modelfs mount` said "is already a mount point" with exit 1, so the unit
    was started again every RestartSec for good. Only an operator mends it: exit 2, naming the type (B490), that of
    the mount on top (B510)."""
    bucket = new_bucket(moto_server)
    moved = tmp_path / "moved"
    moved.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(moved)], check=True)  # made first: listed before the tmpfs
    try:
        with tmpfs(tmp_path / "mnt", "size=1M") as mp:
            assert run_modelfs("unmount", "--stale", str(mp)).returncode == 0
            for foreground in (("--foreground",), ()):
                t = time.monotonic()
                res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url, *foreground,
                                  env=daemon_env(moto_server), timeout=FAIL_FAST_LIMIT)
                assert res.returncode == 2, (foreground, res.returncode, res.stderr)
                assert res.stderr == f"modelfs: mountpoint {mp} already holds a tmpfs mount, not a modelfs one: " \
                    "left mounted; unmount it first, or mount elsewhere\n", res.stderr
                assert time.monotonic() - t < FAIL_FAST_LIMIT
            assert Path("/proc/self/mountinfo").read_text().count(f" {mp} ") == 1
            if subprocess.run(["mount", "--move", str(moved), str(mp)], check=False).returncode != 0:
                pytest.skip("mount --move refused here (a shared parent mount)")
            try:  # the ramfs now on top of the tmpfs, and still listed before it
                res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                                  env=daemon_env(moto_server), timeout=FAIL_FAST_LIMIT)
                assert res.returncode == 2 and "already holds a ramfs mount, not" in res.stderr, res.stderr
            finally:
                subprocess.run(["umount", str(mp)], check=True)
    finally:
        if os.path.ismount(moved):  # the move was refused
            subprocess.run(["umount", str(moved)], check=True)


def test_a_mount_over_a_stopped_daemon_s_mount_says_so_and_does_not_hang(moto_server: S3Server,
                                                                          tmp_path: Path) -> None:
    """`modelfs mount` at a mountpoint whose modelfs daemon is stopped (SIGSTOP, a debugger) or hung: its pre-flight
    asked that daemon (statfs, then a stat of the mountpoint and the stats attribute that tells a live mount, B391)
    with no bound, and waited in the kernel for good, SIGINT or not. It says so within 5 s, exit 1, and leaves that
    mount mounted (B460)."""
    bucket = new_bucket(moto_server)
    mp = tmp_path / "mnt"
    # --metadata-ttl 0: the kernel keeps no attributes of the root, so every stat of it asks the daemon.
    with mounted(moto_server, bucket, mp, "--metadata-ttl", "0", check_log=False) as m:
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            for foreground in (("--foreground",), ()):
                started = time.monotonic()
                res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url, *foreground,
                                  env=daemon_env(moto_server), timeout=FAIL_FAST_LIMIT)
                assert res.returncode == 1, (foreground, res.returncode, res.stderr)
                assert f"modelfs: mountpoint {mp} is a modelfs mount whose daemon does not answer within 5s " \
                    f"(stopped or hung, not gone): left mounted; stop that daemon, or `modelfs unmount --lazy {mp}`\n" \
                    in res.stderr, res.stderr
                assert time.monotonic() - started < 15
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        assert Path("/proc/self/mountinfo").read_text().count(f" {mp} ") == 1 and m.proc.poll() is None


# A daemon of an older modelfs: one with no stats attribute (this checkout's, its attribute renamed before the
# daemon's modules take its name). Run before `python -m fsmount ...`: the argv after the first three is the command's.
OLDER_DAEMON = ("import runpy, sys; import fsmount.stats; fsmount.stats.STATS_XATTR = b'user.modelfs.older'; "
                "sys.argv = ['fsmount', *sys.argv[4:]]; runpy.run_module('fsmount', run_name='__main__')")


def test_a_mount_over_an_older_modelfs_daemon_s_live_mount_exits_2_naming_it(moto_server: S3Server,
                                                                            tmp_path: Path) -> None:
    """A live mount of an older modelfs, whose daemon has no stats attribute (what tells a live modelfs mount, B391),
    at the mountpoint: `unmount --stale` leaves it (it answers), and `modelfs mount` said it held "a fuse.modelfs
    mount, not a modelfs one". It says what it is: a live mount of an older modelfs, exit 2, left mounted (B553)."""
    bucket = new_bucket(moto_server)
    mp = tmp_path / "mnt"
    with mounted(moto_server, bucket, mp, wrap=(sys.executable, "-c", OLDER_DAEMON)) as m:
        with pytest.raises(OSError):
            os.getxattr(mp, "user.modelfs.stats")
        res = run_modelfs("unmount", "--stale", str(mp))
        assert res.returncode == 0 and "is a live modelfs mount" in res.stderr, res.stderr
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url, "--foreground",
                          env=daemon_env(moto_server), timeout=FAIL_FAST_LIMIT)
        assert res.returncode == 2, (res.returncode, res.stderr)
        assert res.stderr == f"modelfs: mountpoint {mp} already holds a live modelfs mount whose daemon is of an " \
            f"older modelfs (it has no stats attribute): left mounted; unmount it first (modelfs unmount {mp}), or " \
            "mount elsewhere\n", res.stderr
        assert Path("/proc/self/mountinfo").read_text().count(f" {mp} ") == 1 and m.proc.poll() is None


def test_a_mount_inside_another_modelfs_mount_is_refused_naming_it(moto_server: S3Server, tmp_path: Path) -> None:
    """`modelfs mount` at a directory of another modelfs mount (/models/sub of /models) mounted there: that mount kept
    the outer one busy, so `modelfs unmount /models` failed and its unit's restart with it. Refused, exit 2, naming
    the outer mount; `unmount --stale` there (the unit's start) says there is nothing to clear and lets it go on
    (B552)."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="sub/w.bin", Body=b"w")
    mp = tmp_path / "mnt"
    with mounted(moto_server, bucket, mp):
        inner = mp / "sub"
        res = run_modelfs("unmount", "--stale", str(inner))
        assert res.returncode == 0 and f"inside the modelfs mount at {mp}: nothing to clear" in res.stderr, res.stderr
        for foreground in (("--foreground",), ()):
            try:  # the old code mounted there: in the foreground until the timeout, which kills it
                res = run_modelfs("mount", bucket, str(inner), "--endpoint-url", moto_server.endpoint_url, *foreground,
                                  "--allow-non-empty", env=daemon_env(moto_server), timeout=FAIL_FAST_LIMIT)
                assert res.returncode == 2, (foreground, res.returncode, res.stderr)
                assert f"modelfs: mountpoint {inner} is inside the modelfs mount at {mp}: a mount there would keep " \
                    f"that one busy (`modelfs unmount {mp}` and its restart would fail); mount elsewhere\n" \
                    in res.stderr, res.stderr
            finally:
                if f" {inner} " in Path("/proc/self/mountinfo").read_text():
                    subprocess.run(["umount", "-l", str(inner)], check=False)
        assert Path("/proc/self/mountinfo").read_text().count(f" {mp}") == 1


@pytest.mark.parametrize("lazy", [False, True], ids=["plain", "lazy"])
def test_a_mount_whose_daemon_is_stopped_unmounts_without_asking_it(moto_server: S3Server, tmp_path: Path,
                                                                    lazy: bool) -> None:
    """A daemon stopped (SIGSTOP, a debugger) or hung answers nothing: `modelfs unmount` stat'ed the mountpoint
    first, which waits in the kernel for the daemon's answer, and hung for good (SIGINT could not stop it).
    It finds the mount in /proc/self/mountinfo instead; once unmounted, the daemon, let go on, exits."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="w.bin", Body=b"w" * 1000)
    mp = tmp_path / "mnt"
    # --metadata-ttl 0: the kernel keeps no attributes of the root, so every stat of it asks the daemon.
    with mounted(moto_server, bucket, mp, "--metadata-ttl", "0", check_log=False) as m:
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            res = run_modelfs("unmount", *(["--lazy"] if lazy else []), str(mp), timeout=20)
            assert res.returncode == 0, res.stderr
            assert str(mp) not in Path("/proc/self/mountinfo").read_text()
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        m.proc.wait(30)


def test_unmount_through_a_symlink_to_a_stopped_daemon_s_mount_does_not_hang(moto_server: S3Server,
                                                                             tmp_path: Path) -> None:
    """A MOUNTPOINT given through a symlink (`/models -> /nvme/models`) was resolved with realpath, whose lstat of the
    mount's root waited for the daemon: of a stopped (or hung) one `modelfs unmount --stale`, the unit's start, hung
    for good (until TimeoutStartSec), as did a plain `modelfs unmount` and one of a path in the mount (B343)."""
    bucket = new_bucket(moto_server)
    mp = tmp_path / "mnt"
    link = tmp_path / "models"
    link.symlink_to(mp)
    # --metadata-ttl 0: the kernel keeps no attributes of the root, so every stat of it asks the daemon.
    with mounted(moto_server, bucket, mp, "--metadata-ttl", "0", check_log=False) as m:
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            res = run_modelfs("unmount", "--stale", str(link), timeout=20)
            assert res.returncode == 1 and "does not answer within 5s (stopped or hung" in res.stderr, res.stderr
            res = run_modelfs("unmount", str(link / "llama"), timeout=20)
            assert res.returncode == 1 and f"is inside the modelfs mount at {mp} " in res.stderr, res.stderr
            assert time.monotonic() - started < 15
            res = run_modelfs("unmount", str(link), timeout=20)
            assert res.returncode == 0, res.stderr
            assert not mounted_at(mp)
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        m.proc.wait(30)


def test_two_mounts_started_at_once_at_one_mountpoint_make_one_mount(moto_server: S3Server, tmp_path: Path) -> None:
    """Both found the mountpoint free and both mounted, one over the other (9 tries in 10): fstab and a systemd
    unit, or an init container and a sidecar, racing. The second is told the mountpoint is taken."""
    bucket = new_bucket(moto_server)
    mp = tmp_path / "mnt"
    mp.mkdir()
    cmd = modelfs_cmd("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url)
    for _ in range(3):
        procs = [subprocess.Popen(cmd, env=daemon_env(moto_server), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        try:
            results = [(p.wait(60), p.stderr.read() if p.stderr else "") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        mounts = Path("/proc/self/mountinfo").read_text().count(f" {mp} ")
        unmount(mp)
        while os.path.ismount(mp):
            unmount(mp)
        assert sorted(code for code, _ in results) in ([0, 1], [0, 2]) and mounts == 1, results
        err = next(err for code, err in results if code != 0)
        assert "is locked by another process (another modelfs mount of it starting?)" in err \
            or "already holds a live modelfs mount" in err, err


def test_a_background_mount_says_when_its_log_would_go_nowhere(moto_server: S3Server, tmp_path: Path) -> None:
    """Without --log-file the daemon logs to syslog; where there is none (most containers) its warnings
    were dropped without a word. The mount command now says so (and still mounts)."""
    bucket = new_bucket(moto_server)
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                          env=daemon_env(moto_server))
        assert res.returncode == 0 and os.path.ismount(mp), res.stderr
        assert ("there is no syslog here" in res.stderr) == (not os.path.exists("/dev/log")), res.stderr
    finally:
        unmount(mp)


def test_umount_is_unmount_and_a_closed_pipe_is_no_traceback(tmp_path: Path) -> None:
    """`modelfs umount` is an alias (it showed as "umount ==SUPPRESS==" in --help); output into a pipe whose
    reader is gone (`modelfs stats --json | head`) ends quietly with 141, not a BrokenPipeError traceback."""
    res = run_modelfs("umount", str(tmp_path))
    assert res.returncode == 1 and "is not mounted" in res.stderr
    help_text = run_modelfs("--help").stdout
    assert "unmount (umount)" in help_text and "SUPPRESS" not in help_text
    DiskCache(tmp_path / "cache", 1 << 30).close()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run(modelfs_cmd("cache", "stats", str(tmp_path / "cache")), stdout=write_end,
                             stderr=subprocess.PIPE, text=True, env=modelfs_env(), timeout=60)
    finally:
        os.close(write_end)
    assert res.returncode == 141 and "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


def test_cleanup_says_what_a_dry_run_would_do(tmp_path: Path) -> None:
    res = run_modelfs("cleanup", "b", "--older-than", "1d")
    assert res.returncode == 2 and "invalid age '1d': give seconds" in res.stderr
    # A profile that is not there: one line (it was botocore's ProfileNotFound traceback).
    env = {**modelfs_env(), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "AWS_CONFIG_FILE": str(tmp_path / "none")}
    res = run_modelfs("cleanup", "b", "--profile", "missing", "--endpoint-url", "http://127.0.0.1:9", env=env)
    assert res.returncode == 1 and "could not be found" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_cleanup_gives_a_silent_endpoint_a_minute_not_ten(monkeypatch: pytest.MonkeyPatch) -> None:
    """It used the daemon's request settings (120 s, four attempts): against an endpoint that never answers it
    ran ten minutes without a word. A command someone waits for gets 20 s per request and one retry."""
    import io

    from fsmount import cleanup_command
    from fsmount.config import StoreConfig

    built = []

    class Store:
        def __init__(self, cfg: StoreConfig, retries: int) -> None:
            built.append((cfg.read_timeout, cfg.connect_timeout, retries))
            raise RuntimeError("stop here")

    monkeypatch.setattr(cleanup_command, "Boto3Store", Store)
    with pytest.raises(cleanup_command.CleanupError, match="stop here"):
        cleanup_command.cleanup(StoreConfig(bucket="b"), 0, dry_run=True, out=io.StringIO())
    (read, connect, retries), = built
    assert read * (retries + 1) <= 60 and connect <= read


def daemon_pid(mountpoint: Path) -> int:
    """The pid of the (background) daemon serving `mountpoint`."""
    found = daemons_for(mountpoint)
    assert found, f"no daemon serves {mountpoint}"
    return found[0]


def test_sighup_keeps_the_mount_and_a_rotated_log_file_is_reopened(moto_server: S3Server, tmp_path: Path) -> None:
    """logrotate moves the log and sends SIGHUP (postrotate): the mount stays (SIGHUP unmounted it), and the
    daemon's next lines go to a new file at the log's path (they went to the moved file, or nowhere)."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="a.bin", Body=b"a" * 100)
    mp, log = tmp_path / "mnt", tmp_path / "modelfs.log"
    mp.mkdir()
    try:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url, "--log-file",
                          str(log), "--log-level", "info", env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        log.rename(tmp_path / "modelfs.log.1")
        os.kill(daemon_pid(mp), signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not (log.exists() and "received SIGHUP" in log.read_text()):
            assert time.monotonic() < deadline, "no new log file after the rotation"
            time.sleep(0.05)
        assert os.path.ismount(mp) and (mp / "a.bin").read_bytes() == b"a" * 100
        assert "mounted bucket" in (tmp_path / "modelfs.log.1").read_text()
        # A reload is not a reconfiguration, and says so.
        assert "the options are not read again (a restart of the mount applies a changed configuration)" in \
            log.read_text()
    finally:
        unmount(mp)


def test_mount_refuses_what_would_break_it_and_says_why(moto_server: S3Server, tmp_path: Path) -> None:
    """A cache dir inside the mountpoint (hidden by the mount: it could never cache, and what it created
    there made the next mount find the mountpoint not empty; exit status 2, a setting to change), an empty
    --cache-dir (silently no cache), a --read-timeout without bound (taken, then every request failed), a log
    file that cannot be written (a traceback in the foreground, "exited with status 1" in the background), a log file
    that is a directory (status 1, which the systemd unit started again every 5 s for good: 2 now, B173), a log FIFO
    that no process reads (the start-up waited for a reader: B190)."""
    bucket = new_bucket(moto_server)
    mp = tmp_path / "mnt"
    mp.mkdir()
    (tmp_path / "afile").write_bytes(b"x")
    os.mkfifo(tmp_path / "log.fifo")
    base = ("mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url)
    try:
        for extra, message, code in (
                # Settings only a change of them mends: 2, which the systemd unit does not restart on (with 1 it
                # started the mount again every 5 s for good).
                (("--cache-dir", str(tmp_path / "afile")), "it exists and is not a directory", 2),
                (("--cache-dir", str(tmp_path / "afile"), "--foreground"), "it exists and is not a directory", 2),
                (("--cache-dir", str(mp)), "is inside the mountpoint", 2),
                (("--cache-dir", str(mp / "cache")), "is inside the mountpoint", 2),
                (("--cache-dir", str(mp / "cache"), "--foreground"), "is inside the mountpoint", 2),
                (("--cache-dir", ""), "--cache-dir is empty", 2),
                (("--read-timeout", "inf"), "--read-timeout must be > 0 and at most", 2),
                (("--read-timeout", "1e12"), "--read-timeout must be > 0 and at most", 2),
                # A parent not there yet may come (another unit makes it, a mount comes up): 1, started again.
                (("--log-file", str(tmp_path / "missing" / "x.log")), "cannot write the log file", 1),
                (("--log-file", str(tmp_path / "missing" / "x.log"), "--foreground"), "cannot write the log file",
                 1),
                # A directory given for the file never mends by itself: it was 1, and the unit started the mount
                # again every 5 s for good (B173).
                (("--log-file", str(tmp_path)), f"--log-file {tmp_path} is a directory: give the path of a file", 2),
                (("--log-file", str(tmp_path), "--foreground"), f"--log-file {tmp_path} is a directory", 2),
                (("--log-file", str(tmp_path / "afile" / "x.log")), "Not a directory", 2),
                # A FIFO no process reads: the open waited for a reader, the background mount said "did not answer"
                # after 120 s, the foreground one hung; a reader may start later: 1, started again (B190).
                (("--log-file", str(tmp_path / "log.fifo")), "it is a FIFO that no process reads", 1),
                (("--log-file", str(tmp_path / "log.fifo"), "--foreground"), "it is a FIFO that no process reads", 1),
                # Created in the mountpoint before the mount; with --allow-non-empty logged through it: a read-only
                # daemon died at its next line, a --writable one waited on its own mount for good.
                (("--log-file", str(mp / "modelfs.log")), "is inside the mountpoint", 2),
                (("--log-file", str(mp / "modelfs.log"), "--allow-non-empty", "--writable"),
                 "is inside the mountpoint", 2),
                (("--log-file", str(mp / "modelfs.log"), "--foreground"), "is inside the mountpoint", 2)):
            res = run_modelfs(*base, *extra, env=daemon_env(moto_server))
            assert res.returncode == code and message in res.stderr, (extra, res.returncode, res.stderr)
            assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
            assert not os.path.ismount(mp) and os.listdir(mp) == [], extra
    finally:
        unmount(mp)


def test_a_daemon_works_from_the_root_directory(moto_server: S3Server, tmp_path: Path) -> None:
    """It kept its caller's working directory, which then could not be unmounted for as long as the mount
    lived ("target is busy"). A relative --cache-dir is taken from where the command ran."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="w.bin", Body=b"w" * 1000)
    work = tmp_path / "work"
    work.mkdir()
    with mounted(moto_server, bucket, tmp_path / "mnt", "--cache-dir", "cache", cwd=work) as m:
        assert os.readlink(f"/proc/{m.proc.pid}/cwd") == "/"
        assert (m.path / "w.bin").read_bytes() == b"w" * 1000
        assert (work / "cache" / "chunks").is_dir()


def default_stop_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_while_mount_waits_stops_its_daemon(tmp_path: Path, signum: int) -> None:
    """`modelfs mount` against an endpoint that does not answer waits for the pre-flight; Ctrl-C there printed
    a traceback and left the detached daemon running, which mounted once the endpoint answered. `timeout N modelfs
    mount` (SIGTERM) and a dropped ssh session (SIGHUP) still did: the caller failed, the daemon mounted later. Now
    the daemon is stopped, the command says so in one line and exits 128 + the signal."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the backlog; nothing ever answers them
    mp = tmp_path / "mnt"
    mp.mkdir()
    env = {**modelfs_env(), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    # As from a terminal: a test run started in the background (`cmd &` in a script) ignores SIGINT, and one under
    # nohup SIGHUP, and so would the command, as it should there.
    proc = subprocess.Popen(modelfs_cmd("mount", "b", str(mp), "--endpoint-url",
                                        f"http://127.0.0.1:{silent.getsockname()[1]}"),
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_stop_signals)
    try:
        daemons = wait_for("the daemon in its pre-flight", lambda: daemons_for(mp), bool)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        assert proc.returncode == 128 + signum, (proc.returncode, err)
        assert f"{said}: the daemon was stopped" in err and len(err.splitlines()) == 1, err
        assert not [pid for pid in daemons if Path(f"/proc/{pid}").exists()]
        assert not os.path.ismount(mp)
    finally:
        if proc.poll() is None:
            proc.kill()
        silent.close()
        unmount(mp)


def test_stats_of_a_daemon_that_does_not_answer_says_so(moto_server: S3Server, tmp_path: Path) -> None:
    """A stopped (SIGSTOP) or hung daemon never answers the stats xattr: `modelfs stats` hung with it."""
    from fsmount.stats_table import StatsUnavailable, read_stats

    bucket = new_bucket(moto_server)
    with mounted(moto_server, bucket, tmp_path / "mnt") as m:
        m.proc.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            with pytest.raises(StatsUnavailable, match="does not answer within 1s"):
                read_stats(str(m.path), timeout=1.0)
            assert time.monotonic() - began < 5
        finally:
            m.proc.send_signal(signal.SIGCONT)
        assert read_stats(str(m.path))["format"]


def test_prefetch_of_a_daemon_that_does_not_answer_says_so(moto_server: S3Server, tmp_path: Path) -> None:
    """`modelfs prefetch` of a stopped daemon's tree sat in the kernel (D state, deaf to Ctrl-C) until the daemon
    woke up, 594 s in a tester's run; it now fails as `modelfs stats` does."""
    from fsmount.stats_table import STATS_TIMEOUT_S

    bucket = bucket_with(moto_server, {"m/a.bin": b"x" * 1000})
    with mounted(moto_server, bucket, tmp_path / "mnt") as m:
        m.proc.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            res = run_modelfs("prefetch", str(m.path / "m"), timeout=STATS_TIMEOUT_S + 20)
            assert res.returncode == 1 and "does not answer within" in res.stderr, res.stderr
            assert time.monotonic() - began < STATS_TIMEOUT_S + 10
        finally:
            m.proc.send_signal(signal.SIGCONT)
        assert run_modelfs("prefetch", str(m.path / "m")).returncode == 0


def test_a_daemon_short_of_descriptors_says_so_in_one_line_and_fails_reads_at_once(moto_server: S3Server,
                                                                                   mountpoint: Path,
                                                                                   tmp_path: Path) -> None:
    """At `ulimit -n 11` trio could not make its wakeup sockets: a traceback in the log, and `modelfs mount` said
    only "run with --foreground to see why"; a little higher, every read waited --read-timeout for an endpoint
    "that cannot be reached". Whatever the limit: a mount that works, or one line that says why, and a read that
    fails fails at once."""
    bucket = bucket_with(moto_server, {"a.bin": b"x" * 100})
    mountpoint.mkdir(exist_ok=True)
    refused = served = 0
    for n in range(8, 25):
        log = tmp_path / f"daemon-{n}.log"
        res = subprocess.run(["prlimit", f"--nofile={n}:{n}", *modelfs_cmd(
            "mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--read-timeout", "20",
            "--cache-dir", str(tmp_path / "cache"), "--log-file", str(log))], env=daemon_env(moto_server),
            capture_output=True, text=True, timeout=120)
        try:
            said = [line for line in res.stderr.splitlines() if not line.startswith("modelfs: warning:")]
            assert "Traceback" not in log.read_text() + res.stderr, (n, res.stderr)
            if res.returncode:
                refused += 1
                assert len(said) == 1 and "Too many open files" in said[0], (n, res.stderr)
                continue
            assert os.path.ismount(mountpoint) and not said, (n, res.stderr)
            began = time.monotonic()
            try:
                assert (mountpoint / "a.bin").read_bytes() == b"x" * 100
                served += 1
            except OSError:
                assert time.monotonic() - began < 5, n  # not --read-timeout
                assert "Too many open files on this machine" in log.read_text(), n
        finally:
            if os.path.ismount(mountpoint):
                unmount(mountpoint)
    assert refused and served, (refused, served)  # the scan crossed the limit a mount needs


def unit_start(server: S3Server, bucket: str, mountpoint: Path) -> tuple[str, int, str]:
    """The systemd unit's start, its lines run as systemd runs them (ExecStartPre in order, a "-" line's failure
    ignored, then ExecStart), with this checkout's modelfs: (the line that ended it, its exit status, its stderr)."""
    env = daemon_env(server)
    env.update(BUCKET=bucket, MOUNTPOINT=str(mountpoint), MODELFS_OPTS=f"--endpoint-url {server.endpoint_url}")
    lines = [line.partition("=")[::2] for line in (REPO / "systemd" / "modelfs@.service").read_text().splitlines()
             if line.startswith(("ExecStartPre=", "ExecStart="))]
    for key, value in lines:
        ignore = value.startswith("-")
        value = value.removeprefix("-").replace("$$", "\0").replace("/usr/local/bin/modelfs", shlex.join(modelfs_cmd()))
        value = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(env[m.group(1)]), value)
        value = value.replace("$MODELFS_OPTS", env["MODELFS_OPTS"]).replace("\0", "$")
        res = subprocess.run(shlex.split(value), capture_output=True, text=True, env=env, timeout=FAIL_FAST_LIMIT)
        if key == "ExecStart" or (res.returncode != 0 and not ignore):
            return key, res.returncode, res.stderr
    raise AssertionError("the unit has no ExecStart")


def test_a_unit_whose_mountpoint_is_inside_a_read_only_modelfs_mount_stops_with_exit_2(moto_server: S3Server,
                                                                                        tmp_path: Path) -> None:
    """B691: a unit whose MOUNTPOINT lies inside a read-only modelfs mount: its ExecStartPre `mkdir -p` failed with
    EROFS (exit 1) before `modelfs mount` could refuse the nested mount (B552), so the unit was started again every
    5 s for good with only mkdir's error. The mkdir's failure no longer fails the start, and `modelfs mount` refuses a
    mountpoint that is not there but would lie inside a modelfs mount as it refuses one that is: exit 2, which the
    unit does not restart on."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    outer = tmp_path / "models"
    inner = outer / "sub" / "inner"
    with mounted(moto_server, bucket, outer, check_log=False):
        try:
            key, status, said = unit_start(moto_server, bucket, inner)
            assert (key, status) == ("ExecStart", 2), said
            assert f"mountpoint {inner} is inside the modelfs mount at {outer}" in said, said
        finally:
            unmount(inner)
        assert (outer / "a.bin").read_bytes() == b"a" * 100
