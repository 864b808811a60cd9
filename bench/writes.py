"""Checkpoint writes (issue 15's targets): safetensors `save_file` of one model onto a writable mount, against
boto3 `upload_file` of the same bytes from local disk, s3fs and rclone, all in one run on one SeaweedFS.

    .venv/bin/python bench/writes.py --size 1.6G --rounds 2          # pinned bed by default (2+ CPUs)

Rows (each a fresh bucket, deleted after; the page cache of the source dropped before each):
  upload_file      boto3 `upload_file` of the model file (s3transfer defaults: 8 MiB parts, 10 threads)
  modelfs          `save_file` onto `modelfs --writable` (temp file, ftruncate, 1 MiB writes, rename before
                   close: the object is uploaded under the temp name and moved at close by a server-side copy)
  modelfs-nvme     the same with `--cache-dir` on local disk: save_file's temp file (extended by ftruncate
                   first) goes to the local copy and is uploaded once, under its final name, at close
  modelfs-cp       the same bytes written sequentially to their final name (`cp`): the upload path alone
  s3fs, rclone     `save_file` onto `s3fs -o rw` and `rclone mount --vfs-cache-mode writes`
Time is from the start of the write until the object is in the bucket whole: the writer times its own
`save_file` (or copy, or `upload_file`; loading the tensors and starting Python are not counted), and for
a mount the time from the writer's exit until a HEAD shows the final size is added (rclone uploads after
close). Every
object is read back from the server and checked against the model's sha256. CPU: the writer process,
the FUSE daemon (from /proc/PID/stat), and the server's. RSS: the daemon's peak (VmHWM). Each row printed also
has the server's page faults (`server_faults`) and the GB of freed memory the VM handed back to its host while
the row ran (`returned_gb`, where the kernel counts it); `--settle` waits for that to stop before each row
(bench/README.md, the host's state).
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import mounts  # noqa: E402 - bench/ is not a package
from run import (  # noqa: E402
    HostProbe,
    bed_text,
    can_pin,
    go_cold,
    memory_returned_to_host,
    origin_scratch_dir,
    parse_size,
    pin_bed,
)

from fsmount.testing.models import write_model  # noqa: E402
from fsmount.testing.seaweed import SeaweedServer  # noqa: E402

TOOLS = ("upload_file", "modelfs", "modelfs-nvme", "modelfs-cp", "s3fs", "rclone")
KEY = "model.safetensors"
MB = 1e6
MEMORY_LIMIT = "1G"
# The writer: loads the model's tensors (not timed), then times the write; prints seconds and its CPU.
WRITER = """
    import os, resource, shutil, sys, time
    from safetensors.numpy import load_file, save_file
    source, target, how = sys.argv[1:4]
    tensors = load_file(source) if how == "save_file" else None
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    if how == "save_file":
        save_file(tensors, target, metadata={"format": "pt"})
    elif how == "cp":
        shutil.copyfile(source, target)
    else:
        import boto3
        from botocore.config import Config
        c = boto3.client("s3", endpoint_url=sys.argv[4], config=Config(s3={"addressing_style": "path"}))
        c.upload_file(source, sys.argv[5], sys.argv[6])
    took = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(took, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""


def sha256_object(server: SeaweedServer, bucket: str, key: str) -> str:
    h = hashlib.sha256()
    body = server.client().get_object(Bucket=bucket, Key=key)["Body"]
    while block := body.read(8 << 20):
        h.update(block)
    return h.hexdigest()


def server_cpu(server: SeaweedServer) -> float:
    used = mounts.cpu_seconds(server.pid) if server.pid else None
    return sum(used) if used else 0.0


def wait_for_object(server: SeaweedServer, bucket: str, key: str, size: int, timeout: float = 600) -> bool:
    client = server.client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.head_object(Bucket=bucket, Key=key)["ContentLength"] == size:
                return True
        except Exception:  # noqa: BLE001 - not there yet
            pass
        time.sleep(0.05)
    return False


def daemon_for(tool: str, endpoint: mounts.Endpoint, mnt: Path, work: Path,
               modelfs_args: list[str]) -> mounts.DaemonCommand:
    if tool.startswith("modelfs"):
        cache = work / f"cache-{mnt.name}" if tool == "modelfs-nvme" else None
        return mounts.modelfs_command([sys.executable, "-m", "fsmount"], endpoint, mnt,
                                      ["--writable", "--memory-limit", MEMORY_LIMIT, *modelfs_args], cache, "info")
    if tool == "s3fs":
        return mounts.s3fs_command(endpoint, mnt, work / "s3fs.passwd", writable=True)
    return mounts.rclone_command(endpoint, mnt, writable=True)


def measure(tool: str, server: SeaweedServer, source: Path, digest: str, work: Path, n: int,
            args: argparse.Namespace) -> dict[str, Any]:
    bucket = f"writes-{n}"
    server.client().create_bucket(Bucket=bucket)
    endpoint = mounts.Endpoint(server.endpoint_url, bucket, server.access_key, server.secret_key, server.region)
    size = source.stat().st_size
    row: dict[str, Any] = {"tool": tool}
    _, settled = go_cold(args.settle)
    if settled is not None:
        row.update(settled_s=round(settled[0], 1), settled_gb=round(settled[1], 2))
    cpu0, faults0, returned0 = server_cpu(server), mounts.minor_faults(server.pid), memory_returned_to_host()
    try:
        if tool == "upload_file":
            env = {**mounts.base_env(), **endpoint.aws_env()}
            out = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), str(source), "", "upload",
                                  server.endpoint_url, bucket, KEY], env=env, capture_output=True, text=True,
                                 check=True, timeout=900).stdout
            took, writer_cpu = map(float, out.split())
            row.update(daemon_cpu=0.0, rss_mib=None)
        else:
            mnt = work / f"mnt-{n}"
            command = daemon_for(tool, endpoint, mnt, work, shlex.split(args.modelfs_args))
            with mounts.MountedDaemon(command, mnt, work / f"{tool}.log") as d:
                daemon0 = d.cpu_seconds() or 0.0
                how = "cp" if tool == "modelfs-cp" else "save_file"
                out = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), str(source), str(mnt / KEY), how],
                                     env=mounts.base_env(), capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    return {**row, "status": "error", "note": out.stderr.strip().splitlines()[-1][:200]}
                exited = time.monotonic()
                if not wait_for_object(server, bucket, KEY, size):
                    return {**row, "status": "error", "note": "the object never appeared whole"}
                writer_took, writer_cpu = map(float, out.stdout.split())
                took = writer_took + time.monotonic() - exited
                row.update(daemon_cpu=(d.cpu_seconds() or 0.0) - daemon0, rss_mib=d.peak_rss_mib())
        row.update(status="ok", seconds=took, mb_s=size / took / MB, writer_cpu=writer_cpu,
                   server_cpu=server_cpu(server) - cpu0, server_faults=mounts.minor_faults(server.pid) - faults0)
        if returned0 is not None and (returned := memory_returned_to_host()) is not None:
            row.update(returned_gb=round((returned - returned0) / 1e9, 2))
        if sha256_object(server, bucket, KEY) != digest:
            row.update(status="wrong bytes")
        return row
    finally:
        client = server.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", ()):
                client.delete_object(Bucket=bucket, Key=obj["Key"])
        for up in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ()):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        client.delete_bucket(Bucket=bucket)


def table(rows: list[dict[str, Any]], size: int) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["tool"], []).append(r)
    base = [r["seconds"] for r in by.get("upload_file", []) if r["status"] == "ok"]
    base_s = statistics.median(base) if base else None
    lines = ["| tool | status | seconds (median) | MB/s | vs upload_file | writer CPU-s | daemon CPU-s/GB | "
             "server CPU-s | daemon peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for tool, rs in by.items():
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            lines.append(f"| {tool} | {rs[0]['status']}: {rs[0].get('note', '')} | | | | | | | |")
            continue
        secs = statistics.median(r["seconds"] for r in ok)
        ratio = f"{base_s / secs:.2f}x" if base_s else "-"
        rss = max((r["rss_mib"] or 0) for r in ok)
        writer, daemon, server = (statistics.median(r[f] for r in ok)
                                  for f in ("writer_cpu", "daemon_cpu", "server_cpu"))
        lines.append(f"| {tool} | {len(ok)}/{len(rs)} ok | {secs:.2f} | {size / secs / MB:.0f} | {ratio} | "
                     f"{writer:.2f} | {daemon / (size / 1e9):.2f} | {server:.2f} | {f'{rss:.0f}' if rss else '-'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("1.6G"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--settle", action="store_true",
                   help="wait for freed memory to go back to the host before each measurement (README)")
    p.add_argument("--modelfs-args", default="", help='extra flags for the modelfs mounts, e.g. "--max-connections 8"')
    args = p.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    pin = can_pin() if args.pin is None else args.pin
    work = Path(tempfile.mkdtemp(prefix="modelfs-bench-writes-"))
    scratch, where = origin_scratch_dir("ram", args.size)
    try:
        source = work / "src" / KEY
        write_model(source, args.size)
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        size = source.stat().st_size
        with SeaweedServer(scratch or work / "weed") as server:
            bed = pin_bed(server, pin)
            print(f"# {size / 1e9:.2f} GB model; SeaweedFS data {where}; {bed_text(bed)}", flush=True)
            rows, n = [], 0
            host = HostProbe()
            for rnd in range(args.rounds):
                print(f"# round {rnd + 1}: {host.probe().text()}", flush=True)
                for tool in tools:
                    n += 1
                    row = measure(tool, server, source, digest, work, n, args)
                    row["round"] = rnd
                    rows.append(row)
                    print(row, flush=True)
        print()
        print(table(rows, size))
    finally:
        for path in (work, scratch):
            if path is not None:
                mounts.remove_tree(path)
                shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
