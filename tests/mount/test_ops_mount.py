"""Running modelfs as infrastructure, with real daemons: READY=1 on NOTIFY_SOCKET, SIGTERM, journald, fstab
via `mount -t fuse.modelfs`, Prometheus metrics, `modelfs stats`, secrets kept out of logs, metrics and
argv. The systemd unit's file, the OSS client configuration and the log filter, in-process:
tests/unit/test_ops.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import (
    MOUNT_TIMEOUT,
    REPO,
    TEST_SECRET,
    MiB,
    S3Server,
    daemon_env,
    free_port,
    modelfs_cmd,
    modelfs_env,
    mount_stats,
    mounted,
    new_bucket,
    put_objects,
    run_modelfs,
    unmount,
    wait_for,
    warning_lines,
)

# Where /bin/sh looks for `modelfs` when mount(8) runs mount.fuse3: mount(8) drops PATH, so only the
# shell's built-in default path applies (dash: /usr/local/sbin:/usr/local/bin:/usr/sbin:...).
SHIM = Path("/usr/local/bin/modelfs")
SHIM_MARKER = "# modelfs test shim (tests/test_ops.py)"


def scrape(url: str) -> dict[str, float]:
    """Every sample of the metrics page, as 'name{label="v"}' -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def metrics_text(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def put_random(server: S3Server, bucket: str, key: str, size: int) -> bytes:
    data = os.urandom(size)
    put_objects(server, bucket, {key: data})
    return data


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert TEST_SECRET not in text


# -- the daemon under a service manager -------------------------------------------------------------

@contextlib.contextmanager
def foreground_daemon(server: S3Server, bucket: str, mountpoint: Path, *extra: str,
                      env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A `--foreground` daemon as systemd runs it; always unmounted and reaped."""
    log_path = mountpoint.parent / "daemon.log"
    cmd = modelfs_cmd("mount", bucket, str(mountpoint), "--foreground", "--endpoint-url", server.endpoint_url,
                      "--log-level", "debug", *extra)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**daemon_env(server), **(env or {})})
    try:
        yield proc, log_path
    finally:
        unmount(mountpoint)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def receive(sock: socket.socket, want: str, proc: subprocess.Popen, log_path: Path) -> list[str]:
    """sd_notify datagrams until one carries `want`."""
    got: list[str] = []
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while not any(want in m.splitlines() for m in got):
        if time.monotonic() > deadline:
            pytest.fail(f"no {want} within {MOUNT_TIMEOUT}s (got {got}):\n{log_path.read_text()[-3000:]}")
        sock.settimeout(0.2)
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            if proc.poll() is not None and want == "READY=1":
                pytest.fail(f"daemon exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
    return got


def test_ready_only_once_mount_answers_and_sigterm_unmounts(moto_server: S3Server, mountpoint: Path,
                                                            tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="weights/model.bin", Body=b"x" * 1000)
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(notify_path))
        with foreground_daemon(moto_server, bucket, mountpoint, env={"NOTIFY_SOCKET": str(notify_path)}) as (
                proc, log_path):
            messages = receive(sock, "READY=1", proc, log_path)
            # The moment READY=1 arrives, the mount must already answer.
            assert os.path.ismount(mountpoint)
            assert os.listdir(mountpoint) == ["weights"]
            assert (mountpoint / "weights" / "model.bin").read_bytes() == b"x" * 1000
            assert messages.count("READY=1") == 1
            assert_no_secret(cmdline(proc.pid))
            # close() returns before the kernel's RELEASE reaches the daemon: wait for it, so that the stop
            # below finds no file open.
            wait_for("the RELEASE of model.bin", lambda: mount_stats(mountpoint)["open_files"], lambda n: n == 0)
            proc.send_signal(signal.SIGTERM)
            receive(sock, "STOPPING=1", proc, log_path)
            assert proc.wait(30) == 0
            assert not os.path.ismount(mountpoint)
            log = log_path.read_text()
    assert "received SIGTERM, unmounting (no file open)" in log and f"unmounted {mountpoint}" in log
    assert not warning_lines(log), log
    assert_no_secret(log)


def test_journald_gets_priority_prefixes(moto_server: S3Server, mountpoint: Path) -> None:
    # systemd passes JOURNAL_STREAM=dev:ino of the stderr it connected; a regular file stands in here.
    bucket = new_bucket(moto_server)
    log_path = mountpoint.parent / "daemon.log"
    with open(log_path, "wb") as log:
        st = os.fstat(log.fileno())
        env = {**daemon_env(moto_server), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        proc = subprocess.Popen(modelfs_cmd("mount", bucket, str(mountpoint), "--foreground", "--endpoint-url",
                                            moto_server.endpoint_url), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while "mounted bucket" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        unmount(mountpoint)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = log_path.read_text().splitlines()
    assert any(re.fullmatch(r"<6>INFO fsmount\.mount: mounted bucket .*", line) for line in lines), lines
    assert all(line.startswith("<") for line in lines), lines  # no timestamps: journald adds its own


# -- metrics ----------------------------------------------------------------------------------------

def test_metrics_show_bytes_moving_during_a_read(moto_server: S3Server, mountpoint: Path) -> None:
    bucket = new_bucket(moto_server)
    size = 40 * MiB + 123
    data = put_random(moto_server, bucket, "model.bin", size)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with mounted(moto_server, bucket, mountpoint, "--metrics-addr", f"127.0.0.1:{port}",
                 "--max-readahead", "0") as m:
        before = scrape(url)
        assert before["modelfs_origin_bytes_total"] == 0
        assert before['modelfs_served_bytes_total{source="origin"}'] == 0
        with open(mountpoint / "model.bin", "rb", buffering=0) as f:
            first = f.read(16 * MiB)
            during = scrape(url)  # the file is open and half read
            rest = f.read()
        # The kernel's RELEASE of the closed file arrives asynchronously: wait for it, bounded.
        after = wait_for("open files in the metrics", lambda: scrape(url), lambda s: s["modelfs_open_files"] == 0,
                         timeout=10)
        text = metrics_text(url)
        log = m.log()
        pid = m.proc.pid
        assert_no_secret(text, log, cmdline(pid))
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing-here", timeout=10)
        # A health check's HEAD (it got 501): the headers of a scrape, no body.
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as head:
            assert head.status == 200 and int(head.headers["Content-Length"]) > 0 and head.read() == b""
    assert first + rest == data

    def served(s: dict[str, float]) -> float:
        return sum(s[f'modelfs_served_bytes_total{{source="{src}"}}'] for src in ("memory", "cache", "origin"))

    assert 16 * MiB <= served(during) < size
    assert 16 * MiB <= during["modelfs_origin_bytes_total"] < size
    assert during["modelfs_open_files"] == 1
    # The kernel may ask for a page twice (a read-ahead folio dropped under load); memory answers it again.
    asked_again = served(after) - size
    assert 0 <= asked_again <= MiB
    assert after["modelfs_origin_bytes_total"] == size  # every chunk fetched once
    assert after["modelfs_origin_requests_total"] == after["modelfs_origin_get_seconds_count"] >= 6
    assert after["modelfs_origin_get_seconds_sum"] > 0
    assert after['modelfs_origin_get_seconds_bucket{le="+Inf"}'] == after["modelfs_origin_get_seconds_count"]
    assert after["modelfs_origin_errors_total"] == after["modelfs_origin_retries_total"] == 0
    assert "modelfs_failed_requests_total{" not in text  # none failed (a family with no sample is not shown)
    assert after["modelfs_open_files"] == 0
    assert after["modelfs_fetches_inflight"] == 0
    assert 0 < after["modelfs_memory_used_bytes"] <= after["modelfs_memory_limit_bytes"]
    assert after["modelfs_egress_saved_bytes_total"] == asked_again  # a cold read saves only pages asked again
    assert 0 <= after["modelfs_hit_ratio"] <= 1
    for name in ("modelfs_streamed_bytes_total", "modelfs_pagecache_pushed_bytes",
                 "modelfs_pagecache_stored_bytes_total", "modelfs_readahead_dropped_total",
                 "modelfs_pagecache_drops_total", "modelfs_cache_loaded_bytes_total",
                 "modelfs_origin_metadata_requests_total", "modelfs_origin_metadata_errors_total"):
        assert name in after
    assert "metrics on http://127.0.0.1:" in log


def test_metrics_port_in_use_is_a_preflight_error(moto_server: S3Server, mountpoint: Path) -> None:
    bucket = new_bucket(moto_server)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_modelfs("mount", bucket, str(mountpoint), "--foreground", "--endpoint-url", moto_server.endpoint_url,
                          "--metrics-addr", f"127.0.0.1:{port}", env=daemon_env(moto_server))
    assert res.returncode == 1
    assert f"--metrics-addr 127.0.0.1:{port}: address already in use" in res.stderr
    assert not os.path.ismount(mountpoint)


# -- modelfs stats ------------------------------------------------------------------------------------

def stats_cmd(mountpoint: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_modelfs("stats", str(mountpoint), *extra)


def table(output: str) -> dict[str, str]:
    return {line[:22].strip(): line[22:].strip() for line in output.splitlines()}


def test_stats_cold_then_warm_from_the_nvme_cache(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(moto_server)
    size = 20 * MiB + 5
    data = put_random(moto_server, bucket, "model.bin", size)
    cache_dir = tmp_path / "nvme"
    mp = tmp_path / "mnt"

    with mounted(moto_server, bucket, mp, "--cache-dir", str(cache_dir)):
        assert (mp / "model.bin").read_bytes() == data
        # Write-through to the NVMe cache runs in the background: wait until the chunks are there.
        cold = wait_for("chunks written through", lambda: json.loads(stats_cmd(mp, "--json").stdout),
                        lambda st: st["disk_cache"]["chunks"] >= 3, timeout=30, interval=0.1)
        assert "user.modelfs.stats" not in os.listxattr(mp)  # virtual, never copied by cp -a / rsync -X
        sub = stats_cmd(mp / "..")
        assert sub.returncode == 1 and "is not the root of a modelfs mount" in sub.stderr
    # Every READ was answered from the origin's fetches or memory. The kernel may ask for a page twice (a
    # read-ahead folio it dropped under load and read again), so the replies are at least the file, not exactly;
    # a page asked for again is answered from memory, and that counts as egress saved.
    assert cold["served_bytes"]["cache"] == 0
    asked_again = sum(cold["served_bytes"].values()) - size
    assert 0 <= asked_again <= MiB
    assert cold["origin"]["bytes"] == size and cold["egress_saved_bytes"] == asked_again
    assert cold["hit_ratio"] < 1

    # A new mount (empty memory and page cache) over the same NVMe cache: no byte from the origin.
    with mounted(moto_server, bucket, mp, "--cache-dir", str(cache_dir)):
        assert (mp / "model.bin").read_bytes() == data
        res = stats_cmd(mp)
        warm = json.loads(stats_cmd(mp, "--json").stdout)
    assert res.returncode == 0, res.stderr
    rows = table(res.stdout)
    assert warm["origin"]["bytes"] == 0 and warm["origin"]["requests"] == 0
    assert warm["cache_loaded_bytes"] == size
    asked_again = sum(warm["served_bytes"].values()) - size
    assert 0 <= asked_again <= MiB
    assert warm["egress_saved_bytes"] == size + asked_again
    assert warm["served_bytes"]["origin"] == 0
    assert warm["hit_ratio"] == 1.0
    assert warm["disk_cache"]["hits"] == 3 and warm["disk_cache"]["misses"] == 0
    # 20 MiB + 5 bytes, plus any page the kernel asked for twice (at most 1 MiB: 20.00 to 21.00 MiB).
    assert re.match(r"100\.0% of 2[01]\.\d\d MiB read", rows["hit ratio"]), res.stdout
    assert re.match(r"2[01]\.\d\d MiB", rows["origin egress saved"]), res.stdout
    assert rows["origin downloads"] == "0 B in 0 GETs, 0 failed", res.stdout
    assert rows["NVMe cache"].startswith("20.01 MiB of "), res.stdout  # data + a 4 KiB header per chunk
    assert rows["errors"] == "origin 0, cache corrupt 0, cache read 0, cache write 0", res.stdout
    assert {"read from memory", "read from NVMe cache", "read from origin", "origin GET latency",
            "NVMe cache lookups", "chunk memory", "model streaming", "now", "mount"} <= set(rows), res.stdout


def test_stats_of_dot_or_a_symlink_names_the_mount_s_own_path(moto_server: S3Server, tmp_path: Path) -> None:
    """`modelfs stats .` run inside the mount showed the mount as "." (and through a symlink, as the link): the
    table's mount row is the mount's path, as /proc/mounts has it."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"a": b"x"})
    mp = tmp_path / "mnt"
    (tmp_path / "link").symlink_to(mp)
    with mounted(moto_server, bucket, mp):
        here = subprocess.run(modelfs_cmd("stats", "."), cwd=mp, capture_output=True, text=True, timeout=60,
                              env=modelfs_env())
        linked = stats_cmd(tmp_path / "link")
    for res in (here, linked):
        assert res.returncode == 0, res.stderr
        assert table(res.stdout)["mount"].startswith(f"{mp} (bucket {bucket}, up "), res.stdout


def test_stats_of_a_path_that_is_not_a_mount(tmp_path: Path) -> None:
    res = stats_cmd(tmp_path)
    assert res.returncode == 1 and "is not the root of a modelfs mount" in res.stderr


# -- fstab: mount -t fuse.modelfs ------------------------------------------------------------------

@pytest.fixture
def modelfs_on_default_path() -> Iterator[None]:
    """mount(8) runs mount.fuse3 without PATH, and mount.fuse3 runs `/bin/sh -c 'exec modelfs ...'`,
    so `modelfs` must be in the shell's default path. Install a shim there for this test only."""
    if SHIM.exists() and SHIM_MARKER not in SHIM.read_text(errors="replace"):
        pytest.skip(f"{SHIM} exists and is not the test shim; not touching it")
    if not os.access(SHIM.parent, os.W_OK):
        pytest.skip(f"cannot write {SHIM.parent}")
    SHIM.write_text(f"#!/bin/sh\n{SHIM_MARKER}: runs this checkout; removed after the test\n"
                    f"PYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m fsmount \"$@\"\n")
    SHIM.chmod(0o755)
    try:
        yield
    finally:
        SHIM.unlink(missing_ok=True)


def daemon_pids(mountpoint: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = cmdline(int(entry.name))
            except OSError:
                continue
            if "fsmount" in text and f" {mountpoint} " in f" {text} " and "--foreground" in text:
                pids.append(int(entry.name))
    return pids


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    wait_for(f"daemon {pids} running after umount", lambda: any(Path(f"/proc/{pid}").exists() for pid in pids),
             lambda running: not running, timeout)


@pytest.mark.parametrize("form", ["mount -t", "fstab"])
def test_mount_t_fuse_modelfs(form: str, moto_server: S3Server, tmp_path: Path, modelfs_on_default_path: None) -> None:
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="llama/config.json", Body=b'{"a": 1}')
    mp = tmp_path / "models"
    mp.mkdir()
    log_file = tmp_path / "daemon.log"
    # The fstab line plus every generic mount(8) option that mount.fuse3 may pass on.
    opts = (f"_netdev,ro,allow_other,cache_dir={tmp_path / 'nvme'},endpoint_url={moto_server.endpoint_url},"
            f"defaults,nofail,auto,user,dev,nodev,suid,nosuid,exec,noexec,noatime,"
            f"log_level=debug,log_file={log_file}")
    if form == "fstab":
        fstab = tmp_path / "fstab"
        fstab.write_text(f"# test fstab\n{bucket}  {mp}  fuse.modelfs  {opts}  0  0\n")
        cmd = ["mount", "-T", str(fstab), str(mp)]
    else:
        cmd = ["mount", "-t", "fuse.modelfs", bucket, str(mp), "-o", opts]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHON"))}
    env.update(moto_server.env)  # mount(8) passes the environment on, PATH excepted
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        # `mount` returned: the daemon has already answered.
        assert os.path.ismount(mp)
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
        entry = next(m for m in mounts if m[1] == str(mp))
        assert entry[0] == bucket and entry[2] == "fuse.modelfs", entry
        assert "ro" in entry[3].split(","), entry
        assert (mp / "llama" / "config.json").read_bytes() == b'{"a": 1}'
        pids = daemon_pids(mp)
        assert len(pids) == 1, pids
        assert_no_secret(cmdline(pids[0]))
        res = subprocess.run(["umount", str(mp)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(mp)
        wait_gone(pids)
    finally:
        unmount(mp)
    log = log_file.read_text()
    assert "mounted bucket" in log and f"unmounted {mp}" in log
    assert not warning_lines(log), log
    assert_no_secret(log)
