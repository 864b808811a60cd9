"""A new revision of a model pushed into the bucket while a node keeps it mounted: a reload after the mount learns
of the push loads one revision, never shards of two (README, Semantics)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.helpers import MiB, S3Server, mounted, new_bucket, put_objects, random_bytes, sha

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
