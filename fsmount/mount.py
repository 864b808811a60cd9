"""Mount lifecycle: pre-flight checks, wiring the parts, pyfuse3 init, serving, readiness, kernel
tuning, signals, and a clean unmount.

It never touches the mountpoint from the serving thread once `pyfuse3.init` has run (that deadlocks:
the stat would wait for the very loop that has to answer it); readiness is checked from a worker thread
while the loop is serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import logging.handlers
import os
import queue
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TextIO

import pyfuse3
import trio

from fsmount import mountinfo, residency, sysmem
from fsmount.capabilities import CAP_SYS_ADMIN, has_capability
from fsmount.config import METADATA_THREADS, MiB, MountConfig, StoreConfig, tier_inside_mount, virtual_style_ignored
from fsmount.data import (
    DISK_THREADS,
    PUT_THREADS,
    WRITES_DIR,
    AccessDenied,
    Boto3Store,
    BucketMissing,
    CacheDirBusy,
    ChunkCache,
    ChunkEngine,
    DiskCache,
    ObjectVersion,
    SharedTier,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
    Uploads,
    cache_bytes,
    counted,
    default_min_free,
    endpoint_path_hint,
    free_bytes,
    human_size,
    missing_profile,
    origin_identity,
    sweep_staged_writes,
    within,
)
from fsmount.namespace import Namespace
from fsmount.operations import FAILED, SESSION_CALLS_S, Operations, Owner
from fsmount.pagecache import PageCachePusher, default_push_limit
from fsmount.prometheus import MetricsAddressError, MetricsServer
from fsmount.saved_names import SAVE_EVERY_S, SavedNames
from fsmount.stats import STATS_XATTR, MountStats
from fsmount.stats_table import DaemonSilent, StatsUnavailable, read_stats
from fsmount.streaming import ModelStreamer
from fsmount.tree_changes import WritableNamespace
from fsmount.write_staging import STAGING_BYTES
from fsmount.writes import ABORT_ALL_S, Writes

log = logging.getLogger(__name__)

FUSE_DEVICE = "/dev/fuse"
# /dev/fuse is the misc character device 10:229 (Documentation/admin-guide/devices.txt).
FUSE_DEVICE_NUMBER = (10, 229)
# fusermount3's configuration (user_allow_other).
FUSE_CONF = "/etc/fuse.conf"
# Metadata requests given up on (--read-timeout) whose threads may still be running, beyond METADATA_THREADS.
ABANDONED_METADATA_THREADS = 32
# How long readiness may take before the daemon gives up (the first request of a mount is fast;
# this only bounds a kernel that never answers).
READY_TIMEOUT = 60.0
# Where the fuse control file system lives (per-connection settings).
FUSECTL = "/sys/fs/fuse/connections"
# umount2's flag for a lazy unmount.
MNT_DETACH = 2
# At unmount, how long to wait for chunks already fetched to reach the NVMe cache. A full default memory
# budget (2 GiB) writes in ~4 s at the dev box's O_DIRECT rate; the unit's TimeoutStopSec (135 s) covers every bound
# of a stop together (tests/unit/test_ops.py).
WRITE_DRAIN_S = 30.0
# After SIGTERM/SIGINT, how long requests already in flight may take before they are cut short: pyfuse3's main
# loop waits for every handler, and a READ stalled on the origin would hold the stop for --read-timeout (120 s,
# past systemd's stop timeout, whose SIGKILL leaves a dead mount). Their readers then get ENOTCONN, as from any
# unmount. Longer while a file is open for writing, so that a close storing it may finish.
STOP_GRACE_S = 5.0
STOP_GRACE_WRITING_S = 20.0
# Signals whose default action ends a process, that nothing in or around the daemon sends, so that only a stray one
# comes (an operator's `kill -USR2` meant for another daemon, a script's): taken and ignored, one line each, as the
# mount's readers would otherwise get ENOTCONN. SIGTERM and SIGINT stop it, SIGHUP and SIGUSR1 reopen the log;
# SIGPIPE and SIGXFSZ Python ignores already (the write gets EPIPE, EFBIG); SIGQUIT, SIGXCPU and the faults' (SEGV,
# BUS, ABRT, ...) keep their action, which is meant to end it. So are SIGSTKFLT (unused on Linux) and the real-time
# signals SIGRTMIN..SIGRTMAX: no library of the daemon uses one (trio takes signals through a wakeup fd, libfuse and
# botocore none; glibc's own two for its threads lie below SIGRTMIN, and Python does not offer them), and a stray
# `kill -RTMIN+n` ended the daemon.
STRAY_SIGNALS = (signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGIO, signal.SIGPWR,
                 signal.SIGSTKFLT, *range(signal.SIGRTMIN, signal.SIGRTMAX + 1))
# At a stop, how long page-cache pushes in flight may take to end while READs are still answered.
PUSH_STOP_S = 5.0
# Once the FUSE connection was aborted for a push still waiting after the loop ended, how long that push may take to
# end: its pages unlock with the abort, and it copies one chunk.
PUSH_ABORT_S = 2.0
# A cache dir with room for fewer chunks than this is worth a warning at mount.
CACHE_ROOM_CHUNKS = 4
# How often the NVMe cache checks its free-space floor while nothing is put (DiskCache.keep_free): a statvfs, and
# evictions only when something else filled the disk. A disk filled at 2 GB/s by another process takes 10 GB of the
# floor's 4 GiB before the cache gives room back: the floor is for slow growth (logs, images), not for a race.
FREE_CHECK_S = 5.0
# The most an unmounted daemon waits to say in its cache dir's lock file that it is draining (a stalled disk).
MARK_DRAINING_S = 1.0
# Descriptors a daemon holds besides its connections and cache files (/dev/fuse, epoll, trio's wakeup pair, the log,
# the cache dir's lock, the metrics socket, botocore's control-plane connections), with room to spare; and how far
# raise_open_file_limit raises a soft limit whose hard one is unlimited.
OPEN_FILES_BASE = 32
OPEN_FILES_RAISE_MAX = 1 << 20
# At most this long dropping the shared-tier claims of fetches the unmount cut short (one DELETE each).
CLAIM_DROP_S = 10.0
# At a stop: the last write of the names learnt (saved_names.py), after the drains.
NAMES_SAVE_S = 5.0
# botocore's retries of one shared-tier request: none, since the origin is the fallback; a request then
# takes at most --shared-cache-timeout.
SHARED_TIER_RETRIES = 0
# A tier lookup (its requests, a wait for another node's claim) takes at most this share of --read-timeout (B253,
# B256); one request at most half of that share, so that requests begun in the first half end within it.
TIER_SHARE_OF_READ_TIMEOUT = 4
# glibc mallopt parameters: return freed chunk-sized blocks to the OS at once, and do not grow one
# arena per worker thread; otherwise RSS stays at its peak long after the memory limit was hit. The mmap
# threshold sits above the largest FUSE request (1 MiB of data and its header), and the heap keeps up to
# TRIM_THRESHOLD_BYTES free at its top: pyfuse3 copies every WRITE into a fresh bytes object, and with a
# 1 MiB threshold each of those was a fresh mmap, faulted in and unmapped again (with a 128 KiB trim
# threshold, a fresh piece of heap given back at once): 260k page faults and ~0.5 daemon CPU-s per GiB
# written, measured (bench/RESULTS.md).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 2 << 20
TRIM_THRESHOLD_BYTES = 4 << 20
ARENA_MAX = 2

QUIET_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")
# sd-daemon(3) priority prefixes: journald reads "<3>" at the start of a stderr line as LOG_ERR.
JOURNAL_PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class MountError(Exception):
    """A pre-flight failure; the message is shown to the user as the reason."""


class SettingError(MountError):
    """A pre-flight failure that starting again does not mend, only an operator: other settings (a path inside the
    mountpoint, a file where the cache dir should be), or the mountpoint freed of the live modelfs mount there: exit
    status 2, as a bad option's, which systemd's unit does not restart on (RestartPreventExitStatus); with status 1
    it started the mount again every RestartSec for good."""


class JournalFormatter(logging.Formatter):
    """stderr under systemd: journald adds time and pid itself, and takes the priority prefix."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prio = JOURNAL_PRIORITIES.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM=dev:ino of the stream it connected to stderr."""
    try:
        dev, ino = (int(x) for x in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def metadata_request_words(fn: Callable, args: tuple[object, ...]) -> str:
    """A metadata request as a log line names it: what was asked of the bucket, and for which key (a warning
    said "lookup failed: has_children timed out after 5s", naming neither)."""
    name = getattr(fn, "__name__", "")
    key = next((arg for arg in reversed(args) if isinstance(arg, str)), None)
    if key is None:
        return name or "a metadata request"
    return f"HEAD {key!r}" if name == "head" else f"listing {key!r}" if "list" in name or "children" in name \
        else f"{name} {key!r}"


class DroppedRequestReply(logging.Filter):
    """pyfuse3 logs an ERROR when the kernel refuses a reply with ENOENT, which means the kernel had
    already dropped that request: an unmount (or an abort) ended it, and whoever waited for it has had
    its answer from the kernel. Seen for a RELEASE after its close, and for the kernel's read-ahead READs
    still waiting on the origin when a loader exits and the node unmounts at once. Nothing is lost, so
    that case is logged at DEBUG; every other reply failure stays an ERROR."""

    PATTERN = re.compile(r"fuse_\w+\(\): fuse_reply_\* failed with No such file or directory")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and self.PATTERN.search(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


class CredentialRefreshFailed(logging.Filter):
    """botocore.credentials logs each refresh of temporary credentials that fails as a WARNING with its traceback
    (24 lines): a web identity token file missing, or STS refusing the role, put two before the one line that said
    why a foreground mount (systemd's) failed, and a running mount whose credentials could not be had logged one at
    every request it signed. A refresh needed before they expire (mandatory) that fails is raised to the request, which
    `credentials.Renewable` says (its lookup's failure, once per RECHECK_S) and the request's error names: its record is
    dropped. One that failed while the credentials there are still last (advisory) is said in one line, with the
    error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        if record.args == ("mandatory",):
            return False
        exc = record.exc_info[1]
        record.msg = f"{record.getMessage()} ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


class LogFile(logging.handlers.WatchedFileHandler):
    """--log-file: reopened at its path when it is moved or deleted (logrotate without copytruncate), checked at each
    line and at SIGHUP and SIGUSR1 (`reopen`). A line it cannot write (its directory removed, a full disk, one
    remounted read-only) is dropped, and said once on stderr (the journal under systemd) until a line is written again.
    WatchedFileHandler raised a failed reopen from the log call itself: the first line logged after an `rm -rf` of the
    log's directory (a SIGHUP's) took the daemon and its mount down; and a failed write printed a traceback per
    line."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename)
        self._failing = False
        self._failed: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = None
        if self._reopened():
            logging.FileHandler.emit(self, record)  # a failed write comes to handleError
        self._say_failure()

    def reopen(self) -> BaseException | None:
        """What SIGHUP and SIGUSR1 (a logrotate postrotate) ask: a file moved or deleted is let go of and the path
        opened now, not at the next line, which at `--log-level warning` may be days away (the rotated file, compressed
        and deleted, held its disk space until then, B260). The error where the file cannot be opened, else None; that
        error is said on stderr at each such signal, not once an episode as a line's: the signal's own line goes only
        to the file that failed, and a reload after the first said nothing anywhere (B345)."""
        self.acquire()
        try:
            self._failed = None
            self._reopened()
            failed = self._failed
            if failed is not None:
                self._failing = False
            self._say_failure()
            return failed
        finally:
            self.release()

    def _reopened(self) -> bool:
        """The file at its path open (reopened if it moved or went); False, with `_failed` set, where it cannot be."""
        try:
            self.reopenIfNeeded()
            if self.stream is None:  # a reopen that failed closed the old stream: try the path again
                self.stream = self._open()
                self._statstream()
        except OSError as err:
            self._failed = err
            return False
        return True

    def _say_failure(self) -> None:
        if self._failed is None:
            self._failing = False
        elif not self._failing:
            self._failing = True
            err = self._failed
            # A warning to the journal (its priority prefix), where systemd connected stderr to it.
            say_on_stderr(f"{'<4>' if stderr_is_journal() else ''}modelfs: cannot write the log file "
                          f"{self.baseFilename} ({getattr(err, 'strerror', None) or err}); its lines are dropped "
                          f"until it can be\n")

    def _open(self) -> TextIO:
        """The file at its path, opened for appending with O_NONBLOCK (B190). A FIFO (a log shipper's) that no process
        reads held the plain open until one did: the mount's start-up waited STARTUP_TIMEOUT and said only "did not
        answer", and a reopen after the FIFO was made anew blocked the daemon's log call, FUSE requests included; a
        reader that stopped reading blocked every line's write the same way once the pipe was full. Now the open
        fails at once (ENXIO: `log_file_error` says the FIFO has no reader) and a line the pipe has no room for is
        dropped and said, as a full disk's. A regular file is written as before (O_NONBLOCK changes nothing there)."""
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
        try:
            return open(fd, self.mode, encoding=self.encoding, errors=self.errors)
        except BaseException:
            os.close(fd)
            raise

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        failed = sys.exc_info()[1]
        if isinstance(failed, OSError):
            self._failed = failed
        else:  # a log call's own mistake (its arguments), not the file's: as logging reports it
            super().handleError(record)


def reopen_log_file() -> str:
    """SIGHUP's and SIGUSR1's: a --log-file that was moved or deleted is let go of, and its path opened, now. What the
    signal's line says of it: nothing without a log file; that it was reopened, or that it could not be (said on
    stderr too, once a failure, by `LogFile`); it said "reopened" either way (B338)."""
    said = ""
    for handler in [handler for handler in logging.getLogger().handlers if isinstance(handler, LogFile)]:
        failed = handler.reopen()
        said += (", the log file reopened if it was moved" if failed is None else
                 f", the log file {handler.baseFilename} could not be reopened "
                 f"({getattr(failed, 'strerror', None) or failed}): its lines are dropped until it can be")
    return said


class PipeStderr(logging.Handler):
    """stderr where it is a pipe (a container runtime's log FIFO, `modelfs mount --foreground 2>&1 | ...`): written
    through a descriptor of its own, opened anew on the pipe with O_NONBLOCK, so that a line the pipe has no room
    for (its reader slow or stopped: a container's log collector behind, a `| less` paused) is dropped, not waited
    for. A plain StreamHandler's write blocked the log call, and with it the trio loop that answers every FUSE
    request and `modelfs stats` (B900): one warning into a full pipe hung every reader of the mount until the pipe
    was read. The lines dropped are counted and said, with how many, before the next line that fits. Its own open
    file description: O_NONBLOCK set on descriptor 2 itself would reach every process sharing it (the shell's, a
    sibling's). Only a FIFO gets this (`open_for_stderr`): a terminal, a file or a socket (the journal) keep the
    StreamHandler, as does a pipe this process may not open again through /proc (another user's)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.dropped = 0  # lines lost since the last one written; only under the handler's lock
        self.cut = False  # the last write ended mid-line: the next one starts a line of its own

    @classmethod
    def open_for_stderr(cls) -> PipeStderr | None:
        """The handler for descriptor 2 where it is a FIFO that can be opened again, else None."""
        fd = cls.own_descriptor()
        return None if fd is None else cls(fd)

    @staticmethod
    def own_descriptor() -> int | None:
        """Descriptor 2 opened anew with O_NONBLOCK where it is a FIFO that can be opened again, else None."""
        try:
            if not stat.S_ISFIFO(os.fstat(2).st_mode):
                return None
            return os.open("/proc/self/fd/2", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # descriptor 2 closed, no /proc, a pipe of another user's
            return None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:  # a log call's own mistake (its arguments): as logging reports it
            self.handleError(record)
            return
        if self.dropped:
            line = f"modelfs: {self.dropped} log line(s) dropped: stderr (a pipe) was full\n{line}"
        if self.cut:
            line = "\n" + line
        data = line.encode(errors="replace")
        try:
            written = os.write(self.fd, data)
        except OSError:  # EAGAIN: the pipe is full; EPIPE: its reader is gone
            self.dropped += 1
            return
        self.dropped = 0
        self.cut = written < len(data)  # a line longer than what the pipe had room for: its end is lost

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        super().close()


def say_on_stderr(text: str) -> None:
    """`text` on stderr beside the log's lines, never waited for: where stderr is a pipe (a container runtime's log
    FIFO), written as PipeStderr writes, and dropped where the pipe has no room (its reader behind); elsewhere (a
    terminal, a file, the journal's socket) as print writes it. A Python warning (`show_warning`) and LogFile's
    failure were written to sys.stderr blocking: a full pipe held the log call, and the trio loop with it (B1041)."""
    fd = PipeStderr.own_descriptor()
    if fd is None:
        if sys.stderr is not None:  # (None where `2>&-`)
            with contextlib.suppress(OSError, ValueError):
                print(text, end="", file=sys.stderr, flush=True)
        return
    try:
        os.write(fd, text.encode(errors="replace"))
    except OSError:  # EAGAIN: the pipe is full; EPIPE: its reader is gone
        pass
    finally:
        os.close(fd)


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
    """warnings.showwarning's, in the daemon: the warning's usual text, through say_on_stderr (B1041)."""
    say_on_stderr(warnings.formatwarning(message, category, filename, lineno, line))


SYSLOG_SOCKET = "/dev/log"


def syslog_available() -> bool:
    """Whether syslog/journald takes messages here (containers often have no /dev/log)."""
    return os.path.exists(SYSLOG_SOCKET)


def setup_logging(level: str, log_file: str | None = None, use_syslog: bool = False) -> None:
    handler: logging.Handler
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_file:
        handler = LogFile(log_file)
    elif use_syslog and syslog_available():
        from logging.handlers import SysLogHandler

        handler = SysLogHandler(address=SYSLOG_SOCKET)
        formatter = logging.Formatter("modelfs[%(process)d]: %(levelname)s %(name)s: %(message)s")
    else:
        handler = PipeStderr.open_for_stderr() or logging.StreamHandler()
        if stderr_is_journal():
            formatter = JournalFormatter()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, PipeStderr):  # its own descriptor of the pipe
            old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    warnings.showwarning = show_warning
    # These libraries log request headers and credential lookups at debug level: never let them.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    credentials_log = logging.getLogger("botocore.credentials")
    if not any(isinstance(f, CredentialRefreshFailed) for f in credentials_log.filters):
        credentials_log.addFilter(CredentialRefreshFailed())
    pyfuse3_log = logging.getLogger("pyfuse3")
    if not any(isinstance(f, DroppedRequestReply) for f in pyfuse3_log.filters):
        pyfuse3_log.addFilter(DroppedRequestReply())


# The errors of opening --log-file, or of making and locking --cache-dir (open_disk_cache), that only another setting
# (or a person's chmod, chattr, policy) mends: exit status 2,
# which the systemd unit does not restart on (RestartPreventExitStatus=2); with 1 it failed the same way every
# RestartSec for good. EISDIR: the path is a directory. ENOTDIR, ELOOP, ENAMETOOLONG: the path itself is wrong (a file
# where a directory of it should be, a symlink loop, a name too long). EACCES and EPERM: the daemon may not write
# there; it runs as root with CAP_DAC_OVERRIDE under the unit, so what refuses is a permission root does not pass (an
# NFS root_squash, another user's FUSE mount, chattr +i or +a, an LSM's policy), and a user's own mount (`modelfs
# mount` run as that user, --foreground or not) is refused a file or directory of another's: a person's to change (a
# chmod, another path), never a moment's. Every other errno may mend by itself and stays status 1 (started again):
# ENOENT, a parent not there yet (a directory another unit makes, a mount not up yet; modelfs never makes it, B53);
# ENOSPC and EDQUOT, a full disk or quota that frees; EROFS, a file system remounted read-write after its check, or
# whose mount over it comes later; ENXIO, a FIFO that no process reads yet (its reader starts later, B190); EIO and
# the like.
LOG_FILE_SETTING_ERRNOS = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EACCES,
                                     errno.EPERM})


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def log_file_error(log_file: str, exc: OSError) -> MountError:
    """What `setup_logging`'s failure to open `log_file` says, one line naming the flag: a SettingError where only
    another setting mends it (LOG_FILE_SETTING_ERRNOS), else a MountError (status 1: it may mend by itself)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EISDIR:
        return SettingError(f"--log-file {log_file} is a directory: give the path of a file (such as "
                            f"{os.path.join(log_file, 'modelfs.log')})")
    if exc.errno == errno.ENXIO and _is_fifo(log_file):
        # A reader (a log shipper) may start later: status 1, started again (B190).
        return MountError(f"cannot write the log file {log_file} (--log-file): it is a FIFO that no process reads: "
                          "start its reader first")
    if exc.errno in LOG_FILE_SETTING_ERRNOS:
        return SettingError(f"--log-file {log_file}: cannot write the log file ({reason}): give a file this daemon "
                            "may write")
    return MountError(f"cannot write the log file {log_file} (--log-file): {reason}")


def user_allow_other(fuse_conf: str = FUSE_CONF) -> bool:
    """Whether fusermount3 lets users other than root mount with allow_other (`user_allow_other` in its conf)."""
    try:
        with open(fuse_conf, encoding="utf-8", errors="replace") as f:
            return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def check_fuse_available(allow_other: bool = False, fuse_conf: str = FUSE_CONF) -> None:
    """What a mount needs of the machine, each missing piece named: libfuse's own failure says only
    "fuse_session_mount failed", and a background mount loses libfuse's line that says why. Only an operator mends a
    /dev/fuse missing or wrong, fusermount3 not installed, or `user_allow_other` not in the conf: a SettingError
    (exit 2), which the unit does not start again every RestartSec for good. The unit starts after the fuse module
    is loaded (modprobe@fuse.service, and the static /dev/fuse node made at boot, both before it): no /dev/fuse
    then is a kernel without the module, or a container not given the device. A /dev/fuse this user may not open
    stays a MountError (exit 1): udev may give the node its mode only after a mount at boot started."""
    try:
        st = os.stat(FUSE_DEVICE)
    except OSError:
        raise SettingError(f"{FUSE_DEVICE} is missing: load the fuse kernel module (modprobe fuse)") from None
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != FUSE_DEVICE_NUMBER:
        raise SettingError(f"{FUSE_DEVICE} is not the FUSE device: load the fuse kernel module")
    if shutil.which("fusermount3") is None:
        raise SettingError("fusermount3 not found: install the fuse3 package (apt-get install fuse3)")
    if not os.access(FUSE_DEVICE, os.R_OK | os.W_OK):
        raise MountError(f"cannot open {FUSE_DEVICE}: permission denied (run as root, or give this user "
                         f"read-write access to it)")
    if allow_other and os.geteuid() != 0 and not user_allow_other(fuse_conf):
        raise SettingError(f"--allow-other as a user other than root needs 'user_allow_other' in {fuse_conf}")


# How long the pre-flight waits for the daemon of a mount already at the mountpoint (or around it) to answer before
# it calls it stopped or hung, as `modelfs unmount --stale` does (one answers in milliseconds).
MOUNTPOINT_ANSWER_S = 5.0


# The type /proc/self/mountinfo gives a modelfs mount (FUSE's type, the subtype it is mounted with).
MODELFS_FSTYPE = b"fuse.modelfs"


# Network file systems: a mount of one that does not answer waits on its server, not on a daemon of this host.
NETWORK_FSTYPES = frozenset({b"nfs", b"nfs4", b"cifs", b"smb3", b"smbfs", b"ceph", b"9p", b"afs", b"lustre"})


def silent_mount(path: str, within: float) -> str:
    """What `path` is, said where asking it got no answer within `within` seconds, and what to do: the words fit the
    mount it is on, from /proc/self/mountinfo (asking nothing of it): a FUSE daemon stopped or hung (modelfs's, which
    `modelfs unmount --lazy` takes away, or another's), or a network file system's server that does not answer
    (NFS, CIFS: only its server, or its operator, mends it). Where it says no type (a symlink to the mount), a modelfs
    mount's words. For `check_daemon_answers` and `cli.live_mount`."""
    on = _mount_on(path)
    fstype = b"" if on is None else on.fstype
    if fstype.startswith(b"fuse") and fstype != MODELFS_FSTYPE:
        at, kind = os.fsdecode(on.point), os.fsdecode(fstype)
        return (f"{path} is on the {kind} mount at {at} whose daemon does not answer within {within:g}s (stopped or "
                f"hung, not gone): left mounted; stop that daemon, or unmount it ({lazy_unmount_advice(at)})")
    if fstype in NETWORK_FSTYPES or fstype.startswith((b"nfs", b"smb")):
        at, kind = os.fsdecode(on.point), os.fsdecode(fstype)
        return (f"{path} is on the {kind} mount at {at} whose server does not answer within {within:g}s: left "
                "mounted; mount elsewhere, or here once that server answers")
    if fstype == MODELFS_FSTYPE and on.point != os.fsencode(os.path.abspath(path)):  # a directory of the mount
        at = os.fsdecode(on.point)
        return (f"{path} is inside the modelfs mount at {at}, whose daemon does not answer within {within:g}s (stopped "
                f"or hung, not gone): left mounted; stop that daemon, or `modelfs unmount --lazy {at}`")
    return (f"{path} is a modelfs mount whose daemon does not answer within {within:g}s (stopped or hung, not gone): "
            f"left mounted; stop that daemon, or `modelfs unmount --lazy {path}`")


def _mount_on(path: str) -> mountinfo.Mount | None:
    """The mount `path` (as given, made absolute: resolving it would ask the mount) is on, or None."""
    try:
        return mountinfo.holding(os.fsencode(os.path.abspath(path)), mountinfo.mounts())
    except (OSError, ValueError):
        return None


def gone_mount(path: str) -> str:
    """What `path` is, said where the FUSE mount it is on has lost its daemon (ENOTCONN), and what clears it: `modelfs
    unmount` of a modelfs mount (of the mount, for a directory inside it), `umount` of another FUSE file system's
    (`fusermount3 -u` for a user other than root), which `modelfs unmount` leaves alone."""
    on = _mount_on(path)
    if on is not None and on.fstype != MODELFS_FSTYPE and on.fstype.startswith(b"fuse"):
        at = os.fsdecode(on.point)
        return (f"{path} is on the {os.fsdecode(on.fstype)} mount at {at}, whose daemon is gone (killed?): unmount it "
                f"first ({'`umount' if os.geteuid() == 0 else '`fusermount3 -u'} {at}`)")
    if on is not None and on.fstype == MODELFS_FSTYPE and on.point != os.fsencode(os.path.abspath(path)):
        at = os.fsdecode(on.point)
        return (f"{path} is inside the modelfs mount at {at}, whose daemon is gone (killed?): run `modelfs unmount "
                f"{at}` first")
    return f"{path} is still mounted, but its daemon is gone (killed?): run `modelfs unmount {path}` first"


def check_daemon_answers(path: str) -> None:
    """Refuse a mountpoint on a FUSE mount whose daemon is gone (killed, OOM: every access fails with ENOTCONN until it
    is unmounted, and os.path.exists / ismount call it missing / not mounted) or does not answer (stopped, hung: every
    later stat of the mountpoint waited in the kernel for good, SIGINT or not; or a network file system whose server
    is down: `silent_mount`). Asked through the stats attribute, which the kernel always sends to the daemon (a stat
    may be answered from cached attributes), in a thread of its own (`stats_table.read_stats`); a directory of
    another file system answers at once."""
    try:
        read_stats(path, MOUNTPOINT_ANSWER_S)
    except DaemonSilent:
        raise MountError(f"mountpoint {silent_mount(path, MOUNTPOINT_ANSWER_S)}") from None
    except StatsUnavailable as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(f"mountpoint {gone_mount(path)}") from None


def check_not_inside_modelfs(path: str, real: str) -> None:
    """Refuse a mountpoint inside another modelfs mount (/models/sub of the mount at /models): the mount over it kept
    the outer one busy, so `modelfs unmount /models` failed, and its unit's restart with it; only an operator mends it
    (exit 2). The outer mount is found in /proc/self/mountinfo, its daemon not asked. A modelfs mount at the
    mountpoint itself is `_check_free`'s to name."""
    try:
        outer = mountinfo.holding(os.fsencode(real), mountinfo.mounts())
    except (OSError, ValueError):
        return
    if outer is not None and outer.fstype == MODELFS_FSTYPE and outer.point != os.fsencode(real):
        at = os.fsdecode(outer.point)
        raise SettingError(f"mountpoint {path} is inside the modelfs mount at {at}: a mount there would keep that one "
                           f"busy (`modelfs unmount {at}` and its restart would fail); mount elsewhere")


def check_mountpoint(path: str, allow_non_empty: bool) -> tuple[str, int]:
    """Validate and resolve the mountpoint; must run before pyfuse3.init. Also returns a descriptor of the
    directory holding an exclusive flock: two mounts started at once at one mountpoint both found it free and
    both mounted, one over the other (fstab and a systemd unit, an init container and a sidecar). The caller
    closes it once mounted (or failed); the second one started then finds a mount point there."""
    check_daemon_answers(path)
    real = os.path.realpath(path)
    if not os.path.exists(path):  # not there yet, or a symlink to a directory on a disk mounted later: exit 1 (B1160)
        # One that cannot be made inside a read-only modelfs mount (the unit's mkdir: EROFS) is refused as it would
        # be if it were there (exit 2), not "does not exist" (exit 1), which the unit started again every 5 s.
        check_not_inside_modelfs(path, real)
        link = f" (a symlink to {real})" if os.path.lexists(path) else ""
        raise MountError(f"mountpoint {path} does not exist{link}")
    if not os.path.isdir(real):  # a file there goes only when an operator removes it: 2, not started again
        raise SettingError(f"mountpoint {path} is not a directory")
    check_not_inside_modelfs(path, real)
    check_user_may_mount_on(path, real)
    try:
        lock = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise MountError(f"mountpoint {path} cannot be opened: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MountError(f"mountpoint {path} is locked by another process (another modelfs mount of it "
                             "starting?)") from None
        except OSError as exc:  # a filesystem without flock (ENOLCK, EOPNOTSUPP): mounted without the lock
            log.debug("no lock on mountpoint %s: %s", path, exc)
        _check_free(path, real, allow_non_empty)
    except BaseException:
        os.close(lock)
        raise
    return real, lock


# What libfuse and fusermount3 start their lines on stderr with.
FUSE_STDERR_PREFIXES = ("fusermount3:", "fuse:")
STDERR_CAPTURE_BYTES = 64 * 1024


@contextlib.contextmanager
def stderr_captured() -> Iterator[list[str]]:
    """Descriptor 2 sent to an anonymous in-memory file (memfd) for the block; its lines (the first
    `STDERR_CAPTURE_BYTES`) are in the list once the block has ended. Around the mount itself: libfuse and the
    fusermount3 it runs for a user other than root say why a mount failed only there (fusermount3: "mounting over
    filesystem type ... is forbidden", "too many FUSE filesystems mounted", ...), and a background mount (the default)
    shows none of its stderr; libfuse's error is "fuse_session_mount failed" alone. fusermount3 ends once the mount is
    made (no auto_unmount), so nothing keeps the file after.

    Best effort, and never in the mount's way: the capture needs no directory (a temporary file in /tmp failed the
    whole mount, with a traceback, in a container whose root filesystem is read-only, B204), and where descriptor 2 is
    closed (`2>&-`; Python's sys.stderr is then None) or no memfd can be made, the block runs uncaptured and the list
    stays empty. Descriptor 2 is put back whatever happens in the block or in the flush of sys.stderr (a full disk
    behind it), so that nothing after is written into the capture."""
    lines: list[str] = []
    try:
        sink = os.memfd_create("modelfs-mount-stderr", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd here (an old kernel, a seccomp filter): not captured
        sink = None
    try:
        saved = os.dup(2) if sink is not None else None
    except OSError:  # descriptor 2 closed: nothing to put back, and a descriptor opened meanwhile could become it
        saved = None
    if saved is None:
        if sink is not None:
            os.close(sink)
        yield lines
        return
    try:
        with contextlib.suppress(Exception):
            if sys.stderr is not None:
                sys.stderr.flush()  # what Python holds for the terminal goes there, not into the capture
        os.dup2(sink, 2)
        try:
            yield lines
        finally:
            with contextlib.suppress(Exception):
                if sys.stderr is not None:
                    sys.stderr.flush()
            os.dup2(saved, 2)
        with contextlib.suppress(OSError):
            said = os.pread(sink, STDERR_CAPTURE_BYTES, 0)
            lines.extend(line for line in said.decode(errors="replace").splitlines() if line.strip())
    finally:
        os.close(saved)
        os.close(sink)


def mounts_by_itself(status: str = "/proc/self/status") -> bool:
    """Whether libfuse mounts with mount(2) itself, not through fusermount3: as root, or as another user with
    CAP_SYS_ADMIN (a systemd unit's `User=` with `AmbientCapabilities=CAP_SYS_ADMIN`): libfuse tries mount(2) first
    and asks fusermount3 only where that is EPERM."""
    return os.geteuid() == 0 or has_capability(CAP_SYS_ADMIN, status)


def check_user_may_mount_on(path: str, real: str) -> None:
    """A user other than root mounts through the setuid fusermount3, which refuses a mountpoint that user could
    not write (and a sticky one, such as /tmp itself, that is not theirs): it says so on stderr, which a background
    mount (the default) does not show, and libfuse then says only "fuse_session_mount failed". The same rules,
    asked the same way (access(2) as the real uid), are checked here first so that the refusal names its cause.
    Whoever mounts by itself (`mounts_by_itself`: root, or a user with CAP_SYS_ADMIN) is not held to them: a user
    with CAP_SYS_ADMIN was refused root's /models, which it had mounted before (B205). Where its mount(2) is refused
    after all and fusermount3 is asked, fusermount3's own line ends the error (B181). Only a chmod or chown of the
    mountpoint, or another MOUNTPOINT, mends either: a SettingError (exit 2)."""
    if mounts_by_itself():
        return
    st = os.stat(real)
    if st.st_mode & stat.S_ISVTX and st.st_uid != os.getuid():
        raise SettingError(f"mountpoint {path} is a sticky directory you do not own: fusermount3, which mounts for "
                           "users other than root, refuses it; mount on a directory of your own (mkdir ~/models)")
    if not os.access(real, os.W_OK):
        raise SettingError(f"mountpoint {path} is not writable by you (uid {os.getuid()}): fusermount3, which mounts "
                           "for users other than root, needs write access to it; mount on a directory of your own "
                           "(mkdir ~/models), or have its owner give it to you (chown)")


def _check_free(path: str, real: str, allow_non_empty: bool) -> None:
    if os.path.ismount(real):
        try:  # only a modelfs mount's root has it, and only its daemon's answer gives it: alive
            os.getxattr(real, STATS_XATTR)
        except OSError as exc:  # only an operator takes it away: the unit must not retry for good
            # A modelfs mount whose daemon answers that it has no such attribute: an older modelfs (B553).
            if exc.errno in (errno.ENODATA, errno.ENOTSUP) and top_type(real) == MODELFS_FSTYPE:
                raise SettingError(f"mountpoint {path} already holds a live modelfs mount whose daemon is of an older "
                                   f"modelfs (it has no stats attribute): left mounted; unmount it first (modelfs "
                                   f"unmount {path}), or mount elsewhere") from None
            raise SettingError(f"mountpoint {path} already holds {mounted_type(real)}, not a modelfs one: left "
                               "mounted; unmount it first, or mount elsewhere") from None
        raise SettingError(f"mountpoint {path} already holds a live modelfs mount: left mounted; unmount it first "
                           f"(modelfs unmount {path}), or mount elsewhere")
    try:
        entries = os.listdir(real)
    except OSError as exc:
        raise MountError(f"mountpoint {path} cannot be read: {exc.strerror}") from None
    if entries and not allow_non_empty:  # as a file there: only an operator empties it (B1060)
        raise SettingError(f"mountpoint {path} is not empty (use --allow-non-empty / -o nonempty to mount over it)")


def bind_metrics(addr: str | None) -> MetricsServer | None:
    """Bind the metrics port before mounting, so a port in use is a pre-flight error."""
    if not addr:
        return None
    try:
        return MetricsServer(addr)
    except MetricsAddressError as exc:
        raise MountError(str(exc)) from None


def warn_path_style(endpoint_url: str | None, addressing_style: str, flag: str) -> None:
    host = virtual_style_ignored(endpoint_url, addressing_style)
    if host is not None:
        log.warning("%s virtual: %s is an IP address, under which a bucket cannot be a host name, so requests "
                    "use path style (a server that takes only virtual-hosted requests needs its DNS name)", flag, host)


def store_origin(store: Boto3Store) -> str:
    """The origin `store` asks, as the cache dir's saved names and the shared tier's keys name it
    (`shared_tier.origin_identity`): its endpoint as configured (None for AWS's own) and the region its client
    resolved. One function, so that the names the pre-flight loads, those the daemon keeps and the tier's keys agree."""
    return origin_identity(store.configured_endpoint_url, store.region)


def check_profiles(cfg: MountConfig) -> None:
    """Each profile named (--profile, --shared-cache-profile) is in the AWS configuration. One missing from config
    files that exist is a setting only an edit mends: exit 2, naming the profile and the files looked in (exit 1 had
    the unit start the mount again every RestartSec for good). Where none of those files exists yet, a configuration
    tool or an agent may write them after boot: exit 1, started again every RestartSec until they are there."""
    for flag, profile in (("--profile", cfg.store.profile),
                          ("--shared-cache-profile", cfg.shared_cache.profile if cfg.shared_cache else None)):
        if not profile:
            continue
        missing = missing_profile(profile)
        if missing is None:
            continue
        present, absent = missing
        if present:
            raise SettingError(f"{flag} {profile}: no such profile in {' or '.join(present)} (add it there, or "
                               f"name a profile they hold)")
        raise MountError(f"{flag} {profile}: the AWS configuration files are not there yet ({', '.join(absent)}); "
                         "the profile must be in one of them")


def check_bucket(cfg: MountConfig) -> None:
    """The bucket can be listed, or the origin does not answer and the cache dir knows names of it (saved_names.py):
    a node restarted during an outage serves what its NVMe cache holds."""
    endpoint_url = cfg.store.endpoint_url
    origin = origin_identity(endpoint_url, cfg.store.region or "")
    try:
        store = Boto3Store(cfg.store, preflight=True)
        endpoint_url = store.configured_endpoint_url  # also one the AWS configuration gives
        origin = store_origin(store)
        warn_path_style(endpoint_url, cfg.store.addressing_style, "--addressing-style")
        store.check_bucket(cfg.store.prefix)
        empty = bool(cfg.store.prefix) and not cfg.writable and not store.has_children(cfg.store.prefix)
        prefix_is_a_file = empty and is_a_key(store, cfg.store.prefix.rstrip("/"))
    except (Unreachable, TransientError) as exc:
        known = load_saved_names(cfg, origin)
        if known is None:
            raise MountError(exc.message) from None
        if not len(known):
            raise MountError(f"{exc.message} (and cache dir {cfg.cache_dir} keeps no name of this bucket and prefix "
                             f"at {origin} to mount with until it answers)") from None
        log.warning("origin unavailable (%s): mounting with the names cache dir %s kept of %d directories; what its "
                    "NVMe cache holds of them is served until the origin answers", exc.message, cfg.cache_dir,
                    len(known))
        return
    except AccessDenied as exc:
        if cfg.store.no_sign_request:  # "check credentials" of a request that carried none
            raise MountError(f"bucket {cfg.store.bucket!r} refused an anonymous listing (--no-sign-request): it is "
                             "not public; drop --no-sign-request and give credentials") from None
        raise MountError(exc.message) from None
    except StoreError as exc:
        raise MountError(exc.message + (endpoint_path_hint(endpoint_url) if isinstance(exc, BucketMissing) else "")) \
            from None
    if empty:  # a typo would look like an empty model directory
        log.warning("no key in bucket %s starts with %r: the mount is empty (%s)", cfg.store.bucket, cfg.store.prefix,
                    f"{cfg.store.prefix.rstrip('/')!r} is a file: --prefix names a directory, such as the one it is "
                    "in" if prefix_is_a_file else "is --prefix right?")


def is_a_key(store: Boto3Store, key: str) -> bool:
    """Whether `key` is an object (one HEAD; a failure to ask is no): the pre-flight's word on an empty --prefix that
    names a file."""
    try:
        return store.head(key) is not None
    except StoreError:
        return False


def load_saved_names(cfg: MountConfig, origin: str) -> SavedNames | None:
    """The names the cache dir keeps of this bucket and prefix at `origin` (shared_tier.origin_identity); None without
    a cache dir."""
    if cfg.cache_dir is None:
        return None
    saved = SavedNames(cfg.cache_dir, cfg.store.bucket, cfg.store.prefix, origin)
    saved.load()
    return saved


def inside_mountpoint(path: str, mountpoint: str) -> bool:
    """Whether `path` (symlinks resolved) is `mountpoint` (resolved already) or below it."""
    real = os.path.realpath(path)
    return real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/")


def check_log_file_outside(log_file: str | None, mountpoint: str) -> None:
    """Before logging is set up. A log file in the mountpoint is created there before the mount (which then finds
    the mountpoint not empty); with --allow-non-empty the handler stats its path through the mount at each line: a
    read-only mount's daemon died (EROFS), a --writable one's thread waited on its own mount for good (D state)."""
    if log_file is not None and inside_mountpoint(log_file, os.path.realpath(mountpoint)):
        raise SettingError(f"--log-file {log_file} is inside the mountpoint {mountpoint}: give a file outside it")


def check_cache_dir_outside(cache_dir: str | None, mountpoint: str) -> None:
    """A cache dir in (or at) the mountpoint would be hidden under the mount the moment it mounts: the cache
    could never write a chunk, and what it created there made the next mount find the mountpoint not empty."""
    if cache_dir is None:
        return
    if inside_mountpoint(cache_dir, mountpoint):
        raise SettingError(f"--cache-dir {cache_dir} is inside the mountpoint {mountpoint}: give a directory "
                         "outside it (on local NVMe)")


def check_cache_dir_place(cache_dir: str) -> None:
    """A MountError (status 1: the unit starts the mount again every RestartSec, and once the disk is there it mounts)
    where the cache dir would go on a disk not mounted yet; a SettingError (status 2, B1141) where what is above it is
    a file or closed to the daemon (`LOG_FILE_SETTING_ERRNOS`), which only an operator mends.

    The cache dir is made, the directories above it are not (as a --log-file's, B53): `--cache-dir /nvme/modelfs`
    started before the NVMe disk was mounted (a boot script's RAID, a slow instance store) made /nvme/modelfs on the
    root disk and filled it to --cache-size of that disk, hidden once the NVMe was mounted over /nvme (B262). Only a
    parent that is not there is said so: one that cannot be reached (EACCES of a directory above it) was said "does
    not exist (a disk not mounted yet?)" too, sending the operator to look for a disk (B293). A cache dir that is a
    symlink to a directory not there (`/var/cache/modelfs -> /nvme/modelfs`) is the same disk not mounted yet: it was
    "it exists and is not a directory", status 2, which the unit never started again (B294); a symlink's target is
    not made."""
    try:
        os.stat(cache_dir)
    except OSError as exc:
        target = None
        if exc.errno == errno.ENOENT:
            with contextlib.suppress(OSError):  # (not a symlink: EINVAL)
                link = os.readlink(cache_dir)
                target = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(cache_dir)), link))
        if target is not None:
            raise MountError(f"cannot use cache dir {cache_dir}: it is a symlink to {target}, which is not there (a "
                             "disk not mounted yet?); modelfs does not make a symlink's target") from None
    if os.path.lexists(cache_dir):
        return
    parent = os.path.dirname(os.path.abspath(cache_dir))
    try:
        parent_is_dir = stat.S_ISDIR(os.stat(parent).st_mode)
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # (a symlink to nothing too)
            raise MountError(f"cannot use cache dir {cache_dir}: {parent}, the directory it goes in, does not exist (a "
                             "disk not mounted yet?); modelfs makes the cache dir itself, not the directories above "
                             "it") from None
        # Closed to the daemon (EACCES: another user's directory), a file on its way: the operator's to mend (B1141).
        error = SettingError if exc.errno in LOG_FILE_SETTING_ERRNOS else MountError
        raise error(f"cannot use cache dir {cache_dir}: {parent}, the directory it goes in: "
                    f"{exc.strerror or exc}") from None
    if not parent_is_dir:
        raise SettingError(f"cannot use cache dir {cache_dir}: {parent}, the directory it goes in, is not a directory")


# How long a mount refused a cache dir that another holds waits for the stats of the modelfs mounts (all asked at
# once), to name the holder.
HOLDER_STATS_TIMEOUT_S = 2.0
# File systems whose files are memory: a Kubernetes emptyDir with `medium: Memory`, /dev/shm, a tmpfs /tmp.
MEMORY_FILE_SYSTEMS = frozenset({b"tmpfs", b"ramfs"})
# Of what the daemon's cgroup has left beyond --memory-limit, the share a cache dir in memory may hold: the rest stays
# for the page cache of the files read (the model's, pushed and read ahead) and the processes beside the daemon.
MEMORY_CACHE_SHARE = 0.5


def memory_file_system(path: str) -> bytes | None:
    """The type of the file system holding `path` where its files are memory (tmpfs, ramfs), else None."""
    try:
        on = mountinfo.holding(os.fsencode(os.path.realpath(path)), mountinfo.mounts())
    except (OSError, ValueError, IndexError):  # no /proc/self/mountinfo, a line it cannot parse
        return None
    return on.fstype if on is not None and on.fstype in MEMORY_FILE_SYSTEMS else None


def bound_by_memory(cache: DiskCache, cfg: MountConfig, free: int) -> None:
    """A cache dir on tmpfs (a pod's emptyDir with `medium: Memory`) holds its chunks in memory that is charged to the
    daemon's cgroup, which cannot reclaim it: with --cache-size a share of the tmpfs (80% by default), and a tmpfs
    sized by the node's RAM or the pod's limit, the cache outgrew the cgroup's limit beside --memory-limit, and the
    cgroup killed the daemon in the middle of a load, leaving a dead mount (B901). Where a cgroup limits the daemon,
    the cache holds at most MEMORY_CACHE_SHARE of what the cgroup has left beyond --memory-limit (the chunks the
    cache holds already counted as left: they are its own), said in one warning; without one, one line says the
    chunks are in RAM. What the cache can come to hold is compared, not --cache-size alone: a tmpfs smaller than the
    bound (`free`: what its file system has free now) holds no more than it has room for, whatever --cache-size says.
    A --cache-size in bytes the bound cannot give is refused (SettingError, exit status 2, B960): the operator's own
    number, replaced by a smaller one, was a surprise, and kept it had the cgroup kill the daemon; a share (80%, the
    default) is of a tmpfs the operator may not have sized, and is bounded with the warning."""
    fstype = memory_file_system(cache.root)
    if fstype is None:
        return
    holds = min(cache.max_bytes, cache.stats.bytes_used + max(0, free - cache.min_free_bytes))
    cgroup = sysmem.cgroup_memory()
    if cgroup is None:
        log.info("cache dir %s is on %s: its chunks are held in RAM (up to %s)", cache.root, fstype.decode(),
                 human_size(holds))
        return
    left = cgroup.available + cache.stats.bytes_used - cfg.memory_limit
    bound = max(cfg.chunk_size, int(max(0, left) * MEMORY_CACHE_SHARE))
    if bound >= holds:
        log.info("cache dir %s is on %s: its chunks (up to %s) are memory charged to this daemon's cgroup (limit %s)",
                 cache.root, fstype.decode(), human_size(holds), human_size(cgroup.limit))
        return
    said = (f"cache dir {cache.root} is on {fstype.decode()}, memory charged to this daemon's cgroup (limit "
            f"{human_size(cgroup.limit)}, {human_size(max(0, left))} left beyond --memory-limit "
            f"{human_size(cfg.memory_limit)} at start)")
    if cfg.cache_size.fraction is None:
        cache.close()
        raise SettingError(f"--cache-size {cfg.cache_size}: the {said} would kill the daemon before the cache held "
                           f"that: give --cache-size {bound // MiB}M at most (half of what is left), or a cache dir "
                           f"on a disk (an emptyDir without `medium: Memory`, a hostPath)")
    log.warning("%s: the cache holds at most %s, not the %s of --cache-size %s, so that the cgroup does not kill the "
                "daemon; give the cache dir a disk (an emptyDir without `medium: Memory`, a hostPath) to cache more",
                said, human_size(bound), human_size(cache.max_bytes), cfg.cache_size)
    cache.max_bytes = bound  # chunks beyond it (a cache dir kept from before) are evicted at the next put


def mount_of_daemon(pid: int) -> str | None:
    """The mountpoint of the live modelfs mount whose daemon is `pid` (its stats say so), else None: a cache command,
    a daemon whose mount is detached (`unmount --lazy`: it lets go of its cache dir once its files are closed), a mount
    that does not answer within HOLDER_STATS_TIMEOUT_S. Every modelfs mount is asked at once, each in a thread of its
    own, within that one time: asked in turn, each stopped or hung one cost the refusal 2 s more (B1140)."""
    try:
        points = [os.fsdecode(on.point) for on in mountinfo.mounts() if on.fstype == MODELFS_FSTYPE]
    except (OSError, ValueError, IndexError):
        return None
    answers: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def ask(point: str) -> None:
        try:
            answers.put(point if read_stats(point, HOLDER_STATS_TIMEOUT_S).get("pid") == pid else None)
        except (StatsUnavailable, OSError):
            answers.put(None)

    for point in points:  # (each left behind, as read_stats's own reader is, where its mount never answers)
        threading.Thread(target=ask, args=(point,), name="holder-stats", daemon=True).start()
    deadline = time.monotonic() + HOLDER_STATS_TIMEOUT_S
    for _ in points:
        try:
            point = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if point is not None:
            return point
    return None


def open_disk_cache(cfg: MountConfig) -> DiskCache:
    assert cfg.cache_dir is not None
    check_cache_dir_place(cfg.cache_dir)
    try:
        cache = DiskCache(cfg.cache_dir, cache_bytes(cfg.cache_size, cfg.cache_dir),
                          min_free_bytes=default_min_free(cfg.cache_dir))
        free = free_bytes(cache.root)
    except CacheDirBusy as exc:
        point = mount_of_daemon(exc.pid) if exc.pid is not None else None
        if point is not None:  # a mount that stays until an operator unmounts it: starting again does not mend it
            raise SettingError(f"cache dir {os.path.abspath(cfg.cache_dir)} is in use by the modelfs mount at {point} "
                               f"(pid {exc.pid}); a cache dir serves one mount at a time: give this mount a "
                               f"--cache-dir of its own, or unmount {point} first") from None
        raise MountError(str(exc)) from None
    except OSError as exc:
        # makedirs says "File exists" of a file (or a symlink loop) where the directory should be.
        if exc.errno == errno.EEXIST and not os.path.isdir(cfg.cache_dir):
            raise SettingError(f"cannot use cache dir {cfg.cache_dir}: it exists and is not a directory") from None
        # As a --log-file's, only an operator mends these (B1040); EINVAL: a `lock` file modelfs did not write, or
        # that is not a regular file (cache_dir.acquire_dir_lock), which it never writes over (B1043).
        if exc.errno in LOG_FILE_SETTING_ERRNOS or exc.errno == errno.EINVAL:
            raise SettingError(f"cannot use cache dir {cfg.cache_dir}: {exc.strerror or exc}") from None
        raise MountError(f"cannot use cache dir {cfg.cache_dir}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a filesystem that reports no size (--cache-size as a share of it)
        raise MountError(f"cannot use cache dir {cfg.cache_dir}: {exc}") from None
    writes = os.path.join(cache.root, WRITES_DIR)
    if cfg.writable and os.path.lexists(writes) and (os.path.islink(writes) or not os.path.isdir(writes)):
        cache.close()
        raise SettingError(f"cannot use cache dir {cfg.cache_dir}: {writes} is not a directory of its own (a "
                           f"--writable mount keeps copies of the files it writes there): move it away, or use another "
                           f"cache dir")
    if not cfg.writable:  # (a --writable mount's staging empties it itself)
        files, staged = sweep_staged_writes(cache.root)
        if files:
            log.info("cache dir %s: removed %s (%s) that a --writable mount left in writes/ when it was killed",
                     cache.root, counted(files, "copy of a file", "copies of files"), human_size(staged))
    bound_by_memory(cache, cfg, free)
    room = min(cache.max_bytes, cache.stats.bytes_used + free - cache.min_free_bytes)
    cache.room_bytes = max(0, room)  # what `modelfs stats` says until the cache's own check measures it again
    if room < CACHE_ROOM_CHUNKS * cfg.chunk_size:
        log.warning("cache dir %s has room for %d MiB of chunks only (--cache-size %d MiB; %d MiB free on its "
                    "filesystem, %d MiB of which stay free): it will hold next to nothing", cache.root,
                    max(0, room) // MiB, cache.max_bytes // MiB, free // MiB, cache.min_free_bytes // MiB)
    elif room < cache.max_bytes:  # `--cache-size 500G` on a small disk started with no word of what it would hold
        log.info("cache dir %s: --cache-size %s is more than its filesystem can give it: the cache holds what is "
                 "free there beyond the %s it leaves free (%s now)", cache.root, human_size(cache.max_bytes),
                 human_size(cache.min_free_bytes), human_size(room))
    return cache


def open_shared_tier(cfg: MountConfig, origin: Boto3Store) -> SharedTier:
    """The fleet-shared tier's level (`origin`: the mount's store, whose client resolved the origin's endpoint and
    region). A missing bucket or refused credentials fail the mount; a tier that does not answer only logs: it is
    tried again as reads go."""
    shared = cfg.shared_cache
    assert shared is not None
    warn_path_style(shared.endpoint_url, shared.addressing_style, "--shared-cache-addressing-style")
    # A tier lookup runs before the origin's GET within the READ's --read-timeout. A tier request (or a wait for
    # another node's claim) as long as that failed reads with EIO while the tier did not answer, the origin well
    # (B253); so did the sum of a lookup's requests, each shorter, against a tier that answered slowly (B256). A
    # lookup takes at most a quarter of it, as a local level's read does (levels.GET_DEADLINE_S): its requests begin
    # within the first part of that quarter (SharedTier.begin_within), each takes at most the rest.
    share = cfg.store.read_timeout / TIER_SHARE_OF_READ_TIMEOUT
    timeout = min(shared.timeout, share / 2)
    begin_within = share - timeout
    wait = min(shared.wait, begin_within)
    if (timeout, wait) != (shared.timeout, shared.wait):
        log.info("shared cache: a lookup takes at most %gs (a quarter of --read-timeout %gs), so that the origin has "
                 "the rest of a read's time: requests time out after %gs and claims are waited for %gs at most",
                 share, cfg.store.read_timeout, timeout, wait)
    tier_store = StoreConfig(bucket=shared.bucket, endpoint_url=shared.endpoint_url, region=shared.region,
                             profile=shared.profile, addressing_style=shared.addressing_style,
                             max_connections=cfg.store.max_connections, connect_timeout=timeout,
                             read_timeout=timeout)
    try:
        client = Boto3Store(tier_store, retries=SHARED_TIER_RETRIES, sign_payloads=False)
    except Exception as exc:  # noqa: BLE001 - botocore's ProfileNotFound and the like: say it is the tier's
        raise MountError(f"--shared-cache-*: {exc}") from None
    inside = tier_inside_mount(shared, cfg.store, origin_identity(origin.endpoint_url, "") ==
                               origin_identity(client.endpoint_url, ""))
    if inside:  # the endpoints as the clients resolved them: one may come from the AWS configuration
        raise SettingError(inside)  # exit 2, as the same refusal of the options themselves (B1061)
    answered = True
    try:
        client.check_bucket(shared.prefix)
    except (BucketMissing, AccessDenied) as exc:
        # B252: a tier endpoint URL with the bucket in its path was told only that the bucket does not exist.
        hint = endpoint_path_hint(client.configured_endpoint_url, "--shared-cache-bucket", "--shared-cache-prefix")
        raise MountError(f"--shared-cache-bucket: {exc.message}" + (hint if isinstance(exc, BucketMissing) else "")) \
            from None
    except StoreError as exc:
        log.warning("shared cache %s does not answer (%s); reading from the origin until it does",
                    shared.bucket, exc.message)
        answered = False
    tier = SharedTier(client, origin=store_origin(origin),
                      prefix=shared.prefix, wait=wait, read_only=shared.read_only,
                      threads=cfg.store.max_connections, begin_within=begin_within)
    if answered:  # (a tier that did not answer the check would make the probe wait its timeout again)
        tier.probe_claims()
    log.info("%s: %s", tier, "read-only" if shared.read_only else
             "claims on" if tier.claims else "claims off")
    return tier


def tune_malloc() -> None:
    """glibc's allocator for a FUSE daemon (see MMAP_THRESHOLD_BYTES); best effort, elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        libc.mallopt(M_ARENA_MAX, ARENA_MAX)
    except (OSError, AttributeError):
        log.debug("mallopt not available; memory may be returned to the OS later")


def open_files_needed(max_connections: int, cache_dir: bool) -> int:
    """The descriptors a daemon may hold at once (two per connection, the cache's files where it has a cache dir,
    OPEN_FILES_BASE besides): what raise_open_file_limit warns below, and what README quotes for the defaults."""
    return OPEN_FILES_BASE + 2 * max_connections + (DISK_THREADS + PUT_THREADS if cache_dir else 0)


def raise_open_file_limit(cfg: MountConfig) -> None:
    """The soft limit on open descriptors up to the hard one (as Go's runtime does for its programs): the daemon
    holds a socket per connection, the cache files it reads and writes, and its log and /dev/fuse. A warning if
    even that is below what it may hold at once: reads would fail with "too many open files"."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else OPEN_FILES_RAISE_MAX
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, OPEN_FILES_RAISE_MAX), hard))
        except (ValueError, OSError) as exc:
            log.debug("cannot raise the open-file limit from %d: %s", soft, exc)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = open_files_needed(cfg.store.max_connections, bool(cfg.cache_dir))
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("the open-file limit is %d (ulimit -n, or LimitNOFILE= in the systemd unit), below the ~%d "
                    "descriptors this mount may hold at once: reads may fail with 'too many open files'", soft, need)


def raise_kernel_readahead(mountpoint: str, dev: int, kib: int) -> None:
    """Ask the kernel for large READs on this mount, whose device is `dev` (bdi read_ahead_kb). Best effort. The device
    is the one the mount answered with, not a stat of the path now: a mount gone meanwhile (a stop as it came up) had
    the read-ahead of the disk under its mount point raised instead (the review)."""
    if kib <= 0:
        return
    try:
        path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        with open(path, "w") as f:
            f.write(str(kib))
        log.info("kernel readahead for %s set to %d KiB", mountpoint, kib)
    except OSError as exc:
        log.info("could not raise kernel readahead (%s); READs stay at the kernel default", exc.strerror or exc)


@contextlib.contextmanager
def fusectl_connection(dev: int) -> Iterator[str]:
    """The fuse control file system's directory of the connection whose mount has device `dev`. Where fusectl is not
    mounted (systemd mounts it at boot; containers often do not) it is mounted for the caller's writes and unmounted
    again: what is written there belongs to the connection, not to that mount. As root only (OSError otherwise)."""
    conn = f"{FUSECTL}/{(os.major(dev) << 20) | os.minor(dev)}"  # the kernel's dev_t encoding
    mounted_here = False
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if not os.path.isdir(conn):
            if libc.mount(b"fusectl", FUSECTL.encode(), b"fusectl", 0, None) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            mounted_here = True
        yield conn
    finally:
        if mounted_here:
            libc.umount2(FUSECTL.encode(), 0)


def raise_fuse_background(mountpoint: str, dev: int, max_background: int) -> None:
    """Let the kernel queue `max_background` READs of its read-ahead on this connection (fusectl's
    max_background, congestion at 3/4 of it). Best effort, as root only (`fusectl_connection`). `dev`: the mount's
    device, as above."""
    if max_background <= 0:
        return
    try:
        with fusectl_connection(dev) as conn:
            with open(f"{conn}/max_background", "w") as f:
                f.write(str(max_background))
            with open(f"{conn}/congestion_threshold", "w") as f:
                f.write(str(max(1, max_background * 3 // 4)))
        log.info("FUSE background requests for %s set to %d", mountpoint, max_background)
    except OSError as exc:
        log.info("could not raise FUSE background requests (%s); the kernel's 12 stay", exc.strerror or exc)


def abort_connection(dev: int) -> str | None:
    """Abort the FUSE connection of the mount with device `dev` (fusectl's `abort`, what `umount -f` does): every
    request it holds ends, their pages are unlocked, and whatever waits in the kernel on them goes on. None once
    done, else why not."""
    try:
        with fusectl_connection(dev) as conn, open(f"{conn}/abort", "w") as f:
            f.write("1")
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


# How long the daemon waits for `fusermount3 -uz` to detach its own aborted mount (a user other than root).
FUSERMOUNT_S = 10.0


def lazy_unmount_advice(mountpoint: str) -> str:
    """The command that detaches a mount that stays (its connection aborted, its session still open) for whoever runs
    this daemon: `umount -l` needs root; a user's own FUSE mount is detached by `fusermount3 -uz`."""
    return f"`umount -l {mountpoint}`" if os.geteuid() == 0 else f"`fusermount3 -uz {mountpoint}`"


def top_type(real: str) -> bytes | None:
    """The file system type of the mount on top at the resolved path `real` (`mountinfo.top_at`), or None where
    /proc/self/mountinfo cannot say."""
    try:
        top = mountinfo.top_at(os.fsencode(real), mountinfo.mounts())
    except (OSError, ValueError):
        return None
    return None if top is None else top.fstype


def mounted_type(real: str) -> str:
    """The mount on top at the resolved path `real`, said with its type ("another file system" where
    /proc/self/mountinfo cannot say): what `_check_free` names."""
    fstype = top_type(real)
    if fstype is None:
        return "a mount of another file system"
    name = os.fsdecode(fstype)
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name} mount"


def mount_id(mountpoint: str, dev: int) -> bytes | None:
    """The mount id of the mount of device `dev` at `mountpoint` (the highest, if several: `mountinfo.stacked`), or
    None: what `detach_aborted` is told, with the device, to know that mount from one made at the path since (B139)."""
    want = f"{os.major(dev)}:{os.minor(dev)}".encode()
    try:
        ours = [m for m in mountinfo.stacked(os.fsencode(mountpoint), mountinfo.mounts()) if m.device == want]
    except (OSError, ValueError):
        return None
    return ours[-1].mount_id if ours else None


def detach_aborted(mountpoint: str, dev: int, only: bytes | None = None) -> bool:
    """Lazily unmount the mount of device `dev` at `mountpoint` (and with mount id `only`, if given), whose connection
    was aborted: libfuse's unmount at the session's close skips a connection that is severed (its device file polls
    POLLERR), which left the aborted mount in place, ENOTCONN for everyone. Only that mount, found in
    /proc/self/mountinfo (a stat of it is ENOTCONN). And only while nothing is mounted over it: umount2 takes the
    topmost mount at a path, which was another one's. As root umount2; as another user (EPERM) `fusermount3 -uz`,
    which detaches that user's own mount (B184). Best effort: whether a mount was detached."""
    want = f"{os.major(dev)}:{os.minor(dev)}".encode()
    path = os.fsencode(mountpoint)
    advice = lazy_unmount_advice(mountpoint)
    try:
        mounts = mountinfo.mounts()
        ours = {m.mount_id for m in mounts if m.device == want and m.point == path and only in (None, m.mount_id)}
        if any(m.parent in ours and m.point == path for m in mounts):
            log.warning("the aborted mount at %s is left in place: another mount was made over it", mountpoint)
            return False
        if not ours:
            return False
        if ctypes.CDLL(None, use_errno=True).umount2(path, MNT_DETACH) != 0:
            failed = OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            if failed.errno != errno.EPERM or os.geteuid() == 0:
                raise failed
            # Not root: umount2 is EPERM, and so would `umount -l` be for the same user; fusermount3 detaches a user's
            # own FUSE mount, the topmost at the path, which is this one (nothing over it, above). It left the mount
            # to the user, ENOTCONN, with a warning naming this command. Where it fails too, the warning names what
            # is left: root's lazy unmount (not the command that has just failed).
            advice = f"root's `umount -l {mountpoint}`"
            fusermount_detach(mountpoint, failed)
    except OSError as exc:
        log.warning("the aborted mount at %s could not be unmounted (%s): %s does it", mountpoint,
                    exc.strerror or exc, advice)
        return False
    return True


def fusermount_detach(mountpoint: str, failed: OSError) -> None:
    """`fusermount3 -uz mountpoint`, bounded (`FUSERMOUNT_S`); `failed` (umount2's EPERM) raised where it fails, its
    reason in the message."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise failed
    try:
        res = subprocess.run([tool, "-uz", mountpoint], capture_output=True, text=True, timeout=FUSERMOUNT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(failed.errno, f"{failed.strerror}; fusermount3: {exc}") from None
    if res.returncode != 0:
        said = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"status {res.returncode}"
        raise OSError(failed.errno, f"{failed.strerror}; {said}")


def sd_notify(message: str) -> None:
    """systemd's notify protocol (Type=notify), without a libsystemd dependency."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify systemd: %s", exc)


class Daemon:
    """One mount, wired: store -> cache levels -> engine -> namespace -> operations."""

    def __init__(self, cfg: MountConfig, mountpoint: str, on_ready: Callable[[], None],
                 metrics: MetricsServer | None = None):
        self.cfg = cfg
        self.mountpoint = mountpoint
        self.on_ready = on_ready
        self.metrics = metrics
        # SIGTERM / SIGINT that came after the mount was made and before `_watch_signals` took them (`run`).
        self.early_stops: list[int] = []
        self._residency_refused = False  # mincore refused once (logged): a seccomp filter without it
        self._names_failure_logged = False  # the names kept in the cache dir could not be written (logged once)
        self._names_saving = trio.Lock()  # one write of them at a time (_save_names)
        self.store = Boto3Store(cfg.store)
        self._meta_limiter: trio.CapacityLimiter | None = None  # metadata requests waited for (METADATA_THREADS)
        self.metadata_requests = 0  # counters (trio thread): every metadata request, and those that failed
        self.metadata_errors = 0
        self._meta_threads: trio.CapacityLimiter | None = None  # their threads, given-up ones included
        # pyfuse3's main loop and the handlers it runs: cancelled by _stop once a stop's grace is over, or at once by
        # a second stop (_stop_now), unless main() returned first (_served).
        self._requests = trio.CancelScope()
        self._served = trio.Event()
        # A stop's state, all of it in the trio thread: `_stopping` once a first SIGTERM/SIGINT began the stop (_stop)
        # or, the mount gone already, let the drains go on; `cut_short` once a second one cut it short
        # (_stop_now), which cancels `_grace` (the wait for requests in flight, once _stop is in it) and `_drains`
        # (the drains of the cache levels after the uploads' abort). The daemon then exits with status 1.
        self._stopping = False
        self.cut_short = False
        self._grace: trio.CancelScope | None = None
        self._drains = trio.CancelScope()
        self._session_open = True  # pyfuse3's session: mounted, until end_session
        self._aborted: int | None = None  # the device of the mount whose connection the stop aborted (B116)
        self._mount_id: bytes | None = None  # this mount's id, once it answers (_announce_ready; B139)
        self.disk_cache = open_disk_cache(cfg) if cfg.cache_dir else None
        self.shared_tier = open_shared_tier(cfg, self.store) if cfg.shared_cache else None
        # The cache levels below memory, asked in this order before the origin.
        levels: list[ChunkCache] = [level for level in (self.disk_cache, self.shared_tier) if level is not None]
        # What the levels hold outside the engine's budget comes out of it.
        staging = sum(level.staging_bytes(cfg.chunk_size) for level in levels)
        if cfg.writable and self.disk_cache is not None:
            staging += STAGING_BYTES  # the O_DIRECT blocks of written files' local copies
        chunk_memory = max(4 * cfg.chunk_size, cfg.chunk_memory - staging)
        self.engine = ChunkEngine(self.store, chunk_size=cfg.chunk_size, memory_limit=chunk_memory,
                                  max_connections=cfg.store.max_connections, read_timeout=cfg.store.read_timeout,
                                  levels=levels)
        self.writes: Writes | None = None
        self.saved_names = load_saved_names(cfg, store_origin(self.store))
        if cfg.writable:
            namespace = WritableNamespace(self.store, self._store_call, prefix=cfg.store.prefix, ttl=cfg.metadata_ttl,
                                          saved=self.saved_names, max_key_bytes=self.store.max_key_bytes)
            # With --cache-dir, stored files go into the NVMe cache (write_staging).
            cache = None if self.disk_cache is None or cfg.cache_dir is None else \
                (self.disk_cache, cfg.cache_dir, self.engine.chunk_id, cfg.chunk_size)
            self.writes = Writes(namespace, Uploads(self.store), self.engine.memory, part_size=cfg.write_part_size,
                                 max_connections=cfg.store.max_connections, timeout=cfg.store.read_timeout,
                                 allow_overwrite=cfg.allow_overwrite, allow_delete=cfg.allow_delete, origin=cfg.store,
                                 cache=cache,
                                 cache_min_free=self.disk_cache.min_free_bytes if self.disk_cache is not None else 0,
                                 cache_room=self.disk_cache.keep_free if self.disk_cache is not None else None)
            self.namespace: Namespace = namespace
        else:
            self.namespace = Namespace(self.store, self._store_call, prefix=cfg.store.prefix, ttl=cfg.metadata_ttl,
                                       saved=self.saved_names)
        push_limit = default_push_limit() if cfg.pagecache_push_limit is None else cfg.pagecache_push_limit
        log.info("memory limit %d MiB (%d MiB of chunks); page-cache pushes: at most %d MiB for the files open",
                 cfg.memory_limit // MiB, chunk_memory // MiB, push_limit // MiB)
        self.pusher = PageCachePusher(push_limit, kernel_readahead=cfg.kernel_window)
        self.streamer = ModelStreamer(self.engine, self.pusher, max_connections=cfg.store.max_connections,
                                      enabled=cfg.model_streaming, siblings=self._files_beside,
                                      look_up=self._look_up, readers=lambda: self.ops.readers,
                                      resident=self._resident)
        self.stats = MountStats(cfg.store.bucket, self.engine, self.streamer, self.pusher, disk_cache=self.disk_cache,
                                shared_tier=self.shared_tier, writes=self.writes,
                                open_files=lambda: self.ops.open_files, inodes=lambda: self.namespace.inode_count,
                                metadata=lambda: (self.metadata_requests, self.metadata_errors),
                                failed=lambda: dict(FAILED), versions_gone=lambda: self.ops.versions_gone)
        self.ops = Operations(self.namespace, self.engine, self.streamer, self.pusher, max_readahead=cfg.max_readahead,
                              owner=Owner(cfg.uid, cfg.gid, cfg.file_mode, cfg.dir_mode), stats=self.stats.json_bytes,
                              writes=self.writes, kernel_window=cfg.kernel_window)

    def end_session(self) -> None:
        """Unmount (lazily, if files are open: their callers get ENOTCONN) and close the FUSE session; once. A mount
        whose connection the stop aborted is detached here (libfuse's unmount skips it), whenever the session closes:
        at the stop, or at the daemon's exit after a push that outlived PUSH_ABORT_S too; and so is this mount still
        there after libfuse's unmount, whose connection someone else aborted (B139)."""
        if self._session_open:
            self._session_open = False
            # The stop waited for them already (_end_session_calls); at run()'s close, here, bounded.
            if not self.ops.session_calls.end(SESSION_CALLS_S):
                log.warning("a call into the FUSE session (a kernel entry dropped) was still under way %g s after "
                            "the FUSE loop ended: the session is closed anyway", SESSION_CALLS_S)
            pyfuse3.close(unmount=True)
            if self._aborted is not None:
                detach_aborted(self.mountpoint, self._aborted)
            elif self.ops.device is not None and self._mount_id is not None and \
                    detach_aborted(self.mountpoint, self.ops.device, only=self._mount_id):
                # Still there after libfuse's unmount: someone else aborted the connection (`umount -f` with files
                # open, whose unmount then fails busy; fusectl's abort), which libfuse takes for an unmount and skips.
                # It stayed, ENOTCONN until `fusermount3 -u` (B139). This mount's id and device, taken while it
                # answered, tell it from one made at the path since.
                log.info("the FUSE connection of %s was aborted by someone else (`umount -f`, fusectl's abort): its "
                         "mount was detached", self.mountpoint)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        stats, levels = self.engine.stats, self.engine.levels.stats
        log.info("served bytes: memory=%d cache=%d origin=%d; origin requests=%d bytes=%d errors=%d; "
                 "cache hits=%d; egress saved=%d; buffers recycled=%d", stats.bytes_served_memory,
                 stats.bytes_served_level, stats.bytes_served_origin, levels.origin_requests, levels.origin_bytes,
                 levels.origin_errors, levels.hits, self.stats.snapshot()["egress_saved_bytes"],
                 self.engine.memory.buffers_recycled)
        if self.disk_cache is not None:
            self.disk_cache.close()

    async def _store_call(self, fn: Callable, *args: object) -> object:
        """One metadata request (a HEAD, a probe, one listing page) in a thread, given up after
        --read-timeout whatever botocore's retries are doing: the FUSE request then fails with EIO
        (or is answered from what the namespace already knows) instead of waiting them out."""
        assert self._meta_limiter is not None and self._meta_threads is not None
        timeout = self.cfg.store.read_timeout
        # A request given up on is left to end in its thread (botocore's own timeouts and retries end it, up to
        # a few --read-timeouts later), but gives its slot back at once: trio frees an abandoned thread's limiter
        # token only when the thread ends, so a few of them kept every lookup waiting long after the origin was
        # back. Threads, abandoned ones included, are bounded by `_meta_threads`. No try of its request begins
        # past the deadline in that thread (`within`): a listing answered cut short is asked once more there (B245),
        # as botocore sends a failed try again, and given up on, neither outlasts --read-timeout by another try.
        self.metadata_requests += 1
        deadline = trio.current_time() + timeout
        try:
            with trio.move_on_at(deadline):  # the wait for a slot included
                async with self._meta_limiter:
                    until = time.monotonic() + (deadline - trio.current_time())
                    return await trio.to_thread.run_sync(within, until, fn, *args, limiter=self._meta_threads,
                                                         abandon_on_cancel=True)
        except Exception:
            self.metadata_errors += 1
            raise
        self.metadata_errors += 1
        raise TimedOut(f"{metadata_request_words(fn, args)} timed out after {timeout:g}s")

    async def _files_beside(self, ino: int) -> list[tuple[int | None, ObjectVersion]]:
        return await self.namespace.files_beside(self.namespace.node(ino))

    def _path_of(self, version: ObjectVersion) -> str:
        """Where a file of the bucket is on this mount."""
        return os.path.join(self.mountpoint, version.key[len(self.namespace.prefix):])

    async def _look_up(self, version: ObjectVersion) -> int | None:
        """Has the kernel look a file up through this mount (a stat from a worker thread, whose LOOKUP this
        daemon's trio thread answers meanwhile), so that model streaming can push a shard nobody opened yet:
        its inode, or None if it could not be looked up."""
        path = self._path_of(version)
        with trio.move_on_after(self.cfg.store.read_timeout):
            try:
                await trio.to_thread.run_sync(os.stat, path, abandon_on_cancel=True)
            except OSError as exc:
                log.debug("could not look %r up through the mount: %s", version.key, exc)
                return None
        return self.namespace.kernel_ino(version)

    async def _resident(self, version: ObjectVersion, ino: int, ranges: list[tuple[int, int]]) -> list[bool] | None:
        """Which of `ranges` of an open file the page cache holds whole (residency.py): the file opened through
        this mount from a worker thread, whose OPEN the trio thread answers meanwhile without starting a stream
        (Operations.probes); None if it could not be asked."""
        path = self._path_of(version)

        def ask() -> list[bool] | None:
            tid = threading.get_native_id()
            self.ops.probes.add(tid)
            try:
                return residency.held_ranges(path, ino, ranges)
            finally:
                self.ops.probes.discard(tid)

        with trio.move_on_after(self.cfg.store.read_timeout):
            try:
                return await trio.to_thread.run_sync(ask, abandon_on_cancel=True)
            except OSError as exc:
                if not self._residency_refused:
                    self._residency_refused = True
                    log.info("cannot ask the kernel which pages of a file it holds (%s): a model stream that runs "
                             "again fetches the whole file", exc)
        return None

    def fuse_options(self) -> set[str]:
        opts = set(pyfuse3.default_options)
        opts |= {f"fsname={self.cfg.store.bucket}", f"subtype={MODELFS_FSTYPE.removeprefix(b'fuse.').decode()}"}
        if not self.cfg.writable:
            opts.add("ro")
        if self.cfg.allow_other:
            opts.add("allow_other")
        return opts

    async def serve(self) -> None:
        self._meta_limiter = trio.CapacityLimiter(METADATA_THREADS)
        self._meta_threads = trio.CapacityLimiter(METADATA_THREADS + ABANDONED_METADATA_THREADS)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            await nursery.start(self.streamer.run)
            await nursery.start(self.namespace.run)
            if self.writes is not None:
                await nursery.start(self.writes.run)
            nursery.start_soon(self._watch_signals)
            nursery.start_soon(self._announce_ready)
            if self.disk_cache is not None:
                nursery.start_soon(self._keep_cache_floor, self.disk_cache)
            if self.saved_names is not None:
                nursery.start_soon(self._keep_names, self.saved_names)
            try:
                with self._requests:
                    await pyfuse3.main()
            except BaseException as exc:
                if not _loop_failed(exc):  # a KeyboardInterrupt (not a stop: those _watch_signals takes)
                    raise
                # A task of the mount failed (its nursery is cancelled, and with it the loop) or the loop itself did.
                # pyfuse3.main runs its handlers in a nursery of its own: its Cancelled comes out in an exception
                # group, which an `except (Exception, trio.Cancelled)` did not take (B128).
                # The session ends here all the same: a push waiting for the pages of a READ that the loop's end cut
                # short held the nursery, and so the daemon, for good, ENOTCONN for everyone, as B116's stop did
                # (B127); and run()'s close would not abort a call into the session still under way.
                await self._end_served()
                with trio.CancelScope(shield=True):
                    await self._drains_after_failure()
                raise
            # The mount goes before the drains below (up to about a minute): nobody reads its requests any more, so
            # a stat of the mount point hung until they ended, and a second stop meanwhile (then the default action)
            # left the mount in place, ENOTCONN until someone unmounted it.
            await self._end_served()
            # A mount started now in this one's place waits for the drains below (its cache dir's lock), and needs
            # the metrics port this one holds: a restart script's `modelfs unmount && modelfs mount` failed "in use".
            if self.metrics is not None:
                metrics, self.metrics = self.metrics, None
                await trio.to_thread.run_sync(metrics.close)
            if self.disk_cache is not None:
                with trio.move_on_after(MARK_DRAINING_S):
                    await trio.to_thread.run_sync(self.disk_cache.mark_draining, abandon_on_cancel=True)
            if self.writes is not None:
                # Not cut short by a second stop: bounded (ABORT_ALL_S), and it says each upload it could not
                # abort, with the `modelfs cleanup` command that removes it.
                await self.writes.abort_all()
            with self._drains:  # the cache levels' drains: a second stop skips them (_stop_now), saying so
                if self.writes is not None:
                    await self.writes.drain_cache_fills()
                await self._drain_cache_writes()
                await self._drop_claims()
                await self._save_names_at_end()
            if self._drains.cancelled_caught:
                log.warning("the stop was cut short: written files and fetched chunks not yet in the NVMe cache are "
                            "not put there, claims on the shared cache are left to expire, and the names learnt "
                            "since the last save are not saved (the bucket holds all it held)")
            nursery.cancel_scope.cancel()

    async def _end_served(self) -> None:
        """The loop has ended, cleanly or not: the session ends, shielded (a task that failed in its wait for a push
        cancelled it before the abort, and the nursery waited for the push for good, B129). The session is about to
        close, so nothing may call into it any more (pyfuse3.terminate() of a closed one is a SIGSEGV: a stop during
        the drains after `modelfs unmount`), nor announce a mount that is gone."""
        self._served.set()
        with trio.CancelScope(shield=True):
            await self._end_session_after_pushes()

    async def _drains_after_failure(self) -> None:
        """Where a task of the mount failed (or the loop did), the drains of a clean end that are bounded on their own
        and lean on no task of the mount: the shared tier's claims dropped (CLAIM_DROP_S; others waited up to
        CLAIM_TTL_S for the chunks this node had claimed) and the names learnt saved (NAMES_SAVE_S; a remount while the
        origin is away found those of the last round only). Each on its own: one that fails is logged, and none
        stops the error that ended the loop from going out (B140). And first the uploads of files still open, aborted
        straight through the store within ABORT_ALL_S (`Writes.abort_after_failure`; their parts stayed in the bucket,
        billed, B147). The cache writes' drain is left out: it waits on the engine's tasks, which may have failed."""
        for what, drain in (("the uploads of files still open could not be aborted", self._abort_uploads_after_failure),
                            ("the shared cache's claims could not be dropped", self._drop_claims),
                            ("the names learnt could not be saved", self._save_names_at_end)):
            try:
                await drain()
            except Exception as exc:  # noqa: BLE001 - the loop's own error goes out; this one is only logged
                log.warning("%s after the mount's failure: %r", what, exc)

    async def _abort_uploads_after_failure(self) -> None:
        if self.writes is not None:
            await self.writes.abort_after_failure()

    async def _save_names_at_end(self) -> None:
        """The names learnt, saved once more at the end, within NAMES_SAVE_S."""
        if self.saved_names is not None:
            with trio.move_on_after(NAMES_SAVE_S):
                await self._save_names(self.saved_names)

    async def _end_session_after_pushes(self) -> None:
        """End the session once no page-cache push is in notify_store: the session a push writes to must outlive it.
        A push waiting for the pages of a READ the stop cut short (its grace was over: pyfuse3 sends no reply for a
        cancelled handler, so the kernel keeps that READ's pages locked until the connection ends) never ended, and
        neither did the daemon, even SIGKILLed, until someone aborted the connection (B116). Here a push still copying
        after PUSH_STOP_S gets the connection aborted through fusectl: the READs it held end, their pages unlock, the
        push ends (within PUSH_ABORT_S), and the session closes. One warning says so."""
        await self._end_session_calls()
        if await self.pusher.stop(PUSH_STOP_S):
            self.end_session()
            return
        aborted_before = self._aborted is not None  # for a call into the session (_end_session_calls)
        why = self._abort_once()
        if why is None:
            if await self.pusher.stop(PUSH_ABORT_S):
                log.warning("a page-cache push was still waiting %g s after the FUSE loop ended (for the pages of a "
                            "READ the stop cut short): the FUSE connection was aborted %s", PUSH_STOP_S,
                            "already (for a call into the session)" if aborted_before else "to end it")
                self.end_session()
                return
        # Not aborted: `umount -f` aborts the connection, which ends the push, and unmounts. Aborted already: that
        # cannot end the push again, and the mount stays until the session closes; a lazy unmount detaches it now.
        log.warning("a page-cache push was still waiting %g s after the FUSE loop ended%s: the mount stays until the "
                    "daemon exits, which waits for the push (%s)", PUSH_STOP_S,
                    f" and the FUSE connection could not be aborted ({why})" if why else
                    f", and {PUSH_ABORT_S:g} s after its connection was aborted",
                    f"`umount -f {self.mountpoint}` ends both" if why else
                    f"{lazy_unmount_advice(self.mountpoint)} detaches it now")

    async def _end_session_calls(self) -> None:
        """No call into the session from a worker thread from now on, and none under way (B124): the threads the
        handlers stopped waiting for (a kernel entry's drop, waiting for the directory's lock) called into the
        session as `pyfuse3.close` freed it. One still there after SESSION_CALLS_S waits for a lock that a request
        the stop cut short holds, with no reply until the connection ends: the connection is aborted (its requests
        end, their locks go), and the call ends. Else end_session waits once more, and says so."""
        calls = self.ops.session_calls
        if await trio.to_thread.run_sync(calls.end, SESSION_CALLS_S, abandon_on_cancel=True):
            return
        if self._abort_once() is None:
            log.warning("a call into the FUSE session (a kernel entry dropped) was still under way %g s after the "
                        "FUSE loop ended (for a request the stop cut short): the FUSE connection was aborted to end "
                        "it", SESSION_CALLS_S)
            await trio.to_thread.run_sync(calls.end, SESSION_CALLS_S, abandon_on_cancel=True)

    def _abort_once(self) -> str | None:
        """Abort the mount's FUSE connection through fusectl, at most once a stop (the step that ends the session, for
        a call into it or a push still waiting after the loop ended): None once it is aborted, now or before, else
        why not. The aborted mount's device is kept (`_aborted`): `end_session` detaches that mount (B122)."""
        if self._aborted is not None:
            return None
        dev = self.ops.device
        why = "the mount's device is not known" if dev is None else abort_connection(dev)
        if why is None:
            self._aborted = dev
        return why

    @staticmethod
    async def _keep_cache_floor(cache: DiskCache) -> None:
        """The NVMe cache's free-space floor, kept while no put comes: a warm node that only reads kept its chunks
        while another process filled the disk to the last byte. And its count of what it holds, true after an operator
        removed chunk files by hand."""
        while True:
            await trio.sleep(FREE_CHECK_S)
            await trio.to_thread.run_sync(cache.forget_removed, abandon_on_cancel=True)
            await trio.to_thread.run_sync(cache.keep_free, abandon_on_cancel=True)

    async def _keep_names(self, saved: SavedNames) -> None:
        """The names learnt, written to the cache dir every SAVE_EVERY_S while they change (saved_names.py)."""
        while True:
            await trio.sleep(SAVE_EVERY_S)
            await self._save_names(saved)

    async def _save_names(self, saved: SavedNames) -> None:
        """One write of the names, if they changed; one at a time (the stop's and the loop's would share the temp
        file), so a stop waits for the loop's, within NAMES_SAVE_S."""
        async with self._names_saving:
            if not saved.dirty:
                return
            try:
                await trio.to_thread.run_sync(saved.save, saved.snapshot(), abandon_on_cancel=True)
            except OSError as exc:
                saved.dirty = True  # tried again at the next round
                self._names_not_saved(saved, exc)
            except BaseException:
                # Cancelled, its thread abandoned: that write may never end (the daemon exits on a task's failure, its
                # worker threads with it). The snapshot cleared `dirty`, and the end's save, finding nothing to
                # write, skipped the names of this round; they are written again, after that thread's (B142).
                saved.dirty = True
                raise

    def _names_not_saved(self, saved: SavedNames, exc: OSError) -> None:
        # A warning once a mount, then at debug level. A cache disk that is full or read-only at info level: the NVMe
        # cache's own warning says that (one line for one episode).
        disk = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
        log.log(logging.DEBUG if self._names_failure_logged else logging.INFO if disk else logging.WARNING,
                "the names learnt could not be written to %s (%s): a remount while the origin is away may not find "
                "them", saved.path, exc.strerror or exc)
        self._names_failure_logged = True

    async def _drop_claims(self) -> None:
        """Claims on the shared tier for chunks whose fetch the unmount cut short: dropped, each request
        bounded by the tier's own timeout, the whole by CLAIM_DROP_S."""
        if self.shared_tier is None:
            return
        with trio.move_on_after(CLAIM_DROP_S):
            dropped = await trio.to_thread.run_sync(self.shared_tier.drop_claims, abandon_on_cancel=True)
            if dropped:
                log.info("unmounted; dropped %d claims on the shared cache", dropped)

    async def _drain_cache_writes(self) -> None:
        pending = self.engine.levels.writes_pending
        if not pending:
            return
        log.info("unmounted; writing %d fetched chunks to the cache (up to %g s)", pending, WRITE_DRAIN_S)
        left = await self.engine.levels.drain_writes(WRITE_DRAIN_S)
        if left:
            log.warning("%d fetched chunks were not written to the cache within %g s", left, WRITE_DRAIN_S)

    async def _watch_signals(self) -> None:
        """SIGTERM / SIGINT, SIGHUP / SIGUSR1 and the stray signals, taken until the end of the stop's drains: a
        first stop begins the stop (_stop, in a task of its own, so that a second one is still taken), a second one
        cuts it short (_stop_now). Its default action ended the daemon at once (143) during the drains, the uploads
        of files still open left in the bucket without a word."""
        try:
            async with trio.open_nursery() as stops:
                await self._take_signals(stops)
        finally:
            # After the drains (run's close): a stop now ends the daemon at once, as the default actions do.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    async def _take_signals(self, stops: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                                       *STRAY_SIGNALS) as signals:
            async for signum in _chain(self.early_stops, signals):
                if signum in STRAY_SIGNALS:
                    log.warning("received %s: ignored, still mounted (SIGTERM or `modelfs unmount` stops the mount)",
                                signal_name(signum))
                    continue
                if signum in (signal.SIGHUP, signal.SIGUSR1):
                    # What logrotate's postrotate and `systemctl reload` send: the log file is reopened now
                    # (LogFile does it at each line too, but a quiet daemon logs none for days: the rotated file,
                    # compressed and deleted, held its disk space); a mount in use must not go away. Its options stay
                    # as they were: an operator who edited the config and reloaded would otherwise think it applied.
                    # SIGUSR1 is nginx's reopen, which a postrotate copied from it sends: its default action
                    # killed the daemon, taking the mount down under every reader.
                    log.info("received %s: %s%s; the options are not read again (a restart of the mount "
                             "applies a changed configuration)", signal.Signals(signum).name,
                             "unmounted, still stopping" if self._served.is_set() else "still mounted",
                             reopen_log_file())
                    continue
                name = signal.Signals(signum).name
                if self._stopping:
                    self._stop_now(name)
                elif self._served.is_set():
                    # The mount is gone already (`modelfs unmount`, then `systemctl stop` or a restart during the
                    # drains): this is the first stop, and it lets them end (bounded); only a second one cuts them
                    # short. It cut them short at once, exit status 1: a unit marked failed, the caches' drains lost.
                    self._stopping = True
                    log.info("received %s: already unmounted, the stop's drains go on (a second SIGTERM or SIGINT "
                             "cuts them short)", name)
                else:
                    self._stopping = True
                    stops.start_soon(self._stop, name)

    async def _stop(self, name: str) -> None:
        """The stop a SIGTERM or SIGINT begins: pushes, then the loop's end, waiting for the requests in flight
        within their grace (STOP_GRACE_S, or STOP_GRACE_WRITING_S while a file is open for writing)."""
        busy = self.ops.open_files
        # An operator reading the log after a stop sees whether anything was still using the mount.
        log.info("received %s, unmounting%s", name, f" with {busy} file{'s' if busy > 1 else ''} open (their "
                 "next reads and writes fail with ENOTCONN)" if busy else " (no file open)")
        sd_notify("STOPPING=1")
        # Pushes first, while READs are still answered: a push waits for pages a queued READ holds.
        if not await self.pusher.stop(PUSH_STOP_S):
            log.warning("page-cache pushes still running %g s after %s", PUSH_STOP_S, name)
        self.streamer.stop()
        if not self._session_open or self._served.is_set():  # the loop ended meanwhile: the session is gone
            return
        pyfuse3.terminate()
        grace = STOP_GRACE_WRITING_S if self.ops.writers else STOP_GRACE_S
        with trio.move_on_after(grace) as self._grace:
            if self.cut_short:
                self._grace.cancel()
            await self._served.wait()
        if not self._served.is_set():
            if not self.cut_short:
                log.warning("requests still in flight %g s after %s were cut short (their callers get "
                            "ENOTCONN)", grace, name)
            self._requests.cancel()

    def _stop_now(self, name: str) -> None:
        """A second SIGTERM / SIGINT (a person's second Ctrl-C; after `modelfs unmount`, the second during the drains):
        the requests still in flight are cut short now, not at their grace's end, and the cache levels' drains are
        skipped; what that drops is said (here, and by the drains' end). The session's end and the uploads' abort,
        each bounded, still run: the daemon leaves no mount behind, and no upload it does not name. Exit status 1."""
        if self.cut_short:
            log.info("received %s again: the stop is already cut short (it ends within %g s)", name, ABORT_ALL_S)
            return
        self.cut_short = True
        writers = self.ops.writers
        if self._served.is_set():
            what = "the drains are skipped"
        else:
            what = "requests still in flight are cut short now (their callers get ENOTCONN)"
            if writers:
                what += (f"; {writers} file{'s' if writers > 1 else ''} open for writing may not be stored (a line "
                         "follows for each)")
        log.warning("received %s while stopping: the stop is cut short, %s; the uploads of files still open are "
                    "aborted (up to %g s; any it cannot abort is named, for `modelfs cleanup`); exit status 1",
                    name, what, ABORT_ALL_S)
        if self._grace is not None:
            self._grace.cancel()
        self._drains.cancel()

    async def _announce_ready(self) -> None:
        # stat() of the mountpoint goes through our own loop: when it returns, the mount answers.
        def probe() -> int:
            deadline = time.monotonic() + READY_TIMEOUT
            while True:
                try:
                    return os.stat(self.mountpoint).st_dev
                except OSError as exc:
                    if exc.errno != errno.ENOTCONN or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

        dev = await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
        if self._served.is_set():  # stopped as it came up: that stat may have reached the directory under the mount
            return
        self.ops.device = dev
        self._mount_id = await trio.to_thread.run_sync(mount_id, self.mountpoint, dev)
        await trio.to_thread.run_sync(raise_kernel_readahead, self.mountpoint, dev, self.cfg.kernel_window // 1024)
        await trio.to_thread.run_sync(raise_fuse_background, self.mountpoint, dev, self.cfg.fuse_max_background)
        if self._served.is_set():
            return
        if self.metrics is not None:
            self.metrics.start(self.stats)
        log.info("mounted bucket %s%s at %s", self.cfg.store.bucket,
                 f" (prefix {self.cfg.store.prefix})" if self.cfg.store.prefix else "", self.mountpoint)
        self.on_ready()
        sd_notify("READY=1")


def _loop_failed(exc: BaseException) -> bool:
    """Whether `exc`, out of pyfuse3.main(), says that the loop or a task of the mount failed (and cancelled it): an
    Exception or trio's Cancelled, bare or in exception groups (pyfuse3's own nursery wraps them), and nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split((Exception, trio.Cancelled))[1] is None
    return isinstance(exc, (Exception, trio.Cancelled))


def signal_name(signum: int) -> str:
    """A signal's name; SIGRTMIN+n for the real-time ones between SIGRTMIN and SIGRTMAX, which Python leaves unnamed."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"


async def _chain(first: list[int], then: AsyncIterator[int]) -> AsyncIterator[int]:
    """The signals in `first` (noted before the receiver existed), then those `then` receives."""
    while first:
        yield first.pop(0)
    async for signum in then:
        yield signum


def run(cfg: MountConfig, ready: Callable[[str | None], None]) -> int:
    """Check, mount, serve until unmounted or signalled. `ready(None)` once serving, `ready(msg)` on
    a pre-flight failure. Metrics are served on `cfg.metrics_addr` (HOST:PORT) once the mount answers.
    Returns the exit status."""
    metrics = None
    # SIGHUP only ever reopens the log (a logrotate postrotate, a systemd reload), and so does SIGUSR1 (nginx's
    # reopen): ignored until the daemon's own receiver takes them, and again once that is gone (after the drains).
    # By default they killed the daemon silently during a slow pre-flight.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for signum in STRAY_SIGNALS:  # and those only a stray `kill` sends, likewise
        signal.signal(signum, signal.SIG_IGN)
    # A stop (systemctl stop, Ctrl-C) during a slow pre-flight (an endpoint that does not answer) is said in one
    # line, as every pre-flight failure is; SIGTERM's default action ended the daemon without a word (143). It
    # exits at once: nothing is mounted yet, and an exception raised in the handler was swallowed by the HTTP
    # stack, which went on waiting for the endpoint (measured).

    def stopped_before_ready(signum: int, frame: object) -> None:
        ready(f"stopped by {signal.Signals(signum).name} before the mount was ready")
        sys.stderr.flush()
        # Then ended by the signal itself, as before: systemd counts a stop's SIGTERM as a clean end (an exit
        # status of 1 left the unit failed, and Restart=on-failure started it again).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped_before_ready)
    signal.signal(signal.SIGINT, stopped_before_ready)
    lock = None
    raise_open_file_limit(cfg)  # first: the pre-flight opens connections, the cache dir, the metrics socket
    try:
        check_fuse_available(cfg.allow_other)
        mountpoint, lock = check_mountpoint(cfg.mountpoint, cfg.allow_non_empty)
        check_cache_dir_outside(cfg.cache_dir, mountpoint)
        os.chdir("/")  # a daemon keeps no directory of its caller busy (the paths in cfg are absolute)
        metrics = bind_metrics(cfg.metrics_addr)
        check_profiles(cfg)
        check_bucket(cfg)
        told: list[None] = []  # ready(None) was called: the mount answers

        def answered() -> None:
            told.append(None)
            ready(None)

        daemon = Daemon(cfg, mountpoint, answered, metrics)
    except Exception as exc:  # noqa: BLE001 - whatever stops the mount, the user is told why in one line
        if metrics is not None:
            metrics.close()
        if not isinstance(exc, MountError):  # one we did not foresee (botocore's ProfileNotFound, ...)
            log.debug("pre-flight failed", exc_info=True)
        if lock is not None:
            os.close(lock)
        ready(str(exc) if isinstance(exc, MountError) else f"cannot mount: {exc}")
        return 2 if isinstance(exc, SettingError) else 1
    finally:
        # From here on a mount may exist: a stop until the daemon's own receiver takes it (Daemon._watch_signals) is
        # noted, and done there. The default action killed the daemon with its mount in place, ENOTCONN for every
        # user of the mount point until someone unmounted it (the audit).
        early_stops: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: early_stops.append(signum))
        signal.signal(signal.SIGINT, lambda signum, frame: early_stops.append(signum))
    daemon.early_stops = early_stops
    tune_malloc()
    try:
        with stderr_captured() as said:
            try:
                pyfuse3.init(daemon.ops, mountpoint, daemon.fuse_options())
                failure = None
            except RuntimeError as exc:
                failure = str(exc)
        why = [line for line in said if line.startswith(FUSE_STDERR_PREFIXES)]
        said_else = said if failure is None else [line for line in said if line not in why]
        if said_else:
            with contextlib.suppress(OSError):  # a stderr gone (a closed pipe, a hung-up terminal) is no reason to fail
                os.write(2, ("\n".join(said_else) + "\n").encode())
        if failure is not None:
            daemon.close()
            ready(f"cannot mount at {mountpoint}: {failure}" + (f" ({'; '.join(why)})" if why else ""))
            return 1
    finally:
        os.close(lock)  # mounted (or not): a mount started after this one finds it there
    clean = False
    try:
        trio.run(daemon.serve)
        clean = True
    except Exception as exc:
        if told:
            log.exception("daemon stopped on an error")
            raise
        # Before the mount answered (out of descriptors for trio's own sockets at `ulimit -n 11`): one line, as a
        # pre-flight failure says it, not a traceback and "run with --foreground to see why".
        log.debug("serving failed before the mount was ready", exc_info=True)
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # a nursery's: say what it holds
            exc = exc.exceptions[0]
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        ready(f"cannot start serving {mountpoint}: {why}")
    except BaseException:
        log.exception("daemon stopped on an error")
        raise
    finally:
        daemon.namespace.forget_all()
        daemon.end_session()
        daemon.close()
        log.info("unmounted %s%s", mountpoint, " (the stop was cut short: exit status 1)" if daemon.cut_short else "")
    return 0 if clean and not daemon.cut_short else 1
