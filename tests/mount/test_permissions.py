"""Permissions with --allow-other: --file-mode, --dir-mode, --uid and --gid are enforced for other users.

The mount runs with `default_permissions` (pyfuse3's defaults), so the kernel checks every access
against the mode, uid and gid the daemon reports; `allow_other` lets users other than the mounter in at
all. Each case mounts as root (the daemon), then runs a short probe as a real non-root uid in a
subprocess that drops its privileges (setgroups/setgid/setuid through `subprocess.run(user=...)`) and
reports what listdir, open+read and stat gave, as JSON: a value, or the errno name.

The mountpoint lives in a directory made world-traversable under /tmp (pytest's tmp_path is below
/tmp/pytest-of-root, which is 0700), and the probe runs an interpreter that other users can execute.
The daemon mounts as root, so /etc/fuse.conf's `user_allow_other` is not needed for `allow_other`
(on the dev box it is commented out, and these tests pass).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import S3Server, mounted, new_bucket, put_objects, unmount

NOBODY = 65534
# Made up: no passwd or group entry, so nothing but the mount's own modes can let them in.
USER_U = 12345
USER_V = 23456
GROUP_G = 4242
OBJECTS = {"top.txt": b"top level\n", "sub/inner.txt": b"inner\n"}

PROBE = r"""
import errno, json, os, sys
out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
       "results": []}
for op, path in json.loads(sys.argv[1]):
    try:
        if op == "listdir":
            value = sorted(os.listdir(path))
        elif op == "read":
            with open(path, "rb") as f:
                value = f.read().decode()
        elif op == "stat":
            st = os.stat(path)
            value = [oct(st.st_mode & 0o7777), st.st_uid, st.st_gid]
        else:
            raise ValueError(op)
        out["results"].append(["ok", value])
    except OSError as exc:
        out["results"].append(["err", errno.errorcode.get(exc.errno, str(exc.errno))])
print(json.dumps(out))
"""


def world_can_run(path: str) -> bool:
    """`path` and every directory above it can be reached and executed by any user."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


@pytest.fixture(scope="module")
def python_for_others() -> str:
    for candidate in (sys.executable, getattr(sys, "_base_executable", ""), shutil.which("python3") or "",
                      "/usr/bin/python3"):
        if candidate and world_can_run(candidate):
            return candidate
    pytest.skip("no Python interpreter that a non-root user can execute")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can traverse, for the mountpoint (and the daemon's log beside it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the probes switch to other uids")
    path = Path(tempfile.mkdtemp(prefix="modelfs-perm-", dir="/tmp"))
    path.chmod(0o755)
    for p in (path, *path.parents):
        assert p.stat().st_mode & stat.S_IXOTH, f"{p} is not traversable by other users"
    try:
        yield path
    finally:
        for child in path.iterdir():
            unmount(child)  # `mounted` always unmounts; this only keeps rmtree out of a mount regardless
        shutil.rmtree(path, ignore_errors=True)


def probe(python: str, uid: int, gid: int, ops: list[tuple[str, Path]],
          groups: tuple[int, ...] = ()) -> list[Any]:
    """Run `ops` as uid/gid with exactly `groups` as supplementary groups; [("ok", value) | ("err", ERRNO)]."""
    res = subprocess.run([python, "-I", "-S", "-c", PROBE, json.dumps([(op, str(p)) for op, p in ops])],
                         user=uid, group=gid, extra_groups=list(groups), cwd="/", env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # The probe really ran unprivileged, with no group we did not give it.
    assert (out["uid"], out["euid"], out["gid"]) == (uid, uid, gid), out
    assert set(out["groups"]) <= {gid, *groups}, out
    return [tuple(r) for r in out["results"]]


OK_TOP = ("ok", OBJECTS["top.txt"].decode())
OK_INNER = ("ok", OBJECTS["sub/inner.txt"].decode())
OK_ROOT_LIST = ("ok", ["sub", "top.txt"])
EACCES = ("err", "EACCES")


@pytest.fixture
def bucket(moto_server: S3Server) -> str:
    name = new_bucket(moto_server)
    put_objects(moto_server, name, OBJECTS)
    return name


def everything(mp: Path) -> list[tuple[str, Path]]:
    return [("listdir", mp), ("read", mp / "top.txt"), ("listdir", mp / "sub"), ("read", mp / "sub/inner.txt"),
            ("stat", mp / "top.txt"), ("stat", mp / "sub")]


# Permissions do not depend on the origin: these run on moto only.

def test_default_modes_with_allow_other_let_other_users_list_and_read(
        moto_server: S3Server, bucket: str, shared_dir: Path, python_for_others: str) -> None:
    mp = shared_dir / "mnt"
    with mounted(moto_server, bucket, mp, "--allow-other"):
        for uid in (NOBODY, USER_U):
            assert probe(python_for_others, uid, uid, everything(mp)) == [
                OK_ROOT_LIST, OK_TOP, ("ok", ["inner.txt"]), OK_INNER,
                ("ok", ["0o444", 0, 0]), ("ok", ["0o555", 0, 0])], uid


def test_without_allow_other_other_users_get_eacces_on_the_mountpoint(
        moto_server: S3Server, bucket: str, shared_dir: Path, python_for_others: str) -> None:
    mp = shared_dir / "mnt"
    with mounted(moto_server, bucket, mp):
        assert sorted(os.listdir(mp)) == ["sub", "top.txt"]  # the mounter (root) is let in
        assert probe(python_for_others, NOBODY, NOBODY, [("stat", mp), *everything(mp)]) == [EACCES] * 7
        # The modes would allow it (0444/0555): it is the kernel refusing other users, not the modes.
        assert stat.S_IMODE(os.stat(mp).st_mode) == 0o555
        assert stat.S_IMODE(os.stat(mp / "top.txt").st_mode) == 0o444


def test_file_mode_0440_with_gid_lets_only_the_group_read(
        moto_server: S3Server, bucket: str, shared_dir: Path, python_for_others: str) -> None:
    mp = shared_dir / "mnt"
    with mounted(moto_server, bucket, mp, "--allow-other", "--file-mode", "0440", "--gid", str(GROUP_G)):
        ops = [("read", mp / "top.txt"), ("read", mp / "sub/inner.txt"), ("stat", mp / "top.txt"), ("listdir", mp)]
        stat_ok = ("ok", ["0o440", 0, GROUP_G])
        # A member by its primary group, and by a supplementary group.
        assert probe(python_for_others, USER_U, GROUP_G, ops) == [OK_TOP, OK_INNER, stat_ok, OK_ROOT_LIST]
        assert probe(python_for_others, USER_V, USER_V, ops, groups=(GROUP_G,)) == [
            OK_TOP, OK_INNER, stat_ok, OK_ROOT_LIST]
        # Not a member: the names are visible (0555 directories) but the files are not readable.
        for uid in (NOBODY, USER_U):
            assert probe(python_for_others, uid, uid, ops) == [EACCES, EACCES, stat_ok, OK_ROOT_LIST], uid


def test_file_mode_0400_with_uid_lets_only_the_owner_read(
        moto_server: S3Server, bucket: str, shared_dir: Path, python_for_others: str) -> None:
    mp = shared_dir / "mnt"
    with mounted(moto_server, bucket, mp, "--allow-other", "--file-mode", "0400", "--uid", str(USER_U)):
        ops = [("read", mp / "top.txt"), ("read", mp / "sub/inner.txt"), ("stat", mp / "top.txt")]
        stat_ok = ("ok", ["0o400", USER_U, 0])
        assert probe(python_for_others, USER_U, USER_U, ops) == [OK_TOP, OK_INNER, stat_ok]
        assert probe(python_for_others, USER_U, GROUP_G, ops, groups=(0,)) == [OK_TOP, OK_INNER, stat_ok]
        # Others, even in the file's group (0): the group bits are 0.
        assert probe(python_for_others, NOBODY, NOBODY, ops) == [EACCES, EACCES, stat_ok]
        assert probe(python_for_others, USER_V, 0, ops) == [EACCES, EACCES, stat_ok]


def test_dir_mode_0500_with_uid_keeps_others_out_of_every_directory(
        moto_server: S3Server, bucket: str, shared_dir: Path, python_for_others: str) -> None:
    mp = shared_dir / "mnt"
    with mounted(moto_server, bucket, mp, "--allow-other", "--dir-mode", "0500", "--uid", str(USER_U)):
        assert probe(python_for_others, USER_U, USER_U, everything(mp)) == [
            OK_ROOT_LIST, OK_TOP, ("ok", ["inner.txt"]), OK_INNER,
            ("ok", ["0o444", USER_U, 0]), ("ok", ["0o500", USER_U, 0])]
        # Others can neither list nor traverse the root: even a readable (0444) file is out of reach.
        for uid in (NOBODY, USER_V):
            assert probe(python_for_others, uid, uid, [("stat", mp), *everything(mp)]) == [
                ("ok", ["0o500", USER_U, 0]), *[EACCES] * 6], uid


def test_dir_mode_0711_lets_others_open_known_names_but_not_list(
        moto_server: S3Server, bucket: str, shared_dir: Path, python_for_others: str) -> None:
    mp = shared_dir / "mnt"
    with mounted(moto_server, bucket, mp, "--allow-other", "--dir-mode", "0711"):
        assert probe(python_for_others, NOBODY, NOBODY, everything(mp)) == [
            EACCES, OK_TOP, EACCES, OK_INNER, ("ok", ["0o444", 0, 0]), ("ok", ["0o711", 0, 0])]

