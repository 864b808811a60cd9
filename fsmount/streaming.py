"""Model streaming: when a safetensors file is opened, read its header and stream the whole data region
through the chunk engine in offset order, pushing each chunk into the kernel page cache. (Read-ahead is
another thing: per handle, driven by sequential READs, in readahead.py.)

One stream per object version, shared by all handles of it, cancelled when the last one closes or
at unmount. Opening a shard of a sharded model (Hugging Face's names: `model-00001-of-00004.safetensors`)
or its index (`model.safetensors.index.json`) also warms the model's other shards, one at a time in name
order, at background priority; those run until done or unmount. Other safetensors files of the
directory (checkpoints of other steps, an adapter, the shards of an older sharding left beside) are not
warmed: only what belongs to the model opened (for an index, the shards its `weight_map` names).
A malformed header only disables the stream (one log line); it never fails a read.

Concurrency: `_active` maps (key, etag) to the one `_FileStream` of that version, a shard being warmed
included (opening it joins that stream, or replaces it when the kernel did not know the shard and so
nothing of it could be pushed); it is changed only in the trio thread, by `opened` / `closed`,
which run in FUSE handlers without awaiting, and by `_warm_siblings` before and after each shard.
`_warmed_models` maps a model to the versions (key, etag) of its files when it was warmed: opening a file of
a version not among them (the model was replaced in the bucket) warms it again; the models opened last are kept
(WARMED_MODELS_KEPT), and one opened again after it was forgotten is warmed again. `_in_room`
counts the chunks of every stream from the fetch it queues to the end of its push, up to `room()`
(STREAM_MEMORY_SHARE); a stream takes one (`_take_room`) right before it queues a fetch, with no checkpoint
between, and `_one_chunk` gives it back whatever happens (`_leave`). A chunk the page cache holds
(`MemoryBudget.in_page_cache`) is not streamed, checked again once the stream has room for it; when a READ
shows the kernel dropped chunks of an open file since (`dropped`), a stream that ended is replaced by one
more run. A shard to warm that the kernel has not looked up is looked up through the mount (`look_up`) just
before its turn, so that its pushes can land.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

import cachetools
import trio

from fsmount.data import AHEAD, BACKGROUND, Chunk, ChunkEngine, Fetch, ObjectVersion, StoreError
from fsmount.pagecache import PageCachePusher
from fsmount.safetensors import LENGTH_PREFIX, Layout, SafetensorsError, header_length, parse_header

log = logging.getLogger(__name__)

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
# A shard of a sharded model, as Hugging Face (transformers, diffusers) names them.
SHARD_NAME = re.compile(r"(?P<stem>.+)-\d+-of-(?P<count>\d+)\.safetensors")
# An index larger than this is not read for its shard names (then every shard of the stem is warmed). A dense
# model's index is small (405B, 1,134 tensors: ~90 KB); a large MoE's lists every expert's weights (671B with 256
# experts a layer and FP8 scales, ~90,000 tensors: ~8.4 MiB, by building its names). Twice that bounds what one
# open fetches for it; its parse is reserved from the chunk budget as a header's is (`_parse_json`).
MAX_INDEX_BYTES = 16 * 1024 * 1024
# Versions whose header was found malformed, remembered (the newest this many) so that each is logged at
# INFO once, not at every open (a loop opening a 0-byte `.safetensors` logged ~200 lines a second), and its
# header is not fetched again.
NOT_STREAMED_KEPT = 1024
# Versions rewritten through the mount remembered (ModelStreamer._rewritten).
REWRITTEN_KEPT = 1024
# Models whose warmed versions are remembered (`ModelStreamer._warmed_models`), the ones opened last. A mount that
# lives through many checkpoints, each a model of its own directory (step-100/, step-200/...), kept an entry for each
# of them for its whole life, each with its files' keys and ETags (~150 B a file).
WARMED_MODELS_KEPT = 1024
# Where the data of the versions streamed last ends (their headers parsed), the newest this many: a file opened
# again needs no header, whose chunk memory has often let go since (chunks pushed to the page cache are the
# first evicted). Each open fetched that chunk again: 50 processes opening shards in a loop had the origin
# send 16 GiB for 2 GiB of models, with the page cache holding them all.
DATA_ENDS_KEPT = 4096
# Memory a header's parse takes at most (`parse_cost`: json.loads' objects, the str it decodes, a Tensor each),
# from tracemalloc's peaks. Per byte of header: real headers take 8-12x; the densest JSON without containers
# 21x (one-character strings of U+0100-U+07FF, beside one character that makes the decoded str 4 bytes a
# character), ints and floats 14x. Each `[` or `{` takes up to ~90 bytes more, which a flat factor cannot
# cover: lists nested in lists take 49x their size, dicts nested in dicts 42x, a list of `{}` 29x. The two
# numbers below cover every one of those by 14% or more; a real header is reserved ~27x.
PARSE_BYTES_PER_BYTE = 24
PARSE_BYTES_PER_CONTAINER = 120


def parse_cost(data: bytes) -> int:
    """Memory that parsing `data` (JSON) takes, at most: see PARSE_BYTES_PER_BYTE."""
    return len(data) * PARSE_BYTES_PER_BYTE + (data.count(b"[") + data.count(b"{")) * PARSE_BYTES_PER_CONTAINER


def index_shards(data: bytes) -> set[str] | None:
    """The file names an index's `weight_map` names, or None if it is not such an index."""
    try:
        weight_map = json.loads(data).get("weight_map")
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        return None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return None
    return set(weight_map.values())


def model_of(key: str) -> tuple[str, str | None] | None:
    """Which sharded model a key belongs to, for warming its other shards: (directory/stem, shard count)
    for a shard, (directory/stem, None) for an index (any count), None for anything else."""
    directory, _, name = key.rpartition("/")
    if name.endswith(INDEX_SUFFIX):
        return f"{directory}/{name.removesuffix(INDEX_SUFFIX)}", None
    m = SHARD_NAME.fullmatch(name)
    return (f"{directory}/{m['stem']}", m["count"]) if m else None


def same_model(model: tuple[str, str | None], key: str) -> bool:
    """Whether `key` is a shard of `model` (what `model_of` said of the file that was opened)."""
    other = model_of(key)
    return (other is not None and other[1] is not None and other[0] == model[0]
            and model[1] in (None, other[1]))


# Fetches a stream keeps queued ahead: enough to keep every connection busy twice over.
QUEUE_DEPTH_PER_CONNECTION = 2
# Share of the chunk memory that all streams together may hold in chunks fetched or queued for their pushes
# (`ModelStreamer.room`). Read-ahead of all open handles together keeps within the other half
# (`Operations._window_cap`). Without this bound, a memory limit below the streams' queues (16 connections
# x 2 x 8 MiB = 256 MiB per stream) made each stream evict from memory what it or the loader's read-ahead
# had fetched and not yet pushed or read, and fetch it again: a `cat` of a 1 GiB model at
# `--memory-limit 256M` fetched 1.1-1.4 times its bytes, measured (bench/RESULTS.md).
STREAM_MEMORY_SHARE = 1 / 2
# Of those, chunks a local cache level holds (engine.held_locally): each takes milliseconds,
# and each one ahead holds a buffer until its push, so a deep queue of them only draws fresh memory
# (first-touch faults cost ~0.4 CPU-s per GB on the dev box) and buys no speed.
NEARBY_DEPTH = 4


@dataclasses.dataclass(eq=False)
class _FileStream:
    version: ObjectVersion
    ino: int | None  # None: the kernel does not know the file yet, so nothing can be pushed
    priority: int = AHEAD
    handles: int = 0
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    pushed: int = 0
    held_in_memory: int = 0  # streamed bytes that only the memory LRU holds
    again: bool = False  # run again because the kernel dropped what an earlier run pushed (`dropped`)
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


Siblings = Callable[[int], Awaitable[list[tuple[int | None, ObjectVersion]]]]
LookUp = Callable[[ObjectVersion], Awaitable[int | None]]
# Of byte ranges of an open file (its version, its inode), which the page cache holds whole; None: not known.
Resident = Callable[[ObjectVersion, int, list[tuple[int, int]]], Awaitable[list[bool] | None]]
Readers = Callable[[], int]
_Parsed = TypeVar("_Parsed")


class ModelStreamer:
    def __init__(self, engine: ChunkEngine, pusher: PageCachePusher, *, max_connections: int,
                 enabled: bool = True, siblings: Siblings | None = None, look_up: LookUp | None = None,
                 readers: Readers = lambda: 1, resident: Resident | None = None):
        self.engine = engine
        self.resident = resident  # asks the kernel which chunks of a file it holds (residency.py), or None
        self.readers = readers  # handles open for reading (Operations.readers), each with its kernel windows
        self.siblings = siblings
        self.look_up = look_up  # has the kernel look a file up, so its pushes can land: its inode, or None
        self._warmed_models: cachetools.LRUCache[str, set[tuple[str, str]]] = cachetools.LRUCache(WARMED_MODELS_KEPT)
        # Versions whose inode a rewrite through the mount took (`rewritten`): never streamed or warmed again, as their
        # pushes would land in the new file's pages (a warming listed its shards before the rewrite).
        self._rewritten: cachetools.LRUCache[tuple[str, str], bool] = cachetools.LRUCache(REWRITTEN_KEPT)
        self.pusher = pusher
        self.enabled = enabled
        self.depth = max(2, max_connections * QUEUE_DEPTH_PER_CONNECTION)
        self._in_room = 0
        self._room_freed = trio.Event()
        self.streamed_bytes = 0
        self.skipped_read = 0  # streamed bytes not pushed because READs had already taken them
        self._active: dict[tuple[str, str], _FileStream] = {}
        self._not_streamed: cachetools.LRUCache[tuple[str, str], str] = cachetools.LRUCache(NOT_STREAMED_KEPT)
        self._data_ends: cachetools.LRUCache[tuple[str, str], int] = cachetools.LRUCache(DATA_ENDS_KEPT)
        self._nursery: trio.Nursery | None = None
        self._parsing = trio.Lock()  # one header parse at a time, its memory reserved from the chunk budget

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def stop(self) -> None:
        """The mount is stopping: every stream and warming ends, and no file opened from now on is streamed."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            self._nursery = None

    def room(self) -> int:
        """Chunks all streams may hold at once: their share of the chunk memory left beside the kernel windows
        of the files open."""
        ahead = self.pusher.beside_readers(self.engine.memory.limit, self.readers())
        return max(2, int(ahead * STREAM_MEMORY_SHARE) // self.engine.chunk_size)

    async def _take_room(self) -> None:
        while self._in_room >= self.room():
            await self._room_freed.wait()
        self._in_room += 1

    def _give_room(self) -> None:
        self._in_room -= 1
        self._room_freed.set()
        self._room_freed = trio.Event()

    def opened(self, ino: int, version: ObjectVersion) -> None:
        if not self.enabled or self._nursery is None:
            return
        model = model_of(version.key) if self.siblings is not None else None
        if model is not None and (version.key, version.etag) not in self._warmed_models.get(model[0], ()):
            # The model's first open, or a file of it replaced since it was warmed.
            warmed = self._warmed_models[model[0]] = {(version.key, version.etag)}
            self._nursery.start_soon(self._warm_siblings, ino, version, model, warmed)
        if not version.key.endswith(SAFETENSORS_SUFFIX):
            return
        key = (version.key, version.etag)
        if key in self._rewritten:
            return
        job = self._active.get(key)
        if job is not None and job.priority > AHEAD:
            # A shard being warmed in the background is opened. If the kernel knew it, the warming pushed
            # what it fetched and goes on for this handle, at an open file's priority. If not, none of it
            # could be pushed: a stream of its own pushes what is in memory and fetches the rest (chunks
            # in flight are joined, not fetched twice).
            if job.ino is not None:
                job.priority = AHEAD
            else:
                job.scope.cancel()
                self.engine.abandon(job)
                job = None
        if job is None:
            job = self._active[key] = _FileStream(version, ino)
            self._nursery.start_soon(self._run_job, job)
        job.handles += 1

    def closed(self, version: ObjectVersion) -> None:
        job = self._active.get((version.key, version.etag))
        if job is None:
            return
        job.handles -= 1
        if job.handles <= 0:
            self._end(job)

    def rewritten(self, version: ObjectVersion) -> None:
        """The inode of `version` is being rewritten through the mount (which keeps the inode): its stream ends,
        else it would push the old bytes into the pages of the new file. Its descriptors read on without one."""
        self._rewritten[(version.key, version.etag)] = True
        job = self._active.get((version.key, version.etag))
        if job is not None:
            job.handles = 0
            self._end(job)

    def _end(self, job: _FileStream) -> None:
        """A stream no handle holds any more stops, and gives back what it pushed."""
        job.scope.cancel()
        del self._active[(job.version.key, job.version.etag)]
        self.engine.abandon(job)
        if job.done.is_set():  # else _run_job gives its pushes back once the push in flight ended
            self.pusher.release(job.pushed)

    def streaming(self, version: ObjectVersion) -> bool:
        """Whether a stream of this open file is fetching it in offset order (or waiting to)."""
        job = self._active.get((version.key, version.etag))
        return job is not None and not job.done.is_set()

    def dropped(self, version: ObjectVersion) -> None:
        """The kernel dropped pages of an open file that were believed held (a READ came for them): a stream
        that ended is run again, once while the file stays open (should the kernel drop them again, a page
        cache too small for the file would only make it fetch and push the file over and over), for what the
        page cache now lacks. A stream still running sees it chunk by chunk. Under memory pressure
        (`PageCachePusher.evicted`) nothing runs again, and pushes shrink."""
        if self.pusher.evicted():
            return  # memory pressure, not a drop: the page cache would only evict what streaming pushed again
        key = (version.key, version.etag)
        job = self._active.get(key)
        if job is None or job.again or not job.done.is_set() or job.handles <= 0 or self._nursery is None:
            return
        self.pusher.release(job.pushed)  # what it pushed is gone from the page cache, or the kernel's to evict
        again = self._active[key] = _FileStream(version, job.ino, priority=job.priority, handles=job.handles,
                                                again=True)
        self._nursery.start_soon(self._run_job, again)

    async def _warm_siblings(self, ino: int, opened: ObjectVersion, model: tuple[str, str | None],
                             remembered: set[tuple[str, str]]) -> None:
        """Warm the shards of `model` beside `opened`, adding their versions to `remembered`: the set `opened`
        put in `_warmed_models`, updated in place, so that a warming that ends after later models were opened
        neither moves its model ahead of them in the LRU order nor brings back one forgotten meanwhile."""
        assert self.siblings is not None
        try:
            files = await self.siblings(ino)
            names = await self._shards_named(opened) if model[1] is None else None
        except Exception as exc:  # noqa: BLE001 - warming is optional
            log.info("not warming the other shards: %s", exc)
            return
        shards = [(sib_ino, v) for sib_ino, v in files if same_model(model, v.key)
                  and (names is None or v.key.rpartition("/")[2] in names)]
        # Its files as they are now, its index included: opening any of them later warms nothing again.
        warmed = {(v.key, v.etag) for _, v in shards}
        warmed.update((v.key, v.etag) for _, v in files if model_of(v.key) == (model[0], None))
        remembered.update(warmed)
        for sib_ino, version in shards:
            key = (version.key, version.etag)
            if key in self._active or key in self._rewritten:
                continue
            if sib_ino is None and self.look_up is not None:
                # A loader that opens shards by name, from the index (transformers), leaves the next ones
                # unknown to the kernel: their chunks could not be pushed, only held in memory, where the
                # shard being loaded evicted them before they were opened (1.12-1.25x the bytes fetched at
                # --memory-limit 256M, bench/RESULTS.md). Looked up now, just before its turn.
                sib_ino = await self.look_up(version)
                if key in self._active or key in self._rewritten:
                    continue  # opened meanwhile: its own stream runs
            # In `_active` while it runs, so that opening the shard joins this stream instead of starting a
            # second one over the same chunks; a handle opened meanwhile keeps it there until it closes.
            job = self._active[key] = _FileStream(version, sib_ino, priority=BACKGROUND)
            await self._run_job(job)
            if job.handles <= 0 and self._active.get(key) is job:
                del self._active[key]

    async def _shards_named(self, index: ObjectVersion) -> set[str] | None:
        """The shard names an opened index lists (None: all shards of its stem, as it could not be read): other
        shard sets of the same stem (an older sharding left beside it) are not the model."""
        if index.size > MAX_INDEX_BYTES:
            return None
        try:
            return await self._parse_json(f"index of {index.size} bytes", index, index.size, index_shards)
        except SafetensorsError as exc:
            log.info("warming every shard of %r's stem: %s", index.key, exc)
            return None

    async def _run_job(self, job: _FileStream) -> None:
        with job.scope:
            try:
                await self._stream(job)
            except SafetensorsError as exc:
                self._refused((job.version.key, job.version.etag), exc)
            except Exception as exc:  # noqa: BLE001 - streaming failures only cost speed
                log.info("streaming of %r stopped: %s", job.version.key, exc)
        job.done.set()
        if job.handles <= 0:
            # No handle holds the file open (closed meanwhile, or a shard warmed for nobody yet): what it
            # pushed is the kernel's to keep or evict, and no longer counts against the push limit, which
            # is for files still open (pagecache.py). Given back here, after the last push ended.
            self.pusher.release(job.pushed)

    async def _data_end(self, obj: ObjectVersion) -> int:
        """Where the version's tensor data ends, from its header (parsed once per version, DATA_ENDS_KEPT)."""
        key = (obj.key, obj.etag)
        if key in self._not_streamed:
            raise SafetensorsError(self._not_streamed[key])
        end = self._data_ends.get(key)
        if end is not None:
            return end
        # Copied out at once: a view would pin chunk 0's buffer (no reuse) for as long as the stream runs.
        n = header_length(bytes(await self.engine.peek(obj, 0, min(obj.size, LENGTH_PREFIX))), obj.size)
        # Parsing takes 8-12x a real header in memory and up to ~50x a hostile one (PARSE_BYTES_PER_BYTE): a 97 MB
        # header of 1.4 million tensors took 1.5 GB, three at once at --memory-limit 256M 4.3 GB over it. So it is
        # reserved from the chunk budget, and a header that would take more than half of it is not streamed. Real
        # models' headers are a few MB (100,000 tensors: ~12 MB).
        def keep(layout: Layout) -> None:
            log.debug("streaming %r: %d tensors", obj.key, len(layout.tensors))
            self._data_ends[key] = layout.data_end

        layout = await self._parse_json(f"header of {n} bytes", obj, LENGTH_PREFIX + n, parse_header, obj.size,
                                        keep=keep, refused=lambda exc: self._refused(key, exc))
        return layout.data_end

    async def _parse_json(self, what: str, obj: ObjectVersion, length: int, parse: Callable[..., _Parsed],
                          *args: object, keep: Callable[[_Parsed], None] = lambda parsed: None,
                          refused: Callable[[SafetensorsError], None] = lambda exc: None) -> _Parsed:
        """`parse(data, *args)` of the first `length` bytes of `obj` (a header, an index), in a worker thread, one
        parse at a time, with the memory it takes (`parse_cost`) reserved from the chunk budget. SafetensorsError
        where that would be more than half of it: refused before the fetch by its size alone, then by its
        containers. On the trio thread, a header of 100,000 tensors (12 MB, a second to parse) held every READ
        and lookup of the mount (84 MB: 7 s). `keep` takes what the parse returned, and `refused` the
        SafetensorsError it raised, in the trio thread, even if the caller was cancelled meanwhile
        (`_parse_in_thread`)."""
        memory = self.engine.memory
        cost = self._parse_fits(what, length * PARSE_BYTES_PER_BYTE)
        async with self._parsing:
            await memory.reserve(cost)
            try:
                data = bytes(await self.engine.peek(obj, 0, length))
                more = self._parse_fits(what, parse_cost(data)) - cost
                await memory.reserve(more)
                cost += more
            except BaseException:
                memory.release(cost)
                raise
            return await self._parse_in_thread(cost, keep, refused, parse, data, *args)

    def _parse_fits(self, what: str, cost: int) -> int:
        """`cost` (of a parse), unless it would take more than half of the chunk memory: SafetensorsError then."""
        if cost > self.engine.memory.limit // 2:
            raise SafetensorsError(f"{what} would take ~{cost >> 20} MiB to parse, more than half of this mount's "
                                   "chunk memory")
        return cost

    def _refused(self, key: tuple[str, str], exc: SafetensorsError) -> None:
        """A version's header is not streamed: said once (then at debug), and remembered, so not parsed again."""
        (log.debug if key in self._not_streamed else log.info)("not streaming %r: %s", key[0], exc)
        self._not_streamed[key] = str(exc)

    async def _parse_in_thread(self, cost: int, keep: Callable[[_Parsed], None],
                               refused: Callable[[SafetensorsError], None], parse: Callable[..., _Parsed],
                               *args: object) -> _Parsed:
        """`parse(*args)` in a worker thread, whose `cost` bytes the caller reserved from the chunk budget: given
        back when the thread ends, and what it returned given to `keep`. A cancel (the file closed, the unmount)
        does not wait for the thread, which nothing can interrupt: the daemon's exit waited for it (a header of
        100,000 tensors parses for a second, 84 MB for 7 s). Its memory stays counted meanwhile, as the thread
        holds it until it returns; and what it parsed is kept all the same, or what it refused given to `refused`
        (a file opened and closed at once needs its header parsed again at its next open otherwise, and a malformed
        one was refused without a word)."""
        token, memory = trio.lowlevel.current_trio_token(), self.engine.memory

        def ended(parsed: list[_Parsed], failed: list[SafetensorsError]) -> None:  # in the trio thread
            memory.release(cost)
            if parsed:
                keep(parsed[0])
            elif failed:
                refused(failed[0])

        def run() -> _Parsed:
            parsed: list[_Parsed] = []
            failed: list[SafetensorsError] = []
            try:
                parsed.append(parse(*args))
                return parsed[0]
            except SafetensorsError as exc:
                failed.append(exc)
                raise
            finally:
                try:
                    token.run_sync_soon(ended, parsed, failed)
                except trio.RunFinishedError:
                    pass  # the mount stopped: there is no budget left to give it back to

        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)

    async def _stream(self, job: _FileStream) -> None:
        obj, engine = job.version, self.engine
        indices = engine.chunk_range(obj, 0, await self._data_end(obj))
        if job.again:
            await self._believe_resident(job, indices)
        async with trio.open_nursery() as nursery:
            # A shard warmed in the background leaves half the room to the streams of files that are open.
            depth = self.depth if job.priority <= AHEAD else max(1, min(self.depth, self.room() // 2))
            slots, nearby = trio.Semaphore(depth), trio.Semaphore(NEARBY_DEPTH)
            for index in indices:
                cid = engine.chunk_id(obj, index)
                if engine.memory.in_page_cache(cid):
                    continue  # pushed already (a shard warmed before it was opened), or read whole
                near = nearby if engine.held_locally(obj, index) else None
                if near is not None:
                    await near.acquire()
                await slots.acquire()
                if not engine.levels and job.held_in_memory >= engine.memory.limit // 2:
                    # Neither the page cache nor a disk cache takes more: streaming on would
                    # only evict chunks the loader has not read yet.
                    log.debug("streaming of %r stops at chunk %d: memory share used", obj.key, index)
                    break
                await self._take_room()
                if engine.memory.in_page_cache(cid):
                    # The loader's READs took it whole while this stream waited: fetched again, it would
                    # only be skipped (measured: 3-14 chunks of 98 fetched twice, two models read at once).
                    self._leave(slots, near)
                    continue
                # Queued here, in order: tasks started in one batch run in no fixed order.
                part = self.engine.fetch(obj, index, job, job.priority)
                nursery.start_soon(self._one_chunk, job, index, part, slots, near)
                del part  # waiting for the next slot, this loop holds no chunk (its task does, until its push)

    async def _believe_resident(self, job: _FileStream, indices: range) -> None:
        """Before a run again: the chunks the page cache still holds whole are believed held (so not fetched).
        A READ showed only that the kernel lacks some page of the file; reclaim takes a few pages at a time,
        and the rest of the file is often still there (`residency.py`). Unknown, every chunk is fetched."""
        if self.resident is None or job.ino is None or not indices:
            return
        engine, obj = self.engine, job.version
        ranges = [(i * engine.chunk_size, i * engine.chunk_size + engine.chunk_length(obj, i)) for i in indices]
        held = await self.resident(obj, job.ino, ranges)
        if held is None:
            return
        for index, whole in zip(indices, held, strict=True):
            if whole:
                engine.memory.held_by_kernel(engine.chunk_id(obj, index))
        log.debug("streaming %r again: the page cache lacks %d of its %d chunks", obj.key,
                  held.count(False), len(held))

    async def _one_chunk(self, job: _FileStream, index: int, part: Fetch | Chunk, slots: trio.Semaphore,
                         near: trio.Semaphore | None) -> None:
        try:
            try:
                length = len(await part.wait() if isinstance(part, Fetch) else part)
            except StoreError:
                return  # logged by the engine; the loader's own READ will try again
            # From here on the chunk is the engine's alone: this task holds no reference while its push
            # waits its turn (see PageCachePusher.push), and takes it back from memory then.
            if isinstance(part, Fetch):  # not a chunk that was in memory already
                self.streamed_bytes += length
            del part
            await self._push(job, index, length)
        finally:
            self._leave(slots, near)

    def _leave(self, slots: trio.Semaphore, near: trio.Semaphore | None) -> None:
        """A chunk of a stream is done with (pushed, skipped, or not fetched): its room and slots are free."""
        self._give_room()
        slots.release()
        if near is not None:
            near.release()

    async def _push(self, job: _FileStream, index: int, length: int) -> None:
        cid = self.engine.chunk_id(job.version, index)

        offset = index * self.engine.chunk_size
        reader_near = False

        def take() -> Chunk | None:
            # Once READs took bytes of it the kernel caches what they returned: pushing it then would
            # copy it a second time; so would a push racing the READs of a reader that is about to get
            # there. Its READs, not this, tell the engine when it is spent.
            nonlocal reader_near
            reader_near = job.ino is not None and self.pusher.reader_near(job.ino, offset, offset + length)
            if reader_near or self.engine.memory.read_by_kernel(cid):
                return None
            return self.engine.memory.get(cid, length)

        if job.ino is not None and await self.pusher.push(job.ino, offset, length, take):
            job.pushed += length
            self.engine.memory.demote(cid)
        elif reader_near or self.engine.memory.read_by_kernel(cid):
            self.skipped_read += length
        else:
            job.held_in_memory += length
