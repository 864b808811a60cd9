"""mmap loaders (`safe_open` + `get_tensor`, vLLM's default path) while the origin misbehaves.

A page fault whose READ fails is a SIGBUS, which a loader cannot catch; so these tests run the loader in a
subprocess and look at how it ended. What they assert:
- an origin stall or a 5xx burst shorter than `--read-timeout` costs time only: the loader finishes with
  every tensor byte-exact;
- an origin down for longer than `--read-timeout` kills an mmap loader with SIGBUS (a `read()` loader gets
  EIO instead); the mount stays up and the same loader succeeds once the origin is back;
- chunks in daemon memory or in the NVMe cache never fault, whatever the origin does (here: a black hole).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsmount.data.engine import RETRY_GRACE_S
from fsmount.testing.fault_proxy import Down, Fault, FaultProxy
from fsmount.testing.models import write_model
from tests.helpers import (
    FETCH_FAILED,
    READ_FAILED,
    TIMEOUT_MARGIN_S,
    MiB,
    S3Server,
    bucket_with,
    drop_page_cache,
    mount_stats,
    mounted_via,
    wait_for,
)

MODEL_BYTES = 24 * MiB
READ_TIMEOUT_S = 10.0
# 1 MiB chunks, no read-ahead beyond the kernel's: the loader's page faults decide what is fetched.
MMAP_ARGS = ("--read-timeout", f"{READ_TIMEOUT_S:g}", "--chunk-size", "1M", "--max-readahead", "0",
             "--metadata-ttl", "300")
PREFETCH_STOPPED = r"streaming of .* stopped"

# Loads every tensor through safe_open (an mmap of the file) and prints {name: digest of its bytes}.
LOADER = """
import hashlib, json, sys
from safetensors import safe_open
out = {}
with safe_open(sys.argv[1], "np") as f:
    for name in sorted(f.keys()):
        out[name] = hashlib.sha256(f.get_tensor(name).tobytes()).hexdigest()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mmap-model") / "model.safetensors"
    write_model(path, MODEL_BYTES, seed=3)
    return path


def load(path: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOADER, str(path)], capture_output=True, text=True,
                          timeout=timeout)


def expected(model_file: Path) -> dict[str, str]:
    done = load(model_file)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("fault", ["stall-3s", "500-burst", "503-burst", "refused-3s"])
def test_a_fault_shorter_than_the_read_timeout_lets_an_mmap_loader_finish_exact(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, model_file: Path, fault: str) -> None:
    want = expected(model_file)
    bucket = bucket_with(moto_server, {"m/model.safetensors": model_file})
    with mounted_via(proxy, moto_server, bucket, mountpoint, *MMAP_ARGS, allowed=(PREFETCH_STOPPED,)) as m:
        os.stat(mountpoint / "m" / "model.safetensors")
        if fault == "stall-3s":
            rule = proxy.inject(Fault.STALL, seconds=3.0, times=8)
        elif fault == "500-burst":
            rule = proxy.inject(Fault.ERROR, status=500, times=8)
        elif fault == "503-burst":
            # botocore's throttling backoff grows fast: 3 SlowDowns in a row stay well inside the timeout.
            rule = proxy.inject(Fault.ERROR, status=503, times=3)
        else:
            rule = None  # a restarting origin: connections refused for 3 s
            proxy.origin_down(Down.REFUSE)
            threading.Timer(3.0, proxy.origin_back).start()
        done = load(mountpoint / "m" / "model.safetensors")
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert json.loads(done.stdout) == want
        if rule is not None:
            assert rule.hits >= 1, "the fault never hit a request"
        else:
            # A fetch that waited for the origin tried again (debug log); one that could not wait failed (an error).
            met = mount_stats(mountpoint)["origin"]["errors"] >= 1 or "trying again in" in m.log()
            assert met, "no request met the refusing origin"
        assert m.proc.poll() is None


def test_an_origin_down_longer_than_the_read_timeout_is_sigbus_for_mmap_eio_for_read(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, model_file: Path) -> None:
    want = expected(model_file)
    bucket = bucket_with(moto_server, {"m/model.safetensors": model_file})
    path = mountpoint / "m" / "model.safetensors"
    with mounted_via(proxy, moto_server, bucket, mountpoint, *MMAP_ARGS, "--no-model-prefetch",
                     allowed=(FETCH_FAILED, READ_FAILED)) as m:
        # The header is read while the origin is up, so safe_open itself succeeds; the tensors are not.
        with open(path, "rb") as f:
            f.read(64 * 1024)
        proxy.origin_down(Down.BLACKHOLE)
        start = time.monotonic()
        done = load(path)
        took = time.monotonic() - start
        assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-2000:])
        # A READ waits at most --read-timeout; the loader's first uncached page is where it dies.
        assert took <= READ_TIMEOUT_S + TIMEOUT_MARGIN_S + 5.0, took
        # A read() loader of the same bytes gets an error it can handle.
        with open(path, "rb", buffering=0) as f:
            f.seek(8 * MiB)
            with pytest.raises(OSError) as exc:
                f.read(MiB)
        assert exc.value.errno == 5  # EIO
        assert m.proc.poll() is None
        proxy.origin_back()
        # A READ within RETRY_GRACE_S of a failed fetch's deadline fails at once: it cannot be told from
        # the kernel re-sending the READ that just failed (fix B5). The loader's READs all failed at the
        # same deadline (the kernel sends up to --fuse-max-background of them at once), so a loader
        # started again gets fresh fetches once that second has passed.
        time.sleep(RETRY_GRACE_S)
        done = load(path)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert json.loads(done.stdout) == want


@pytest.mark.parametrize("where", ["memory", "nvme-cache"])
def test_chunks_held_by_the_daemon_never_fault_whatever_the_origin_does(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, model_file: Path, tmp_path: Path,
        where: str) -> None:
    want = expected(model_file)
    bucket = bucket_with(moto_server, {"m/model.safetensors": model_file})
    path = mountpoint / "m" / "model.safetensors"
    extra: tuple[str, ...] = ("--no-model-prefetch",)
    if where == "nvme-cache":
        # Memory for 4 chunks of the 24: the rest can only come from the cache directory.
        extra += ("--memory-limit", "4M", "--cache-dir", str(tmp_path / "cache"))
    with mounted_via(proxy, moto_server, bucket, mountpoint, *MMAP_ARGS, *extra) as m:
        with open(path, "rb") as f:  # every chunk through the daemon once
            while f.read(4 * MiB):
                pass
        wait_for("cache writes pending", lambda: mount_stats(mountpoint)["cache_writes_pending"], lambda n: not n,
                 timeout=60)
        origin_bytes = mount_stats(mountpoint)["origin"]["bytes"]
        drop_page_cache(path)  # the loader's faults must reach the daemon
        proxy.origin_down(Down.BLACKHOLE)
        done = load(path)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert json.loads(done.stdout) == want
        stats = mount_stats(mountpoint)
        assert stats["origin"]["bytes"] == origin_bytes
        if where == "nvme-cache":
            assert stats["cache_chunk_hits"] > 0, stats
        assert m.proc.poll() is None
