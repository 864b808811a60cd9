"""Cold-read benchmark, side by side in one run: origin ceiling, the GET and FUSE floors, local disk, modelfs
(cold and with a warm persistent cache), s3fs, rclone, boto3 download.

It starts its own SeaweedFS, generates and uploads the models, and drops the page cache before every
measurement; it must never leave a mount, daemon or server behind, and never let one slow tool hang it.
On 2 CPUs or more the bed is pinned (`--pin`): SeaweedFS alone on the first CPU, every client-side process
on the others, so the server does not steal the CPU whose work per byte is measured.

    .venv/bin/python bench/run.py [--quick] [--out bench/out/results.json] [--size 1.6G] [--only NAME,...]

See bench/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import mmap
import os
import platform
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path[:0] = [str(REPO_ROOT), str(BENCH_DIR)]

import mounts  # noqa: E402 - bench/ is not a package; sys.path above makes these importable
import scenarios  # noqa: E402
from boto3.s3.transfer import TransferConfig  # noqa: E402

from fsmount.config import parse_size  # noqa: E402 - K/M/G/T binary suffixes, as the mount's flags
from fsmount.testing.models import write_model, write_sharded_model  # noqa: E402
from fsmount.testing.seaweed import SeaweedServer  # noqa: E402

#: One measurement (or one summary row): tool, model, scenario, status, seconds, bytes, ...
Record = dict[str, Any]

TOOLS = (
    "curl",
    "get-floor",
    "fuse-floor",
    "local-disk",
    "modelfs",
    "modelfs-warm",
    "s3fs",
    "rclone",
    "boto3-download",
)
MOUNT_TOOLS = ("fuse-floor", "modelfs", "modelfs-warm", "s3fs", "rclone")
MODELFS_TOOLS = ("modelfs", "modelfs-warm")
#: Rows that get a "× local" (throughput / local-disk's in the same round): the warm-cache target (local-disk speed).
LOCAL_RATIO_TOOLS = ("local-disk", "modelfs-warm")
BUCKET = "models"
SINGLE_KEY = "single/model.safetensors"
SHARDED_PREFIX = "sharded"
SHARDS = 4
#: Full run: the 1.6 GB file the architecture's peer numbers were measured on. Quick: enough for
#: several chunks and both shard layouts, small enough for CI (< 2 min for everything).
FULL_SIZE = "1.6G"
QUICK_SIZE = "32M"
FULL_ROUNDS = 3
FULL_TIMEOUT_S = 300.0
QUICK_TIMEOUT_S = 60.0
#: Upload like a typical client (aws cli uses 8 MiB; larger parts just make the upload faster here).
UPLOAD_CONFIG = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=8)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
#: The origin keeps its data in RAM when it fits: both models (2 x size) plus SeaweedFS's overhead.
SHM = Path("/dev/shm")
ORIGIN_FOOTPRINT = 2.2
ORIGIN_SLACK = 1 << 30
MB = 1e6  # throughput in decimal MB/s, as curl reports it; sizes on the command line are binary (1G = 2**30)
GB = 1e9  # CPU seconds per GB read: decimal too
#: The floors (bench/clients.py and bench/fuse_floor.py, each run as its own process): a parallel ranged GET
#: of the single model by a plain S3 client, and a minimal pyfuse3 daemon serving the same bytes from memory.
CLIENTS = BENCH_DIR / "clients.py"
FUSE_FLOOR = BENCH_DIR / "fuse_floor.py"
FUSE_FLOOR_FILE = "floor.bin"
FLOOR_THREADS = 16
FLOOR_PART = "8M"
#: The CPU-seconds per measurement in records and summary rows, and their columns in the table.
CPU_COLUMNS = {"daemon_cpu_s": "daemon CPU-s/GB", "reader_cpu_s": "reader CPU-s/GB", "origin_cpu_s": "origin CPU-s/GB"}
PIN_HELP = (
    "pin the bed: SeaweedFS alone on the first CPU, every client-side process (daemons, readers, curl) on the "
    "others (default: on with 2 CPUs or more)"
)
NOTE_CHARS = 300  # of a note shown in the table; the JSON has all of it

#: Workloads per model. `cat` runs the cat binary; the others run bench/scenarios.py in a fresh process.
SCENARIOS = {
    "single": ("cat", "load_file", "safe_open", "safe_open_reverse", "natural_threads", "quarters"),
    "sharded": ("cat", "load_file", "load_file_threads", "safe_open"),
}


# ---- environment -------------------------------------------------------------------------------------


def drop_caches() -> bool:
    """sync + drop page cache, dentries and inodes (the origin's files too: everything starts cold)."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def cpu_list(cpus: Iterable[int]) -> str:
    """CPU numbers in taskset's list form: [0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def can_pin() -> bool:
    """Whether this process may run on 2 CPUs or more: one for the origin, the rest for the clients."""
    return len(os.sched_getaffinity(0)) >= 2


def pin_choice(parser: argparse.ArgumentParser, pin: bool | None) -> bool:
    """`--pin/--no-pin` as given, else whether the bed can be pinned; an error if asked for and it cannot."""
    if pin and not can_pin():
        parser.error(f"--pin needs 2 CPUs or more; this process may use CPUs {cpu_list(os.sched_getaffinity(0))}")
    return can_pin() if pin is None else pin


def tree_threads(pid: int) -> set[int]:
    """Thread ids of `pid` and of every process below it, from /proc (gone ones are left out)."""
    threads: set[int] = set()
    pending = [pid]
    while pending:
        process = pending.pop()
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{process}/task")]
        except OSError:
            continue
        threads.update(tids)
        for tid in tids:
            with contextlib.suppress(OSError):
                pending += [int(c) for c in Path(f"/proc/{process}/task/{tid}/children").read_text().split()]
    return threads


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its descendants on `cpus`; what they start later inherits it. Passes
    again until one finds no thread it has not pinned (a thread may start while it runs)."""
    pinned: set[int] = set()
    while fresh := tree_threads(pid) - pinned:
        for tid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)
        pinned |= fresh


def pin_bed(server: SeaweedServer, pin: bool) -> Record:
    """With `pin`: SeaweedFS (already started; `weed mini` is one process) alone on the first CPU this
    process may use, and this process on the others, so that every client-side process it starts from
    now on (curl, the FUSE daemons, cat, scenarios.py, the floors) inherits them. What the bed is, for the
    results: {"pinned", "server_cpus", "client_cpus"} (unpinned: both are every CPU)."""
    allowed = os.sched_getaffinity(0)
    if not pin:
        return {"pinned": False, "server_cpus": cpu_list(allowed), "client_cpus": cpu_list(allowed)}
    assert server.pid is not None, "pin the bed once the server runs"
    origin, clients = {min(allowed)}, allowed - {min(allowed)}
    set_affinity(os.getpid(), clients)  # the server too, being this process's child: hence it comes second
    set_affinity(server.pid, origin)
    return {"pinned": True, "server_cpus": cpu_list(origin), "client_cpus": cpu_list(clients)}


def bed_text(bed: Record) -> str:
    """One line for logs, the Markdown header and the chart's title."""

    def cpus(text: str) -> str:
        return f"CPUs {text}" if "," in text or "-" in text else f"CPU {text}"

    if bed["pinned"]:
        return f"pinned: SeaweedFS on {cpus(bed['server_cpus'])}, clients on {cpus(bed['client_cpus'])}"
    return f"unpinned: everything on {cpus(bed['client_cpus'])}"


#: The fresh-memory probe: a new anonymous mapping of this size, every page written once.
PROBE_BYTES = 256 << 20
#: Free page reporting (virtio-balloon): the freed memory this VM has handed back to its host, where the
#: kernel says (the dev VM's does; upstream kernels have no such counter).
REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def fresh_memory_cost() -> float:
    """CPU-s per GB this process spends writing fresh memory: a new anonymous mapping, each page faulted in
    and zeroed by the kernel on its first write. Every page that a daemon, a reader or a page-cache fill
    touches for the first time costs this, at least: on the dev VM a page reused after the VM handed it back to
    its host (free page reporting) costs a fault in the host too, 2-3x in all, and a probe this small is
    served from recently freed pages, so it shows a host's baseline, not that state (HostProbe counts it)."""
    buf = mmap.mmap(-1, PROBE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = (ctypes.c_char * PROBE_BYTES).from_buffer(buf)
        try:
            start = time.thread_time()
            ctypes.memset(view, 1, PROBE_BYTES)
            spent = time.thread_time() - start
        finally:
            del view  # the mapping cannot close while ctypes holds it
    finally:
        buf.close()
    return spent / (PROBE_BYTES / GB)


def memory_returned_to_host() -> int | None:
    """Bytes of freed memory this VM has handed back to its host so far, or None where the kernel does not say."""
    try:
        return int(REPORTED_KIB.read_text()) * 1024
    except (OSError, ValueError):
        return None


#: settle_memory: the counter must stay still this long (the kernel reports every 2 s), waiting at most MAX.
SETTLE_QUIET_S = 4.0
SETTLE_MAX_S = 60.0


def settle_memory(quiet_s: float = SETTLE_QUIET_S, max_s: float = SETTLE_MAX_S) -> tuple[float, float] | None:
    """Wait until this VM has handed back to its host all the memory freed so far (free page reporting: the
    counter stops rising), so that the measurement that follows does not run while it hands back what the tool
    before it, or a drop of the page cache, freed. Returns (seconds waited, GB handed back meanwhile), or None
    where the kernel does not count it (nothing to wait for)."""
    first = last = memory_returned_to_host()
    if first is None:
        return None
    started = still_since = time.monotonic()
    while (now := time.monotonic()) - still_since < quiet_s and now - started < max_s:
        time.sleep(0.25)
        current = memory_returned_to_host()
        if current is not None and current != last:
            last, still_since = current, time.monotonic()
    return time.monotonic() - started, (last - first) / GB


def go_cold(settle: bool) -> tuple[bool, tuple[float, float] | None]:
    """drop_caches, then with `settle` settle_memory: (whether the cache was dropped, what settling waited)."""
    dropped = drop_caches()
    return dropped, settle_memory() if settle else None


class HostState(NamedTuple):
    """What HostProbe saw before a round."""

    fresh_memory_cpu_s_per_gb: float
    returned_gb: float | None  # freed memory the VM handed back to its host since the last look (None: not counted)

    def text(self) -> str:
        line = f"fresh memory costs {self.fresh_memory_cpu_s_per_gb:.2f} CPU-s/GB"
        if self.returned_gb is not None:
            line += f"; {self.returned_gb:.1f} GB of freed memory went back to the host since the last probe"
        return line


class HostProbe:
    """The host's state before each round: what fresh memory costs now, and how much freed memory the VM
    handed back to its host since the last probe (the first: since the probe was made), each such page
    costing more when reused."""

    def __init__(self) -> None:
        self._returned = memory_returned_to_host()

    def probe(self) -> HostState:
        cost = fresh_memory_cost()
        returned = memory_returned_to_host()
        known = returned is not None and self._returned is not None
        state = HostState(cost, (returned - self._returned) / GB if known else None)
        self._returned = returned
        return state


def children_cpu_seconds() -> float:
    """User + system CPU seconds of the child processes this one has waited for, and of theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tool_version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=mounts.COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else "unknown"


def environment(weed: str, bed: Record) -> Record:
    git = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
        check=False,
        capture_output=True,
        text=True,
    )
    return {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "bed": bed,
        "git": git.stdout.strip(),
        "weed": tool_version([weed, "version"]),
        "curl": tool_version(["curl", "--version"]),
        "s3fs": tool_version(["s3fs", "--version"]),
        "rclone": tool_version(["rclone", "version"]),
    }


def origin_scratch_dir(where: str, size: int) -> tuple[Path | None, str]:
    """A tmpfs dir for SeaweedFS's data (None: use the work dir on disk), and a line saying which.

    On tmpfs the origin's bytes survive drop_caches, as a remote S3's would: only the client side goes
    cold, and the ceiling is the network path, not this machine's disk.
    """
    if where == "disk":
        return None, "on local disk: dropped with the page cache, so the origin is cold too"
    needed = ORIGIN_FOOTPRINT * size + ORIGIN_SLACK
    if SHM.is_dir() and shutil.disk_usage(SHM).free > needed:
        return Path(tempfile.mkdtemp(prefix="modelfs-bench-origin-", dir=SHM)), f"in RAM ({SHM}): stays warm"
    return None, f"on local disk ({SHM} lacks {needed / MB:.0f} MB): cold too"


# ---- one measurement ---------------------------------------------------------------------------------


class Bench:
    """Everything a measurement needs; each `run_*` returns one record (status ok/timeout/error/...)."""

    def __init__(self, args: argparse.Namespace, work: Path, server: SeaweedServer) -> None:
        self.args = args
        self.work = work
        self.server = server
        self.endpoint = mounts.Endpoint(
            server.endpoint_url, BUCKET, server.access_key, server.secret_key, server.region
        )
        self.files: dict[str, list[Path]] = {}
        self.keys: dict[str, list[str]] = {}
        self.digests: dict[str, str] = {}
        self.cache_dropped = True
        self.modelfs: list[str] | None = None
        self.modelfs_note = ""
        self.modelfs_help = ""
        self.modelfs_cache_dir: Path | None = None
        #: modelfs-warm: one persistent cache dir per model on local disk, filled once per run.
        self.warm_cache_root = work / "modelfs-warm-cache"
        self.warm_fills: dict[str, Record] = {}
        self.work_fs = mounts.fs_type(work)
        self.measurement = 0  # numbers the daemon logs
        self.settle_waits: list[float] = []  # --settle: seconds waited before each measurement

    # models ---------------------------------------------------------------------------------------------

    def prepare_models(self, size: int) -> None:
        client = self.server.client(max_pool_connections=UPLOAD_CONFIG.max_concurrency)
        models = self.work / "models"
        # The single model always: curl and the GET floor read it whatever --models says.
        single = write_model(models / "single" / "model.safetensors", size)
        self.files = {"single": single.files}
        self.keys = {"single": [SINGLE_KEY]}
        uploads = [(single.files[0], SINGLE_KEY)]
        if "sharded" in self.args.models:
            sharded = write_sharded_model(models / SHARDED_PREFIX, size, shards=SHARDS)
            self.files["sharded"] = sharded.files
            self.keys["sharded"] = [f"{SHARDED_PREFIX}/{f.name}" for f in sharded.files]
            uploads += [(f, f"{SHARDED_PREFIX}/{f.name}") for f in sharded.files]
            index = models / SHARDED_PREFIX / "model.safetensors.index.json"
            uploads.append((index, f"{SHARDED_PREFIX}/{index.name}"))
        for path, key in uploads:
            client.upload_file(str(path), BUCKET, key, Config=UPLOAD_CONFIG)
        if self.args.verify:
            self.digests = {model: scenarios.files_digest(paths) for model, paths in self.files.items()}

    def model_bytes(self, model: str) -> int:
        return sum(p.stat().st_size for p in self.files[model])

    # primitives -----------------------------------------------------------------------------------------

    def record(self, tool: str, model: str, scenario: str, **fields: object) -> Record:
        record: Record = {"tool": tool, "model": model, "scenario": scenario, "status": "ok"}
        record.update(fields)
        return record

    def empty_modelfs_cache(self) -> None:
        if self.modelfs_cache_dir is not None:
            shutil.rmtree(self.modelfs_cache_dir, ignore_errors=True)
            self.modelfs_cache_dir.mkdir(parents=True)

    def cold(self) -> None:
        dropped, settled = go_cold(self.args.settle)
        self.cache_dropped = dropped and self.cache_dropped
        if settled is not None:
            self.settle_waits.append(round(settled[0], 1))

    def origin_cpu_seconds(self) -> float | None:
        used = mounts.cpu_seconds(self.server.pid) if self.server.pid is not None else None
        return sum(used) if used else None

    @contextlib.contextmanager
    def cpu_meter(self, daemon: mounts.MountedDaemon | None = None) -> Iterator[Record]:
        """CPU seconds spent while the block runs, put into the dict it yields when the block ends:
        `reader_cpu_s` by the processes it ran and waited for (curl, cat, scenarios.py with its children),
        `origin_cpu_s` by SeaweedFS and, given a mounted daemon, `daemon_cpu_s` by it (None if unknown)."""
        reader, origin = children_cpu_seconds(), self.origin_cpu_seconds()
        daemon_cpu = daemon.cpu_seconds() if daemon is not None else None
        used: Record = {}
        yield used
        used["reader_cpu_s"] = children_cpu_seconds() - reader
        origin_after = self.origin_cpu_seconds()
        used["origin_cpu_s"] = origin_after - origin if origin is not None and origin_after is not None else None
        if daemon is not None:
            daemon_after = daemon.cpu_seconds()
            known = daemon_cpu is not None and daemon_after is not None
            used["daemon_cpu_s"] = daemon_after - daemon_cpu if known else None

    def timed_command(self, argv: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
        start = time.perf_counter()
        done = subprocess.run(
            argv,
            check=False,
            stdout=subprocess.PIPE if argv[0] == "curl" else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=self.args.timeout,
            env=env,
        )
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        return seconds, (done.stdout or "").strip()

    def json_command(self, argv: list[str], env: dict[str, str] | None = None) -> Record:
        """Run a command whose last line on stdout is one JSON object (scenarios.py, clients.py): that
        object, plus the command's wall time as `process_seconds`."""
        start = time.perf_counter()
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=self.args.timeout, env=env)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            what = f"{Path(argv[1]).name} {argv[2]}"
            raise RuntimeError(f"{what} exited {done.returncode}: {done.stderr.strip()[-800:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["process_seconds"] = wall
        return result

    def workload(self, name: str, targets: list[str], env: dict[str, str] | None = None) -> Record:
        argv = [sys.executable, str(BENCH_DIR / "scenarios.py"), name, *targets]
        if self.args.verify:
            argv.append("--digest")
        if name == "download_load":
            argv += ["--tmp", str(self.work / "download")]
        return self.json_command(argv, env)

    def check_digest(self, model: str, result: Record, record: Record) -> None:
        digest = result.get("digest")
        if digest is not None and self.digests and digest != self.digests[model]:
            record["status"] = "wrong-data"
            record["note"] = "tensors differ from the source model"

    def guarded(self, tool: str, model: str, scenario: str, body: Callable[[], Record]) -> Record:
        """Run one measurement; a timeout or failure becomes a record, never an exception."""
        try:
            return body()
        except subprocess.TimeoutExpired:
            return self.record(tool, model, scenario, status="timeout", note=f"> {self.args.timeout:g} s")
        except (RuntimeError, OSError, mounts.MountError, json.JSONDecodeError) as exc:
            return self.record(tool, model, scenario, status="error", note=str(exc).strip()[-1500:])

    # tools ----------------------------------------------------------------------------------------------

    def s3_env(self) -> dict[str, str]:
        env = {**mounts.base_env(), **self.endpoint.aws_env()}
        env.update(BENCH_ENDPOINT_URL=self.endpoint.url, BENCH_BUCKET=BUCKET, PYTHONPATH=str(REPO_ROOT))
        return env

    def run_curl(self) -> Record:
        def body() -> Record:
            url = f"{self.endpoint.url}/{BUCKET}/{SINGLE_KEY}"
            sigv4 = f"aws:amz:{self.endpoint.region}:s3"
            user = f"{self.endpoint.access_key}:{self.endpoint.secret_key}"
            argv = ["curl", "-sS", "-f", "-o", "/dev/null", "-w", "%{size_download}", "--aws-sigv4", sigv4]
            argv += ["--user", user, url]
            self.cold()
            with self.cpu_meter() as cpu:
                seconds, out = self.timed_command(argv)
            if int(out) != self.model_bytes("single"):
                raise RuntimeError(f"curl got {out} bytes, expected {self.model_bytes('single')}")
            return self.record("curl", "single", "GET to /dev/null", seconds=seconds, bytes=int(out), **cpu)

        return self.guarded("curl", "single", "GET to /dev/null", body)

    def run_get_floor(self) -> Record:
        """`clients.py one`: the single model by a plain S3 client in parallel ranged GETs, bytes discarded.
        Its reader CPU is what the client reports for its timed part (not its interpreter start)."""
        client = self.args.floor_client
        scenario = f"{client}, {FLOOR_THREADS} x {FLOOR_PART} ranged GETs"

        def body() -> Record:
            argv = [sys.executable, str(CLIENTS), "one", "--endpoint", self.endpoint.url, "--bucket", BUCKET]
            argv += ["--key", SINGLE_KEY, "--client", client, "--threads", str(FLOOR_THREADS), "--part", FLOOR_PART]
            self.cold()
            with self.cpu_meter() as cpu:
                result = self.json_command(argv, env=self.s3_env())
            if result.get("error"):
                raise RuntimeError(f"{client}: {result['error']}")
            if int(result["bytes"]) != self.model_bytes("single"):
                raise RuntimeError(f"{client} got {result['bytes']} bytes, expected {self.model_bytes('single')}")
            cpu["reader_cpu_s"] = float(result["cpu_user_s"]) + float(result["cpu_sys_s"])
            fields = {key: result[key] for key in ("seconds", "bytes", "process_seconds")}
            return self.record("get-floor", "single", scenario, **fields, **cpu)

        return self.guarded("get-floor", "single", scenario, body)

    def run_download(self, model: str) -> Record:
        scenario = "download + load_file"

        def body() -> Record:
            shutil.rmtree(self.work / "download", ignore_errors=True)
            self.cold()
            try:
                with self.cpu_meter() as cpu:
                    result = self.workload("download_load", self.keys[model], env=self.s3_env())
            finally:
                shutil.rmtree(self.work / "download", ignore_errors=True)
            record = self.record("boto3-download", model, scenario, **result, **cpu)
            self.check_digest(model, result, record)
            return record

        return self.guarded("boto3-download", model, scenario, body)

    def scenario(self, scenario: str, model: str, paths: list[str]) -> Record:
        """Run one scenario over `paths` (a mount's or local files): {"seconds", "bytes", ...}."""
        if scenario == "cat":
            seconds, _ = self.timed_command(["cat", *paths])
            return {"seconds": seconds, "bytes": self.model_bytes(model)}
        env = {**mounts.base_env(), "PYTHONPATH": str(REPO_ROOT)}
        return self.workload(scenario, paths, env=env)

    def run_local(self, model: str, scenario: str) -> Record:
        """The generated model files in the work dir (local disk), read after the page cache is dropped."""

        def body() -> Record:
            paths = [str(p) for p in self.files[model]]
            self.cold()
            with self.cpu_meter() as cpu:
                result = self.scenario(scenario, model, paths)
            record = self.record("local-disk", model, scenario, **result, **cpu)
            self.check_digest(model, result, record)
            return record

        return self.guarded("local-disk", model, scenario, body)

    def modelfs_daemon(self, mountpoint: Path, cache_dir: Path | None, log_level: str) -> mounts.DaemonCommand:
        assert self.modelfs is not None
        extra = shlex.split(self.args.modelfs_args)
        return mounts.modelfs_command(self.modelfs, self.endpoint, mountpoint, extra, cache_dir, log_level)

    def warm_cache_dir(self, model: str) -> Path:
        return self.warm_cache_root / model

    def cache_dir_bytes(self, cache_dir: Path) -> int | None:
        """Bytes in a modelfs cache dir, from `modelfs cache stats DIR` (None if it cannot say)."""
        assert self.modelfs is not None
        env = {**mounts.base_env(), "PYTHONPATH": str(REPO_ROOT)}
        try:
            done = subprocess.run(
                [*self.modelfs, "cache", "stats", str(cache_dir)],
                check=False,
                capture_output=True,
                text=True,
                timeout=mounts.COMMAND_TIMEOUT_S,
                env=env,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in done.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "bytes" and fields[1].isdigit():
                return int(fields[1])
        return None

    def fill_warm_cache(self, model: str) -> Record:
        """Once per model and run: an empty cache dir, a mount on it, `cat` of the model's files, unmount.

        Raises (the measurement becomes an error) if the fill failed, now or in an earlier round."""
        fill = self.warm_fills.get(model)
        if fill is None:
            fill = self.warm_fills[model] = {"model": model, "status": "error"}
            cache_dir = self.warm_cache_dir(model)
            shutil.rmtree(cache_dir, ignore_errors=True)
            cache_dir.mkdir(parents=True)
            mountpoint = self.work / "mnt" / "modelfs-warm"
            command = self.modelfs_daemon(mountpoint, cache_dir, "info")
            log_path = self.work / "logs" / f"fill-modelfs-warm-{model}.log"
            log_path.parent.mkdir(exist_ok=True)
            daemon = mounts.MountedDaemon(command, mountpoint, log_path)
            start = time.perf_counter()
            try:
                with daemon:
                    self.timed_command(["cat", *(str(mountpoint / key) for key in self.keys[model])])
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                fill["note"] = f"{exc}\n--- modelfs log tail:\n{daemon.log_tail()}"
                raise RuntimeError(f"filling the cache failed: {fill['note']}") from exc
            fill.update(
                status="ok",
                seconds=time.perf_counter() - start,  # mount, cat, unmount (write-through finished)
                cache_dir=str(cache_dir),
                cache_bytes=self.cache_dir_bytes(cache_dir),
                **(mounts.served_bytes(daemon.log_text()) or {}),
            )
            if daemon.notes:
                fill["note"] = "; ".join(daemon.notes)
        if fill["status"] != "ok":
            raise RuntimeError(f"filling the cache failed (earlier): {str(fill.get('note', ''))[-800:]}")
        return fill

    def daemon_command(self, tool: str, mountpoint: Path, model: str) -> mounts.DaemonCommand:
        if tool == "fuse-floor":  # the single model's size, served from memory as one file
            argv = [sys.executable, str(FUSE_FLOOR), str(mountpoint), "--size", str(self.model_bytes("single"))]
            return mounts.DaemonCommand(argv, mounts.base_env())
        if tool == "modelfs":
            return self.modelfs_daemon(mountpoint, self.modelfs_cache_dir, "warning")
        if tool == "modelfs-warm":  # info: it logs the bytes served from cache and origin at unmount
            return self.modelfs_daemon(mountpoint, self.warm_cache_dir(model), "info")
        if tool == "s3fs":
            return mounts.s3fs_command(self.endpoint, mountpoint, self.work / "s3fs.passwd")
        return mounts.rclone_command(self.endpoint, mountpoint)

    def run_mounted(self, tool: str, model: str, scenario: str) -> Record:
        def body() -> Record:
            mountpoint = self.work / "mnt" / tool
            command = self.daemon_command(tool, mountpoint, model)
            keys = [FUSE_FLOOR_FILE] if tool == "fuse-floor" else self.keys[model]
            paths = [str(mountpoint / key) for key in keys]
            if tool == "modelfs":
                self.empty_modelfs_cache()  # before the daemon opens it
            elif tool == "modelfs-warm":
                self.fill_warm_cache(model)  # once per model; the daemon below is a fresh one
            self.measurement += 1
            log_path = self.work / "logs" / f"{self.measurement:03d}-{tool}-{model}-{scenario}.log"
            log_path.parent.mkdir(exist_ok=True)
            daemon = mounts.MountedDaemon(command, mountpoint, log_path)
            with daemon:
                self.cold()
                try:
                    with self.cpu_meter(daemon) as cpu:
                        result = self.scenario(scenario, model, paths)
                except RuntimeError as exc:
                    raise RuntimeError(f"{exc}\n--- {tool} log tail:\n{daemon.log_tail()}") from exc
                rss = daemon.peak_rss_mib()
            record = self.record(tool, model, scenario, **result, **cpu, peak_rss_mib=rss)
            self.check_digest(model, result, record)
            notes = list(daemon.notes)
            if tool == "modelfs-warm":  # the daemon logged what it served at unmount
                served = mounts.served_bytes(daemon.log_text())
                if served is None:
                    notes.append("no `served bytes:` line in the daemon log: origin bytes unknown")
                else:
                    record.update(served)
            if notes:
                record["note"] = "; ".join(notes)
            return record

        return self.guarded(tool, model, scenario, body)

    # one round ------------------------------------------------------------------------------------------

    def skip_reason(self, tool: str) -> str | None:
        if tool in MODELFS_TOOLS and self.modelfs is None:
            return f"modelfs CLI missing: {self.modelfs_note}"
        if tool == "modelfs-warm" and "--cache-dir" not in self.modelfs_help:
            return "this modelfs has no --cache-dir"
        if tool == "modelfs-warm" and "--cache-dir" in self.args.modelfs_args:
            return "--modelfs-args sets --cache-dir; modelfs-warm uses its own (put --work-dir on the disk to test)"
        script = {"get-floor": CLIENTS, "fuse-floor": FUSE_FLOOR}.get(tool)
        if script and not script.is_file():
            return f"bench/{script.name} is not there (yet)"
        binary = {"curl": "curl", "s3fs": "s3fs", "rclone": "rclone"}.get(tool)
        if binary and shutil.which(binary) is None:
            return f"`{binary}` not installed (apt-get install {binary})"
        if tool in MOUNT_TOOLS and shutil.which("fusermount3") is None:
            return "fusermount3 not installed"
        return None

    def round(self, tools: list[str]) -> Iterator[Record]:
        for tool in tools:
            reason = self.skip_reason(tool)
            if reason:
                yield self.record(tool, "-", "-", status="skipped", note=reason)
                continue
            if tool == "curl":
                yield self.run_curl()
            elif tool == "get-floor":
                yield self.run_get_floor()
            elif tool == "fuse-floor":
                yield self.run_mounted(tool, "single", "cat")
            elif tool == "boto3-download":
                for model in self.args.models:
                    yield self.run_download(model)
            elif tool == "local-disk":
                for model in self.args.models:
                    for scenario in self.scenarios(model):
                        yield self.run_local(model, scenario)
            else:
                for model in self.args.models:
                    for scenario in self.scenarios(model):
                        yield self.run_mounted(tool, model, scenario)

    def scenarios(self, model: str) -> list[str]:
        return [s for s in SCENARIOS[model] if self.args.scenarios is None or s in self.args.scenarios]


# ---- summary -----------------------------------------------------------------------------------------


def summarize(records: list[Record]) -> list[Record]:
    """One row per (tool, model, scenario): median seconds and CPU seconds (daemon, reader, origin; also per
    GB read) over the ok rounds, max peak RSS, max origin bytes (modelfs-warm), and the medians over rounds
    of throughput / curl's and (local-disk, modelfs-warm) throughput / local-disk's same model and scenario,
    each in the same round, so drift between rounds cancels."""
    ok_records = [r for r in records if r["status"] == "ok"]
    curl_mb_s = {r["round"]: r["bytes"] / r["seconds"] / MB for r in ok_records if r["tool"] == "curl"}
    local_mb_s = {
        (r["round"], r["model"], r["scenario"]): r["bytes"] / r["seconds"] / MB
        for r in ok_records
        if r["tool"] == "local-disk"
    }
    groups: dict[tuple[str, str, str], list[Record]] = {}
    for record in records:
        groups.setdefault((str(record["tool"]), str(record["model"]), str(record["scenario"])), []).append(record)
    rows = []
    for (tool, model, scenario), group in groups.items():
        ok = [r for r in group if r["status"] == "ok"]
        row: Record = {"tool": tool, "model": model, "scenario": scenario, "runs": len(group)}
        bad = [r for r in group if r["status"] != "ok"]
        row["status"] = "ok" if not bad else str(bad[0]["status"])
        notes = sorted({str(r["note"]) for r in group if r.get("note")})
        if notes:
            row["note"] = " | ".join(notes)
        if ok:
            seconds = statistics.median(float(r["seconds"]) for r in ok)
            nbytes = int(ok[0]["bytes"])
            row.update(seconds=seconds, seconds_all=[r["seconds"] for r in ok], bytes=nbytes)
            row["mb_s"] = nbytes / seconds / MB
            rss = [float(r["peak_rss_mib"]) for r in ok if r.get("peak_rss_mib") is not None]
            row["peak_rss_mib"] = max(rss) if rss else None
            for field in CPU_COLUMNS:
                used = [float(r[field]) for r in ok if r.get(field) is not None]
                row[field] = statistics.median(used) if used else None
                row[f"{field}_per_gb"] = row[field] / (nbytes / GB) if used and nbytes else None
            ratios = [r["bytes"] / r["seconds"] / MB / curl_mb_s[r["round"]] for r in ok if r["round"] in curl_mb_s]
            row["ratio_to_curl"] = statistics.median(ratios) if ratios else None
            if tool in LOCAL_RATIO_TOOLS:
                local = [
                    r["bytes"] / r["seconds"] / MB / local_mb_s[key]
                    for r in ok
                    if (key := (r["round"], model, scenario)) in local_mb_s
                ]
                row["ratio_to_local"] = statistics.median(local) if local else None
            origin = [int(r["origin_bytes"]) for r in ok if r.get("origin_bytes") is not None]
            if origin:
                row["origin_bytes"] = max(origin)
                row["origin_requests"] = max(int(r["origin_requests"]) for r in ok if "origin_requests" in r)
        rows.append(row)
    return rows


def markdown_table(rows: list[Record]) -> str:
    cpu_headers = " | ".join(CPU_COLUMNS.values())
    lines = [
        f"| tool | model | scenario | seconds | MB/s | × curl | × local | {cpu_headers} | daemon peak RSS MiB "
        "| origin MB | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        seconds = f"{row['seconds']:.2f}" if row.get("seconds") is not None else str(row["status"])
        mb_s = f"{row['mb_s']:.0f}" if row.get("mb_s") else ""
        ratio = f"{row['ratio_to_curl']:.2f}" if row.get("ratio_to_curl") else ""
        local = f"{row['ratio_to_local']:.2f}" if row.get("ratio_to_local") else ""
        rss = f"{row['peak_rss_mib']:.0f}" if row.get("peak_rss_mib") else ""
        cpu = [
            f"{row[f'{field}_per_gb']:.2f}" if row.get(f"{field}_per_gb") is not None else "" for field in CPU_COLUMNS
        ]
        origin = f"{row['origin_bytes'] / MB:.1f}" if row.get("origin_bytes") is not None else ""
        note = " ".join(str(row.get("note", "")).replace("|", "/").split())
        note = note[-NOTE_CHARS:] if row["status"] == "error" else note[:NOTE_CHARS]  # errors: the end says why
        if row["status"] != "ok" and row.get("seconds") is not None:
            note = f"{row['status']} in some rounds; {note}"
        cells = [row["tool"], row["model"], row["scenario"], seconds, mb_s, ratio, local, *cpu, rss, origin, note]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def find_row(rows: list[Record], tool: str, scenario: str | None = None) -> Record | None:
    """The summary row of `tool` on the single model (in `scenario` if given) that has a time, if any."""
    for row in rows:
        wanted = row["tool"] == tool and row["model"] == "single" and scenario in (None, row["scenario"])
        if wanted and row.get("seconds") is not None:
            return row
    return None


def targets_line(rows: list[Record]) -> str:
    """Issue #13's targets for `cat` of the single model, those this run's rows allow, as ratios of medians:
    modelfs's daemon CPU-s/GB against the floors' sum and against s3fs's, its seconds against curl's,
    s3fs's seconds against modelfs's."""
    modelfs, s3fs = find_row(rows, "modelfs", "cat"), find_row(rows, "s3fs", "cat")
    curl, get_floor, fuse_floor = find_row(rows, "curl"), find_row(rows, "get-floor"), find_row(rows, "fuse-floor")

    def value(row: Record | None, field: str) -> float | None:
        return row.get(field) if row else None

    get_cpu, fuse_cpu = value(get_floor, "reader_cpu_s_per_gb"), value(fuse_floor, "daemon_cpu_s_per_gb")
    floors = get_cpu + fuse_cpu if get_cpu is not None and fuse_cpu is not None else None
    checks = [
        (
            "modelfs daemon CPU-s/GB ÷ (get-floor reader + fuse-floor daemon CPU-s/GB)",
            value(modelfs, "daemon_cpu_s_per_gb"),
            floors,
            "≤",
            1.3,
        ),
        (
            "modelfs ÷ s3fs daemon CPU",
            value(modelfs, "daemon_cpu_s_per_gb"),
            value(s3fs, "daemon_cpu_s_per_gb"),
            "≤",
            0.75,
        ),
        ("modelfs `cat` ÷ curl seconds", value(modelfs, "seconds"), value(curl, "seconds"), "≤", 1.25),
        ("s3fs ÷ modelfs `cat` seconds", value(s3fs, "seconds"), value(modelfs, "seconds"), "≥", 1.3),
    ]
    parts = []
    for name, numerator, denominator, sense, target in checks:
        if numerator is None or not denominator:
            continue
        ratio = numerator / denominator
        met = ratio <= target if sense == "≤" else ratio >= target
        parts.append(f"{name} = {ratio:.2f}× (target {sense} {target}×: {'met' if met else 'not met'})")
    return "Issue #13 targets, `cat` of the single model: " + "; ".join(parts) + "." if parts else ""


def grouped_bars(axes: Any, rows: list[Record], field: str, colors: dict[str, Any]) -> None:
    """Bars of `field`: one group per (model, scenario), models and scenarios in SCENARIOS' order (the rows
    of curl, the floors and downloads first), one bar per tool in the group, in TOOLS' order."""

    def order(row: Record) -> tuple[int, int]:
        scenarios = SCENARIOS.get(row["model"], ())
        in_list = row["scenario"] in scenarios
        return list(SCENARIOS).index(row["model"]), scenarios.index(row["scenario"]) if in_list else -1

    groups: dict[tuple[str, str], list[Record]] = {}
    for row in sorted(rows, key=order):
        groups.setdefault((row["model"], row["scenario"]), []).append(row)
    width = 0.8 / max(3, *(len(members) for members in groups.values()))
    labelled: set[str] = set()
    for x, members in enumerate(groups.values()):
        members.sort(key=lambda r: TOOLS.index(r["tool"]))
        for i, row in enumerate(members):
            tool = row["tool"]
            offset = (i - (len(members) - 1) / 2) * width
            label = tool if tool not in labelled else None
            axes.bar(x + offset, row[field], width, color=colors[tool], label=label)
            labelled.add(tool)
    axes.set_xticks(range(len(groups)), [f"{model}/{scenario}" for model, scenario in groups], rotation=30, ha="right")
    axes.set_xlim(-0.5, len(groups) - 0.5)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")


def write_chart(rows: list[Record], path: Path, title: str) -> str:
    """`path` (PNG): median seconds per model/scenario, a bar per tool, and below them the daemon CPU-s/GB
    of each mount's `cat`. Returns a line for the log (also when matplotlib is missing: no chart)."""
    try:
        import matplotlib
    except ImportError:
        return "no chart: matplotlib is not installed (.venv/bin/pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("seconds") is not None]
    if not timed:
        return "no chart: no measurement succeeded"
    cat_cpu = [r for r in timed if r["scenario"] == "cat" and r.get("daemon_cpu_s_per_gb") is not None]
    colors = {tool: plt.get_cmap("tab10")(i % 10) for i, tool in enumerate(TOOLS)}
    groups = len({(r["model"], r["scenario"]) for r in timed})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(10, 0.9 * groups + 3), 9), height_ratios=(2, 1))
    fig.suptitle(title)
    grouped_bars(top, timed, "seconds", colors)
    top.set_ylabel("seconds (median)")
    if cat_cpu:
        grouped_bars(bottom, cat_cpu, "daemon_cpu_s_per_gb", colors)
        for bars in bottom.containers:
            bottom.bar_label(bars, fmt="%.2f", fontsize="x-small")
    bottom.set_ylabel("daemon CPU-s/GB, cat")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"chart: {path}"


# ---- main --------------------------------------------------------------------------------------------


def local_disk_note(args: argparse.Namespace, work: Path, bench: Bench) -> str:
    """A line under the table: where local-disk's files and modelfs-warm's cache live, and the fills."""
    parts = []
    if "local-disk" in args.tools or bench.warm_fills:
        in_ram = " — in RAM, not a disk: use --work-dir" if bench.work_fs in ("tmpfs", "ramfs") else ""
        parts.append(f"local-disk files and modelfs-warm cache dirs: {work} ({bench.work_fs}{in_ram}).")
    for fill in bench.warm_fills.values():
        if fill["status"] != "ok":
            parts.append(f"modelfs-warm cache fill of {fill['model']} failed.")
            continue
        origin = f"{fill['origin_bytes'] / MB:.0f} MB from origin" if "origin_bytes" in fill else "origin unknown"
        cached = f", cache holds {fill['cache_bytes'] / MB:.0f} MB" if fill.get("cache_bytes") is not None else ""
        took = f"{fill['seconds']:.1f} s"
        parts.append(f"modelfs-warm fill of {fill['model']} (`cat`, once): {origin} in {took}{cached}.")
    return " ".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_SIZE} models, one round, data verified (CI)")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "results.json", help="JSON results (a .md beside)")
    p.add_argument("--size", default=None, help=f"model size, K/M/G binary suffixes (default {FULL_SIZE})")
    p.add_argument("--only", default=",".join(TOOLS), help=f"comma-separated tools from {','.join(TOOLS)}")
    p.add_argument("--models", default="single,sharded", help="comma-separated: single, sharded")
    p.add_argument("--scenarios", default=None,
                   help="comma-separated scenarios to run of each model's (default all): "
                   + "; ".join(f"{m}: {','.join(names)}" for m, names in SCENARIOS.items()))
    p.add_argument("--rounds", type=int, default=None, help=f"rounds, median reported (default {FULL_ROUNDS}; 1 quick)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per measurement before it is abandoned")
    p.add_argument("--modelfs-args", default="", help='extra modelfs mount flags, e.g. "--chunk-size 16M"')
    p.add_argument("--modelfs-cmd", default=None, help="modelfs command (default: venv script, else -m fsmount)")
    p.add_argument(
        "--no-modelfs-cache",
        action="store_true",
        help="do not give the (cold) modelfs tool a --cache-dir; modelfs-warm always has one",
    )
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None, help="check tensor digests")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None, help=PIN_HELP)
    p.add_argument(
        "--floor-client",
        default="presigned",
        help=f"the S3 client of get-floor (bench/clients.py --client; {FLOOR_THREADS} threads x {FLOOR_PART}); "
        "default: presigned, what modelfs's ranged GETs use",
    )
    p.add_argument(
        "--origin",
        choices=("ram", "disk"),
        default="ram",
        help="where SeaweedFS keeps the objects: ram (/dev/shm, stays warm like a remote S3; default) or "
        "disk (dropped with the page cache too)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="scratch dir on local disk; also local-disk's files and modelfs-warm's cache (default: a temp dir "
        "in /var/tmp)",
    )
    p.add_argument("--keep-work", action="store_true", help="keep the scratch dir (logs, models) afterwards")
    p.add_argument(
        "--settle",
        action="store_true",
        help="after dropping the page cache, wait until the VM has handed all freed memory back to its host (free "
        "page reporting), so that no measurement runs while it does (see README)",
    )
    args = p.parse_args(argv)
    args.size = parse_size(args.size or (QUICK_SIZE if args.quick else FULL_SIZE))
    args.rounds = args.rounds or (1 if args.quick else FULL_ROUNDS)
    args.timeout = args.timeout or (QUICK_TIMEOUT_S if args.quick else FULL_TIMEOUT_S)
    args.verify = args.quick if args.verify is None else args.verify
    args.pin = pin_choice(p, args.pin)
    args.tools = [t for t in (s.strip() for s in args.only.split(",")) if t]
    args.models = [m for m in (s.strip() for s in args.models.split(",")) if m]
    for tool in args.tools:
        if tool not in TOOLS:
            p.error(f"unknown tool {tool!r}; choose from {', '.join(TOOLS)}")
    for model in args.models:
        if model not in SCENARIOS:
            p.error(f"unknown model {model!r}; choose from {', '.join(SCENARIOS)}")
    if args.scenarios is not None:
        args.scenarios = {s.strip() for s in args.scenarios.split(",") if s.strip()}
        known = {name for names in SCENARIOS.values() for name in names}
        for name in sorted(args.scenarios - known):
            p.error(f"unknown scenario {name!r}; choose from {', '.join(sorted(known))}")
    return args


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so `finally` unmounts and stops the server
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="modelfs-bench-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    records: list[Record] = []
    probes: list[float] = []  # fresh_memory_cost() before each round
    returned: list[float | None] = []  # GB the VM handed back to its host before each round (None: not counted)
    host = HostProbe()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    origin_scratch: Path | None = None
    try:
        origin_scratch, origin_note = origin_scratch_dir(args.origin, args.size)
        origin_dir = (origin_scratch or work) / "weed"
        log(f"origin data: {origin_note}")
        with SeaweedServer(origin_dir, buckets=[BUCKET], log_path=work / "weed.log") as server:
            bed = pin_bed(server, args.pin)  # before anything else starts: it all inherits the client CPUs
            log(bed_text(bed))
            bench = Bench(args, work, server)
            if set(MODELFS_TOOLS) & set(args.tools):
                bench.modelfs, help_or_reason = mounts.find_modelfs(args.modelfs_cmd)
                if bench.modelfs is None:
                    bench.modelfs_note = help_or_reason
                    log(f"modelfs skipped: {help_or_reason}")
                else:
                    bench.modelfs_help = help_or_reason
                if (
                    bench.modelfs is not None
                    and "modelfs" in args.tools
                    and not args.no_modelfs_cache
                    and "--cache-dir" in help_or_reason
                    and "--cache-dir" not in args.modelfs_args
                ):
                    bench.modelfs_cache_dir = work / "modelfs-cache"
            log(f"SeaweedFS at {server.endpoint_url}; generating and uploading {args.size / MB:.0f} MB models")
            bench.prepare_models(args.size)
            env = environment(str(server.weed_binary or "weed"), bed)
            for round_index in range(args.rounds):
                state = host.probe()
                probes.append(state.fresh_memory_cpu_s_per_gb)
                returned.append(state.returned_gb)
                log(f"round {round_index + 1}: {state.text()}")
                for record in bench.round(args.tools):
                    record["round"] = round_index
                    records.append(record)
                    shown = f"{record['seconds']:.2f} s" if record.get("seconds") is not None else ""
                    log(
                        f"round {round_index + 1}: {record['tool']} {record['model']} {record['scenario']}: "
                        f"{record['status']} {shown} {str(record.get('note', ''))[:200]}"
                    )
    finally:
        if origin_scratch is not None:
            shutil.rmtree(origin_scratch, ignore_errors=True)  # RAM: never kept
        if not args.keep_work and args.work_dir is None:
            mounts.remove_tree(work)
        elif args.keep_work:
            print(f"scratch dir kept: {work}", file=sys.stderr)

    rows = summarize(records)
    table = markdown_table(rows)
    for line in (targets_line(rows), local_disk_note(args, work, bench)):
        if line:
            table += "\n\n" + line
    print(table)
    if not bench.cache_dropped:
        print("\nWARNING: the page cache could not be dropped (not root?): these are not cold reads.")
    command = shlex.join([Path(sys.executable).name, "bench/run.py", *(argv if argv is not None else sys.argv[1:])])
    document = {
        "command": command,
        "started": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(timespec="seconds"),
        "seconds": time.time() - started,
        "size_bytes": args.size,
        "rounds": args.rounds,
        "cache_dropped": bench.cache_dropped,
        "origin": origin_note,
        "modelfs_command": bench.modelfs,
        "modelfs_args": args.modelfs_args,
        "modelfs_cache_dir": bench.modelfs_cache_dir is not None,
        "local_disk": {"dir": str(work), "fs": bench.work_fs},
        "modelfs_warm_fills": list(bench.warm_fills.values()),
        "environment": env,
        "fresh_memory_cpu_s_per_gb": probes,
        "memory_returned_to_host_gb": returned,
        "settle_waits_s": bench.settle_waits if args.settle else None,
        "summary": rows,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    started_text = document["started"]
    fresh = ", ".join(f"{p:.2f}" for p in probes)
    args.out.with_suffix(".md").write_text(
        f"`{command}` ({started_text}, {env['kernel']}, {env['cpus']} CPUs, {bed_text(bed)}; fresh memory "
        f"{fresh} CPU-s/GB before each round{'; memory settled before each measurement' if args.settle else ''})"
        f"\n\n{table}\n"
    )
    size = f"{args.size / (1 << 30):.1f} GiB" if args.size >= 1 << 30 else f"{args.size >> 20} MiB"
    rounds = f"median of {args.rounds} rounds" if args.rounds > 1 else "1 round"
    log(write_chart(rows, args.out.with_suffix(".png"), f"{bed_text(bed)}; models of {size}, {rounds}"))
    failed = [r for r in rows if r["status"] in ("error", "wrong-data")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
