"""Which of several mounts at one path is on top: the same answer from every reader of /proc/self/mountinfo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsmount import mount, mount_users, mountinfo, prefetch_command

# A ramfs made first, then moved (mount(8)'s move) over the modelfs mount at /models: listed before it, its parent
# the modelfs mount's id. At /data, a bind mount of the bottom mount moved over the one on it.
MOVED = """\
20 1 8:1 / / rw - ext4 /dev/sda1 rw
24 25 0:30 / /models rw - ramfs ramfs rw
25 20 0:25 / /models rw - fuse.modelfs modelfs rw,user_id=1000,group_id=1000
23 27 0:40 /sub /data rw - fuse.modelfs modelfs rw,user_id=1001,group_id=1001
26 20 0:40 / /data rw - fuse.modelfs modelfs rw,user_id=1001,group_id=1001
27 26 0:41 / /data rw - fuse.modelfs modelfs rw,user_id=1002,group_id=1002
"""


@pytest.fixture
def moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(MOVED)
    listed = mountinfo.mounts(str(path))
    monkeypatch.setattr(mountinfo, "mounts", lambda info=str(path): listed)
    monkeypatch.setattr(prefetch_command, "mounts", lambda info=str(path): listed)
    monkeypatch.setattr(mount_users, "mounts", lambda info=str(path): listed)
    return str(path)


def test_the_mount_on_top_is_the_one_no_other_there_sits_on_not_the_last_listed(moved: str) -> None:
    """`mount.mounted_type` took the mount on top by parent ids (B510); `mount.mount_id`,
    `prefetch_command.mount_of`, `mount_owner` and `mount_users.mount_at` took the last listed, the one underneath
    where a mount was moved over another (B550)."""
    assert mount.mounted_type("/models") == "a ramfs mount"
    assert prefetch_command.mount_of("/models/x", moved, resolve=False) == ("/models", "ramfs")
    assert prefetch_command.mount_owner("/models", moved) is None
    assert mount_users.mount_at("/models", moved) == (24, (0, 30))
    assert prefetch_command.mount_of("/data/x", moved, resolve=False) == ("/data", "fuse.modelfs")
    assert prefetch_command.mount_owner("/data", moved) == 1001
    assert mount.mount_id("/data", os.makedev(0, 40)) == b"23"
    assert mount.mount_id("/data", os.makedev(0, 41)) == b"27"
    assert mount.mount_id("/models", os.makedev(0, 25)) == b"25"


ON_THE_NETWORK = """\
20 1 8:1 / / rw - ext4 /dev/sda1 rw
30 20 0:50 / /shared rw - nfs4 server:/export rw,vers=4.2
31 20 0:51 / /remote rw - fuse.sshfs user@host:/ rw,user_id=0,group_id=0
32 20 0:52 / /models rw - fuse.modelfs models rw,user_id=0,group_id=0
"""


@pytest.mark.parametrize("path, words", [
    ("/shared/models", "mountpoint /shared/models is on the nfs4 mount at /shared whose server does not answer within "
                       "5s: left mounted; mount elsewhere, or here once that server answers"),
    ("/remote", "mountpoint /remote is on the fuse.sshfs mount at /remote whose daemon does not answer within 5s "
                "(stopped or hung, not gone): left mounted; stop that daemon, or unmount it (`umount -l /remote`)"),
    ("/models", "mountpoint /models is a modelfs mount whose daemon does not answer within 5s (stopped or hung, not "
                "gone): left mounted; stop that daemon, or `modelfs unmount --lazy /models`"),
    ("/models/sub", "mountpoint /models/sub is inside the modelfs mount at /models, whose daemon does not answer "
                    "within 5s (stopped or hung, not gone): left mounted; stop that daemon, or `modelfs unmount "
                    "--lazy /models`"),
])
def test_a_mountpoint_that_does_not_answer_is_said_in_the_words_of_its_mount_s_type(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, words: str) -> None:
    """A mountpoint on an NFS or CIFS mount whose server is down was said to be "a mount whose daemon does not
    answer", with `modelfs unmount --lazy` for advice, which refuses a mount that is not modelfs's (B554)."""
    info = tmp_path / "mountinfo"
    info.write_text(ON_THE_NETWORK)
    listed = mountinfo.mounts(str(info))
    monkeypatch.setattr(mountinfo, "mounts", lambda: listed)
    monkeypatch.setattr(mount.os, "geteuid", lambda: 0)  # root's words (`umount`), whoever runs the tests

    def silent(mountpoint: str, timeout: float) -> dict:
        raise mount.DaemonSilent("no answer")

    monkeypatch.setattr(mount, "read_stats", silent)
    with pytest.raises(mount.MountError) as refused:
        mount.check_daemon_answers(path)
    assert str(refused.value) == words


@pytest.mark.parametrize("path, words", [
    ("/remote/d", "mountpoint /remote/d is on the fuse.sshfs mount at /remote, whose daemon is gone (killed?): unmount "
                  "it first (`umount /remote`)"),
    ("/models/sub", "mountpoint /models/sub is inside the modelfs mount at /models, whose daemon is gone (killed?): "
                    "run `modelfs unmount /models` first"),
    ("/models", "mountpoint /models is still mounted, but its daemon is gone (killed?): run `modelfs unmount /models` "
                "first"),
])
def test_a_mountpoint_whose_daemon_is_gone_names_what_clears_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  path: str, words: str) -> None:
    """A mountpoint on a FUSE mount whose daemon is gone (ENOTCONN) was told to run `modelfs unmount` of itself: of
    another FUSE file system's mount, which `modelfs unmount` leaves alone, or of a directory inside a modelfs mount,
    which is no mount point (B555)."""
    import errno

    info = tmp_path / "mountinfo"
    info.write_text(ON_THE_NETWORK)
    listed = mountinfo.mounts(str(info))
    monkeypatch.setattr(mountinfo, "mounts", lambda: listed)
    monkeypatch.setattr(mount.os, "geteuid", lambda: 0)

    def gone(mountpoint: str, timeout: float) -> dict:
        raise mount.StatsUnavailable("gone", errno.ENOTCONN)

    monkeypatch.setattr(mount, "read_stats", gone)
    with pytest.raises(mount.MountError) as refused:
        mount.check_daemon_answers(path)
    assert str(refused.value) == words


# At /models, a modelfs mount with a tmpfs on its directory sub, then an ext4 mounted over /models: the tmpfs is
# hidden, /models/sub is ext4's directory. At /data, the other way round: a tmpfs with a modelfs mount on its sub,
# hidden by an ext4 over /data. At /srv, a modelfs mount (stopped, say) over a tmpfs with an ext4 on its sub.
COVERED = """\
20 1 8:1 / / rw - ext4 /dev/sda1 rw
30 20 0:30 / /models rw - fuse.modelfs models rw,user_id=0,group_id=0
31 30 0:31 / /models/sub rw - tmpfs tmpfs rw
32 30 8:2 / /models rw - ext4 /dev/sda2 rw
33 20 0:33 / /data rw - tmpfs tmpfs rw
34 33 0:34 / /data/sub rw - fuse.modelfs data rw,user_id=1001,group_id=1001
35 33 8:3 / /data rw - ext4 /dev/sda3 rw
36 20 0:36 / /srv rw - tmpfs tmpfs rw
37 36 8:4 / /srv/sub rw - ext4 /dev/sda4 rw
38 36 0:38 / /srv rw - fuse.modelfs srv rw,user_id=0,group_id=0
"""


def test_a_mount_under_a_covered_mount_is_hidden_and_the_path_is_on_the_mount_over_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount made on a directory of a mount that another was mounted over since is hidden: the path reaches the
    mount over it. `mountinfo.holding` took the deepest mount point, the hidden one: a mountpoint there was refused as
    inside a modelfs mount it is not in, and `resolve_unasked` asked (readlink) a path of a modelfs mount whose daemon
    may not answer, taking it for the hidden ext4's (B620)."""
    info = tmp_path / "mountinfo"
    info.write_text(COVERED)
    listed = mountinfo.mounts(str(info))
    monkeypatch.setattr(mountinfo, "mounts", lambda info=str(info): listed)
    assert prefetch_command.mount_of("/models/sub/x", str(info), resolve=False) == ("/models", "ext4")
    assert prefetch_command.mount_of("/data/sub/x", str(info), resolve=False) == ("/data", "ext4")
    assert prefetch_command.mount_owner("/data/sub", str(info)) is None
    assert mount_users.mount_at("/data/sub", str(info)) is None
    assert mount.top_type("/data/sub") is None
    mount.check_not_inside_modelfs("/data/sub", "/data/sub")  # on the ext4 over /data, not in the modelfs mount
    with pytest.raises(mount.SettingError):
        mount.check_not_inside_modelfs("/srv/sub", "/srv/sub")
    asked = []

    def readlink(path: str) -> str:
        asked.append(path)
        raise OSError(22, "not a symlink")

    monkeypatch.setattr(prefetch_command.os, "readlink", readlink)
    assert prefetch_command.resolve_unasked("/srv/sub/link", str(info)) == "/srv/sub/link"
    assert asked == []


def test_another_fuse_file_system_s_mount_is_unmounted_with_fusermount3_by_a_user_other_than_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user other than root cannot `umount` a FUSE mount, only `fusermount3 -u` their own: the words of B554 and
    B555 for another FUSE file system's mount (sshfs) named `umount` to anyone (a wording fix of the review)."""
    import errno

    info = tmp_path / "mountinfo"
    info.write_text(ON_THE_NETWORK)
    listed = mountinfo.mounts(str(info))
    monkeypatch.setattr(mountinfo, "mounts", lambda: listed)
    monkeypatch.setattr(mount.os, "geteuid", lambda: 1000)
    assert mount.silent_mount("/remote", 5).endswith("stop that daemon, or unmount it (`fusermount3 -uz /remote`)")

    def gone(mountpoint: str, timeout: float) -> dict:
        raise mount.StatsUnavailable("gone", errno.ENOTCONN)

    monkeypatch.setattr(mount, "read_stats", gone)
    with pytest.raises(mount.MountError) as refused:
        mount.check_daemon_answers("/remote/d")
    assert str(refused.value).endswith("unmount it first (`fusermount3 -u /remote`)")


def test_a_line_with_optional_fields_and_an_escaped_mount_point_is_read_whole(tmp_path: Path) -> None:
    """Optional fields (none, one, several) before the separator, and a mount point with a space, a backslash, a tab
    and a newline (octal escapes; a backslash before digits stays one): each field where it belongs. A guard of the
    reader (the readers before it parsed alike: passes on the old code)."""
    info = tmp_path / "mountinfo"
    info.write_bytes(b"20 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                     b"40 20 0:40 / /srv/a\\040b\\134134\\011c\\012 rw,nosuid shared:1 master:2 propagate_from:3 - "
                     b"fuse.modelfs my\\040bucket rw,user_id=0,group_id=0,allow_other\n"
                     b"41 40 0:41 /sub /srv/a\\040b\\134134\\011c\\012/d rw unbindable - tmpfs tmpfs rw\n")
    listed = mountinfo.mounts(str(info))
    assert [(m.mount_id, m.parent, m.device, m.point, m.fstype, m.options) for m in listed[1:]] == [
        (b"40", b"20", b"0:40", b"/srv/a b\\134\tc\n", b"fuse.modelfs", b"rw,user_id=0,group_id=0,allow_other"),
        (b"41", b"40", b"0:41", b"/srv/a b\\134\tc\n/d", b"tmpfs", b"rw")]
    assert mountinfo.holding(b"/srv/a b\\134\tc\n/x", listed).mount_id == b"40"
    assert mountinfo.holding(b"/srv/a b\\134\tc\n/d/x", listed).mount_id == b"41"
