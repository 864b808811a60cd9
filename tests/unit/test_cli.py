"""The command line in-process: option parsing, the fstab form and the defaults. The real command in a
subprocess (fail-fast cases, help, version) is tests/mount/test_cli_mount.py."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsmount import cli
from fsmount.cli import build_config, expand_mount_options, make_parser
from fsmount.config import (
    ConfigError,
    GiB,
    MiB,
    StoreConfig,
    parse_cache_size,
    parse_mode,
    parse_size,
    parse_ttl,
    virtual_style_ignored,
)


def test_sizes_and_ttls() -> None:
    assert parse_size("8M") == 8 * MiB
    assert parse_size("1G") == GiB
    assert parse_size("1.5G") == int(1.5 * GiB)
    assert parse_size("4096") == 4096
    assert parse_size("512KiB") == 512 * 1024
    with pytest.raises(ConfigError):
        parse_size("lots")
    assert parse_ttl("forever") > 10**8
    with pytest.raises(ConfigError, match="say 'forever'.* or 0"):
        parse_ttl("never")  # "never cached" or "never expires"? It was taken for forever
    assert parse_ttl("2.5") == 2.5
    with pytest.raises(ConfigError):
        parse_ttl("-1")


def test_every_duration_option_refuses_a_unit_with_the_seconds_to_give(capsys: pytest.CaptureFixture[str]) -> None:
    """B630: `--read-timeout 2m` was argparse's "invalid float value: '2m'" where `--metadata-ttl 5m` was told to give
    seconds; each duration option, and its fstab `-o` form, now says which number of seconds to give."""
    for argv, said in ((["mount", "b", "/m", "--read-timeout", "2m"], "--read-timeout: invalid duration '2m': give "
                        "seconds (120 for '2m')"),
                       (["mount", "b", "/m", "-o", "read_timeout=2m"], "--read-timeout: invalid duration '2m'"),
                       (["mount", "b", "/m", "--shared-cache-wait", "1.5 min"], "(90 for '1.5 min')"),
                       (["mount", "b", "/m", "-o", "shared_cache_timeout=soon"], "--shared-cache-timeout: invalid "
                        "duration 'soon': give seconds (120 is two minutes)"),
                       (["prefetch", "/m", "--write-wait", "1h"], "--write-wait: invalid duration '1h': give seconds "
                        "(3600 for '1h')"),
                       (["mount", "b", "/m", "--metadata-ttl", "5m"], "invalid TTL '5m': give seconds (300 for '5m') "
                        "or 'forever'"),
                       (["mount", "b", "/m", "-o", "metadata_ttl=5m"], "invalid TTL '5m': give seconds (300 for"),
                       (["cleanup", "b", "--older-than", "2d"], "invalid age '2d': give seconds (172800 for '2d')")):
        with pytest.raises(SystemExit):
            make_parser().parse_args(expand_mount_options(argv))
        err = capsys.readouterr().err
        assert said in err and "float" not in err, err
    args = make_parser().parse_args(["mount", "b", "/m", "--read-timeout", "30", "--shared-cache-wait", "0.5"])
    assert (args.read_timeout, args.shared_cache_wait) == (30.0, 0.5)


def test_fstab_options_expand_and_generic_ones_are_ignored() -> None:
    argv = expand_mount_options(["mount", "b", "/m", "-o",
                                 "ro,rw,defaults,_netdev,nofail,noauto,user,nodev,nosuid,noexec,allow_other,"
                                 "endpoint_url=http://h:1,prefix=llama/,cache_dir=/nvme/x,nonempty,x-systemd.requires=a"])
    assert argv == ["mount", "b", "/m", "--mount-ro", "--allow-other", "--endpoint-url=http://h:1", "--prefix=llama/",
                    "--cache-dir=/nvme/x", "--allow-non-empty"]
    args = make_parser().parse_args(argv)
    cfg = build_config(args)
    assert cfg.allow_other and cfg.store.prefix == "llama/" and cfg.store.endpoint_url == "http://h:1"
    assert not cfg.writable


def test_every_generic_mount_option_mount_passes_on_is_ignored() -> None:
    """mount(8) and mount.fuse3 pass an fstab line's filesystem-independent options on as written (with `dev,suid`
    added): `defaults,noatime,lazytime` reached modelfs as `rw,noatime,lazytime,dev,suid` and failed the mount with
    "unknown mount option 'lazytime'" (B261)."""
    generic = ("rw,noatime,lazytime,nolazytime,dirsync,iversion,noiversion,mand,nomand,nosymfollow,norelatime,"
               "nostrictatime,dev,suid")
    assert expand_mount_options(["mount", "b", "/m", "-o", f"{generic},endpoint_url=http://h:1"]) == [
        "mount", "b", "/m", "--endpoint-url=http://h:1"]
    with pytest.raises(ConfigError, match="unknown mount option 'context'"):  # a label asked for is not left off
        expand_mount_options(["mount", "b", "/m", "-o", "context=system_u:object_r:tmp_t:s0"])


def test_a_remount_is_said_to_need_an_unmount_not_called_an_unknown_option() -> None:
    """`mount -o remount,noatime /models` (to apply an edited fstab line) reaches modelfs through mount.fuse3 as
    `modelfs BUCKET /models -o ro,remount,noatime,...,dev,suid`, which said "unknown mount option 'remount'" (B264)."""
    with pytest.raises(ConfigError, match=r"cannot change the options of a mount it serves \(-o remount\): unmount it "
                                          r"and mount it again"):
        expand_mount_options(["b", "/models", "-o", "ro,remount,noatime,endpoint_url=http://h:1,dev,suid"])


def test_an_unknown_fstab_option_is_named_as_written() -> None:
    """argparse named `--bogus-opt 1`, a flag the user never typed, under the top-level usage line."""
    with pytest.raises(ConfigError, match=r"unknown mount option 'bogus_opt' in -o ro,bogus_opt=1"):
        expand_mount_options(["mount", "b", "/m", "-o", "ro,bogus_opt=1"])
    assert expand_mount_options(["mount", "b", "/m", "-o", "cache-dir=/x,allow_other"]) == [
        "mount", "b", "/m", "--cache-dir=/x", "--allow-other"]


def test_fstab_options_abbreviated_as_earlier_versions_took_them_still_mount() -> None:
    """Earlier versions passed -o keys on to argparse, which takes a unique prefix: an fstab line with
    `endpoint=...,addressing=path,metadata=forever` mounted, and after an upgrade the node failed to mount at boot.
    A unique prefix is taken again; an ambiguous one names the options it could be."""
    argv = expand_mount_options(["mount", "b", "/m", "-o", "endpoint=http://h:1,addressing=path,metadata=forever"])
    assert argv == ["mount", "b", "/m", "--endpoint-url=http://h:1", "--addressing-style=path",
                    "--metadata-ttl=forever"]
    cfg = build_config(make_parser().parse_args(argv))
    assert cfg.store.endpoint_url == "http://h:1" and cfg.store.addressing_style == "path"
    with pytest.raises(ConfigError, match=r"unknown mount option 'cache' in -o cache=/x \(could be cache_dir, "
                                          r"cache_size\)"):
        expand_mount_options(["mount", "b", "/m", "-o", "cache=/x"])
    assert expand_mount_options(["mount", "b", "/m", "-o", "max_conn=32,endp=http://h:1"])[3:] == [
        "--max-connections=32", "--endpoint-url=http://h:1"]  # any unique prefix, as argparse took it
    # Never an internal option, nor libfuse's own: max_read= is not max_readahead= (a 128 KiB read-ahead, silently).
    for opts in ("ready=7", "ready_fd=7", "mount_ro"):
        with pytest.raises(ConfigError, match=f"unknown mount option '{opts.partition('=')[0]}'"):
            expand_mount_options(["mount", "b", "/m", "-o", opts])
    with pytest.raises(ConfigError, match="mount option 'max_read' .* is libfuse's"):
        expand_mount_options(["mount", "b", "/m", "-o", "max_read=131072"])


def test_a_libfuse_option_of_another_filesystems_fstab_line_names_modelfs_s_own() -> None:
    """`-o umask=022` (an s3fs line) was refused with "modelfs sets it itself: leave it out", though modelfs sets no
    umask: left out, the files kept the default modes."""
    for opt, instead in (("umask=022", "use file_mode= and dir_mode="), ("allow_root", "use allow_other"),
                         ("max_background=128", "use fuse_max_background="), ("attr_timeout=60", "use metadata_ttl=")):
        with pytest.raises(ConfigError, match=f"is libfuse's, which modelfs does not take: {instead}"):
            expand_mount_options(["mount", "b", "/m", "-o", opt])
    with pytest.raises(ConfigError, match="is libfuse's, and modelfs sets it itself"):
        expand_mount_options(["mount", "b", "/m", "-o", "default_permissions"])


def test_a_fstab_flag_with_a_value_or_an_option_without_one_is_named() -> None:
    """`-o allow_other=1` ended in argparse's "unrecognized arguments: 1" under the top-level usage, and
    `-o prefix=-x` in "expected one argument" although `--prefix=-x` works."""
    for opts, message in (("allow_other=1", "mount option 'allow_other' takes no value"),
                          ("writable=false", "mount option 'writable' takes no value"),
                          ("endpoint_url", "mount option 'endpoint_url' needs a value")):
        with pytest.raises(ConfigError, match=message):
            expand_mount_options(["mount", "b", "/m", "-o", opts])
    argv = expand_mount_options(["mount", "b", "/m", "-o", "prefix=-x/"])
    assert build_config(make_parser().parse_args(argv)).store.prefix == "-x/"


def test_a_mistyped_command_is_named_not_mounted_as_a_bucket(capsys: pytest.CaptureFixture[str]) -> None:
    """`modelfs stat /models` tried to mount a bucket named 'stat'; mount(8)'s form (with -o) still mounts."""
    from fsmount.cli import main

    for argv, hint in ((["stat", "/models"], "did you mean stats?"), (["unmout", "/m"], "did you mean unmount?"),
                       (["prefech", "/m"], "did you mean prefetch?")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"unknown command {argv[0]!r} ({hint})" in err and f"modelfs mount {argv[0]} MOUNTPOINT" in err, err


def test_an_unknown_word_alone_is_an_unknown_command_listing_the_commands(capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`modelfs bogus` said "modelfs mount: error: the following arguments are required: mountpoint": a word with no
    MOUNTPOINT after it was taken for the fstab form's bucket (B1084). It is an unknown command, the commands listed;
    a bucket and a MOUNTPOINT, with -o or without, still mount."""
    from fsmount.cli import main

    for argv in (["bogus"], ["bogus", "--json"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == ("modelfs: unknown command 'bogus': the commands are mount, unmount, umount, cache, prefetch, "
                       "stats, cleanup (modelfs --help); to mount a bucket of that name: modelfs mount bogus "
                       "MOUNTPOINT\n"), err
    mounted: list[tuple[str, str]] = []
    monkeypatch.setattr(cli, "cmd_mount", lambda args, argv: mounted.append((args.bucket, args.mountpoint)) or 0)
    assert main(["bogus", "/models"]) == 0 and main(["bogus", "/models", "-o", "ro"]) == 0
    assert main(["bogus", "-o", "ro", "/models"]) == 0
    assert mounted == [("bogus", "/models")] * 3


def test_an_unknown_argument_is_said_by_the_command_whose_help_lists_its_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    """B231: `modelfs stats --jsn /models` said "modelfs: error: unrecognized arguments: --jsn (see modelfs --help)",
    and `modelfs --help` lists no command's options; an extra word after a command's arguments the same."""
    from fsmount.cli import main

    for argv, command, unknown in ((["stats", "--jsn", "/models"], "stats", "--jsn"),
                                   (["prefetch", "--bogus", "/m/a"], "prefetch", "--bogus"),
                                   (["cleanup", "b", "x"], "cleanup", "x"),
                                   (["cache", "stats", "/c", "x"], "cache", "x"),
                                   (["umount", "/m", "/n"], "unmount", "/n"),
                                   (["mount", "b", "/m", "--bogus"], "mount", "--bogus"),
                                   (["b", "/m", "x", "-o", "ro"], "mount", "x")):  # the fstab form is a mount
        with pytest.raises(SystemExit) as raised:
            main(argv)
        err = capsys.readouterr().err
        assert raised.value.code == 2 and err == (f"modelfs {command}: error: unrecognized arguments: {unknown} "
                                                  f"(see modelfs {command} --help)\n"), err
    # One given before the command is the top-level parser's (not the command's, whose help does not list it).
    for argv in (["--bogus"], ["--bogus", "stats", "/models"]):
        with pytest.raises(SystemExit) as raised:
            main(argv)
        err = capsys.readouterr().err
        assert raised.value.code == 2, err
        assert err == "modelfs: error: unrecognized arguments: --bogus (see modelfs --help)\n", err


def test_a_bucket_named_like_a_command_mounts_in_the_fstab_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """mount(8) runs `modelfs BUCKET MOUNTPOINT -o OPTS`: an fstab line of a bucket named `cache` (or `stats`, ...)
    ran `modelfs cache`, which failed with "invalid choice: '/models'". Without -o the command is still run."""
    from fsmount.cli import main

    mounted: list[tuple[str, str]] = []
    monkeypatch.setattr(cli, "cmd_mount", lambda args, argv: mounted.append((args.bucket, args.mountpoint)) or 0)
    names = ("cache", "stats", "prefetch", "cleanup", "unmount", "umount")
    for name in names:
        assert main([name, "/models", "-o", "ro,endpoint_url=http://127.0.0.1:9000"]) == 0
    assert mounted == [(name, "/models") for name in names]
    monkeypatch.setattr(cli, "cmd_stats", lambda args: 7)
    monkeypatch.setattr(cli, "cmd_prefetch", lambda args: 8)
    assert main(["stats", "/models"]) == 7
    assert main(["prefetch", "/models/a", "--", "-odd-name"]) == 8  # a path like an option is still a path


def test_virtual_addressing_of_an_ip_endpoint_is_named() -> None:
    """botocore addresses an IP endpoint with path style whatever --addressing-style says (a bucket cannot be a
    host name under an address); a DNS name, `localhost` included, does get virtual-hosted requests."""
    assert virtual_style_ignored("http://10.0.0.5:9000", "virtual") == "10.0.0.5"
    assert virtual_style_ignored("https://[fd00::1]/", "virtual") == "fd00::1"
    for url, style in (("http://10.0.0.5:9000", "auto"), ("http://10.0.0.5:9000", "path"),
                       ("https://oss-cn-hangzhou.aliyuncs.com", "virtual"), ("http://localhost:9000", "virtual"),
                       (None, "virtual")):
        assert virtual_style_ignored(url, style) is None, (url, style)


def test_a_prefix_with_empty_dot_or_dotdot_segments_is_refused() -> None:
    for prefix in ("dir//", "a//b", "./dir", "dir/../st", "..", "a/./"):
        with pytest.raises(ConfigError, match="path segments may not be empty"):
            build_config(make_parser().parse_args(["mount", "b", "/mnt", "--prefix", prefix]))
    for prefix, normal in (("/llama", "llama/"), ("llama/", "llama/"), ("a/b.c", "a/b.c/"), ("/", "")):
        assert build_config(make_parser().parse_args(["mount", "b", "/mnt", "--prefix", prefix])).store.prefix \
            == normal


def test_flags_a_new_user_gets_wrong_are_refused_with_the_fix() -> None:
    def config(*argv: str):  # noqa: ANN202
        return build_config(make_parser().parse_args(["mount", *argv]))

    for bucket, hint in (("s3://models/llama-3", "give the bucket's name alone ('models') and --prefix llama-3"),
                         ("oss://models", "give the bucket's name alone ('models')"),
                         ("models/llama-3", "a path inside the bucket is --prefix")):
        with pytest.raises(ConfigError, match=re.escape(hint)):
            config(bucket, "/mnt")
    with pytest.raises(ConfigError, match="permission bits only"):
        parse_mode("4755")
    assert config("b", "/mnt", "--file-mode", "0640").file_mode == 0o640


def test_an_endpoint_without_a_scheme_is_refused_with_one(capsys: pytest.CaptureFixture[str]) -> None:
    for text, said in (("127.0.0.1:9000", "e.g. http://127.0.0.1:9000"), ("ftp://host", "not an http:// or")):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["mount", "b", "/mnt", "--endpoint-url", text])
        assert said in capsys.readouterr().err
    assert make_parser().parse_args(["mount", "b", "/mnt", "--endpoint-url", "https://s3.example.com/"]).endpoint_url


def test_an_endpoint_that_is_no_url_is_named_so(capsys: pytest.CaptureFixture[str]) -> None:
    """An unclosed IPv6 bracket was "invalid _endpoint_url value" (argparse naming the parser function), and a port
    out of range or not a number passed the CLI to fail in botocore."""
    for text, said in (("http://[::1", "Invalid IPv6 URL"), ("http://host:99999", "Port out of range"),
                       ("http://host:abc", "Port could not be cast")):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["mount", "b", "/mnt", "--endpoint-url", text])
        err = capsys.readouterr().err
        assert f"{text!r} is not a URL: {said}" in err and "_endpoint_url" not in err, err
    assert make_parser().parse_args(["mount", "b", "/mnt", "--endpoint-url", "http://[::1]:9000"]).endpoint_url


def test_an_endpoint_refused_never_shows_the_credentials_in_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Credentials in the endpoint URL are refused so that they stay out of the logs, yet an endpoint refused for its
    port or scheme was echoed whole: the secret of `MODELFS_OPTS` in a unit's environment file went to the journal."""
    for text in ("https://AKIAKEY:s3cr3t@host:99999", "http://AKIAKEY:s3cr3t@[::1", "s3://AKIAKEY:s3cr3t@host",
                 "https://AKIAKEY:s3cr3t@host", "AKIAKEY:s3cr3t@host:9000", "http://AKIAKEY:s3@cr3t@host:0x"):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["mount", "b", "/mnt", "--endpoint-url", text])
        err = capsys.readouterr().err
        assert "--endpoint-url" in err and "cr3t" not in err and "AKIAKEY" not in err, err


def test_ro_and_writable_together_are_refused() -> None:
    """`-o ro,writable` used to give a read-write mount without a word."""
    writable = make_parser().parse_args(expand_mount_options(["mount", "b", "/m", "-o", "rw,writable"]))
    assert build_config(writable).writable
    both = make_parser().parse_args(expand_mount_options(["mount", "b", "/m", "-o", "ro,writable"]))
    with pytest.raises(ConfigError, match="-o ro and writable contradict"):
        build_config(both)


def test_a_log_file_named_dash_is_refused_not_made() -> None:
    """`--log-file -` (stderr's name to many tools) logged to a file named "-" in the daemon's working directory (`/`
    under systemd), and nothing reached the journal."""
    for argv in (["--log-file", "-"], ["-o", "log_file=-"]):
        with pytest.raises(ConfigError, match="--log-file - is not stderr: leave --log-file out"):
            build_config(make_parser().parse_args(expand_mount_options(["mount", "b", "/m", *argv])))
    assert build_config(make_parser().parse_args(["mount", "b", "/m", "--log-file", "./-x"])).log_file \
        == os.path.abspath("-x")


def test_a_path_flag_s_tilde_is_the_home_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--cache-dir=~/cache` (the shell expands `~` only at a word's start) and fstab's `cache_dir=~/cache` made a
    directory named `~` in the working directory of the caller (`/` at boot) and kept the cache there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for argv in (["--cache-dir=~/cache", "--log-file=~/modelfs.log"],
                 ["-o", "cache_dir=~/cache,log_file=~/modelfs.log"]):
        cfg = build_config(make_parser().parse_args(expand_mount_options(["mount", "b", "/m", *argv])))
        assert (cfg.cache_dir, cfg.log_file) == (str(tmp_path / "cache"), str(tmp_path / "modelfs.log"))


def test_cache_options_that_would_do_nothing_are_refused() -> None:
    """--cache-size without --cache-dir, or too small for one chunk, used to be accepted and keep nothing."""
    def cfg(*flags: str):  # noqa: ANN202
        return build_config(make_parser().parse_args(expand_mount_options(["mount", "b", "/m", *flags])))

    for flags in (["--cache-size", "10G"], ["-o", "cache_size=50%"]):
        with pytest.raises(ConfigError, match="--cache-size needs --cache-dir"):
            cfg(*flags)
    with pytest.raises(ConfigError, match="cannot hold one chunk"):
        cfg("--cache-dir", "/nvme/x", "--cache-size", "1K")
    assert cfg("--cache-dir", "/nvme/x", "--cache-size", "8M").cache_size.bytes == 8 * MiB
    assert cfg("--cache-dir", "/nvme/x").cache_size.fraction == 0.8  # the default
    assert cfg("--cache-dir", "/nvme/x", "--cache-size", "50%").cache_size.fraction == 0.5
    # 0% was refused as not "between 0% and 100%".
    for share in ("0%", "101%"):
        with pytest.raises(ConfigError, match=f"cache size '{share}' must be above 0% and at most 100%"):
            parse_cache_size(share)
    assert parse_cache_size("100%").fraction == 1.0


def test_defaults_are_safe() -> None:
    cfg = build_config(make_parser().parse_args(["mount", "b", "/m"]))
    assert not cfg.allow_other
    assert cfg.chunk_size == 8 * MiB and cfg.store.max_connections == 16
    assert cfg.memory_limit <= 2 * GiB
    assert cfg.file_mode == 0o444


def test_the_default_memory_limit_in_a_tiny_cgroup_is_four_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenth of a 200 MiB pod is less than the daemon works with: it starts with four chunks, and the
    option's own check still refuses less when asked for."""
    import fsmount.config

    monkeypatch.setattr(fsmount.config, "usable_ram", lambda: 200 * MiB)
    assert build_config(make_parser().parse_args(["mount", "b", "/m"])).memory_limit == 32 * MiB
    assert build_config(make_parser().parse_args(["mount", "b", "/m", "--chunk-size", "16M"])).memory_limit == 64 * MiB
    with pytest.raises(ConfigError, match="at least 4 chunks"):
        build_config(make_parser().parse_args(["mount", "b", "/m", "--memory-limit", "20M"]))


def test_the_kernel_window_is_at_most_an_eighth_of_the_chunk_memory() -> None:
    """A reader keeps two kernel windows of READs requested, and their chunks must fit beside what is fetched
    ahead of them: --kernel-readahead is lowered where the memory is small, never raised."""
    def window(*flags: str) -> int:
        return build_config(make_parser().parse_args(["mount", "b", "/m", *flags])).kernel_window

    assert window("--memory-limit", "2G") == 16 * MiB
    assert window("--memory-limit", "256M") == 16 * MiB  # 160 MiB of chunk memory
    assert window("--memory-limit", "128M") == 4 * MiB  # 32 MiB
    assert window("--memory-limit", "104M", "--chunk-size", "1M") == 1 * MiB  # 8 MiB
    assert window("--memory-limit", "2G", "--kernel-readahead", "4M") == 4 * MiB


def test_prefetch_waits_for_the_daemons_pending_cache_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`modelfs prefetch` returns once the daemon wrote what it fetched (its tier writes trail the load),
    and says how many were left when its --write-wait ran out."""
    import fsmount.prefetch_command as pc

    pending = iter([3, 2, 0, 5])
    monkeypatch.setattr(pc, "pending_writes", lambda mountpoint: next(pending))
    monkeypatch.setattr(pc, "mount_of", lambda path: ("/models", "fuse.modelfs"))
    monkeypatch.setattr(pc, "WRITES_POLL_S", 0.0)
    said: list[str] = []
    assert pc.wait_for_writes(["/models/m"], 60.0, say=said.append) == 0
    assert said == ["waiting for 3 fetched chunks to be written to the cache levels"]
    pending = iter([1, 0])  # one chunk: it was "waiting for 1 fetched chunks"
    said.clear()
    assert pc.wait_for_writes(["/models/m"], 60.0, say=said.append) == 0
    assert said == ["waiting for 1 fetched chunk to be written to the cache levels"]
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(pc, "pending_writes", lambda mountpoint: 7)
    assert pc.wait_for_writes(["/models/m", "/models/n"], 5.0, clock=clock) == 7


def test_prefetch_finds_its_mount_under_any_name(tmp_path) -> None:  # noqa: ANN001
    """mountinfo escapes a space, tab, newline and backslash as octal and leaves UTF-8 as it is: a mount at
    ".../mnt-tü" was decoded as latin-1 and `modelfs prefetch` called it "not on a modelfs mount"."""
    import fsmount.prefetch_command as pc

    names = ["mnt-tü", "mnt with space", "mnt\\back", "mnt\ttab"]
    lines = [b"22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/root rw\n"]
    for i, name in enumerate(names):
        (tmp_path / name).mkdir()
        escaped = os.fsencode(str(tmp_path / name)).replace(b"\\", b"\\134").replace(b" ", b"\\040")
        escaped = escaped.replace(b"\t", b"\\011")
        lines.append(b"%d 22 0:%d / %s rw,nosuid - fuse.modelfs models rw\n" % (40 + i, 50 + i, escaped))
    info = tmp_path / "mountinfo"
    info.write_bytes(b"".join(lines))
    for name in names:
        inner = tmp_path / name / "model.safetensors"
        assert pc.mount_of(str(inner), str(info)) == (str(tmp_path / name), "fuse.modelfs"), name
    assert pc.mount_of(str(tmp_path), str(info)) == ("/", "ext4")


def test_resolve_unasked_is_realpath_without_asking_a_modelfs_mount(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """`modelfs unmount LINK` resolved a symlink to a mount with realpath, whose lstat of the mount's root went to its
    daemon: a stopped or hung one never answered, and `unmount --stale` (the unit's start) hung (B343).
    `resolve_unasked` gives what realpath gives, reading no link at a mount point or in a modelfs mount."""
    import fsmount.prefetch_command as pc

    (tmp_path / "mnt").mkdir()
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "to-mnt").symlink_to(tmp_path / "mnt")
    (tmp_path / "d" / "up").symlink_to("../to-mnt")  # relative, through another link
    (tmp_path / "d" / "e" / "there").symlink_to("../../d/up/llama")
    (tmp_path / "dangling").symlink_to("mnt/typo")
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path / "d")
    info = tmp_path / "mountinfo"
    info.write_bytes(b"22 1 0:21 / / rw - ext4 /dev/root rw\n")
    for path in ["../to-mnt", str(tmp_path / "d/up"), str(tmp_path / "d/e/there"), "e/../up/x/../y",
                 str(tmp_path / "dangling"), "./up/", str(tmp_path / "d/e/there/..")]:
        assert pc.resolve_unasked(path, str(info)) == os.path.realpath(path), path
    assert pc.resolve_unasked(str(tmp_path / "loop" / "x"), str(info)).endswith("/loop/x")  # ends
    info.write_bytes(info.read_bytes() + b"40 22 0:50 / %s rw - fuse.modelfs m rw\n" % os.fsencode(tmp_path / "mnt"))
    asked: list[str] = []
    real_readlink = os.readlink

    def readlink(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        asked.append(str(path))
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", readlink)
    assert pc.resolve_unasked(str(tmp_path / "d/e/there"), str(info)) == str(tmp_path / "mnt" / "llama")
    assert pc.resolve_unasked(str(tmp_path / "mnt/a/../b"), str(info)) == str(tmp_path / "mnt" / "b")
    assert not [path for path in asked if path == str(tmp_path / "mnt") or path.startswith(f"{tmp_path}/mnt/")], asked


def test_unmount_of_another_user_s_mount_says_whose_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path,  # noqa: ANN001
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """fusermount3 answers a user other than root who unmounts someone else's mount "entry for M not found in
    /etc/mtab", though it is there for all to see: the user is told whose mount it is (B182)."""
    import fsmount.prefetch_command as pc
    from fsmount.cli import main

    mp = tmp_path / "models"
    info = tmp_path / "mountinfo"
    info.write_bytes(b"22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/root rw\n"
                     b"40 22 0:50 / %s rw,nosuid - fuse.modelfs models ro,user_id=0,group_id=0,default_permissions\n"
                     % os.fsencode(str(mp)))
    assert pc.mount_owner(str(mp), str(info)) == 0
    assert pc.mount_owner(str(tmp_path), str(info)) is None
    info.write_bytes(info.read_bytes() + b"41 40 0:51 / %s rw - fuse.modelfs other rw,user_id=4242,group_id=4242\n"
                     % os.fsencode(str(mp)))
    assert pc.mount_owner(str(mp), str(info)) == 4242  # the topmost
    real_mount_of, real_owner = pc.mount_of, pc.mount_owner
    monkeypatch.setattr(pc, "mount_of", lambda path, mountinfo=None, resolve=True: real_mount_of(path, str(info),
                                                                                                 resolve))
    monkeypatch.setattr(pc, "mount_owner", lambda path: real_owner(path, str(info)))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: ran.append(a) or subprocess.CompletedProcess(a, 0))
    mp.mkdir()
    assert main(["unmount", str(mp)]) == 1
    assert ("cannot unmount " + str(mp) + ": it is the mount of uid 4242, and only that user or root may unmount it"
            in capsys.readouterr().err) and not ran
    monkeypatch.setattr(os, "getuid", lambda: 4242)  # their own: fusermount3 is asked
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    assert main(["unmount", str(mp)]) == 0 and ran


def test_another_user_s_mount_without_allow_other_is_said_closed(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path) -> None:  # noqa: ANN001
    """The reason of an EACCES on another user's modelfs mount made without --allow-other (B183)."""
    import fsmount.prefetch_command as pc

    mp = tmp_path / "models"
    info = tmp_path / "mountinfo"
    line = b"40 22 0:50 / %s rw,nosuid - fuse.modelfs models ro,user_id=0,group_id=0%s\n"
    info.write_bytes(b"22 1 0:21 / / rw - ext4 /dev/root rw\n" + line % (os.fsencode(str(mp)), b""))
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    assert pc.closed_to_you(str(mp / "m" / "x"), str(info)).startswith(
        f"{mp} is the modelfs mount of root (uid 0), made without --allow-other, so no other user may enter it")
    assert pc.closed_to_you(str(tmp_path), str(info)) == ""  # not on the mount
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert pc.closed_to_you(str(mp), str(info)) == ""  # its owner
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    info.write_bytes(b"22 1 0:21 / / rw - ext4 /dev/root rw\n" + line % (os.fsencode(str(mp)), b",allow_other"))
    assert pc.closed_to_you(str(mp), str(info)) == ""  # open to all: EACCES is the modes'


def test_prefetch_reads_small_files_side_by_side(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """--threads applies across files: one file at a time, 3000 files of 4 KB took 14 s. Every byte is still
    read, and a failing file is named."""
    import threading
    import time

    import fsmount.prefetch_command as pc

    for i in range(16):
        (tmp_path / f"f{i:02d}").write_bytes(bytes([i]) * 4096)
    monkeypatch.setattr(pc, "mount_fstype", lambda path: pc.MODELFS_FSTYPE)
    lock, now, most = threading.Lock(), [0], [0]
    real_pread = os.pread

    def slow_pread(fd: int, n: int, offset: int) -> bytes:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)
        with lock:
            now[0] -= 1
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", slow_pread)
    fds_before = len(os.listdir("/proc/self/fd"))
    assert pc.warm([str(tmp_path)], threads=4, progress=False) == 16 * 4096
    assert most[0] >= 3, most  # files side by side (one at a time: 1)
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(pc.WarmError, match=r"16 of 16 files could not be read \(.*f00: Input/output error.*; "
                                           r"and 11 more\)$"):  # not "; the other 0 were" (B234)
        pc.warm([str(tmp_path)], threads=4, progress=False)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no descriptor left open
    # A file that fails (one that cannot be opened, here) does not stop the others: a stale shard left a fleet
    # warm-up mostly cold.
    monkeypatch.setattr(os, "pread", real_pread)
    real_open = os.open

    def open_but_f03(path: str, flags: int, *args: int) -> int:
        if str(path).endswith("f03"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_but_f03)
    with pytest.raises(pc.PartlyWarmed, match=r"1 of 16 files could not be read \(.*f03: Permission denied\); the "
                                             r"other 15 were read$") as partly:
        pc.warm([str(tmp_path)], threads=4, progress=False)
    assert partly.value.done == 15 * 4096
    # With a path given that is not found: it is counted as a path, not as one of the files (B1085).
    gone = str(tmp_path / "renamed")
    with pytest.raises(pc.PartlyWarmed, match=rf"^1 of 2 paths given was not read and 1 of 16 files could not be "
                                             rf"read \({re.escape(gone)}: no such file or directory; .*f03: "
                                             r"Permission denied\); the other 15 files were read$"):
        pc.warm([gone, str(tmp_path)], threads=4, progress=False)


def test_cache_help_says_what_clear_removes_beside_the_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    """`modelfs cache --help` said "clear: delete every chunk": it also deletes the names kept in names/, with which a
    mount started while the origin is unreachable comes up (README "While the origin is unreachable"), and the copies
    a killed --writable mount left in writes/; and verify also deletes chunks of another version's format (B145)."""
    with pytest.raises(SystemExit) as done:
        cli.main(["cache", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "clear: delete every chunk, and with them the copies a killed --writable mount left in writes/ and the " \
           "names mounts learnt in names/" in text, text
    assert "and those of another version's format" in text
    assert "`rm -rf CACHE_DIR/chunks` frees its disk then" in text


def test_prefetch_of_several_paths_warms_the_others_when_one_is_not_found(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path) -> None:  # noqa: ANN001
    """`modelfs prefetch A B C` with B not in the bucket (a shard renamed since the warm-up script was written) read
    nothing at all, A and C included: a path not found stopped the command before any read, where the README says a
    file it cannot read does not stop the others. Now B is named at the end (exit 1) and A and C are warmed; a prefetch
    of nothing that can be found still fails at once. B is counted as a path given, not as a file: a directory
    (or a local copy's path, not on a mount) was called one of the "files" that could not be read (B1085)."""
    import fsmount.prefetch_command as pc

    monkeypatch.setattr(pc, "mount_fstype", lambda path: pc.MODELFS_FSTYPE)
    (tmp_path / "model").mkdir()
    for i in range(3):
        (tmp_path / "model" / f"shard-{i}").write_bytes(bytes([i]) * (4096 + i))
    (tmp_path / "config.json").write_bytes(b"{}")
    gone = str(tmp_path / "renamed-shard")
    with pytest.raises(pc.PartlyWarmed, match=rf"^1 of 3 paths given was not read \({re.escape(gone)}: no such file "
                                             r"or directory\); 4 files were read$") as partly:
        pc.warm([str(tmp_path / "model"), gone, str(tmp_path / "config.json")], threads=2, progress=False)
    assert partly.value.done == 3 * 4096 + 3 + 2
    with pytest.raises(pc.PartlyWarmed, match=r"^1 of 2 paths given was not read \(.*\); one file was read$"):
        pc.warm([gone, str(tmp_path / "config.json")], threads=2, progress=False)  # not "the other 1 were" (B234)
    with pytest.raises(pc.WarmError, match=rf"^{re.escape(gone)}: no such file or directory$") as alone:
        pc.warm([gone], threads=2, progress=False)
    assert not isinstance(alone.value, pc.PartlyWarmed)


def test_prefetch_of_many_paths_none_found_names_a_few(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path) -> None:  # noqa: ANN001
    """`modelfs prefetch` of a warm-up list gone stale (a model renamed: none of its 60 shards is there) failed with
    every path named in one line, where a prefetch names 5 failures and counts the rest."""
    import fsmount.prefetch_command as pc

    monkeypatch.setattr(pc, "mount_fstype", lambda path: pc.MODELFS_FSTYPE)
    gone = [str(tmp_path / f"shard-{i:05d}") for i in range(60)]
    with pytest.raises(pc.WarmError) as failed:
        pc.warm(gone, threads=2, progress=False)
    assert not isinstance(failed.value, pc.PartlyWarmed)
    assert str(failed.value) == "; ".join(f"{p}: no such file or directory" for p in gone[:pc.FAILURES_NAMED]) + \
        f"; and {60 - pc.FAILURES_NAMED} more"


def test_prefetch_reads_a_file_named_through_a_symlink_and_by_its_path_once(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path) -> None:  # noqa: ANN001
    """`modelfs prefetch ~/models /models` with ~/models a symlink to the mount read every file twice and counted it
    twice: files were told apart by their absolute path, not by where they are."""
    import fsmount.prefetch_command as pc

    (tmp_path / "mnt" / "sub").mkdir(parents=True)
    (tmp_path / "mnt" / "sub" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "mnt" / "b").write_bytes(b"y" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "mnt")
    monkeypatch.setattr(pc, "mount_fstype", lambda path: pc.MODELFS_FSTYPE)
    for paths in (["link", "mnt"], ["link/sub", "mnt"], ["link/sub/a", "mnt/sub/a", "mnt/b", "link"]):
        assert pc.warm([str(tmp_path / p) for p in paths], progress=False) == 1010, paths


def test_prefetch_with_more_threads_than_descriptors_waits_for_one(tmp_path) -> None:  # noqa: ANN001
    """--threads keeps that many files open: above `ulimit -n`, every file past the limit failed with EMFILE
    instead of waiting for a file before it to finish. (A child process: the limit is the process's.)"""
    import textwrap

    for i in range(300):
        (tmp_path / f"f{i:04d}").write_bytes(b"x" * 100)
    script = textwrap.dedent(f"""
        import resource
        import fsmount.prefetch_command as pc
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        pc.mount_fstype = lambda path: pc.MODELFS_FSTYPE
        print(pc.warm([{str(tmp_path)!r}], threads=256, progress=False))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == [str(300 * 100)], res.stdout + res.stderr[-2000:]


def test_a_user_without_dev_fuse_or_user_allow_other_is_told_which(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path) -> None:  # noqa: ANN001
    """As a user other than root, libfuse fails with "fuse_session_mount failed" alone (and a background mount
    loses its line saying why): the pre-flight names the missing piece. What only an operator mends (/dev/fuse
    missing, fusermount3 not installed, no user_allow_other) is a SettingError, exit 2 (B1081, B1082); a /dev/fuse
    this user may not open, which udev may yet give its mode, a MountError, exit 1."""
    from fsmount import mount
    from fsmount.mount import MountError, SettingError, check_fuse_available

    if not os.path.exists(mount.FUSE_DEVICE):
        pytest.skip("no /dev/fuse here")
    conf = tmp_path / "fuse.conf"
    conf.write_text("# user_allow_other\nmount_max = 1000\n")
    monkeypatch.setattr(mount.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != mount.FUSE_DEVICE and real_access(path, mode))
    with pytest.raises(MountError, match="cannot open /dev/fuse: permission denied") as denied:
        check_fuse_available(False, str(conf))
    assert not isinstance(denied.value, SettingError)
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    check_fuse_available(False, str(conf))
    with pytest.raises(SettingError, match="needs 'user_allow_other' in"):
        check_fuse_available(True, str(conf))
    with pytest.raises(SettingError, match="needs 'user_allow_other' in"):
        check_fuse_available(True, str(tmp_path / "missing.conf"))
    conf.write_text("mount_max = 1000\n  user_allow_other  # for --allow-other\n")
    check_fuse_available(True, str(conf))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    check_fuse_available(True, str(tmp_path / "missing.conf"))  # root needs no user_allow_other
    monkeypatch.setattr(mount.shutil, "which", lambda name: None)
    with pytest.raises(SettingError, match="fusermount3 not found"):
        check_fuse_available(False, str(conf))
    monkeypatch.setattr(mount, "FUSE_DEVICE", str(tmp_path / "fuse"))
    with pytest.raises(SettingError, match="fuse is missing: load the fuse kernel module"):
        check_fuse_available(False, str(conf))


def test_a_user_is_told_fusermount3_refuses_a_mountpoint_they_may_not_write_or_a_sticky_one_of_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """fusermount3 refuses a user other than root a mountpoint they cannot write, or a sticky directory they do not
    own; a background mount lost its line saying so, and the user read "fuse_session_mount failed" (B180). Only a
    chmod or chown mends either: a SettingError, exit 2 (B1080)."""
    from fsmount import mount
    from fsmount.mount import SettingError, check_mountpoint

    mp = tmp_path / "mnt"
    mp.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    status = tmp_path / "status"  # no CAP_SYS_ADMIN (this test's root has it): mounts through fusermount3
    status.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    real_mounts_by_itself = mount.mounts_by_itself
    monkeypatch.setattr(mount, "mounts_by_itself", lambda: real_mounts_by_itself(str(status)))
    real_access = os.access
    writable = {"yes": False}
    monkeypatch.setattr(os, "access", lambda path, mode: (writable["yes"] or not mode & os.W_OK)
                        and real_access(path, mode))
    with pytest.raises(SettingError, match=r"is not writable by you \(uid 1000\): fusermount3"):
        check_mountpoint(str(mp), False)
    writable["yes"] = True
    mp.chmod(0o1777)  # owned by the test's uid, not 1000
    with pytest.raises(SettingError, match="is a sticky directory you do not own"):
        check_mountpoint(str(mp), False)
    monkeypatch.setattr(os, "getuid", lambda: mp.stat().st_uid)
    os.close(check_mountpoint(str(mp), False)[1])
    mp.chmod(0o755)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    os.close(check_mountpoint(str(mp), False)[1])
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root mounts by itself: neither rule
    writable["yes"] = False
    mp.chmod(0o1777)
    os.close(check_mountpoint(str(mp), False)[1])
    assert mount.check_user_may_mount_on(str(mp), str(mp)) is None
    # Nor a user with CAP_SYS_ADMIN (systemd's AmbientCapabilities=): libfuse mounts with mount(2), fusermount3 is not
    # asked, and root's directory was refused though it mounted (B205).
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SettingError, match="is a sticky directory you do not own"):
        check_mountpoint(str(mp), False)
    status.write_text("Name:\tx\nCapEff:\t0000000000200000\n")  # CAP_SYS_ADMIN alone
    os.close(check_mountpoint(str(mp), False)[1])
    mp.chmod(0o755)
    os.close(check_mountpoint(str(mp), False)[1])
    assert real_mounts_by_itself(str(tmp_path / "no-status")) is False



STDERR_CAPTURE_CHILD = """
import os, sys
from fsmount.mount import stderr_captured
with stderr_captured() as said:
    os.write(1, b"in the block\\n")
os.write(1, (repr(sys.stderr) + " " + repr(said) + "\\n").encode())
"""


def test_the_mount_s_stderr_capture_needs_no_directory_and_never_fails_the_mount(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """The capture of fusermount3's lines around the mount (B181) is best effort: it made a temporary file, which
    raised out of the mount (a traceback, nothing mounted) where no directory can be written (a container whose root
    filesystem is read-only), where descriptor 2 is closed (Python's sys.stderr is then None), or where the flush of
    sys.stderr fails; and a failed flush at its end left descriptor 2 in the capture for good (B204)."""
    import tempfile

    from fsmount.mount import stderr_captured

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "read-only-root"))  # no temporary file can be made
    before = os.fstat(2)
    with stderr_captured() as said:
        os.write(2, b"fusermount3: mounting over filesystem type 0x858458f6 is forbidden\n\n")
        assert os.fstat(2).st_ino != before.st_ino
    assert said == ["fusermount3: mounting over filesystem type 0x858458f6 is forbidden"]
    assert (os.fstat(2).st_dev, os.fstat(2).st_ino) == (before.st_dev, before.st_ino)

    class FullDisk:
        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def write(self, text: str) -> int:
            return len(text)

    monkeypatch.setattr(sys, "stderr", FullDisk())
    with pytest.raises(KeyError), stderr_captured() as said:  # an error in the block: put back all the same
        os.write(2, b"fuse: said\n")
        raise KeyError("in the block")
    assert (os.fstat(2).st_dev, os.fstat(2).st_ino) == (before.st_dev, before.st_ino) and said == []
    monkeypatch.undo()

    # A daemon started with descriptor 2 closed (`2>&-`): the block runs, uncaptured.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", STDERR_CAPTURE_CHILD], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.close(2), env={**os.environ, "PYTHONPATH": repo})
    assert res.returncode == 0 and res.stdout.splitlines() == ["in the block", "None []"], res.stdout + res.stderr


def test_a_negative_value_is_the_option_s_value_and_its_check_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took `--cache-size -5G` for a missing value ("expected one argument"); joined to its option,
    the size check says what is wrong with it, in the flag form and the -o form alike."""
    assert expand_mount_options(["mount", "b", "/m", "--cache-size", "-5G", "-o", "memory_limit=-1G"]) == [
        "mount", "b", "/m", "--cache-size=-5G", "--memory-limit=-1G"]
    assert expand_mount_options(["mount", "b", "/m", "--read-timeout", "-.5"])[-1] == "--read-timeout=-.5"
    for argv in (["--cache-dir", "/c", "--cache-size", "-5G"], ["-o", "cache_dir=/c,cache_size=-5G"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(expand_mount_options(["mount", "b", "/m", *argv]))
        assert "invalid size '-5G'" in capsys.readouterr().err


def test_an_owner_id_beyond_32_bits_is_refused() -> None:
    """--uid 4294967296 was taken, and the daemon crashed on its first reply (OverflowError) with the user told
    only that it exited before the mount was ready."""
    def config(*argv: str):  # noqa: ANN202
        return build_config(make_parser().parse_args(["mount", "b", "/m", *argv]))

    for flags in (["--uid", "4294967296"], ["--gid", "4294967295"], ["--uid", "-1"]):
        with pytest.raises(ConfigError, match="--uid and --gid must be >= 0 and < 4294967295"):
            config(*flags)
    assert config("--uid", "4294967294", "--gid", "0").uid == 4294967294


def test_a_tier_flag_without_the_tier_is_refused_and_log_levels_take_any_case() -> None:
    """--shared-cache-wait (and the others) without --shared-cache-bucket were ignored without a word, as
    --cache-size without --cache-dir is not; `--log-level DEBUG` was refused."""
    def config(*argv: str):  # noqa: ANN202
        return build_config(make_parser().parse_args(["mount", "b", "/m", *argv]))

    for flags in (["--shared-cache-wait", "3"], ["--shared-cache-read-only"], ["--shared-cache-prefix", "x/"]):
        with pytest.raises(ConfigError, match=f"{flags[0]} needs --shared-cache-bucket"):
            config(*flags)
    assert config("--shared-cache-bucket", "tier", "--shared-cache-wait", "3").shared_cache.wait == 3
    # B235: a --shared-cache-timeout above --read-timeout's bound was taken here and refused by the daemon as
    # "cannot mount: --read-timeout must be > 0 and at most 86400 seconds" (status 1), naming an option not given.
    for flags in (["--shared-cache-timeout", "1e20"], ["--shared-cache-timeout", "inf"], ["--shared-cache-wait", "nan"],
                  ["--shared-cache-wait", "1e20"], ["--shared-cache-timeout", "0"], ["--shared-cache-wait", "-1"]):
        with pytest.raises(ConfigError, match=r"^--shared-cache-wait must be >= 0 and --shared-cache-timeout > 0, "
                                              r"both in seconds and at most 86400$"):
            config("--shared-cache-bucket", "tier", *flags)
    assert config("--shared-cache-bucket", "tier", "--shared-cache-timeout", "86400").shared_cache.timeout == 86400
    assert make_parser().parse_args(["mount", "b", "/m", "--log-level", "DEBUG"]).log_level == "debug"


def test_a_shared_tier_inside_the_mounted_tree_is_refused() -> None:
    """--shared-cache-bucket of the mounted bucket was accepted: its chunk objects showed in the mount, and a
    prefetch of the root read them and wrote chunk objects of them."""
    def config(*argv: str):  # noqa: ANN202
        return build_config(make_parser().parse_args(["mount", "models", "/m", *argv]))

    for flags in (["--shared-cache-bucket", "models"],
                  ["--prefix", "cache/", "--shared-cache-bucket", "models", "--shared-cache-prefix", "cache/tier/"]):
        with pytest.raises(ConfigError, match="the shared tier .* lies inside what the mount shows"):
            config(*flags)
    # B250: a mount of one of the tier's own folders showed its chunk objects (or claims) as files.
    for flags in (["--prefix", "cache/chunks/", "--shared-cache-bucket", "models", "--shared-cache-prefix", "cache/"],
                  ["--prefix", "modelfs/claims", "--shared-cache-bucket", "models"],
                  ["--prefix", "waiting/", "--shared-cache-bucket", "models", "--shared-cache-prefix", "/"]):
        with pytest.raises(ConfigError, match=r"^the mount \(models, prefix '.*'\) lies inside the shared tier's own "
                                              r"objects \(models, prefix '.*': chunks/, claims/, waiting/\)"):
            config(*flags)
    assert config("--prefix", "llama/", "--shared-cache-bucket", "models").shared_cache.prefix == "modelfs/"
    # A mount under the tier's prefix but outside its folders shows none of its objects.
    assert config("--prefix", "modelfs/models/", "--shared-cache-bucket", "models").shared_cache.prefix == "modelfs/"
    assert config("--prefix", "llama/", "--shared-cache-bucket", "models", "--shared-cache-prefix", "/").shared_cache
    assert config("--shared-cache-bucket", "tier").shared_cache.bucket == "tier"
    assert config("--endpoint-url", "http://h:1", "--shared-cache-bucket", "models",
                  "--shared-cache-endpoint-url", "http://other:1").shared_cache.bucket == "models"


def test_a_kernel_readahead_below_one_kib_is_refused() -> None:
    """read_ahead_kb is in KiB: `--kernel-readahead 100` became 0, "leave the kernel's", without a word."""
    def config(*argv: str):  # noqa: ANN202
        return build_config(make_parser().parse_args(["mount", "b", "/m", *argv]))

    for value in ("100", "1023"):
        with pytest.raises(ConfigError, match=r"--kernel-readahead must be 0 \(leave the kernel's\) or at least 1K"):
            config("--kernel-readahead", value)
    assert config("--kernel-readahead", "0").kernel_readahead == 0
    assert config("--kernel-readahead", "1K").kernel_readahead == 1024


def test_a_cache_dir_with_a_symlinked_lock_is_refused_by_name(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`modelfs cache verify` truncated the target of a `lock` symlink to its pid; it says what is wrong."""
    from fsmount.cli import main

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "c" / "chunks").mkdir(parents=True)
    (tmp_path / "c" / "lock").symlink_to(victim)
    assert main(["cache", "verify", str(tmp_path / "c")]) == 1
    assert "lock is a symlink: the lock is a file of the cache dir's own" in capsys.readouterr().err
    assert victim.read_text() == "precious"


def test_ctrl_c_while_the_daemon_is_started_stops_it(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGINT that lands inside Popen, after the daemon's exec, raised KeyboardInterrupt before `proc`
    existed: a traceback, and a detached daemon that nobody stopped (seen once in CI as a flaky
    test_ctrl_c_while_mount_waits_stops_its_daemon). Now the daemon is stopped as for a later Ctrl-C."""
    import signal
    import subprocess
    import types

    from fsmount import cli

    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen_then_ctrl_c(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        # A stand-in daemon that never reports; the Ctrl-C arrives before Popen has returned.
        proc = real_popen(["sleep", "60"], **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGINT)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_then_ctrl_c)
    # As in a terminal: a run started in the background ignores SIGINT, and `modelfs mount` leaves a signal its
    # caller ignores ignored (`nohup`, a script's `cmd &`).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.run_background(types.SimpleNamespace(log_file="log"), []) == 130
        assert started[0].wait(10) == -signal.SIGTERM
        assert "interrupted: the daemon was stopped" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back as it was
    finally:
        signal.signal(signal.SIGINT, before)
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_startup_error_of_several_lines_reaches_the_user_whole(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """botocore's "Parameter validation failed:" spans lines: `modelfs mount` read only the last one, found no
    ERROR there, and said only "run with --foreground to see why"."""
    import subprocess
    import sys
    import types

    from fsmount import cli

    real_popen = subprocess.Popen

    def daemon_that_fails(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        fd = cmd[cmd.index("--ready-fd") + 1]
        report = "WARN early words\nERROR listing bucket 'a b': Parameter validation failed:\nInvalid bucket name\n"
        code = "import os, sys; os.write(int(sys.argv[1]), sys.argv[2].encode()); sys.exit(1)"
        return real_popen([sys.executable, "-c", code, fd, report], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", daemon_that_fails)
    assert cli.run_background(types.SimpleNamespace(log_file="log"), []) == 1
    err = capsys.readouterr().err
    assert "modelfs: warning: early words" in err
    assert "listing bucket 'a b': Parameter validation failed:\nInvalid bucket name" in err, err
    assert "--foreground to see why" not in err


def test_a_write_part_size_too_large_for_the_memory_is_refused_with_the_largest_that_fits() -> None:
    """The refusal said "at most half of --memory-limit's chunk memory" without a number to act on."""
    args = make_parser().parse_args(["mount", "b", "/m", "--writable", "--memory-limit", "256M",
                                     "--write-part-size", "100M"])
    with pytest.raises(ConfigError, match=r"80M here"):
        build_config(args)
    args = make_parser().parse_args(["mount", "b", "/m", "--writable", "--memory-limit", "256M",
                                     "--write-part-size", "80M"])
    assert build_config(args).write_part_size == 80 * MiB


@pytest.mark.parametrize("soft, hard, after, warned", [(64, 4096, 4096, False), (20, 20, 20, True)])
def test_the_daemon_raises_its_open_file_limit_and_warns_when_it_is_still_short(soft: int, hard: int, after: int,
                                                                                 warned: bool) -> None:
    """A daemon at `ulimit -n 16` failed every read at --read-timeout, blaming the endpoint. Its soft limit goes
    up to the hard one (distributions' soft default of 1024 is a leftover of select(2)); a hard one below what the
    mount may hold at once is a warning at start."""
    code = f"""
import logging, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from fsmount.cli import build_config, make_parser
from fsmount.mount import raise_open_file_limit
cfg = build_config(make_parser().parse_args(["mount", "b", "/m", "--cache-dir", "/nonexistent/c"]))
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
raise_open_file_limit(cfg)
print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"soft {after}\n" in out, out
    assert ("WARNING the open-file limit is 20" in out) == warned, out


def test_stats_and_prefetch_of_a_daemon_of_an_older_version_say_so_instead_of_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """After an upgrade the old daemon runs on until it is restarted: the new `modelfs stats` ended in
    `KeyError: 'metadata_requests'` with a traceback, and `modelfs prefetch` in `KeyError: 'cache_writes_pending'`
    with nothing warmed."""
    import fsmount.stats_table
    from fsmount.cli import main
    from fsmount.prefetch_command import WarmError, pending_writes

    older = {"format": 1, "bucket": "models", "uptime_seconds": 5.0,
             "served_bytes": {"memory": 0, "cache": 0, "origin": 0}, "hit_ratio": 0.0,
             "origin": {"requests": 0, "bytes": 0, "errors": 0}}
    monkeypatch.setattr(fsmount.stats_table, "read_stats", lambda mountpoint, timeout=10.0: older)
    assert main(["stats", "/models"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("modelfs: /models: its daemon runs another version of modelfs") and "--json" in err, err
    assert main(["stats", "/models", "--json"]) == 0 and '"bucket": "models"' in capsys.readouterr().out
    with pytest.raises(WarmError, match="another version of modelfs.*--write-wait 0"):
        pending_writes("/models")


def test_the_advised_cleanup_command_names_the_keys_and_the_options_that_reach_the_bucket() -> None:
    from fsmount.config import cleanup_command

    assert cleanup_command(StoreConfig(bucket="b", prefix="run1"), ["run1/a.bin"]) == \
        "modelfs cleanup b --key run1/a.bin --older-than 0"  # the mount's prefix is in the key already
    cfg = StoreConfig(bucket="w", endpoint_url="https://oss-cn-hangzhou.aliyuncs.com", region="cn-hangzhou",
                      profile="team a", addressing_style="virtual")
    line = cleanup_command(cfg, ["x y.bin", "$(rm -rf ~)"])
    assert line == ("modelfs cleanup w --endpoint-url https://oss-cn-hangzhou.aliyuncs.com --region cn-hangzhou "
                    "--profile 'team a' --addressing-style virtual --key 'x y.bin' --key '$(rm -rf ~)' --older-than 0")
    # What it says is what the CLI takes.
    args = make_parser().parse_args(shlex.split(line)[1:])
    assert (args.bucket, args.key, args.profile, args.older_than) == ("w", ["x y.bin", "$(rm -rf ~)"], "team a", 0)


def test_cleanup_of_keys_aborts_exactly_those_and_refuses_a_prefix_beside_them(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import fsmount.cleanup_command
    from fsmount.data import PendingUpload

    pending = {"": ["run1/a.bin", "run1/a.bin.2", "run1/b.bin"]}
    aborted: list[str] = []

    class Uploads:
        def __init__(self, store: object) -> None:
            pass

        def pending(self, prefix: str) -> list[PendingUpload]:
            return [PendingUpload(k, f"id-{k}", None) for k in pending[""] if k.startswith(prefix)]

        def abort(self, key: str, upload_id: str) -> None:
            aborted.append(key)

    monkeypatch.setattr(fsmount.cleanup_command, "Uploads", Uploads)
    monkeypatch.setattr(fsmount.cleanup_command, "Boto3Store", lambda cfg, retries: None)
    assert cli.main(["cleanup", "b", "--key", "run1/a.bin", "--key", "run1/b.bin", "--older-than", "0"]) == 0
    assert aborted == ["run1/a.bin", "run1/b.bin"], aborted  # not run1/a.bin.2, listed under run1/a.bin
    assert capsys.readouterr().out.splitlines()[-1] == "2 incomplete uploads older than 0s; aborted 2"
    assert cli.main(["cleanup", "b", "--key", "run1/a.bin", "--prefix", "run1"]) == 2
    assert capsys.readouterr().err.strip() == "modelfs: --key names whole keys of the bucket: give it without --prefix"


def test_cleanup_says_how_many_young_uploads_it_left_alone(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Run right after a daemon was killed (its uploads an hour old, under the default day), cleanup said only
    "0 incomplete uploads older than 86400s; aborted 0": read as nothing left in the bucket to bill."""
    import datetime

    import fsmount.cleanup_command
    from fsmount.data import PendingUpload

    now = datetime.datetime.now(datetime.UTC)
    ages = {"ckpt/a.bin": 3600, "ckpt/b.bin": 60, "old.bin": 3 * 86400}

    class Uploads:
        def __init__(self, store: object) -> None:
            pass

        def pending(self, prefix: str) -> list[PendingUpload]:
            return [PendingUpload(k, f"id-{k}", now - datetime.timedelta(seconds=age)) for k, age in ages.items()]

        def abort(self, key: str, upload_id: str) -> None:
            pass

    monkeypatch.setattr(fsmount.cleanup_command, "Uploads", Uploads)
    monkeypatch.setattr(fsmount.cleanup_command, "Boto3Store", lambda cfg, retries: None)
    assert cli.main(["cleanup", "b"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "left 2 incomplete uploads begun less than 86400s ago alone (a running mount may be writing them; a smaller "
        "--older-than takes them too)", "1 incomplete upload older than 86400s; aborted 1"]
    assert cli.main(["cleanup", "b", "--older-than", "0"]) == 0
    assert "left" not in capsys.readouterr().out


def test_cleanup_without_credentials_says_what_cleanup_takes(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """It advised --no-sign-request, which `modelfs cleanup` does not take (nor could use: an abort is signed)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert cli.main(["cleanup", "b", "--endpoint-url", "http://127.0.0.1:9", "--region", "us-east-1"]) == 1
    err = capsys.readouterr().err
    assert "no credentials found" in err and "--no-sign-request" not in err and len(err.splitlines()) == 1, err


def test_cache_stats_of_a_cache_dir_whose_chunks_were_removed(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`rm -rf CACHE/chunks` under a live mount (to free the disk): `modelfs cache stats CACHE` said "not a modelfs
    cache directory" (exit 1) until the mount's next put made `chunks/` again. Its `lock` says it is one."""
    (tmp_path / "lock").write_text("12345\n")
    assert cli.main(["cache", "stats", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ["chunks          0", "bytes           0 (0 B)"]
    for other in ("", "build lock of another tool\n"):  # a folder's own `lock` makes it no cache dir
        (tmp_path / "lock").write_text(other)
        assert cli.main(["cache", "clear", str(tmp_path)]) == 1
        assert "is not a modelfs cache directory" in capsys.readouterr().err


def test_cache_commands_of_a_path_that_is_not_there_say_so(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`modelfs cache stats /var/cache/modelfs` with a typo, or before the first mount made the dir, said it "is not a
    modelfs cache directory": the user looked for what was wrong with a directory that is not there (B174). Exit
    status 1 each, as for a directory that is not a cache dir."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for action in ("stats", "verify", "clear"):
        for path, said in ((tmp_path / "missing", f"modelfs: {tmp_path / 'missing'} does not exist: give the "
                                                  "--cache-dir of a mount\n"),
                           (tmp_path / "dangling", f"modelfs: {tmp_path / 'dangling'} does not exist (a symlink to "
                                                   "nothing): give the --cache-dir of a mount\n"),
                           (tmp_path / "afile", f"modelfs: {tmp_path / 'afile'} is not a directory: give the "
                                                "--cache-dir of a mount\n"),
                           (tmp_path, f"modelfs: {tmp_path} is not a modelfs cache directory\n")):
            assert cli.main(["cache", action, str(path)]) == 1, (action, path)
            assert capsys.readouterr().err == said, (action, path)
    assert not (tmp_path / "missing").exists() and not (tmp_path / "gone").exists()


def test_cache_clear_says_it_waits_for_the_daemon_of_a_mount_just_unmounted(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`modelfs unmount X && modelfs cache clear CACHE`: the daemon, unmounted, still writes what it fetched, and clear
    waits for it (up to a minute). It said so only to a logger the CLI never set up: it sat silent, as if hung."""
    import threading

    from fsmount.data.cache_dir import acquire_dir_lock, mark_draining, release_dir_lock

    (tmp_path / "chunks").mkdir()
    held = acquire_dir_lock(str(tmp_path))  # the daemon's, draining
    mark_draining(str(tmp_path))
    done = threading.Timer(0.5, release_dir_lock, (held,))
    done.start()
    try:
        assert cli.main(["cache", "clear", str(tmp_path)]) == 0
    finally:
        done.join()
    out = capsys.readouterr()
    assert out.out == "removed 0 chunk files\n"
    assert out.err.startswith(f"modelfs: cache dir {tmp_path}: waiting for the daemon of the mount before (pid "), out


def test_ctrl_c_in_cache_commands_and_stats_is_one_line_and_exit_130(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`modelfs cache verify` of a big cache and `modelfs stats` of a hung daemon (it waits 10 s) ended Ctrl-C with a
    KeyboardInterrupt traceback; `cleanup`, `prefetch` and `mount` say "interrupted" and exit 130."""
    import fsmount.data
    import fsmount.stats_table

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    (tmp_path / "chunks").mkdir()
    for name in ("cache_verify", "cache_clear", "cache_stats"):
        monkeypatch.setattr(fsmount.data, name, interrupted)
    monkeypatch.setattr(fsmount.stats_table, "read_stats", interrupted)
    for argv, said in ((["cache", "verify", str(tmp_path)], "cache verify interrupted"),
                       (["cache", "clear", str(tmp_path)], "cache clear interrupted"),
                       (["cache", "stats", str(tmp_path)], "cache stats interrupted"),
                       (["stats", str(tmp_path)], "stats interrupted"),
                       (["stats", "--json", str(tmp_path)], "stats interrupted")):
        try:
            code = cli.main(argv)
        except KeyboardInterrupt:
            raise AssertionError(f"modelfs {' '.join(argv)}: Ctrl-C ended in a traceback") from None
        assert code == 130, (argv, code)
        assert capsys.readouterr().err == f"modelfs: {said}\n", argv


def test_cache_clear_counts_one_file_of_names_and_one_foreign_entry_in_the_singular(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`modelfs cache clear` said "1 files of the names mounts learnt", and of one file it leaves alone in writes/
    "left 1 entries"."""
    (tmp_path / "chunks").mkdir()
    (tmp_path / "names").mkdir()
    (tmp_path / "names" / ("0" * 32 + ".json")).write_text("{}")
    (tmp_path / "writes").mkdir()
    (tmp_path / "writes" / "notes.txt").write_text("mine")
    assert cli.main(["cache", "clear", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out == "removed 0 chunk files, 1 file of the names mounts learnt (names/)\n", out
    assert f"cache dir {tmp_path}: left 1 entry in writes/ that modelfs did not write there (notes.txt)" in out.err, out
    assert (tmp_path / "writes" / "notes.txt").read_text() == "mine"


def test_cache_stats_shows_a_stamp_of_the_epoch_as_a_date(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """A chunk whose mtime is 0 (restored by a tool that zeroes mtimes) is a real stamp, the oldest there can be:
    `cache stats` showed "-", its word for none, as if the cache held no chunk."""
    shard = tmp_path / "chunks" / "ab"
    shard.mkdir(parents=True)
    chunk = shard / ("ab" + "0" * 62)
    chunk.write_bytes(b"x")
    os.utime(chunk, ns=(0, 0))
    assert cli.main(["cache", "stats", str(tmp_path)]) == 0
    epoch = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(0))
    out = capsys.readouterr().out.splitlines()
    assert out[2:4] == [f"oldest access   {epoch}", f"newest access   {epoch}"], out


def test_unmount_of_a_directory_inside_a_mount_names_the_mount(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`modelfs unmount /models/llama` said "/models/llama is not mounted", as if nothing were there to unmount
    (B266)."""
    import fsmount.prefetch_command as pc
    from fsmount.cli import main

    (tmp_path / "llama").mkdir()
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "fuse.modelfs"))
    assert main(["unmount", str(tmp_path / "llama")]) == 1
    assert capsys.readouterr().err == (f"modelfs: {tmp_path}/llama is not a mount point: it is inside the modelfs "
                                       f"mount at {tmp_path} (modelfs unmount {tmp_path})\n")
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: ("/", "ext4"))
    assert main(["unmount", str(tmp_path / "llama")]) == 1
    assert capsys.readouterr().err == f"modelfs: {tmp_path}/llama is not mounted\n"


def test_unmount_of_a_path_not_there_inside_a_mount_says_it_does_not_exist(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`modelfs unmount /models/typo` said "is not a mount point: it is inside the modelfs mount at /models", sending
    the user looking for a directory that is not there (B339). A mount whose daemon is gone (ENOTCONN) or does not
    answer cannot say the path is not there: the mount is named then, as before."""
    import errno

    import fsmount.cli as cli_module
    import fsmount.prefetch_command as pc
    from fsmount.cli import main

    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "fuse.modelfs"))
    assert main(["unmount", str(tmp_path / "typo")]) == 1
    assert capsys.readouterr().err == f"modelfs: {tmp_path}/typo does not exist\n"
    assert main(["unmount", str(tmp_path / "typo" / "deeper")]) == 1
    assert capsys.readouterr().err == f"modelfs: {tmp_path}/typo/deeper does not exist\n"
    real_lstat = os.lstat

    def gone(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(path).startswith(str(tmp_path) + "/"):
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", gone)
    assert main(["unmount", str(tmp_path / "typo")]) == 1
    assert capsys.readouterr().err == (f"modelfs: {tmp_path}/typo is not a mount point: it is inside the modelfs "
                                       f"mount at {tmp_path} (modelfs unmount {tmp_path})\n")
    monkeypatch.setattr(os, "lstat", lambda *a, **kw: time.sleep(30))  # a daemon that does not answer
    started = time.monotonic()
    assert cli_module.there_in_mount(str(tmp_path / "typo"), 0.2)  # may be there: not said not to be
    assert time.monotonic() - started < 5


def test_unmount_stale_leaves_a_hung_mount_and_another_file_system_alone(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`modelfs unmount --stale` (the unit's ExecStartPre, B336) detaches only a mount whose daemon is gone: one whose
    daemon does not answer (stopped, hung) is not dead, and is left mounted with exit 1, within STALE_CHECK_S; a
    mount of another file system is left alone and the start goes on; nothing mounted says nothing."""
    import fsmount.prefetch_command as pc
    import fsmount.stats_table as st
    from fsmount.cli import STALE_CHECK_S, main

    ran: list = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: ran.append(a) or subprocess.CompletedProcess(a, 0))
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: ("/", "ext4"))
    assert main(["unmount", "--stale", str(tmp_path)]) == 0
    assert capsys.readouterr().err == "" and not ran
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "ext4"))
    assert main(["unmount", "--stale", str(tmp_path)]) == 0
    assert capsys.readouterr().err == f"modelfs: {tmp_path} is an ext4 mount, not a modelfs one: left mounted\n"
    assert not ran
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "fuse.modelfs"))
    monkeypatch.setattr(pc, "mount_owner", lambda path: None)
    waited: list[float] = []

    def silent(path: str, timeout: float) -> dict:
        waited.append(timeout)
        raise st.DaemonSilent("no answer")

    monkeypatch.setattr(st, "read_stats", silent)
    assert main(["unmount", "--stale", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"modelfs: {tmp_path} is a modelfs mount whose daemon does not answer within "
                                       f"5s (stopped or hung, not gone): left mounted; stop that daemon, or "
                                       f"`modelfs unmount --lazy {tmp_path}`\n")
    assert waited == [STALE_CHECK_S] and not ran


def test_unmount_stale_of_a_directory_inside_a_modelfs_mount_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The unit's MOUNTPOINT a directory of another modelfs mount (/models/llama under /models): `unmount --stale`
    said nothing and exited 0, as where nothing is mounted, and the journal had no word of why the start then mounted
    over a directory of that mount (or failed its mkdir). It names that mount and exits 0: nothing to clear, the start
    goes on, as at another file system's mount; nor does it ask that mount's daemon whether the directory is there
    (B392)."""
    import fsmount.cli as cli_module
    import fsmount.prefetch_command as pc
    from fsmount.cli import main

    ran: list = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: ran.append(a) or subprocess.CompletedProcess(a, 0))
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "fuse.modelfs"))
    monkeypatch.setattr(cli_module, "there_in_mount", lambda *a: pytest.fail("asked the outer mount's daemon"))
    assert main(["unmount", "--stale", str(tmp_path / "llama")]) == 0
    assert capsys.readouterr().err == (f"modelfs: {tmp_path}/llama is not a mount point: it is a directory inside the "
                                       f"modelfs mount at {tmp_path}: nothing to clear there\n")
    assert not ran


def test_unmount_stale_of_a_mount_closed_to_root_does_not_call_it_live(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Another user's mount made without --allow-other answers root EACCES from the kernel, its daemon dead or alive:
    `unmount --stale` called a dead one "a live modelfs mount" (B344). It says it could not ask, and leaves it."""
    import errno

    import fsmount.prefetch_command as pc
    import fsmount.stats_table as st
    from fsmount.cli import main

    ran: list = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: ran.append(a) or subprocess.CompletedProcess(a, 0))
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "fuse.modelfs"))
    monkeypatch.setattr(pc, "mount_owner", lambda path: 4242)

    def closed(path: str, timeout: float) -> dict:
        raise st.StatsUnavailable("cannot read stats: Permission denied", errno.EACCES)

    monkeypatch.setattr(st, "read_stats", closed)
    assert main(["unmount", "--stale", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"modelfs: {tmp_path} is the modelfs mount of uid 4242, made without --allow-other") \
        and "a live modelfs mount" not in err and not ran, err


def test_stats_of_a_directory_inside_a_mount_names_the_mount(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`modelfs stats /models/llama` said only "is not the root of a modelfs mount" (B266)."""
    import errno

    import fsmount.prefetch_command as pc
    import fsmount.stats_table as st
    from fsmount.cli import main

    def no_stats(path: str) -> dict:
        raise st.StatsUnavailable(f"{path} is not the root of a modelfs mount", errno.ENODATA)

    (tmp_path / "llama").mkdir()
    monkeypatch.setattr(st, "read_stats", no_stats)
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: (str(tmp_path), "fuse.modelfs"))
    assert main(["stats", str(tmp_path / "llama")]) == 1
    assert capsys.readouterr().err == (f"modelfs: {tmp_path}/llama is not the root of a modelfs mount: it is inside "
                                       f"the modelfs mount at {tmp_path} (modelfs stats {tmp_path})\n")
    monkeypatch.setattr(pc, "mount_of", lambda path, resolve=True: ("/", "ext4"))
    assert main(["stats", str(tmp_path / "llama")]) == 1
    assert capsys.readouterr().err == f"modelfs: {tmp_path}/llama is not the root of a modelfs mount\n"


def test_the_mount_holding_a_cache_dir_is_found_at_once_among_hung_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount refused a cache dir names the modelfs mount whose daemon holds it (B1042), asking each modelfs mount's
    stats for up to HOLDER_STATS_TIMEOUT_S. Asked in turn, each stopped or hung mount (SIGSTOP, a daemon stuck) added
    those 2 s to the refusal: four made it 8 s, more on a node of many mounts. Now all are asked at once: the holder
    is named as soon as it answers, and none is found within the one timeout."""
    import errno

    import fsmount.mount as mount
    from fsmount.mountinfo import Mount
    from fsmount.stats_table import DaemonSilent, StatsUnavailable

    def on(point: str, fstype: bytes = b"fuse.modelfs") -> Mount:
        return Mount(b"1", b"0", b"0:1", point.encode(), fstype, b"rw")

    listed = [on(f"/hung{i}") for i in range(4)] + [on("/dead"), on("/tmp", b"tmpfs"), on("/models")]

    def stats(point: str, timeout: float) -> dict:
        assert point != "/tmp"
        if point.startswith("/hung"):
            time.sleep(timeout)
            raise DaemonSilent(f"the daemon of {point} does not answer within {timeout:g}s")
        if point == "/dead":
            raise StatsUnavailable(f"the daemon of {point} is gone", errno.ENOTCONN)
        return {"pid": 4242}

    monkeypatch.setattr(mount.mountinfo, "mounts", lambda: listed)
    monkeypatch.setattr(mount, "read_stats", stats)
    started = time.monotonic()
    assert mount.mount_of_daemon(4242) == "/models"
    assert time.monotonic() - started < mount.HOLDER_STATS_TIMEOUT_S
    started = time.monotonic()
    assert mount.mount_of_daemon(4243) is None
    assert time.monotonic() - started < 2.5 * mount.HOLDER_STATS_TIMEOUT_S


CACHE_DIR_PLACE = """
import sys
from fsmount.mount import MountError, SettingError, check_cache_dir_place
try:
    check_cache_dir_place(sys.argv[1])
except SettingError as exc:
    print(2, exc)
except MountError as exc:
    print(1, exc)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_a_cache_dir_below_a_file_or_a_closed_directory_is_refused_for_good(tmp_path: Path) -> None:
    """B1040 made a cache dir the daemon may not make or write exit 2 (the unit does not start it again: only an
    operator mends it), but one whose parent is another user's 0700 directory, or a file, was refused before, by
    check_cache_dir_place, with status 1: started again every 5 s for good (B1141). A parent not there stays 1."""
    from fsmount.mount import MountError, SettingError, check_cache_dir_place

    locked = tmp_path / "locked"
    (locked / "models").mkdir(parents=True)
    os.chown(locked, 65534, 65534)
    locked.chmod(0o700)
    # root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: another user's 0700 directory is closed to it.
    res = subprocess.run([shutil.which("setpriv"), "--bounding-set", "-dac_override,-dac_read_search", "--",
                          sys.executable, "-c", CACHE_DIR_PLACE, str(locked / "models" / "cache")],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert res.stdout.startswith(f"2 cannot use cache dir {locked / 'models' / 'cache'}: "), res.stdout + res.stderr
    assert res.stdout.endswith(": Permission denied\n"), res.stdout
    (tmp_path / "afile").write_bytes(b"x")
    for below_a_file in (tmp_path / "afile" / "c", tmp_path / "afile" / "d" / "c"):
        with pytest.raises(SettingError, match="the directory it goes in"):
            check_cache_dir_place(str(below_a_file))
    with pytest.raises(MountError, match="does not exist") as refused:
        check_cache_dir_place(str(tmp_path / "nvme" / "c"))
    assert not isinstance(refused.value, SettingError)
