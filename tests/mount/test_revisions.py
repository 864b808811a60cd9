"""A new revision of a model pushed into the bucket while a node keeps it mounted: a reload after the mount learns
of the push loads one revision, never shards of two (README, Semantics)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import Fault, FaultProxy
from tests.helpers import (
    MiB,
    S3Server,
    drop_kernel_caches,
    mounted,
    mounted_via,
    new_bucket,
    put_objects,
    random_bytes,
    sha,
    timed,
)

# Not safetensors shards, which streaming warms whole at the first open (a shard never read is cached too).
SHARDS = [f"pytorch_model-{i}.bin" for i in range(1, 5)]


@pytest.mark.parametrize("cache", ["memory", "cache-dir"])
def test_with_ttl_forever_a_reload_after_a_push_loads_one_revision(
        s3: S3Server, mountpoint: Path, tmp_path: Path, cache: str) -> None:
    """With `--metadata-ttl forever`, shards read before a push of a new revision (their chunks in memory or the
    cache dir) kept serving the old revision after a read of an uncached shard had found the push (EIO, once): a
    reload of every shard then loaded two of the old revision and two of the new, silently. Now the refusal makes
    every file of its directory be asked again at its next open: the reload loads the new revision whole, while a
    descriptor opened before the push keeps reading the version it opened."""
    bucket = new_bucket(s3)
    old = {f"m/{name}": random_bytes(2 * MiB + i, i) for i, name in enumerate(SHARDS)}
    new = {f"m/{name}": random_bytes(3 * MiB + i, 10 + i) for i, name in enumerate(SHARDS)}
    put_objects(s3, bucket, old)
    extra = ("--cache-dir", str(tmp_path / "cache")) if cache == "cache-dir" else ()
    model = mountpoint / "m"
    with mounted(s3, bucket, mountpoint, "--metadata-ttl", "forever", *extra,
                 allowed=("object changed", "fetching chunk")):
        assert sorted(p.name for p in model.iterdir()) == SHARDS
        for name in SHARDS[:2]:  # loaded once: cached
            assert sha((model / name).read_bytes()) == sha(old[f"m/{name}"])
        with open(model / SHARDS[0], "rb") as held:  # a loader still holding a shard of the old revision
            put_objects(s3, bucket, new)  # CI pushes the new revision
            with pytest.raises(OSError) as exc:
                (model / SHARDS[3]).read_bytes()  # never read: its read finds the push
            assert exc.value.errno == errno.EIO
            loaded = {name: sha((model / name).read_bytes()) for name in SHARDS}  # the reload
            assert loaded == {name: sha(new[f"m/{name}"]) for name in SHARDS}
            assert {name: (model / name).stat().st_size for name in SHARDS} == {
                name: len(new[f"m/{name}"]) for name in SHARDS}
            assert sha(held.read()) == sha(old[f"m/{SHARDS[0]}"])  # the descriptor keeps its version


def test_with_ttl_forever_a_mount_at_rest_asks_the_bucket_nothing(moto_server: S3Server, proxy: FaultProxy,
                                                                   mountpoint: Path) -> None:
    """What `forever` is for (README, Semantics): with no change learnt, `ls -l`, `stat` and reads of a model the
    mount knows send no HEAD and no listing, also after the kernel forgot its entries (`drop_caches`), B1000's
    and B1001's answers beside."""
    bucket = new_bucket(moto_server)
    files = {f"m/{name}": random_bytes(MiB + i, i) for i, name in enumerate(SHARDS)}
    put_objects(moto_server, bucket, files)
    model = mountpoint / "m"
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", "forever", "--no-model-prefetch"):
        for again in (False, True):
            if again:
                proxy.reset_counts()
                drop_kernel_caches(3)
                time.sleep(1.5)
            assert os.listdir(mountpoint) == ["m"]  # (a directory's lookup asks the bucket if its parent is unlisted)
            assert sorted(os.listdir(model)) == SHARDS
            assert {key: (mountpoint / key).stat().st_size for key in files} == {
                key: len(data) for key, data in files.items()}
            assert {key: sha((mountpoint / key).read_bytes()) for key in files} == {
                key: sha(data) for key, data in files.items()}
        counts = proxy.counts()
        assert counts.get("heads", 0) == counts.get("lists", 0) == 0, counts


def test_a_file_deleted_is_enoent_right_after_the_ttl_on_an_origin_that_answers(moto_server: S3Server,
                                                                                 proxy: FaultProxy,
                                                                                 mountpoint: Path) -> None:
    """The origin answering in 50 ms, a file deleted in the bucket is ENOENT to a `stat` and gone from `ls` as soon
    as the TTL has passed, the kernel's entry dropped or not: the bound of KNOWN_NAME_WAIT_S on a known name's lookup
    (B1001) answers what the mount knew only when the origin is slower than that."""
    bucket = new_bucket(moto_server)
    files = {f"m/{name}": b"x" * (1000 + i) for i, name in enumerate(SHARDS)}
    put_objects(moto_server, bucket, files)
    model = mountpoint / "m"
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", "1", "--no-model-prefetch"):
        assert sorted(os.listdir(model)) == SHARDS
        assert all((mountpoint / key).stat().st_size == len(files[key]) for key in files)
        proxy.inject(Fault.STALL, seconds=0.05, data_only=False)  # every answer 50 ms late
        for name, drop in ((SHARDS[0], False), (SHARDS[1], True)):
            moto_server.client().delete_object(Bucket=bucket, Key=f"m/{name}")
            time.sleep(1.5)  # past the TTL
            if drop:
                drop_kernel_caches(3)
            got, took = timed(os.stat, model / name)
            assert got == errno.ENOENT, (name, got, took)
            assert name not in os.listdir(model)
        proxy.clear()
