"""The README demo: SeaweedFS + a sample model, `modelfs mount`, load every tensor through it, check, unmount.

It exits non-zero on any failure and must never leave the server, the mount or the daemon behind.

    .venv/bin/python bench/demo.py [--size 256M] [--modelfs-args "--chunk-size 16M"]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path[:0] = [str(REPO_ROOT), str(BENCH_DIR)]

import mounts  # noqa: E402 - bench/ is not a package; sys.path above makes these importable
import numpy as np  # noqa: E402
from run import MB, drop_caches, parse_size  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from fsmount.testing.models import write_model  # noqa: E402
from fsmount.testing.seaweed import SeaweedServer  # noqa: E402

BUCKET = "demo-models"
KEY = "sample/model.safetensors"
DEMO_SIZE = "256M"
#: `modelfs mount` itself waits up to 120 s for the daemon; give it a little more.
MOUNT_COMMAND_TIMEOUT_S = 150.0
UNMOUNT_TIMEOUT_S = 30.0
#: After unmounting, the background daemon should exit within this.
DAEMON_EXIT_TIMEOUT_S = 15.0
LOG_TAIL_CHARS = 2000


class DemoError(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"demo: {message}", flush=True)


def daemon_pids(mountpoint: Path) -> list[int]:
    """Our background daemon(s): a modelfs process whose command line names our (unique) mountpoint."""
    pids = []
    target = str(mountpoint).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if target in argv and any(b"fsmount" in a or b"modelfs" in a for a in argv):
            pids.append(int(entry.name))
    return pids


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
    return alive


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def unmount(modelfs: list[str], mountpoint: Path, env: dict[str, str]) -> None:
    """`modelfs unmount`, then make sure neither the mount nor the daemon is left."""
    pids = daemon_pids(mountpoint)
    problems = []
    if mounts.mount_entry(mountpoint) is not None:
        done = subprocess.run(
            [*modelfs, "unmount", str(mountpoint)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=UNMOUNT_TIMEOUT_S,
        )
        if done.returncode != 0:
            problems.append(f"modelfs unmount failed ({done.returncode}): {done.stderr.strip()}")
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True)
    for pid in wait_gone(pids, DAEMON_EXIT_TIMEOUT_S):
        problems.append(f"daemon {pid} still running after unmount; killed")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if mounts.mount_entry(mountpoint) is not None:
        problems.append("mount still present after unmount")
    if problems:
        raise DemoError("; ".join(problems))


def compare(source: dict[str, np.ndarray], loaded: dict[str, np.ndarray]) -> None:
    if source.keys() != loaded.keys():
        missing = sorted(source.keys() - loaded.keys())[:5]
        extra = sorted(loaded.keys() - source.keys())[:5]
        raise DemoError(f"tensor names differ: missing {missing}, unexpected {extra}")
    for name, expected in source.items():
        got = loaded[name]
        if got.dtype != expected.dtype or got.shape != expected.shape or not np.array_equal(got, expected):
            raise DemoError(f"tensor {name} differs from the source")


def run_demo(args: argparse.Namespace, work: Path) -> None:
    modelfs, help_or_reason = mounts.find_modelfs(args.modelfs_cmd)
    if modelfs is None:
        raise DemoError(f"modelfs CLI not usable: {help_or_reason}")
    source_path = work / "source" / "model.safetensors"
    size = parse_size(args.size)
    say(f"generating a {size / MB:.0f} MB sample model")
    write_model(source_path, size)
    file_bytes = source_path.stat().st_size
    with SeaweedServer(work / "weed", buckets=[BUCKET]) as server:
        say(f"SeaweedFS S3 at {server.endpoint_url}; uploading s3://{BUCKET}/{KEY}")
        server.client().upload_file(str(source_path), BUCKET, KEY)
        mountpoint = work / "mnt"
        mountpoint.mkdir()
        env = {**mounts.base_env(), **server.env(), "PYTHONPATH": str(REPO_ROOT)}
        env.pop("AWS_ENDPOINT_URL_S3", None)  # the demo shows --endpoint-url
        argv = [*modelfs, "mount", BUCKET, str(mountpoint), "--endpoint-url", server.endpoint_url]
        argv += ["--log-file", str(work / "modelfs.log"), *shlex.split(args.modelfs_args)]
        say(f"$ {shlex.join(argv)}")
        try:
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, env=env, timeout=MOUNT_COMMAND_TIMEOUT_S
            )
            if done.returncode != 0:
                raise DemoError(f"modelfs mount failed ({done.returncode}): {done.stderr.strip()}")
            if mounts.mount_entry(mountpoint) is None:
                raise DemoError("modelfs mount returned 0 but nothing is mounted")
            cold = drop_caches()
            say(f"page cache {'dropped' if cold else 'NOT dropped (not root?)'}; loading from the mount")
            start = time.perf_counter()
            loaded = load_file(mountpoint / KEY)
            seconds = time.perf_counter() - start
            rate = file_bytes / seconds / MB
            say(f"load_file: {file_bytes / MB:.0f} MB in {seconds:.2f} s = {rate:.0f} MB/s")
            compare(load_file(source_path), loaded)
            say(f"all {len(loaded)} tensors equal the source")
            del loaded
        except BaseException:
            log = work / "modelfs.log"
            if log.exists():
                print(
                    f"--- modelfs log tail:\n{log.read_text(errors='replace')[-LOG_TAIL_CHARS:]}",
                    file=sys.stderr,
                )
            with contextlib.suppress(DemoError, subprocess.TimeoutExpired):
                unmount(modelfs, mountpoint, env)
            raise
        say(f"$ {shlex.join([*modelfs, 'unmount', str(mountpoint)])}")
        unmount(modelfs, mountpoint, env)
    say("unmounted, server stopped")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=DEMO_SIZE, help=f"sample model size (default {DEMO_SIZE})")
    p.add_argument("--modelfs-args", default="", help="extra `modelfs mount` flags")
    p.add_argument("--modelfs-cmd", default=None, help="modelfs command (default: venv script, else -m fsmount)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="modelfs-demo-", dir="/var/tmp"))
    try:
        run_demo(args, work)
    except (DemoError, OSError, subprocess.SubprocessError, RuntimeError) as exc:
        print(f"demo: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        mounts.remove_tree(work)
    say("OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
