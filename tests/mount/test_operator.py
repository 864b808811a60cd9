"""What an operator who runs modelfs for weeks does to a live mount: remove the cache by hand, rotate logs, read
its numbers. Each test is a defect such an operator hit."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

from tests.helpers import (
    MiB,
    S3Server,
    bucket_with,
    free_port,
    mount_stats,
    mounted,
    random_bytes,
    run_modelfs,
    wait_for,
)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def test_chunks_removed_by_hand_under_a_mount_are_no_longer_counted(s3: S3Server, mountpoint: Path,
                                                                   tmp_path: Path) -> None:
    """`rm -rf CACHE/chunks` to free the disk while mounted (`modelfs cache clear` refuses then): `modelfs stats` and
    `modelfs_disk_cache_used_bytes` went on saying the cache held the chunks, until each was read again or evicted.
    Readers get the bytes from the origin meanwhile, and the cache fills again."""
    data = random_bytes(20 * MiB, seed=7)
    bucket = bucket_with(s3, {"m/a.bin": data})
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
