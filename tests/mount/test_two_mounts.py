"""Two modelfs mounts on one node, as an operator of a GPU fleet runs them (two instances of the systemd unit, or two
`modelfs mount` commands): their cache dirs, their numbers, and stopping one while the other serves."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from tests.helpers import (
    MiB,
    S3Server,
    bucket_with,
    daemon_env,
    free_port,
    mount_stats,
    mounted,
    mounted_at,
    random_bytes,
    run_modelfs,
    unmount,
)
from tests.mount.test_operator import metric


def test_two_mounts_keep_their_own_caches_numbers_and_lifetimes(moto_server: S3Server, tmp_path: Path) -> None:
    """Each mount's `modelfs stats`, `/metrics` and cache dir are its own; unmounting one leaves the other's reader
    reading the right bytes. A third mount given the cache dir of a live one (two unit instances' settings files
    naming one --cache-dir) exited 1, which the unit started again every 5 s for as long as the other was mounted,
    naming only a pid: now exit 2 (B1042), naming the mount that holds it; nothing of that cache is lost."""
    a_data, b_data = random_bytes(20 * MiB, seed=1), random_bytes(12 * MiB, seed=2)
    a_bucket = bucket_with(moto_server, {"m/a.bin": a_data})
    b_bucket = bucket_with(moto_server, {"m/b.bin": b_data})
    a_mp, b_mp, c_mp = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a_cache, b_cache = tmp_path / "cache-a", tmp_path / "cache-b"
    a_port, b_port = free_port(), free_port()
    with mounted(moto_server, a_bucket, a_mp, "--cache-dir", str(a_cache), "--metrics-addr", f"127.0.0.1:{a_port}"):
        with mounted(moto_server, b_bucket, b_mp, "--cache-dir", str(b_cache), "--metrics-addr",
                     f"127.0.0.1:{b_port}") as b:
            assert run_modelfs("prefetch", str(a_mp / "m"), str(b_mp / "m")).returncode == 0
            a_st, b_st = mount_stats(a_mp), mount_stats(b_mp)
            assert (a_st["disk_cache"]["chunks"], b_st["disk_cache"]["chunks"]) == (3, 2), (a_st, b_st)
            assert metric(a_port, "modelfs_disk_cache_used_bytes") == a_st["disk_cache"]["bytes_used"]
            assert metric(b_port, "modelfs_disk_cache_used_bytes") == b_st["disk_cache"]["bytes_used"]
            for mp, bucket in ((a_mp, a_bucket), (b_mp, b_bucket)):
                res = run_modelfs("stats", str(mp))
                assert res.returncode == 0 and bucket in res.stdout, res
            c_mp.mkdir()
            res = run_modelfs("mount", b_bucket, str(c_mp), "--endpoint-url", moto_server.endpoint_url,
                              "--cache-dir", str(a_cache), env=daemon_env(moto_server))
            try:
                assert f"cache dir {a_cache} is in use by the modelfs mount at {a_mp} (pid " in res.stderr, res.stderr
                assert res.returncode == 2 and not mounted_at(c_mp), res
            finally:
                unmount(c_mp)
            assert mount_stats(a_mp)["disk_cache"]["chunks"] == 3
            stopped: list[subprocess.CompletedProcess] = []
            with open(b_mp / "m/b.bin", "rb") as f:
                head = f.read(MiB)
                stopper = threading.Thread(target=lambda: stopped.append(run_modelfs("unmount", str(a_mp))))
                stopper.start()
                rest = f.read()
                stopper.join(60)
            assert head + rest == b_data
            assert stopped and stopped[0].returncode == 0, stopped
            assert not mounted_at(a_mp) and mounted_at(b_mp)
            assert (b_mp / "m/b.bin").read_bytes() == b_data
            assert b.proc.poll() is None
