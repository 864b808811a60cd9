"""The names a mount keeps in its cache dir (saved_names.py): what is kept from listings, lookups and changes, the
file's round trip and its bounds, what an unreadable file does, and a namespace started while the origin is down."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from pathlib import Path

import pytest
import trio

from fsmount import namespace, saved_names
from fsmount.data import ObjectMeta, TransientError, Unreachable, cache_clear
from fsmount.data.store import version_tag
from fsmount.namespace import ROOT_INODE, DirEntry, Namespace
from fsmount.saved_names import SavedNames
from tests.helpers import ORIGIN_UNAVAILABLE
from tests.unit.fake_store import FakeStore, LateAnswers
from tests.unit.test_namespace import F_AND_G, call, landing_after, origin_down

DIR = (True, None)


def listed(saved: SavedNames, path: str, entries: dict[str, tuple[bool, ObjectMeta | None]]) -> None:
    """A whole listing of `path` landed, its entries given as (is_dir, meta) by name."""
    saved.listed(path, {name.encode("utf-8", "surrogateescape"): DirEntry(name.encode("utf-8", "surrogateescape"),
                                                                           *entry) for name, entry in entries.items()})


# What Boto3Store gives as the version of an object the server gave no ETag for (store.version_tag).
NO_ETAG = version_tag("", 3, 7)


def file_entry(key: str, size: int = 3, etag: str = '"e"') -> tuple[bool, ObjectMeta]:
    return (False, ObjectMeta(key, size, etag, 7))


def reloaded(saved: SavedNames, tmp_path: Path) -> SavedNames:
    saved.save(saved.snapshot())
    again = SavedNames(str(tmp_path), saved.bucket, saved.prefix)
    again.load()
    return again


def keeping_names_answering_late(objects: dict[str, bytes], tmp_path: Path,
                                 ) -> tuple[FakeStore, LateAnswers, SavedNames, Namespace]:
    """A store holding `objects` (key: bytes), and a namespace of it (a TTL of 0) keeping its names in `tmp_path`
    (`saved`), whose answers land a second after they were asked once `answers.late` is set. The store, the answers,
    the names kept and the namespace."""
    store = FakeStore()
    for key, data in objects.items():
        store.put(key, data)
    answers = LateAnswers()
    saved = SavedNames(str(tmp_path), store.bucket, "")
    return store, answers, saved, Namespace(store, answers, prefix="", ttl=0, saved=saved)


def started_while_down(store: FakeStore, tmp_path: Path, ttl: float) -> Namespace:
    """A namespace started with the origin away (until `del store.head, store.has_children, store.list_pages`),
    knowing what its predecessor kept in `tmp_path`."""
    store.head = store.has_children = store.list_pages = origin_down
    saved = SavedNames(str(tmp_path), store.bucket, "")
    saved.load()
    return Namespace(store, call, prefix="", ttl=ttl, saved=saved)


def test_listings_lookups_and_changes_round_trip(tmp_path: Path) -> None:
    saved = SavedNames(str(tmp_path), "b", "p/")
    listed(saved, "m", {"w.bin": file_entry("p/m/w.bin"), "sub": DIR, "odd\udcff": file_entry("k")})
    saved.found("models", DIR)  # a lookup in a directory never listed: that name only
    saved.found("x/f", file_entry("p/x/f"))
    saved.found("x/writing", (False, None))  # a file being written: not kept
    # Nothing pins its version (the server gave no ETag; Boto3Store tags it by size and date): not kept.
    saved.found("x/noetag", file_entry("p/x/noetag", etag=NO_ETAG))
    assert saved.dirty
    again = reloaded(saved, tmp_path)
    assert not saved.dirty
    assert again.listing("m") == {"w.bin": file_entry("p/m/w.bin"), "sub": DIR, "odd\udcff": file_entry("k")}
    assert again.listing("") is None and again.listing("x") is None  # lookups alone never answer a listing
    assert again.entry("models") == DIR
    assert again.entry("x/f") == file_entry("p/x/f")
    assert again.entry("x/writing") is None and again.entry("x/noetag") is None and again.entry("nope") is None
    again.found("x/f", None)  # deleted (a negative lookup, an unlink through the mount)
    again.found("m/w.bin", file_entry("p/m/w.bin", size=9, etag='"new"'))
    assert again.entry("x/f") is None and again.entry("m/w.bin") == file_entry("p/m/w.bin", size=9, etag='"new"')
    mode = stat.S_IMODE(os.stat(saved.path).st_mode), stat.S_IMODE(os.stat(os.path.dirname(saved.path)).st_mode)
    assert mode == (0o600, 0o700)


def test_an_unchanged_listing_writes_nothing(tmp_path: Path) -> None:
    saved = SavedNames(str(tmp_path), "b", "")
    listed(saved, "", {"a": file_entry("a")})
    saved.snapshot()
    listed(saved, "", {"a": file_entry("a")})  # the next listing a TTL later, the same
    saved.found("a", file_entry("a"))
    assert not saved.dirty
    listed(saved, "", {"a": file_entry("a", etag='"2"')})
    assert saved.dirty


def test_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saved_names, "SAVED_ENTRIES", 10)
    monkeypatch.setattr(saved_names, "SAVED_DIR_ENTRIES", 5)
    saved = SavedNames(str(tmp_path), "b", "")
    listed(saved, "big", {f"f{i}": file_entry(f"big/f{i}") for i in range(6)})
    assert saved.listing("big") is None  # a dataset's directory, not a model's: not kept
    for d in range(4):
        listed(saved, f"d{d}", {f"f{i}": file_entry(f"d{d}/f{i}") for i in range(3)})
    # 12 entries over 10: the directory updated least recently went.
    assert saved.listing("d0") is None and all(saved.listing(f"d{d}") is not None for d in (1, 2, 3))
    saved.found("d1/late", file_entry("d1/late"))  # 10: d1 is now the most recently updated
    assert saved.listing("d2") is not None
    saved.found("d1/later", file_entry("d1/later"))  # 11: d2 goes
    assert saved.listing("d2") is None and saved.entry("d1/late") is not None
    for i in range(5):
        saved.found(f"d3/more{i}", file_entry(f"d3/more{i}"))
    names = [*(f"f{i}" for i in range(3)), *(f"more{i}" for i in range(5))]
    assert sum(saved.entry(f"d3/{name}") is not None for name in names) == 5  # within SAVED_DIR_ENTRIES


@pytest.mark.parametrize("content", [b"{not json", b'{"format": 1, "bucket": "other", "prefix": "", "dirs": {}}',
                                     b'{"format": 1, "bucket": "b", "prefix": "", "dirs": {"": [true, {"a": [1]}]}}',
                                     b'[]',
                                     # What the parser itself cannot take (OverflowError, RecursionError): out of
                                     # load() they failed every mount of the cache dir, origin up or not.
                                     b'{"format": 1, "bucket": "b", "prefix": "", "dirs": {"": [true, {"a": '
                                     b'[false, "a", 1e400, "e", 1]}]}}',
                                     b'{"format": 1, "bucket": "b", "prefix": "", "dirs": ' + b"[" * 100_000 +
                                     b"]" * 100_000 + b"}"])
def test_a_file_that_cannot_be_read_is_left_out(tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture,
                                                allowed_logs: list[str]) -> None:
    allowed_logs.append("cannot be read")
    saved = SavedNames(str(tmp_path), "b", "")
    os.makedirs(os.path.dirname(saved.path))
    Path(saved.path).write_bytes(content)
    saved.load()
    assert len(saved) == 0 and "cannot be read" in caplog.text


def test_another_bucket_or_prefix_has_a_file_of_its_own(tmp_path: Path) -> None:
    paths = {SavedNames(str(tmp_path), b, p).path for b, p in (("b", ""), ("b", "x/"), ("c", ""))}
    assert len(paths) == 3


def test_an_older_snapshot_saved_after_a_newer_one_does_not_replace_it(tmp_path: Path) -> None:
    """A save given up on in its thread (the names task's, cancelled as a task of the mount failed) and the end's save,
    of a newer snapshot, run side by side: each encodes its snapshot before it takes the lock, and a lock is not
    first come first served, so the abandoned one can write after the end's, its older names over the newer file,
    which the daemon then exits with (B148). Here it comes second."""
    saved = SavedNames(str(tmp_path), "b", "")
    listed(saved, "", {"a": file_entry("a")})
    abandoned = saved.snapshot()
    listed(saved, "", {"a": file_entry("a"), "b": file_entry("b")})
    saved.save(saved.snapshot())  # the end's save
    saved.save(abandoned)  # the abandoned thread, late
    assert set(json.loads(Path(saved.path).read_bytes())["dirs"][""][1]) == {"a", "b"}
    assert os.listdir(os.path.dirname(saved.path)) == [os.path.basename(saved.path)]  # no temp file left


def test_a_failed_write_leaves_the_last_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = SavedNames(str(tmp_path), "b", "")
    listed(saved, "", {"a": file_entry("a")})
    saved.save(saved.snapshot())
    before = Path(saved.path).read_bytes()
    listed(saved, "", {"b": file_entry("b")})

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saved_names.os, "replace", full)
    with pytest.raises(OSError):
        saved.save(saved.snapshot())
    assert Path(saved.path).read_bytes() == before and os.listdir(os.path.dirname(saved.path)) == [
        os.path.basename(saved.path)]
    assert json.loads(before)["dirs"][""][1] == {"a": [False, "a", 3, '"e"', 7]}


async def test_a_namespace_started_while_the_origin_is_down_resolves_what_its_predecessor_saved(
        tmp_path: Path, allowed_logs: list[str]) -> None:
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("models/m/w.bin", b"12345")
    store.put("models/m/config.json", b"{}")
    store.put("other/x", b"x")
    first = SavedNames(str(tmp_path), store.bucket, "")
    ns = Namespace(store, call, prefix="", ttl=60, saved=first)
    models = await ns.lookup(ROOT_INODE, b"models")  # lookups only down to the model's directory
    m = await ns.lookup(models.ino, b"m")
    await ns.listing(m)
    w = await ns.lookup(m.ino, b"w.bin")
    first.save(first.snapshot())

    ns = started_while_down(store, tmp_path, ttl=60)
    models = await ns.lookup(ROOT_INODE, b"models")
    m = await ns.lookup(models.ino, b"m")
    assert models.is_dir and m.is_dir
    again = await ns.lookup(m.ino, b"w.bin")
    assert again.version(ns.prefix) == w.version("")  # the same version: its chunks are the cached ones
    assert sorted(e.name for e in await ns.listing(m)) == [b"config.json", b"w.bin"]
    with pytest.raises(Unreachable):
        await ns.listing(models)  # only looked up in: no listing of it was ever made
    with pytest.raises(Unreachable):
        await ns.lookup(ROOT_INODE, b"other")  # never seen


def test_cache_clear_removes_the_names_and_nothing_else_there(tmp_path: Path) -> None:
    """`modelfs cache clear` empties the cache: names kept without their chunks would have a mount started while
    the origin is away list files it cannot read. Files modelfs did not name so stay."""
    saved = SavedNames(str(tmp_path), "b", "")
    saved.found("a", file_entry("a"))
    saved.save(saved.snapshot())
    names = Path(saved.path).parent
    (names / (Path(saved.path).name + ".tmp")).write_text("left by a crash")
    (names / "notes.txt").write_text("theirs")
    (names / ("0" * 32 + ".json")).symlink_to(tmp_path / "elsewhere")
    assert cache_clear(tmp_path) == (0, 0, 2)
    assert sorted(os.listdir(names)) == ["0" * 32 + ".json", "notes.txt"]


def test_a_listing_kept_without_some_of_its_names_is_not_served_as_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name left out of a directory whose whole listing is kept (found, or written through the mount, once it held
    SAVED_DIR_ENTRIES; a file no ETag pins) left the listing said whole: a remount while the origin is away listed the
    directory without it (a listing served partially). Its lookups still answer from what is kept."""
    monkeypatch.setattr(saved_names, "SAVED_DIR_ENTRIES", 3)
    saved = SavedNames(str(tmp_path), "b", "")
    listed(saved, "d", {f"f{i}": file_entry(f"d/f{i}") for i in range(3)})
    saved.found("d/late", file_entry("d/late"))
    assert saved.listing("d") is None and saved.entry("d/f0") == file_entry("d/f0")
    listed(saved, "e", {"a": file_entry("e/a"), "noetag": file_entry("e/noetag", etag=NO_ETAG)})
    assert saved.listing("e") is None and saved.entry("e/a") == file_entry("e/a")
    listed(saved, "f", {"a": file_entry("f/a")})
    saved.found("f/noetag", file_entry("f/noetag", etag=NO_ETAG))
    assert saved.listing("f") is None
    listed(saved, "g", {"a": file_entry("g/a"), "b": file_entry("g/b")})
    saved.found("g/b", None)  # deleted: the listing is still the whole directory
    assert saved.listing("g") == {"a": file_entry("g/a")}


@pytest.mark.usefixtures("each_request_asks")
async def test_a_version_the_mount_saw_replaced_or_deleted_is_not_kept(tmp_path: Path) -> None:
    """A stat after the TTL (a HEAD: getattr) or a read refused by the bucket (412/404: `gone`) tells the mount that
    the version it knows is no longer there. Kept all the same (no lookup of the path came after it), a remount while
    the origin is away served the deleted object, or the replaced version from the NVMe cache."""
    store = FakeStore()
    for key in ("m/w.bin", "m/deleted.bin", "m/read.bin"):
        store.put(key, b"old")
    saved = SavedNames(str(tmp_path), store.bucket, "")
    ns = Namespace(store, call, prefix="", ttl=0, saved=saved)
    m = await ns.lookup(ROOT_INODE, b"m")
    nodes = {name: await ns.lookup(m.ino, name.encode()) for name in ("w.bin", "deleted.bin", "read.bin")}
    read_version = nodes["read.bin"].version("")
    store.put("m/w.bin", b"new bytes")
    del store.objects["m/deleted.bin"]
    assert (await ns.refresh(nodes["w.bin"])).superseded and (await ns.refresh(nodes["deleted.bin"])).superseded
    ns.gone(read_version)  # a GET pinned to its ETag found it replaced
    assert saved.entry("m/w.bin") == (False, store.meta("m/w.bin"))  # what the HEAD found
    assert saved.entry("m/deleted.bin") is None
    assert saved.entry("m/read.bin") is None


async def test_a_name_the_origin_just_said_is_gone_is_not_answered_from_the_kept_names(
        tmp_path: Path, allowed_logs: list[str]) -> None:
    """A lookup asks HEAD and a one-key listing at once. With the HEAD answered (no such file) and the listing failed
    (a 503 SlowDown: S3 throttles LIST before HEAD), the lookup answered from the names a predecessor kept: a file
    the origin had just said is gone, its bytes served from the NVMe cache, while the origin was up."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("m/w.bin", b"12345")
    first = SavedNames(str(tmp_path), store.bucket, "")
    ns = Namespace(store, call, prefix="", ttl=60, saved=first)
    await ns.lookup((await ns.lookup(ROOT_INODE, b"m")).ino, b"w.bin")
    first.save(first.snapshot())
    del store.objects["m/w.bin"]
    store.put("m/other", b"x")  # m stays a directory

    def slow_down(prefix: str) -> bool:
        if prefix == "m/w.bin/":
            raise TransientError("listing: SlowDown (503)")
        return FakeStore.has_children(store, prefix)

    store.has_children = slow_down  # type: ignore[method-assign]
    second = SavedNames(str(tmp_path), store.bucket, "")
    second.load()
    ns = Namespace(store, call, prefix="", ttl=60, saved=second)
    m = await ns.lookup(ROOT_INODE, b"m")
    with pytest.raises(TransientError):
        await ns.lookup(m.ino, b"w.bin")

    # The other way round: the HEAD throttled, the listing answered that nothing is under a directory kept.
    second.found("m/sub", DIR)
    store.has_children = lambda prefix: FakeStore.has_children(store, prefix)  # type: ignore[method-assign]

    def head_slow_down(key: str) -> ObjectMeta | None:
        raise TransientError("HEAD: SlowDown (503)")

    store.head = head_slow_down  # type: ignore[method-assign]
    with pytest.raises(TransientError):
        await ns.lookup(m.ino, b"sub")
    store.put("m/sub2/x", b"x")  # a directory needs no HEAD: the listing says so
    assert (await ns.lookup(m.ino, b"sub2")).is_dir


def test_the_bound_drops_the_directories_used_least_recently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's directory, listed at every TTL and never changed, and its name found again by lookups: dropped first
    at the bound while a dataset's directories came and went (its listings came back unchanged, which did not count
    as a use), so a remount while the origin was away had every name but the model's."""
    monkeypatch.setattr(saved_names, "SAVED_ENTRIES", 6)
    saved = SavedNames(str(tmp_path), "b", "")
    saved.found("model", DIR)
    listed(saved, "model", {"config.json": file_entry("model/config.json"), "w.bin": file_entry("model/w.bin")})
    listed(saved, "data/0", {f"s{i}": file_entry(f"data/0/s{i}") for i in range(3)})
    listed(saved, "model", {"config.json": file_entry("model/config.json"), "w.bin": file_entry("model/w.bin")})
    saved.found("model", DIR)  # looked up again
    listed(saved, "data/1", {f"s{i}": file_entry(f"data/1/s{i}") for i in range(3)})  # 9 over 6: data/0 goes
    assert saved.listing("model") is not None and saved.entry("model") == DIR
    assert saved.listing("data/0") is None


async def test_a_file_resolved_from_the_kept_names_keeps_its_mtime_once_the_origin_answers(
        tmp_path: Path, allowed_logs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A name kept by a predecessor may be dated later than the bucket's Last-Modified of the same version: a file it
    wrote (the time of its close; a multipart upload's Last-Modified is when it began), or a listing's milliseconds
    that a daemon before B270 kept. A mount started while the origin was away showed that date, and once the origin
    answered the bucket's, earlier, on the same inode: its mtime stepped back (`make`, `find -newer`)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    monkeypatch.setattr(namespace, "DOWN_FAST_FAIL_S", 0.0)  # asked again at once once it is back
    store = FakeStore()
    store.put("m/w.bin", b"12345")
    bucket_mtime = store.meta("m/w.bin").mtime_ns
    first = SavedNames(str(tmp_path), store.bucket, "")
    first.found("m", DIR)
    first.found("m/w.bin", (False, dataclasses.replace(store.meta("m/w.bin"), mtime_ns=bucket_mtime + 500_000_000)))
    first.save(first.snapshot())

    ns = started_while_down(store, tmp_path, ttl=0)
    m = await ns.lookup(ROOT_INODE, b"m")
    w = await ns.lookup(m.ino, b"w.bin")
    kept = w.mtime_ns
    assert kept == bucket_mtime + 500_000_000
    del store.head, store.has_children, store.list_pages  # the origin is back
    again = await ns.lookup(m.ino, b"w.bin")  # the origin answers: the bucket's version, the same inode
    assert store.heads + store.lists > 0 and again.ino == w.ino
    assert again.mtime_ns >= kept


async def test_a_lookup_asked_before_a_newer_head_found_another_version_does_not_keep_its_older_one(
        tmp_path: Path, autojump_clock: object, allowed_logs: list[str]) -> None:
    """A lookup's HEAD finds the version the kernel holds, its answer on its way; another writer stores a new version,
    and an open's HEAD of the held inode, asked after, finds it (the held one superseded, the new one kept); then the
    lookup's answer lands. Kept as the bucket's word, the older version went back into the names kept, and a remount
    while the origin was away served it, the version the mount had seen replaced (B324)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, saved, ns = keeping_names_answering_late({"m/w.bin": b"old"}, tmp_path)
    m = await ns.lookup(ROOT_INODE, b"m")
    held = await ns.lookup(m.ino, b"w.bin")
    async with landing_after(answers, ns.lookup, m.ino, b"w.bin"):
        store.put("m/w.bin", b"new bytes")
        held.confirmed_at = 0.0  # not the same system call as its lookup
        assert (await ns.refresh(held)).superseded
    assert saved.entry("m/w.bin") == (False, store.meta("m/w.bin"))
    reloaded(saved, tmp_path)
    ns = started_while_down(store, tmp_path, ttl=60)
    node = await ns.lookup((await ns.lookup(ROOT_INODE, b"m")).ino, b"w.bin")
    assert node.size == len(b"new bytes") and node.etag == store.etags["m/w.bin"]


async def test_a_listing_begun_before_a_newer_head_found_another_version_does_not_keep_its_older_one(
        tmp_path: Path, autojump_clock: object, allowed_logs: list[str]) -> None:
    """A listing of the directory finds the version the kernel holds, its answer on its way; another writer stores a
    new version, and an open's HEAD of the held inode, begun after, finds it (and a lookup, a file stored since); then
    the listing lands. Kept whole as the directory's names, it put the older version back over the new one (and left
    out the file found since), and a remount while the origin was away served it (B325)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, saved, ns = keeping_names_answering_late({"m/w.bin": b"old", "m/other.bin": b"other"}, tmp_path)
    m = await ns.lookup(ROOT_INODE, b"m")
    held = await ns.lookup(m.ino, b"w.bin")
    async with landing_after(answers, ns.listing, m):
        store.put("m/w.bin", b"new bytes")
        held.confirmed_at = 0.0  # not the same system call as its lookup
        assert (await ns.refresh(held)).superseded
        store.put("m/added.bin", b"added")  # stored after the listing began, and found by a lookup
        await ns.lookup(m.ino, b"added.bin")
    assert saved.entry("m/w.bin") == (False, store.meta("m/w.bin"))
    assert saved.entry("m/added.bin") == (False, store.meta("m/added.bin"))
    assert saved.entry("m/other.bin") == (False, store.meta("m/other.bin"))  # the rest of the listing is kept
    reloaded(saved, tmp_path)
    ns = started_while_down(store, tmp_path, ttl=60)
    m = await ns.lookup(ROOT_INODE, b"m")
    node = await ns.lookup(m.ino, b"w.bin")
    assert node.size == len(b"new bytes") and node.etag == store.etags["m/w.bin"]
    assert (await ns.lookup(m.ino, b"added.bin")).size == len(b"added")


@pytest.mark.parametrize("lookup_lands", ["before-the-listing", "after-the-listing"])
async def test_a_listing_begun_before_a_lookup_found_a_file_deleted_does_not_bring_it_back(
        lookup_lands: str, tmp_path: Path, autojump_clock: object) -> None:
    """A listing of the directory finds a file, its answer on its way; another writer deletes it, and a lookup, asked
    after, finds nothing there. A lookup's answer of nothing was dated nowhere, so the listing was not older news of
    the name: landing after that answer, the file came back, looked up as the version the lookup had found deleted,
    and kept in the names kept, which a remount while the origin was away would serve; landing before it, the listing
    cached went on answering the name for the TTL (B351)."""
    store = FakeStore()
    store.put("m/w.bin", b"old")
    store.put("m/other.bin", b"other")
    delay = [0.0]

    async def late(fn, *args):  # noqa: ANN001, ANN202
        answer = fn(*args)  # what the bucket says when asked
        await trio.sleep(delay[0])
        return answer

    saved = SavedNames(str(tmp_path), store.bucket, "")
    ns = Namespace(store, late, prefix="", ttl=60, saved=saved)
    m = await ns.lookup(ROOT_INODE, b"m")
    delay[0] = 1.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, m)  # asked now, lands in 1 s
        await trio.sleep(0.5)
        delay[0] = 0.0 if lookup_lands == "before-the-listing" else 1.0
        del store.objects["m/w.bin"]
        with pytest.raises(namespace.PathError) as exc:
            await ns.lookup(m.ino, b"w.bin")
        assert exc.value.errno == errno.ENOENT
    delay[0] = 0.0
    with pytest.raises(namespace.PathError) as exc:
        await ns.lookup(m.ino, b"w.bin")
    assert exc.value.errno == errno.ENOENT
    assert saved.entry("m/w.bin") is None
    assert saved.entry("m/other.bin") == (False, store.meta("m/other.bin"))  # the rest of the listing is kept


async def test_a_listing_begun_before_a_lookup_found_a_file_deleted_is_kept_whole_without_it(
        tmp_path: Path, autojump_clock: object, allowed_logs: list[str]) -> None:
    """A directory whose listing is kept whole; the next listing of it finds a file, its answer on its way; another
    writer deletes the file, and a lookup, asked after, finds nothing there; then the listing lands. Its name, newer
    news than the listing (B351), left the listing kept marked not whole, so a remount while the origin was away
    failed `ls` of the directory until the origin answered, where what is kept, less the name found gone, is it."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, saved, ns = keeping_names_answering_late({"m/w.bin": b"old", "m/other.bin": b"other"}, tmp_path)
    m = await ns.lookup(ROOT_INODE, b"m")
    await ns.listing(m)  # kept whole
    async with landing_after(answers, ns.listing, m):
        del store.objects["m/w.bin"]
        with pytest.raises(namespace.PathError):
            await ns.lookup(m.ino, b"w.bin")
    assert saved.listing("m") == {"other.bin": (False, store.meta("m/other.bin"))}
    reloaded(saved, tmp_path)
    ns = started_while_down(store, tmp_path, ttl=60)
    m = await ns.lookup(ROOT_INODE, b"m")
    assert [e.name for e in await ns.listing(m)] == [b"other.bin"]


def test_a_name_found_gone_then_read_at_an_older_version_is_not_left_out_of_a_later_listing(tmp_path: Path) -> None:
    """A whole listing kept; a lookup found `f` deleted (left out, the listing still whole), another writer stored it
    again, and a read of a version older than both was refused, newer news of the name than a listing under way that
    names the new one. That listing landing, the name missing from the whole listing kept was taken for one found
    gone: kept whole without `f`, a remount while the origin was away listed the directory without a file it held."""
    saved = SavedNames(str(tmp_path), "b", "")
    listed(saved, "d", {"a": file_entry("d/a"), "f": file_entry("d/f")})
    saved.found("d/f", None)  # a lookup found it deleted
    saved.gone("d/f", '"older"')  # a descriptor's read of an older version refused (412 or 404: which, unknown)
    entries = {"a": file_entry("d/a"), "f": file_entry("d/f", etag='"new"')}
    saved.listed("d", {name.encode(): DirEntry(name.encode(), *entry) for name, entry in entries.items()},
                 lambda name, etag: name == "f")  # begun before that read's refusal
    assert saved.listing("d") is None and saved.entry("d/a") == file_entry("d/a")


def test_aws_s_names_are_found_after_a_region_change_and_with_or_without_its_endpoint(tmp_path: Path) -> None:
    """AWS S3 without --endpoint-url was filed by region: after a --region change (or a node whose environment gives
    another), a mount started while the origin was away found none of the names its predecessor kept, and an AWS
    endpoint given was filed apart from none. A bucket's name there is one bucket in every region of a partition;
    another partition's, or another server's, is another bucket."""
    saved = SavedNames(str(tmp_path), "b", "", "s3:us-east-1")
    saved.found("w.bin", file_entry("w.bin"))
    saved.save(saved.snapshot())
    for origin, same in (("s3:eu-west-1", True), ("https://s3.us-west-2.amazonaws.com", True),
                         ("https://s3.amazonaws.com", True), ("s3:cn-north-1", False), ("s3:us-gov-west-1", False),
                         ("https://s3.cn-north-1.amazonaws.com.cn", False), ("http://127.0.0.1:9000", False),
                         ("https://s3.us-west-2.amazonaws.com:8443", False)):
        again = SavedNames(str(tmp_path), "b", "", origin)
        again.load()
        assert (again.entry("w.bin") is not None) is same, origin


def test_the_names_a_daemon_filed_by_region_are_read_once_where_none_are_filed_by_partition(tmp_path: Path) -> None:
    """A daemon upgraded while the origin is away still starts from what its predecessor kept under the region's
    identity (saved_names._names_file of the origin as given), and saves under the partition's."""
    before = saved_names._names_file(str(tmp_path), "b", "", "s3:us-west-2")
    os.makedirs(os.path.dirname(before), mode=0o700)
    entry = [False, "w.bin", 3, '"e"', 7]
    with open(before, "w") as f:
        json.dump({"format": saved_names.FORMAT, "bucket": "b", "prefix": "", "origin": "s3:us-west-2",
                   "dirs": {"": [False, {"w.bin": entry}]}}, f)
    saved = SavedNames(str(tmp_path), "b", "", "s3:us-west-2")
    assert saved.path != before
    saved.load()
    assert saved.entry("w.bin") is not None
    saved.save(saved.snapshot())
    again = SavedNames(str(tmp_path), "b", "", "s3:eu-west-1")
    again.load()
    assert again.entry("w.bin") is not None


def test_another_server_under_amazonaws_com_never_shares_aws_s_names(tmp_path: Path) -> None:
    """Any host under amazonaws.com with a label beginning `s3-` was taken for AWS S3: an S3-compatible server behind a
    load balancer named `s3` (`s3-1234.us-east-1.elb.amazonaws.com`), started while it did not answer, served the names
    AWS's bucket of that name had (B670). Only S3's own endpoints share them."""
    saved = SavedNames(str(tmp_path), "b", "", "s3:us-east-1")
    saved.found("w.bin", file_entry("w.bin"))
    saved.save(saved.snapshot())
    for origin, same in (("https://s3-1234567890.us-east-1.elb.amazonaws.com", False),
                         ("https://s3-cache.abc123.0001.use1.cache.amazonaws.com", False),
                         ("https://s3-proxy.internal.amazonaws.com", False),
                         ("https://s3.us-east-1.amazonaws.com.cn", False),
                         ("https://s3-us-west-2.amazonaws.com", True), ("https://s3-external-1.amazonaws.com", True),
                         ("https://s3.dualstack.eu-west-1.amazonaws.com", True),
                         ("https://s3-fips.us-east-2.amazonaws.com", True)):
        again = SavedNames(str(tmp_path), "b", "", origin)
        again.load()
        assert (again.entry("w.bin") is not None) is same, origin


async def test_a_listing_begun_before_a_read_of_the_old_version_failed_keeps_the_new_version(
        tmp_path: Path, autojump_clock: object, allowed_logs: list[str]) -> None:
    """`ls d` kept `d/f`; another writer replaced it, and a listing of `d` was under way (naming the new version) as a
    reader's GET of the old one was refused (412: `gone`, dated when it lands). That refusal was taken as newer news
    of every version, so the names kept left `f` out and `d` no longer whole: a remount while the origin was away
    failed `ls d` and `stat d/f`, where the listing had found the new version (B671)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, saved, ns = keeping_names_answering_late(F_AND_G, tmp_path)
    d = await ns.lookup(ROOT_INODE, b"d")
    old = (await ns.lookup(d.ino, b"f")).version("")
    await ns.listing(d)
    store.put("d/f", b"1234567")
    answers.late = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, d)  # asked now, lands in 1 s
        await trio.sleep(0.5)
        ns.gone(old)  # the reader's GET refused as the listing is under way
    answers.late = False
    assert saved.entry("d/f") == (False, store.meta("d/f"))
    saved.save(saved.snapshot())
    down = started_while_down(store, tmp_path, ttl=0)
    d = await down.lookup(ROOT_INODE, b"d")
    listed = {e.name: e for e in await down.listing(d)}
    assert set(listed) == {b"f", b"g"} and listed[b"f"].meta.size == 7
    assert (await down.lookup(d.ino, b"f")).size == 7
