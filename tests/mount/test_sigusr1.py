"""SIGUSR1, what an nginx-style logrotate postrotate (`kill -USR1`) sends: its default action killed the daemon,
taking the mount down under every reader. It is taken as SIGHUP is, a log reopen."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.helpers import S3Server, bucket_with, daemon_env, run_modelfs, unmount, wait_for
from tests.mount.test_cli_mount import daemon_pid


def test_sigusr1_reopens_the_log_and_leaves_the_mount_up(moto_server: S3Server, mountpoint: Path,
                                                          tmp_path: Path) -> None:
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    log_file = tmp_path / "modelfs.log"
    try:
        res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--log-file",
                          str(log_file), "--log-level", "info", env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        pid = daemon_pid(mountpoint)
        with open(mountpoint / "a.bin", "rb") as held:
            log_file.rename(tmp_path / "modelfs.log.1")  # what logrotate does before its postrotate
            os.kill(pid, signal.SIGUSR1)
            wait_for("the line saying it", lambda: log_file.exists() and "received SIGUSR1" in log_file.read_text())
            assert held.read() == b"a" * 100
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        os.kill(pid, 0)  # the daemon is still there
    finally:
        unmount(mountpoint)
