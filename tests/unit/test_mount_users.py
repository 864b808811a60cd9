"""The busy unmount's scan of /proc (`mount_users.mount_users`) is bounded in time, and a process whose
/proc/PID/maps does not answer (its memory map lock held by a process blocked on a hung mount) cannot hold `modelfs
unmount` (B176). A directory of this test's own file system stands for the mount: `mount_at` is made to name it."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsmount import cli, mount_users
from fsmount.mount_users import MountUsers


def mount_of(path: Path) -> tuple[int, tuple[int, int]]:
    """(mount id, device) of the file system `path` is on, as `mount_users.mount_at` gives a mount's."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        mnt_id = mount_users.fd_mount_id(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)
    st = os.stat(path)
    assert mnt_id is not None
    return mnt_id, (os.major(st.st_dev), os.minor(st.st_dev))


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, subprocess.Popen, subprocess.Popen]]:
    """A "mount" at tmp_path/mnt, a process whose working directory is in it, and another process (the one whose maps
    the tests make stuck)."""
    mp = tmp_path / "mnt"
    (mp / "m").mkdir(parents=True)
    mount = mount_of(mp)
    monkeypatch.setattr(mount_users, "mount_at", lambda mountpoint, mountinfo="": mount if mountpoint == str(mp)
                        else None)
    holder = subprocess.Popen(["sleep", "60"], cwd=mp / "m")
    other = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    try:
        yield str(mp), holder, other
    finally:
        for proc in (holder, other):
            proc.kill()
            proc.wait()


def test_a_process_whose_maps_do_not_answer_holds_the_scan_up_only_briefly(
        held: tuple[str, subprocess.Popen, subprocess.Popen], monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading /proc/PID/maps takes the process's memory map lock; one blocked on a hung mount may keep it (with a
    writer of its own queued behind), and the scan read it with no bound: `modelfs unmount` of a busy mount waited
    as long as the mount hung. Now one process's maps are waited for MAPS_READ_S, the holders found by their working
    directory and descriptors are named still, and the one that did not answer is said."""
    mp, holder, other = held
    real = mount_users.mapped_paths
    release = threading.Event()

    def stuck(maps: str, dev: tuple[int, int]) -> set[str]:
        if maps == f"/proc/{other.pid}/maps":
            release.wait(10)  # the old scan waited this out, then went on
        return real(maps, dev)

    monkeypatch.setattr(mount_users, "mapped_paths", stuck)
    try:
        started = time.monotonic()
        found = mount_users.mount_users(mp)
        took = time.monotonic() - started
    finally:
        release.set()
    assert took < mount_users.MOUNT_USERS_SCAN_S + 0.5, took  # the stuck read costs MAPS_READ_S of it
    assert found.named == [f"sleep (pid {holder.pid}: working directory)"], found
    assert not found.complete and found.unread == [f"sleep (pid {other.pid})"], found
    hint = cli.busy_hint(found, [])
    assert hint == (f" (in use by sleep (pid {holder.pid}: working directory); maybe others: a process has a file in "
                    "it open or mapped, or its working directory there; /proc was not read whole within "
                    f"{mount_users.MOUNT_USERS_SCAN_S:g}s (the memory map of sleep (pid {other.pid}) did not answer: "
                    "perhaps waiting on this mount): stop them, or leave the mount, or use --lazy)"), hint


def test_the_whole_scan_is_bounded_in_time(held: tuple[str, subprocess.Popen, subprocess.Popen],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process slow to read (a loaded host of thousands of processes): the scan ends at MOUNT_USERS_SCAN_S
    with what it found, said as not the whole of it."""
    mp, holder, _ = held
    real = mount_users.mapped_paths
    # Every read together takes 2 s, four times the bound, however many processes this host has (a container's few:
    # a fixed 0.05 s a read was asserted to pass the bound only where there were more than 20).
    per_read = 2.0 / len([e for e in os.listdir("/proc") if e.isdigit()])

    def slow(maps: str, dev: tuple[int, int]) -> set[str]:
        time.sleep(per_read)
        return real(maps, dev)

    monkeypatch.setattr(mount_users, "mapped_paths", slow)
    monkeypatch.setattr(mount_users, "MOUNT_USERS_SCAN_S", 0.5)
    started = time.monotonic()
    found = mount_users.mount_users(mp)
    took = time.monotonic() - started
    assert took < 0.5 + 0.5, took  # the old scan: 2 s
    assert found.named == [f"sleep (pid {holder.pid}: working directory)"] and not found.complete, found
    assert found.unread == [], found
    assert cli.busy_hint(found, [f"{mp}/m (tmpfs)"]).endswith(
        "; /proc was not read whole within 0.5s: stop them, or leave the mount, or unmount it first, or use --lazy)")


def test_a_scan_that_finishes_says_what_it_said_before(held: tuple[str, subprocess.Popen, subprocess.Popen]) -> None:
    mp, holder, _ = held
    found = mount_users.mount_users(mp)
    assert found == MountUsers([f"sleep (pid {holder.pid}: working directory)"], True, [])
    assert cli.busy_hint(found, []) == (f" (in use by sleep (pid {holder.pid}: working directory): stop them, or "
                                        "leave the mount, or use --lazy)")
    assert cli.busy_hint(MountUsers([], True, []), []) == (
        " (in use: a process has a file in it open or mapped, or its working directory there: close them or use "
        "--lazy)")
    assert cli.busy_hint(MountUsers([], False, []), []) == (
        " (in use: a process has a file in it open or mapped, or its working directory there; /proc was not read "
        f"whole within {mount_users.MOUNT_USERS_SCAN_S:g}s: close them or use --lazy)")


def test_a_scan_with_no_thread_to_be_had_still_answers(held: tuple[str, subprocess.Popen, subprocess.Popen],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A pids cgroup at its limit (a trainer's threads filled it) or RLIMIT_NPROC: the maps reader's thread could not
    start, and `modelfs unmount` of a busy mount failed with a RuntimeError's traceback. The maps are read in the
    scan's own thread then, as before B176 (B192)."""
    mp, holder, _ = held

    class NoThread:
        def __init__(self, **_: object) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(mount_users, "threading", types.SimpleNamespace(Thread=NoThread))
    assert mount_users.mount_users(mp) == MountUsers([f"sleep (pid {holder.pid}: working directory)"], True, [])
