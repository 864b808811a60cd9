"""holders.py against real processes and descriptors (on a local filesystem: the /proc reading is the same)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fsmount import holders
from tests.helpers import modelfs_env

HOLD = "import sys, time; sys.stdin.read()"  # holds its inherited descriptors until its stdin closes


def test_a_child_holding_the_file_is_found_and_nothing_once_it_exits(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    ino, dev = os.fstat(fd).st_ino, os.fstat(fd).st_dev
    me = os.getpid()
    assert holders.holder(me, dev, ino, path.name) == me  # the opener's own descriptor
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, pass_fds=(fd,))
    try:
        os.close(fd)  # as the opener's close(2): its descriptor is gone before FUSE would send the FLUSH
        assert holders.holder(me, dev, ino, path.name) == child.pid
        assert holders.holder(me, dev, ino + 1, path.name) is None  # another inode of the same name
        assert holders.holder(me, dev, ino, "other.bin") is None
        assert holders.holder(me, dev + 1, ino, path.name) is None  # the same inode number on another mount
        assert holders.holder(me, None, ino, path.name) == child.pid  # before the mount knows its device
    finally:
        child.communicate(b"", timeout=30)
    assert holders.holder(me, dev, ino, path.name) is None


def test_a_descriptor_open_only_for_reading_holds_nothing(tmp_path: Path) -> None:
    """`with open(p, "wb")` over a file the same process still reads: the reader's descriptor (of the version
    being replaced; an O_TRUNC rewrite keeps the inode) counted as a holder, the file was stored only at
    RELEASE, and close(2) returned 0 before anything was stored, whatever the upload did."""
    path = tmp_path / "ckpt.bin"
    path.write_bytes(b"old")
    reader = os.open(path, os.O_RDONLY)
    try:
        ino, dev = os.fstat(reader).st_ino, os.fstat(reader).st_dev
        assert holders.holder(os.getpid(), dev, ino, path.name) is None
        writer = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            assert holders.holder(os.getpid(), dev, ino, path.name) == os.getpid()
        finally:
            os.close(writer)
        both = os.open(path, os.O_RDWR)
        try:
            assert holders.holder(os.getpid(), dev, ino, path.name) == os.getpid()
        finally:
            os.close(both)
    finally:
        os.close(reader)


def test_a_grandchild_is_found_and_a_process_out_of_the_tree_is_not(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    ino, dev = os.fstat(fd).st_ino, os.fstat(fd).st_dev
    # A shell that starts the holder as its own child, then closes its own copy: the opener's grandchild holds it.
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} -c '{HOLD}' <&0 & exec {fd}>&-; wait"],
                             stdin=subprocess.PIPE, pass_fds=(fd,))
    os.close(fd)
    try:
        found = None
        for _ in range(500):  # until the shell has started the holder and closed its copy
            found = holders.holder(os.getpid(), dev, ino, path.name)
            if found is not None and found != shell.pid:
                break
            threading.Event().wait(0.02)
        assert found is not None and found != shell.pid, found
        assert holders.holder(os.getppid(), dev, ino, path.name) == found  # a wider tree finds it too
        assert holders.holder(found, dev, ino, path.name) == found
        assert holders.holder(1 << 30, dev, ino, path.name) is None  # no such process
    finally:
        shell.communicate(b"", timeout=30)


def test_the_process_of_a_thread() -> None:
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(holders.thread_group(threading.get_native_id())))
    t.start()
    t.join()
    assert got == [os.getpid()]
    assert holders.thread_group(0) is None  # a writer outside this daemon's PID namespace
    assert holders.thread_group(1 << 30) is None


ASK_TWICE = """
import logging, sys
from fsmount import holders
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
pid, dev, ino, name = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
print(holders.holder(pid, dev, ino, name), holders.holder(pid, dev, ino, name))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_a_process_the_kernel_will_not_show_counts_as_not_holding_and_is_logged_once(tmp_path: Path) -> None:
    """Without CAP_SYS_PTRACE, a root process with every capability (this test) is not ours to inspect."""
    path = tmp_path / "ckpt.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        st = os.fstat(fd)
        argv = [str(os.getpid()), str(st.st_dev), str(st.st_ino), path.name]
        ask = [shutil.which("setpriv"), "--bounding-set", "-all,+sys_admin,+dac_override", "--",
               sys.executable, "-c", ASK_TWICE, *argv]
        res = subprocess.run(ask, capture_output=True, text=True, timeout=60, env=modelfs_env())
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["None", "None"]
        assert res.stderr.count("WARNING cannot see which files process") == 1, res.stderr
        assert "CAP_SYS_PTRACE" in res.stderr
        # The same question with CAP_SYS_PTRACE finds this process's descriptor, and logs nothing.
        ask[2] = "-all,+sys_admin,+dac_override,+sys_ptrace"
        res = subprocess.run(ask, capture_output=True, text=True, timeout=60, env=modelfs_env())
        assert res.stdout.split() == [str(os.getpid())] * 2 and not res.stderr, res.stdout + res.stderr
    finally:
        os.close(fd)


def test_a_file_named_like_a_deleted_one_is_still_found_held(tmp_path: Path) -> None:
    """A descriptor's path that ends in " (deleted)" is matched with and without it: stripped from every path, the
    name of a live file that ends so no longer matched itself, and a second descriptor of it was missed (the first
    close stored the file cut short; the review)."""
    path = tmp_path / "ckpt (deleted)"
    with open(path, "wb") as f:
        assert holders._holds(os.getpid(), None, os.fstat(f.fileno()).st_ino, "/ckpt (deleted)")
