"""Mount a bucket with modelfs, s3fs or rclone as a foreground daemon, report its peak RSS, unmount it.

It must never leave a mount or a daemon behind, and never block on a hung mount: readiness is read from
/proc/self/mountinfo (no stat of the mountpoint), every command has a timeout, and the last resort is
aborting the FUSE connection through /sys/fs/fuse/connections.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

#: How long a daemon may take from exec to a mount that answers a stat.
MOUNT_TIMEOUT_S = 30.0
#: After `fusermount3 -u` the daemon should exit promptly; then SIGTERM, then SIGKILL.
EXIT_TIMEOUT_S = 15.0
COMMAND_TIMEOUT_S = 20.0
POLL_S = 0.05
LOG_TAIL_CHARS = 3000
FUSE_CONNECTIONS = Path("/sys/fs/fuse/connections")
REPO_ROOT = Path(__file__).resolve().parent.parent


class MountError(RuntimeError):
    """The daemon did not mount (message carries its log tail) or could not be found."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where and as whom the daemons talk to S3."""

    url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str

    def aws_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }


@dataclasses.dataclass(frozen=True)
class DaemonCommand:
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        return shlex.join(self.argv)


def base_env() -> dict[str, str]:
    """The bench's environment minus any AWS settings of the person running it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}


def find_modelfs(explicit: str | None = None) -> tuple[list[str] | None, str]:
    """(command, its `mount --help` text), or (None, why not). Tries explicit, the venv script, -m fsmount."""
    candidates: list[list[str]] = []
    beside = Path(sys.executable).parent / "modelfs"
    if explicit:
        candidates.append(shlex.split(explicit))  # what the user asked for, or nothing
    elif beside.exists():
        candidates += [[str(beside)], [sys.executable, "-m", "fsmount"]]
    else:
        candidates.append([sys.executable, "-m", "fsmount"])
    reasons = []
    for argv in candidates:
        env = {**base_env(), "PYTHONPATH": str(REPO_ROOT)}
        try:
            done = subprocess.run(
                [*argv, "mount", "--help"],
                check=False,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                env=env,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(f"{shlex.join(argv)}: {exc}")
            continue
        if done.returncode == 0 and "--foreground" in done.stdout:
            return argv, done.stdout
        last_line = (done.stderr.strip().splitlines() or ["no output"])[-1]
        reasons.append(f"{shlex.join(argv)} mount --help: rc {done.returncode}: {last_line}")
    return None, "; ".join(reasons)


def modelfs_command(
    modelfs: list[str],
    endpoint: Endpoint,
    mountpoint: Path,
    extra: list[str],
    cache_dir: Path | None,
    log_level: str = "warning",
) -> DaemonCommand:
    """`info` also logs, at unmount, the bytes served from memory, cache and origin (`served_bytes`)."""
    argv = [
        *modelfs,
        "mount",
        endpoint.bucket,
        str(mountpoint),
        "--foreground",
        "--endpoint-url",
        endpoint.url,
        "--log-level",
        log_level,
    ]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    env = {**base_env(), **endpoint.aws_env(), "PYTHONPATH": str(REPO_ROOT)}
    return DaemonCommand(argv + extra, env)


#: The line modelfs logs at info level when it unmounts (fsmount/mount.py, `close`).
SERVED_BYTES = re.compile(
    r"served bytes: memory=(?P<memory>\d+) cache=(?P<cache>\d+) origin=(?P<origin>\d+); "
    r"origin requests=(?P<origin_requests>\d+) bytes=(?P<origin_bytes>\d+)"
)


def served_bytes(log_text: str) -> dict[str, int] | None:
    """The last `served bytes:` line of a modelfs log as numbers (served_memory, served_cache,
    served_origin, origin_requests, origin_bytes), or None if the daemon did not log one."""
    matches = list(SERVED_BYTES.finditer(log_text))
    if not matches:
        return None
    found = {k: int(v) for k, v in matches[-1].groupdict().items()}
    return {
        "served_memory": found["memory"],
        "served_cache": found["cache"],
        "served_origin": found["origin"],
        "origin_requests": found["origin_requests"],
        "origin_bytes": found["origin_bytes"],
    }


def s3fs_command(endpoint: Endpoint, mountpoint: Path, passwd_file: Path, writable: bool = False) -> DaemonCommand:
    passwd_file.write_text(f"{endpoint.access_key}:{endpoint.secret_key}\n")
    passwd_file.chmod(0o600)
    mode = "rw" if writable else "ro"
    options = f"passwd_file={passwd_file},url={endpoint.url},use_path_request_style,{mode},dbglevel=warn"
    argv = ["s3fs", endpoint.bucket, str(mountpoint), "-f", "-o", options]
    return DaemonCommand(argv, base_env())


def rclone_command(endpoint: Endpoint, mountpoint: Path, writable: bool = False) -> DaemonCommand:
    """Read-only, or with `writable` rclone's own advice for applications that write: --vfs-cache-mode
    writes (files are written to a local cache and uploaded after close)."""
    env = base_env()  # rclone fails TLS setup here when AWS_CA_BUNDLE is set; base_env drops it
    env.update(
        RCLONE_CONFIG_BENCH_TYPE="s3",
        RCLONE_CONFIG_BENCH_PROVIDER="Other",
        RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=endpoint.access_key,
        RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=endpoint.secret_key,
        RCLONE_CONFIG_BENCH_ENDPOINT=endpoint.url,
        RCLONE_CONFIG_BENCH_REGION=endpoint.region,
        RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE="true",
        RCLONE_CONFIG="/dev/null",
    )
    argv = ["rclone", "mount", f"BENCH:{endpoint.bucket}", str(mountpoint)]
    argv += ["--vfs-cache-mode", "writes", "--vfs-write-back", "0s"] if writable else ["--read-only"]
    return DaemonCommand(argv, env)


def mount_entry(mountpoint: Path) -> tuple[int, int] | None:
    """(major, minor) of the mount on `mountpoint`, from mountinfo: never touches the mount itself."""
    target = str(mountpoint)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes space as \040
            if point == target:
                major, minor = fields[2].split(":")
                return int(major), int(minor)
    return None


def fs_type(path: Path) -> str:
    """The file system type (ext4, tmpfs, ...) of the mount holding `path`, from mountinfo."""
    target = str(path.resolve())
    best, kind = "", "unknown"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[fields.index("-") + 1]
    return kind


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below `directory` (from mountinfo), so nobody rm -rf's into a live mount."""
    prefix = str(directory.absolute()).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    return [p for p in points if (p + "/").startswith(prefix)]


def remove_tree(directory: Path) -> None:
    """rm -rf, unless a mount is still inside (then leave it all and say so)."""
    live = mounts_under(directory)
    if live:
        print(f"not removing {directory}: still mounted: {', '.join(live)}", file=sys.stderr)
        return
    shutil.rmtree(directory, ignore_errors=True)


def peak_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds a live process has used, all its threads (`/proc/PID/stat`)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def minor_faults(pid: int | None) -> int:
    """A live process's minor page faults so far, all its threads (0 if it is gone): each a first touch of a
    page of its memory, or of a tmpfs file it writes."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, TypeError):
        return 0


class MountedDaemon:
    """`with MountedDaemon(cmd, mountpoint, log) as m:` mounted and answering inside; gone after."""

    def __init__(self, command: DaemonCommand, mountpoint: Path, log_path: Path) -> None:
        self.command = command
        self.mountpoint = mountpoint.absolute()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.notes: list[str] = []

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def start(self) -> None:
        if mount_entry(self.mountpoint) is not None:
            raise MountError(f"{self.mountpoint} is already a mount point (stale mount?)")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"---- {self.command.shell()}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.command.argv,
                    env=self.command.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            except OSError as exc:
                raise MountError(f"cannot run {self.command.argv[0]}: {exc}") from exc
        try:
            self._wait_mounted()
        except BaseException:
            self.stop()
            raise

    def _wait_mounted(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while mount_entry(self.mountpoint) is None:
            if self.proc.poll() is not None:
                raise MountError(
                    f"{self.command.argv[0]} exited with status {self.proc.returncode} before mounting:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise MountError(f"no mount on {self.mountpoint} after {MOUNT_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(POLL_S)
        # Mounted is not answering: stat from a child, so a hung daemon cannot hang the bench.
        remaining = max(1.0, deadline - time.monotonic())
        try:
            subprocess.run(["stat", "-t", str(self.mountpoint)], check=True, capture_output=True, timeout=remaining)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise MountError(f"{self.mountpoint} is mounted but does not answer ({exc}):\n{self.log_tail()}") from exc

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def peak_rss_mib(self) -> float | None:
        return peak_rss_mib(self.proc.pid) if self.proc and self.proc.poll() is None else None

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds the daemon has used so far (None once it is gone)."""
        used = cpu_seconds(self.proc.pid) if self.proc and self.proc.poll() is None else None
        return sum(used) if used else None

    def stop(self) -> None:
        """fusermount3 -u; if that fails: lazy unmount, SIGTERM, SIGKILL, abort the FUSE connection."""
        proc = self.proc
        if proc is None:
            return
        entry = mount_entry(self.mountpoint)
        if entry is not None and not self._run(["fusermount3", "-u", str(self.mountpoint)]):
            self.notes.append("unmount refused; lazy unmount")
            self._run(["fusermount3", "-u", "-z", str(self.mountpoint)])
        try:
            proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.notes.append("daemon did not exit after unmount; SIGTERM")
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.notes.append("SIGKILL")
                self._signal(proc, signal.SIGKILL)
                proc.wait()
        entry = mount_entry(self.mountpoint)
        if entry is not None:
            self.notes.append("mount left behind; aborting the FUSE connection")
            with contextlib.suppress(OSError):
                (FUSE_CONNECTIONS / str(entry[1]) / "abort").write_text("1")
            self._run(["fusermount3", "-u", "-z", str(self.mountpoint)])
        self.proc = None

    def _signal(self, proc: subprocess.Popen[bytes], signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)  # its own session: helpers it started go too

    def _run(self, argv: list[str]) -> bool:
        if shutil.which(argv[0]) is None:
            self.notes.append(f"{argv[0]} not found")
            return False
        try:
            done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.notes.append(f"{shlex.join(argv)} timed out")
            return False
        if done.returncode != 0:
            self.notes.append(f"{shlex.join(argv)}: {done.stderr.strip()}")
        return done.returncode == 0
