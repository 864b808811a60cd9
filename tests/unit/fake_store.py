"""An in-memory ObjectStore for unit tests, with injectable latency and faults.

It follows the same contract as `fsmount.data.Boto3Store` (blocking calls, StoreErrors, If-Match).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import trio

from fsmount.data import ListingPage, ObjectMeta, PreconditionFailed, StoreError
from fsmount.data.store import size_changed

PAGE_SIZE = 1000  # S3's ListObjectsV2 page size


class FakeStore:
    def __init__(self, bucket: str = "bucket"):
        self.bucket = bucket
        self.objects: dict[str, bytes] = {}
        self.undecodable: list[bytes] = []
        self.etags: dict[str, str] = {}
        self.latency = 0.0
        self.fault: Callable[[str, int, int], None] | None = None  # raise to inject a failure
        self.gets: list[tuple[str, int, int]] = []
        self.heads = 0
        self.lists = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data
        self.etags[key] = '"' + hashlib.md5(data).hexdigest() + '"'

    def meta(self, key: str) -> ObjectMeta:
        return ObjectMeta(key, len(self.objects[key]), self.etags[key], 1_700_000_000_000_000_000)

    def check_bucket(self, prefix: str) -> None:
        return None

    def head(self, key: str) -> ObjectMeta | None:
        with self._lock:
            self.heads += 1
        return self.meta(key) if key in self.objects else None

    def list_pages(self, prefix: str) -> Iterator[ListingPage]:
        with self._lock:
            self.lists += 1
        objects, prefixes = [], set()
        for key in sorted(self.objects):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if "/" in rest:
                prefixes.add(prefix + rest.split("/", 1)[0] + "/")
            else:
                objects.append(self.meta(key))
        undecodable = [k for k in self.undecodable if k.startswith(prefix.encode())]
        items: list[ObjectMeta | str] = [*objects, *sorted(prefixes)]
        for i in range(0, max(len(items), 1), PAGE_SIZE):
            page = items[i:i + PAGE_SIZE]
            yield ListingPage([o for o in page if isinstance(o, ObjectMeta)],
                              [p for p in page if isinstance(p, str)], undecodable if i == 0 else [],
                              last=i + PAGE_SIZE >= len(items))

    def has_children(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.objects)

    def get_range(self, key: str, etag: str, start: int, end: int, buffer: Any = None,
                  size: int | None = None) -> Any:
        with self._lock:
            self.gets.append((key, start, end))
        if self.latency:
            time.sleep(self.latency)
        if self.fault is not None:
            self.fault(key, start, end)
        if key not in self.objects:
            raise StoreError(f"GET {key!r}: not found")
        if etag and self.etags[key] != etag:
            raise PreconditionFailed(f"GET {key!r}: object changed")
        wrong_size = size_changed(str(len(self.objects[key])), size, f"GET {key!r}")  # as the Content-Range total
        if wrong_size is not None:
            raise wrong_size
        data = self.objects[key][start:end]
        if buffer is None:
            return data
        buffer[:] = data
        return buffer


class LateAnswers:
    """A `Namespace`'s runner for blocking store calls whose answers, once `late` is set, are what the bucket said when
    asked but land a second later (trio time): answers that land out of the order they were asked in."""

    def __init__(self) -> None:
        self.late = False

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        answer = fn(*args)  # what the bucket says when asked
        if self.late:
            await trio.sleep(1)
        return answer
