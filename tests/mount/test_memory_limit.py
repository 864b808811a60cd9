"""`--memory-limit` bounds the daemon's peak RSS (VmHWM) in every combination that holds chunk bytes:
with and without `--cache-dir`; cold, filling the cache, and warm; a sequential `cat`, 4 readers at random
offsets, and `modelfs prefetch` of a sharded model (which also streams each shard through the
safetensors streamer and the page-cache pusher). Real mounts on SeaweedFS, a fresh daemon per run, so
each peak belongs to one combination.

The bound is the limit plus 64 MiB. The model is larger than the largest limit, so every run has to
evict.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from fsmount.testing.models import write_sharded_model
from tests.helpers import (
    MiB,
    S3Server,
    bucket_with,
    delete_bucket,
    drop_kernel_caches,
    file_digest,
    mounted,
    new_bucket,
    proc_status,
    run_modelfs,
)

pytestmark = pytest.mark.seaweedfs

MODEL_BYTES = 1200 * MiB  # above the 1 GiB limit: the cache must evict
SHARDS = 4
MARGIN = 64 * MiB
RANDOM_READERS = 4
RANDOM_BYTES_PER_READER = 96 * MiB


class Model:
    def __init__(self, directory: Path, bucket: str):
        self.directory = directory
        self.bucket = bucket
        self.files = sorted(p.name for p in directory.iterdir())
        self.digests = {name: _digest(directory / name) for name in self.files}


def _digest(path: Path) -> str:
    """xxh3-128 of a file: much faster than sha256 over a 1.2 GB model, which every run reads whole."""
    return file_digest(path, xxhash.xxh3_128)


@pytest.fixture(scope="module")
def model(seaweed_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    directory = tmp_path_factory.mktemp("model")
    write_sharded_model(directory, MODEL_BYTES, shards=SHARDS, seed=7)
    bucket = bucket_with(seaweed_server, {f"m/{path.name}": path for path in sorted(directory.iterdir())}, "mem")
    yield Model(directory, bucket)
    shutil.rmtree(directory, ignore_errors=True)


def read_sequentially(root: Path, model: Model) -> None:
    for name in model.files:
        assert _digest(root / name) == model.digests[name], name


def read_at_random(root: Path, model: Model) -> None:
    errors: list[BaseException] = []
    shards = [name for name in model.files if name.endswith(".safetensors")]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        fds = {name: (os.open(root / name, os.O_RDONLY), open(model.directory / name, "rb")) for name in shards}
        try:
            done = 0
            while done < RANDOM_BYTES_PER_READER:
                name = rng.choice(shards)
                fd, local = fds[name]
                size = os.fstat(local.fileno()).st_size
                length = rng.choice((4096, 128 * 1024, MiB, 3 * MiB + 5))
                offset = rng.randrange(0, max(1, size - length))
                got = os.pread(fd, length, offset)
                assert got == os.pread(local.fileno(), length, offset), (name, offset, length)
                # Each read really reaches the daemon, not the page cache of an earlier one.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done += len(got)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
        finally:
            for fd, local in fds.values():
                os.close(fd)
                local.close()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(RANDOM_READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def prefetch_command(root: Path, model: Model) -> None:
    done = run_modelfs("prefetch", "--quiet", str(root), timeout=600)
    assert done.returncode == 0, done.stderr
    read_sequentially(root, model)  # from the page cache and the daemon: still exact


PATTERNS = {"cat": read_sequentially, "random": read_at_random, "prefetch": prefetch_command}


def peak_of_one_run(server: S3Server, model: Model, mountpoint: Path, limit: str, pattern: str,
                    cache_dir: Path | None, *flags: str) -> int:
    extra = ["--memory-limit", limit, *flags]
    if cache_dir is not None:
        extra += ["--cache-dir", str(cache_dir)]
    with mounted(server, model.bucket, mountpoint, *extra) as m:
        PATTERNS[pattern](mountpoint / "m", model)
        return proc_status(m.proc.pid, "VmHWM") * 1024


@pytest.mark.parametrize("limit", ["256M", "1G"])
def test_peak_rss_stays_within_the_memory_limit(seaweed_server: S3Server, model: Model, tmp_path: Path,
                                                limit: str) -> None:
    limit_bytes = {"256M": 256 * MiB, "1G": 1024 * MiB}[limit]
    cache = tmp_path / "cache"
    peaks: dict[str, int] = {}

    def run(name: str, pattern: str, cache_dir: Path | None) -> None:
        drop_kernel_caches(3)
        peaks[name] = peak_of_one_run(seaweed_server, model, tmp_path / f"mnt-{name}", limit, pattern, cache_dir)

    for pattern in PATTERNS:
        run(f"{pattern}/no-cache", pattern, None)
        shutil.rmtree(cache, ignore_errors=True)
        run(f"{pattern}/cache-filling", pattern, cache)
    # A full read fills the cache (the daemon drains its write-through at unmount), then every
    # pattern runs from it.
    shutil.rmtree(cache, ignore_errors=True)
    run("fill", "cat", cache)
    for pattern in PATTERNS:
        run(f"{pattern}/cache-warm", pattern, cache)

    print(f"VmHWM MiB at --memory-limit {limit}:", {k: v // MiB for k, v in peaks.items()})
    over = {name: peak // MiB for name, peak in peaks.items() if peak > limit_bytes + MARGIN}
    assert not over, f"VmHWM MiB over {limit} + 64 MiB: {over}; all: { {k: v // MiB for k, v in peaks.items()} }"
    # The runs really filled memory: the bound was exercised, not met by an idle daemon.
    assert max(peaks.values()) > min(limit_bytes, 512 * MiB) // 2, {k: v // MiB for k, v in peaks.items()}


def test_peak_rss_with_a_shared_tier_stays_within_the_memory_limit(seaweed_server: S3Server, model: Model,
                                                                   tmp_path: Path) -> None:
    """The shared tier holds no chunk outside the budget: reads go straight into the engine's buffers and
    the bodies of PUTs in flight are taken out of it. Filling an empty tier (and the NVMe cache), then
    random readers on the warm tier alone, then the warm tier with an NVMe cache to fill."""
    tier = new_bucket(seaweed_server, "tier")
    flags = ("--shared-cache-bucket", tier, "--shared-cache-endpoint-url", seaweed_server.endpoint_url)
    peaks: dict[str, int] = {}
    try:
        for name, pattern, cache_dir in (("cat/tier-filling", "cat", tmp_path / "cache1"),
                                         ("random/tier-warm", "random", None),
                                         ("cat/tier-warm-cache-filling", "cat", tmp_path / "cache2")):
            drop_kernel_caches(3)
            peaks[name] = peak_of_one_run(seaweed_server, model, tmp_path / f"mnt-{name.replace('/', '-')}",
                                          "256M", pattern, cache_dir, *flags)
    finally:
        # The session's SeaweedFS gives each bucket volumes of its own and has a fixed number of them:
        # 1.2 GB of chunk objects left behind would starve the tests that run after this one.
        delete_bucket(seaweed_server, tier)
    print("VmHWM MiB at --memory-limit 256M with a shared tier:", {k: v // MiB for k, v in peaks.items()})
    over = {name: peak // MiB for name, peak in peaks.items() if peak > 256 * MiB + MARGIN}
    assert not over, f"VmHWM MiB over 256M + 64 MiB: {over}"
