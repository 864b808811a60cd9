"""SIGUSR1, what an nginx-style logrotate postrotate (`kill -USR1`) sends: its default action killed the daemon,
taking the mount down under every reader. It is taken as SIGHUP is, a log reopen. So did a stray `kill -USR2` (and
ALRM, VTALRM, PROF, IO, PWR, STKFLT, and the real-time signals SIGRTMIN..SIGRTMAX): ignored, one line each. TERM
still stops it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from tests.helpers import S3Server, bucket_with, daemon_env, mounted_at, run_modelfs, unmount, wait_for
from tests.mount.test_cli_mount import daemon_pid


def mount_logging(server: S3Server, mountpoint: Path, log_file: Path, *options: str) -> int:
    """A mount of a bucket holding `a.bin` (100 bytes of `a`), logging to `log_file`: its daemon's pid."""
    bucket = bucket_with(server, {"a.bin": b"a" * 100})
    res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", server.endpoint_url, "--log-file",
                      str(log_file), *options, env=daemon_env(server))
    assert res.returncode == 0, res.stderr
    return daemon_pid(mountpoint)


def test_sigusr1_reopens_the_log_and_leaves_the_mount_up(moto_server: S3Server, mountpoint: Path,
                                                          tmp_path: Path) -> None:
    log_file = tmp_path / "modelfs.log"
    try:
        pid = mount_logging(moto_server, mountpoint, log_file, "--log-level", "info")
        with open(mountpoint / "a.bin", "rb") as held:
            log_file.rename(tmp_path / "modelfs.log.1")  # what logrotate does before its postrotate
            os.kill(pid, signal.SIGUSR1)
            wait_for("the line saying it", lambda: log_file.exists() and "received SIGUSR1" in log_file.read_text())
            assert held.read() == b"a" * 100
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        os.kill(pid, 0)  # the daemon is still there
    finally:
        unmount(mountpoint)


def files_held(pid: int) -> list[str]:
    """What the descriptors of process `pid` point to."""
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            held.append(os.readlink(fd))
    return held


def test_a_quiet_daemon_lets_go_of_the_rotated_log_at_the_signal(moto_server: S3Server, mountpoint: Path,
                                                                 tmp_path: Path) -> None:
    """At --log-level warning the line that says the signal is not written, and the log file was reopened only at a
    line: the rotated file stayed open (compressed and deleted by logrotate, its disk space held) and no file was at
    the log's path until the next warning, days later perhaps (B260)."""
    log_file, rotated = tmp_path / "modelfs.log", tmp_path / "modelfs.log.1"
    try:
        pid = mount_logging(moto_server, mountpoint, log_file, "--log-level", "warning")
        for signum in (signal.SIGUSR1, signal.SIGHUP):
            log_file.rename(rotated)
            os.kill(pid, signum)
            wait_for(f"a log file at its path after {signum.name}", log_file.exists, timeout=10)
            wait_for("the rotated file let go of", lambda: str(rotated) in files_held(pid), lambda held: not held,
                     timeout=10)
            assert str(log_file) in files_held(pid)
            rotated.unlink()  # what logrotate's compress does with it
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        unmount(mountpoint)


LOGGED = ("SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGIO", "SIGPWR")
SILENT = ("SIGPIPE", "SIGXFSZ")  # ignored by Python itself: a write gets EPIPE, EFBIG


def signals_leave_the_mount_up(moto_server: S3Server, mountpoint: Path, log_file: Path,
                               send: Callable[[int], None]) -> None:
    """Mounts, has `send(pid)` signal the daemon while a file is held open, then checks the mount still serves it
    and SIGTERM still stops the daemon; always unmounts."""
    try:
        pid = mount_logging(moto_server, mountpoint, log_file)
        with open(mountpoint / "a.bin", "rb") as held:
            send(pid)
            assert held.read() == b"a" * 100
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        os.kill(pid, 0)  # the daemon is still there
        os.kill(pid, signal.SIGTERM)
        wait_for("the stop", lambda: not mounted_at(mountpoint))
    finally:
        unmount(mountpoint)


def test_stray_signals_leave_the_mount_up_and_sigterm_still_stops_it(moto_server: S3Server, mountpoint: Path,
                                                                     tmp_path: Path) -> None:
    log_file = tmp_path / "modelfs.log"

    def send(pid: int) -> None:
        for name in LOGGED + SILENT:
            os.kill(pid, getattr(signal, name))
            if name in LOGGED:
                wait_for(f"the line saying {name} was ignored",
                         lambda: f"received {name}: ignored" in log_file.read_text())  # noqa: B023
        os.kill(pid, signal.SIGUSR2)  # and again: each one is
        wait_for("the second line", lambda: log_file.read_text().count("received SIGUSR2: ignored") == 2)

    signals_leave_the_mount_up(moto_server, mountpoint, log_file, send)


# The real-time signals (default action: end the process), which no library of the daemon uses (glibc keeps two below
# SIGRTMIN for its threads; Python does not offer them), and SIGSTKFLT, unused on Linux: a stray `kill -RTMIN+3` (a
# tool's own notification sent to the wrong pid) ended the daemon, leaving the mountpoint ENOTCONN.
REAL_TIME = ((signal.SIGRTMIN, "SIGRTMIN"), (signal.SIGRTMIN + 3, "SIGRTMIN+3"),
             (signal.SIGRTMAX - 1, f"SIGRTMIN+{signal.SIGRTMAX - 1 - signal.SIGRTMIN}"),
             (signal.SIGRTMAX, "SIGRTMAX"), (signal.SIGSTKFLT, "SIGSTKFLT"))


def test_real_time_signals_leave_the_mount_up(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    log_file = tmp_path / "modelfs.log"

    def send(pid: int) -> None:
        for signum, name in REAL_TIME:
            os.kill(pid, signum)
            wait_for(f"the line saying {name} was ignored",
                     lambda: f"received {name}: ignored" in log_file.read_text())  # noqa: B023

    signals_leave_the_mount_up(moto_server, mountpoint, log_file, send)
