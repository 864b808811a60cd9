"""Model-aware prefetch through real mounts: mmap readers while the page-cache pusher runs, unmount during a
prefetch, `modelfs prefetch`, and one shard warming the others. In virtual time: tests/unit/test_prefetch.py."""

from __future__ import annotations

import fcntl
import mmap
import os
import pty
import re
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fsmount.config import DEFAULT_CHUNK_SIZE
from fsmount.data import ChunkId
from fsmount.data.cache_dir import SHARD_HEX_CHARS
from fsmount.testing.fault_proxy import Fault, FaultProxy
from tests.helpers import (
    FETCH_FAILED,
    READ_FAILED,
    MiB,
    S3Server,
    bucket_with,
    drop_kernel_caches,
    drop_page_cache,
    model_bytes,
    modelfs_cmd,
    modelfs_env,
    mount_stats,
    mounted,
    mounted_via,
    new_bucket,
    put_objects,
    random_bytes,
    run_modelfs,
    sha,
    upload,
    wait_for,
)


def cache_file(cache: Path, bucket: str, key: str, etag: str, index: int) -> Path:
    """Where --cache-dir keeps a chunk (of the default size) once it is written through."""
    digest = ChunkId(bucket, key, etag, DEFAULT_CHUNK_SIZE, index).digest()
    return cache / "chunks" / digest[:SHARD_HEX_CHARS] / digest


@pytest.mark.parametrize("push_limit", ["0", "1G"])
def test_eight_mmap_readers_while_pushing(moto_server: S3Server, mountpoint: Path, tmp_path: Path,
                                          push_limit: str) -> None:
    from safetensors import safe_open

    data = model_bytes(tmp_path, 96 * MiB, seed=1)
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, {"m.safetensors": data})
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
                    if sha(mm[:]) != sha(data):
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
    assert "streaming 'm.safetensors'" in m.log()


def assert_no_read_but_of_dropped_pages(stats: dict) -> None:
    """No READ reached the daemon, unless the kernel had dropped pushed pages first. Under memory pressure from
    other processes it may reclaim some between the push and the read (a CI run once saw one 4 KiB READ after
    40 MiB pushed); the daemon counts each such READ in `pagecache_drops`. A READ of bytes never pushed counts
    no drop, so it still fails here."""
    if stats["pagecache_drops"] == 0:
        assert sum(stats["served_bytes"].values()) == 0, stats["served_bytes"]


def test_a_file_held_open_is_pushed_whole_and_read_without_a_request(moto_server: S3Server, mountpoint: Path,
                                                                        tmp_path: Path) -> None:
    """Model streaming pushes every chunk of a safetensors file opened and not read, the header's too (its own
    header reads are not READs), so the whole file is then read from the page cache: no READ reaches the
    daemon, and its stats count no byte as served."""
    data = model_bytes(tmp_path, 40 * MiB, seed=3)
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, {"m.safetensors": data})
    with mounted(moto_server, bucket, mountpoint, "--pagecache-push-limit", "1G"):
        path = mountpoint / "m.safetensors"
        with open(path, "rb"):
            wait_for("bytes pushed", lambda: mount_stats(mountpoint)["pagecache_stored_bytes"],
                     lambda n: n >= len(data))
            assert path.read_bytes() == data
        stats = mount_stats(mountpoint)
        assert_no_read_but_of_dropped_pages(stats)
        assert stats["pagecache_stored_bytes"] == len(data)


def test_a_file_the_kernel_dropped_while_open_is_streamed_again(moto_server: S3Server, mountpoint: Path,
                                                                 tmp_path: Path) -> None:
    """Pushed chunks are believed held by the page cache and not streamed again. The kernel may drop them
    while the file is open (memory pressure; here POSIX_FADV_DONTNEED): the next READ of one shows it, and the
    stream, which had ended, runs once more, so the rest of the file is pushed again before the loader faults
    on it."""
    data = model_bytes(tmp_path, 64 * MiB, seed=4)
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, {"m.safetensors": data})
    with mounted(moto_server, bucket, mountpoint, "--pagecache-push-limit", "1G"):
        path = mountpoint / "m.safetensors"
        stored = lambda: mount_stats(mountpoint)["pagecache_stored_bytes"]  # noqa: E731
        with open(path, "rb", buffering=0) as f:
            wait_for("the file pushed", stored, lambda n: n >= len(data))
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(f.fileno(), 4096, 0) == data[:4096]
            # Pushed again beyond the reader's two read-ahead windows: the last chunks at least.
            wait_for("the file pushed again", stored, lambda n: n >= len(data) + 8 * MiB)
            assert f.read() == data
        assert mount_stats(mountpoint)["pagecache_drops"] == 1  # the first READ told; the file's beliefs went


def test_a_file_that_lost_a_few_pages_while_open_has_only_those_chunks_streamed_again(
        moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """Reclaim takes a few pages of a file, not the file (and some hosts reclaim cold page cache with memory
    free: DAMON's pageout in this dev box's VM took 1 MiB of pushed shards within seconds). The READ that
    finds them gone cannot tell how much went, so the stream that runs again asks the kernel what it still
    holds (residency.py): at most the chunk that lost pages is fetched and pushed again, not the file."""
    data = model_bytes(tmp_path, 64 * MiB, seed=5)
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, {"m.safetensors": data})
    chunk = DEFAULT_CHUNK_SIZE
    with mounted(moto_server, bucket, mountpoint, "--pagecache-push-limit", "1G") as m:
        path = mountpoint / "m.safetensors"
        stats = lambda: mount_stats(mountpoint)  # noqa: E731
        with open(path, "rb", buffering=0) as f:
            wait_for("the file pushed", lambda: stats()["pagecache_stored_bytes"], lambda n: n >= len(data))
            before = stats()
            lost = 3 * chunk + MiB  # 2 MiB in the fourth chunk, as reclaim takes them
            os.posix_fadvise(f.fileno(), lost, 2 * MiB, os.POSIX_FADV_DONTNEED)
            assert os.pread(f.fileno(), 4096, lost) == data[lost:lost + 4096]
            line = wait_for("the stream run again", m.log,
                            lambda log: "streaming 'm.safetensors' again: the page cache lacks" in log)
            # The READ's own pages are back by then (the kernel caches what READs return): at most their chunk.
            assert re.search(r"again: the page cache lacks [01] of its \d+ chunks", line), line[-2000:]
            assert f.read() == data
        after = stats()
        assert after["pagecache_drops"] == 1
        # The fourth chunk at most, once for the READ and once for its push again; before, the whole file.
        fetched = after["origin"]["bytes"] - before["origin"]["bytes"]
        assert fetched <= chunk, fetched
        assert after["pagecache_stored_bytes"] - before["pagecache_stored_bytes"] <= chunk


def gets_within(times: list[float], seconds: float) -> int:
    """The most requests that started within any `seconds` of each other."""
    times = sorted(times)
    return max((sum(1 for u in times[i:] if u < t + seconds) for i, t in enumerate(times)), default=0)


def test_a_file_read_again_after_the_kernel_dropped_it_is_read_ahead_again(moto_server: S3Server,
                                                                           proxy: FaultProxy,
                                                                           mountpoint: Path) -> None:
    """A chunk READs took whole is believed held by the page cache, and read-ahead skips it. Once the kernel
    dropped the file, a second reader's READs show it, and its chunks are read ahead again: with 0.3 s per GET,
    several GETs start within 0.3 s of each other, as they did for the first reader, where without that each
    chunk was fetched only when its own READ came (1 MiB chunks, 1 MiB kernel read-ahead: 1 or 2 at a time).
    The daemon's memory (16 MiB of chunks) holds a third of the file, so most chunks come from the origin again."""
    data = random_bytes(48 * MiB, seed=5)
    bucket = bucket_with(moto_server, {"blob.bin": data})
    latency = 0.3
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--chunk-size", "1M", "--kernel-readahead", "1M",
                     "--max-readahead", "16M", "--memory-limit", "112M"):
        path = mountpoint / "blob.bin"
        proxy.inject(Fault.LATENCY, seconds=latency)
        bursts = []
        for _ in range(2):
            drop_page_cache(path)
            seen = len(proxy.log())
            with open(path, "rb", buffering=0) as f:
                out = b"".join(iter(lambda: f.read(128 * 1024), b""))
            assert out == data
            bursts.append(gets_within([e.t for e in proxy.log()[seen:] if e.range], latency))
        assert bursts[0] >= 5, bursts
        assert bursts[1] >= 5, bursts


@pytest.mark.parametrize("readers", [1, 2])
def test_models_larger_than_memory_are_fetched_once(moto_server: S3Server, mountpoint: Path, tmp_path: Path,
                                                    readers: int) -> None:
    """Model streaming and read-ahead together hold no more chunks than the daemon's memory, so nothing they
    fetched is evicted before its push or its READ and fetched again. 8 MiB of chunk memory (1 MiB chunks) for
    `readers` models of 48 MiB read whole at once, each streamed while it is read: each byte is fetched once.
    Before, every stream queued 32 chunks (16 connections x 2) and the kernel kept 2 x 16 MiB of READs
    requested, whatever the memory: 1.3-1.7x the bytes were fetched (a 1.07 GB model at --memory-limit 256M,
    1.13-1.57x); and a stream that waited for room fetched chunks the reader had meanwhile taken whole."""
    models = {f"m{i}.safetensors": model_bytes(tmp_path, 48 * MiB, seed=10 + i) for i in range(readers)}
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, models)
    errors: list[str] = []
    with mounted(moto_server, bucket, mountpoint, "--chunk-size", "1M", "--memory-limit", "104M",
                 "--pagecache-push-limit", "1G") as m:
        # The kernel's window is an eighth of the 8 MiB of chunk memory, not the 16 MiB default.
        assert "set to 1024 KiB" in m.log() or "could not raise kernel readahead" in m.log()
        before = mount_stats(mountpoint)["origin"]["bytes"]

        def read(name: str) -> None:
            try:
                with open(mountpoint / name, "rb", buffering=0) as f:
                    if b"".join(iter(lambda: f.read(128 * 1024), b"")) != models[name]:
                        errors.append(f"{name}: wrong bytes")
            except OSError as exc:
                errors.append(f"{name}: {exc!r}")

        threads = [threading.Thread(target=read, args=(name,)) for name in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        stats = mount_stats(mountpoint)
        fetched = stats["origin"]["bytes"] - before
    total = sum(len(d) for d in models.values())
    # Up to one chunk per model more: a read-ahead fetch may still be evicted by the READ of a chunk the
    # kernel asked for out of turn. (Unless the kernel dropped pushed pages meanwhile, on a busy host: then
    # they are fetched again, at most once more.)
    most = total + readers * MiB if stats["pagecache_drops"] == 0 else 2 * total + readers * MiB
    assert total <= fetched <= most, (fetched / total, fetched, total, stats["pagecache_drops"])


@pytest.mark.parametrize("memory", ["256M", "2G"])
def test_a_loader_in_name_order_with_little_memory_has_the_stream_as_its_read_ahead(
        seaweed_server: S3Server, mountpoint: Path, tmp_path: Path, memory: str) -> None:
    """safe_open's keys() are sorted by name, not by offset: each tensor is read where it lies. Where memory
    held less than a read-ahead window per reader (256M: 160 MiB of chunks), a handle's read-ahead past the
    reader's tensor fetched chunks of tensors wanted later, and they were evicted before their READs came: a
    model of 512 MiB was fetched 1.34 times (1.28 at 192M). A file being streamed now gets no read-ahead of its
    own there (the stream fetches it in offset order). With room (2G) read-ahead stays, and the model is fetched
    once."""
    from safetensors import safe_open

    data = model_bytes(tmp_path, 512 * MiB, seed=31)
    bucket = new_bucket(seaweed_server)
    upload(seaweed_server, bucket, {"m.safetensors": data})
    drop_kernel_caches(3)
    with mounted(seaweed_server, bucket, mountpoint, "--memory-limit", memory):
        before = mount_stats(mountpoint)["origin"]["bytes"]
        with safe_open(str(mountpoint / "m.safetensors"), "np") as f, \
                safe_open(str(tmp_path / "m31.safetensors"), "np") as want:
            for key in f.keys():
                assert np.array_equal(f.get_tensor(key), want.get_tensor(key)), key
        stats = mount_stats(mountpoint)
        fetched = stats["origin"]["bytes"] - before
    if stats["pagecache_drops"] == 0:
        assert fetched <= 1.05 * len(data), fetched / len(data)
    else:  # the kernel dropped pushed pages (a busy host): the stream ran once more, at most once per open
        assert fetched <= 2.05 * len(data), fetched / len(data)


def test_unmount_during_prefetch_is_clean(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    data = model_bytes(tmp_path, 128 * MiB, seed=2)
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, {"m.safetensors": data})
    with mounted(moto_server, bucket, mountpoint, "--max-connections", "2") as m:
        with open(mountpoint / "m.safetensors", "rb") as f:
            assert f.read(8) == data[:8]
        # the handle is closed: prefetch is cancelled; the unmount below must not wait for it
    assert "streaming 'm.safetensors'" in m.log()


def prefetch_on_a_terminal(path: Path) -> str:
    """What `modelfs prefetch PATH` writes to stderr when stderr is a terminal (a pty)."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    try:
        proc = subprocess.run(modelfs_cmd("prefetch", str(path)), stdout=subprocess.DEVNULL, stderr=sub,
                              env=modelfs_env(), timeout=120)
        os.close(sub)
        sub = -1
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
        if sub >= 0:
            os.close(sub)
    assert proc.returncode == 0, out
    return out.decode(errors="replace")


def test_modelfs_prefetch_command_warms_the_cache(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    payload = {f"model/shard-{i}.bin": os.urandom(5 * MiB + i) for i in range(3)}
    put_objects(moto_server, bucket, payload)
    cache = tmp_path / "cache"
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(cache), "--cache-size", "1G") as m:
        # A file named twice (by its directory and by itself) is read and counted once.
        res = run_modelfs("prefetch", str(mountpoint / "model"), str(mountpoint / "model" / "shard-1.bin"),
                          timeout=120)
        assert res.returncode == 0, res.stderr
        assert f"prefetched {sum(map(len, payload.values()))} bytes" in res.stdout
        assert res.stderr == ""  # no progress bar into a pipe or a log file
        res = run_modelfs("prefetch", "--threads", "0", str(mountpoint / "model"))
        assert res.returncode == 2 and "--threads must be at least 1" in res.stderr
        assert "prefetch: " in prefetch_on_a_terminal(mountpoint / "model")  # the progress bar
        res = run_modelfs("prefetch", str(tmp_path), timeout=None)
        assert res.returncode == 1 and "not on a modelfs mount" in res.stderr
        res = run_modelfs("prefetch", str(mountpoint / "nope"), timeout=None)
        assert res.returncode == 1 and "no such file" in res.stderr
        # A path not found among others does not stop them (B143).
        res = run_modelfs("prefetch", str(mountpoint / "model" / "shard-2.bin"), str(mountpoint / "nope"), timeout=None)
        assert res.returncode == 1 and "1 of 2 paths given was not read" in res.stderr, res.stderr
        assert f"prefetched {len(payload['model/shard-2.bin'])} bytes" in res.stdout, res.stdout
        # Not on the mount either: named as not found, not its file system said to be no modelfs mount.
        res = run_modelfs("prefetch", str(mountpoint / "model" / "shard-2.bin"), str(tmp_path / "nope"), timeout=None)
        assert res.returncode == 1 and f"1 of 2 paths given was not read ({tmp_path / 'nope'}: no such file" \
            in res.stderr, res.stderr
        # Nor a path on another file system: it is named, not read, and the others are (B496); a directory, counted as
        # a path given, not as a file (B1085).
        res = run_modelfs("prefetch", str(tmp_path), str(mountpoint / "model" / "shard-2.bin"), timeout=None)
        assert res.returncode == 1 and f"1 of 2 paths given was not read ({tmp_path} is not on a modelfs mount); one " \
            "file was read" in res.stderr, res.stderr
        assert f"prefetched {len(payload['model/shard-2.bin'])} bytes" in res.stdout, res.stdout
    stored = sum(f.stat().st_size for f in (cache / "chunks").rglob("*") if f.is_file())
    assert stored >= sum(map(len, payload.values()))
    assert "origin requests=" in m.log()


def test_opening_one_shard_warms_the_others(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """Opening one shard warms the model's other shards (not an adapter beside them, which sorts first), and
    what the warming pushed into the page cache for files nobody opened does not stay counted against the
    push limit (it did, so pushing stopped for good once the limit was reached)."""
    from safetensors.numpy import load_file

    from fsmount.testing.models import write_model, write_sharded_model

    model = write_sharded_model(tmp_path / "sharded", 48 * MiB, shards=4, seed=3)
    write_model(tmp_path / "sharded" / "adapter.safetensors", 12 * MiB, seed=4)
    bucket = new_bucket(moto_server)
    client = moto_server.client()
    upload(moto_server, bucket, {f"llm/{f.name}": f for f in (tmp_path / "sharded").iterdir()})
    total = sum(f.stat().st_size for f in model.files)
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(tmp_path / "cache")) as m:
        shards = sorted(p.name for p in model.files)
        for path in (mountpoint / "llm").iterdir():
            path.stat()  # the kernel knows every file: the warming pushes them into the page cache
        with open(mountpoint / "llm" / shards[0], "rb") as f:
            f.read(8)
        deadline = time.monotonic() + 60
        while not all(f"streaming 'llm/{name}'" in m.log() for name in shards[1:]):
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
        # open_files too: close() returns before the kernel's RELEASE reaches the daemon.
        stats = wait_for("the warming's pushes and the RELEASEs given back", lambda: mount_stats(mountpoint),
                         lambda st: st["pagecache_pushed_bytes"] == 0 and st["open_files"] == 0, timeout=30,
                         interval=0.1)
        assert stats["streamed_bytes"] <= total
        assert "streaming 'llm/adapter.safetensors'" not in m.log()
        for path in model.files:
            src = load_file(path)
            got = load_file(mountpoint / "llm" / path.name)
            assert src.keys() == got.keys()
            assert all(np.array_equal(src[k], got[k]) for k in src)
    origin = int(re.search(r"origin requests=\d+ bytes=(\d+)", m.log()).group(1))
    assert origin <= total * 1.05, (origin, total)  # every byte fetched from the origin about once


def test_shards_opened_by_name_are_warmed_into_the_page_cache(s3: S3Server, mountpoint: Path,
                                                               tmp_path: Path) -> None:
    """transformers opens each shard by name, from the index, so the kernel has not looked the next shards up
    while the current one loads. Warming could not push them, only hold their chunks in memory, where the
    shard being loaded evicted them before they were opened (1.12-1.25x the bytes fetched at
    --memory-limit 256M). The daemon now looks them up through its own mount, by the names their keys give
    (a space and a non-ASCII letter here, on both servers): opening one shard, and nothing else, pushes every
    shard into the page cache, and reading them after that sends no READ."""
    from fsmount.testing.models import write_sharded_model

    model = write_sharded_model(tmp_path / "sharded", 24 * MiB, shards=3, seed=6)
    folder = "my llm/größe"
    bucket = new_bucket(s3)
    upload(s3, bucket, {f"{folder}/{f.name}": f for f in (tmp_path / "sharded").iterdir()})
    total = sum(f.stat().st_size for f in model.files)
    with mounted(s3, bucket, mountpoint, "--pagecache-push-limit", "1G"):
        shards = sorted(model.files)
        with open(mountpoint / folder / shards[0].name, "rb"):
            wait_for("every shard pushed", lambda: mount_stats(mountpoint)["pagecache_stored_bytes"],
                     lambda n: n >= total, timeout=30, interval=0.1)
        for shard in shards:
            assert (mountpoint / folder / shard.name).read_bytes() == shard.read_bytes()
        stats = mount_stats(mountpoint)
        assert_no_read_but_of_dropped_pages(stats)
        if stats["pagecache_drops"] == 0:
            assert stats["origin"]["bytes"] == total  # the index was never read


def test_modelfs_prefetch_while_a_server_loads(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    data = model_bytes(tmp_path, 64 * MiB, seed=4)
    bucket = new_bucket(moto_server)
    upload(moto_server, bucket, {"m/model.safetensors": data})
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(tmp_path / "cache")):
        warm = subprocess.Popen(modelfs_cmd("prefetch", "-q", str(mountpoint / "m")), env=modelfs_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = load_file(mountpoint / "m/model.safetensors")
        out, err = warm.communicate(timeout=120)
        assert warm.returncode == 0, err
        src = load_file(tmp_path / "m4.safetensors")
        assert got.keys() == src.keys() and all(np.array_equal(got[k], src[k]) for k in src)


def test_modelfs_prefetch_right_after_a_new_revision_reads_the_new_one(s3: S3Server, mountpoint: Path) -> None:
    """A revision pushed while the mount is up (B750): the files the mount listed before are read as the bucket holds
    them now, not failed with EIO until --metadata-ttl has passed; one deleted since is named as such."""
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {f"m/f{i}.bin": random_bytes(3 * MiB, i) for i in range(3)})
    with mounted(s3, bucket, mountpoint, "--metadata-ttl", "600", allowed=(FETCH_FAILED, READ_FAILED)) as m:
        assert sorted(os.listdir(mountpoint / "m")) == ["f0.bin", "f1.bin", "f2.bin"]  # listed: the old versions
        new = random_bytes(5 * MiB, 7)
        put_objects(s3, bucket, {"m/f2.bin": new})
        s3.client().delete_object(Bucket=bucket, Key="m/f1.bin")
        res = run_modelfs("prefetch", str(mountpoint / "m"), timeout=120)
        assert res.returncode == 1, res.stderr
        assert f"1 of 3 files could not be read ({mountpoint / 'm' / 'f1.bin'}: deleted from the bucket since the " \
            "mount listed it); the other 2 were read" in res.stderr, res.stderr
        assert f"prefetched {3 * MiB + len(new)} bytes" in res.stdout, res.stdout
        assert (mountpoint / "m" / "f2.bin").read_bytes() == new
    assert "object changed in the bucket since the mount saw the version asked for" in m.log()


def test_modelfs_prefetch_of_a_file_the_origin_fails_names_it_after_one_try(proxy: FaultProxy, moto_server: S3Server,
                                                                            mountpoint: Path) -> None:
    """The other side of B750: a file whose read fails with the daemon's own EIO (here its read timeout), the version
    unchanged, is named as an I/O error as before (not as deleted, nor read as a new version), within its timeout."""
    bucket = bucket_with(moto_server, {"m/f.bin": random_bytes(3 * MiB, 1)})
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--read-timeout", "2",
                     allowed=(FETCH_FAILED, READ_FAILED, "timed out", "timeout")):
        assert os.listdir(mountpoint / "m") == ["f.bin"]
        proxy.inject(Fault.STALL, seconds=60)
        started = time.monotonic()
        res = run_modelfs("prefetch", "--write-wait", "0", str(mountpoint / "m"), timeout=120)
        took = time.monotonic() - started
        assert res.returncode == 1 and f"1 of 1 files could not be read ({mountpoint / 'm' / 'f.bin'}: Input/output " \
            "error)" in res.stderr, res.stderr
        assert took < 2 * 2, took  # bounded by the read timeout


@pytest.mark.parametrize("new_size", [1 * MiB, 9 * MiB], ids=["smaller", "larger"])
def test_modelfs_prefetch_reads_the_version_it_opened_whole(s3: S3Server, mountpoint: Path, new_size: int) -> None:
    """A file replaced after the prefetch listed it and before it opened it, past --metadata-ttl (a revision pushed
    during a long prefetch): the open gets the new version, read to its own end (B751)."""
    bucket = bucket_with(s3, {f"m/f{i}.bin": random_bytes(4 * MiB, i) for i in range(3)})
    new = random_bytes(new_size, 9)
    with FaultProxy(s3.endpoint_url) as proxy, mounted_via(proxy, s3, bucket, mountpoint, "--metadata-ttl", "1"):
        # One thread: f2 is opened once f0 is read, whose first GET is held 3 s: the listing's sizes are then old.
        proxy.inject(Fault.LATENCY, seconds=3, times=1)
        with subprocess.Popen(modelfs_cmd("prefetch", "--threads", "1", str(mountpoint / "m")), env=modelfs_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as prefetch:
            wait_for("the prefetch's first GET", lambda: proxy.counts().get("data_gets", 0), timeout=60)
            put_objects(s3, bucket, {"m/f2.bin": new})
            out, err = prefetch.communicate(timeout=120)
        assert prefetch.returncode == 0, err
        assert f"prefetched {2 * 4 * MiB + new_size} bytes" in out, out
        assert (mountpoint / "m" / "f2.bin").read_bytes() == new



def test_modelfs_prefetch_on_a_dead_origin_fails_within_one_read_timeout(proxy: FaultProxy, moto_server: S3Server,
                                                                         mountpoint: Path) -> None:
    """B750's open again of a file whose read failed, on an origin that answers nothing (HEADs too), opened within
    --metadata-ttl and read past it (a TTL below the read timeout, as the defaults are): that open asked the dead
    origin once more, and the file took two read timeouts to fail."""
    bucket = bucket_with(moto_server, {"m/f.bin": random_bytes(3 * MiB, 1)})
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--read-timeout", "4", "--metadata-ttl", "3",
                     allowed=(FETCH_FAILED, READ_FAILED, "timed out", "timeout", "did not answer", "origin")):
        assert os.listdir(mountpoint / "m") == ["f.bin"]
        proxy.inject(Fault.STALL, seconds=60, data_only=False)
        started = time.monotonic()
        res = run_modelfs("prefetch", "--write-wait", "0", str(mountpoint / "m" / "f.bin"), timeout=120)
        took = time.monotonic() - started
        assert res.returncode == 1 and f"1 of 1 files could not be read ({mountpoint / 'm' / 'f.bin'}: Input/output " \
            "error)" in res.stderr, res.stderr
        assert took < 4 * 1.5, took  # one read timeout, not two
