"""Model-aware prefetch: unit tests in virtual time, and real mounts with mmap readers and page-cache push."""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from fsmount.cache_level import ChunkId
from fsmount.config import DEFAULT_CHUNK_SIZE
from fsmount.disk_cache import SHARD_HEX_CHARS
from fsmount.pagecache import PageCachePusher
from fsmount.prefetch import ModelPrefetcher
from fsmount.testing.models import write_model
from tests.conftest import S3Server, mounted, new_bucket
from tests.fake_store import FakeStore
from tests.test_engine import CHUNK, autojump_clock, make_engine, run_engine, version  # noqa: F401

MiB = 1 << 20


def cache_file(cache: Path, bucket: str, key: str, etag: str, index: int) -> Path:
    """Where --cache-dir keeps a chunk (of the default size) once it is written through."""
    digest = ChunkId(bucket, key, etag, DEFAULT_CHUNK_SIZE, index).digest()
    return cache / "chunks" / digest[:SHARD_HEX_CHARS] / digest


def model_bytes(tmp_path: Path, size: int, seed: int = 0) -> bytes:
    path = tmp_path / f"m{seed}.safetensors"
    write_model(path, size, seed=seed)
    return path.read_bytes()


async def test_streams_whole_data_region_in_offset_order(autojump_clock, tmp_path) -> None:  # noqa: ANN001, F811
    store = FakeStore()
    store.put("m.safetensors", model_bytes(tmp_path, 24 * MiB))
    engine = make_engine(store, conns=4, memory=256 * MiB)
    prefetcher = ModelPrefetcher(engine, PageCachePusher(0), max_connections=4)

    async def body() -> None:
        async with trio.open_nursery() as n:
            await n.start(prefetcher.run)
            v = version(store, "m.safetensors")
            prefetcher.opened(2, v)
            job = prefetcher._active[(v.key, v.etag)]
            await job.done.wait()
            chunks = len(engine.chunk_range(v, 0, v.size))
            assert prefetcher.prefetched_bytes == v.size
            starts = [start for _, start, _ in store.gets]
            assert sorted(starts) == [i * CHUNK for i in range(chunks)]
            # Offset order: no chunk is fetched before those more than one round of connections ahead.
            assert all(start // CHUNK <= i + 4 for i, start in enumerate(starts)), starts
            prefetcher.closed(v)
            n.cancel_scope.cancel()

    await run_engine(engine, body)


async def test_close_cancels_prefetch(autojump_clock, tmp_path) -> None:  # noqa: ANN001, F811
    store = FakeStore()
    store.put("m.safetensors", model_bytes(tmp_path, 64 * MiB))
    engine = make_engine(store, conns=2, memory=512 * MiB)
    prefetcher = ModelPrefetcher(engine, PageCachePusher(0), max_connections=2)

    async def body() -> None:
        async with trio.open_nursery() as n:
            await n.start(prefetcher.run)
            v = version(store, "m.safetensors")
            prefetcher.opened(2, v)
            await trio.sleep(0.2)
            prefetcher.closed(v)
            await trio.sleep(30)
            assert len(store.gets) < 20  # of 65 chunks
            assert not prefetcher._active
            n.cancel_scope.cancel()

    await run_engine(engine, body)


async def test_malformed_header_only_disables_prefetch(autojump_clock, caplog) -> None:  # noqa: ANN001, F811
    store = FakeStore()
    store.put("bad.safetensors", (10**12).to_bytes(8, "little") + os.urandom(3 * MiB))
    engine = make_engine(store)
    prefetcher = ModelPrefetcher(engine, PageCachePusher(0), max_connections=4)

    async def body() -> None:
        async with trio.open_nursery() as n:
            await n.start(prefetcher.run)
            v = version(store, "bad.safetensors")
            prefetcher.opened(2, v)
            await prefetcher._active[(v.key, v.etag)].done.wait()
            assert len(store.gets) == 1
            assert bytes(await engine.read(v, 100, 200)) == store.objects[v.key][100:200]
            prefetcher.closed(v)
            n.cancel_scope.cancel()

    await run_engine(engine, body)
    assert any("not prefetching" in r.getMessage() for r in caplog.records)


@pytest.mark.mount
@pytest.mark.parametrize("push_limit", ["0", "1G"])
def test_eight_mmap_readers_while_pushing(moto_server: S3Server, mountpoint: Path, tmp_path: Path,
                                          push_limit: str) -> None:
    from safetensors import safe_open

    data = model_bytes(tmp_path, 96 * MiB, seed=1)
    bucket = new_bucket(moto_server)
    moto_server.client().upload_fileobj(io.BytesIO(data), bucket, "m.safetensors")
    local = tmp_path / "m1.safetensors"
    errors: list[str] = []
    with mounted(moto_server, bucket, mountpoint, "--pagecache-push-limit", push_limit) as m:
        path = mountpoint / "m.safetensors"
        with safe_open(local, "np") as f:
            names = sorted(f.keys())

        def reader(i: int) -> None:
            try:
                with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
                    view = memoryview(mm)
                    step = len(data) // 8
                    lo = (i * step * 5) % len(data)
                    for off in list(range(lo, len(data), 1 << 20)) + list(range(0, lo, 1 << 20)):
                        if view[off:off + 4096] != data[off:off + 4096]:
                            errors.append(f"reader {i} mismatch at {off}")
                    view.release()
                    if hashlib.sha256(mm[:]).digest() != hashlib.sha256(data).digest():
                        errors.append(f"reader {i} sha mismatch")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"reader {i}: {exc!r}")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        with safe_open(path, "np") as got, safe_open(local, "np") as src:
            for name in names:
                assert np.array_equal(got.get_tensor(name), src.get_tensor(name))
    assert errors == []
    assert "prefetching 'm.safetensors'" in m.log()


@pytest.mark.mount
def test_unmount_during_prefetch_is_clean(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    data = model_bytes(tmp_path, 128 * MiB, seed=2)
    bucket = new_bucket(moto_server)
    moto_server.client().upload_fileobj(io.BytesIO(data), bucket, "m.safetensors")
    with mounted(moto_server, bucket, mountpoint, "--max-connections", "2") as m:
        with open(mountpoint / "m.safetensors", "rb") as f:
            assert f.read(8) == data[:8]
        # the handle is closed: prefetch is cancelled; the unmount below must not wait for it
    assert "prefetching 'm.safetensors'" in m.log()


@pytest.mark.mount
def test_modelfs_prefetch_command_warms_the_cache(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    import subprocess

    from tests.conftest import REPO, modelfs_cmd

    bucket = new_bucket(moto_server)
    client = moto_server.client()
    payload = {f"model/shard-{i}.bin": os.urandom(5 * MiB + i) for i in range(3)}
    for key, body in payload.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(cache), "--cache-size", "1G") as m:
        res = subprocess.run(modelfs_cmd("prefetch", str(mountpoint / "model")), capture_output=True,
                             text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        assert f"prefetched {sum(map(len, payload.values()))} bytes" in res.stdout
        assert "prefetch" in res.stderr  # the progress bar
        res = subprocess.run(modelfs_cmd("prefetch", str(tmp_path)), capture_output=True, text=True, env=env)
        assert res.returncode == 1 and "not on a modelfs mount" in res.stderr
        res = subprocess.run(modelfs_cmd("prefetch", str(mountpoint / "nope")), capture_output=True, text=True,
                             env=env)
        assert res.returncode == 1 and "no such file" in res.stderr
    stored = sum(f.stat().st_size for f in (cache / "chunks").rglob("*") if f.is_file())
    assert stored >= sum(map(len, payload.values()))
    assert "origin requests=" in m.log()


@pytest.mark.mount
def test_opening_one_shard_warms_the_others(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    import re
    import time

    from safetensors.numpy import load_file

    from fsmount.testing.models import write_sharded_model

    model = write_sharded_model(tmp_path / "sharded", 48 * MiB, shards=4, seed=3)
    bucket = new_bucket(moto_server)
    client = moto_server.client()
    for f in (tmp_path / "sharded").iterdir():
        client.upload_file(str(f), bucket, f"llm/{f.name}")
    total = sum(f.stat().st_size for f in model.files)
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(tmp_path / "cache")) as m:
        shards = sorted(p.name for p in model.files)
        with open(mountpoint / "llm" / shards[0], "rb") as f:
            f.read(8)
        deadline = time.monotonic() + 60
        while not all(f"prefetching 'llm/{name}'" in m.log() for name in shards[1:]):
            assert time.monotonic() < deadline, "the other shards were not warmed"
            time.sleep(0.2)
        # The warming is over once every chunk of the other shards (nothing else reads them) has been
        # fetched and written through to the NVMe cache.
        warmed = [cache_file(tmp_path / "cache", bucket, f"llm/{name}",
                             client.head_object(Bucket=bucket, Key=f"llm/{name}")["ETag"], index)
                  for name in shards[1:]
                  for index in range(-(-(tmp_path / "sharded" / name).stat().st_size // DEFAULT_CHUNK_SIZE))]
        while missing := [p for p in warmed if not p.exists()]:
            assert time.monotonic() < deadline, f"{len(missing)} of {len(warmed)} chunks of the other shards " \
                                                "never reached the cache"
            time.sleep(0.1)
        for path in model.files:
            src = load_file(path)
            got = load_file(mountpoint / "llm" / path.name)
            assert src.keys() == got.keys()
            assert all(np.array_equal(src[k], got[k]) for k in src)
    origin = int(re.search(r"origin requests=\d+ bytes=(\d+)", m.log()).group(1))
    assert origin <= total * 1.05, (origin, total)  # every byte fetched from the origin about once


@pytest.mark.mount
def test_modelfs_prefetch_while_a_server_loads(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    import subprocess

    from safetensors.numpy import load_file

    from tests.conftest import REPO, modelfs_cmd

    data = model_bytes(tmp_path, 64 * MiB, seed=4)
    bucket = new_bucket(moto_server)
    moto_server.client().upload_fileobj(io.BytesIO(data), bucket, "m/model.safetensors")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(tmp_path / "cache")):
        warm = subprocess.Popen(modelfs_cmd("prefetch", "-q", str(mountpoint / "m")), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = load_file(mountpoint / "m/model.safetensors")
        out, err = warm.communicate(timeout=120)
        assert warm.returncode == 0, err
        src = load_file(tmp_path / "m4.safetensors")
        assert got.keys() == src.keys() and all(np.array_equal(got[k], src[k]) for k in src)


async def test_chunks_readers_already_read_are_not_pushed_again(autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001, F811
    """READs put their bytes in the page cache; pushing the same chunk would copy it there twice."""
    import fsmount.pagecache

    stored: list[int] = []
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: stored.append(off))
    store = FakeStore()
    store.put("m.safetensors", model_bytes(tmp_path, 12 * MiB))
    engine = make_engine(store, conns=4, memory=256 * MiB)
    prefetcher = ModelPrefetcher(engine, PageCachePusher(1 << 40), max_connections=4)

    async def body() -> None:
        async with trio.open_nursery() as n:
            await n.start(prefetcher.run)
            v = version(store, "m.safetensors")
            await engine.read(v, 0, 3 * CHUNK + 100)  # a reader got through chunks 0-3 first
            prefetcher.opened(2, v)
            await prefetcher._active[(v.key, v.etag)].done.wait()
            chunks = len(engine.chunk_range(v, 0, v.size))
            assert sorted(stored) == [i * CHUNK for i in range(4, chunks)]
            assert prefetcher.skipped_read == 4 * CHUNK
            prefetcher.closed(v)
            n.cancel_scope.cancel()

    await run_engine(engine, body)


async def test_a_queued_push_asks_again_whether_it_is_wanted(monkeypatch) -> None:
    import fsmount.pagecache

    stored: list[int] = []
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: stored.append(off))
    pusher = PageCachePusher(1 << 40)
    wanted = True
    results: list[bool] = []

    async def push(offset: int) -> None:
        results.append(await pusher.push(2, offset, 4096, lambda: b"x" * 4096 if wanted else None))

    async with trio.open_nursery() as n:
        async with pusher._turn:  # another push is running: these two queue behind it
            n.start_soon(push, 0)
            await trio.testing.wait_all_tasks_blocked()
            wanted = False  # meanwhile READs took the bytes
        await trio.testing.wait_all_tasks_blocked()
    assert results == [False] and stored == [] and pusher.pushed == 0
    await push(4096)  # wanted() is still False: skipped at once
    wanted = True
    await push(8192)
    assert results == [False, False, True] and stored == [8192] and pusher.pushed == 4096
