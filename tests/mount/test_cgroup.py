"""A daemon in a memory-limited cgroup (a Kubernetes pod, a systemd unit with MemoryMax=), through a real mount:
its defaults follow the cgroup's limit, not the machine's.

Before, a pod of 600 MiB got the machine's defaults: a --memory-limit of 2 GiB, so the cgroup killed the
daemon (OOM) in the middle of a load, and page-cache pushes sized by the host's MemAvailable, so the cgroup
evicted pushed pages before the loader reached them and the model was fetched several times.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsmount import sysmem
from fsmount.testing.models import write_model
from tests.helpers import (
    MiB,
    S3Server,
    drop_kernel_caches,
    mount_stats,
    mounted,
    new_bucket,
    random_bytes,
    sha,
    tmpfs,
    upload,
)

CGROUP_LIMIT = 600 * MiB
MODEL_SIZE = 512 * MiB  # more than the page cache of the cgroup can hold beside the daemon and the loader

# safe_open + get_tensor in the order of keys() (sorted by name, not by offset: vLLM's loader), each tensor
# hashed and let go; prints one digest over all of them.
LOADER = """
import hashlib, sys
from safetensors import safe_open
h = hashlib.sha256()
with safe_open(sys.argv[1], "np") as f:
    for k in f.keys():
        h.update(k.encode() + f.get_tensor(k).tobytes())
print(h.hexdigest())
"""


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A child of this process's memory cgroup, limited to CGROUP_LIMIT; removed afterwards."""
    with limited_cgroup(CGROUP_LIMIT) as child:
        yield child


@contextlib.contextmanager
def limited_cgroup(limit: int) -> Iterator[Path]:
    """A child of this process's memory cgroup, limited to `limit` bytes; removed afterwards."""
    dirs = sysmem.memory_cgroup_dirs(Path("/proc/self"))
    if not dirs or os.geteuid() != 0:
        pytest.skip("no memory cgroup to make a child in (needs root and a mounted memory controller)")
    child = dirs[0] / f"modelfs-test-{os.getpid()}"
    child.mkdir(exist_ok=True)
    try:
        limit_file = child / ("memory.max" if (child / "memory.max").exists() else "memory.limit_in_bytes")
        try:
            limit_file.write_text(str(limit))
        except OSError as exc:
            pytest.skip(f"cannot limit a child cgroup's memory here: {exc}")
        yield child
    finally:
        for _ in range(50):
            try:
                child.rmdir()
                break
            except OSError:  # its last processes are still exiting
                time.sleep(0.1)


def in_cgroup(cgroup: Path) -> tuple[str, ...]:
    """A command prefix that runs the command after it inside `cgroup`."""
    return ("/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup))


def test_a_daemon_in_a_small_cgroup_loads_a_larger_model_without_dying_or_fetching_it_again(
        seaweed_server: S3Server, mountpoint: Path, tmp_path: Path, cgroup: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_model(path, MODEL_SIZE, seed=21)
    expected = subprocess.run([sys.executable, "-c", LOADER, str(path)], capture_output=True, text=True,
                              check=True).stdout
    bucket = new_bucket(seaweed_server)
    upload(seaweed_server, bucket, {"m/model.safetensors": path})
    size = path.stat().st_size
    path.unlink()
    drop_kernel_caches(3)
    with mounted(seaweed_server, bucket, mountpoint, wrap=in_cgroup(cgroup)) as m:
        log = m.log()
        # A tenth of the cgroup's 600 MiB (the machine has more), and half of what the cgroup has left.
        assert "memory limit 60 MiB" in log, log[-3000:]
        pushes = [line for line in log.splitlines() if "page-cache pushes: at most" in line]
        assert pushes and int(pushes[0].split("at most ")[1].split()[0]) <= CGROUP_LIMIT // 2 // MiB, pushes
        before = mount_stats(mountpoint)["origin"]["bytes"]
        got = subprocess.run([*in_cgroup(cgroup), sys.executable, "-c", LOADER,
                              str(mountpoint / "m/model.safetensors")], capture_output=True, text=True, timeout=300)
        assert m.proc.poll() is None, f"the daemon died ({m.proc.returncode}):\n{m.log()[-3000:]}"
        assert got.returncode == 0, got.stderr[-3000:]
        assert got.stdout == expected
        origin = mount_stats(mountpoint)["origin"]
        fetched = origin["bytes"] - before
    # What the origin sent beyond one copy of the model is what the stats call fetched again (the header's
    # chunk is the model's first chunk, so the stream's peek at it is no extra copy).
    assert origin["refetched_bytes"] == origin["bytes"] - size, origin
    # The cgroup's page cache cannot hold the model, and the loader's order is not the file's: the kernel evicts
    # pages it read around a fault before the loader gets to them, and they are fetched again (2.05-2.1 times
    # with no pushes at all, 1.9-2.2 with them). Before: 3.6-4.1 times.
    assert fetched <= 2.8 * size, f"fetched {fetched / size:.2f} times the model"


TMPFS_CACHE_WARNING = r"cache dir .* is on tmpfs, memory charged to this daemon's cgroup"


def test_a_cache_dir_on_tmpfs_stays_within_the_daemon_s_cgroup(seaweed_server: S3Server, mountpoint: Path,
                                                                  tmp_path: Path) -> None:
    """A sidecar whose --cache-dir is a pod's emptyDir with `medium: Memory` (a tmpfs sized by the node, or by the
    pod's limit): the cache's chunks are memory charged to the daemon's cgroup, which cannot reclaim them, and the
    cache's default size (80% of the tmpfs) paid no heed to the cgroup's limit. A 300 MiB cgroup with a 2 GiB tmpfs
    had the daemon OOM-killed once the cache held about 170 MiB: the reads got ENOTCONN, the mount was left dead
    (B901). Now the cache holds at most half of what the cgroup has left beyond --memory-limit, said in a warning."""
    files = {f"m/p{i}.bin": random_bytes(80 * MiB, seed=900 + i) for i in range(4)}
    bucket = new_bucket(seaweed_server)
    upload(seaweed_server, bucket, files)
    with limited_cgroup(300 * MiB) as group, tmpfs(tmp_path / "emptydir", "size=2g") as emptydir, \
            mounted(seaweed_server, bucket, mountpoint, "--cache-dir", str(emptydir / "cache"),
                    wrap=in_cgroup(group), allowed=(TMPFS_CACHE_WARNING,)) as m:
        for key, data in files.items():
            got = subprocess.run(["sha256sum", str(mountpoint / key)], capture_output=True, text=True, check=False)
            assert got.stdout.split()[:1] == [sha(data)], \
                f"{key}: {got.stderr.strip()}; the daemon's status: {m.proc.poll()} (-9: killed)"
        assert m.proc.poll() is None
        said = [line for line in m.log().splitlines() if re.search(TMPFS_CACHE_WARNING, line)]
        assert len(said) == 1, m.log()[-3000:]
        bound = re.search(r"the cache holds at most ([0-9.]+) MiB", said[0])
        assert bound, said
        cached = mount_stats(mountpoint)["disk_cache"]
        assert cached["max_bytes"] <= (float(bound.group(1)) + 0.01) * MiB, cached  # as said, to its rounding
        assert 0 < cached["bytes_used"] <= cached["max_bytes"], cached
