"""The real command in a subprocess: help and version, and every fail-fast case with its message and exit
status; a background mount. Option parsing in-process is tests/unit/test_cli.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsmount import __version__
from tests.helpers import (
    REPO,
    S3Server,
    daemon_env,
    free_port,
    modelfs_cmd,
    modelfs_env,
    new_bucket,
    run_modelfs,
    unmount,
)

FAIL_FAST_LIMIT = 20.0  # seconds; every pre-flight failure must come well within this


def test_version_and_help() -> None:
    res = run_modelfs("--version")
    assert res.returncode == 0 and __version__ in res.stdout
    res = run_modelfs("mount", "--help")
    assert res.returncode == 0 and "examples:" in res.stdout and "--endpoint-url" in res.stdout


def test_unknown_option_is_rejected() -> None:
    res = run_modelfs("b", "/tmp", "-o", "no_such_option=1")
    assert res.returncode == 2 and "no-such-option" in res.stderr


def test_invalid_memory_limit_is_a_clear_error(tmp_path: Path) -> None:
    res = run_modelfs("mount", "b", str(tmp_path), "--memory-limit", "1M")
    assert res.returncode == 2 and "--memory-limit must be at least" in res.stderr


# -- fail fast before mounting --------------------------------------------------------------------

def assert_fails(res: subprocess.CompletedProcess, message: str, started: float) -> None:
    assert res.returncode == 1, res
    assert message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # one clear line
    assert time.monotonic() - started < FAIL_FAST_LIMIT


def mount_fails_fast(bucket: str, path: Path, endpoint_url: str, env: dict[str, str],
                     message: str) -> subprocess.CompletedProcess:
    """`modelfs mount` that must fail before mounting (assert_fails), timed from just before it starts."""
    t = time.monotonic()
    res = run_modelfs("mount", bucket, str(path), "--endpoint-url", endpoint_url, env=env)
    assert_fails(res, message, t)
    return res


def test_bucket_missing(moto_server: S3Server, tmp_path: Path) -> None:
    mount_fails_fast("no-such-bucket-here", tmp_path, moto_server.endpoint_url, daemon_env(moto_server),
                     "bucket 'no-such-bucket-here' does not exist")


@pytest.mark.seaweedfs
def test_access_denied(seaweed_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(seaweed_server)
    env = daemon_env(seaweed_server)
    env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret"
    res = mount_fails_fast(bucket, tmp_path, seaweed_server.endpoint_url, env, "access denied")
    assert "wrong-secret" not in res.stderr


def test_endpoint_unreachable(tmp_path: Path) -> None:
    env = {**modelfs_env(), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    mount_fails_fast("b", tmp_path, f"http://127.0.0.1:{free_port()}", env, "cannot reach the endpoint")


def test_mountpoint_problems(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    afile = tmp_path / "file"
    afile.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    cases = [(tmp_path / "missing", "does not exist"), (afile, "is not a directory"), (full, "is not empty")]
    for path, message in cases:
        mount_fails_fast(bucket, path, moto_server.endpoint_url, daemon_env(moto_server), message)
    assert (full / "something").read_text() == "x"  # nothing lost


def test_no_fusermount3(moto_server: S3Server, tmp_path: Path) -> None:
    env = daemon_env(moto_server)
    env["PATH"] = "/nonexistent"
    mount_fails_fast(new_bucket(moto_server), tmp_path, moto_server.endpoint_url, env, "fusermount3 not found")


def test_no_dev_fuse(moto_server: S3Server, tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to hide /dev/fuse")
    bucket = new_bucket(moto_server)
    inner = " ".join(["mount --bind /dev/null /dev/fuse &&", *modelfs_cmd("mount", bucket, str(tmp_path),
                                                                              "--endpoint-url",
                                                                              moto_server.endpoint_url)])
    t = time.monotonic()
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                         capture_output=True, text=True, timeout=60, env=daemon_env(moto_server))
    assert_fails(res, "/dev/fuse is not the FUSE device", t)


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
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(mp)
        res = run_modelfs("unmount", str(mp))
        assert res.returncode == 1 and "is not mounted" in res.stderr
    finally:
        unmount(mp)
    assert "mounted bucket" in log.read_text()


def test_python_m_entry_point() -> None:
    res = subprocess.run([sys.executable, "-m", "fsmount", "--version"], capture_output=True, text=True,
                         cwd=REPO)
    assert res.returncode == 0
