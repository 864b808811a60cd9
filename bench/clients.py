"""The GET floor per HTTP client: CPU and seconds to read one object with N threads of ranged GETs.

modelfs spends most of its CPU receiving bytes; this asks how much of that is the HTTP client's. Every
client reads the same object as PART-byte ranged GETs from THREADS threads and drops the bytes:

  boto3           client.get_object(Range=..., IfMatch=etag)["Body"].read() (config like fsmount's store)
  presigned       modelfs's own data plane (fsmount.data.presigned): a presigned URL (boto3), kept-alive
                  http.client connections, Range + If-Match headers, body readinto() a reused per-thread
                  buffer, every check of the daemon's GETs
  obstore         obstore.get_range(S3Store, key, start=, length=) (sync API; Rust, returns a buffer); no If-Match
  obstore-ifmatch obstore.get(store, key, options={range, if_match}).bytes()
  awscrt          awscrt.s3.S3Client, one GET_OBJECT meta request per part (Range + If-Match headers) made from
                  the N threads, body through on_body (dropped); plain http via S3RequestTlsMode.DISABLED
  awscrt-whole    one GET_OBJECT of the whole object, split by the CRT itself into PART-byte ranged GETs over
                  up to THREADS connections (how the CRT is meant to be used)

    .venv/bin/python bench/clients.py one --endpoint URL --bucket B --key K --client NAME \\
        [--threads 16] [--part 8M] [--verify SHA256]
    .venv/bin/python bench/clients.py ab [--size 1G] [--rounds 3] [--clients boto3,presigned,obstore,awscrt] \\
        [--threads 16] [--part 8M] [--pin] [--no-verify] [--out FILE.json]

`one` prints one JSON line; credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION.
Only the read phase is measured (time.perf_counter and getrusage(RUSAGE_SELF) user+sys around it: all
threads of the process, the CRT's event-loop threads too); imports, client setup and the HEAD are not.
With --verify the parts are also copied into one buffer (that copy is inside the measurement) and its
sha256 is compared afterwards (outside).

`ab` starts its own SeaweedFS (data in /dev/shm), uploads one random object, runs one unmeasured
--verify pass per client, then alternates the clients round after round, each `one` in a fresh process
after the page cache is dropped. --pin puts every SeaweedFS thread on CPU 0 and the client on CPUs 1..N-1.
A client whose package is missing is reported as skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
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
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(REPO_ROOT))

from fsmount.config import parse_size  # noqa: E402 - K/M/G/T binary suffixes, as the mount's flags

GB = 1e9  # CPU-seconds per decimal GB, as bench/run.py reports MB/s
CLIENTS = ("boto3", "presigned", "obstore", "obstore-ifmatch", "awscrt", "awscrt-whole")
DEFAULT_CLIENTS = "boto3,presigned,obstore,awscrt"
#: The Python package each client needs (reported as skipped when it is not installed).
PACKAGES = {"boto3": "boto3", "presigned": "boto3", "obstore": "obstore", "obstore-ifmatch": "obstore",
            "awscrt": "awscrt", "awscrt-whole": "awscrt"}
BUCKET = "bench"
KEY = "floor/object.bin"
ONE_TIMEOUT_S = 300.0
WRITE_BLOCK = 8 << 20
# ---- one client, one read of the whole object ----------------------------------------------------------


class Target:
    """Where the object is and who we are."""

    def __init__(self, endpoint: str, bucket: str, key: str) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.bucket = bucket
        self.key = key
        self.access_key = os.environ.get("AWS_ACCESS_KEY_ID", "")
        self.secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
        self.region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        parsed = urllib.parse.urlsplit(self.endpoint)
        self.scheme = parsed.scheme
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.size = 0
        self.etag = ""

    def boto3_client(self, threads: int) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            region_name=self.region,
            max_pool_connections=threads + 4,
            retries={"max_attempts": 4, "mode": "standard"},
            s3={"addressing_style": "path"},
            tcp_keepalive=True,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, config=config)

    def head(self) -> None:
        resp = self.boto3_client(1).head_object(Bucket=self.bucket, Key=self.key)
        self.size = int(resp["ContentLength"])
        self.etag = resp["ETag"]


class Client:
    """`setup()` once (not measured); then each thread calls `read(state, start, length, sink)` with its own
    `state = thread_state()`; `read` returns the bytes it got. `sink` is None (drop the bytes) or a
    memoryview of the whole object to copy them into (--verify)."""

    name = ""

    def __init__(self, target: Target, threads: int, part: int) -> None:
        self.t = target
        self.threads = threads
        self.part = part

    def setup(self) -> None:
        pass

    def thread_state(self) -> Any:
        return None

    def read(self, state: Any, start: int, length: int, sink: memoryview | None) -> int:
        raise NotImplementedError

    def run_all(self, sink: memoryview | None) -> int:
        """Read every part from `threads` threads; the bytes they got."""
        parts = iter([(s, min(self.part, self.t.size - s)) for s in range(0, self.t.size, self.part)])
        lock = threading.Lock()
        got = [0] * self.threads
        errors: list[BaseException] = []

        def next_part() -> tuple[int, int] | None:
            with lock:
                if errors:
                    return None
                return next(parts, None)

        def worker(index: int) -> None:
            try:
                state = self.thread_state()
                while (job := next_part()) is not None:
                    got[index] += self.read(state, job[0], job[1], sink)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                with lock:
                    errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,), name=f"get-{i}") for i in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        return sum(got)


class Boto3Client(Client):
    name = "boto3"

    def setup(self) -> None:
        self.client = self.t.boto3_client(self.threads)

    def read(self, state: Any, start: int, length: int, sink: memoryview | None) -> int:
        resp = self.client.get_object(Bucket=self.t.bucket, Key=self.t.key, Range=f"bytes={start}-{start + length - 1}",
                                      IfMatch=self.t.etag)
        data = resp["Body"].read()
        if len(data) != length:
            raise RuntimeError(f"short body at {start}: {len(data)} of {length}")
        if sink is not None:
            sink[start:start + length] = data
        return len(data)


class PresignedClient(Client):
    """modelfs's own data plane (fsmount.data.presigned.RangeGetter, checks included): the GET floor of
    what the daemon runs."""

    name = "presigned"

    def setup(self) -> None:
        from fsmount.data.presigned import URL_EXPIRES_S, RangeGetter

        client = self.t.boto3_client(1)

        def presign(key: str) -> str:
            return client.generate_presigned_url(
                "get_object", Params={"Bucket": self.t.bucket, "Key": key}, ExpiresIn=URL_EXPIRES_S)

        self.getter = RangeGetter(presign, bucket=self.t.bucket, pool_size=self.threads, connect_timeout=60,
                                  read_timeout=60)

    def thread_state(self) -> Any:
        return memoryview(bytearray(self.part))

    def read(self, state: Any, start: int, length: int, sink: memoryview | None) -> int:
        view = state[:length]
        self.getter.get_into(self.t.key, self.t.etag, start, view, f"GET at {start}")
        if sink is not None:
            sink[start:start + length] = view
        return length


class ObstoreClient(Client):
    name = "obstore"

    def setup(self) -> None:
        import obstore
        from obstore.store import S3Store

        self.obstore = obstore
        self.store = S3Store(
            self.t.bucket,
            endpoint=self.t.endpoint,
            access_key_id=self.t.access_key,
            secret_access_key=self.t.secret_key,
            region=self.t.region,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True, "pool_max_idle_per_host": str(self.threads + 4)},
        )

    def fetch(self, start: int, length: int) -> Any:
        return self.obstore.get_range(self.store, self.t.key, start=start, length=length)

    def read(self, state: Any, start: int, length: int, sink: memoryview | None) -> int:
        data = memoryview(self.fetch(start, length))
        if data.nbytes != length:
            raise RuntimeError(f"short body at {start}: {data.nbytes} of {length}")
        if sink is not None:
            sink[start:start + length] = data
        return data.nbytes


class ObstoreIfMatchClient(ObstoreClient):
    name = "obstore-ifmatch"

    def fetch(self, start: int, length: int) -> Any:
        options = {"range": (start, start + length), "if_match": self.t.etag}
        return self.obstore.get(self.store, self.t.key, options=options).bytes()


class AwsCrtClient(Client):
    name = "awscrt"

    def setup(self) -> None:
        from awscrt import auth, http, io, s3

        self.http = http
        self.s3 = s3
        event_loops = io.EventLoopGroup()
        bootstrap = io.ClientBootstrap(event_loops, io.DefaultHostResolver(event_loops))
        credentials = auth.AwsCredentialsProvider.new_static(self.t.access_key, self.t.secret_key)
        tls = s3.S3RequestTlsMode.ENABLED if self.t.scheme == "https" else s3.S3RequestTlsMode.DISABLED
        self.client = s3.S3Client(
            bootstrap=bootstrap,
            region=self.t.region,
            tls_mode=tls,
            signing_config=s3.create_default_s3_signing_config(region=self.t.region, credential_provider=credentials),
            part_size=self.part,
            max_active_connections_override=self.threads,
        )
        # The CRT connects to the Host header's host and port (its Python API takes no endpoint).
        default_port = 443 if self.t.scheme == "https" else 80
        self.host_header = self.t.host if self.t.port == default_port else f"{self.t.host}:{self.t.port}"
        self.path = "/" + urllib.parse.quote(f"{self.t.bucket}/{self.t.key}")

    def get(self, headers: list[tuple[str, str]], on_body: Callable[..., None]) -> int:
        status: list[int] = []
        request = self.http.HttpRequest("GET", self.path, self.http.HttpHeaders([("Host", self.host_header), *headers]))
        made = self.client.make_request(
            type=self.s3.S3RequestType.GET_OBJECT,
            request=request,
            on_headers=lambda status_code, headers, **kw: status.append(status_code),
            on_body=on_body,
        )
        made.finished_future.result()
        return status[0] if status else 0

    def read(self, state: Any, start: int, length: int, sink: memoryview | None) -> int:
        got = 0

        def on_body(chunk: bytes, offset: int, **kwargs: Any) -> None:
            nonlocal got
            got += len(chunk)
            if sink is not None:  # the CRT gives offsets in the object, also for a ranged GET (--verify checks)
                sink[offset:offset + len(chunk)] = chunk

        status = self.get([("Range", f"bytes={start}-{start + length - 1}"), ("If-Match", self.t.etag)], on_body)
        if status not in (200, 206) or got != length:
            raise RuntimeError(f"GET at {start}: HTTP {status}, {got} of {length} bytes")
        return got


class AwsCrtWholeClient(AwsCrtClient):
    name = "awscrt-whole"

    def run_all(self, sink: memoryview | None) -> int:
        got = 0
        lock = threading.Lock()

        def on_body(chunk: bytes, offset: int, **kwargs: Any) -> None:
            nonlocal got
            with lock:  # called from several event-loop threads
                got += len(chunk)
            if sink is not None:
                sink[offset:offset + len(chunk)] = chunk

        status = self.get([("If-Match", self.t.etag)], on_body)
        if status not in (200, 206):
            raise RuntimeError(f"GET: HTTP {status}")
        return got


CLIENT_CLASSES: dict[str, type[Client]] = {c.name: c for c in (
    Boto3Client, PresignedClient, ObstoreClient, ObstoreIfMatchClient, AwsCrtClient, AwsCrtWholeClient)}


def missing_package(client: str) -> str | None:
    package = PACKAGES[client]
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return f"package {package!r} is not installed (pip install 'modelfs[bench]')"
    return None


def measure_one(args: argparse.Namespace) -> dict[str, Any]:
    # With awscrt installed botocore signs through the CRT; a modelfs install (no awscrt) signs in Python.
    os.environ.setdefault("BOTO_DISABLE_CRT", "true")
    record: dict[str, Any] = {"client": args.client, "seconds": None, "bytes": None, "cpu_user_s": None,
                              "cpu_sys_s": None, "cpu_s_per_gb": None, "error": None, "skipped": None,
                              "threads": args.threads, "part": args.part, "verified": None}
    reason = missing_package(args.client)
    if reason:
        record["skipped"] = record["error"] = f"skipped: {reason}"
        return record
    try:
        record["version"] = importlib.metadata.version(PACKAGES[args.client])
        target = Target(args.endpoint, args.bucket, args.key)
        target.head()
        client = CLIENT_CLASSES[args.client](target, args.threads, args.part)
        client.setup()
        whole = memoryview(bytearray(target.size)) if args.verify else None
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        got = client.run_all(whole)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        record.update(seconds=seconds, bytes=got, cpu_user_s=user, cpu_sys_s=system,
                      cpu_s_per_gb=(user + system) / (got / GB) if got else None)
        if got != target.size:
            record["error"] = f"read {got} bytes of {target.size}"
        elif whole is not None:
            digest = hashlib.sha256(whole).hexdigest()
            record["verified"] = digest == args.verify.lower()
            if not record["verified"]:
                record["error"] = f"sha256 {digest} differs from the expected {args.verify}"
    except Exception as exc:  # noqa: BLE001 - one JSON line whatever happens
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    return record


# ---- A/B of the clients against a private SeaweedFS --------------------------------------------------------


def cpu_list(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def write_random_object(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(WRITE_BLOCK, left))
            digest.update(block)
            f.write(block)
            left -= len(block)
    return digest.hexdigest()


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], clients: list[str]) -> list[dict[str, Any]]:
    rows = []
    for client in clients:
        mine = [r for r in runs if r["client"] == client]
        ok = [r for r in mine if not r.get("error")]
        skipped = next((r["skipped"] for r in mine if r.get("skipped")), None)
        errors = [r["error"] for r in mine if r.get("error") and not r.get("skipped")]
        rows.append({
            "client": client,
            "runs": len(ok),
            "seconds": median([r["seconds"] for r in ok]),
            "cpu_s_per_gb": median([r["cpu_s_per_gb"] for r in ok]),
            "cpu_user_s": median([r["cpu_user_s"] for r in ok]),
            "cpu_sys_s": median([r["cpu_sys_s"] for r in ok]),
            "server_cpu_s_per_gb": median([r["server_cpu_s_per_gb"] for r in ok if r.get("server_cpu_s_per_gb")]),
            "note": skipped or (errors[0] if errors else ""),
        })
    base = next((r["cpu_s_per_gb"] for r in rows if r["client"] == "boto3" and r["cpu_s_per_gb"]), None)
    for row in rows:
        row["cpu_vs_boto3"] = row["cpu_s_per_gb"] / base if base and row["cpu_s_per_gb"] else None
    return rows


def markdown(rows: list[dict[str, Any]], size: int) -> str:
    def f(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    lines = [
        "| client | runs | seconds | GB/s | CPU-s/GB | user / sys s | CPU vs boto3 | SeaweedFS CPU-s/GB | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rate = size / GB / r["seconds"] if r["seconds"] else None
        split = f"{r['cpu_user_s']:.2f} / {r['cpu_sys_s']:.2f}" if r["cpu_user_s"] is not None else ""
        lines.append(f"| {r['client']} | {r['runs']} | {f(r['seconds'], '.2f')} | {f(rate, '.2f')} | "
                     f"{f(r['cpu_s_per_gb'], '.2f')} | {split} | {f(r['cpu_vs_boto3'], '.2f')} | "
                     f"{f(r['server_cpu_s_per_gb'], '.2f')} | {r['note'][:200]} |")
    return "\n".join(lines)


def run_ab(args: argparse.Namespace) -> int:
    sys.path[:0] = [str(REPO_ROOT), str(BENCH_DIR)]
    import mounts  # bench/ is not a package
    from run import UPLOAD_CONFIG, drop_caches, origin_scratch_dir

    from fsmount.testing.seaweed import SeaweedServer

    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so `finally` stops the server
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    cpus = os.cpu_count() or 1
    client_cpus = cpu_list(1, cpus - 1) if cpus > 1 else "0"
    if args.pin and (cpus < 2 or shutil.which("taskset") is None):
        log("--pin needs 2 CPUs and taskset; not pinning")
        args.pin = False
    work = Path(tempfile.mkdtemp(prefix="modelfs-clients-", dir="/var/tmp"))
    scratch: Path | None = None
    runs: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    cache_dropped = True
    try:
        # The origin's data in RAM: dropping the page cache then makes only the client cold.
        scratch, note = origin_scratch_dir("shm", args.size)
        log(f"origin data: {note}")
        with SeaweedServer((scratch or work) / "weed", buckets=[BUCKET], log_path=work / "weed.log") as server:
            assert server.pid is not None
            if args.pin:
                subprocess.run(["taskset", "-a", "-p", "-c", "0", str(server.pid)], check=True,
                               stdout=subprocess.DEVNULL)
                log(f"SeaweedFS (pid {server.pid}, all threads) on CPU 0; clients on CPUs {client_cpus}")
            source = (scratch or work) / "object.bin"
            log(f"SeaweedFS at {server.endpoint_url}; writing and uploading {args.size / GB:.2f} GB")
            digest = write_random_object(source, args.size)
            server.client(max_pool_connections=UPLOAD_CONFIG.max_concurrency).upload_file(
                str(source), BUCKET, KEY, Config=UPLOAD_CONFIG)
            source.unlink()
            env = {**mounts.base_env(), **server.env()}

            def one(client: str, verify: bool) -> dict[str, Any]:
                argv = [sys.executable, str(Path(__file__).resolve()), "one", "--endpoint", server.endpoint_url,
                        "--bucket", BUCKET, "--key", KEY, "--client", client, "--threads", str(args.threads),
                        "--part", str(args.part)]
                if verify:
                    argv += ["--verify", digest]
                if args.pin:
                    argv = ["taskset", "-c", client_cpus, *argv]
                server_before = mounts.cpu_seconds(server.pid)
                try:
                    done = subprocess.run(argv, check=False, capture_output=True, text=True, env=env,
                                          timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    return {"client": client, "error": f"timed out after {args.timeout:g} s"}
                server_after = mounts.cpu_seconds(server.pid)
                try:
                    record = json.loads(done.stdout.strip().splitlines()[-1])
                except (IndexError, json.JSONDecodeError):
                    return {"client": client, "error": f"rc {done.returncode}: {done.stderr.strip()[-1500:]}"}
                if server_before and server_after and record.get("bytes"):
                    server_cpu = sum(server_after) - sum(server_before)
                    record["server_cpu_s"] = server_cpu
                    record["server_cpu_s_per_gb"] = server_cpu / (record["bytes"] / GB)
                return record

            if args.verify:
                for client in args.clients:
                    record = one(client, verify=True)
                    checks.append(record)
                    log(f"check {client}: {record.get('error') or 'sha256 ok'}")
            for round_index in range(args.rounds):
                for client in args.clients:
                    if any(c["client"] == client and c.get("skipped") for c in checks):
                        runs.append({**next(c for c in checks if c["client"] == client), "round": round_index})
                        continue
                    cache_dropped = drop_caches() and cache_dropped
                    record = one(client, verify=False)
                    record["round"] = round_index
                    runs.append(record)
                    shown = (f"{record['seconds']:.2f} s, {record['cpu_s_per_gb']:.2f} CPU-s/GB"
                             if record.get("seconds") else record.get("error"))
                    log(f"round {round_index + 1}: {client}: {shown}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    rows = summarize(runs, args.clients)
    print(markdown(rows, args.size))
    if not cache_dropped:
        print("\nWARNING: the page cache could not be dropped (not root?)")
    if args.out:
        document = {
            "command": shlex.join(["python", "bench/clients.py", *sys.argv[1:]]),
            "environment": {"kernel": platform.release(), "python": platform.python_version(), "cpus": cpus,
                            "versions": {p: _version(p) for p in sorted(set(PACKAGES.values()))}},
            "size": args.size, "threads": args.threads, "part": args.part, "pin": args.pin,
            "checks": checks, "runs": runs, "summary": rows,
        }
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 0 if all(not r.get("error") or r.get("skipped") for r in runs) else 1


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- command line -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    one = sub.add_parser("one", help="one client, one read of the object; prints one JSON line")
    one.add_argument("--endpoint", required=True)
    one.add_argument("--bucket", required=True)
    one.add_argument("--key", required=True)
    one.add_argument("--client", required=True, choices=CLIENTS)
    one.add_argument("--verify", metavar="SHA256", help="also check a sha256 of the reassembled object")
    ab = sub.add_parser("ab", help="own SeaweedFS, random object, clients alternated round after round")
    ab.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ab.add_argument("--rounds", type=int, default=3)
    ab.add_argument("--clients", default=DEFAULT_CLIENTS, help=f"comma-separated, from {','.join(CLIENTS)}")
    ab.add_argument("--pin", action="store_true", help="SeaweedFS on CPU 0, the client on CPUs 1..N-1")
    ab.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip the unmeasured sha256 check pass per client")
    ab.add_argument("--timeout", type=float, default=ONE_TIMEOUT_S, help="seconds per client run")
    ab.add_argument("--out", help="write every run and the summary as JSON here")
    for q in (one, ab):
        q.add_argument("--threads", type=int, default=16)
        q.add_argument("--part", type=parse_size, default=parse_size("8M"))
    args = p.parse_args(argv)
    if args.threads < 1 or args.part < 1:
        p.error("--threads and --part must be >= 1")
    if args.command == "ab":
        args.clients = [c for c in (s.strip() for s in args.clients.split(",")) if c]
        for client in args.clients:
            if client not in CLIENTS:
                p.error(f"unknown client {client!r}; choose from {', '.join(CLIENTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "one":
        record = measure_one(args)
        print(json.dumps(record), flush=True)
        return 0 if not record["error"] or record["skipped"] else 1
    return run_ab(args)


if __name__ == "__main__":
    sys.exit(main())
