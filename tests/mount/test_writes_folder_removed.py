"""`rm -rf CACHE/writes` under a `--writable --cache-dir` mount (B78): files written afterwards still go into the NVMe
cache, as those written before did."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.helpers import MiB, S3Server, mount_stats, mounted, new_bucket, random_bytes, wait_for
from tests.mount.test_writes import WRITABLE


def test_files_written_after_the_writes_folder_was_removed_are_still_cached(s3: S3Server, mountpoint: Path,
                                                                           tmp_path: Path) -> None:
    bucket = new_bucket(s3)
    cache = tmp_path / "cache"
    data = random_bytes(3 * MiB, 11)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--cache-dir", str(cache)):
        (mountpoint / "a.bin").write_bytes(data)
        wait_for("chunks cached", lambda: mount_stats(mountpoint)["writes"]["chunks_cached"], lambda n: n == 1)
        shutil.rmtree(cache / "writes")
        (mountpoint / "b.bin").write_bytes(data[::-1])  # was stored but not cached, with a warning
        wait_for("chunks cached", lambda: mount_stats(mountpoint)["writes"]["chunks_cached"], lambda n: n == 2)
        assert os.listdir(cache / "writes") == []
        assert (mountpoint / "b.bin").read_bytes() == data[::-1]
