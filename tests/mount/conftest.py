"""Fixtures of the mount tests: S3 servers (moto in server mode, SeaweedFS), the fault proxy in front of
moto, and a mountpoint that is always unmounted. Mounting itself is `tests.helpers.mounted`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.seaweed import dying_with_parent
from tests.helpers import TEST_KEY, TEST_REGION, TEST_SECRET, S3Server, free_port, unmount

TEST_ENV = {"AWS_ACCESS_KEY_ID": TEST_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET, "AWS_DEFAULT_REGION": TEST_REGION}


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    # Dies with this test run even if it is killed (or its output pipe closes) before teardown.
    proc = subprocess.Popen(dying_with_parent([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                               str(port)]), stdout=log, stderr=subprocess.STDOUT)
    server = S3Server("moto", f"http://127.0.0.1:{port}", dict(TEST_ENV))
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
        yield S3Server("seaweedfs", weed.endpoint_url, dict(TEST_ENV))


@pytest.fixture(params=["moto", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)])
def s3(request: pytest.FixtureRequest) -> S3Server:
    """Each test that takes `s3` runs against both servers."""
    return request.getfixturevalue({"moto": "moto_server", "seaweedfs": "seaweed_server"}[request.param])


@pytest.fixture
def proxy(moto_server: S3Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of moto (`tests.helpers.mounted_via` mounts through it)."""
    with FaultProxy(moto_server.endpoint_url) as p:
        yield p


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    yield mp
    unmount(mp)
