"""Shared fixtures: S3 servers (moto in server mode, SeaweedFS), real FUSE mounts in a subprocess that
are always unmounted, and a log checker that fails any test logging an unexpected warning or error."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from fsmount.testing.seaweed import dying_with_parent

REPO = Path(__file__).resolve().parent.parent
MOUNT_TIMEOUT = 30.0
UNMOUNT_TIMEOUT = 30.0
# Daemon log lines at these levels fail the test unless the test allowed them by pattern.
BAD_LOG_LEVELS = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback")

TEST_KEY, TEST_SECRET, TEST_REGION = "modelfs-test-key", "modelfs-test-secret-0123456789", "us-east-1"


# -- log checking (in-process) --------------------------------------------------------------------

@pytest.fixture
def allowed_logs() -> list[str]:
    """Regexes of warning/error messages a test expects; anything else at WARNING+ fails it."""
    return []


@pytest.fixture(autouse=True)
def _check_logs(caplog: pytest.LogCaptureFixture, allowed_logs: list[str]) -> Iterator[None]:
    caplog.set_level(logging.DEBUG, logger="fsmount")
    yield
    bad = [r for r in caplog.get_records("call") if r.levelno >= logging.WARNING
           and r.name.startswith("fsmount")
           and not any(re.search(p, r.getMessage()) for p in allowed_logs)]
    if bad:
        pytest.fail("unexpected log records:\n" + "\n".join(f"{r.levelname} {r.getMessage()}" for r in bad))


# -- S3 servers -----------------------------------------------------------------------------------

def free_port() -> int:
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


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    # Dies with this test run even if it is killed (or its output pipe closes) before teardown.
    proc = subprocess.Popen(dying_with_parent([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                               str(port)]), stdout=log, stderr=subprocess.STDOUT)
    env = {"AWS_ACCESS_KEY_ID": TEST_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
           "AWS_DEFAULT_REGION": TEST_REGION}
    server = S3Server("moto", f"http://127.0.0.1:{port}", env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                server.client().list_buckets()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    from fsmount.testing.seaweed import SeaweedServer

    with SeaweedServer(tmp_path_factory.mktemp("weed"), access_key=TEST_KEY, secret_key=TEST_SECRET,
                       region=TEST_REGION) as weed:
        yield S3Server("seaweedfs", weed.endpoint_url,
                       {"AWS_ACCESS_KEY_ID": TEST_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
                        "AWS_DEFAULT_REGION": TEST_REGION})


@pytest.fixture(params=["moto", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)])
def s3(request: pytest.FixtureRequest) -> S3Server:
    """Each test that takes `s3` runs against both servers."""
    return request.getfixturevalue({"moto": "moto_server", "seaweedfs": "seaweed_server"}[request.param])


_bucket_counter = iter(range(1, 1_000_000))


def new_bucket(server: S3Server, prefix: str = "t") -> str:
    name = f"{prefix}-{os.getpid()}-{next(_bucket_counter)}"
    server.client().create_bucket(Bucket=name)
    return name


# -- real mounts ----------------------------------------------------------------------------------

def daemon_env(server: S3Server) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env)
    env["PYTHONPATH"] = str(REPO)
    return env


class Mount:
    def __init__(self, path: Path, proc: subprocess.Popen, log_path: Path):
        self.path = path
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def modelfs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fsmount", *args]


def unmount(path: Path) -> None:
    if not os.path.ismount(path):
        return
    res = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
    if res.returncode != 0:
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


@contextlib.contextmanager
def mounted(server: S3Server, bucket: str, mountpoint: Path, *extra: str,
            allowed: tuple[str, ...] = (), check_log: bool = True) -> Iterator[Mount]:
    """A foreground daemon in a subprocess; always unmounted; its log checked for warnings."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    log_path = mountpoint.parent / f"{mountpoint.name}.daemon.log"
    cmd = modelfs_cmd("mount", bucket, str(mountpoint), "--foreground", "--endpoint-url", server.endpoint_url,
                      "--log-level", "debug", *extra)
    with open(log_path, "wb") as log:
        # SIGTERM if this test run dies before the finally below: the daemon then unmounts itself.
        proc = subprocess.Popen(dying_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT,
                                env=daemon_env(server))
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
        bad = [line for line in m.log().splitlines() if BAD_LOG_LEVELS.search(line)
               and not any(re.search(p, line) for p in allowed)]
        if bad:
            pytest.fail("daemon logged unexpected warnings/errors:\n" + "\n".join(bad[:20]))
        assert proc.returncode == 0, f"daemon exit status {proc.returncode}"


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    yield mp
    unmount(mp)

