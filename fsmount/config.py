"""The one configuration object of a mount: frozen dataclasses, parsing of sizes and TTLs, defaults.

Everything here is pure and validated at construction; nothing here touches the network or the disk.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import resource
import shlex
from collections.abc import Iterable

from fsmount.sysmem import ram as usable_ram

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# 8 MiB chunks: Mountpoint-S3 part size, ossfs 2.0 chunk, Run:ai streamer chunk.
DEFAULT_CHUNK_SIZE = 8 * MiB
# 16 parallel 8 MiB GETs reached the origin ceiling here (boto3 530-655 MB/s on the dev box).
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_MAX_READAHEAD = 256 * MiB
# With read_ahead_kb=16384 the kernel sends 1 MiB READs (its largest; measured on the dev box).
DEFAULT_KERNEL_READAHEAD = 16 * MiB
# FUSE's background requests (READs of the kernel's read-ahead): the kernel allows 12 and calls the
# connection congested at 9, and then shrinks read-ahead and frees pages it had just allocated. 64 let
# a 1 MiB-READ server keep up with a sequential reader (cat of 1 GiB: 1.58 s -> 0.65 s, reader CPU
# 0.71 -> 0.26 s/GB; bench/fuse_floor.py --max-background).
DEFAULT_FUSE_MAX_BACKGROUND = 64
DEFAULT_METADATA_TTL = 60.0
# Meant as "never expires" for `--metadata-ttl forever`; the kernel takes 64-bit seconds.
FOREVER_TTL = 10.0 * 365 * 24 * 3600
DEFAULT_READ_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 10.0
# What carries the bytes of a ranged GET: presigned URLs read by http.client into recycled buffers
# (the default: less CPU per byte), or boto3's get_object.
GET_CLIENTS = ("presigned", "boto3")
# Metadata calls (HEAD, LIST) get their own threads so a burst of lookups never waits behind data (mount.py); the
# store's boto3 client keeps a connection for each, beside those of the writes and the data.
METADATA_THREADS = 8
# --write-part-size: S3 part sizes are 5 MiB to 5 GiB; 8 MiB as Mountpoint-S3 (and our chunks).
DEFAULT_WRITE_PART_SIZE = 8 * MiB
MIN_WRITE_PART_SIZE = 5 * MiB
MAX_WRITE_PART_SIZE = 5 * GiB
MEMORY_LIMIT_CAP = 2 * GiB
MEMORY_LIMIT_RAM_FRACTION = 0.10
# ... and at most this part of the address space where it is limited (`ulimit -v`, RLIMIT_AS).
ADDRESS_SPACE_SHARE = 4
# --memory-limit bounds the daemon's RSS. The interpreter, boto3, pyfuse3 and prometheus-client
# take ~75-85 MiB of it here (idle daemon, measured); chunk data gets the rest.
RUNTIME_RESERVE = 96 * MiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_SIZE_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}


class ConfigError(ValueError):
    """A user-supplied option is invalid; the message is shown as is."""


# uid_t and gid_t are 32 bits; 2^32 - 1 is (uid_t) -1, "no id".
MAX_ID = 2**32 - 1


def parse_size(text: str) -> int:
    """'8M' -> 8 MiB, '1G', '512k', '1.5G', '4096' (bytes). Suffixes are binary (K = 1024)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"invalid size {text!r}: use a number with an optional K/M/G/T suffix, e.g. 8M")
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    return int(value)


# A duration written with a unit ("2m", "1.5h"), which the duration options refuse: they take seconds, and the
# refusal gives the number.
_UNIT_SECONDS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|d)\s*", re.IGNORECASE)


def seconds_hint(text: str) -> str:
    """What to give a duration option instead of `text`: seconds, and for "2m" the number (120)."""
    m = _DURATION_RE.fullmatch(str(text))
    if m:
        return f"give seconds ({float(m.group(1)) * _UNIT_SECONDS[m.group(2).lower()]:g} for {text!r})"
    return "give seconds (120 is two minutes)"


def parse_seconds(text: str) -> float:
    """A duration option's value: seconds as a number. `--read-timeout 2m` was argparse's "invalid float value: '2m'"
    where `--metadata-ttl 5m` was told to give seconds (B630)."""
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"invalid duration {text!r}: {seconds_hint(text)}") from None


def parse_ttl(text: str) -> float:
    """Seconds as a number, or 'forever'. 'never' is refused: it reads as "never cached" as well as "never
    expires" (it was taken for 'forever', silently)."""
    word = str(text).strip().lower()
    if word in ("forever", "inf", "infinite"):
        return FOREVER_TTL
    if word == "never":
        raise ConfigError("invalid TTL 'never': say 'forever' (names never asked again) or 0 (always asked)")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"invalid TTL {text!r}: {seconds_hint(text)} or 'forever'") from None
    if value < 0 or math.isnan(value):
        raise ConfigError(f"invalid TTL {text!r}: must be >= 0")
    return min(value, FOREVER_TTL)


def parse_mode(text: str) -> int:
    try:
        mode = int(str(text), 8)
    except ValueError:
        raise ConfigError(f"invalid mode {text!r}: give octal permission bits, e.g. 0444") from None
    if not 0 <= mode <= 0o777:
        # setuid, setgid and sticky bits mean nothing on a mount of objects (and it is mounted nosuid).
        raise ConfigError(f"invalid mode {text!r}: permission bits only, 0 to 0777")
    return mode


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """`--cache-size`: a byte count, or a fraction of the filesystem that holds the cache dir (measured
    when the cache opens)."""

    bytes: int = 0
    fraction: float | None = None

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%" if self.fraction is not None else str(self.bytes)


def parse_cache_size(text: str) -> CacheSize:
    """'500G' (bytes) or '80%' (of the cache dir's filesystem)."""
    spec = str(text).strip()
    if spec.endswith("%"):
        try:
            fraction = float(spec[:-1]) / 100
        except ValueError:
            raise ConfigError(f"invalid cache size {text!r}: give bytes (500G) or a share of the disk (80%)") \
                from None
        if not 0 < fraction <= 1:
            raise ConfigError(f"cache size {text!r} must be above 0% and at most 100%")
        return CacheSize(fraction=fraction)
    size = parse_size(spec)
    if size <= 0:
        raise ConfigError(f"cache size {text!r} must be above zero")
    return CacheSize(bytes=size)


def tier_inside_mount(sc: SharedCacheConfig, store: StoreConfig, same_endpoint: bool) -> str | None:
    """Why the shared tier may not be where it is, if it lies inside what the mount shows (`same_endpoint`: the two
    endpoints are one server): accepted, its chunk objects showed as files of the mount, and a prefetch of the
    mount's root read them and wrote chunk objects of them in turn. Checked on the options as given here, and again
    on the endpoints as the clients resolve them (mount.open_shared_tier: one may come from the AWS configuration).
    A mount inside one of the folders the tier writes (`--prefix cache/chunks/` beside a tier at `cache/`) shows its
    objects too: refused alike (B250)."""
    if sc.bucket != store.bucket or not same_endpoint:
        return None
    if sc.prefix.startswith(store.prefix):
        return (f"the shared tier ({sc.bucket}, prefix {sc.prefix!r}) lies inside what the mount shows "
                f"({store.bucket}, prefix {store.prefix!r}): give the tier another bucket, or a "
                "--shared-cache-prefix outside the mount's --prefix")
    if any(store.prefix.startswith(sc.prefix + folder) for folder in SHARED_TIER_FOLDERS):
        return (f"the mount ({store.bucket}, prefix {store.prefix!r}) lies inside the shared tier's own objects "
                f"({sc.bucket}, prefix {sc.prefix!r}: {', '.join(SHARED_TIER_FOLDERS)}): give the tier another "
                "bucket or --shared-cache-prefix")
    return None


def default_memory_limit() -> int:
    """min(2 GiB, 10% of RAM): room for a window of read-ahead per reader on a GPU node, and little
    enough beside the inference server itself. RAM is the cgroup's limit where that is lower (a pod). Where the
    address space is limited (`ulimit -v`), at most a quarter of it: the daemon's threads and libraries take
    address space of their own, and at `ulimit -v 600000` the 2 GiB default failed fetches with ENOMEM (an mmap
    loader died of SIGBUS) where 200M worked."""
    ram = usable_ram()
    limit = MEMORY_LIMIT_CAP if ram is None else min(MEMORY_LIMIT_CAP, int(ram * MEMORY_LIMIT_RAM_FRACTION))
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        limit = min(limit, address_space // ADDRESS_SPACE_SHARE)
    return limit


# The longest --read-timeout taken: a day (a request that waits longer is a hung one).
MAX_READ_TIMEOUT = 86400.0


def _check_bucket(cfg: StoreConfig | SharedCacheConfig, bad_bucket: str, style_flag: str) -> None:
    """The rules a bucket, its addressing style and a key prefix follow, for the origin and the shared
    tier alike; the prefix is normalised in place to 'a/b/' (no leading '/', one trailing '/')."""
    if not cfg.bucket or "/" in cfg.bucket:
        hint = ""
        if cfg.bucket.startswith(("s3://", "oss://")):
            name, _, key_prefix = cfg.bucket.split("://", 1)[1].partition("/")
            hint = f": give the bucket's name alone ({name!r})" + (f" and --prefix {key_prefix}" if key_prefix else "")
        elif "/" in cfg.bucket:
            hint = ": a bucket name has no '/' (a path inside the bucket is --prefix)"
        raise ConfigError(f"{bad_bucket} {cfg.bucket!r}{hint}")
    if cfg.addressing_style not in ("auto", "path", "virtual"):
        raise ConfigError(f"{style_flag} must be auto, path or virtual")
    prefix = cfg.prefix.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if any(part in ("", ".", "..") for part in prefix.split("/")[:-1]):
        # Keys under such a prefix cannot be paths of the tree (`dir//` listed entries stat could not find).
        raise ConfigError(f"prefix {cfg.prefix!r}: its path segments may not be empty, '.' or '..'")
    object.__setattr__(cfg, "prefix", prefix)


def virtual_style_ignored(endpoint_url: str | None, addressing_style: str) -> str | None:
    """The host of an endpoint that botocore addresses with path style although `virtual` was asked for (an IP
    address: a bucket cannot be a name under it), or None. It does so without a word; a server that takes
    virtual-hosted requests only (OSS) then refuses every one."""
    if addressing_style != "virtual" or not endpoint_url:
        return None
    from urllib.parse import urlsplit

    try:
        host = urlsplit(endpoint_url).hostname
        ipaddress.ip_address(host or "")
    except ValueError:
        return None
    return host


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """How to reach the bucket. Credentials are never stored here: boto3 finds them itself."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str = "auto"
    no_sign_request: bool = False
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    get_client: str = "presigned"

    def __post_init__(self) -> None:
        _check_bucket(self, "invalid bucket name", "--addressing-style")
        if self.get_client not in GET_CLIENTS:
            raise ConfigError(f"--get-client must be one of {', '.join(GET_CLIENTS)}")
        if self.max_connections < 1:
            raise ConfigError("--max-connections must be >= 1")
        if not 0 < self.read_timeout <= MAX_READ_TIMEOUT:
            # Unbounded, it was taken (inf, 1e12) and every request then failed: no deadline that far ahead.
            raise ConfigError(f"--read-timeout must be > 0 and at most {MAX_READ_TIMEOUT:g} seconds")
        if not self.connect_timeout > 0:
            raise ConfigError("the connect timeout must be > 0")


def cleanup_command(store: StoreConfig, keys: Iterable[str]) -> str:
    """The `modelfs cleanup` command line that aborts the incomplete uploads of exactly `keys` (whole keys of the
    bucket) and of no other, with the options that reach `store`'s bucket: what the daemon's warnings advise. A
    `--prefix KEY` found nothing (prefixes end in '/'), and one bucket-wide aborted other mounts' live uploads."""
    words = ["modelfs", "cleanup", store.bucket]
    for flag, value in (("--endpoint-url", store.endpoint_url), ("--region", store.region),
                        ("--profile", store.profile)):
        if value:
            words += [flag, value]
    if store.addressing_style != "auto":
        words += ["--addressing-style", store.addressing_style]
    for key in keys:
        words += ["--key", key]
    return shlex.join([*words, "--older-than", "0"])


DEFAULT_SHARED_CACHE_PREFIX = "modelfs/"
# The folders the shared tier writes under its prefix (shared_tier's chunk objects, claims, waiting markers): a mount
# showing one of them would show the tier's objects as files (tier_inside_mount).
SHARED_TIER_FOLDERS = ("chunks/", "claims/", "waiting/")
# A node waits this long per chunk for another node's fetch of it to appear in the shared tier, then
# fetches it from the origin itself: 8 MiB at a few hundred MB/s takes tens of ms, so seconds of waiting
# only pass when the node that claimed the chunk is slow or gone.
DEFAULT_SHARED_CACHE_WAIT = 5.0
# Connect and read timeout of one shared-tier request: the tier sits near the nodes, so a request that
# takes longer means it is down or overloaded, and the origin is the better bet.
DEFAULT_SHARED_CACHE_TIMEOUT = 5.0


@dataclasses.dataclass(frozen=True)
class SharedCacheConfig:
    """The fleet-shared chunk tier: an S3-compatible bucket near the nodes. Credentials as for the
    origin (environment, instance role, or `profile`)."""

    bucket: str
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str = "auto"
    prefix: str = DEFAULT_SHARED_CACHE_PREFIX
    read_only: bool = False
    wait: float = DEFAULT_SHARED_CACHE_WAIT
    timeout: float = DEFAULT_SHARED_CACHE_TIMEOUT

    def __post_init__(self) -> None:
        _check_bucket(self, "invalid --shared-cache-bucket", "--shared-cache-addressing-style")
        # Bounded as --read-timeout is: the tier's requests take `timeout` as theirs (StoreConfig), and a larger one
        # (1e20) was refused there, in the daemon, as "--read-timeout must be ...", an option not given (B235).
        if not (0 <= self.wait <= MAX_READ_TIMEOUT and 0 < self.timeout <= MAX_READ_TIMEOUT):
            raise ConfigError("--shared-cache-wait must be >= 0 and --shared-cache-timeout > 0, both in seconds and "
                              f"at most {MAX_READ_TIMEOUT:g}")


@dataclasses.dataclass(frozen=True)
class MountConfig:
    store: StoreConfig
    mountpoint: str
    foreground: bool = False
    uid: int = dataclasses.field(default_factory=os.getuid)
    gid: int = dataclasses.field(default_factory=os.getgid)
    file_mode: int = 0o444
    dir_mode: int = 0o555
    allow_other: bool = False
    allow_non_empty: bool = False
    metadata_ttl: float = DEFAULT_METADATA_TTL
    log_level: str = "info"
    log_file: str | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    memory_limit: int = dataclasses.field(default_factory=default_memory_limit)
    max_readahead: int = DEFAULT_MAX_READAHEAD
    kernel_readahead: int = DEFAULT_KERNEL_READAHEAD
    fuse_max_background: int = DEFAULT_FUSE_MAX_BACKGROUND
    cache_dir: str | None = None
    cache_size: CacheSize = CacheSize(fraction=0.8)
    model_streaming: bool = True
    pagecache_push_limit: int | None = None  # None: a share of MemAvailable at mount time
    metrics_addr: str | None = None  # HOST:PORT of the Prometheus endpoint, checked by the CLI
    shared_cache: SharedCacheConfig | None = None
    writable: bool = False
    allow_overwrite: bool = False
    allow_delete: bool = False
    write_part_size: int = DEFAULT_WRITE_PART_SIZE

    @property
    def chunk_memory(self) -> int:
        """Bytes of chunk data the engine may hold: the limit less the runtime's own share, but
        never less than four chunks (tiny limits are for tests, not for RSS)."""
        return max(4 * self.chunk_size, self.memory_limit - RUNTIME_RESERVE)

    @property
    def kernel_window(self) -> int:
        """The kernel read-ahead the mount asks for: --kernel-readahead, but at most an eighth of the chunk
        memory. A sequential reader keeps two such windows of READs requested (pagecache.KERNEL_WINDOWS_AHEAD),
        and their chunks must fit in memory beside what is fetched ahead of them: with 16 MiB windows and
        32 MiB of chunk memory (--memory-limit 128M) a `cat` fetched its chunks up to 1.5 times each."""
        return min(self.kernel_readahead, self.chunk_memory // 8)

    def __post_init__(self) -> None:
        if not (0 <= self.uid < MAX_ID and 0 <= self.gid < MAX_ID):
            # Above it, the daemon crashed on its first reply (OverflowError: a uid_t is 32 bits, and -1 means none).
            raise ConfigError(f"--uid and --gid must be >= 0 and < {MAX_ID}")
        if self.chunk_size < 64 * KiB or self.chunk_size > 256 * MiB:
            raise ConfigError("--chunk-size must be between 64K and 256M")
        # Room for at least a few chunks in flight, or read-ahead could never make progress.
        if self.memory_limit < 4 * self.chunk_size:
            raise ConfigError(
                f"--memory-limit must be at least 4 chunks ({4 * self.chunk_size // MiB} MiB "
                f"with --chunk-size {self.chunk_size // MiB} MiB)"
            )
        if self.max_readahead < 0:
            raise ConfigError("--max-readahead must be >= 0")
        if self.kernel_readahead < 0 or 0 < self.kernel_readahead < KiB:
            # read_ahead_kb is in KiB: below 1K it was taken as 0, "leave the kernel's", without a word.
            raise ConfigError("--kernel-readahead must be 0 (leave the kernel's) or at least 1K")
        if not 0 <= self.fuse_max_background <= 65535:
            raise ConfigError("--fuse-max-background must be between 0 and 65535")
        if (self.allow_overwrite or self.allow_delete) and not self.writable:
            raise ConfigError("--allow-overwrite and --allow-delete need --writable")
        sc = self.shared_cache
        inside = sc is not None and tier_inside_mount(
            sc, self.store, (sc.endpoint_url or "").rstrip("/") == (self.store.endpoint_url or "").rstrip("/"))
        if inside:
            raise ConfigError(inside)
        if not MIN_WRITE_PART_SIZE <= self.write_part_size <= MAX_WRITE_PART_SIZE:
            raise ConfigError("--write-part-size must be between 5M and 5G (S3's part sizes)")
        if self.writable and 2 * self.write_part_size > self.chunk_memory:
            most = self.chunk_memory // 2
            fits = (f"{most // MiB}M here" if most >= MIN_WRITE_PART_SIZE else
                    "less than the 5M minimum here: raise --memory-limit")
            raise ConfigError(f"--write-part-size must be at most half of --memory-limit's chunk memory, {fits} "
                              f"(parts are held in memory while they upload; the chunk memory is "
                              f"{self.chunk_memory // MiB} MiB of the {self.memory_limit // MiB} MiB limit)")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError("--log-level must be debug, info, warning, error or critical")
