"""Browsing a model zoo (`ls -l`, `stat` of each file, `find`, config and tokenizer loading) through the fault proxy on
moto, counting the daemon's requests by kind: what each costs, asserted where the cost was the defect."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fsmount.namespace import RELIST_ENTRIES
from fsmount.testing.fault_proxy import FaultProxy
from tests.helpers import S3Server, bucket_with, mounted_via

TTL_S = 2.0
MODEL = {f"models/m0/f{i:03d}.json": b"x" * i for i in range(50)}


def test_a_stat_of_each_file_past_the_ttl_lists_the_small_directory_again_not_each_name(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """A model's files `stat`ed one by one once the listing of its directory has expired (a loader's checks, a
    second `du`): one listing of the directory answers them all, the missing names a loader probes for too (B1200)."""
    bucket = bucket_with(moto_server, MODEL)
    assert len(MODEL) <= RELIST_ENTRIES
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", f"{TTL_S:g}"):
        model = mountpoint / "models" / "m0"
        for directory in (mountpoint, mountpoint / "models", model):
            for name in os.listdir(directory):
                os.stat(directory / name)
        time.sleep(TTL_S + 0.5)
        proxy.reset_counts()
        sizes = {key: os.stat(model / key.rpartition("/")[2]).st_size for key in MODEL}
        missing = [(model / f"absent{i}.json").exists() for i in range(10)]
        counts = proxy.counts()
    assert sizes == {key: len(body) for key, body in MODEL.items()}
    assert not any(missing)
    # Each directory of the path listed again (root, models, m0), a slow run's TTL passing once more at most; asked by
    # name, each file and directory was a HEAD and a one-key listing: 62 of each.
    assert counts.get("heads", 0) == 0, counts
    assert counts.get("lists", 0) <= 6, counts
