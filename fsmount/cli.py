"""The `modelfs` command line: argument parsing, the fstab (`-o key=value`) form, and running a mount in
the background until it answers. It holds no filesystem logic.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import logging
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from fsmount import __version__
from fsmount.config import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_FUSE_MAX_BACKGROUND,
    DEFAULT_KERNEL_READAHEAD,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_READAHEAD,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_SHARED_CACHE_PREFIX,
    DEFAULT_SHARED_CACHE_TIMEOUT,
    DEFAULT_SHARED_CACHE_WAIT,
    DEFAULT_WRITE_PART_SIZE,
    GET_CLIENTS,
    ConfigError,
    MountConfig,
    SharedCacheConfig,
    StoreConfig,
    default_memory_limit,
    parse_cache_size,
    parse_mode,
    parse_seconds,
    parse_size,
    parse_ttl,
    seconds_hint,
)

if TYPE_CHECKING:
    from fsmount.mount_users import MountUsers

EPILOG = """\
examples:
  modelfs mount my-models /models                       # AWS S3, credentials from the environment
  modelfs mount my-models /models --prefix llama-3/ --metadata-ttl forever
  modelfs mount my-models /models --endpoint-url http://127.0.0.1:8333   # MinIO, SeaweedFS, ...
  modelfs mount my-models /models --endpoint-url https://oss-cn-hangzhou.aliyuncs.com \\
      --region cn-hangzhou --addressing-style virtual    # Alibaba OSS
  modelfs my-models /models -o ro,allow_other,endpoint_url=http://127.0.0.1:8333   # fstab form
  modelfs mount my-models /models --metrics-addr 127.0.0.1:9478   # Prometheus text at /metrics
  modelfs stats /models
  modelfs unmount /models
"""

SUBCOMMANDS = ("mount", "unmount", "umount", "cache", "prefetch", "stats", "cleanup")
# mount(8)'s filesystem-independent options, which mean nothing to a FUSE daemon; accepted and ignored. mount(8) and
# mount.fuse3 pass them on to `modelfs` as written in fstab (not `norelatime`, `nomand`: mount(8) keeps those): the
# `lazytime`, `dirsync`, `iversion` or `nosymfollow` of a copied fstab line failed the mount as unknown (B261).
# SELinux's `context=` and the like stay refused: a label asked for is not silently left off.
IGNORED_MOUNT_OPTIONS = {"defaults", "_netdev", "nofail", "noauto", "auto", "user", "users", "nouser",
                         "owner", "group", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime",
                         "noatime", "relatime", "norelatime", "strictatime", "nostrictatime", "nodiratime", "diratime",
                         "lazytime", "nolazytime", "iversion", "noiversion", "mand", "nomand", "nosymfollow", "dirsync",
                         "sync", "async", "rw", "silent", "loud"}
# libfuse's own -o options: refused as ours are not them (taken as the start of one of ours, `max_read=` became
# `--max-readahead`: a 128 KiB read-ahead, silently).
LIBFUSE_OPTIONS = frozenset({"max_read", "max_write", "max_background", "congestion_threshold", "blksize", "fsname",
                             "subtype", "default_permissions", "allow_root", "auto_unmount", "kernel_cache",
                             "auto_cache", "direct_io", "entry_timeout", "attr_timeout", "negative_timeout", "umask",
                             "sync_read", "async_read", "big_writes", "writeback_cache"})
# What a libfuse -o option of another FUSE filesystem's fstab line (s3fs, rclone) is here: `umask=022` copied from s3fs
# was told "modelfs sets it itself", and the mount then had the default modes.
LIBFUSE_EQUIVALENTS = {"umask": "file_mode= and dir_mode=", "allow_root": "allow_other",
                       "max_background": "fuse_max_background=", "entry_timeout": "metadata_ttl=",
                       "attr_timeout": "metadata_ttl=", "negative_timeout": "metadata_ttl="}
# -o flags that map to a differently named command-line flag.
MOUNT_OPTION_ALIASES = {"nonempty": "allow_non_empty"}
# `modelfs cleanup` leaves uploads younger than this alone (a mount may still be writing them); the
# lifecycle rule in the README aborts after one day too.
DEFAULT_CLEANUP_AGE = 86400.0
# `modelfs prefetch` then waits this long for the daemon's cache writes (a model's tier writes trail its
# load, at the tier's pace: minutes for hundreds of GB).
DEFAULT_PREFETCH_WRITE_WAIT = 600.0
# How long `modelfs mount` waits for the background daemon to answer before giving up.
STARTUP_TIMEOUT = 120.0
# How long a daemon stopped by Ctrl-C during `modelfs mount` gets to exit before it is killed.
STOP_WAIT_S = 10.0
# What stops a `modelfs mount` waiting for its daemon, and the daemon with it: Ctrl-C, `timeout N modelfs mount`
# (SIGTERM), a dropped ssh session (SIGHUP). Only SIGINT did: the caller failed, and the daemon mounted later anyway.
WAIT_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Warnings a background daemon logs before it is ready that `modelfs mount` prints (the rest are in its log).
EARLY_WARNINGS_MAX = 20

T = TypeVar("T")


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse `type=` from a config parser: its ConfigError becomes argparse's usage error."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")  # argparse names it in messages
    return convert


_size = _argument(parse_size)
_ttl = _argument(parse_ttl)
_seconds = _argument(parse_seconds)
_mode = _argument(parse_mode)


def _age_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid age {text!r}: {seconds_hint(text)}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"invalid age {text!r}: must be >= 0")
    return value


_age_seconds.__name__ = "age"
_cache_size = _argument(parse_cache_size)


def _metrics_addr(text: str) -> str:
    from fsmount.prometheus import MetricsAddressError, parse_metrics_addr

    try:
        _, port = parse_metrics_addr(text)
    except MetricsAddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if port == 0:  # the OS's pick, another at each start: no scrape config could name it
        raise argparse.ArgumentTypeError(f"invalid --metrics-addr {text!r}: port 0 would be a new port at each start, "
                                         "which Prometheus cannot be told: give a fixed port, e.g. 127.0.0.1:9478")
    return text


def _endpoint_url(text: str) -> str:
    # A URL like https://KEY:SECRET@host would put the secret in argv, the process list and the logs; one refused
    # for another reason is named without it.
    shown = re.sub(r"(^|//)[^/?#]*@", r"\1...@", text)
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - parsed on access: a port out of range or not a number raises here
    except ValueError as exc:  # argparse would say "invalid _endpoint_url value", naming this function
        raise argparse.ArgumentTypeError(f"{shown!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{shown!r} is not an http:// or https:// URL (e.g. http://{shown})"
                                         if "://" not in text else f"{shown!r} is not an http:// or https:// URL")
    if parts.username or parts.password:
        raise argparse.ArgumentTypeError("credentials in the endpoint URL are refused (they would show in the "
                                         "process list): use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --profile")
    return text


def add_origin_arguments(s: argparse._ArgumentGroup | argparse.ArgumentParser, prefix_help: str) -> None:
    """Where the bucket is: the flags `mount` and `cleanup` share."""
    s.add_argument("--prefix", default="", help=prefix_help)
    # No default of our own: botocore finds one in the AWS configuration ($AWS_ENDPOINT_URL_S3 before
    # $AWS_ENDPOINT_URL, a profile's endpoint_url or services section, $AWS_IGNORE_CONFIGURED_ENDPOINT_URLS), as boto3
    # does; a default read here from $AWS_ENDPOINT_URL alone took it before $AWS_ENDPOINT_URL_S3.
    s.add_argument("--endpoint-url", type=_endpoint_url, default=None,
                   help="S3-compatible endpoint (default: AWS, or the AWS configuration's: $AWS_ENDPOINT_URL_S3, "
                        "$AWS_ENDPOINT_URL, a profile's endpoint_url)")
    s.add_argument("--region", default=None, help="region name (default: from the AWS configuration)")
    s.add_argument("--profile", default=None,
                   help="profile of the AWS configuration (~/.aws/credentials, ~/.aws/config)")
    s.add_argument("--addressing-style", choices=("auto", "path", "virtual"), default="auto",
                   help="bucket addressing; Alibaba OSS needs virtual")


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bucket", help="bucket name (S3 or OSS)")
    p.add_argument("mountpoint", help="an existing empty directory")
    s = p.add_argument_group("object store")
    add_origin_arguments(s, "mount only keys under this prefix")
    s.add_argument("--no-sign-request", action="store_true", help="anonymous access to a public bucket")
    s.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="parallel ranged GETs (default %(default)s)")
    s.add_argument("--read-timeout", type=_seconds, default=DEFAULT_READ_TIMEOUT,
                   help="seconds after which a READ fails with EIO instead of waiting (default %(default)s)")
    s.add_argument("--get-client", choices=GET_CLIENTS, default="presigned",
                   help="what carries the bytes of ranged GETs: presigned URLs read by http.client into "
                        "recycled buffers (default; less CPU per byte), or boto3's get_object. Signing, "
                        "credentials and retries are boto3's either way")
    f = p.add_argument_group("file system")
    f.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground (for systemd)")
    f.add_argument("--uid", type=int, default=os.getuid(), help="owner of all files (default: you)")
    f.add_argument("--gid", type=int, default=os.getgid(), help="group of all files (default: yours)")
    f.add_argument("--file-mode", type=_mode, default=None,
                   help="permission bits of files (default 0444, 0644 with --writable)")
    f.add_argument("--dir-mode", type=_mode, default=None,
                   help="permission bits of directories (default 0555, 0755 with --writable)")
    f.add_argument("--allow-other", action="store_true", help="let other users see the mount (off by default)")
    f.add_argument("--allow-non-empty", action="store_true", help="mount over a non-empty directory")
    f.add_argument("--metadata-ttl", type=_ttl, default=60.0,
                   help="seconds to trust listings and sizes, or 'forever' (default 60)")
    d = p.add_argument_group("data path")
    d.add_argument("--chunk-size", type=_size, default=DEFAULT_CHUNK_SIZE, help="fetch unit (default 8M)")
    d.add_argument("--memory-limit", type=_size, default=None,
                   help="bound on the daemon's memory (RSS); chunk data gets this less ~96M for the runtime "
                        "(default min(2G, 10%% of RAM or of the cgroup's memory limit))")
    d.add_argument("--max-readahead", type=_size, default=DEFAULT_MAX_READAHEAD,
                   help="largest read-ahead window per reader (default 256M)")
    d.add_argument("--kernel-readahead", type=_size, default=DEFAULT_KERNEL_READAHEAD,
                   help="kernel read_ahead_kb for the mount, 0 to leave it (default 16M)")
    d.add_argument("--fuse-max-background", type=int, default=DEFAULT_FUSE_MAX_BACKGROUND,
                   help="FUSE background requests the kernel may queue (its read-ahead READs), set through "
                        "fusectl when run as root; 0 to leave the kernel's 12 (default %(default)s)")
    d.add_argument("--no-model-streaming", "--no-model-prefetch", dest="no_model_streaming", action="store_true",
                   help="do not stream safetensors files in offset order when they are opened "
                        "(--no-model-prefetch is the old name)")
    d.add_argument("--pagecache-push-limit", type=_size, default=None,
                   help="bytes of streamed model data pushed into the kernel page cache for open files, "
                        "0 to disable (default half of MemAvailable, or of what the cgroup has left)")
    d.add_argument("--cache-dir", default=None,
                   help="persistent local chunk cache directory (NVMe); it also keeps the names the mount learns, so "
                        "that a mount started while the origin does not answer serves what it holds")
    d.add_argument("--cache-size", type=_cache_size, default=None,
                   help="cache size, e.g. 500G or 80%% of the disk (default 80%%; needs --cache-dir)")
    w = p.add_argument_group("writing (off by default: the mount is read-only)")
    w.add_argument("--writable", action="store_true",
                   help="accept new files (written sequentially, streamed to the bucket as a multipart upload "
                        "and stored at close) and new directories")
    w.add_argument("--allow-overwrite", action="store_true", help="let new files and renames replace existing keys")
    w.add_argument("--allow-delete", action="store_true",
                   help="let unlink and rmdir delete keys (this mount's own stored files too), and renames of "
                        "files and directories this mount did not write")
    w.add_argument("--write-part-size", type=_size, default=DEFAULT_WRITE_PART_SIZE,
                   help="size of the first upload parts; it grows every 200 parts, so files up to 255,000 x "
                        "this fit in S3's 10,000 parts (default 8M)")
    t = p.add_argument_group("fleet-shared chunk tier (an S3-compatible bucket near the nodes)")
    t.add_argument("--shared-cache-bucket", default=None,
                   help="turn the tier on: nodes share chunks through this bucket")
    t.add_argument("--shared-cache-endpoint-url", type=_endpoint_url, default=None, help="the tier's endpoint")
    t.add_argument("--shared-cache-region", default=None, help="the tier's region")
    t.add_argument("--shared-cache-profile", default=None, help="profile for the tier's credentials")
    t.add_argument("--shared-cache-addressing-style", choices=("auto", "path", "virtual"), default="auto",
                   help="bucket addressing of the tier")
    t.add_argument("--shared-cache-prefix", default=DEFAULT_SHARED_CACHE_PREFIX,
                   help="key prefix of chunk objects in the tier (default %(default)s)")
    t.add_argument("--shared-cache-read-only", action="store_true", help="use the tier, never write to it")
    t.add_argument("--shared-cache-wait", type=_seconds, default=DEFAULT_SHARED_CACHE_WAIT,
                   help="seconds a node waits for a chunk another node is fetching, then fetches it itself "
                        "(default %(default)s; a tier lookup, this wait included, takes at most a quarter of "
                        "--read-timeout)")
    t.add_argument("--shared-cache-timeout", type=_seconds, default=DEFAULT_SHARED_CACHE_TIMEOUT,
                   help="seconds one tier request may take before the origin is asked (default %(default)s; at "
                        "most an eighth of --read-timeout: a tier lookup takes at most a quarter of it)")
    o = p.add_argument_group("logging and metrics")
    o.add_argument("--log-level", default="info", type=str.lower,
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="how much the daemon logs (default %(default)s)")
    o.add_argument("--log-file", default=None,
                   help="log here instead of stderr/syslog; reopened at its path when it is moved or deleted "
                        "(logrotate), at once at SIGHUP or SIGUSR1")
    o.add_argument("--metrics-addr", type=_metrics_addr, default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (':PORT' for every IPv4 interface)")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTS",
                   help="fstab-style options: ro,allow_other,endpoint_url=URL,prefix=P,...")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-to-syslog", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mount-ro", action="store_true", help=argparse.SUPPRESS)  # mount(8)'s -o ro


def _mount_parser() -> argparse.ArgumentParser:
    """`modelfs mount`'s options alone, to ask about them."""
    p = argparse.ArgumentParser(add_help=False)
    add_mount_arguments(p)
    return p


def mount_option_strings() -> dict[str, bool]:
    """Every option string `modelfs mount` takes (`--cache-dir`, ...), and whether it takes a value."""
    return {name: action.nargs != 0 for name, action in _mount_parser()._option_string_actions.items()}


def documented_long_options() -> set[str]:
    """The `--` option strings `modelfs mount --help` shows (not the internal ones, such as `--ready-fd`)."""
    return {name for name, action in _mount_parser()._option_string_actions.items()
            if name.startswith("--") and action.help != argparse.SUPPRESS}


def expand_mount_options(argv: list[str]) -> list[str]:
    """Turn every `-o a,b=c` into `--a --b c`, dropping mount(8)'s generic options. ConfigError for a key
    that is no option (argparse would name a `--flag` the user never typed, under the top-level usage)."""
    known: set[str] | None = None
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-o" and i + 1 < len(argv):
            opts, i = argv[i + 1], i + 2
        elif arg.startswith("-o") and len(arg) > 2:
            opts, i = arg[2:], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            key, has_value, value = opt.partition("=")
            if key in IGNORED_MOUNT_OPTIONS or key.startswith(("x-systemd.", "x-", "comment")):
                continue
            if key == "remount":  # `mount -o remount /models`: mount(8) hands it to mount.fuse3, which runs us
                raise ConfigError("modelfs cannot change the options of a mount it serves (-o remount): unmount it "
                                  "and mount it again (umount MOUNTPOINT && mount MOUNTPOINT); the mount is left as "
                                  "it was")
            if key == "ro":  # read-only is the default; with `writable` too it is a contradiction (build_config)
                out.append("--mount-ro")
                continue
            key = MOUNT_OPTION_ALIASES.get(key, key)
            if key.replace("-", "_") in LIBFUSE_OPTIONS:
                instead = LIBFUSE_EQUIVALENTS.get(key.replace("-", "_"))
                raise ConfigError(f"mount option {key!r} (in -o {opts}) is libfuse's, " +
                                  (f"which modelfs does not take: use {instead}" if instead else
                                   "and modelfs sets it itself: leave it out"))
            known = mount_option_strings() if known is None else known
            documented = documented_long_options()
            flag = "--" + key.replace("_", "-")
            if flag not in documented:
                # A unique prefix of one option, as argparse takes it on the command line (`endpoint=` for
                # endpoint_url=): fstab lines written so for earlier versions, which passed -o keys on to argparse,
                # mount as they did. Never an internal option (`ready_fd=`).
                longer = sorted(name for name in documented if name.startswith(flag))
                if len(longer) != 1:
                    could = f" (could be {', '.join(n[2:].replace('-', '_') for n in longer)})" if longer else ""
                    raise ConfigError(f"unknown mount option {opt.partition('=')[0]!r} in -o {opts}{could}")
                flag = longer[0]
            takes_value = known[flag]
            if has_value and not takes_value:
                raise ConfigError(f"mount option {opt.partition('=')[0]!r} takes no value (in -o {opts}): give it "
                                  "alone to turn it on, leave it out for off")
            if takes_value and not has_value:
                raise ConfigError(f"mount option {key!r} needs a value: {key}=... (in -o {opts})")
            # One token: a value that starts with '-' would be taken for an option of its own.
            out.append(f"{flag}={value}" if has_value else flag)
    return _joined_negative_values(out)


def _joined_negative_values(argv: list[str]) -> list[str]:
    """`--cache-size -5G` as `--cache-size=-5G`: argparse takes a value that starts with `-` and is not a
    plain number for an option and says only "expected one argument"; joined, the option's own check says
    what is wrong with the value."""
    out: list[str] = []
    for arg in argv:
        if out and re.match(r"-\.?\d", arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _local_path(path: str) -> str:
    """A path flag's value, absolute (the daemon works from /: it must not keep a directory of the caller's busy),
    with `~` expanded: the shell leaves it in `--cache-dir=~/cache` and in fstab's options, and the cache went to a
    directory named `~` in the caller's working directory (`/~` at boot)."""
    return os.path.abspath(os.path.expanduser(path))


def build_config(args: argparse.Namespace) -> MountConfig:
    if args.mount_ro and args.writable:
        raise ConfigError("-o ro and writable contradict each other: drop one")
    if args.cache_dir == "" or args.log_file == "":
        raise ConfigError(f"--{'cache-dir' if args.cache_dir == '' else 'log-file'} is empty: give a path")
    if args.log_file == "-":
        # Not stdout's name here: the daemon wrote its log to a file named "-" in its working directory (`/` under
        # systemd), and the journal got nothing.
        raise ConfigError("--log-file - is not stderr: leave --log-file out to log to stderr with --foreground (the "
                          "journal under systemd), to syslog in the background; or give a file's path")
    if args.cache_size is not None and args.cache_dir is None:
        raise ConfigError("--cache-size needs --cache-dir: without a cache directory no chunk is kept on disk")
    if args.cache_size is not None and args.cache_size.fraction is None and args.cache_size.bytes < args.chunk_size:
        raise ConfigError(f"--cache-size of {args.cache_size.bytes} bytes cannot hold one chunk "
                          f"(--chunk-size {args.chunk_size})")
    store = StoreConfig(bucket=args.bucket, prefix=args.prefix, endpoint_url=args.endpoint_url,
                        region=args.region, profile=args.profile, addressing_style=args.addressing_style,
                        no_sign_request=args.no_sign_request, max_connections=args.max_connections,
                        read_timeout=args.read_timeout, get_client=args.get_client)
    return MountConfig(
        store=store, mountpoint=args.mountpoint, foreground=args.foreground, uid=args.uid, gid=args.gid,
        file_mode=_default(args.file_mode, 0o644 if args.writable else 0o444),
        dir_mode=_default(args.dir_mode, 0o755 if args.writable else 0o555), allow_other=args.allow_other,
        allow_non_empty=args.allow_non_empty, metadata_ttl=args.metadata_ttl, log_level=args.log_level,
        log_file=_local_path(args.log_file) if args.log_file else None, chunk_size=args.chunk_size,
        memory_limit=args.memory_limit if args.memory_limit is not None else
        max(default_memory_limit(), 4 * args.chunk_size),  # a tiny pod: the least the daemon works with
        max_readahead=args.max_readahead, kernel_readahead=args.kernel_readahead,
        fuse_max_background=args.fuse_max_background,
        cache_dir=_local_path(args.cache_dir) if args.cache_dir else None,
        cache_size=_default(args.cache_size, parse_cache_size("80%")), model_streaming=not args.no_model_streaming,
        pagecache_push_limit=args.pagecache_push_limit, metrics_addr=args.metrics_addr,
        shared_cache=shared_cache_config(args), writable=args.writable, allow_overwrite=args.allow_overwrite,
        allow_delete=args.allow_delete, write_part_size=args.write_part_size)


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def shared_cache_config(args: argparse.Namespace) -> SharedCacheConfig | None:
    if not args.shared_cache_bucket:
        # As --cache-size without --cache-dir: a tier flag without the tier was ignored without a word.
        given = [a.option_strings[0] for a in _mount_parser()._actions if a.dest.startswith("shared_cache_")
                 and getattr(args, a.dest, a.default) != a.default]
        if given:
            raise ConfigError(f"{given[0]} needs --shared-cache-bucket: without it there is no shared tier")
        return None
    return SharedCacheConfig(
        bucket=args.shared_cache_bucket, endpoint_url=args.shared_cache_endpoint_url, region=args.shared_cache_region,
        profile=args.shared_cache_profile, addressing_style=args.shared_cache_addressing_style,
        prefix=args.shared_cache_prefix, read_only=args.shared_cache_read_only, wait=args.shared_cache_wait,
        timeout=args.shared_cache_timeout)


class _OneLineErrors(argparse.ArgumentParser):
    """argparse's parser (and its subcommands' parsers), whose usage errors are one line: argparse prints the
    usage above the error, and `modelfs mount`'s is 35 lines, so under systemd one bad value in MODELFS_OPTS put
    them in the journal above the line that says what is wrong. `--help` still shows the usage."""

    #: The parsers of the commands, by name and alias (`make_parser`'s own; empty in theirs).
    commands: dict[str, argparse.ArgumentParser]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.commands = {}

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def make_parser() -> _OneLineErrors:
    p = _OneLineErrors(
        prog="modelfs", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Mount an S3 or Alibaba OSS bucket, tuned for loading model weights (read-only unless "
                    "--writable, for checkpoints).")
    p.add_argument("--version", action="version", version=f"modelfs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    m = sub.add_parser("mount", help="mount a bucket", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mount_arguments(m)
    w = sub.add_parser("prefetch", help="warm files or directories of a mounted tree (NVMe and page cache)")
    w.add_argument("paths", nargs="+", metavar="PATH")
    w.add_argument("--no-pagecache", action="store_true", help="warm only the daemon's caches, not the page cache")
    w.add_argument("--threads", type=int, default=8, help="parallel readers (default %(default)s)")
    w.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    w.add_argument("--write-wait", type=_seconds, default=DEFAULT_PREFETCH_WRITE_WAIT, metavar="SECONDS",
                   help="then wait up to this long for the daemon to write what it fetched to its NVMe cache and "
                        "shared tier (0: do not wait; default %(default)g)")
    st = sub.add_parser("stats", help="hit ratio, bytes by source, egress saved and errors of a running mount")
    st.add_argument("mountpoint")
    st.add_argument("--json", action="store_true", help="the raw numbers as JSON")
    k = sub.add_parser("cleanup", help="abort incomplete multipart uploads (parts left by a writable mount that "
                                       "was killed) under a prefix of a bucket")
    k.add_argument("bucket")
    add_origin_arguments(k, "only uploads of keys under this prefix")
    k.add_argument("--older-than", type=_age_seconds, default=DEFAULT_CLEANUP_AGE,
                   help="only uploads begun at least this many seconds ago: a running mount may be writing the "
                        "newer ones (default %(default)g, one day)")
    k.add_argument("--key", action="append", default=[], metavar="KEY",
                   help="only the uploads of this whole key, not under --prefix (repeatable): the keys a mount's "
                        "log names")
    k.add_argument("--dry-run", action="store_true", help="list them, abort nothing")
    c = sub.add_parser("cache", help="inspect or empty a local chunk cache directory")
    c.add_argument("action", choices=("stats", "clear", "verify"),
                   help="stats: size and chunks; verify: check every chunk against its hash and delete the corrupt "
                        "ones (exit 1 if any) and those of another version's format; clear: delete every chunk, and "
                        "with them the copies a killed --writable mount left in writes/ and the names mounts learnt "
                        "in names/ (what a mount started while the origin is unreachable serves from). verify and "
                        "clear refuse while a mount uses the directory (`rm -rf CACHE_DIR/chunks` frees its disk "
                        "then)")
    c.add_argument("cache_dir")
    u = sub.add_parser("unmount", aliases=["umount"], help="unmount a modelfs mount")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", "-z", action="store_true", help="detach now even if files are open")
    u.add_argument("--stale", action="store_true",
                   help="only a dead mount (its daemon gone: 'transport endpoint is not connected'), detached at "
                        "once; a mount whose daemon answers is left mounted, named, exit 0 (`modelfs mount` then "
                        "refuses that mountpoint, exit 2); one whose daemon hangs or may not be asked is left "
                        "mounted, exit 1; a directory inside a modelfs mount is named, exit 0; nothing mounted "
                        "there is not an error and says nothing (what "
                        "systemd/modelfs@.service runs before a start)")
    p.commands = dict(sub.choices)
    return p


def fail(message: str, code: int = 1) -> int:
    print(f"modelfs: {message}", file=sys.stderr)
    return code


def cmd_mount(args: argparse.Namespace, mount_argv: list[str]) -> int:
    if args.options:  # left over only when -o came in a form we did not expand
        return fail(f"unknown -o options: {','.join(args.options)}")
    try:
        cfg = build_config(args)
    except ConfigError as exc:
        return fail(str(exc), 2)
    if cfg.foreground:
        return run_foreground(cfg, args.ready_fd, args.log_to_syslog)
    return run_background(cfg, mount_argv)


def run_foreground(cfg: MountConfig, ready_fd: int | None, use_syslog: bool) -> int:
    from fsmount import mount

    # A background mount's warnings before it is ready (a --prefix that matches nothing, a cache dir with no
    # room) went only to syslog or the log file; they also go to the waiting `modelfs mount`, which prints them.
    early = _EarlyWarnings()

    def ready(error: str | None) -> None:
        logging.getLogger().removeHandler(early)
        if error is not None:
            print(f"modelfs: {error}", file=sys.stderr)
        if ready_fd is not None:
            lines = [f"WARN {' '.join(w.split())}" for w in early.messages]
            lines.append("READY" if error is None else f"ERROR {error}")
            try:
                os.write(ready_fd, "".join(f"{line}\n" for line in lines).encode())
                os.close(ready_fd)
            except OSError:
                pass

    try:
        mount.check_log_file_outside(cfg.log_file, cfg.mountpoint)
    except mount.MountError as exc:
        ready(str(exc))
        return 2 if isinstance(exc, mount.SettingError) else 1
    try:
        mount.setup_logging(cfg.log_level, cfg.log_file, use_syslog)
    except OSError as exc:  # the --log-file's open; without one, syslog's socket refusing the connection
        failure = (mount.log_file_error(cfg.log_file, exc) if cfg.log_file else
                   mount.MountError(f"cannot log to syslog ({mount.SYSLOG_SOCKET}): {exc.strerror or exc}"))
        ready(str(failure))
        return 2 if isinstance(failure, mount.SettingError) else 1
    if ready_fd is not None:
        logging.getLogger().addHandler(early)
    return mount.run(cfg, ready)


class _EarlyWarnings(logging.Handler):
    """Keeps the messages of warnings logged before the mount is ready (at most EARLY_WARNINGS_MAX)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.messages) < EARLY_WARNINGS_MAX:
            self.messages.append(record.getMessage())


class _StopWhileWaiting(Exception):
    """A stop signal (WAIT_STOP_SIGNALS) reached `modelfs mount` while it waited for its daemon."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopWhileWaiting(signum)


def run_background(cfg: MountConfig, mount_argv: list[str]) -> int:
    """Start the daemon detached and return only once the mount answers (or say why it cannot)."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "fsmount", *mount_argv, "--foreground", "--ready-fd", str(write_fd)]
    if not cfg.log_file:
        cmd.append("--log-to-syslog")
    # A Ctrl-C that lands while the daemon is being started (inside Popen, after its exec) would leave it
    # running with nobody to stop it: until `proc` exists, a stop signal is only noted, then raised. (A Python-level
    # handler does not survive the daemon's exec: the daemon starts with the signals' defaults.)
    # A signal the caller ignores stays ignored: `nohup modelfs mount` (SIGHUP), a script's `cmd &` (SIGINT).
    noted: list[int] = []
    stops = [signum for signum in WAIT_STOP_SIGNALS if signal.getsignal(signum) != signal.SIG_IGN]
    previous = {signum: signal.signal(signum, lambda signum, frame: noted.append(signum)) for signum in stops}
    buf = b""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        try:
            proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(write_fd)
        for signum in stops:
            signal.signal(signum, _raise_stop)
        if noted:
            raise _StopWhileWaiting(noted[0])
        while not re.search(rb"^(READY|ERROR)", buf, re.MULTILINE):
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                return fail(f"the mount did not answer within {STARTUP_TIMEOUT:.0f}s")
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                continue
            data = os.read(read_fd, 4096)
            if not data:
                break
            buf += data
        if re.search(rb"^ERROR", buf, re.MULTILINE):
            # The message may go on past this read: the rest of it, until the daemon closes its end.
            while select.select([read_fd], [], [], max(0.0, min(2.0, deadline - time.monotonic())))[0]:
                data = os.read(read_fd, 4096)
                if not data:
                    break
                buf += data
    except (KeyboardInterrupt, _StopWhileWaiting) as exc:
        # Stopped while waiting (Ctrl-C; `timeout N modelfs mount`: SIGTERM; a dropped ssh session: SIGHUP): the
        # detached daemon (its own session, so it got no signal) would go on and mount once the endpoint answers,
        # behind the back of a caller who gave up. Stop it.
        signum = exc.signum if isinstance(exc, _StopWhileWaiting) else signal.SIGINT
        # A second signal does not cut this stop of the starting daemon short. (The daemon's own stop, once mounted,
        # is cut short by a second one: mount.Daemon._stop_now.)
        for stop in stops:
            signal.signal(stop, signal.SIG_IGN)
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        with contextlib.suppress(OSError):  # a hung-up terminal takes no message
            return fail(f"{said}: the daemon was stopped and nothing is mounted", 128 + signum)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        os.close(read_fd)
    # WARN lines (one line each), then READY, or ERROR and the message, which may span lines (botocore's
    # "Parameter validation failed:" does): everything after "ERROR " is the message.
    text = buf.decode(errors="replace")
    end = re.search(r"^(READY$|ERROR )", text, re.MULTILINE)
    for warning in text[:end.start() if end else len(text)].splitlines():
        if warning.startswith("WARN "):
            print(f"modelfs: warning: {warning[len('WARN '):]}", file=sys.stderr)
    line = text[end.start():].strip() if end else ""
    if line == "READY":
        from fsmount.mount import SYSLOG_SOCKET, syslog_available

        if not cfg.log_file and not syslog_available():
            print(f"modelfs: note: there is no syslog here ({SYSLOG_SOCKET}), so the daemon's log (warnings "
                  "included) goes nowhere; mount with --log-file FILE to keep it", file=sys.stderr)
        return 0
    if line.startswith("ERROR "):
        # The daemon's status: 2 for settings only a change of them mends (mount.SettingError), as in the foreground.
        return fail(line[len("ERROR "):], 2 if proc.wait(timeout=30) == 2 else 1)
    code = proc.wait(timeout=30)
    return fail(f"the daemon exited with status {code} before the mount was ready; "
                "run with --foreground to see why")


# How long `modelfs unmount` waits for the daemon of a mount to answer (--stale: whether it is alive; a path inside the
# mount: whether it is there) before it calls it hung (one answers in milliseconds; a dead one's ENOTCONN comes at
# once).
STALE_CHECK_S = 5.0


def user_name(uid: int) -> str:
    """"root (uid 0)", or "uid N" for a uid without a passwd entry."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def cmd_unmount(args: argparse.Namespace) -> int:
    from fsmount.mount_users import mount_users, mounts_inside
    from fsmount.prefetch_command import MODELFS_FSTYPE, mount_of, mount_owner, resolve_unasked

    # Found in /proc/self/mountinfo without a stat of the mountpoint: a stat goes to the mount's daemon, and one
    # that is stopped or hung (SIGSTOP, a debugger, a deadlock) left `modelfs unmount` waiting in the kernel for
    # good, SIGINT or not. Only a path that is no mountpoint as given is resolved (a symlink to one); not one inside a
    # modelfs mount, which has no symlinks, and whose resolving asked its daemon too; and that without a lstat of a
    # mount's root or of a path in a modelfs mount (`resolve_unasked`: realpath's asked the daemon, B343).
    path = os.path.abspath(args.mountpoint)
    mounted_at, fstype = mount_of(path, resolve=False)
    if mounted_at != path and fstype != MODELFS_FSTYPE:
        path = resolve_unasked(args.mountpoint)
        mounted_at, fstype = mount_of(path, resolve=False)
    if mounted_at != path:
        if args.stale and fstype == MODELFS_FSTYPE:  # said: the unit's start goes on, and `modelfs mount` refuses it
            return fail(f"{args.mountpoint} is not a mount point: it is a directory inside the modelfs mount at "
                        f"{mounted_at}: nothing to clear there", 0)
        if args.stale:  # nothing mounted there: a clean start, nothing to say
            return 0
        if fstype == MODELFS_FSTYPE and not there_in_mount(path):  # "inside the mount" sent the user looking there
            return fail(f"{args.mountpoint} does not exist")
        if fstype == MODELFS_FSTYPE:  # a directory of the mount ("is not mounted" sent the user looking elsewhere)
            return fail(f"{args.mountpoint} is not a mount point: it is inside the modelfs mount at {mounted_at} "
                        f"(modelfs unmount {mounted_at})")
        return fail(f"{args.mountpoint} {'is not mounted' if os.path.lexists(path) else 'does not exist'}")
    # fusermount3 run as root unmounts whatever is there: a typo must not take a disk or an NFS share away.
    if fstype != MODELFS_FSTYPE:
        # With --stale not a failure: no dead modelfs mount to clear, and not its business to refuse a start.
        return fail(f"{args.mountpoint} is {'an' if (fstype or 'n')[0] in 'aeiou' else 'a'} {fstype or 'non-modelfs'} "
                    "mount, not a modelfs one: left mounted", 0 if args.stale else 1)
    # fusermount3 says "entry for M not found in /etc/mtab" of another user's mount, which is there: say whose it is.
    owner = mount_owner(path)
    if os.geteuid() != 0 and owner is not None and owner != os.getuid():
        return fail(f"cannot unmount {args.mountpoint}: it is the mount of {user_name(owner)}, and only that user "
                    "or root may unmount it")
    if args.stale:
        refused, code = live_mount(path, args.mountpoint)
        if refused:
            return fail(refused, code)
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        return fail("fusermount3 not found: install the fuse3 package")
    cmd = [tool, "-u"] + (["-z"] if args.lazy or args.stale else []) + [path]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        reason = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"status {res.returncode}"
        hint = ""
        if "busy" in reason.lower():
            hint = busy_hint(mount_users(path), mounts_inside(path))
        return fail(f"cannot unmount {args.mountpoint}: {reason}{hint}")
    if args.stale:  # said once, in the journal of the start it made possible
        print(f"modelfs: cleared the dead mount at {args.mountpoint} (its daemon was gone)", file=sys.stderr)
    return 0


def there_in_mount(path: str, timeout: float = STALE_CHECK_S) -> bool:
    """Whether `path`, inside a modelfs mount, may be there: False only where its daemon answered that it is not
    (ENOENT, ENOTDIR). Asked in a thread of its own: a daemon that is stopped or hung never answers, and a dead one
    answers ENOTCONN; neither says the path is not there."""
    import errno
    import threading

    out: list[int] = []

    def ask() -> None:
        try:
            os.lstat(path)
            out.append(0)
        except OSError as exc:
            out.append(exc.errno or -1)

    asker = threading.Thread(target=ask, daemon=True)  # left behind if it never returns
    asker.start()
    asker.join(timeout)
    return not out or out[0] not in (errno.ENOENT, errno.ENOTDIR)


def live_mount(path: str, shown: str) -> tuple[str, int]:
    """Why `unmount --stale` leaves the modelfs mount at `path` alone, and its exit status: its daemon answers (named:
    bucket, pid, user; status 0, so that the unit's start goes on to `modelfs mount`, which refuses that mountpoint
    with status 2, which the unit does not restart on), or does not answer within STALE_CHECK_S (stopped or hung, not
    gone; status 1), or may not be asked (another user's mount made without --allow-other, which the kernel closes to
    root too: dead or alive, EACCES; status 1); "" where the mount is dead (ENOTCONN: its daemon is gone), which is
    what --stale clears. Asked through the stats attribute in a thread of its own (`stats_table.read_stats`), so a
    hung daemon costs STALE_CHECK_S, never a hang."""
    import errno

    from fsmount.prefetch_command import mount_owner
    from fsmount.stats_table import DaemonSilent, StatsUnavailable, read_stats

    owner = mount_owner(path)
    try:
        snap = read_stats(path, STALE_CHECK_S)
    except DaemonSilent:
        from fsmount.mount import silent_mount

        return silent_mount(shown, STALE_CHECK_S), 1
    except StatsUnavailable as exc:
        if exc.errno == errno.ENOTCONN:
            return "", 0
        if exc.errno in (errno.EACCES, errno.EPERM):  # the kernel's answer, not the daemon's: alive or dead (B344)
            whose = f" of {user_name(owner)}" if owner is not None else ""
            return (f"{shown} is the modelfs mount{whose}, made without --allow-other: the kernel lets no other user, "
                    f"root included, ask its daemon whether it is alive: left mounted; unmount it (modelfs unmount "
                    f"{shown}) if it is not in use", 1)
        snap = {}  # it answered: a daemon of another version
    named = ([f"bucket {snap['bucket']}"] if isinstance(snap.get("bucket"), str) else []) + \
        ([f"daemon pid {snap['pid']}"] if isinstance(snap.get("pid"), int) else []) + \
        ([f"mounted by {user_name(owner)}"] if owner is not None else [])
    holder = f" ({', '.join(named)})" if named else ""
    return (f"{shown} is a live modelfs mount{holder}: "
            f"left mounted; unmount it (modelfs unmount {shown}) or stop its daemon first", 0)


def busy_hint(users: MountUsers, inside: list[str]) -> str:
    """What a busy unmount says holds the mount (`mount_users.mount_users`, `mounts_inside`) and what to do. Where the
    scan of /proc did not finish (its time bound passed, a process's maps did not answer), the holders it found are
    named and the generic hint follows them, with the processes whose maps did not answer (B176)."""
    from fsmount.mount_users import MOUNT_USERS_NAMED, MOUNT_USERS_SCAN_S

    generic = "a process has a file in it open or mapped, or its working directory there"
    cut = ""
    if not users.complete:
        stuck = users.unread[:MOUNT_USERS_NAMED] + ([f"{len(users.unread) - MOUNT_USERS_NAMED} more"]
                                                    if len(users.unread) > MOUNT_USERS_NAMED else [])
        cut = (f"; /proc was not read whole within {MOUNT_USERS_SCAN_S:g}s"
               + (f" (the memory map of {', '.join(stuck)} did not answer: perhaps waiting on this mount)"
                  if stuck else ""))
    said = ([f"in use by {', '.join(users.named)}"] if users.named else []) + \
        ([f"{'a mount' if len(inside) == 1 else 'mounts'} inside it: {', '.join(inside)}"] if inside else [])
    if not said:
        return f" (in use: {generic}{cut}: close them or use --lazy)"
    todo = (["stop them, or leave the mount"] if users.named else []) + \
        ([f"unmount {'it' if len(inside) == 1 else 'them'} first"] if inside else [])
    if cut:
        said.append(f"maybe others: {generic}{cut}")
        if not users.named:
            todo.insert(0, "close them")
    return f" ({'; '.join(said)}: {', or '.join(todo)}, or use --lazy)"


def cmd_stats(args: argparse.Namespace) -> int:
    import json

    from fsmount.prefetch_command import resolve_unasked
    from fsmount.stats_table import StatsUnavailable, format_stats, read_stats

    try:
        # The mount's own path, asking no daemon (`modelfs stats .` showed the mount as "."); one in a directory
        # gone from under the shell (getcwd fails) as given.
        mountpoint = resolve_unasked(args.mountpoint)
    except OSError:
        mountpoint = args.mountpoint
    try:
        snapshot = read_stats(mountpoint)  # a hung daemon is waited for up to 10 s: Ctrl-C comes then
    except StatsUnavailable as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):  # a directory of a mount, given for the mount (B266)
            from fsmount.prefetch_command import MODELFS_FSTYPE, mount_of

            at, fstype = mount_of(mountpoint)
            if fstype == MODELFS_FSTYPE and at != mountpoint:
                return fail(f"{exc}: it is inside the modelfs mount at {at} (modelfs stats {at})")
        if exc.errno == errno.EACCES:  # another user's mount made without --allow-other: say so, not only EACCES
            from fsmount.prefetch_command import closed_to_you

            why = closed_to_you(mountpoint)
            if why:
                return fail(f"cannot read stats of {mountpoint}: {why}")
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("stats interrupted", 130)
    if args.json:
        print(json.dumps(snapshot, indent=2))
        return 0
    try:
        print(format_stats(snapshot, mountpoint))
    except KeyError as exc:  # a daemon of an older version: its counters have other names
        return fail(f"{mountpoint}: its daemon runs another version of modelfs, whose stats this one cannot "
                    f"show (no {exc}): restart the mount to run this version, or read them with --json")
    return 0


def cmd_prefetch(args: argparse.Namespace) -> int:
    from fsmount.prefetch_command import (
        PartlyWarmed,
        WarmError,
        answering,
        fetched_chunks,
        unwritten,
        wait_for_writes,
        warm,
    )
    from fsmount.stats_table import human_size

    if not args.write_wait >= 0:
        return fail("--write-wait must be >= 0 seconds", 2)
    if args.threads < 1:
        return fail("--threads must be at least 1", 2)
    started = time.monotonic()
    partly: PartlyWarmed | None = None
    try:
        answering(args.paths)  # before anything asks the mounts: a stopped daemon would hold this process
        failed_before = unwritten(args.paths) if args.write_wait else 0
        try:
            n = warm(args.paths, keep_pagecache=not args.no_pagecache, threads=args.threads,
                     progress=not args.quiet and sys.stderr.isatty())
        except PartlyWarmed as exc:  # what was read is still waited for below, then the failure said
            n, partly = exc.done, exc
        elapsed = max(time.monotonic() - started, 1e-9)
        print(f"prefetched {n} bytes ({human_size(n)}) in {elapsed:.1f}s ({human_size(n / elapsed)}/s)", flush=True)
        pending = wait_for_writes(args.paths, args.write_wait, say=lambda line: print(line, flush=True)) \
            if args.write_wait else 0
        failed = unwritten(args.paths) - failed_before if args.write_wait else 0
    except WarmError as exc:
        return fail(f"prefetch failed: {exc}")
    except KeyboardInterrupt:
        return fail("prefetch interrupted", 130)
    if partly is not None:
        return fail(f"prefetch failed: {partly}")
    if pending:
        return fail(f"prefetch: {fetched_chunks(pending)} {'was' if pending == 1 else 'were'} still not written to the "
                    f"cache levels after {args.write_wait:g}s (the reads succeeded; the daemon keeps writing them)")
    if failed > 0:
        return fail(f"prefetch: {fetched_chunks(failed)} {'was' if failed == 1 else 'were'} not written to a cache "
                    "level (the NVMe cache or the shared tier failed or refused them: see the daemon's log); the reads "
                    "succeeded")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from fsmount.cleanup_command import CleanupError, cleanup

    if args.key and args.prefix:
        return fail("--key names whole keys of the bucket: give it without --prefix", 2)
    try:
        store = StoreConfig(bucket=args.bucket, prefix=args.prefix, endpoint_url=args.endpoint_url,
                            region=args.region, profile=args.profile, addressing_style=args.addressing_style)
        found, aborted = cleanup(store, args.older_than, keys=args.key, dry_run=args.dry_run, out=sys.stdout)
    except ConfigError as exc:
        return fail(str(exc), 2)
    except CleanupError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("cleanup interrupted", 130)
    what = (f"{found} incomplete upload{'' if found == 1 else 's'}"
            f"{f' older than {args.older_than:g}s' if math.isfinite(args.older_than) else ''}")
    print(f"{what}; would abort {found}" if args.dry_run else f"{what}; aborted {aborted}")
    return 0 if aborted == found or args.dry_run else 1


def cmd_cache(args: argparse.Namespace) -> int:
    from fsmount.data import is_cache_dir

    if not is_cache_dir(args.cache_dir):
        # A typo, or the cache dir of a mount not made yet, was said to be "not a modelfs cache directory", which sent
        # the user looking at a directory that is not there: say what the path is (B174). Status 1, as before.
        try:
            os.stat(args.cache_dir)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                dangling = os.path.islink(args.cache_dir)
                return fail(f"{args.cache_dir} does not exist" + (" (a symlink to nothing)" if dangling else "")
                            + ": give the --cache-dir of a mount")
            return fail(f"cache dir {args.cache_dir}: {exc.strerror or exc}")
        if not os.path.isdir(args.cache_dir):
            return fail(f"{args.cache_dir} is not a directory: give the --cache-dir of a mount")
        return fail(f"{args.cache_dir} is not a modelfs cache directory")
    # What the cache dir's code says at info level, on stderr: a wait of up to a minute for the daemon of a mount just
    # unmounted to finish its writes, entries of writes/ left alone. With no logging set up in the CLI it went nowhere,
    # and `clear` right after an unmount sat silent as if hung.
    said = logging.StreamHandler(sys.stderr)
    said.setFormatter(logging.Formatter("modelfs: %(message)s"))
    data_log = logging.getLogger("fsmount.data.cache_dir")
    data_log.addHandler(said)
    data_log.setLevel(logging.INFO)
    try:
        return _cache_action(args)
    finally:
        data_log.removeHandler(said)
        data_log.setLevel(logging.NOTSET)


def _cache_action(args: argparse.Namespace) -> int:
    from fsmount.data import CacheDirBusy, cache_clear, cache_stats, cache_verify, counted
    from fsmount.stats_table import human_size

    try:
        if args.action == "stats":
            st = cache_stats(args.cache_dir)
            print(f"{'chunks':15} {st['chunks']}")
            print(f"{'bytes':15} {st['bytes']} ({human_size(int(st['bytes'] or 0))})")
            for key in ("oldest_access", "newest_access"):
                value = st[key]
                shown = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value)) if value is not None else "-"
                print(f"{key.replace('_', ' '):15} {shown}")
            future = int(st["future_stamps"] or 0)
            if future:
                print(f"{'future stamps':15} {counted(future, 'chunk', 'chunks')} (used while this machine's clock "
                      f"was ahead; the cache counts {'it' if future == 1 else 'them'} as the oldest)")
            if st["staged_files"]:
                print(f"{'staged writes':15} {counted(int(st['staged_files'] or 0), 'file', 'files')}, "
                      f"{human_size(int(st['staged_bytes'] or 0))} "
                      "(copies of files a --writable mount is writing, or that a killed one left: `clear` removes "
                      "them, and so does the next mount)")
        elif args.action == "clear":
            chunks, staged, names = cache_clear(args.cache_dir)
            print(f"removed {counted(chunks, 'chunk file', 'chunk files')}" +
                  (f", {human_size(staged)} of copies a --writable mount left in writes/" if staged else "") +
                  (f", {counted(names, 'file', 'files')} of the names mounts learnt (names/)" if names else ""))
        else:
            ok, bad, other = cache_verify(args.cache_dir)
            print(f"{counted(ok, 'chunk', 'chunks')} verified, {len(bad)} corrupt (removed)" +
                  (f", {other} of another version's format (removed: not damaged, but this version cannot read "
                   "them)" if other else ""))
            for path in bad:
                print(f"  corrupt: {path}")
            return 1 if bad else 0
    except CacheDirBusy as exc:
        return fail(str(exc))
    except KeyboardInterrupt:  # verify of a big cache reads every chunk: minutes
        return fail(f"cache {args.action} interrupted", 130)
    except BrokenPipeError:
        raise  # the reader of the output went away: main() ends quietly
    except OSError as exc:  # a lock or chunks dir that is a symlink, a directory it may not read
        return fail(f"cache dir {args.cache_dir}: {exc.strerror or exc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Whoever read the output went away (`modelfs stats --json | head`): not a failure worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail
        return 128 + 13  # as if killed by SIGPIPE, like other tools in a pipeline


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # mount(8) runs `modelfs BUCKET MOUNTPOINT -o OPTS`, the fstab / mount.fuse3 form (no subcommand). No command but
    # mount takes -o, so in that shape a first word that is a command is a bucket of that name (`cache /models
    # fuse.modelfs ...` in fstab); one named `mount` is the command (`modelfs mount mount MOUNTPOINT` mounts it).
    with_options = any(a.startswith("-o") for a in argv)
    fstab_shape = len(argv) >= 4 and argv[2] == "-o"
    if argv and not argv[0].startswith("-") and (argv[0] not in SUBCOMMANDS or (argv[0] != "mount" and fstab_shape)):
        # Without -o, a word like a command is a typo of one (`modelfs stat /models` tried to mount the bucket 'stat').
        typo = difflib.get_close_matches(argv[0], SUBCOMMANDS, n=1, cutoff=0.75)
        if typo and not with_options:
            return fail(f"unknown command {argv[0]!r} (did you mean {typo[0]}?); to mount a bucket of that "
                        f"name: modelfs mount {argv[0]} MOUNTPOINT", 2)
        # A word with no MOUNTPOINT after it is no fstab form (`modelfs bogus` said "required: mountpoint").
        if not with_options and all(a.startswith("-") for a in argv[1:]):
            return fail(f"unknown command {argv[0]!r}: the commands are {', '.join(SUBCOMMANDS)} (modelfs --help); "
                        f"to mount a bucket of that name: modelfs mount {argv[0]} MOUNTPOINT", 2)
        argv = ["mount", *argv]
    if argv and argv[0] == "mount":
        try:
            argv = expand_mount_options(argv)
        except ConfigError as exc:
            return fail(str(exc), 2)
    parser = make_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse's parse_args said these as the top-level parser's, "modelfs: error: unrecognized arguments: --jsn
        # (see modelfs --help)", whose help lists no command's options: the command's own parser says it (B231).
        # One given before the command (`modelfs --jsn stats /m`) is the top-level parser's to say.
        before = argv[:argv.index(args.command)] if args.command in argv else argv
        said_by = parser if any(word in before for word in unknown) else parser.commands.get(args.command, parser)
        said_by.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "mount":
        # The child gets the same normalised arguments, minus the ones the parent adds itself.
        return cmd_mount(args, strip_internal(argv))
    if args.command in ("unmount", "umount"):
        return cmd_unmount(args)
    if args.command == "cache":
        return cmd_cache(args)
    if args.command == "prefetch":
        return cmd_prefetch(args)
    if args.command == "stats":
        return cmd_stats(args)
    if args.command == "cleanup":
        return cmd_cleanup(args)
    parser.print_help()
    return 2


def strip_internal(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--ready-fd":
            skip = True
            continue
        if a in ("--foreground", "-f", "--log-to-syslog"):
            continue
        out.append(a)
    return out
