"""The fleet-shared chunk tier: a cache level on an S3-compatible bucket near the nodes (S3 Express One
Zone, an OSS bucket in the region, a SeaweedFS or MinIO cluster), so that N nodes cold-starting one model
cost the origin about one copy of it.

A chunk object is a chunk file (chunk_file: a header naming bucket, key, ETag, chunk size, index, data
length and data hash, then the data) stored under `PREFIX chunks/<h>`, where h hashes the origin endpoint
with the chunk id, so two origins, two versions or two chunk sizes never share a key. Every read checks
the whole header against the chunk asked for and the data against its hash; a mismatch is counted,
logged once and taken as a miss, so a wrong byte is never served.

Simultaneous cold start: on a miss a node claims the chunk by creating `PREFIX claims/<h>` only if it is
absent (If-None-Match: *). The claimer fetches the chunk from the origin; the level stack writes it back
here, and `put` then drops the claim (`abandon` drops it when the fetch failed, so that the others need
not wait for it). The other nodes poll for the chunk object for up to `wait` seconds, then fetch it from
the origin themselves; every CLAIM_CHECK_S they also look at the claim, and once it is gone (dropped) or
older than CLAIM_TTL_S (its node died; it is broken) they claim the chunk and fetch it at once. A tier
that does not honour conditional writes is found at mount (`probe_claims`) and run without claims.

Failures never reach a reader: every request has the tier client's own timeout; a tier that fails a
request is skipped for UNAVAILABLE_RETRY_S (one warning per episode) and reads go to the origin; a
refused PUT pauses writes for WRITE_RETRY_S (one warning per episode) while reads go on. get and put never
raise.

Threads: get and put run in the level stack's worker threads. `_lock` guards the counters, the failure
episodes, the log-once flags and `_claimed` (chunks this node has claimed and not yet written).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from fsmount.data.chunk_file import HEADER_READ_BYTES, Corrupt, encode_chunk, read_chunk_stream
from fsmount.data.identity import ChunkId, WritableBuffer
from fsmount.data.store import StoreError, TransientError, Unreachable

log = logging.getLogger(__name__)

CHUNKS = "chunks/"
CLAIMS = "claims/"
# A claim this old is taken to belong to a node that died: long enough for a slow origin GET of one
# chunk and its write to the tier, short enough that a dead node costs others seconds, not minutes.
CLAIM_TTL_S = 30.0
# How often a node waiting for another node's fetch looks for the chunk object, and for the claim.
POLL_S = 0.05
CLAIM_CHECK_S = 0.5
# After a failed request the tier is skipped this long: a down tier must not cost every chunk a timeout.
UNAVAILABLE_RETRY_S = 10.0
# After a refused PUT (full, read-only, no permission) writes pause this long.
WRITE_RETRY_S = 30.0
# Chunk PUTs at once. A PUT by the presigned path sends the engine's buffer as it is; by botocore's (a
# proxy in the environment) it joins a whole chunk object (header + data) outside the engine's memory
# budget while it is sent, which the mount subtracts from the budget either way (staging_bytes).
PUT_THREADS = 4


class ObjectStream(Protocol):
    """One GET's body (boto3_store.ObjectReader): `size` bytes to read front to back."""

    size: int

    def read(self, n: int) -> bytes: ...

    def readinto(self, buffer: WritableBuffer) -> int: ...

    def __enter__(self) -> ObjectStream: ...

    def __exit__(self, *exc_info: object) -> None: ...


class TierClient(Protocol):
    """What the tier needs of a store client (boto3_store.Boto3Store has it). Blocking; StoreErrors."""

    bucket: str

    def open_object(self, key: str) -> ObjectStream | None: ...

    def get_object(self, key: str) -> bytes | None: ...

    def put_object(self, key: str, body: bytes | Sequence[bytes | WritableBuffer], *,
                   only_if_absent: bool = False) -> bool: ...

    def delete_object(self, key: str) -> None: ...


@dataclasses.dataclass
class TierStats:
    """What only the tier sees (its hits, misses and bytes are the level stack's to count)."""

    claims: int = 0  # chunks this node claimed, so fetched from the origin for the fleet
    claim_waits: int = 0  # misses that found another node's claim and waited for its chunk
    fallbacks: int = 0  # waits that ended without the chunk: fetched from the origin after all
    writes: int = 0
    write_errors: int = 0
    corrupt: int = 0  # chunk objects that failed the identity or checksum check
    errors: int = 0  # requests that failed (the tier was then skipped for a while)


class SharedTier:
    def __init__(self, client: TierClient, *, origin: str, prefix: str, wait: float, read_only: bool,
                 threads: int, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.origin = origin
        self.prefix = prefix
        self.wait = wait
        self.read_only = read_only
        self.claims = not read_only
        self.threads = threads  # the level stack runs this many lookups at once (network, not disk)
        self.put_threads = min(threads, PUT_THREADS)
        self.stats = TierStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None
        self._writes_paused_until: float | None = None
        self._corrupt_logged = False
        self._claimed: set[ChunkId] = set()
        self._owner = f"{socket.gethostname()} {os.getpid()}"

    def staging_bytes(self, chunk_size: int) -> int:
        """The most memory chunk objects being written hold outside the engine's budget (a read goes
        straight into the engine's buffer and holds none)."""
        return self.put_threads * (chunk_size + HEADER_READ_BYTES)

    def __str__(self) -> str:
        return f"shared cache {self.client.bucket}/{self.prefix}"

    # -- names ---------------------------------------------------------------------------------

    def _hash(self, chunk: ChunkId) -> str:
        h = hashlib.sha256()
        for part in (self.origin, chunk.digest()):
            data = part.encode("utf-8", "surrogateescape")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def chunk_key(self, chunk: ChunkId) -> str:
        return self.prefix + CHUNKS + self._hash(chunk)

    def claim_key(self, chunk: ChunkId) -> str:
        return self.prefix + CLAIMS + self._hash(chunk)

    # -- at mount ------------------------------------------------------------------------------

    def probe_claims(self) -> None:
        """Find out whether the tier honours If-None-Match: * (a second create of one key must fail);
        if not, or if it refuses the header, claims are off for this mount (one warning)."""
        if self.read_only:
            return
        key = f"{self.prefix}{CLAIMS}probe-{os.getpid()}-{time.time_ns()}"
        try:
            first = self.client.put_object(key, b"probe", only_if_absent=True)
            second = self.client.put_object(key, b"probe", only_if_absent=True)
            self.client.delete_object(key)
        except (Unreachable, TransientError):
            return  # not an answer: claims stay on, and the tier is tried as reads go
        except StoreError as exc:
            first, second = False, True
            reason = exc.message
        else:
            reason = "a second conditional create of one key succeeded"
        if first and not second:
            return
        self.claims = False
        log.warning("%s does not support conditional writes (%s): running without claims, so nodes that "
                    "start together may each fetch a chunk from the origin", self, reason)

    # -- ChunkCache ----------------------------------------------------------------------------

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        if self._down():
            return None
        data = self._read(chunk, buffer)
        if data is not None or not self.claims or self._down() or self._writes_paused():
            return data
        claimed = self._claim(chunk)
        if claimed is not False:
            return None  # ours to fetch from the origin (True), or the tier failed (None)
        with self._lock:
            self.stats.claim_waits += 1
        deadline = self._clock() + self.wait
        next_check = self._clock() + CLAIM_CHECK_S
        while self._clock() < deadline and not self._down():
            time.sleep(POLL_S)
            data = self._read(chunk, buffer)
            if data is not None:
                return data
            if self._clock() < next_check:
                continue
            # The claim may be gone (its node's fetch failed, or the node stopped) or stale (the node died):
            # then this node claims the chunk and fetches it, instead of waiting out `wait` for nothing.
            claimed = self._claim(chunk)
            if claimed:
                data = self._read(chunk, buffer)  # the claimer may have written it just before it let go
                if data is not None:  # a hit after all: this claim fetches nothing, so it is not counted
                    self._release(chunk)
                    with self._lock:
                        self.stats.claims -= 1
                return data
            if claimed is None:
                break
            next_check = self._clock() + CLAIM_CHECK_S
        with self._lock:
            self.stats.fallbacks += 1
        return None

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None:
        if self.read_only:
            return
        try:
            if self._writes_paused() or self._down():
                return
            try:
                self.client.put_object(self.chunk_key(chunk), encode_chunk(chunk, data))
            except StoreError as exc:
                self._write_failed(exc)
                return
            with self._lock:
                self.stats.writes += 1
                self._writes_paused_until = None
        finally:
            self._release(chunk)

    def abandon(self, chunk: ChunkId) -> None:
        """The chunk will not be put (this node's origin fetch failed): drop our claim on it, if any."""
        self._release(chunk)

    def drop_claims(self) -> int:
        """At unmount: drop every claim this node still holds (fetches cut short), so that other nodes need
        not wait for them until they are CLAIM_TTL_S old. How many there were."""
        with self._lock:
            held = list(self._claimed)
        for chunk in held:
            self._release(chunk)
        return len(held)

    # -- internals -----------------------------------------------------------------------------

    def _read(self, chunk: ChunkId, buffer: WritableBuffer | None) -> bytes | WritableBuffer | None:
        key = self.chunk_key(chunk)
        try:
            stream = self.client.open_object(key)
            if stream is None:
                return None
            with stream:
                # Straight into the engine's buffer: no copy of the chunk outside the memory budget.
                stored, data = read_chunk_stream(stream.read, stream.readinto, stream.size, buffer)
            if stored != chunk:
                raise Corrupt(f"it holds {stored}")
        except StoreError as exc:
            self._failed(exc)
            return None
        except Corrupt as why:
            with self._lock:
                self.stats.corrupt += 1
                first, self._corrupt_logged = not self._corrupt_logged, True
            (log.warning if first else log.debug)(
                "%s: ignoring chunk object %s for chunk %d of %r (%s)%s", self, key, chunk.index, chunk.key, why,
                "; further ones are logged at debug level and counted" if first else "")
            return None
        return data

    def _claim(self, chunk: ChunkId) -> bool | None:
        """True: this node claimed the chunk. False: another node holds a live claim. None: the tier
        failed the request."""
        key = self.claim_key(chunk)
        for _ in range(2):  # a second try only after breaking a stale claim
            try:
                if self.client.put_object(key, f"{time.time():.3f} {self._owner}".encode(), only_if_absent=True):
                    with self._lock:
                        self._claimed.add(chunk)
                        self.stats.claims += 1
                    return True
                held = self.client.get_object(key)
                if held is None or not _expired(held):
                    return False
                log.info("%s: breaking a claim older than %gs on chunk %d of %r (%s)", self, CLAIM_TTL_S,
                         chunk.index, chunk.key, held[:100].decode("utf-8", "replace"))
                self.client.delete_object(key)
            except (Unreachable, TransientError) as exc:
                self._failed(exc)
                return None
            except StoreError as exc:  # refused (no write permission, full): as a refused chunk write
                self._write_failed(exc)
                return None
        return False

    def _release(self, chunk: ChunkId) -> None:
        with self._lock:
            if chunk not in self._claimed:
                return
            self._claimed.discard(chunk)
        try:
            self.client.delete_object(self.claim_key(chunk))
        except StoreError as exc:  # the claim then expires on its own
            log.debug("%s: dropping the claim on chunk %d of %r failed: %s", self, chunk.index, chunk.key, exc)

    def _down(self) -> bool:
        with self._lock:
            if self._down_until is None:
                return False
            if self._clock() < self._down_until:
                return True
        return False  # the pause is over: the next request tries the tier again

    def _failed(self, exc: StoreError) -> None:
        with self._lock:
            self.stats.errors += 1
            first = self._down_until is None or self._clock() >= self._down_until + UNAVAILABLE_RETRY_S
            self._down_until = self._clock() + UNAVAILABLE_RETRY_S
        (log.warning if first else log.debug)(
            "%s unavailable (%s): reading from the origin, trying the tier again in %gs", self, exc.message,
            UNAVAILABLE_RETRY_S)

    def _writes_paused(self) -> bool:
        with self._lock:
            return self._writes_paused_until is not None and self._clock() < self._writes_paused_until

    def _write_failed(self, exc: StoreError) -> None:
        with self._lock:
            self.stats.write_errors += 1
            first = self._writes_paused_until is None
            self._writes_paused_until = self._clock() + WRITE_RETRY_S
        if first:
            log.warning("%s: writing a chunk failed (%s); reads go on, writes pause and are retried every %gs",
                        self, exc.message, WRITE_RETRY_S)


def _expired(claim: bytes) -> bool:
    """A claim's body starts with its creation time (epoch seconds); unreadable counts as expired."""
    try:
        created = float(claim.split(b" ", 1)[0])
    except ValueError:
        return True
    return time.time() - created > CLAIM_TTL_S
