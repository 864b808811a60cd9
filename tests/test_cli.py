"""The command line: option parsing, the fstab form, and every fail-fast case with its message and
exit status (the real command, in a subprocess)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsmount import __version__
from fsmount.cli import build_config, expand_mount_options, make_parser
from fsmount.config import ConfigError, GiB, MiB, parse_size, parse_ttl
from tests.conftest import REPO, S3Server, daemon_env, free_port, modelfs_cmd, new_bucket, unmount

FAIL_FAST_LIMIT = 20.0  # seconds; every pre-flight failure must come well within this


def run_modelfs(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(modelfs_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=env or {**os.environ, "PYTHONPATH": str(REPO)})


def test_sizes_and_ttls() -> None:
    assert parse_size("8M") == 8 * MiB
    assert parse_size("1G") == GiB
    assert parse_size("1.5G") == int(1.5 * GiB)
    assert parse_size("4096") == 4096
    assert parse_size("512KiB") == 512 * 1024
    with pytest.raises(ConfigError):
        parse_size("lots")
    assert parse_ttl("forever") > 10**8
    assert parse_ttl("2.5") == 2.5
    with pytest.raises(ConfigError):
        parse_ttl("-1")


def test_fstab_options_expand_and_generic_ones_are_ignored() -> None:
    argv = expand_mount_options(["mount", "b", "/m", "-o",
                                 "ro,rw,defaults,_netdev,nofail,noauto,user,nodev,nosuid,noexec,allow_other,"
                                 "endpoint_url=http://h:1,prefix=llama/,cache_dir=/nvme/x,nonempty,x-systemd.requires=a"])
    assert argv == ["mount", "b", "/m", "--allow-other", "--endpoint-url", "http://h:1", "--prefix", "llama/",
                    "--cache-dir", "/nvme/x", "--allow-non-empty"]
    args = make_parser().parse_args(argv)
    cfg = build_config(args)
    assert cfg.allow_other and cfg.store.prefix == "llama/" and cfg.store.endpoint_url == "http://h:1"


def test_defaults_are_safe() -> None:
    cfg = build_config(make_parser().parse_args(["mount", "b", "/m"]))
    assert not cfg.allow_other
    assert cfg.chunk_size == 8 * MiB and cfg.store.max_connections == 16
    assert cfg.memory_limit <= 2 * GiB
    assert cfg.file_mode == 0o444


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


@pytest.mark.mount
def test_bucket_missing(moto_server: S3Server, tmp_path: Path) -> None:
    t = time.monotonic()
    res = run_modelfs("mount", "no-such-bucket-here", str(tmp_path), "--endpoint-url", moto_server.endpoint_url,
                      env=daemon_env(moto_server))
    assert_fails(res, "bucket 'no-such-bucket-here' does not exist", t)


@pytest.mark.mount
@pytest.mark.seaweedfs
def test_access_denied(seaweed_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(seaweed_server)
    env = daemon_env(seaweed_server)
    env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret"
    t = time.monotonic()
    res = run_modelfs("mount", bucket, str(tmp_path), "--endpoint-url", seaweed_server.endpoint_url, env=env)
    assert_fails(res, "access denied", t)
    assert "wrong-secret" not in res.stderr


@pytest.mark.mount
def test_endpoint_unreachable(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    t = time.monotonic()
    res = run_modelfs("mount", "b", str(tmp_path), "--endpoint-url", f"http://127.0.0.1:{free_port()}", env=env)
    assert_fails(res, "cannot reach the endpoint", t)


@pytest.mark.mount
def test_mountpoint_problems(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    env = daemon_env(moto_server)
    afile = tmp_path / "file"
    afile.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    cases = [(tmp_path / "missing", "does not exist"), (afile, "is not a directory"), (full, "is not empty")]
    for path, message in cases:
        t = time.monotonic()
        res = run_modelfs("mount", bucket, str(path), "--endpoint-url", moto_server.endpoint_url, env=env)
        assert_fails(res, message, t)
    assert (full / "something").read_text() == "x"  # nothing lost


@pytest.mark.mount
def test_no_fusermount3(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    env = daemon_env(moto_server)
    env["PATH"] = "/nonexistent"
    t = time.monotonic()
    res = run_modelfs("mount", bucket, str(tmp_path), "--endpoint-url", moto_server.endpoint_url, env=env)
    assert_fails(res, "fusermount3 not found", t)


@pytest.mark.mount
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


@pytest.mark.mount
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
