"""Fleet cold start: N daemons ("nodes") load one model at the same moment, with and without a shared chunk
tier, against one SeaweedFS holding both the origin bucket and the tier bucket (bytes counted apart from
each daemon's own stats). Every node's bytes are checked against the model's sha256.

    .venv/bin/python bench/fleet.py --nodes 4 --size 1.6G --rounds 2

A node's time is one front-to-back read of the model into a reused buffer (as curl's is into /dev/null);
its bytes are checked against the sha256 afterwards, outside the time and the CPU counts.

Scenarios, page cache dropped and every daemon fresh (own empty --cache-dir, unless --no-cache-dir) before
each:
  no-tier    N nodes at once without a tier (today: N copies from the origin)
  tier-cold  N nodes at once, empty tier
  tier-warm  N fresh nodes at once, tier filled by the run before
  tier-curl  the tier read directly: every chunk object of the model with `curl --parallel` (the ceiling
             a warm-tier node is compared with)
  one-warm   one fresh node, warm tier (the node the curl row is compared with)
  one-empty  one node, empty tier; one-none: one node without a tier (the "no slower alone" check)
Prints per scenario: wall seconds until the last node finished, origin bytes over all nodes as a
multiple of the model size, tier bytes, per-node MB/s, and the CPU seconds of all daemons and of SeaweedFS
(origin and tier are one server here, so its CPU includes storing what the nodes write to the tier).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import mounts  # noqa: E402 - bench/ is not a package
from run import UPLOAD_CONFIG, drop_caches, parse_size  # noqa: E402

from fsmount.testing.models import write_model  # noqa: E402
from fsmount.testing.seaweed import SeaweedServer  # noqa: E402

ORIGIN, TIER, KEY = "models", "tier", "model.safetensors"
SCENARIOS = ("no-tier", "tier-cold", "tier-warm", "tier-curl", "one-warm", "one-none", "one-empty")
READ_BLOCK = 8 << 20


def read_whole(path: Path) -> None:
    """Read the file front to back into one reused buffer, as a loader would, keeping nothing."""
    buffer = bytearray(READ_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


class Fleet:
    def __init__(self, args: argparse.Namespace, work: Path, server: SeaweedServer, digest: str, size: int):
        self.args, self.work, self.server, self.digest, self.size = args, work, server, digest, size
        self.endpoint = mounts.Endpoint(server.endpoint_url, ORIGIN, server.access_key, server.secret_key,
                                        server.region)

    def empty_tier(self) -> None:
        client = self.server.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=TIER):
            for obj in page.get("Contents", ()):
                client.delete_object(Bucket=TIER, Key=obj["Key"])

    def node(self, stack: ExitStack, i: int, tier: bool) -> mounts.MountedDaemon:
        cache = self.work / f"cache{i}"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        extra = ["--shared-cache-bucket", TIER, "--shared-cache-endpoint-url", self.server.endpoint_url] if tier else []
        # -P: the working directory must not come before PYTHONPATH (this tree, mounts.REPO_ROOT), so that a
        # fleet.py in a clone of another commit runs that commit's daemon.
        command = mounts.modelfs_command([sys.executable, "-P", "-m", "fsmount"], self.endpoint, self.work / f"mnt{i}",
                                         extra + self.args.node_flags.split(),
                                         None if self.args.no_cache_dir else cache, "info")
        return stack.enter_context(mounts.MountedDaemon(command, self.work / f"mnt{i}", self.work / f"node{i}.log"))

    def load(self, nodes: int, tier: bool) -> dict[str, float]:
        """N nodes read the model at once; wall seconds, origin and tier bytes over all nodes."""
        with ExitStack() as stack:
            daemons = [self.node(stack, i, tier) for i in range(nodes)]
            drop_caches()
            results: dict[int, tuple[bool, float]] = {}
            cpu_before = [sum(mounts.cpu_seconds(d.proc.pid) or (0, 0)) for d in daemons]
            weed_before = sum(mounts.cpu_seconds(self.server.pid) or (0, 0))

            def read(i: int) -> None:
                started = time.perf_counter()
                read_whole(daemons[i].mountpoint / KEY)
                results[i] = (False, time.perf_counter() - started)

            started = time.perf_counter()
            threads = [threading.Thread(target=read, args=(i,)) for i in range(nodes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            stats = [mounts_stats(d.mountpoint) for d in daemons]
            # Unmount drains the write-through to the tier: wait for it inside the measurement.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(mounts_stats(d.mountpoint)["cache_writes_pending"]
                                                      for d in daemons):
                time.sleep(0.05)
            daemon_cpu = sum(sum(mounts.cpu_seconds(d.proc.pid) or (0, 0)) for d in daemons) - sum(cpu_before)
            weed_cpu = sum(mounts.cpu_seconds(self.server.pid) or (0, 0)) - weed_before
            # Checked after the clock and the CPU counters stopped: a hash costs the reader's core ~0.5 s/GB,
            # which the curl row (bytes to /dev/null) does not pay. What it reads is what the mount serves
            # (mostly from the page cache the timed read filled).
            for i, d in enumerate(daemons):
                results[i] = (sha256_of(d.mountpoint / KEY) == self.digest, results[i][1])
        if not all(ok for ok, _ in results.values()):
            raise SystemExit(f"a node read wrong bytes: {results}")
        origin = sum(s["origin"]["bytes"] for s in stats)
        tier_bytes = sum((s["shared_cache"] or {}).get("bytes", 0) for s in stats)
        # What the nodes did in the tier (counted when the reads were done; writes may trail them).
        tier_counts = {name: sum((s["shared_cache"] or {}).get(name, 0) for s in stats)
                       for name in ("claims", "claim_waits", "fallbacks", "trailed", "waiters_seen")}
        node_mbs = [self.size / t / 1e6 for _, t in results.values()]
        return {"seconds": wall, "origin_x": origin / self.size, "tier_x": tier_bytes / self.size,
                "node_mb_s_min": min(node_mbs), "daemon_cpu": daemon_cpu, "weed_cpu": weed_cpu,
                "tier_counts": tier_counts if tier else {}}

    def curl_tier(self) -> dict[str, float]:
        """Every chunk object in the tier, fetched with curl --parallel through presigned URLs."""
        client = self.server.client()
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=TIER, Prefix="modelfs/chunks/")
        keys = [o["Key"] for page in pages for o in page.get("Contents", ())]
        urls = [client.generate_presigned_url("get_object", Params={"Bucket": TIER, "Key": k}, ExpiresIn=3600)
                for k in keys]
        config = self.work / "curl.cfg"
        config.write_text("".join(f'url = "{u}"\noutput = "/dev/null"\n' for u in urls))
        drop_caches()
        started = time.perf_counter()
        subprocess.run(["curl", "-sS", "--fail", "--parallel", "--parallel-max", "16", "-K", str(config)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "origin_x": 0.0, "tier_x": 1.0, "node_mb_s_min": self.size / seconds / 1e6,
                "daemon_cpu": 0.0, "weed_cpu": 0.0}

    def measure(self, scenario: str) -> dict[str, float]:
        n = self.args.nodes
        if scenario == "no-tier":
            return self.load(n, tier=False)
        if scenario == "tier-cold":
            self.empty_tier()
            return self.load(n, tier=True)
        if scenario == "tier-warm":
            return self.load(n, tier=True)  # after tier-cold in the same round
        if scenario == "tier-curl":
            return self.curl_tier()
        if scenario == "one-warm":
            return self.load(1, tier=True)  # after tier-cold in the same round
        if scenario == "one-none":
            return self.load(1, tier=False)
        self.empty_tier()
        return self.load(1, tier=True)


def pin(pid: int | None, cpus: str) -> None:
    """Every thread of `pid` on `cpus` (taskset's list form); children started later inherit it."""
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True, stdout=subprocess.DEVNULL)


def mounts_stats(mountpoint: Path) -> dict:
    import json

    return json.loads(os.getxattr(mountpoint, "user.modelfs.stats"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--size", default="1.6G", help="model size, K/M/G binary suffixes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--work-dir", type=Path, help="scratch dir on local disk (default: a temp dir in /var/tmp)")
    p.add_argument("--pin", action="store_true",
                   help="SeaweedFS alone on CPU 0, every daemon and reader (this process) on the other CPUs")
    p.add_argument("--no-cache-dir", action="store_true", help="nodes without --cache-dir (memory and tier only)")
    p.add_argument("--node-flags", default="", help="more flags for every node's daemon (one string)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench/fleet.py needs root (mounts, drop_caches)")
    work = Path(tempfile.mkdtemp(prefix="modelfs-fleet-", dir=args.work_dir or "/var/tmp"))
    results: dict[str, list[dict[str, float]]] = {}
    try:
        with SeaweedServer(work / "weed", buckets=[ORIGIN, TIER]) as server:
            model = work / KEY
            write_model(model, parse_size(args.size))
            size = model.stat().st_size
            server.client().upload_file(str(model), ORIGIN, KEY, Config=UPLOAD_CONFIG)
            fleet = Fleet(args, work, server, sha256_of(model), size)
            if args.pin:
                pin(server.pid, "0")
                pin(os.getpid(), f"1-{os.cpu_count() - 1}")  # daemons and curl inherit it
            model.unlink()
            for round_no in range(1, args.rounds + 1):
                for scenario in args.scenarios.split(","):
                    out = fleet.measure(scenario)
                    results.setdefault(scenario, []).append(out)
                    print(f"round {round_no} {scenario:10s} {out['seconds']:6.2f} s  origin {out['origin_x']:4.2f}x  "
                          f"tier {out['tier_x']:4.2f}x  slowest node {out['node_mb_s_min']:6.0f} MB/s  daemons "
                          f"{out['daemon_cpu']:5.2f} weed {out['weed_cpu']:5.2f} CPU-s  "
                          f"{' '.join(f'{k}={v}' for k, v in out.get('tier_counts', {}).items())}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"medians ({args.nodes} nodes, model {args.size}): scenario seconds origin-x tier-x slowest-node-MB/s "
          "daemons-CPU-s weed-CPU-s")
    keys = ("seconds", "origin_x", "tier_x", "node_mb_s_min", "daemon_cpu", "weed_cpu")
    for scenario, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in keys}
        print(f"{scenario:10s} {med['seconds']:6.2f} {med['origin_x']:5.2f} {med['tier_x']:5.2f} "
              f"{med['node_mb_s_min']:7.0f} {med['daemon_cpu']:6.2f} {med['weed_cpu']:6.2f}  "
              f"{[round(r['seconds'], 2) for r in runs]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
