"""What an operator who runs modelfs for weeks does to a live mount: remove the cache by hand, rotate logs, read
its numbers. Each test is a defect such an operator hit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import urllib.request
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
    tmpfs,
    unmount,
    wait_for,
)
from tests.mount.test_cli_mount import daemon_pid


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def test_chunks_removed_by_hand_under_a_mount_are_no_longer_counted(s3: S3Server, mountpoint: Path,
                                                                   tmp_path: Path) -> None:
    """`rm -rf CACHE/chunks` to free the disk while mounted (`modelfs cache clear` refuses then): `modelfs stats` and
    `modelfs_disk_cache_used_bytes` went on saying the cache held the chunks, until each was read again or evicted.
    Readers get the bytes from the origin meanwhile, and the cache fills again, also after an `rm -rf CACHE`."""
    data = random_bytes(20 * MiB, seed=7)
    bucket = bucket_with(s3, {"m/a.bin": data, "b.bin": data[::-1]})
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
        # The whole cache dir (B56): made again by the next put, without a warning (`mounted` checks the log).
        shutil.rmtree(cache)
        assert (mountpoint / "b.bin").read_bytes() == data[::-1]
        assert run_modelfs("prefetch", str(mountpoint / "b.bin")).returncode == 0
        assert mount_stats(mountpoint)["disk_cache"]["chunks"] == 3 and len(list(cache.glob("chunks/*/*"))) == 3


def test_a_log_file_whose_directory_was_removed_does_not_take_the_mount_down(moto_server: S3Server, mountpoint: Path,
                                                                             tmp_path: Path) -> None:
    """`rm -rf` of the --log-file's directory (a cleanup, a tmpfs wiped): the next line logged, a reload's (SIGHUP)
    for one, raised from the log call, and the daemon died: every reader then got ENOTCONN. Now the lines are dropped
    (`test_log_file.py`: said once on stderr) and written again at the log's path once it can be opened."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--log-file",
                          str(logs / "modelfs.log"), "--log-level", "info", env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        pid = daemon_pid(mountpoint)
        shutil.rmtree(logs)
        for _ in range(2):
            os.kill(pid, signal.SIGHUP)  # logs a line
            assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        logs.mkdir()
        os.kill(pid, signal.SIGHUP)
        wait_for("a new log file", lambda: (logs / "modelfs.log").exists() and "received SIGHUP" in
                 (logs / "modelfs.log").read_text())
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        unmount(mountpoint)


def test_a_cache_dir_whose_disk_is_not_mounted_yet_is_retried_not_made_on_the_root_disk(
        moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """`--cache-dir /nvme/modelfs` started before /nvme was mounted: the mount made /nvme/modelfs on the disk below and
    filled it to --cache-size of that disk (B262). Now exit status 1 (the unit starts it again) until the directory the
    cache dir goes in is there, and nothing is made above the cache dir."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    nvme = tmp_path / "nvme"
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--cache-dir",
            str(nvme / "modelfs"))
    try:
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 1, res.stderr
        assert f"{nvme}, the directory it goes in, does not exist (a disk not mounted yet?)" in res.stderr, res.stderr
        assert not nvme.exists() and not mounted_at(mountpoint)
        nvme.mkdir()  # the disk is mounted
        res = run_modelfs(*args, env=daemon_env(moto_server))
        assert res.returncode == 0, res.stderr
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
        assert (nvme / "modelfs" / "chunks").is_dir()
    finally:
        unmount(mountpoint)


def test_a_missing_profile_is_retried_by_the_unit_and_mounts_once_it_appears(moto_server: S3Server, mountpoint: Path,
                                                                             tmp_path: Path) -> None:
    """The unit's choice for a `--profile` not (yet) in the credentials file: exit status 1, which
    `Restart=on-failure` starts again every RestartSec, not 2 (a setting only an edit mends, never retried). Credentials
    often arrive after boot (an agent writes them), and a start once they are there mounts without anyone's help."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    creds = tmp_path / "credentials"
    env = {k: v for k, v in daemon_env(moto_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(tmp_path / "config"))
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--profile", "models")
    try:
        res = run_modelfs(*args, env=env)
        assert res.returncode == 1 and "--profile models: the AWS configuration files are not there yet" in res.stderr
        assert str(creds) in res.stderr, res.stderr
        creds.write_text(f"[models]\naws_access_key_id = {moto_server.env['AWS_ACCESS_KEY_ID']}\n"
                         f"aws_secret_access_key = {moto_server.env['AWS_SECRET_ACCESS_KEY']}\n")
        res = run_modelfs(*args, env=env)
        assert res.returncode == 0, res.stderr
        assert (mountpoint / "a.bin").read_bytes() == b"a" * 100
    finally:
        unmount(mountpoint)


def test_a_profile_missing_from_config_files_that_exist_is_refused_for_good(moto_server: S3Server, mountpoint: Path,
                                                                          tmp_path: Path) -> None:
    """B690: `--profile nosuch` with a credentials file that holds other profiles exited 1 ("The config profile
    (nosuch) could not be found"), which the unit started again every 5 s for good: only an edit mends it. Now exit 2
    (RestartPreventExitStatus), naming the profile and the files looked in; nothing is mounted."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {moto_server.env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {moto_server.env['AWS_SECRET_ACCESS_KEY']}\n")
    env = {k: v for k, v in daemon_env(moto_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(tmp_path / "config"))
    try:
        res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url,
                          "--profile", "nosuch", env=env)
        assert res.returncode == 2, res.stderr
        assert f"--profile nosuch: no such profile in {creds}" in res.stderr, res.stderr
        assert not mounted_at(mountpoint)
    finally:
        unmount(mountpoint)


def test_a_mount_after_a_lazy_unmount_says_what_still_holds_the_cache_dir(moto_server: S3Server, mountpoint: Path,
                                                                         tmp_path: Path) -> None:
    """`modelfs unmount` of a mount with a file open advises `--lazy`; the mount after it was refused with "in use by
    another modelfs mount: unmount it first", though it had just been unmounted: the detached mount's daemon serves
    the files still open, and holds the cache dir until they are closed. The refusal says so; once they are closed,
    the mount goes."""
    bucket = bucket_with(moto_server, {"a.bin": b"a" * 100})
    args = ("mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url, "--cache-dir",
            str(tmp_path / "cache"))
    env = daemon_env(moto_server)
    try:
        assert run_modelfs(*args, env=env).returncode == 0
        pid = daemon_pid(mountpoint)
        with open(mountpoint / "a.bin", "rb") as reader:
            res = run_modelfs("unmount", str(mountpoint))
            assert res.returncode == 1 and "use --lazy" in res.stderr, res.stderr
            assert run_modelfs("unmount", "--lazy", str(mountpoint)).returncode == 0
            res = run_modelfs(*args, env=env)
            assert res.returncode == 1 and "a mount detached with `unmount --lazy` keeps its daemon, and the cache " \
                "dir, until the files open on it are closed" in res.stderr, res.stderr
            assert reader.read() == b"a" * 100  # still served
        wait_for("the detached mount's daemon gone", lambda: not os.path.exists(f"/proc/{pid}"))
        res = run_modelfs(*args, env=env)
        assert res.returncode == 0, res.stderr
    finally:
        unmount(mountpoint)


def test_prefetch_onto_a_full_cache_disk_does_not_say_it_warmed_it(moto_server: S3Server, mountpoint: Path,
                                                                  tmp_path: Path) -> None:
    """The cache disk filled by something else, after one chunk's write failed: writes pause 30 s (one warning), and
    every chunk fetched meanwhile is skipped. `modelfs prefetch` counted only the write errors, so it exited 0, the
    model "warmed", with nothing of it in the NVMe cache (an mmap loader started on that word then needs the origin
    after all). It fails now, naming the chunks not written; `modelfs stats` and Prometheus count them."""
    data = random_bytes(16 * MiB, seed=5)
    bucket = bucket_with(moto_server, {"a.bin": data[:8 * MiB], "m/b.bin": data})
    port = free_port()
    with tmpfs(tmp_path / "fs", "size=64m") as fs:
        with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(fs / "cache"), "--metrics-addr",
                     f"127.0.0.1:{port}", allowed=(r"disk cache .*: write failed",)):
            with open(fs / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
                while True:  # something else fills the cache's disk
                    filler.write(b"\0" * MiB)
            assert (mountpoint / "a.bin").read_bytes() == data[:8 * MiB]  # its chunk's write fails: writes pause
            wait_for("the failed write", lambda: mount_stats(mountpoint)["disk_cache"]["write_errors"],
                     lambda n: n == 1)
            res = run_modelfs("prefetch", str(mountpoint / "m"))
            assert res.returncode == 1 and "2 fetched chunks were not written to a cache level" in res.stderr, res
            assert mount_stats(mountpoint)["disk_cache"]["writes_skipped"] == 2
            assert metric(port, "modelfs_disk_cache_writes_skipped_total") == 2
            assert "2 not written (writes paused after a failure, or no room)" in \
                run_modelfs("stats", str(mountpoint)).stdout
