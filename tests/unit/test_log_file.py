"""--log-file's handler (mount.LogFile) when the file cannot be written: the daemon goes on, and says so once."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import pytest

from fsmount.mount import LogFile


def line(text: str) -> logging.LogRecord:
    return logging.makeLogRecord({"msg": text, "levelno": logging.INFO, "levelname": "INFO"})


def test_a_log_file_whose_directory_was_removed_drops_lines_and_says_so_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """WatchedFileHandler raised the failed reopen from the log call itself: the daemon died at the first line logged
    after an `rm -rf` of the log's directory."""
    logs = tmp_path / "logs"
    logs.mkdir()
    handler = LogFile(str(logs / "modelfs.log"))
    try:
        handler.handle(line("before"))
        for round_ in range(2):
            shutil.rmtree(logs)
            for i in range(3):
                handler.handle(line(f"dropped {round_} {i}"))  # raised FileNotFoundError
            assert capsys.readouterr().err.count("cannot write the log file") == 1  # once an episode
            logs.mkdir()
            handler.handle(line(f"after {round_}"))
            assert (logs / "modelfs.log").read_text() == f"after {round_}\n"
    finally:
        handler.close()


def test_a_full_log_disk_is_said_once_not_a_traceback_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A write that fails (ENOSPC: /dev/full) printed logging's "--- Logging error ---" and a traceback on stderr for
    every line, into the journal under systemd."""
    handler = LogFile("/dev/full")
    try:
        for i in range(5):
            handler.handle(line(f"line {i}"))
    finally:
        with contextlib.suppress(OSError):  # what is still buffered cannot be written either (logging.shutdown's too)
            handler.close()
    err = capsys.readouterr().err
    assert err.count("cannot write the log file /dev/full (No space left on device)") == 1
    assert "Traceback" not in err and "Logging error" not in err


def test_under_systemd_the_dropped_lines_are_said_as_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """stderr connected to the journal: the line carries the warning priority, as the daemon's own log lines do."""
    import fsmount.mount

    monkeypatch.setattr(fsmount.mount, "stderr_is_journal", lambda: True)
    handler = LogFile("/dev/full")
    try:
        handler.handle(line("x"))
    finally:
        with contextlib.suppress(OSError):
            handler.close()
    assert capsys.readouterr().err.startswith("<4>modelfs: cannot write the log file /dev/full")


def test_a_log_file_that_cannot_mend_by_itself_is_a_setting() -> None:
    """A --log-file that no wait mends (a directory, a path through a file, a permission root does not pass) is exit
    status 2, which the systemd unit does not restart on; one that may mend (a parent not there yet, a full or
    read-only disk) stays 1, started again (B173). Each says --log-file on one line."""
    import errno
    import os

    from fsmount.mount import MountError, SettingError, log_file_error

    for code in (errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ELOOP):
        said = log_file_error("/var/log/m", OSError(code, os.strerror(code)))
        assert isinstance(said, SettingError) and "--log-file /var/log/m" in str(said), code
    for code in (errno.ENOENT, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
        said = log_file_error("/var/log/m", OSError(code, os.strerror(code)))
        assert type(said) is MountError and "--log-file" in str(said) and os.strerror(code) in str(said), code
    assert "\n" not in str(log_file_error("/var/log/m", OSError(errno.EISDIR, "Is a directory")))


def test_a_log_fifo_with_no_reader_or_a_stalled_one_never_blocks_the_daemon(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --log-file that is a FIFO (a log shipper's): with no process reading it, the open waited for one (the mount's
    start-up said only "did not answer" after STARTUP_TIMEOUT; a reopen blocked the daemon's log call, FUSE requests
    included), and a reader that stopped reading blocked every line's write once the pipe was full. Now the open fails
    at once, said as a FIFO with no reader (status 1: a reader may come), and a line the pipe has no room for is
    dropped and said once, as a full disk's (B190)."""
    import errno
    import os
    import threading

    from fsmount.mount import MountError, SettingError, log_file_error

    fifo = tmp_path / "modelfs.fifo"
    os.mkfifo(fifo)
    opened: list[object] = []

    def open_it() -> None:
        try:
            opened.append(LogFile(str(fifo)))
        except OSError as exc:
            opened.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(5)
    if opener.is_alive():  # the old open, waiting for a reader: give it one, so that the thread ends
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        opener.join(5)
        pytest.fail("the open of a FIFO with no reader waited for one")
    assert isinstance(opened[0], OSError) and opened[0].errno == errno.ENXIO, opened
    said = log_file_error(str(fifo), opened[0])
    assert type(said) is MountError and not isinstance(said, SettingError)
    assert str(said) == f"cannot write the log file {fifo} (--log-file): it is a FIFO that no process reads: start " \
        "its reader first"

    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that reads nothing
    try:
        handler = LogFile(str(fifo))
        written = threading.Thread(target=lambda: [handler.handle(line("x" * 1000)) for _ in range(200)], daemon=True)
        written.start()  # 200 kB: more than a pipe holds (64 kB)
        written.join(10)
        blocked = written.is_alive()
        first = os.read(reader, 1001)
        while written.is_alive():  # the old write, blocked: read the pipe empty until it ends
            with contextlib.suppress(BlockingIOError):
                os.read(reader, 1 << 16)
        assert not blocked, "a write to a FIFO whose reader stopped reading blocked the log call"
        assert first == b"x" * 1000 + b"\n"
        assert capsys.readouterr().err.count("cannot write the log file") == 1
        while True:  # the reader catches up: lines are written again
            try:
                os.read(reader, 1 << 16)
            except BlockingIOError:
                break
        handler.handle(line("again"))
        assert os.read(reader, 1 << 16).endswith(b"again\n")
        handler.close()
    finally:
        os.close(reader)


def test_the_signal_s_line_says_a_failed_reopen_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """SIGHUP's (and SIGUSR1's) line said "the log file reopened if it was moved" when the reopen had failed (its
    directory removed), the failure said on stderr alone (B338)."""
    import fsmount.mount

    logs = tmp_path / "logs"
    logs.mkdir()
    handler = LogFile(str(logs / "modelfs.log"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    try:
        assert fsmount.mount.reopen_log_file() == ", the log file reopened if it was moved"
        shutil.rmtree(logs)
        assert fsmount.mount.reopen_log_file() == (f", the log file {logs}/modelfs.log could not be reopened (No such "
                                                   "file or directory): its lines are dropped until it can be")
        assert capsys.readouterr().err.count("cannot write the log file") == 1
        logs.mkdir()
        assert fsmount.mount.reopen_log_file() == ", the log file reopened if it was moved"
        monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
        assert fsmount.mount.reopen_log_file() == ""  # no log file: the line names none
    finally:
        handler.close()


def test_each_signal_whose_reopen_fails_says_so_on_stderr(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """With --log-file the log file is the daemon's only handler: the signal's line saying the reopen failed (B338)
    goes to the file that failed, and is dropped. stderr (the journal) said the failure once an episode, so a second
    `systemctl reload` while the log's directory was still gone said nothing anywhere (B345). Each such signal now
    says it; the lines logged meanwhile still say nothing more."""
    import fsmount.mount

    logs = tmp_path / "logs"
    logs.mkdir()
    handler = LogFile(str(logs / "modelfs.log"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    try:
        shutil.rmtree(logs)
        for _ in range(2):
            said = fsmount.mount.reopen_log_file()
            logging.getLogger("fsmount.mount").warning("received SIGHUP: still mounted%s", said)  # dropped
            handler.handle(line("dropped"))
        assert capsys.readouterr().err.count(f"cannot write the log file {logs}/modelfs.log") == 2
        logs.mkdir()
        assert fsmount.mount.reopen_log_file() == ", the log file reopened if it was moved"
        assert capsys.readouterr().err == ""
    finally:
        handler.close()


STDERR_PIPE_CHILD = """
import logging, sys
from fsmount.mount import setup_logging
setup_logging("info")
for i in range(300):
    logging.getLogger("t").info("%04d %s", i, "x" * 1000)
print("logged", flush=True)
sys.stdin.readline()
logging.getLogger("t").warning("after")
print("done", flush=True)
"""


def test_a_stderr_pipe_nobody_reads_drops_lines_and_never_blocks_the_daemon() -> None:
    """`modelfs mount --foreground` as a container's main process: its stderr is the runtime's log pipe, read when the
    collector gets to it. The daemon's log call wrote it blocking: once 64 kB waited in the pipe, the next line held
    the trio loop, and every FUSE request and `modelfs stats` with it, until the pipe was read (B900). Now a line the
    pipe has no room for is dropped, and the next line that fits says how many were."""
    import os
    import re
    import select
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", STDERR_PIPE_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    err = b""

    def drain() -> None:
        nonlocal err
        os.set_blocking(child.stderr.fileno(), False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(child.stderr.fileno(), 1 << 16):
                err += chunk

    try:
        logged = bool(select.select([child.stdout], [], [], 20)[0]) and child.stdout.readline() == b"logged\n"
        drain()  # the old handler, blocked: this lets it go on
        assert logged, "a log line into a full stderr pipe blocked the log call"
        child.stdin.write(b"\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"done\n"
        assert child.wait(20) == 0
        drain()
    finally:
        if child.poll() is None:
            child.kill()
            drain()
            child.wait()
    written = re.findall(rb" t: (\d{4}) x+\n", err)
    assert written == [b"%04d" % i for i in range(len(written))]  # whole lines, in order, from the first
    said = re.search(rb"modelfs: (\d+) log line\(s\) dropped: stderr \(a pipe\) was full\n[^\n]* WARNING t: after\n$",
                     err)
    assert said, err[-300:]
    assert len(written) + int(said.group(1)) == 300


def test_stderr_that_is_a_file_or_closed_keeps_the_stream_handler(tmp_path: Path) -> None:
    """Only a pipe gets a descriptor of its own: a file opened again through /proc would be written from its start."""
    import os
    import subprocess
    import sys

    out = tmp_path / "stderr.txt"
    out.write_text("before\n")
    code = ("import logging; from fsmount.mount import setup_logging, PipeStderr; setup_logging('info'); "
            "h = logging.getLogger().handlers[0]; assert not isinstance(h, PipeStderr), h; "
            "logging.getLogger('t').info('line')")
    with open(out, "a") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.read_text().startswith("before\n") and out.read_text().endswith(" INFO t: line\n")


FULL_STDERR_CHILD = """
import errno, logging, os, sys, warnings
from fsmount.mount import setup_logging
setup_logging("info", {log_file!r})
fd = os.open("/proc/self/fd/2", os.O_WRONLY | os.O_NONBLOCK)  # fill the pipe: its reader is behind
try:
    while True:
        os.write(fd, b"x" * 4096)
except BlockingIOError:
    pass
{action}
print("said", flush=True)
"""


@pytest.mark.parametrize("action", ["warning", "log file failing"])
def test_what_the_daemon_says_on_stderr_beside_its_log_never_waits_for_a_full_pipe(tmp_path: Path,
                                                                                  action: str) -> None:
    """B900 made the daemon's log lines drop what a full stderr pipe has no room for; two other things it writes on
    stderr still blocked there, and with them the trio loop (every FUSE request, `modelfs stats`) until the pipe was
    read: a Python warning (warnings.showwarning writes sys.stderr), and the line saying that --log-file cannot be
    written (`LogFile._say_failure`: its directory removed, its disk full). Now each is written as PipeStderr writes,
    dropped where the pipe has no room."""
    import os
    import select
    import subprocess
    import sys

    logs = tmp_path / "logs"
    logs.mkdir()
    code = ('warnings.warn("a stray warning", UserWarning)' if action == "warning" else
            f'import shutil; shutil.rmtree({str(logs)!r}); logging.getLogger("t").warning("dropped")')
    log_file = None if action == "warning" else str(logs / "modelfs.log")  # (a warning: PipeStderr's lines beside)
    child = subprocess.Popen([sys.executable, "-c", FULL_STDERR_CHILD.format(log_file=log_file, action=code)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        said = bool(select.select([child.stdout], [], [], 20)[0]) and child.stdout.readline() == b"said\n"
        os.set_blocking(child.stderr.fileno(), False)
        with contextlib.suppress(BlockingIOError):
            while os.read(child.stderr.fileno(), 1 << 16):  # the old code, blocked: this lets it go on
                pass
        assert said, f"a {action} into a full stderr pipe blocked the daemon"
        assert child.wait(20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
