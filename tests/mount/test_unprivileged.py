"""modelfs run by a user who is not root: the daemon itself unprivileged, mounting through the setuid fusermount3.

Every other mount test runs the daemon as root (test_permissions.py only runs probes as other uids). Here each
`modelfs` command, the daemon and the readers run as a real user (a fixed system account, `modelfs-unpriv`, made
with useradd if it is not there and removed again by the test that made it, or by the next run where a run was
killed: fusermount3 refuses a uid without a passwd entry), as a researcher on a shared node would run
`modelfs mount BUCKET ~/models`:

- a mountpoint the user may not write (root's), or a sticky one of root's, is refused naming why, exit status 2
  (B1080), where fusermount3's own line used to be lost in a background mount (B180); so is `--allow-other` without
  `user_allow_other` in /etc/fuse.conf (B1081); but a user with CAP_SYS_ADMIN, who mounts with mount(2) itself,
  mounts there (B205);
- a mountpoint fusermount3 refuses for a reason modelfs does not check itself (a ramfs: not a filesystem type it
  mounts over for users) ends the error line on fusermount3's own reason, background and foreground (B181);
- `modelfs unmount` of root's mount by the user says whose mount it is, not fusermount3's "not found in /etc/mtab"
  (B182), and its `prefetch` and `stats` of root's mount made without --allow-other say it is closed to them (B183);
- root's `umount -f` of the user's mount with a file open: the daemon detaches its aborted mount with
  `fusermount3 -uz` (B184);
- a background mount with `--cache-dir` and `--writable` in the user's directory; `ls`, `cat`, safetensors'
  `load_file`, a file written and closed (then in the bucket), `modelfs prefetch`, `modelfs stats --json`; a busy
  `modelfs unmount` (a shell's working directory inside) names the holder and advises nothing root-only, a plain
  one then unmounts;
- a foreground daemon stopped with SIGTERM while a reader is mid-file: it unmounts and exits 0;
- a daemon killed with SIGKILL: root's `modelfs unmount --stale` says it may not ask whether that mount is alive and
  leaves it (B344); `modelfs unmount` (fusermount3 -u, as that user) undoes it, which then mounts again over the NVMe
  cache the killed daemon left;
- the daemons' logs: the root-only tuning (the bdi's read_ahead_kb, max_background in fusectl) skipped with an info
  line each, no traceback, no warning, and no advice only root can follow (`umount -l`).

What the user needs of the machine: an interpreter it can run that is the same Python as the test's (the project's
packages are put on its PYTHONPATH from this environment's site-packages), and read-write access to /dev/fuse (libfuse
opens it itself before it asks fusermount3, and fails if it cannot). Where /dev/fuse is root's alone (0600, as in
many containers) the test gives that one user access for its duration with a POSIX ACL and puts the device's ACL and
mode back after (the next run puts back one that a killed run left); where none of that can be had (not root, no
useradd, no ACL on the device, no such Python), it skips. The user and the ACL are the machine's: one run of this
module at a time holds a lock (`RUN_LOCK`), and another waits for it. The working directory of the test's user is
a directory made under /tmp that it owns (its HOME).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pwd
import shutil
import signal
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fsmount import mount as fsmount_mount
from tests.helpers import REPO, S3Server, bucket_with, mounted, mounted_at, run_modelfs, wait_for, warning_lines

USER = "modelfs-unpriv"
# The account's comment: a user of that name with it was made by this test (one whose run was killed left it), and
# is removed by the run that finds it; one without it is someone's own and left alone.
USER_COMMENT = "modelfs test user (tests/mount/test_unprivileged.py)"
# The account and /dev/fuse's ACL are the machine's, not the run's: two runs at once (two checkouts, two CI jobs on
# one host) each found the other's user and ACL, and the first to end removed both under the second, whose daemons
# then failed to open /dev/fuse. One run at a time holds this lock (released by the kernel if the run is killed).
RUN_LOCK = "/tmp/modelfs-test-unprivileged.lock"
RUN_LOCK_WAIT_S = 600.0
ACL_XATTR = "system.posix_acl_access"
# posix_acl_xattr (include/uapi/linux/posix_acl_xattr.h): a version, then (tag, perm, id) entries.
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
ACL_UNDEFINED_ID = 0xFFFFFFFF


def world_can_run(path: str) -> bool:
    """`path` and every directory above it can be reached and executed by any user."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


@dataclass
class User:
    uid: int
    gid: int
    home: Path
    python: str
    pythonpath: str

    def env(self, server: S3Server) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "PYTHONPATH": self.pythonpath,
                "PYTHONWARNINGS": "ignore", **server.env}

    def popen(self, server: S3Server, argv: list[str], **kw) -> subprocess.Popen:  # noqa: ANN003
        return subprocess.Popen(argv, user=self.uid, group=self.gid, extra_groups=[], env=self.env(server),
                                cwd=kw.pop("cwd", self.home), **kw)

    def run(self, server: S3Server, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
        return subprocess.run(argv, user=self.uid, group=self.gid, extra_groups=[], env=self.env(server),
                              cwd=kw.pop("cwd", self.home), capture_output=True, text=True, timeout=timeout, **kw)

    def modelfs(self, server: S3Server, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
        return self.run(server, [self.python, "-m", "fsmount", *args], timeout=timeout, **kw)


def _one_run_at_a_time() -> Iterator[None]:
    """Held for the module: the next run waits (up to `RUN_LOCK_WAIT_S`, then skips)."""
    fd = os.open(RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + RUN_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.skip(f"another run of this module held {RUN_LOCK} for {RUN_LOCK_WAIT_S:g} s")
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)


def _user_account() -> Iterator[tuple[int, int]]:
    try:
        pw = pwd.getpwnam(USER)
        made = pw.pw_gecos == USER_COMMENT  # left by a run that was killed: this run's to remove
    except KeyError:
        if shutil.which("useradd") is None or shutil.which("userdel") is None:
            pytest.skip("no useradd/userdel here to make a user to run modelfs as")
        res = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--comment",
                              USER_COMMENT, USER], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot make a user to run modelfs as: {res.stderr.strip()}")
        made = True
        pw = pwd.getpwnam(USER)
    try:
        yield pw.pw_uid, pw.pw_gid
    finally:
        if made:  # once the daemons it ran are gone (userdel refuses a user with processes)
            deadline = time.monotonic() + 30
            while user_processes(pw.pw_uid) and time.monotonic() < deadline:
                time.sleep(0.1)
            subprocess.run(["userdel", USER], capture_output=True)


def user_processes(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def _acl(uid: int, mode: int) -> bytes:
    """The device's mode as an ACL, plus read-write for `uid` (the mask widened to let it through; the owner, group
    and others keep what the mode gave them)."""
    entry = lambda tag, perm, ident=ACL_UNDEFINED_ID: struct.pack("<HHI", tag, perm, ident)  # noqa: E731
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    return (struct.pack("<I", 2) + entry(ACL_USER_OBJ, owner) + entry(ACL_USER, 6, uid) + entry(ACL_GROUP_OBJ, group)
            + entry(ACL_MASK, group | 6) + entry(ACL_OTHER, other))


def _left_by_a_killed_run(acl: bytes, uid: int) -> int | None:
    """The mode the device had before a run that was killed gave `uid` its ACL entry (that ACL is `_acl`'s, which
    keeps the mode's bits), or None where the ACL is not such a leftover."""
    entries = [struct.unpack_from("<HHI", acl, at) for at in range(4, len(acl) - 7, 8)]
    if (ACL_USER, 6, uid) not in entries:
        return None
    perm = {tag: perm for tag, perm, _ in entries if tag != ACL_USER}
    return (perm.get(ACL_USER_OBJ, 6) << 6) | (perm.get(ACL_GROUP_OBJ, 0) << 3) | perm.get(ACL_OTHER, 0)


def _fuse_device_for(uid: int, gid: int, python: str) -> Iterator[None]:
    """The user may open /dev/fuse for the duration: already, or through an ACL entry put back after."""
    def can_open() -> bool:
        probe = "import os; os.close(os.open('/dev/fuse', os.O_RDWR))"
        return subprocess.run([python, "-I", "-c", probe], user=uid, group=gid, extra_groups=[],
                              capture_output=True, timeout=30).returncode == 0

    device = fsmount_mount.FUSE_DEVICE
    mode = stat.S_IMODE(os.stat(device).st_mode)
    try:
        before: bytes | None = os.getxattr(device, ACL_XATTR)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
            raise
        before = None
    if before is not None and (was := _left_by_a_killed_run(before, uid)) is not None:
        before, mode = None, (mode & ~0o777) | was  # put back as it was before that run
    elif can_open():
        yield
        return
    try:
        os.setxattr(device, ACL_XATTR, _acl(uid, mode))
    except OSError as exc:
        pytest.skip(f"{device} is root's alone and takes no ACL ({exc.strerror})")
    try:
        if not can_open():
            pytest.skip(f"the test user cannot open {device} even with an ACL entry")
        yield
    finally:
        if before is None:
            os.removexattr(device, ACL_XATTR)
        else:
            os.setxattr(device, ACL_XATTR, before)
        os.chmod(device, mode)


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes the user and switches to it")
    if not os.path.exists(fsmount_mount.FUSE_DEVICE) or shutil.which("fusermount3") is None:
        pytest.skip("no /dev/fuse or fusermount3 here")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    pythons = [p for p in (sys.executable, getattr(sys, "_base_executable", ""), f"/usr/bin/python{version}",
                           shutil.which(f"python{version}") or "") if p and world_can_run(p)]
    paths = dict.fromkeys([str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    lock = _one_run_at_a_time()
    next(lock)
    try:
        yield from _the_user(pythons, os.pathsep.join(paths), version)
    finally:
        next(lock, None)


def _the_user(pythons: list[str], pythonpath: str, version: str) -> Iterator[User]:
    accounts = _user_account()
    uid, gid = next(accounts)
    home = Path(tempfile.mkdtemp(prefix="modelfs-unpriv-", dir="/tmp"))
    try:
        home.chmod(0o755)
        os.chown(home, uid, gid)
        if not all(p.stat().st_mode & stat.S_IXOTH for p in home.parents):
            pytest.skip(f"{home.parent} is not traversable by other users")
        check = "import fsmount, pyfuse3, trio, boto3, safetensors, numpy; print(fsmount.__file__)"
        python = next((p for p in pythons if (r := subprocess.run(
            [p, "-c", check], user=uid, group=gid, extra_groups=[], cwd=home, capture_output=True, text=True,
            env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": pythonpath}, timeout=60)).returncode == 0
            and r.stdout.strip().startswith(str(REPO))), None)
        if python is None:
            pytest.skip(f"no Python {version} that {USER} can run with this checkout's packages")
        devices = _fuse_device_for(uid, gid, python)
        next(devices)
        try:
            yield User(uid, gid, home, python, pythonpath)
        finally:
            next(devices, None)
    finally:
        for child in home.iterdir() if home.exists() else ():
            if mounted_at(child):
                subprocess.run(["fusermount3", "-uz", str(child)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
        next(accounts, None)


def safetensors_bytes() -> tuple[bytes, np.ndarray]:
    from safetensors.numpy import save

    weights = np.random.default_rng(7).standard_normal((512, 1024), dtype=np.float32)
    return save({"w": weights}), weights


def bucket_of(server: S3Server) -> str:
    """A bucket of a small safetensors model, a config and a 24 MiB file."""
    data, _ = safetensors_bytes()
    return bucket_with(server, {"m/model.safetensors": data, "m/config.json": b'{"a": 1}\n',
                                "big.bin": np.random.default_rng(8).bytes(24 << 20)})


@pytest.fixture(scope="module")
def bucket(moto_server: S3Server) -> str:
    return bucket_of(moto_server)


@pytest.fixture
def mountpoint(user: User) -> Iterator[Path]:
    mp = user.home / "models"
    mp.mkdir()
    os.chown(mp, user.uid, user.gid)
    try:
        yield mp
    finally:
        if mounted_at(mp):
            subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)
        for p in user.home.iterdir():
            if p.is_dir() and not mounted_at(p):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file():
                p.unlink()


def assert_clean_log(log: Path) -> None:
    """Root-only tuning skipped with its info lines; no warning, no traceback, no advice for root."""
    text = log.read_text(errors="replace")
    assert "could not raise kernel readahead" in text and "could not raise FUSE background requests" in text, text
    assert "Traceback" not in text and "umount -l" not in text, text
    assert not warning_lines(text), warning_lines(text)


def test_a_mountpoint_the_user_may_not_write_is_refused_naming_why(user: User, moto_server: S3Server,
                                                                     bucket: str) -> None:
    """fusermount3's "user has no write access to mountpoint" went to a background mount's nowhere: the user read
    only "fuse_session_mount failed" (B180). Only a chmod or chown mends it, and a sticky directory of root's the
    same: exit status 2, which a unit does not start again every RestartSec for good as it did on 1 (B1080)."""
    roots = Path(tempfile.mkdtemp(prefix="modelfs-unpriv-root-", dir="/tmp"))
    try:
        for mode, message in ((0o755, "is not writable by you"), (0o1777, "is a sticky directory you do not own")):
            roots.chmod(mode)
            for foreground in ((), ("--foreground",)):
                res = user.modelfs(moto_server, "mount", bucket, str(roots), "--endpoint-url",
                                   moto_server.endpoint_url, *foreground)
                assert res.returncode == 2 and not mounted_at(roots), res.stderr
                assert message in res.stderr and "fuse_session_mount failed" not in res.stderr, res.stderr
    finally:
        if mounted_at(roots):
            subprocess.run(["fusermount3", "-uz", str(roots)], capture_output=True)
        shutil.rmtree(roots, ignore_errors=True)



def test_allow_other_without_user_allow_other_exits_2(user: User, moto_server: S3Server, bucket: str,
                                                      mountpoint: Path) -> None:
    """`--allow-other` as a user without `user_allow_other` in /etc/fuse.conf exited 1: a unit started it again every
    RestartSec for good, though only an edit of that file mends it. It exits 2 (B1081)."""
    if fsmount_mount.user_allow_other():
        pytest.skip(f"{fsmount_mount.FUSE_CONF} has user_allow_other here")
    res = user.modelfs(moto_server, "mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url,
                       "--allow-other", "--foreground")
    assert res.returncode == 2 and not mounted_at(mountpoint), res.stderr
    assert "--allow-other as a user other than root needs 'user_allow_other' in" in res.stderr, res.stderr


def test_a_user_with_cap_sys_admin_mounts_on_root_s_directory_as_before(user: User, moto_server: S3Server,
                                                                        bucket: str) -> None:
    """A user with CAP_SYS_ADMIN (a systemd unit's `User=` with `AmbientCapabilities=CAP_SYS_ADMIN`) mounts with
    mount(2) itself, as root does, and fusermount3's rules are not asked: B180's check refused such a daemon the
    root-owned /models it had mounted before (B205)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv (util-linux) here to give the user CAP_SYS_ADMIN")
    roots = Path(tempfile.mkdtemp(prefix="modelfs-unpriv-root-", dir="/tmp"))
    log = user.home / "capable.log"
    try:
        roots.chmod(0o755)
        argv = [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--inh-caps=+sys_admin",
                "--ambient-caps=+sys_admin", "--", user.python, "-m", "fsmount", "mount", bucket, str(roots),
                "--endpoint-url", moto_server.endpoint_url, "--log-file", str(log)]
        res = subprocess.run(argv, env=user.env(moto_server), cwd=user.home, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0 and mounted_at(roots), res.stderr
        res = user.run(moto_server, ["cat", str(roots / "m" / "config.json")])
        assert res.returncode == 0 and res.stdout == '{"a": 1}\n', res.stderr
        res = user.modelfs(moto_server, "unmount", str(roots))  # its own mount (user_id=), without the capability
        assert res.returncode == 0 and not mounted_at(roots), res.stderr
    finally:
        if mounted_at(roots):
            subprocess.run(["fusermount3", "-uz", str(roots)], capture_output=True)
        shutil.rmtree(roots, ignore_errors=True)

def test_a_user_mounts_reads_writes_prefetches_and_unmounts(user: User, s3: S3Server, mountpoint: Path) -> None:
    """On moto and SeaweedFS."""
    moto_server = s3  # the name the rest of the module uses for its server
    bucket = bucket_of(s3)
    cache, log = user.home / "cache", user.home / "daemon.log"
    res = user.modelfs(moto_server, "mount", bucket, str(mountpoint), "--endpoint-url", moto_server.endpoint_url,
                       "--cache-dir", str(cache), "--writable", "--log-file", str(log))
    assert res.returncode == 0 and mounted_at(mountpoint), res.stderr
    try:
        data, weights = safetensors_bytes()
        script = f"""
import hashlib, os, sys
from safetensors.numpy import load_file
m = {str(mountpoint)!r}
print(sorted(os.listdir(m)), sorted(os.listdir(m + "/m")))
print(open(m + "/m/config.json").read().strip())
print(hashlib.sha256(open(m + "/m/model.safetensors", "rb").read()).hexdigest())
print(float(load_file(m + "/m/model.safetensors")["w"].sum()))
with open(m + "/new.txt", "wb") as f:
    f.write(b"written by a user")
"""
        res = user.run(moto_server, [user.python, "-c", script])
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == "['big.bin', 'm'] ['config.json', 'model.safetensors']"
        assert lines[1:3] == ['{"a": 1}', hashlib.sha256(data).hexdigest()]
        assert float(lines[3]) == pytest.approx(float(weights.sum()))
        body = moto_server.client().get_object(Bucket=bucket, Key="new.txt")["Body"].read()
        assert body == b"written by a user"

        res = user.modelfs(moto_server, "prefetch", str(mountpoint))
        assert res.returncode == 0 and "prefetched" in res.stdout, res.stdout + res.stderr
        res = user.modelfs(moto_server, "stats", str(mountpoint), "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["bucket"] == bucket, res.stdout + res.stderr
        assert (cache / "chunks").is_dir() and (cache / "chunks").stat().st_uid == user.uid

        # A shell's cd inside (root, the chdir of subprocess's cwd=, may not enter a mount without allow_other).
        holder = user.popen(moto_server, ["sh", "-c", f"cd {mountpoint / 'm'} && exec sleep 30"])
        wait_for("the holder's cd", lambda: os.readlink(f"/proc/{holder.pid}/cwd") == str(mountpoint / "m"))
        try:
            res = user.modelfs(moto_server, "unmount", str(mountpoint))
            assert res.returncode == 1 and mounted_at(mountpoint), res.stderr
            assert f"sleep (pid {holder.pid}: working directory)" in res.stderr, res.stderr
            assert "umount -l" not in res.stderr and "--lazy" in res.stderr, res.stderr
        finally:
            holder.kill()
            holder.wait()
        res = user.modelfs(moto_server, "unmount", str(mountpoint))
        assert res.returncode == 0 and not mounted_at(mountpoint), res.stderr
        wait_for("the daemon's end in its log", lambda: "unmounted " in log.read_text(), timeout=30)
        assert_clean_log(log)
    finally:
        if mounted_at(mountpoint):
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


READER = """
import sys, time
f = open(sys.argv[1], "rb")
f.read(1 << 20)
print("reading", flush=True)
try:
    while f.read(1 << 20):
        time.sleep(0.2)
    print("done")
except OSError as exc:
    print("error", exc.errno)
"""


def test_a_user_s_daemon_stopped_mid_read_or_killed_leaves_no_mount(user: User, moto_server: S3Server, bucket: str,
                                                                      mountpoint: Path) -> None:
    cache, log = user.home / "cache", user.home / "fg.log"
    argv = [user.python, "-m", "fsmount", "mount", bucket, str(mountpoint), "--endpoint-url",
            moto_server.endpoint_url, "--cache-dir", str(cache), "--foreground", "--log-file", str(log)]

    def start() -> subprocess.Popen:
        daemon = user.popen(moto_server, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for("the user's mount", lambda: mounted_at(mountpoint) and "mounted bucket" in log.read_text()
                 or daemon.poll() is not None, timeout=30)
        assert daemon.poll() is None, log.read_text()
        return daemon

    daemon = start()
    try:
        reader = user.popen(moto_server, [user.python, "-c", READER, str(mountpoint / "big.bin")],
                            stdout=subprocess.PIPE, text=True)
        assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, log.read_text()
        assert not mounted_at(mountpoint)
        out, _ = reader.communicate(timeout=30)
        assert out.split()[0] in ("error", "done"), out
        assert_clean_log(log)

        log.unlink()
        daemon = start()
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(30)
        assert mounted_at(mountpoint)  # ENOTCONN until someone unmounts it
        # Root's `unmount --stale` (the unit's ExecStartPre) may not ask the daemon of a mount made without
        # --allow-other, dead or alive: it called this dead one "a live modelfs mount" (B344).
        res = run_modelfs("unmount", "--stale", str(mountpoint))
        assert (res.returncode, res.stderr) == (1, f"modelfs: {mountpoint} is the modelfs mount of {USER} (uid "
                                                   f"{user.uid}), made without --allow-other: the kernel lets no "
                                                   "other user, root included, ask its daemon whether it is alive: "
                                                   f"left mounted; unmount it (modelfs unmount {mountpoint}) if it "
                                                   "is not in use\n"), res.stderr
        assert mounted_at(mountpoint)
        res = user.modelfs(moto_server, "unmount", str(mountpoint))
        assert res.returncode == 0 and not mounted_at(mountpoint), res.stderr
        daemon = start()
        res = user.run(moto_server, ["cat", str(mountpoint / "m" / "config.json")])
        assert res.returncode == 0 and res.stdout == '{"a": 1}\n', res.stderr
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, log.read_text()
        assert_clean_log(log)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        if mounted_at(mountpoint):
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


def test_a_mount_fusermount3_refuses_says_fusermount3_s_reason(user: User, moto_server: S3Server,
                                                                 bucket: str) -> None:
    """fusermount3 lets a user other than root mount only over the filesystem types it lists (not ramfs, which
    modelfs's own checks do not foresee), and says so on its stderr: lost in a background mount, whose user read
    "fuse_session_mount failed" alone; its line now ends the refusal, in the foreground too (B181)."""
    ram = Path(tempfile.mkdtemp(prefix="modelfs-unpriv-ramfs-", dir="/tmp"))
    try:
        ram.chmod(0o755)
        res = subprocess.run(["mount", "-t", "ramfs", "-o", "mode=755", "modelfs-unpriv-ramfs", str(ram)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a ramfs here: {res.stderr.strip()}")
        mp = ram / "mnt"
        mp.mkdir()
        os.chown(mp, user.uid, user.gid)
        for extra in ((), ("--foreground",)):
            res = user.modelfs(moto_server, "mount", bucket, str(mp), "--endpoint-url", moto_server.endpoint_url,
                               *extra)
            assert res.returncode == 1 and not mounted_at(mp), res.stderr
            last = res.stderr.strip().splitlines()[-1]
            assert last.startswith(f"modelfs: cannot mount at {mp}: "), res.stderr
            assert "(fusermount3: mounting over filesystem type 0x858458f6 is forbidden)" in last, res.stderr
            assert res.stderr.count("fusermount3:") == 1, res.stderr  # not said twice in the foreground
    finally:
        for path in (ram / "mnt", ram):
            if mounted_at(path):
                subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(ram, ignore_errors=True)


def test_a_user_told_whose_mount_they_may_not_unmount(user: User, moto_server: S3Server, bucket: str) -> None:
    """fusermount3 said "entry for M not found in /etc/mtab" of root's mount, which the user saw in `mount` (B182)."""
    shared = Path(tempfile.mkdtemp(prefix="modelfs-unpriv-shared-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        with mounted(moto_server, bucket, shared / "models"):
            res = user.modelfs(moto_server, "unmount", str(shared / "models"))
            assert res.returncode == 1 and mounted_at(shared / "models"), res.stderr
            assert "it is the mount of root (uid 0), and only that user or root may unmount it" in res.stderr, \
                res.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_prefetch_and_stats_of_root_s_mount_made_without_allow_other_say_so(user: User, moto_server: S3Server,
                                                                            bucket: str) -> None:
    """Root's mount made without --allow-other is closed to every other user whatever its modes: `modelfs prefetch`
    and `modelfs stats` said "permission denied" alone, and the user went looking at modes (B183)."""
    shared = Path(tempfile.mkdtemp(prefix="modelfs-unpriv-shared-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        mp = shared / "models"
        with mounted(moto_server, bucket, mp):
            closed = f"{mp} is the modelfs mount of root (uid 0), made without --allow-other"
            res = user.modelfs(moto_server, "prefetch", str(mp / "m"))
            assert res.returncode == 1 and f"{mp / 'm'}: permission denied ({closed}" in res.stderr, res.stderr
            res = user.modelfs(moto_server, "stats", str(mp))
            assert res.returncode == 1 and f"cannot read stats of {mp}: {closed}" in res.stderr, res.stderr
        with mounted(moto_server, bucket, mp, "--allow-other"):  # open to all: no such word, and it works
            res = user.modelfs(moto_server, "stats", str(mp), "--json")
            assert res.returncode == 0 and json.loads(res.stdout)["bucket"] == bucket, res.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


HOLDER = """
import sys, time
f = open(sys.argv[1], "rb")
f.read(10)
print("open", flush=True)
time.sleep(60)
"""


def test_a_user_s_mount_aborted_by_umount_f_with_a_file_open_is_detached(user: User, moto_server: S3Server,
                                                                           bucket: str, mountpoint: Path) -> None:
    """`umount -f` (root's) with a file open aborts the connection and fails busy; the daemon, ending, detaches its
    own mount (B139), but a daemon that is not root could not (umount2: EPERM), and left the mount ENOTCONN for its
    user with a warning naming `fusermount3 -uz`, which it may run itself: it does now (B184)."""
    log = user.home / "force.log"
    daemon = user.popen(moto_server, [user.python, "-m", "fsmount", "mount", bucket, str(mountpoint), "--endpoint-url",
                                      moto_server.endpoint_url, "--foreground", "--log-file", str(log)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = None
    try:
        wait_for("the user's mount", lambda: mounted_at(mountpoint) and "mounted bucket" in log.read_text()
                 or daemon.poll() is not None, timeout=30)
        assert daemon.poll() is None, log.read_text()
        holder = user.popen(moto_server, [user.python, "-c", HOLDER, str(mountpoint / "big.bin")],
                            stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        res = subprocess.run(["umount", "-f", str(mountpoint)], capture_output=True, text=True)
        assert res.returncode != 0, "umount -f unmounted a mount with a file open"
        assert daemon.wait(30) == 0, log.read_text()
        assert not mounted_at(mountpoint), log.read_text()
        text = log.read_text()
        assert "aborted by someone else" in text and not warning_lines(text), text
    finally:
        for proc in (holder, daemon):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if mounted_at(mountpoint):
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)
