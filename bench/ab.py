"""A/B: two (or more) versions of the modelfs source, alternated in one run against one SeaweedFS.

On this shared 2-core bed the same cold `cat` swings by ±40 % within minutes, so a change is judged by
running the old and the new daemon one after the other, scenario by scenario and round after round
(the variants' order turned by one each round), in the same run, and by the CPU each process spent
(from /proc/PID/stat), which is steadier than wall time:

    .venv/bin/python bench/ab.py --variant old=/path/to/clone --variant new=. \\
        --scenarios fill,warm,warm_load,local --rounds 3

A variant is a source tree (a clean clone of another commit, or `.`) put first on PYTHONPATH of the
daemon, and optionally mount flags of its own after a colon; all run with this interpreter, so a
variant must not need packages this venv lacks. The data-plane A/B of one tree:

    .venv/bin/python bench/ab.py --variant presigned=. --variant 'boto3=.:--get-client boto3' \
        --scenarios cold --rounds 5

Scenarios, each after the page cache is dropped, each on a fresh daemon:
  cold       cat through a mount without --cache-dir
  cold_load  safetensors.numpy.load_file through a mount without --cache-dir
  cold_safe_open  safe_open + get_tensor of every key (vLLM's order) through a mount without --cache-dir
  cold_stream  open the file through a mount without --cache-dir and hold it, reading nothing, until model
             streaming has pushed all of it into the page cache (the mount's stats): the rate of the
             streaming pipeline alone, with no reader's CPU beside it
  fill       cat through a mount with an emptied --cache-dir (the variant's own)
  warm       cat through a fresh mount on that cache dir (run `fill` first in the same round)
  warm_load  safetensors.numpy.load_file through a fresh mount on that cache dir
  warm_stream  cold_stream through a fresh mount on that cache dir
  shards_load       load_file of each shard of the same tensors in 4 shards (Hugging Face's names, the
                    index beside them), one after the other in one process, without --cache-dir
  shards_fill_load  the same through a mount with an emptied --cache-dir
  shards_idle_load  the first shard opened and held until model streaming has pushed the whole model (the
                    other shards warmed), IDLE_S seconds idle, then shards_load (timed: the load alone);
                    the page cache may lose pages meanwhile (reclaim: this bed's VM reclaims cold page
                    cache with memory free), and the columns show what the mount fetched and pushed again
  fill_load_file, fill_safe_open, fill_natural_threads, fill_quarters
             that loader of bench/scenarios.py through a mount with an emptied --cache-dir (bench/run.py's
             modelfs row)
  local      cat of the same file on local disk (the warm-cache baseline)
  local_load load_file of the same file on local disk
Every mounted measurement also reads the trio thread's CPU (it answers every FUSE request). With --gil it
is sampled by `py-spy record --gil` too (the bench extra), and the medians give the GIL's share two ways:
sampled (wall seconds a thread held it; high on a busy CPU, where a holder gets preempted) and bounded
from /proc (the trio thread's CPU, whose READ replies are copied with the GIL held, plus the other
threads' user CPU). 1 / that bound is the projected ceiling of a node with cores to spare (one GIL);
1 / the trio thread's CPU per GB is the FUSE thread's own.
Per measurement it prints seconds, the daemon's user and system CPU seconds, its CPU seconds per GB read
SeaweedFS's CPU seconds, the daemon's faulted memory and the reader's CPU seconds (user + system: on the
pinned bed it shares the daemon's CPU), then medians per (scenario, variant). On 2 CPUs or more the bed is pinned
as in bench/run.py (`--pin`, the default there too): SeaweedFS alone on the first CPU, the daemons and the
readers on the others. Nothing is left behind: server, mounts and the work dir go.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import mounts  # noqa: E402 - bench/ is not a package
from run import (  # noqa: E402
    BENCH_DIR,
    GB,
    PIN_HELP,
    REPO_ROOT,
    UPLOAD_CONFIG,
    HostProbe,
    bed_text,
    children_cpu_seconds,
    go_cold,
    parse_size,
    pin_bed,
    pin_choice,
)

from fsmount.stats import STATS_XATTR  # noqa: E402
from fsmount.testing.models import write_model, write_sharded_model  # noqa: E402
from fsmount.testing.seaweed import SeaweedServer  # noqa: E402

BUCKET = "models"
KEY = "model.safetensors"
SHARDS = 4
# A cold read of the loaders of bench/scenarios.py through a mount with an emptied --cache-dir (the bench's
# modelfs row): fill_<workload>.
FILL_WORKLOADS = ("load_file", "safe_open", "natural_threads", "quarters")
SCENARIOS = ("cold", "cold_load", "cold_safe_open", "cold_stream", "shards_load", "shards_fill_load",
             "shards_idle_load", "fill", "warm",
             "warm_load", "warm_stream", "local", "local_load", *(f"fill_{w}" for w in FILL_WORKLOADS))
# How long `*_stream` waits for model streaming to push the whole file before it gives up, and how often it asks.
STREAM_TIMEOUT_S = 300
STREAM_POLL_S = 0.01
# shards_idle_load: seconds between the whole model pushed and its load.
IDLE_S = 75  # past the 60 s after which this bed's VM reclaims page cache nobody touched (DAMON pageout)


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process, all its threads; zeros if it is gone."""
    return (mounts.cpu_seconds(pid) if pid is not None else None) or (0.0, 0.0)


@dataclasses.dataclass
class Measured:
    """One measurement: wall seconds, the daemon's user and system CPU-s, SeaweedFS's CPU-s, the trio
    thread's user and system CPU-s (it answers every FUSE request); with --gil also the seconds the
    daemon's threads held the GIL (py-spy samples / rate), the trio thread's and the rest's."""

    seconds: float
    user: float = 0.0
    sys: float = 0.0
    weed: float = 0.0
    main_user: float = 0.0
    main_sys: float = 0.0
    gil_main: float | None = None
    gil_other: float | None = None
    faults: int = 0  # the daemon's minor page faults: first touches of fresh memory, each zeroed
    reader: float = 0.0  # the reader's CPU-s (user + system)
    # From the mount's stats: bytes the daemon answered READs with, and bytes it pushed into the page cache.
    # Together more than the file means some bytes went to the kernel twice. None: no stats to read.
    replied: int | None = None
    pushed: int | None = None
    fetched: int | None = None  # bytes its GETs brought from the origin: more than the file, some twice

    @property
    def gil_bound(self) -> float:
        """CPU-s that can have held the GIL: all of the trio thread's (pyfuse3 copies each READ reply
        into the kernel without releasing it) and the other threads' user time (their system time is
        recv() and file I/O, which run without it)."""
        return self.main_user + self.main_sys + (self.user - self.main_user)


# py-spy's sampling rate for --gil: 1000 samples a second resolve the GIL's share of a 1-2 s read to ~1 ms.
GIL_RATE = 1000


def thread_cpu_seconds(pid: int, tid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one thread of a live process (zeros if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def on_the_other_cpus() -> Callable[[], None] | None:
    """A preexec_fn that moves a sampler onto the CPUs this process is not pinned to (the origin's on a
    pinned bed), so it does not take the measured daemon's CPU; None when there are none."""
    elsewhere = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    return (lambda: os.sched_setaffinity(0, elsewhere)) if elsewhere else None


class GilSampler:
    """`py-spy record --gil` on a live daemon: only the thread holding the GIL is sampled, so samples
    divided by the rate are the seconds the GIL was held. `--nonblocking`: the daemon is never paused.
    On a pinned bed py-spy runs on the CPUs the bench leaves to the origin, not on the daemon's. Wall
    time: a thread preempted while it holds the GIL still counts, so on a busy CPU this reads high."""

    @staticmethod
    def find() -> Path | None:
        """py-spy beside the interpreter (the bench extra), else on PATH; None: --gil gives the CPU bound only."""
        beside = Path(sys.executable).parent / "py-spy"
        found = beside if beside.is_file() else shutil.which("py-spy")
        return Path(found) if found else None

    def __init__(self, pid: int, out: Path, spy: Path):
        self.pid, self.out = pid, out
        self.proc = subprocess.Popen(
            [str(spy), "record", "--gil", "--nonblocking", "--threads", "-r", str(GIL_RATE), "-f", "raw",
             "-o", str(out), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=on_the_other_cpus())
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> tuple[float, float]:
        """(seconds the trio thread held the GIL, seconds all other threads did)."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        by_thread: collections.Counter[str] = collections.Counter()
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            by_thread[stack.split(";", 1)[0]] += int(count)
        main = sum(n for name, n in by_thread.items() if f"({self.pid})" in name or "MainThread" in name)
        return main / GIL_RATE, (sum(by_thread.values()) - main) / GIL_RATE


class PerfRecorder:
    """`perf record -e cpu-clock -g` of a live daemon into one file, on the CPUs the bench leaves to the
    origin (as GilSampler): the kernel side (copies, page faults) that py-spy cannot see."""

    def __init__(self, pid: int, out: Path):
        self.proc = subprocess.Popen(
            ["perf", "record", "-q", "-e", "cpu-clock", "-F", "997", "-g", "-o", str(out), "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=on_the_other_cpus())
        time.sleep(0.5)  # perf attaches

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Runs a reader to its end: (wall seconds, its user + system CPU-s, its children's included)."""
    cpu = children_cpu_seconds()
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env, timeout=600)
    return time.perf_counter() - start, children_cpu_seconds() - cpu


def load(paths: list[Path], workload: str = "load_file") -> tuple[float, float]:
    """A bench/scenarios.py workload (load_file, safe_open, ...) of these files, in a fresh process."""
    env = {**mounts.base_env(), "PYTHONPATH": str(REPO_ROOT)}
    return timed([sys.executable, str(BENCH_DIR / "scenarios.py"), workload, *map(str, paths)], env)


def streamed(path: Path, mountpoint: Path) -> tuple[float, float]:
    """Opens `path` and holds it, reading nothing, until the mount has pushed all of it into the page cache
    (model streaming, on a fresh daemon): (wall seconds, 0 reader CPU-s)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return wait_pushed(mountpoint, path.stat().st_size), 0.0
    finally:
        os.close(fd)


def wait_pushed(mountpoint: Path, size: int) -> float:
    """Waits until the mount has pushed `size` bytes into the page cache (model streaming): the seconds."""
    start = time.perf_counter()
    while (moved_bytes(mountpoint)[1] or 0) < size:
        if time.perf_counter() - start > STREAM_TIMEOUT_S:
            raise SystemExit(f"model streaming pushed {moved_bytes(mountpoint)[1]} of {size} bytes "
                             f"in {STREAM_TIMEOUT_S} s")
        time.sleep(STREAM_POLL_S)
    return time.perf_counter() - start


def moved_bytes(mountpoint: Path) -> tuple[int | None, int | None, int | None]:
    """(READ reply bytes, bytes pushed into the page cache, bytes fetched from the origin) of a mounted daemon
    so far, from its stats."""
    try:
        stats = json.loads(os.getxattr(mountpoint, STATS_XATTR))
        return sum(stats["served_bytes"].values()), stats["pagecache_stored_bytes"], stats["origin"]["bytes"]
    except (OSError, ValueError, KeyError):
        return None, None, None


class AB:
    def __init__(self, args: argparse.Namespace, work: Path, server: SeaweedServer) -> None:
        self.args = args
        self.work = work
        self.server = server
        self.endpoint = mounts.Endpoint(server.endpoint_url, BUCKET, server.access_key, server.secret_key,
                                        server.region)
        self.model = work / KEY
        self.shards: list[str] = []  # keys of the sharded model, set once it is uploaded
        self.mountpoint = work / "mnt"
        self.runs: dict[tuple[str, str], int] = {}  # measurements so far per (variant, scenario), for --perf

    def daemon(self, variant: str, cache_dir: Path | None) -> mounts.MountedDaemon:
        source, _, flags = self.args.variants[variant].partition(":")
        # -P: the working directory (this repo, for `.`) must not come before the variant's PYTHONPATH,
        # or every variant would run this checkout's code (as every A/B before this fix did).
        command = mounts.modelfs_command([sys.executable, "-P", "-m", "fsmount"], self.endpoint, self.mountpoint,
                                         [*self.args.modelfs_args.split(), *flags.split()], cache_dir, "info")
        command.env["PYTHONPATH"] = str(Path(source).resolve())
        return mounts.MountedDaemon(command, self.mountpoint, self.work / f"{variant}.log")

    def through_mount(self, variant: str, scenario: str, cache_dir: Path | None, workload: str) -> Measured:
        with self.daemon(variant, cache_dir) as daemon:
            assert daemon.pid is not None
            go_cold(self.args.settle)
            perf, gil_out = None, self.work / "gil.txt"
            if self.args.perf:
                self.args.perf.mkdir(parents=True, exist_ok=True)
                self.runs[variant, scenario] = self.runs.get((variant, scenario), 0) + 1
                name = f"{variant}-{scenario}-{self.runs[variant, scenario]}"
                perf = PerfRecorder(daemon.pid, self.args.perf / f"{name}.data")
                gil_out = self.args.perf / f"{name}.gil.txt"  # py-spy's raw stacks, kept beside it
            spy = GilSampler.find() if self.args.gil else None
            sampler = GilSampler(daemon.pid, gil_out, spy) if spy else None
            daemon_before, server_before = cpu_seconds(daemon.pid), cpu_seconds(self.server.pid)
            main_before = thread_cpu_seconds(daemon.pid, daemon.pid)
            faults_before = mounts.minor_faults(daemon.pid)
            paths = [self.mountpoint / key for key in (self.shards if workload.startswith("shards") else [KEY])]
            pushed_before = fetched_before = None
            if workload == "cat":
                seconds, reader = timed(["cat", *map(str, paths)])
            elif workload == "shards_idle":
                with open(paths[0], "rb"):
                    total = sum(p.stat().st_size for p in paths)
                    wait_pushed(self.mountpoint, total)
                    time.sleep(IDLE_S)
                    daemon_before, server_before = cpu_seconds(daemon.pid), cpu_seconds(self.server.pid)
                    main_before = thread_cpu_seconds(daemon.pid, daemon.pid)
                    faults_before = mounts.minor_faults(daemon.pid)
                    pushed_before, fetched_before = moved_bytes(self.mountpoint)[1:]
                    seconds, reader = load(paths, "load_file")
            elif workload == "stream":
                seconds, reader = streamed(paths[0], self.mountpoint)
            else:
                seconds, reader = load(paths, "load_file" if workload == "shards" else workload)
            daemon_after, server_after = cpu_seconds(daemon.pid), cpu_seconds(self.server.pid)
            main_after = thread_cpu_seconds(daemon.pid, daemon.pid)
            faults = mounts.minor_faults(daemon.pid) - faults_before
            replied, pushed, fetched = moved_bytes(self.mountpoint)
            if workload == "shards_idle" and None not in (pushed, fetched, pushed_before, fetched_before):
                pushed, fetched = pushed - pushed_before, fetched - fetched_before  # the load's own
            gil = sampler.stop() if sampler else (None, None)
            if perf:
                perf.stop()
        return Measured(seconds, daemon_after[0] - daemon_before[0], daemon_after[1] - daemon_before[1],
                        sum(server_after) - sum(server_before), main_after[0] - main_before[0],
                        main_after[1] - main_before[1], *gil, faults, reader, replied, pushed, fetched)

    def measure(self, variant: str, scenario: str) -> Measured:
        cache_dir = self.work / f"cache-{variant}"
        if scenario.startswith("cold"):
            workload = {"cold": "cat", "cold_load": "load_file", "cold_safe_open": "safe_open",
                        "cold_stream": "stream"}[scenario]
            return self.through_mount(variant, scenario, None, workload)
        if scenario in ("shards_load", "shards_idle_load"):
            return self.through_mount(variant, scenario, None, scenario.removesuffix("_load"))
        if scenario in ("fill", "shards_fill_load") or scenario.removeprefix("fill_") in FILL_WORKLOADS:
            shutil.rmtree(cache_dir, ignore_errors=True)
            cache_dir.mkdir()
            workload = {"fill": "cat", "shards_fill_load": "shards"}.get(scenario, scenario.removeprefix("fill_"))
            return self.through_mount(variant, scenario, cache_dir, workload)
        if scenario in ("warm", "warm_load", "warm_stream"):
            if not cache_dir.is_dir():
                raise SystemExit(f"{scenario} needs a filled cache: put fill before it in --scenarios")
            workload = {"warm": "cat", "warm_load": "load_file", "warm_stream": "stream"}[scenario]
            return self.through_mount(variant, scenario, cache_dir, workload)
        go_cold(self.args.settle)
        seconds, reader = timed(["cat", str(self.model)]) if scenario == "local" else load([self.model])
        return Measured(seconds, reader=reader)


def moved(out: Measured, gb: float) -> str:
    """The bytes a mount replied with and pushed, as multiples of the file's `gb`, for a measurement's line."""
    if out.replied is None or out.pushed is None or out.fetched is None:
        return ""
    return (f"  replied {out.replied / GB / gb:4.2f} pushed {out.pushed / GB / gb:4.2f} "
            f"fetched {out.fetched / GB / gb:4.2f} x the file")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=SOURCE_DIR[:FLAGS]",
                   help="a modelfs source tree to run the daemon from, and mount flags of this variant only "
                        "(e.g. 'boto3=.:--get-client boto3'); repeat: 2 or more")
    p.add_argument("--scenarios", default="fill,warm,local", help=f"comma-separated from {','.join(SCENARIOS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--size", default="1.6G", help="model size, K/M/G binary suffixes")
    p.add_argument("--modelfs-args", default="", help="extra mount flags for every variant")
    p.add_argument("--work-dir", type=Path, help="scratch dir on local disk (default: a temp dir in /var/tmp)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None, help=PIN_HELP)
    p.add_argument("--gil", action="store_true",
                   help="the GIL's share: at most the trio thread's CPU and the others' user CPU per GB, and, "
                        "sampled by py-spy --gil (bench extra; skipped where it is missing), the seconds the trio "
                        "thread and the others held it")
    p.add_argument("--settle", action="store_true",
                   help="after each drop of the page cache, wait until the VM has handed the freed memory back to its "
                        "host (bench/README.md, the host's state)")
    p.add_argument("--perf", type=Path, metavar="DIR",
                   help="also record each mounted measurement's daemon with `perf record -g` into DIR "
                        "(VARIANT-SCENARIO-ROUND.data; read with `perf report -i`); with --gil, py-spy's "
                        "stacks go there too (VARIANT-SCENARIO-ROUND.gil.txt, one stack and its count a line)")
    args = p.parse_args(argv)
    args.pin = pin_choice(p, args.pin)
    args.variants = dict(v.split("=", 1) for v in args.variant)
    args.scenario_list = args.scenarios.split(",")
    unknown = set(args.scenario_list) - set(SCENARIOS)
    if unknown or len(args.variants) < 2:
        p.error(f"unknown scenarios {sorted(unknown)}" if unknown else "give at least two --variant")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench/ab.py needs root (mounts, drop_caches)")
    work = Path(tempfile.mkdtemp(prefix="modelfs-ab-", dir=args.work_dir or "/var/tmp"))
    results: dict[tuple[str, str], list[Measured]] = {}
    try:
        with SeaweedServer(work / "weed", buckets=[BUCKET]) as server:
            bed = bed_text(pin_bed(server, args.pin))  # daemons and readers started from here on inherit it
            print(bed, flush=True)
            ab = AB(args, work, server)
            write_model(ab.model, parse_size(args.size))
            gb = ab.model.stat().st_size / GB
            server.client().upload_file(str(ab.model), BUCKET, KEY, Config=UPLOAD_CONFIG)
            if any(s.startswith("shards") for s in args.scenario_list):
                sharded = write_sharded_model(work / "sharded", parse_size(args.size), shards=SHARDS)
                for path in [*sharded.files, work / "sharded" / "model.safetensors.index.json"]:
                    server.client().upload_file(str(path), BUCKET, f"sharded/{path.name}", Config=UPLOAD_CONFIG)
                ab.shards = [f"sharded/{path.name}" for path in sharded.files]
            host = HostProbe()
            for round_no in range(1, args.rounds + 1):
                print(f"round {round_no}: {host.probe().text()}", flush=True)
                # Each scenario by every variant back to back, the variants' order turned by one each
                # round, so that no variant always runs first (an A/B of a one-line change read 10-20 %
                # better for whichever variant ran second, both ways round).
                names = list(args.variants)
                shift = (round_no - 1) % len(names)
                for scenario in args.scenario_list:
                    for variant in names[shift:] + names[:shift]:
                        out = ab.measure(variant, scenario)
                        results.setdefault((scenario, variant), []).append(out)
                        spied = "" if out.gil_main is None or out.gil_other is None else (
                            f" (py-spy) {out.gil_main / gb:5.3f} (trio) + {out.gil_other / gb:5.3f} (others) s/GB,")
                        gil = "" if not args.gil else (
                            f"  GIL held{spied} at most (CPU) {out.gil_bound / gb:5.3f} s/GB, trio thread "
                            f"{(out.main_user + out.main_sys) / gb:5.3f} CPU-s/GB (user {out.main_user / gb:5.3f} sys "
                            f"{out.main_sys / gb:5.3f})")
                        print(f"round {round_no} {variant:8s} {scenario:10s} {out.seconds:6.2f} s  daemon user "
                              f"{out.user:5.2f} sys {out.sys:5.2f} ({(out.user + out.sys) / gb:5.2f} CPU-s/GB)  "
                              f"weed {out.weed:5.2f} CPU-s  faulted {out.faults * mmap.PAGESIZE / 2**20:5.0f} MiB  "
                              f"reader {out.reader:5.2f} CPU-s{moved(out, gb)}{gil}",
                              flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"medians ({bed}): scenario variant seconds daemon-CPU-s daemon-CPU-s/GB weed-CPU-s "
          "daemon-faulted-MiB reader-CPU-s (every run's seconds)")
    for (scenario, variant), runs in sorted(results.items()):
        seconds = statistics.median(r.seconds for r in runs)
        daemon = statistics.median(r.user + r.sys for r in runs)
        weed = statistics.median(r.weed for r in runs)
        faulted = statistics.median(r.faults for r in runs) * mmap.PAGESIZE / 2**20
        reader = statistics.median(r.reader for r in runs)
        print(f"{scenario:10s} {variant:8s} {seconds:6.2f} {daemon:6.2f} {daemon / gb:6.2f} {weed:6.2f} "
              f"{faulted:6.0f} {reader:6.2f}  {[round(r.seconds, 2) for r in runs]}")
        if args.gil and scenario in ("cold", "fill", "warm", "warm_load", "cold_stream", "warm_stream"):
            sampled = [r.gil_main + r.gil_other for r in runs if r.gil_main is not None and r.gil_other is not None]
            bound = statistics.median(r.gil_bound / gb for r in runs)
            main = statistics.median((r.main_user + r.main_sys) / gb for r in runs)
            by_spy = f"{statistics.median(sampled) / gb:.3f} s/GB sampled" if sampled else "not sampled (no py-spy)"
            print(f"{'':10s} {variant:8s} GIL held: {by_spy}, at most "
                  f"{bound:.3f} CPU-s/GB -> GIL-bound ceiling >= {1 / bound:.1f} GB/s; trio thread {main:.3f} "
                  f"CPU-s/GB -> its own ceiling {1 / main:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
