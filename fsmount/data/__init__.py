"""The data path: object bytes from the store, through the cache levels, into chunks in memory.

Everything above this package (namespace, handles, model streaming, operations, the mount) imports from
here, never from the modules inside, which are private to the package:

- identity: what names a chunk (ObjectVersion, ChunkId) and the forms its bytes take;
- store: the ObjectStore protocol and its errors; boto3_store: the boto3 client; presigned: the bytes of
  ranged GETs (and the tier's whole-object GETs and PUTs) over presigned URLs with http.client;
- budget: the memory LRU, reservations, pins and buffer reuse (MemoryBudget);
- levels: the ChunkCache interface and the level stack (lookup order, origin fallback, write-through,
  the fetch-path counters);
- engine: single-flight fetches, workers, priorities and deadlines (ChunkEngine, Fetch);
- disk_cache: the NVMe cache level; chunk_file: its file format; cache_dir: its directory and lock;
  cache_admin: `modelfs cache stats|clear|verify` over a cache directory;
- shared_tier: the fleet-shared chunk tier, a level on an S3-compatible bucket; trailing: its chunk writes,
  held back until this node's origin reads are done;
- uploads: the write requests of `--writable` (PUT, multipart, copy, delete, incomplete uploads).
"""

from fsmount.data.boto3_store import MAX_KEY_BYTES, Boto3Store, endpoint_path_hint, within
from fsmount.data.budget import MemoryBudget
from fsmount.data.cache_admin import cache_clear, cache_stats, cache_verify
from fsmount.data.cache_dir import (
    CHUNKS_DIR,
    NAMES_DIR,
    WRITES_DIR,
    CacheDirBusy,
    cache_bytes,
    counted,
    free_bytes,
    human_size,
    is_cache_dir,
    still_on,
    sweep_staged_writes,
)
from fsmount.data.chunk_file import ALIGN, pwrite_all, round_up
from fsmount.data.credentials import missing_profile
from fsmount.data.disk_cache import DiskCache, default_min_free
from fsmount.data.engine import AHEAD, BACKGROUND, DEMAND, ChunkEngine, Fetch, ReadTimeout
from fsmount.data.identity import Chunk, ChunkId, ObjectVersion, WritableBuffer, new_buffer
from fsmount.data.levels import (
    DISK_THREADS,
    PUT_THREADS,
    UNREACHABLE_RETRY_S,
    ChunkCache,
    LatencyHistogram,
    LevelStack,
    wait_to_retry,
)
from fsmount.data.shared_tier import SharedTier, origin_identity
from fsmount.data.store import (
    AccessDenied,
    BucketMissing,
    CutShort,
    ListingPage,
    NoCredentials,
    NotFound,
    ObjectMeta,
    ObjectStore,
    OutOfResources,
    PreconditionFailed,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
    sent_etag,
)
from fsmount.data.uploads import (
    COPY_OBJECT_MAX,
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    Exists,
    PendingUpload,
    Replaced,
    Uploads,
    multipart_etag,
    put_etag,
)

__all__ = [
    "AHEAD", "ALIGN", "BACKGROUND", "CHUNKS_DIR", "DEMAND", "AccessDenied", "Boto3Store", "BucketMissing",
    "CutShort", "MAX_KEY_BYTES", "NoCredentials",
    "CacheDirBusy", "Chunk", "ChunkCache", "ChunkEngine", "ChunkId", "DiskCache", "Fetch", "LatencyHistogram",
    "LevelStack", "ListingPage", "MemoryBudget", "NotFound", "ObjectMeta", "ObjectStore", "ObjectVersion",
    "PreconditionFailed", "ReadTimeout", "SharedTier", "StoreError", "TimedOut", "TransientError", "Unreachable",
    "origin_identity",
    "WritableBuffer",
    "cache_bytes", "free_bytes",
    "default_min_free", "cache_clear", "cache_stats", "cache_verify", "missing_profile", "MAX_PART_SIZE", "MAX_PARTS",
    "MIN_PART_SIZE",
    "PendingUpload", "COPY_OBJECT_MAX", "Exists", "Replaced", "Uploads", "new_buffer", "pwrite_all", "round_up",
    "UNREACHABLE_RETRY_S", "wait_to_retry", "WRITES_DIR", "NAMES_DIR", "sweep_staged_writes", "counted", "DISK_THREADS",
    "is_cache_dir", "still_on", "human_size", "endpoint_path_hint",
    "PUT_THREADS", "OutOfResources", "multipart_etag", "put_etag", "sent_etag", "within",
]
