"""A `--writable --allow-overwrite --allow-delete` mount used as a POSIX directory (checkpoint scripts, shell tools,
Python `os`/`shutil`), compared with a local directory: the same steps, one after the other, against both; after
each, the same result (a value or an errno) and the same tree (names, kinds, files' sizes and link counts), and on
the mount a file's mtime that never steps back. What the mount documents it does not do (README "Writing
checkpoints": sequential writes only, no links or FIFOs, no truncate of a stored file, no rename of a non-empty
directory, one writer per file, no old version left to a reader of a file unlinked or replaced) is listed in DIVERGES
with both answers, and undone on the local side where it changed something there.

Then what a local directory does where another writer fills a name after this mount found it free (the kernel's
CREATE, mkdir, `mv -n`), a file's mtime once the bucket is asked again, and readers across renames."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsmount.testing.fault_proxy import FaultProxy
from tests.helpers import (
    MiB,
    S3Server,
    delete_bucket,
    drop_kernel_caches,
    mounted,
    mounted_via,
    new_bucket,
    put_objects,
    random_bytes,
    sha,
    wait_for,
)

TTL_S = 1.0
AT_FDCWD = -100
RENAME_NOREPLACE = 1
FLAGS = ("--writable", "--allow-overwrite", "--allow-delete", "--metadata-ttl", f"{TTL_S:g}")
# The warnings the documented refusals log.
REFUSALS = (r"only sequential writes are supported", r"only whole rewrites", r"is not renamed \(EXDEV\)",
            r"a truncate of a stored file",
            r"not stored",
            r"fetching chunk \d+ of 'd/big2?' failed", r"read failed: GET 'd/big2?'")

Outcome = tuple[str, Any]


def outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno, exc.errno))


def closed_after(fd: int, work: Callable[[int], Any]) -> None:
    """`work(fd)`, then close; the first error of the two (a close reports what the writes could not store)."""
    failed: OSError | None = None
    try:
        work(fd)
    except OSError as exc:
        failed = exc
    try:
        os.close(fd)
    except OSError as exc:
        failed = failed or exc
    if failed is not None:
        raise failed


def write_file(path: Path, data: bytes, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """open, write, close; the first error of the three."""
    closed_after(os.open(path, flags, 0o644), lambda fd: os.write(fd, data) if data else None)
    return len(data)


def open_close(path: Path, flags: int) -> bool:
    os.close(os.open(path, flags, 0o644))
    return True


def written_while_open(path: Path, then: Callable[[], Any], *, fsync: bool = False) -> int:
    """A file written, `then` done while it is open, then closed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"open")
        then()
        if fsync:
            os.fsync(fd)
        os.write(fd, b" still")
    finally:
        os.close(fd)
    return 10


def fsynced(path: Path, flags: int) -> bool:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def read_across(path: Path, change: Callable[[], Any]) -> str:
    """A reader that has begun a file, while `change` is done to its name: what it reads on, as a digest."""
    with open(path, "rb", buffering=0) as f:
        first = f.read(4096)
        change()
        rest = f.read()
    return sha(first + rest)


def atomic_write(directory: Path, name: str, data: bytes) -> bytes:
    """The atomic-write idiom: a temporary file beside the target, fsynced, renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp")
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / name)
    return (directory / name).read_bytes()


def seek_back(path: Path) -> int:
    """A writer that patches what it wrote (zipfile, np.savez)."""
    def patched(fd: int) -> None:
        os.write(fd, b"header and body")
        os.pwrite(fd, b"H", 0)

    closed_after(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), patched)
    return 0


def extended(path: Path) -> bytes:
    """What safetensors' save_file does: a new file extended by ftruncate before its first write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, 10)
        os.write(fd, b"abc")
    finally:
        os.close(fd)
    return path.read_bytes()


def makedirs_racing(path: Path) -> list[Outcome]:
    """`mkdir -p` of one path from 4 threads at once: each succeeds."""
    results: list[Outcome] = []
    start = threading.Barrier(4)

    def one() -> None:
        start.wait()
        results.append(outcome(lambda: os.makedirs(path, exist_ok=True)))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def same_dir(a: Path, b: Path) -> bool:
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


BIG = random_bytes(20 * MiB, 1)
LONG = "n" * 256
LONGEST = "m" * 255
Step = tuple[str, Callable[[Path], Any]]

STEPS: list[Step] = [
    ("mkdir", lambda r: os.mkdir(r / "d")),
    ("mkdir existing", lambda r: os.mkdir(r / "d")),
    ("makedirs -p", lambda r: os.makedirs(r / "d/a/b", exist_ok=True)),
    ("makedirs existing", lambda r: os.makedirs(r / "d/a/b")),
    ("makedirs racing", lambda r: makedirs_racing(r / "p/q/r")),
    ("write", lambda r: write_file(r / "d/f", b"hello")),
    ("read", lambda r: (r / "d/f").read_bytes()),
    ("O_EXCL existing", lambda r: open_close(r / "d/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
    ("O_EXCL new", lambda r: write_file(r / "d/x", b"excl", os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
    ("rmdir non-empty", lambda r: os.rmdir(r / "d")),
    ("unlink dir", lambda r: os.unlink(r / "d")),
    ("rmdir file", lambda r: os.rmdir(r / "d/f")),
    ("create under file", lambda r: open_close(r / "d/f/x", os.O_WRONLY | os.O_CREAT)),
    ("stat file/", lambda r: os.stat(str(r / "d/f") + "/").st_size),
    ("stat dir/", lambda r: stat.S_ISDIR(os.stat(str(r / "d/a") + "/").st_mode)),
    ("..", lambda r: same_dir(r / "d/a/b/..", r / "d/a")),
    ("listdir ..", lambda r: sorted(os.listdir(r / "d/a/.."))),
    ("create in missing dir", lambda r: open_close(r / "d/missing/x", os.O_WRONLY | os.O_CREAT)),
    ("unlink missing", lambda r: os.unlink(r / "d/missing")),
    ("rename missing", lambda r: os.rename(r / "d/missing", r / "d/y")),
    ("rename into missing dir", lambda r: os.rename(r / "d/x", r / "d/missing/x")),
    ("mkdir on file", lambda r: os.mkdir(r / "d/f")),
    ("create on dir", lambda r: open_close(r / "d/a", os.O_WRONLY | os.O_CREAT)),
    ("open dir to write", lambda r: open_close(r / "d/a", os.O_WRONLY)),
    ("rename file", lambda r: os.rename(r / "d/f", r / "d/g")),
    ("write another", lambda r: write_file(r / "d/h", b"world!")),
    ("rename onto file", lambda r: os.rename(r / "d/g", r / "d/h")),
    ("rename to itself", lambda r: os.rename(r / "d/h", r / "d/../d/h")),
    ("rename file onto dir", lambda r: os.rename(r / "d/h", r / "d/a")),
    ("rename dir onto file", lambda r: os.rename(r / "d/a/b", r / "d/h")),
    ("mkdir e1", lambda r: os.mkdir(r / "d/e1")),
    ("mkdir e2", lambda r: os.mkdir(r / "d/e2")),
    ("rename empty dir onto empty dir", lambda r: os.rename(r / "d/e1", r / "d/e2")),
    ("rename empty dir across dirs", lambda r: os.rename(r / "d/e2", r / "p/e3")),
    ("mkdir e4", lambda r: os.mkdir(r / "d/e4")),
    ("rename empty dir onto empty dir across dirs", lambda r: os.rename(r / "p/e3", r / "d/e4")),
    ("rename empty dir onto itself", lambda r: os.rename(r / "d/e4", r / "d/e4/")),
    ("rename empty dir onto non-empty dir", lambda r: os.rename(r / "d/e4", r / "d/a")),
    ("rename dir into itself", lambda r: os.rename(r / "d/a", r / "d/a/b/c")),
    ("rename dir onto its ancestor", lambda r: os.rename(r / "d/a/b", r / "d")),
    ("rename non-empty dir", lambda r: os.rename(r / "d/a", r / "d/a2")),
    ("rename file across dirs", lambda r: os.replace(r / "d/h", r / "p/h")),
    ("O_TRUNC rewrite", lambda r: write_file(r / "p/h", b"rewritten")),
    ("read rewrite", lambda r: (r / "p/h").read_bytes()),
    ("append open", lambda r: open_close(r / "p/h", os.O_WRONLY | os.O_APPEND)),
    ("O_RDWR open", lambda r: open_close(r / "p/h", os.O_RDWR)),
    ("truncate same size", lambda r: os.truncate(r / "p/h", 9)),
    ("truncate shorter", lambda r: os.truncate(r / "p/h", 2)),
    ("utime", lambda r: os.utime(r / "p/h", (1, 1))),
    ("chmod", lambda r: os.chmod(r / "p/h", 0o600)),
    ("access W_OK", lambda r: os.access(r / "p/h", os.W_OK)),
    ("symlink", lambda r: os.symlink("h", r / "p/s")),
    ("link", lambda r: os.link(r / "p/h", r / "p/l")),
    ("create long name", lambda r: open_close(r / "d" / LONG, os.O_WRONLY | os.O_CREAT)),
    ("mkdir long name", lambda r: os.mkdir(r / "d" / LONG)),
    ("rename to long name", lambda r: os.rename(r / "p/h", r / "p" / LONG)),
    ("create longest name", lambda r: write_file(r / "d" / LONGEST, b"255")),
    ("create empty", lambda r: open_close(r / "d/empty", os.O_WRONLY | os.O_CREAT)),
    ("touch empty", lambda r: open_close(r / "d/empty", os.O_WRONLY | os.O_CREAT)),
    ("mknod regular", lambda r: os.mknod(r / "d/node", stat.S_IFREG | 0o644)),
    ("mknod existing", lambda r: os.mknod(r / "d/node", stat.S_IFREG | 0o644)),
    ("mknod on dir", lambda r: os.mknod(r / "d/a", stat.S_IFREG | 0o644)),
    ("mknod no type", lambda r: os.mknod(r / "d/node0")),
    ("read mknod", lambda r: (r / "d/node").read_bytes()),
    ("ftruncate extends new", lambda r: extended(r / "d/sparse")),
    ("seek back", lambda r: seek_back(r / "d/patched")),
    ("unlink while written", lambda r: written_while_open(r / "d/tmp", lambda: os.unlink(r / "d/tmp"))),
    ("rename while written", lambda r: written_while_open(r / "d/w.tmp", lambda: os.rename(r / "d/w.tmp", r / "d/w"))),
    ("read renamed", lambda r: (r / "d/w").read_bytes()),
    ("rename onto a file being written",
     lambda r: written_while_open(r / "d/busy", lambda: os.rename(r / "d/w", r / "d/busy")) and None),
    ("rmdir .", lambda r: os.rmdir(r / "d/a/b/.")),
    ("fsync dir", lambda r: fsynced(r / "d", os.O_RDONLY | os.O_DIRECTORY)),
    ("fsync stored file", lambda r: fsynced(r / "d/w", os.O_RDONLY)),
    ("fsync new file", lambda r: written_while_open(r / "d/synced", lambda: None, fsync=True)),
    ("statvfs namemax", lambda r: os.statvfs(r).f_namemax),
    ("access X_OK", lambda r: os.access(r / "d/w", os.X_OK)),
    ("access R_OK", lambda r: os.access(r / "d/w", os.R_OK)),
    ("mkdir trailing /", lambda r: os.mkdir(str(r / "d/t") + "/")),
    ("rmdir trailing /", lambda r: os.rmdir(str(r / "d/t") + "/")),
    ("unlink trailing /", lambda r: os.unlink(str(r / "d/w") + "/")),
    ("rename file to trailing /", lambda r: os.rename(r / "d/w", str(r / "d/w2") + "/")),
    ("create O_RDONLY", lambda r: open_close(r / "d/ro", os.O_RDONLY | os.O_CREAT)),
    ("mkfifo", lambda r: os.mkfifo(r / "d/fifo")),
    ("read across a rename", lambda r: read_across(r / "d/w", lambda: os.rename(r / "d/w", r / "d/w3"))),
    ("read across an unlink", lambda r: read_across(r / "d/w3", lambda: os.unlink(r / "d/w3"))),
    ("write big", lambda r: write_file(r / "d/big", BIG)),
    ("read big across a rename", lambda r: read_across(r / "d/big", lambda: os.rename(r / "d/big", r / "d/big2"))),
    ("read big across a replace",
     lambda r: read_across(r / "d/big2", lambda: os.replace(r / "d/synced", r / "d/big2"))),
    ("write big again", lambda r: write_file(r / "d/big", BIG)),
    ("read big across an unlink", lambda r: read_across(r / "d/big", lambda: os.unlink(r / "d/big"))),
    ("mkstemp and replace", lambda r: atomic_write(r / "d", "state.json", b'{"step": 1}')),
    ("mkstemp and replace again", lambda r: atomic_write(r / "d", "state.json", b'{"step": 2}')),
    ("read replaced", lambda r: (r / "d/state.json").read_bytes()),
    ("copytree", lambda r: shutil.copytree(r / "d/a", r / "tree") and None),
    ("copy2", lambda r: shutil.copy2(r / "d/state.json", r / "tree/state.json") and None),
    ("move dir", lambda r: shutil.move(r / "tree", r / "moved") and None),
    ("move file", lambda r: shutil.move(r / "moved/state.json", r / "moved/b/state.json") and None),
    ("mkdtemp and rmtree", lambda r: shutil.rmtree(tempfile.mkdtemp(dir=r / "moved"))),
    ("unlink", lambda r: os.unlink(r / "d/empty")),
    ("rmdir leaf", lambda r: os.rmdir(r / "d/a/b")),
    ("rmdir", lambda r: os.rmdir(r / "d/a")),
    ("rmtree", lambda r: shutil.rmtree(r / "d")),
    ("a TTL later", lambda r: time.sleep(TTL_S + 0.3)),
    ("rmtree all", lambda r: [shutil.rmtree(r / n) for n in sorted(os.listdir(r))]),
]

ERR = "err"
NOTSUP = errno.errorcode[errno.EOPNOTSUPP]  # ENOTSUP, the same number on Linux
# step: (the local answer, the mount's, what undoes the local change so that the trees stay comparable).
DIVERGES: dict[str, tuple[Outcome, Outcome, Callable[[Path], Any] | None]] = {
    "rename non-empty dir": (("ok", None), (ERR, "EXDEV"), lambda r: os.rename(r / "d/a2", r / "d/a")),
    "append open": (("ok", True), (ERR, NOTSUP), None),
    "O_RDWR open": (("ok", True), (ERR, NOTSUP), None),
    "truncate shorter": (("ok", None), (ERR, NOTSUP), lambda r: write_file(r / "p/h", b"rewritten")),
    "symlink": (("ok", None), (ERR, "EPERM"), lambda r: os.unlink(r / "p/s")),
    "link": (("ok", None), (ERR, "EPERM"), lambda r: os.unlink(r / "p/l")),
    # (the writer's close then stores what it wrote before the refused rename)
    "rename onto a file being written": (
        ("ok", None), (ERR, "EBUSY"),
        lambda r: os.rename(r / "d/busy", r / "d/w") or write_file(r / "d/busy", b"open")),
    "mkfifo": (("ok", None), (ERR, "EPERM"), lambda r: os.unlink(r / "d/fifo")),
    # The object a reader has begun goes from the bucket: what was fetched ahead of it is read, then EIO (S3 keeps no
    # old version to read); never other bytes.
    "read big across a replace": (("ok", sha(BIG)), (ERR, "EIO"), None),
    "read big across an unlink": (("ok", sha(BIG)), (ERR, "EIO"), None),
    "seek back": (("ok", 0), (ERR, "EINVAL"), lambda r: os.unlink(r / "d/patched")),
}

EXACT_OR_EIO = ("read big across a replace", "read big across an unlink")


def tree(root: Path) -> list[tuple[Any, ...]]:
    """Every name under `root` by walking it (listings, then an lstat of each): a directory's kind, a file's kind,
    size and link count (a directory's link count is not promised)."""
    out: list[tuple[Any, ...]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames:
            out.append((os.path.join(rel, name), "dir"))
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out.append((os.path.join(rel, name), stat.S_IFMT(st.st_mode), st.st_size, st.st_nlink))
    return sorted(out)


def mtimes(root: Path) -> dict[tuple[int, int], int]:
    return {(st.st_ino, st.st_size): st.st_mtime_ns
            for dirpath, _, filenames in os.walk(root) for name in filenames
            if (st := os.lstat(os.path.join(dirpath, name)))}


@pytest.mark.parametrize("cache", [False, True], ids=["", "cache-dir"])
def test_the_mount_answers_as_a_local_directory(s3: S3Server, mountpoint: Path, tmp_path: Path, cache: bool) -> None:
    """With --cache-dir too: files then go through local copies (write_staging), and one extended by ftruncate
    before its first write is uploaded at its close."""
    local = tmp_path / "local"
    local.mkdir()
    bucket = new_bucket(s3)
    seen: dict[tuple[int, int], int] = {}
    cache_dir = ("--cache-dir", str(tmp_path / "cache")) if cache else ()
    with mounted(s3, bucket, mountpoint, *FLAGS, *cache_dir, allowed=REFUSALS):
        for name, step in STEPS:
            here, there = outcome(lambda: step(local)), outcome(lambda: step(mountpoint))  # noqa: B023
            if name in DIVERGES:
                want_here, want_there, undo = DIVERGES[name]
                assert here == want_here, name
                assert there == want_there or (there == here and name in EXACT_OR_EIO), name
                if undo is not None:
                    undo(local)
            else:
                assert there == here, name
            assert tree(mountpoint) == tree(local), name
            # An inode of a file is one version: its mtime never goes back (the close time, then Last-Modified).
            for version, mtime in mtimes(mountpoint).items():
                assert mtime >= seen.get(version, 0), (name, version)
                seen[version] = mtime
    delete_bucket(s3, bucket)


def test_a_file_another_writer_stored_after_this_mount_found_the_name_free_opens_as_it_is(
        s3: S3Server, mountpoint: Path) -> None:
    """The kernel sends CREATE for a name the mount said was missing; another writer stored a file there since. A
    lock file's second `open(O_CREAT|O_WRONLY)` was EPERM, where opening the stored (empty) file is a touch; an
    O_EXCL create was EPERM, where a lock taker waits on EEXIST."""
    bucket = new_bucket(s3)
    names = ("lock", "excl", "full", "lock2", "node")
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", "60",
                 allowed=(r"needs --allow-overwrite",)):
        for name in names:
            assert not (mountpoint / name).exists()
        put_objects(s3, bucket, {"lock": b"", "excl": b"", "full": b"theirs", "node": b"theirs"})
        fd = os.open(mountpoint / "lock", os.O_WRONLY | os.O_CREAT)
        try:
            assert os.fstat(fd).st_size == 0
            with pytest.raises(OSError) as info:
                os.write(fd, b"x")  # a touch, as for an open of the known empty file
            assert info.value.errno == errno.EPERM
        finally:
            os.close(fd)
        with pytest.raises(OSError) as info:
            os.open(mountpoint / "excl", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        assert info.value.errno == errno.EEXIST
        with pytest.raises(OSError) as info:
            os.open(mountpoint / "full", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        assert info.value.errno == errno.EPERM  # replacing bytes still needs the flag
        assert (mountpoint / "full").read_bytes() == b"theirs"
        with pytest.raises(OSError) as info:
            os.mknod(mountpoint / "node", stat.S_IFREG | 0o644)  # as an O_EXCL create
        assert info.value.errno == errno.EEXIST
        put_objects(s3, bucket, {"lock2": b"flock"})
        fd = os.open(mountpoint / "lock2", os.O_RDONLY | os.O_CREAT)  # `flock(1)` of a lock file with bytes in it
        try:
            assert os.read(fd, 100) == b"flock"
        finally:
            os.close(fd)
    for key in ("full", "node"):
        assert s3.client().get_object(Bucket=bucket, Key=key)["Body"].read() == b"theirs"
    delete_bucket(s3, bucket)


def test_an_append_to_a_file_another_writer_stored_after_this_mount_found_the_name_free_keeps_its_bytes(
        s3: S3Server, mountpoint: Path) -> None:
    """With --allow-overwrite a create replaces what is there without asking, but one that does not truncate
    (`open(p, "a")`, a logger's) replaced another writer's object with only what it appended."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--allow-overwrite", "--metadata-ttl", "60",
                 allowed=(r"only whole rewrites",)):
        assert not (mountpoint / "log").exists()
        put_objects(s3, bucket, {"log": b"line 1\n"})
        with pytest.raises(OSError) as info:
            open(mountpoint / "log", "a")
        assert info.value.errno == errno.EOPNOTSUPP  # as for an append to the known file
        with open(mountpoint / "log") as f:
            assert f.read() == "line 1\n"
    assert s3.client().get_object(Bucket=bucket, Key="log")["Body"].read() == b"line 1\n"
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("forget", [False, True], ids=["", "forgotten"])
def test_a_file_just_written_keeps_its_mtime_once_the_bucket_is_asked_again(s3: S3Server, mountpoint: Path,
                                                                            forget: bool) -> None:
    """After close a file showed its close time; once the TTL had passed and the bucket was asked again, its
    Last-Modified (whole seconds; a multipart upload's start), earlier: the mtime stepped back, and `make` or
    `rsync` took a file just written for an older one; and so once the kernel had forgotten its inode, which the
    daemon then makes again from what the bucket says."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", f"{TTL_S:g}"):
        path = mountpoint / "out.bin"
        path.write_bytes(b"x" * 1000)
        closed = os.stat(path)
        if forget:
            drop_kernel_caches(2)  # the kernel forgets the inode (FORGET): the daemon drops its node
        time.sleep(TTL_S + 0.2)  # the TTL passes: the stat below asks the bucket again (a HEAD), the scandir lists
        again = os.stat(path)
        listed = next(e for e in os.scandir(mountpoint) if e.name == "out.bin").stat()
        assert again.st_mtime_ns >= closed.st_mtime_ns
        assert listed.st_mtime_ns >= closed.st_mtime_ns
    delete_bucket(s3, bucket)


def touched(path: Path) -> None:
    """`touch -d`: a new empty file, its times set by path, closed (stored at RELEASE, after close returned)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644))
    os.utime(path, (978307200, 978307200))


def written_with_futime(path: Path) -> None:
    """A writer that sets its file's times through its descriptor before closing it (stored at that close)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"x" * 1000)
        os.utime(fd, (5, 5))
        os.fstat(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("make", [touched, written_with_futime], ids=["touch -d", "futime"])
def test_the_mtime_a_new_file_shows_after_its_close_stays_after_a_utime(s3: S3Server, mountpoint: Path,
                                                                        make: Callable[[Path], None]) -> None:
    """Times set by `utime` are not kept (a bucket keeps none), and a stat after it shows the file's own time. After
    a utime of a file being written (`touch -d` of a new name, a writer's `futime`), the kernel kept the attributes
    its SETATTR answered, the time the file was created, until the TTL passed: then the stored version's time. A
    file's mtime changed a TTL after its close with nothing done to it (`make`, `rsync -t` saw it change)."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", f"{TTL_S:g}"):
        path = mountpoint / "f"
        make(path)
        closed = os.stat(path)
        os.utime(path, (1, 1))  # of the stored file: accepted, and it shows its own time still
        assert os.stat(path).st_mtime_ns == closed.st_mtime_ns
        time.sleep(TTL_S + 0.3)
        assert os.stat(path).st_mtime_ns == closed.st_mtime_ns
    delete_bucket(s3, bucket)


def assert_held_empty(path: Path) -> None:
    """A new file still held open, empty: its stat says so, and an open for reading is EBUSY until it is stored."""
    assert os.stat(path).st_size == 0
    with pytest.raises(OSError) as info:
        os.open(path, os.O_RDONLY)
    assert info.value.errno == errno.EBUSY


def test_an_empty_file_held_by_another_descriptor_is_not_waited_for_at_each_stat(s3: S3Server,
                                                                                 mountpoint: Path) -> None:
    """`exec 9>lock`: the file is opened, dup'ed, and the first descriptor closed, empty. A stat or open waited (up
    to a second) for the RELEASE that would store it; none comes while the other descriptor is held, and each `ls -l`
    of the lock file took that second (the opener still holding it, none waits at all: B92)."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", f"{TTL_S:g}"):
        path = mountpoint / "lock"
        first = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        held = os.dup(first)
        os.close(first)
        try:
            os.stat(path)  # waits at most once
            started = time.monotonic()
            for _ in range(3):
                assert_held_empty(path)
            assert time.monotonic() - started < 1.0
        finally:
            os.close(held)
        assert os.stat(path).st_size == 0
    assert s3.client().get_object(Bucket=bucket, Key="lock")["Body"].read() == b""
    delete_bucket(s3, bucket)


def test_an_empty_file_a_script_holds_is_not_waited_for_after_each_of_its_commands(s3: S3Server,
                                                                                  mountpoint: Path) -> None:
    """`exec 9>lock; flock 9; cmd; ls -l lock; cmd; ...`: each command the script runs inherits the descriptor, and
    its exit closes that copy (a FLUSH of the empty file). A stat or open after it waited a second for a RELEASE that
    no close brings while the script holds the file: each `ls -l` of the lock file took a second, where a local
    disk's took none."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", f"{TTL_S:g}"):
        path = mountpoint / "lock"
        held = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(3):
                subprocess.run(["true"], pass_fds=(held,), check=True)
                started = time.monotonic()
                assert_held_empty(path)
                assert time.monotonic() - started < 0.5
        finally:
            os.close(held)
        assert os.stat(path).st_size == 0
        assert (mountpoint / "lock").read_bytes() == b""  # the last close's RELEASE stored it, waited for
    assert s3.client().get_object(Bucket=bucket, Key="lock")["Body"].read() == b""
    delete_bucket(s3, bucket)


def test_a_reader_follows_a_file_renamed_through_the_mount(s3: S3Server, mountpoint: Path) -> None:
    """A rename through the mount copies the object to its new key and deletes the old one. A descriptor opened
    before kept reading the old key: what it had not read yet was EIO (404), where a local file's descriptor reads on,
    whatever its name. It follows the object now, with the same ETag (CopyObject) too."""
    bucket = new_bucket(s3)
    data = random_bytes(24 * MiB, 2)
    # One PUT (a part size above the file's), so that the copy's ETag is the same on moto as on SeaweedFS.
    with mounted(s3, bucket, mountpoint, "--writable", "--allow-overwrite", "--metadata-ttl", "60",
                 "--write-part-size", "32M"):
        (mountpoint / "ckpt.pt").write_bytes(data)
        fd = os.open(mountpoint / "ckpt.pt", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: the reader has fetched one chunk
            assert os.pread(fd, 4096, 0) == data[:4096]
            os.rename(mountpoint / "ckpt.pt", mountpoint / "ckpt-old.pt")
            assert os.pread(fd, MiB, 20 * MiB) == data[20 * MiB:21 * MiB]
        finally:
            os.close(fd)
        assert (mountpoint / "ckpt-old.pt").read_bytes() == data
    delete_bucket(s3, bucket)


def renameat2(old: Path, new: Path, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, bytes(old), AT_FDCWD, bytes(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(new))


def test_a_rename_noreplace_leaves_a_file_another_writer_stored_after_this_mount_found_the_name_free(
        s3: S3Server, mountpoint: Path) -> None:
    """`mv -n` (renameat2 RENAME_NOREPLACE) onto a name the mount said was free, where another writer has stored a
    file or made a directory since: with --allow-overwrite the rename replaced their object (it asked the bucket only
    for the other kind). It is EEXIST, and nothing changes, as on a local disk."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--allow-overwrite", "--allow-delete", "--metadata-ttl", "60"):
        (mountpoint / "mine").write_bytes(b"mine")
        os.mkdir(mountpoint / "empty")
        for name in ("theirs", "their-dir"):
            assert not (mountpoint / name).exists()
        put_objects(s3, bucket, {"theirs": b"theirs", "their-dir/x": b"x"})
        for old, new in (("mine", "theirs"), ("mine", "their-dir"), ("empty", "theirs"), ("empty", "their-dir")):
            with pytest.raises(OSError) as info:
                renameat2(mountpoint / old, mountpoint / new, RENAME_NOREPLACE)
            assert info.value.errno == errno.EEXIST, (old, new)
        renameat2(mountpoint / "mine", mountpoint / "free", RENAME_NOREPLACE)
        assert sorted(os.listdir(mountpoint)) == ["empty", "free", "their-dir", "theirs"]
        assert (mountpoint / "theirs").read_bytes() == b"theirs"
    assert s3.client().get_object(Bucket=bucket, Key="theirs")["Body"].read() == b"theirs"
    delete_bucket(s3, bucket)


def test_a_mkdir_where_another_writer_made_a_directory_since_this_mount_found_the_name_free_is_eexist(
        s3: S3Server, mountpoint: Path) -> None:
    """`mkdir lock` taken as a lock by two nodes: the second mount, whose answer said the name was free, put the
    marker again and returned 0, so both held the lock. It is EEXIST, as on a local disk; `makedirs(exist_ok=True)`
    still succeeds, and the directory is shown as it is."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", "60"):
        for name in ("lock", "run"):
            assert not (mountpoint / name).exists()
        put_objects(s3, bucket, {"lock/": b"", "run/rank0.pt": b"theirs"})
        with pytest.raises(OSError) as info:
            os.mkdir(mountpoint / "lock")
        assert info.value.errno == errno.EEXIST
        os.makedirs(mountpoint / "run", exist_ok=True)
        assert os.listdir(mountpoint / "run") == ["rank0.pt"]
        assert sorted(os.listdir(mountpoint)) == ["lock", "run"]
    assert sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]) == ["lock/", "run/rank0.pt"]
    delete_bucket(s3, bucket)


def test_a_read_whose_get_reaches_the_old_key_after_a_rename_follows_the_file(moto_server: S3Server, proxy: FaultProxy,
                                                                               mountpoint: Path) -> None:
    """A READ's GET queued for the old key (behind others; here held by the proxy) reaches the bucket after a rename
    through the mount deleted that key: 404, and the reader got EIO, though the file is whole under its new name. The
    READ follows the handle to the new key."""
    bucket = new_bucket(moto_server)
    data = random_bytes(24 * MiB, 3)
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--allow-overwrite", "--metadata-ttl", "60",
                     "--write-part-size", "32M",
                     allowed=(r"fetching chunk 2 of 'ckpt.pt' failed: GET 'ckpt.pt' .*not found",)):
        (mountpoint / "ckpt.pt").write_bytes(data)
        # O_DIRECT: the kernel sends the READ once (a page-cache read tries a failed one again, which hid it).
        fd = os.open(mountpoint / "ckpt.pt", os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, MiB)

        def read_at(offset: int) -> bytes:
            return bytes(buf[:os.preadv(fd, [buf], offset)])

        try:
            assert read_at(0) == data[:MiB]
            held = proxy.inject("latency", seconds=1.5, times=1)  # the next data GET: chunk 2's, below
            got: list[Outcome] = []
            reader = threading.Thread(target=lambda: got.append(outcome(lambda: read_at(20 * MiB))))
            reader.start()
            wait_for("the GET held", lambda: held.hits, timeout=10)
            os.rename(mountpoint / "ckpt.pt", mountpoint / "ckpt-old.pt")  # done before the GET goes on
            reader.join()
            assert got == [("ok", data[20 * MiB:21 * MiB])]
        finally:
            os.close(fd)
    delete_bucket(moto_server, bucket)


def test_a_rename_onto_a_file_another_writer_stored_after_this_mount_found_the_name_free_needs_allow_overwrite(
        s3: S3Server, mountpoint: Path) -> None:
    """Without --allow-overwrite, `os.replace(tmp, final)` onto a name the mount said was free, where another writer
    has stored a file since: the create-only copy found it at its completion and the rename was EIO, which a trainer
    takes for the bucket failing and retries; onto a name the mount knows it is EPERM, and now here too. Nothing
    changes in the bucket either way."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, "--writable", "--metadata-ttl", "60", allowed=(r"needs --allow-overwrite",)):
        (mountpoint / "step.tmp").write_bytes(b"mine")
        assert not (mountpoint / "step.pt").exists()
        put_objects(s3, bucket, {"step.pt": b"theirs"})
        with pytest.raises(OSError) as info:
            os.replace(mountpoint / "step.tmp", mountpoint / "step.pt")
        assert info.value.errno == errno.EPERM
        assert (mountpoint / "step.pt").read_bytes() == b"theirs"
        assert (mountpoint / "step.tmp").read_bytes() == b"mine"
    client = s3.client()
    assert {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]} == {"step.tmp": 4,
                                                                                              "step.pt": 6}
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    delete_bucket(s3, bucket)
