"""The namespace against the fake store: names, listings, lookups, inode numbers, lookup counts."""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import cachetools
import pytest
import trio

from fsmount import namespace
from fsmount.config import FOREVER_TTL
from fsmount.data import AccessDenied, ListingPage, ObjectMeta, StoreError, TimedOut, Unreachable
from fsmount.namespace import RELIST_ENTRIES, ROOT_INODE, Namespace, Node, PathError
from tests.helpers import ORIGIN_UNAVAILABLE
from tests.unit.fake_store import FakeStore, LateAnswers

MiB = 1 << 20


async def call(fn, *args):  # noqa: ANN001, ANN201
    return fn(*args)


async def answered_in_a_second(fn, *args):  # noqa: ANN001, ANN201
    """A store call that takes 1 s (virtual time with autojump_clock), answered as the bucket is then."""
    await trio.sleep(1)
    return fn(*args)


def make_ns(store: FakeStore, prefix: str = "", ttl: float = 60.0) -> Namespace:
    return Namespace(store, call, prefix=prefix, ttl=ttl)


async def names(ns: Namespace, ino: int) -> dict[bytes, bool]:
    return {e.name: e.is_dir for e in await ns.listing(ns.node(ino))}


def origin_down(*args: object) -> None:
    """Stands in for a store call while the origin is down."""
    raise Unreachable("cannot reach the endpoint")


def go_down(store: FakeStore) -> None:
    """From now on the origin is away: every request the namespace sends `store` fails so."""
    store.head = store.has_children = store.list_pages = origin_down  # type: ignore[method-assign]


def skips_logged(caplog: pytest.LogCaptureFixture, named: str) -> tuple[int, list[str]]:
    """What was logged of skipped keys since the last call (then forgotten): how many lines name one key (those
    holding `named`), and the lines that count the rest."""
    messages = [r.getMessage() for r in caplog.records]
    caplog.clear()
    return (sum(named in m for m in messages), [m for m in messages if "more keys under" in m])


# What most of the tests of answers landing late hold: `d/f` (5 bytes) and `d/g` (3).
F_AND_G = {"d/f": b"12345", "d/g": b"123"}


def a_namespace_answering_late(objects: dict[str, bytes], kind: type[Namespace] = Namespace, ttl: float = 0,
                               ) -> tuple[FakeStore, LateAnswers, Namespace]:
    """The setup of the tests of answers landing out of the order they were asked in: a store holding `objects` (key:
    bytes), and a namespace of it (`kind`, with `ttl`) whose answers land a second after they were asked once
    `answers.late` is set. The store, the answers and the namespace."""
    store = FakeStore()
    for key, data in objects.items():
        store.put(key, data)
    answers = LateAnswers()
    return store, answers, kind(store, answers, prefix="", ttl=ttl)


@asynccontextmanager
async def landing_after(answers: LateAnswers, request: Callable[..., Awaitable[object]], *args: object,
                        ) -> AsyncIterator[None]:
    """`request(*args)` (a listing, a lookup, a HEAD of an inode) asked now, half a second before the block; its
    answers, what the bucket said when asked, land a second after they were asked, after what the block does
    (`answers` holds them back). What the block asks is answered at once."""
    answers.late = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, *args)  # asked now, lands in 1 s
        await trio.sleep(0.5)
        answers.late = False
        yield


async def beside_a_listing(ns: Namespace, answers: LateAnswers, d: Node, listing: str, kept: dict[bytes, bool],
                           answer: Callable[[], Awaitable[None]]) -> None:
    """`answer()` (another writer's change and the answer that finds it) after `ls d` was kept, naming `kept`
    ("kept-before"), or while a listing of `d` asked before it is under way and lands a second later, after it
    ("landing-after"; `answers` holds it back)."""
    if listing == "kept-before":
        assert await names(ns, d.ino) == kept
        await answer()
        return
    async with landing_after(answers, ns.listing, d):
        await answer()


async def test_keys_become_files_and_prefixes_directories() -> None:
    store = FakeStore()
    for key in ["a.txt", "d/b.txt", "d/e/c.txt", "empty-dir/", "zero"]:
        store.put(key, b"x" * len(key) if key != "zero" else b"")
    ns = make_ns(store)
    assert await names(ns, ROOT_INODE) == {b"a.txt": False, b"d": True, b"empty-dir": True, b"zero": False}
    d = await ns.lookup(ROOT_INODE, b"d")
    assert d.is_dir and await names(ns, d.ino) == {b"b.txt": False, b"e": True}
    empty = await ns.lookup(ROOT_INODE, b"empty-dir")
    assert await names(ns, empty.ino) == {}  # the marker object itself is not listed
    zero = await ns.lookup(ROOT_INODE, b"zero")
    assert zero.size == 0


async def test_directory_wins_over_file_of_same_name() -> None:
    store = FakeStore()
    store.put("dup", b"file")
    store.put("dup/inner", b"inner")
    ns = make_ns(store)
    assert await names(ns, ROOT_INODE) == {b"dup": True}
    ns2 = make_ns(store)  # without a cached listing: HEAD + LIST path
    assert (await ns2.lookup(ROOT_INODE, b"dup")).is_dir


async def test_unrepresentable_keys_are_skipped_with_one_log_line(caplog, allowed_logs) -> None:  # noqa: ANN001
    allowed_logs.append("skipping key")
    store = FakeStore()
    bad = ["a//b", "./x", "../y", "c/./d", "c/../e", "z" * 256, "nul\x00name"]
    for key in bad + ["ok/fine"]:
        store.put(key, b"1")
    store.undecodable.append(b"bad\xffname")
    ns = make_ns(store)
    for _ in range(2):
        root = await names(ns, ROOT_INODE)
    assert root == {b"a": True, b"c": True, b"ok": True}
    a = await ns.lookup(ROOT_INODE, b"a")
    assert await names(ns, a.ino) == {}
    c = await ns.lookup(ROOT_INODE, b"c")
    assert await names(ns, c.ino) == {}
    skipped = [r.getMessage() for r in caplog.records if "skipping key" in r.getMessage()]
    assert len(skipped) == 8  # once per key although the root was listed twice
    assert (await ns.lookup(ROOT_INODE, b"..")).ino == ROOT_INODE  # never the key '..'
    with pytest.raises(PathError):
        await ns.lookup(ROOT_INODE, b"z" * 256)


async def test_entries_a_server_lists_outside_the_prefix_are_skipped(caplog, allowed_logs) -> None:  # noqa: ANN001
    """SeaweedFS answered a listing of `dir//` with `dir//dir/` and `dir/sub/`: cut at the prefix's length,
    the second became an entry `ub` that no lookup could find. What does not start with the prefix is
    skipped. The listing's store calls are named (a timeout said "next timed out")."""
    from fsmount.data import ListingPage

    allowed_logs.append("skipping key")

    class Stray(FakeStore):
        def list_pages(self, prefix: str):  # noqa: ANN202
            for page in super().list_pages(prefix):
                yield ListingPage([*page.objects, self.meta("elsewhere.bin")], [*page.prefixes, "other/"],
                                  page.undecodable)

    store = Stray()
    for key in ("m/a.bin", "m/sub/b.bin", "elsewhere.bin"):
        store.put(key, b"x")
    calls: list[str] = []

    async def named(fn, *args):  # noqa: ANN001, ANN202
        calls.append(fn.__name__)
        return fn(*args)

    ns = Namespace(store, named, prefix="m/", ttl=60.0)
    assert await names(ns, ROOT_INODE) == {b"a.bin": False, b"sub": True}
    assert "listing_page" in calls
    skipped = [r.getMessage() for r in caplog.records if "skipping key" in r.getMessage()]
    assert any("key 'elsewhere.bin'" in m for m in skipped), skipped
    assert any("keys under 'other/'" in m for m in skipped), skipped


async def test_more_than_1000_entries_paginate() -> None:
    store = FakeStore()
    for i in range(2500):
        store.put(f"many/f{i:05d}", b"")
    ns = make_ns(store)
    many = await ns.lookup(ROOT_INODE, b"many")
    assert len(await names(ns, many.ino)) == 2500


@pytest.mark.parametrize(("files", "ttl", "by_name"), [(50, 60.0, False), (RELIST_ENTRIES + 1, 60.0, True),
                                                        (50, 0.0, True)])
async def test_lookups_past_the_ttl_list_a_small_directory_again_and_ask_a_big_ones_names(
        files: int, ttl: float, by_name: bool) -> None:
    """B1200: once the listing of a directory of at most RELIST_ENTRIES has expired, a lookup lists it again, which
    answers the other names too (missing ones included), rather than ask each by name (a HEAD and a one-key listing);
    a bigger directory's, or with TTL 0, still are."""
    store = FakeStore()
    for i in range(files):
        store.put(f"d/f{i:04d}", b"x" * i)
    ns = make_ns(store, ttl=ttl)
    d = await ns.lookup(ROOT_INODE, b"d")
    await ns.listing(d)
    ns._listings.clear()  # its TTL ran out
    store.heads = store.lists = 0
    asked = [f"f{i:04d}".encode() for i in range(0, files, files // 10)]
    found = [(await ns.lookup(d.ino, name)).size for name in asked]
    assert found == [int(name[1:]) for name in asked]
    for i in range(3):
        with pytest.raises(PathError):
            await ns.lookup(d.ino, f"absent{i}".encode())
    if by_name:  # (the fake store does not count the one-key listings)
        assert (store.heads, store.lists) == (len(asked) + 3, 0)
    else:
        assert (store.heads, store.lists) == (0, 1)


async def test_a_relisting_begun_before_a_change_beside_was_learnt_does_not_answer_the_files_beside_it(
        autojump_clock: Any) -> None:
    """B1260: a model listed (`ls`) once its listing had expired; a read of one shard refused meanwhile (the push
    learnt: the files beside it are asked again, `_changed_beside`), then an open of another shard. Its lookup waited
    for that listing, begun before the push (B1200's relisting), and took the old version as confirmed: the open
    that follows it asked no HEAD, and opened the old revision."""
    store, answers, ns = a_namespace_answering_late({"d/a": b"old", "d/b": b"old"}, ttl=60)
    d = await ns.lookup(ROOT_INODE, b"d")
    assert await names(ns, d.ino) == {b"a": False, b"b": False}
    a, b = await ns.lookup(d.ino, b"a"), await ns.lookup(d.ino, b"b")
    ns._listings.clear()  # its TTL ran out
    async with landing_after(answers, ns.listing, d):
        for key in ("d/a", "d/b"):
            store.put(key, b"newer!")  # the push
        assert ns.gone(a.version(""))[1] == [(d.ino, b"b")]  # a read of a, refused: b's entry dropped
        ns.forget(b.ino, 1)
        opened = await ns.open_file((await ns.lookup(d.ino, b"b")).ino)
    assert opened.size == len(b"newer!")


async def test_inode_numbers_are_stable_and_forget_honours_counts() -> None:
    store = FakeStore()
    store.put("f", b"123")
    ns = make_ns(store, ttl=0)
    n1 = await ns.lookup(ROOT_INODE, b"f")
    n2 = await ns.lookup(ROOT_INODE, b"f")
    assert n1.ino == n2.ino and n1.lookups == 2
    ns.forget(n1.ino, 1)
    assert ns.node(n1.ino).lookups == 1
    ns.forget(n1.ino, 1)
    with pytest.raises(PathError):
        ns.node(n1.ino)
    again = await ns.lookup(ROOT_INODE, b"f")
    assert again.ino == n1.ino


async def test_missing_names_are_enoent_and_cached_negative() -> None:
    store = FakeStore()
    store.put("x", b"1")
    ns = make_ns(store)
    for _ in range(3):
        with pytest.raises(PathError) as exc:
            await ns.lookup(ROOT_INODE, b"nope")
        assert exc.value.errno == errno.ENOENT
    assert store.heads == 1


@pytest.mark.usefixtures("each_request_asks")
async def test_metadata_refreshes_after_ttl() -> None:
    store = FakeStore()
    store.put("f", b"old")
    ns = make_ns(store, ttl=0)
    node = await ns.lookup(ROOT_INODE, b"f")
    old_etag = node.etag
    store.put("f", b"newer!")
    node = await ns.refresh(node)
    # The inode is one version: it keeps the old one, and the path's next lookup is a new inode.
    assert node.superseded and node.size == 3 and node.etag == old_etag
    new = await ns.lookup(ROOT_INODE, b"f")
    assert new.ino != node.ino and new.size == 6 and new.etag == store.etags["f"]
    node = new
    node.fresh_until = 0
    del store.objects["f"]
    # Deleted: the inode keeps its attributes (descriptors open on it fstat and read what is cached, as those of an
    # unlinked file; this raised ENOENT), an open of it is ESTALE, and the path is gone.
    node = await ns.refresh(node)
    assert node.superseded and node.size == 6
    with pytest.raises(PathError) as exc:
        await ns.open_file(node.ino)
    assert exc.value.errno == errno.ESTALE
    with pytest.raises(PathError) as exc:
        await ns.lookup(ROOT_INODE, b"f")
    assert exc.value.errno == errno.ENOENT


@pytest.mark.parametrize("change", ["replaced", "deleted"])
async def test_a_version_the_bucket_no_longer_holds_is_superseded_whatever_the_ttl(change: str) -> None:
    """A GET pinned to a version failed (412 or 404): with --metadata-ttl forever the next open must still get
    ESTALE, and the path's next lookup ask the bucket (not the cached listing) for what it holds now."""
    store = FakeStore()
    store.put("d/f", b"old")
    ns = make_ns(store, ttl=float("inf"))
    d = await ns.lookup(ROOT_INODE, b"d")
    await names(ns, d.ino)  # the listing names the old version
    node = await ns.lookup(d.ino, b"f")
    old = node.version("")
    if change == "replaced":
        store.put("d/f", b"newer!")
    else:
        del store.objects["d/f"]
    assert await ns.open_file(node.ino) == old  # nothing says so yet: the TTL is forever
    assert ns.gone(old) == ((d.ino, b"f"), [])  # the kernel entry to drop; no file beside it
    with pytest.raises(PathError) as exc:
        await ns.open_file(node.ino)
    assert exc.value.errno == errno.ESTALE
    if change == "replaced":
        new = await ns.lookup(d.ino, b"f")
        assert new.ino != node.ino and new.size == 6 and await ns.open_file(new.ino) == new.version("")
    else:
        with pytest.raises(PathError) as exc:
            await ns.lookup(d.ino, b"f")
        assert exc.value.errno == errno.ENOENT


async def test_with_ttl_0_the_requests_of_one_open_ask_the_bucket_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An open() is a LOOKUP, a GETATTR and an OPEN: with TTL 0 each sent a HEAD, and a file rewritten all the time was
    found replaced between them, at the kernel's retry too (ESTALE). The lookup's answer holds for ONE_CALL_S, from
    when it arrived; a request after that asks again."""
    clock = [1000.0]
    monkeypatch.setattr(namespace.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    store.put("f", b"old")
    ns = make_ns(store, ttl=0)
    node = await ns.lookup(ROOT_INODE, b"f")
    heads = store.heads
    store.put("f", b"newer!")
    clock[0] += namespace.ONE_CALL_S / 2
    assert not (await ns.refresh(node)).superseded  # its GETATTR
    assert await ns.open_file(node.ino) == node.version("")  # its OPEN
    assert store.heads == heads
    clock[0] += namespace.ONE_CALL_S
    assert (await ns.refresh(node)).superseded and store.heads == heads + 1


@pytest.mark.usefixtures("each_request_asks")
@pytest.mark.parametrize("change", ["rolled back", "deleted and put again"])
async def test_a_version_the_bucket_holds_again_opens_again(change: str) -> None:
    """A superseded version that comes back (a rollback, or the same bytes uploaded again) maps to its old inode,
    which stayed superseded: every open got ESTALE, the kernel's retry looked the path up to the same inode, and
    so on until the kernel forgot it (a new user's held-open checkpoint)."""
    store = FakeStore()
    store.put("f", b"old")
    ns = make_ns(store, ttl=0)
    node = await ns.lookup(ROOT_INODE, b"f")
    old = node.version("")
    if change == "rolled back":
        store.put("f", b"newer!")
    else:
        del store.objects["f"]
    assert (await ns.refresh(node)).superseded
    if change == "rolled back":
        assert (await ns.lookup(ROOT_INODE, b"f")).ino != node.ino
    store.put("f", b"old")
    ns._negative.clear()  # what the TTL (0) does by the time the next lookup comes
    again = await ns.lookup(ROOT_INODE, b"f")
    assert again is node and not node.superseded
    assert await ns.open_file(node.ino) == old
    # Superseded by a refresh and back by its next one, with no lookup between.
    store.put("f", b"newer!")
    assert (await ns.refresh(node)).superseded
    store.put("f", b"old")
    assert await ns.open_file(node.ino) == old


async def test_replaced_versions_the_kernel_forgot_leave_nothing_behind() -> None:
    """Every replaced file left its (path, ETag) entry for the life of the mount: 65 MiB after 200,000 versions of
    rotating checkpoints. Once superseded and forgotten, it goes; the current version keeps its inode number."""
    store = FakeStore()
    ns = make_ns(store, ttl=0)
    inos = set()
    for i in range(100):
        store.put("ckpt.pt", b"v%d" % i)
        ns._negative.clear()
        node = await ns.lookup(ROOT_INODE, b"ckpt.pt")
        await ns.refresh(node)
        inos.add(node.ino)
        if i:
            ns.forget(previous.ino, 1)  # noqa: F821 - the kernel forgets the version before
        previous = node  # noqa: F841
    assert len(inos) == 100
    assert len(ns._ino_by_path) == 2 and len(ns._latest_file) == 1  # the root, and the current version
    ns.forget(node.ino, 1)
    assert (await ns.lookup(ROOT_INODE, b"ckpt.pt")).ino == node.ino  # current: the same number


async def test_an_answer_asked_before_a_version_was_superseded_leaves_it_superseded(
        autojump_clock) -> None:  # noqa: ANN001
    """A HEAD sent while the bucket still held a version, answered after a READ found it replaced (412), made that
    version current again: opens then succeeded and their READs failed, instead of the kernel's ESTALE and a new
    lookup."""
    store = FakeStore()
    store.put("f", b"old")

    async def answered_late(fn, *args):  # noqa: ANN001, ANN202
        answer = fn(*args)  # what the bucket says when asked
        await trio.sleep(1)
        return answer

    ns = Namespace(store, answered_late, prefix="", ttl=0)
    node = await ns.lookup(ROOT_INODE, b"f")
    old = node.version("")

    async def replaced_meanwhile() -> None:
        await trio.sleep(0.5)
        store.put("f", b"newer!")
        ns.gone(old)  # a READ's GET got 412

    for ask in (lambda: ns.refresh(node), lambda: ns.lookup(ROOT_INODE, b"f")):
        store.put("f", b"old")
        node.superseded, node.fresh_until = False, 0
        ns._negative.clear()
        async with trio.open_nursery() as n:
            n.start_soon(replaced_meanwhile)
            await ask()
        assert node.superseded
        with pytest.raises(PathError) as exc:
            await ns.open_file(node.ino)
        assert exc.value.errno == errno.ESTALE


async def test_a_lookup_answered_after_the_kernel_forgot_the_inode_gives_it_back(
        autojump_clock) -> None:  # noqa: ANN001
    """A LOOKUP that waited for another's answer counted its lookup on a node that a FORGET had removed meanwhile
    (the kernel forgets an inode as soon as its count drops, and the revalidation of a replaced file does so at
    once): the kernel then held an inode the daemon did not know, and its next OPEN or GETATTR got ENOENT for
    a file that was always there (a new user's readers of an object overwritten in a loop)."""
    store = FakeStore()
    store.put("f", b"x")
    ns = Namespace(store, answered_in_a_second, prefix="", ttl=0)
    waited: list = []

    async def first() -> None:
        node = await ns.lookup(ROOT_INODE, b"f")
        ns.forget(node.ino, 1)  # the kernel's FORGET, before the other LOOKUP's reply

    async def second() -> None:
        await trio.sleep(0.5)
        waited.append(await ns.lookup(ROOT_INODE, b"f"))

    async with trio.open_nursery() as n:
        n.start_soon(first)
        n.start_soon(second)
    assert store.heads == 1
    node = waited[0]
    assert ns.node(node.ino) is node and node.lookups == 1
    assert await ns.open_file(node.ino) == node.version("")


async def test_what_a_listing_says_of_a_file_is_trusted_for_the_ttl_from_the_listing_not_from_its_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A name looked up from a listing made 8 s ago with a 10 s TTL is asked of the bucket again 2 s later,
    not 10 s later: a replaced object is seen within one TTL (README), not two."""
    clock = [1000.0]
    monkeypatch.setattr(namespace.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    store.put("f", b"old")
    ns = make_ns(store, ttl=10.0)
    await names(ns, ROOT_INODE)
    clock[0] += 8
    node = await ns.lookup(ROOT_INODE, b"f")
    assert node.fresh_until == 1010.0
    assert store.heads == 0
    store.put("f", b"newer!")
    clock[0] += 2.5
    assert (await ns.refresh(node)).superseded and store.heads == 1
    new = await ns.lookup(ROOT_INODE, b"f")  # the listing expired with the TTL: asked again
    assert new.size == 6 and new.fresh_until == clock[0] + 10


async def test_the_kernel_keeps_a_files_attributes_for_what_is_left_of_its_ttl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry from a listing made 8 s ago with a 10 s TTL is the kernel's for 2 s, not 10: otherwise a stat
    of a replaced object shows the old size for up to two TTLs. A directory's the same (one whose keys were deleted
    was there for up to two TTLs); the root, always there, keeps the whole TTL."""
    from fsmount.operations import Operations, Owner

    clock = [1000.0]
    monkeypatch.setattr(namespace.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    store.put("d/f", b"old")
    ns = make_ns(store, ttl=10.0)
    ops = Operations(ns, None, None, None, max_readahead=0, owner=Owner(0, 0, 0o444, 0o555))  # type: ignore[arg-type]
    d = await ns.lookup(ROOT_INODE, b"d")
    await names(ns, d.ino)
    clock[0] += 8
    attr = ops._attributes(await ns.lookup(d.ino, b"f"))
    assert attr.entry_timeout == attr.attr_timeout == pytest.approx(2.0)
    assert ops._attributes(d).entry_timeout == pytest.approx(2.0)
    assert ops._attributes(ns.node(ROOT_INODE)).entry_timeout == 10.0
    clock[0] += 5
    assert ops._attributes(await ns.lookup(d.ino, b"f")).attr_timeout == 0.0  # expired: asked again next time


async def test_a_directory_bigger_than_the_listing_cache_is_listed_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """cachetools refuses a value bigger than the cache: such a directory must still list (uncached)."""
    monkeypatch.setattr(namespace, "LISTING_CACHE_ENTRIES", 3)
    store = FakeStore()
    for i in range(5):
        store.put(f"big/{i}", b"x")
    store.put("small/a", b"y")
    ns = Namespace(store, call, prefix="", ttl=60.0)
    ns._listings = cachetools.TTLCache(maxsize=3, ttl=60.0, getsizeof=lambda entries: max(1, len(entries)))
    ns._last_listings = cachetools.LRUCache(maxsize=3, getsizeof=lambda entries: max(1, len(entries)))
    big = await ns.lookup(ROOT_INODE, b"big")
    for _ in range(2):
        assert len(await names(ns, big.ino)) == 5
    assert (await ns.lookup(big.ino, b"4")).size == 1
    small = await ns.lookup(ROOT_INODE, b"small")
    lists = store.lists
    await names(ns, small.ino)
    await names(ns, small.ino)
    assert store.lists == lists + 1  # a directory that fits is cached as before


async def test_prefix_mounts_a_subtree() -> None:
    store = FakeStore()
    store.put("llama/config.json", b"{}")
    store.put("llama/w/model.safetensors", b"1")
    store.put("other/x", b"1")
    ns = make_ns(store, prefix="llama/")
    assert await names(ns, ROOT_INODE) == {b"config.json": False, b"w": True}
    node = await ns.lookup(ROOT_INODE, b"config.json")
    assert node.version(ns.prefix).key == "llama/config.json"


async def test_known_files_keep_metadata_while_origin_is_down(allowed_logs) -> None:  # noqa: ANN001
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("f", b"12345")
    ns = make_ns(store, ttl=0)
    node = await ns.lookup(ROOT_INODE, b"f")
    store.head = origin_down
    for _ in range(3):
        node.fresh_until = 0
        assert (await ns.refresh(node)).size == 5
    unknown = make_ns(store, ttl=0)
    with pytest.raises(Unreachable):
        await unknown.lookup(ROOT_INODE, b"f")


async def test_a_refused_head_keeps_a_known_files_attributes_but_refuses_its_opens(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, allowed_logs: list[str]) -> None:
    """Credentials expired after the mount (403 on HEAD): a GETATTR (fstat of a descriptor open on the file) keeps
    the attributes; an open, and a lookup of a name not known, are EACCES; one warning, then debug lines."""
    allowed_logs.append("access denied")
    store = FakeStore()
    store.put("f", b"12345")
    ns = make_ns(store, ttl=0)
    node = await ns.lookup(ROOT_INODE, b"f")
    monkeypatch.setattr(namespace, "ONE_CALL_S", 0.0)

    def denied(*args: object) -> None:
        raise AccessDenied("access denied to bucket 'b' (403): check credentials")
    store.head = store.has_children = store.list_pages = denied  # type: ignore[method-assign]
    for _ in range(3):
        node.fresh_until = 0
        assert (await ns.refresh(node)) is node and node.size == 5 and not node.superseded
    with pytest.raises(AccessDenied):
        await ns.open_file(node.ino)
    with pytest.raises(AccessDenied):
        await ns.lookup(ROOT_INODE, b"g")
    warned = [r for r in caplog.records if "access denied" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warned) == 1, warned


async def test_known_names_and_listings_resolve_while_origin_is_down(allowed_logs) -> None:  # noqa: ANN001
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("d/f", b"12345")
    ns = make_ns(store, ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")
    assert {e.name for e in await ns.listing(d)} == {b"f"}
    f = await ns.lookup(d.ino, b"f")
    store.head = store.has_children = origin_down
    store.list_pages = origin_down
    assert (await ns.lookup(d.ino, b"f")).ino == f.ino  # known file: still resolves
    assert (await ns.lookup(ROOT_INODE, b"d")).ino == d.ino  # known directory too
    assert {e.name for e in await ns.listing(d)} == {b"f"}  # the expired listing serves
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"never-seen")


async def test_metadata_requests_given_up_on_leave_their_slots_to_the_next() -> None:
    """Requests past --read-timeout are given up on, but their threads run on until botocore's own timeouts
    and retries end them (minutes). They held every metadata slot meanwhile, so lookups failed for that long
    after the origin was back. Now the next request gets a slot at once."""
    import threading
    import types

    import trio

    from fsmount import mount

    release = threading.Event()
    daemon = types.SimpleNamespace(cfg=types.SimpleNamespace(store=types.SimpleNamespace(read_timeout=0.5)),
                                   _meta_limiter=trio.CapacityLimiter(mount.METADATA_THREADS),
                                   _meta_threads=trio.CapacityLimiter(mount.METADATA_THREADS
                                                                      + mount.ABANDONED_METADATA_THREADS),
                                   metadata_requests=0, metadata_errors=0)

    def hung() -> None:
        release.wait(30)  # a request into a black hole

    async def given_up() -> None:
        with pytest.raises(TimedOut, match="timed out"):
            await mount.Daemon._store_call(daemon, hung)  # type: ignore[arg-type]

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(mount.METADATA_THREADS):
                nursery.start_soon(given_up)
        began = trio.current_time()
        assert await mount.Daemon._store_call(daemon, lambda: "answered") == "answered"  # type: ignore[arg-type]
        assert trio.current_time() - began < 0.25
        assert (daemon.metadata_requests, daemon.metadata_errors) == (mount.METADATA_THREADS + 1,
                                                                      mount.METADATA_THREADS)
    finally:
        release.set()


async def test_listings_of_one_directory_at_once_are_one_listing(
        autojump_clock) -> None:  # noqa: ANN001
    """Eight `ls` of a directory at once sent every page of its listing eight times (20,000 keys: 160 requests
    for 20 pages, 44 s instead of 2.5 s). Those that come while a listing is in flight get its result, or its
    error; a listing of another directory is its own."""
    store = FakeStore()
    for i in range(5):
        store.put(f"d/f{i}", b"x")
    store.put("e/g", b"y")
    store.put("h/i", b"z")
    failing = [False]

    async def slow(fn, *args):  # noqa: ANN001, ANN202
        await trio.sleep(1)
        if failing[0]:
            raise Unreachable("cannot reach the endpoint")
        return fn(*args)

    ns = Namespace(store, slow, prefix="", ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")
    e = await ns.lookup(ROOT_INODE, b"e")
    h = await ns.lookup(ROOT_INODE, b"h")  # never listed: no expired listing to fall back on
    lists = store.lists
    got: list[object] = []

    async def ls(node) -> None:  # noqa: ANN001
        try:
            got.append(sorted(entry.name for entry in await ns.listing(node)))
        except Unreachable as exc:
            got.append(exc)

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(ls, d)
        n.start_soon(ls, e)
    assert store.lists == lists + 2
    assert got.count([f"f{i}".encode() for i in range(5)]) == 8 and [b"g"] in got
    failing[0] = True
    got.clear()
    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(ls, h)
    assert store.lists == lists + 2 and len(got) == 3 and all(isinstance(g, Unreachable) for g in got)


@pytest.mark.parametrize("keys", [0, 5, 2500])
async def test_a_listing_asks_the_store_once_per_page(keys: int) -> None:
    """`modelfs stats` counts each store call as a metadata request; the call after a listing's last page sends
    nothing, and was counted (one too many per listing)."""
    store = FakeStore()
    for i in range(keys):
        store.put(f"d/f{i:05d}", b"x")
    store.put("d/sub/x", b"x")
    calls: list[str] = []

    async def counting(fn, *args):  # noqa: ANN001, ANN202
        calls.append(fn.__name__)
        return fn(*args)

    ns = Namespace(store, counting, prefix="", ttl=60)
    d = await ns.lookup(ROOT_INODE, b"d")
    calls.clear()
    assert len(await names(ns, d.ino)) == keys + 1
    assert calls == ["listing_page"] * -(-(keys + 1) // 1000)


async def test_a_directory_of_many_unrepresentable_keys_logs_a_count_not_each_key(caplog, allowed_logs) -> None:  # noqa: ANN001
    """12,000 keys the kernel cannot represent in one directory logged every key at every listing (the memory of
    keys logged is bounded): 14 MB of log in 10 s. The first of a listing are named, the rest counted in one
    line, said again only when the count changes."""
    allowed_logs.append("skipping")
    store = FakeStore()
    for i in range(namespace.SKIPS_NAMED_PER_LISTING + 30):
        store.put(f"d/{i:03d}" + "L" * 256, b"1")
    store.put("d/ok", b"1")
    ns = make_ns(store, ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")

    def lines() -> tuple[int, list[str]]:
        return skips_logged(caplog, "skipping key ")

    assert await names(ns, d.ino) == {b"ok": False}
    assert lines() == (namespace.SKIPS_NAMED_PER_LISTING,
                       ["skipping 30 more keys under 'd/' that the kernel cannot represent (not named one by one)"])
    await names(ns, d.ino)
    assert lines() == (0, [])  # listed again: nothing new to say
    store.put("d/999" + "L" * 256, b"1")
    await names(ns, d.ino)
    assert lines() == (0, ["skipping 31 more keys under 'd/' that the kernel cannot represent (not named one by "
                           "one)"])


async def test_a_directory_of_many_hidden_files_logs_a_count_not_each_key(caplog) -> None:  # noqa: ANN001
    """B632: the files hidden by a directory of their name (B570) were each logged, once while the memory of keys
    logged (SKIP_LOG_MEMORY) held them: a directory of more of them logged every one at every listing. They are
    named as skipped keys are: the first of a listing, the rest counted in one line, said again when it changes."""
    store = FakeStore()
    for i in range(namespace.SKIPS_NAMED_PER_LISTING + 30):
        store.put(f"d/{i:03d}", b"file")
        store.put(f"d/{i:03d}/x", b"x")
    ns = make_ns(store, ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")

    def lines() -> tuple[int, list[str]]:
        return skips_logged(caplog, "is not shown: keys under")

    with caplog.at_level(logging.INFO, logger="fsmount.namespace"):
        assert len(await names(ns, d.ino)) == namespace.SKIPS_NAMED_PER_LISTING + 30
        counted = "30 more keys under 'd/' are not shown (not named one by one): keys under each one's name make it a "
        assert lines() == (namespace.SKIPS_NAMED_PER_LISTING, [counted + "directory, which wins over the file"])
        await names(ns, d.ino)
        assert lines() == (0, [])  # listed again: nothing new to say
        store.put("d/999", b"file")
        store.put("d/999/x", b"x")
        await names(ns, d.ino)
        assert lines() == (0, [counted.replace("30", "31") + "directory, which wins over the file"])


async def test_lookups_of_one_name_at_once_ask_the_bucket_once(
        autojump_clock) -> None:  # noqa: ANN001
    """A stat storm: every process whose cached entry expired sends its LOOKUP, and each sent the name's HEAD
    and listing again. Those that come while one is in flight share its answer (a file, or ENOENT)."""
    store = FakeStore()
    store.put("f", b"x")
    ns = Namespace(store, answered_in_a_second, prefix="", ttl=0)
    found: dict[bytes, list[int]] = {b"f": [], b"missing": []}

    async def stat(name: bytes) -> None:
        try:
            found[name].append((await ns.lookup(ROOT_INODE, name)).ino)
        except PathError as exc:
            found[name].append(-exc.errno)

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(stat, b"f")
            n.start_soon(stat, b"missing")
    assert store.heads == 2
    ino = found[b"f"][0]
    assert found == {b"f": [ino] * 8, b"missing": [-errno.ENOENT] * 8} and ns.node(ino).lookups == 8


async def test_a_request_failed_at_once_after_an_outage_says_so_and_names_what_failed_first() -> None:
    """Within DOWN_FAST_FAIL_S of a request that got no answer, the next fail without being sent. Their warning
    said the first one's "cannot reach ... URL of another key (asked again in 4.9s)", or "has_children timed out
    after 5s" for a lookup that failed in 10 ms: now it says it was not asked, and the timeout names the key."""
    from fsmount.mount import metadata_request_words
    from fsmount.namespace import listing_page

    store = FakeStore()
    store.put("a/x", b"x")
    ns = Namespace(store, lambda fn, *args: origin_down(), prefix="", ttl=0)  # type: ignore[arg-type, return-value]
    with pytest.raises(Unreachable, match="cannot reach the endpoint"):
        await ns.lookup(ROOT_INODE, b"a")
    with pytest.raises(Unreachable, match=r"^not asked: the origin did not answer 0\.\ds ago \(cannot reach the "
                                          r"endpoint\); it is asked again in \d\.\ds$"):
        await ns.lookup(ROOT_INODE, b"b")
    assert metadata_request_words(store.head, ("m/a.bin",)) == "HEAD 'm/a.bin'"
    assert metadata_request_words(store.has_children, ("m/a.bin/",)) == "listing 'm/a.bin/'"
    assert metadata_request_words(listing_page, (iter(()), "m/")) == "listing 'm/'"
    assert metadata_request_words(lambda: None, ()) == "<lambda>"


# -- answers that arrive after newer ones ------------------------------------------------------------

def slow_listings(seconds: float) -> Any:
    """A store call that answers a listing page as the bucket is when asked, but lands `seconds` later (a big
    directory's listing, or a slow origin); every other call answers at once."""
    async def ask(fn: Any, *args: Any) -> Any:
        result = fn(*args)
        if fn is namespace.listing_page:
            await trio.sleep(seconds)
        return result
    return ask


@pytest.mark.parametrize("how", ["read-412", "getattr-head"])
async def test_a_listing_under_way_when_a_file_is_superseded_does_not_bring_the_old_version_back(how: str) -> None:
    """`ls d` (or a loader's opendir, or model streaming's look at the shards beside) under way while `d/f` is
    replaced and the mount learns so (a READ's 412, or a stat's HEAD): the listing lands naming the old version.
    Answered from it, every open of `d/f` got ESTALE, and the kernel's retry the same inode, for the TTL (the
    audit; for good with `forever`, below)."""
    store = FakeStore()
    store.put("d/f", b"old")
    ttl = 1.0
    ns = Namespace(store, slow_listings(0.3), prefix="", ttl=ttl)
    d = await ns.lookup(ROOT_INODE, b"d")
    old = await ns.lookup(d.ino, b"f")  # HEAD: the parent's listing is not cached
    if how == "getattr-head":
        await trio.sleep(ttl + 0.1)  # the node's metadata is due for a HEAD
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, d)
        await trio.sleep(0.1)  # the listing has read the bucket: it names the old version
        store.put("d/f", b"new version")
        if how == "read-412":
            ns.gone(old.version(""))
        else:
            await ns.refresh(ns.node(old.ino))  # a GETATTR after the TTL: the HEAD says another ETag
        assert ns.node(old.ino).superseded
    for _ in range(2):  # the kernel's LOOKUP, and its LOOKUP_REVAL after an ESTALE
        node = await ns.lookup(d.ino, b"f")
        assert (await ns.open_file(node.ino)).size == len(b"new version")


async def test_with_ttl_forever_a_file_superseded_while_listed_opens_its_new_version() -> None:
    store = FakeStore()
    store.put("d/f", b"old")
    ns = Namespace(store, slow_listings(0.3), prefix="", ttl=FOREVER_TTL)
    d = await ns.lookup(ROOT_INODE, b"d")
    old = await ns.lookup(d.ino, b"f")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, d)
        await trio.sleep(0.1)
        store.put("d/f", b"new version")
        ns.gone(old.version(""))  # a READ got 412
    node = await ns.lookup(d.ino, b"f")
    assert not node.superseded and (await ns.open_file(node.ino)).size == len(b"new version")


@pytest.mark.parametrize("forgotten", [False, True], ids=["held", "forgotten"])
async def test_a_listing_begun_before_a_newer_answer_does_not_bring_the_older_version_back(forgotten: bool) -> None:
    """A lookup answered by HEAD with the new version while a listing begun earlier is under way; the listing lands
    naming the old one. It answered the next lookups (and `ls -l`'s readdirplus) with the old inode, not
    superseded: the reader saw the new version, then the old one again, and the path's inode number changed. The
    newest answer is kept apart from its node: `forgotten`, the kernel forgot the new inode meanwhile (a file only
    stat'ed, its dentry dropped), and an older answer then made the old version current again (the review)."""
    store = FakeStore()
    store.put("d/f", b"old")
    ns = Namespace(store, slow_listings(0.3), prefix="", ttl=30.0)
    d = await ns.lookup(ROOT_INODE, b"d")
    old = await ns.lookup(d.ino, b"f")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, d)
        await trio.sleep(0.1)  # the listing has read the bucket (the old version)
        store.put("d/f", b"new version")
        new = await ns.lookup(d.ino, b"f")  # no listing cached yet: HEAD, the new version
        assert new.size == len(b"new version") and new.ino != old.ino
        if forgotten:
            ns.forget(new.ino, 1)
    again = await ns.lookup(d.ino, b"f")
    assert (again.ino, again.size) == (new.ino, len(b"new version"))
    assert (await ns.open_file(again.ino)).size == len(b"new version")
    assert ns.node(old.ino).superseded


async def test_a_directory_handle_opened_before_a_replacement_never_hands_out_the_old_version_as_current() -> None:
    """readdirplus from a handle's snapshot (opendir before the replacement), after the mount learnt (412) that the
    version is gone and the kernel forgot its inode: the entry made a new inode of the old version, not superseded,
    whose open succeeded and whose READs failed (412 -> EIO). Now it is superseded: its open is ESTALE, and the
    kernel looks the name up again."""
    store = FakeStore()
    store.put("f", b"old")
    ns = Namespace(store, call, prefix="", ttl=60.0)
    entries, listed_at = await ns.open_dir(ROOT_INODE)  # opendir: the snapshot names the old version
    old = await ns.lookup(ROOT_INODE, b"f")
    store.put("f", b"new version")
    ns.gone(old.version(""))
    new = await ns.lookup(ROOT_INODE, b"f")
    assert new.size == len(b"new version")
    ns.forget(old.ino, 1)
    node = ns.entry_node(ns.node(ROOT_INODE), next(e for e in entries if e.name == b"f"), listed_at)
    ns.entry_taken(node)
    with pytest.raises(PathError) as exc:
        await ns.open_file(node.ino)
    assert exc.value.errno == errno.ESTALE
    assert (await ns.lookup(ROOT_INODE, b"f")).ino == new.ino


@pytest.mark.usefixtures("each_request_asks")
async def test_opens_of_one_file_at_once_after_its_ttl_ask_the_bucket_once(autojump_clock: Any) -> None:
    """Lookups of one name at once share one HEAD; opens (and GETATTRs) of a known inode past its TTL sent one each:
    8 ranks opening one shard sent 8 HEADs, each waiting for a metadata thread behind the others."""
    store = FakeStore()
    store.put("model.safetensors", b"x" * 10)

    async def one_second(fn: Any, *args: Any) -> Any:
        await trio.sleep(1)
        return fn(*args)

    ns = Namespace(store, one_second, prefix="", ttl=0)
    node = await ns.lookup(ROOT_INODE, b"model.safetensors")
    heads = store.heads
    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(ns.open_file, node.ino)
    assert store.heads - heads == 1


async def test_a_name_longer_than_name_max_is_enametoolong() -> None:
    """The kernel passes names up to 1024 bytes; a local file system answers a 256+ byte one "File name too long"."""
    ns = Namespace(FakeStore(), call, prefix="", ttl=60.0)
    for name, err in ((b"a" * 300, errno.ENAMETOOLONG), (b"a" * 255, errno.ENOENT)):
        with pytest.raises(PathError) as exc:
            await ns.lookup(ROOT_INODE, name)
        assert exc.value.errno == err


async def test_while_the_origin_is_down_a_listed_name_the_kernel_forgot_still_resolves(allowed_logs: list[str]) -> None:
    """While the origin is away, `ls d` serves the last listing, but a lookup of a name in it was EIO unless the
    kernel held that name's inode: a file read an hour ago, its dentry dropped since, its chunks all in the NVMe
    cache, could not be opened although `ls` showed it (the audit)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("d/f", b"12345")
    ns = Namespace(store, call, prefix="", ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")
    assert set(await names(ns, d.ino)) == {b"f"}
    f = await ns.lookup(d.ino, b"f")
    ns.forget(f.ino, 1)  # the kernel dropped the dentry and forgot the inode
    go_down(store)
    assert set(await names(ns, d.ino)) == {b"f"}
    node = await ns.lookup(d.ino, b"f")
    assert node.size == 5 and (await ns.open_file(node.ino)).size == 5
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"never-listed")


async def test_while_the_origin_is_down_a_name_found_by_its_head_the_kernel_forgot_still_resolves(
        allowed_logs: list[str]) -> None:
    """A file looked up by its HEAD (its directory never listed), read, then forgotten by the kernel (memory pressure,
    another process's drop_caches): while the origin was away its next lookup was EIO, although the mount knew it a
    moment before (tests/mount/test_metadata_faults.py's re-read of `d/known.txt`, B246). A directory the same. Not
    a version found gone meanwhile, nor one the bucket was found to hold no more."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("d/f", b"12345")
    store.put("d/g", b"123")
    store.put("d/sub/x", b"x")
    ns = Namespace(store, call, prefix="", ttl=60)
    d = await ns.lookup(ROOT_INODE, b"d")
    f, g, sub = (await ns.lookup(d.ino, b"f")), (await ns.lookup(d.ino, b"g")), (await ns.lookup(d.ino, b"sub"))
    gone = g.version(ns.prefix)
    for node in (f, g, sub):
        ns.forget(node.ino, 1)  # the kernel dropped the dentries and forgot the inodes
    ns.gone(gone)  # a GET found g replaced meanwhile
    go_down(store)
    node = await ns.lookup(d.ino, b"f")
    assert node.ino == f.ino and node.size == 5 and (await ns.open_file(node.ino)).size == 5
    assert (await ns.lookup(d.ino, b"sub")).ino == sub.ino
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"g")
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"never-looked-up")
    # Found deleted while forgotten: not answered from what the mount knew before.
    store2 = FakeStore()
    store2.put("h", b"1")
    ns2 = Namespace(store2, call, prefix="", ttl=0)
    h = await ns2.lookup(ROOT_INODE, b"h")
    ns2.forget(h.ino, 1)
    del store2.objects["h"]
    with pytest.raises(PathError):
        await ns2.lookup(ROOT_INODE, b"h")
    store2.head = store2.has_children = store2.list_pages = origin_down  # type: ignore[method-assign]
    with pytest.raises(Unreachable):
        await ns2.lookup(ROOT_INODE, b"h")


async def test_while_the_origin_is_down_a_forgotten_node_a_later_listing_contradicts_is_not_served(
        allowed_logs: list[str]) -> None:
    """A file found by its HEAD, forgotten by the kernel, then deleted, replaced or made a directory, as a listing of
    its directory said since (`ls`, or the prefetch's listing: no node made of its entries): while the origin was
    away its lookup was answered from the node kept when the kernel forgot it (B246), the version the mount had
    learnt was gone, not from that newer listing (B247)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    for key in ("d/deleted", "d/replaced", "d/now-dir"):
        store.put(key, b"12345")
    ns = Namespace(store, call, prefix="", ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")
    for name in (b"deleted", b"replaced", b"now-dir"):
        ns.forget((await ns.lookup(d.ino, name)).ino, 1)  # the kernel dropped the dentry and forgot the inode
    del store.objects["d/deleted"]
    store.put("d/replaced", b"123")
    del store.objects["d/now-dir"]
    store.put("d/now-dir/x", b"x")
    assert await names(ns, d.ino) == {b"replaced": False, b"now-dir": True}
    store.put("d/late", b"1234")  # found by its HEAD after that listing: newer news than it
    ns.forget((await ns.lookup(d.ino, b"late")).ino, 1)
    go_down(store)
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"deleted")
    replaced = await ns.lookup(d.ino, b"replaced")
    assert replaced.size == 3 and (await ns.open_file(replaced.ino)).size == 3
    assert (await ns.lookup(d.ino, b"now-dir")).is_dir
    assert (await ns.lookup(d.ino, b"late")).size == 4


async def test_while_the_origin_is_down_a_file_found_deleted_while_held_open_is_not_served_once_forgotten(
        allowed_logs: list[str]) -> None:
    """A file held open (the kernel holds its inode) that a lookup of its name found deleted (another writer), then
    closed and forgotten by the kernel: the node was kept as a current version (B246), and while the origin was away
    the name resolved as the deleted file (its old size, its cached bytes), where a HEAD of the inode finding it gone
    supersedes it (`refresh`) and nothing is served (B304). Its descriptor keeps its attributes meanwhile."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store = FakeStore()
    store.put("d/f", b"12345")
    ns = Namespace(store, call, prefix="", ttl=0)
    d = await ns.lookup(ROOT_INODE, b"d")
    f = await ns.lookup(d.ino, b"f")  # held open
    del store.objects["d/f"]
    with pytest.raises(PathError):
        await ns.lookup(d.ino, b"f")  # found deleted (`ls d/f` beside the reader)
    assert ns.node(f.ino).size == 5  # the descriptor's fstat
    ns.forget(f.ino, 1)  # closed, and the kernel forgot the inode
    go_down(store)
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"f")


async def _a_lookup_answered_after_a_newer_head(ttl: float, meanwhile: Any = None) -> tuple[Namespace, Any]:
    """A file held open (the kernel holds its inode); another writer deletes it, and a lookup's HEAD finds nothing,
    its answer on its way; the writer stores the same bytes again (the same ETag), and a HEAD of the held inode, asked
    after, finds them there; then (after `meanwhile(ns, node)`, if given) the lookup's answer (ENOENT) lands. The
    namespace and the held node."""
    store, answers, ns = a_namespace_answering_late({"f": b"12345"}, ttl=ttl)
    f = await ns.lookup(ROOT_INODE, b"f")

    async def looked_up() -> None:
        with pytest.raises(PathError):
            await ns.lookup(ROOT_INODE, b"f")

    del store.objects["f"]
    async with landing_after(answers, looked_up):
        store.put("f", b"12345")
        f.fresh_until = f.confirmed_at = 0.0
        assert await ns.refresh(f) is f and not f.superseded
        if meanwhile is not None:
            meanwhile(ns, f)
    return ns, f


async def test_a_lookup_asked_before_a_newer_head_found_the_held_file_does_not_supersede_it(
        autojump_clock) -> None:  # noqa: ANN001
    """The lookup's late answer is older news than the HEAD of the inode. Taken as the bucket's word (B304's
    supersede, by answer order, not age), the current file the kernel holds was superseded: its opens were ESTALE
    (B306)."""
    ns, f = await _a_lookup_answered_after_a_newer_head(ttl=0)
    assert not f.superseded
    assert await ns.open_file(f.ino) == f.version("")


async def test_a_lookup_asked_before_a_newer_head_found_the_file_leaves_no_negative_entry(
        autojump_clock) -> None:  # noqa: ANN001
    """The same late answer also made the path's negative entry: the next lookups were ENOENT for the TTL, a file
    that the newest answer found there (B307)."""
    ns, f = await _a_lookup_answered_after_a_newer_head(ttl=30.0)
    assert (await ns.lookup(ROOT_INODE, b"f")).ino == f.ino


async def test_a_lookup_asked_before_a_newer_head_found_the_file_leaves_the_node_kept_once_forgotten(
        autojump_clock, allowed_logs: list[str]) -> None:  # noqa: ANN001
    """The same late answer, landing once the reader had closed the file and the kernel had forgotten its inode, dropped
    the node kept of it (B246), as the bucket's word: while the origin was away the name was EIO, a file the newest
    answer found there (B323)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    ns, f = await _a_lookup_answered_after_a_newer_head(ttl=0, meanwhile=lambda ns, node: ns.forget(node.ino, 1))
    store = ns._store
    store.head = store.has_children = store.list_pages = origin_down
    node = await ns.lookup(ROOT_INODE, b"f")
    assert node.ino == f.ino and (await ns.open_file(node.ino)).size == 5


async def test_a_head_of_the_held_inode_asked_before_a_newer_lookup_found_the_file_does_not_supersede_it(
        autojump_clock) -> None:  # noqa: ANN001
    """A file held open; another writer deletes it and stores the same bytes again. An open's HEAD of the inode, asked
    while it was gone, lands after a lookup's HEAD, asked after, found it there: `refresh` took it as the bucket's word
    and superseded the current version, and every open of the inode was ESTALE for the TTL (B322; B306's rule)."""
    store, answers, ns = a_namespace_answering_late({"f": b"12345"}, ttl=30.0)
    f = await ns.lookup(ROOT_INODE, b"f")
    f.fresh_until = f.confirmed_at = 0.0  # its TTL is over: the next open asks
    del store.objects["f"]
    async with landing_after(answers, ns.refresh, f):
        store.put("f", b"12345")
        assert await ns.lookup(ROOT_INODE, b"f") is f  # found there, the open's answer still on its way
    assert not f.superseded
    assert await ns.open_file(f.ino) == f.version("")
    # An answer that no newer one contradicts still supersedes it.
    del store.objects["f"]
    f.fresh_until = f.confirmed_at = 0.0
    with pytest.raises(PathError) as exc:
        await ns.open_file(f.ino)
    assert exc.value.errno == errno.ESTALE


async def test_a_head_of_the_held_inode_finding_it_replaced_supersedes_it_after_a_read_of_an_older_version_failed(
        autojump_clock) -> None:  # noqa: ANN001
    """A checkpoint rewritten by another writer, v0, v1, v2: a descriptor still reads v0, the kernel holds v1. An open's
    HEAD of v1 finds v2, its answer on its way; meanwhile a read of v0 is refused (412: `gone`, dated when it lands).
    B322 took that refusal for a newer answer that found v1 current, and the HEAD's answer superseded nothing: the
    open got v1, and its reads EIO, instead of ESTALE and the kernel's lookup of v2 (B350)."""
    store, answers, ns = a_namespace_answering_late({"f": b"v0"}, ttl=30.0)
    v0 = (await ns.lookup(ROOT_INODE, b"f")).version("")
    store.put("f", b"v1")
    f = await ns.lookup(ROOT_INODE, b"f")
    assert f.etag == store.etags["f"] != v0.etag
    f.fresh_until = f.confirmed_at = 0.0  # its TTL is over: the next open asks
    store.put("f", b"v2")
    async with landing_after(answers, ns.refresh, f):
        ns.gone(v0)  # a read of the descriptor on v0, refused
    assert f.superseded
    with pytest.raises(PathError) as exc:
        await ns.open_file(f.ino)
    assert exc.value.errno == errno.ESTALE


def test_the_listing_caches_stay_within_the_runtime_share_of_the_memory_limit() -> None:
    """The listings kept for outages outlive their TTL, up to LISTING_CACHE_ENTRIES entries. Estimated at 100 B an
    entry, 2,000,000 of them held ~780 MiB beyond --memory-limit, whose runtime share is 96 MiB (the audit)."""
    store = FakeStore()
    n = 20_000
    for i in range(n):
        key = f"ckpt/model-{i:05d}-of-{n:05d}.safetensors"
        store.objects[key] = b""
        store.etags[key] = '"0123456789abcdef0123456789abcdef"'

    async def fresh_strings(fn: Any, *args: Any) -> Any:  # each page's strings new, as Boto3Store decodes them
        page = fn(*args)
        if fn is namespace.listing_page and page is not None:
            page = ListingPage([ObjectMeta("".join(list(m.key)), m.size, "".join(list(m.etag)), m.mtime_ns)
                                for m in page.objects], page.prefixes, page.undecodable, last=page.last)
        return page

    async def listed() -> None:
        ns = Namespace(store, fresh_strings, prefix="", ttl=60.0)
        ckpt = await ns.lookup(ROOT_INODE, b"ckpt")
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await ns.listing(ckpt)
            gc.collect()
            per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
        finally:
            tracemalloc.stop()
        assert namespace.LISTING_CACHE_ENTRIES * per_entry < 96 * MiB, per_entry

    trio.run(listed)


# -- older answers after the kernel forgot the newer version (the review) ------------------------------

async def test_a_directory_handle_snapshot_after_the_kernel_forgot_the_new_inode() -> None:
    store = FakeStore()
    store.put("f", b"old")
    ns = Namespace(store, call, prefix="", ttl=60.0)
    entries, listed_at = await ns.open_dir(ROOT_INODE)  # opendir: the snapshot names the old version
    await trio.sleep(0.01)
    store.put("f", b"new version")
    ns._listings.clear()  # its TTL ran out (or a 412 dropped it): the next lookup asks the bucket
    new = await ns.lookup(ROOT_INODE, b"f")  # HEAD: the new version
    assert new.size == len(b"new version")
    ns.forget(new.ino, 1)  # the kernel forgot it
    node = ns.entry_node(ns.node(ROOT_INODE), next(e for e in entries if e.name == b"f"), listed_at)  # readdirplus
    ns.entry_taken(node)
    assert node.superseded or node.size == len(b"new version"), "the old version handed out as current"
    again = await ns.lookup(ROOT_INODE, b"f")
    assert again.size == len(b"new version"), (again.ino, again.size, new.ino)


async def test_a_handle_opened_before_this_mount_stored_a_file_never_hands_out_the_old_version() -> None:
    """`ls -l` whose opendir came before this mount rewrote `f` (O_TRUNC, closed, stored) and whose readdirplus came
    after the kernel forgot the inode (closed, dentry dropped)."""
    from fsmount.tree_changes import WritableNamespace

    store = FakeStore()
    store.put("f", b"old")
    ns = WritableNamespace(store, call, prefix="", ttl=60.0)
    root = ns.node(ROOT_INODE)
    entries, listed_at = await ns.open_dir(ROOT_INODE)  # the snapshot names the old version
    old = await ns.lookup(ROOT_INODE, b"f")
    await trio.sleep(0.01)
    node = ns.begin_file("f", old)  # the O_TRUNC rewrite keeps the inode
    store.put("f", b"new version")
    ns.end_file(node, store.meta("f"))  # stored: the path's latest version, asked now
    ns.forget(node.ino, 1)  # closed, and the kernel forgot it
    entry = next(e for e in entries if e.name == b"f")
    handed = ns.entry_node(root, entry, listed_at)  # readdirplus from the old snapshot
    ns.entry_taken(handed)
    assert handed.superseded or handed.size == len(b"new version"), (
        f"readdirplus handed out inode {handed.ino} (size {handed.size}) of the old version as current; "
        f"opens of it then read a version the bucket no longer holds")


@pytest.mark.parametrize("how", ["read-412", "getattr-head"])
async def test_a_listing_under_way_at_a_replacement_lands_after_the_old_inode_was_forgotten(how: str) -> None:
    """test_a_listing_under_way_when_a_file_is_superseded_does_not_bring_the_old_version_back, with one more step:
    the kernel forgets the superseded inode (its last descriptor closed, the dentry dropped) before the listing
    lands. forget() then drops the (path, old ETag) entry, so the listing's entry makes a new, unsuperseded inode
    of the old version."""
    store = FakeStore()
    store.put("d/f", b"old")
    ttl = 30.0
    ns = Namespace(store, slow_listings(0.3), prefix="", ttl=ttl if how == "read-412" else 0.05)
    d = await ns.lookup(ROOT_INODE, b"d")
    old = await ns.lookup(d.ino, b"f")
    if how == "getattr-head":
        await trio.sleep(0.1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, d)
        await trio.sleep(0.1)  # the listing has read the bucket: it names the old version
        store.put("d/f", b"new version")
        if how == "read-412":
            ns.gone(old.version(""))
        else:
            await ns.refresh(ns.node(old.ino))
        assert ns.node(old.ino).superseded
        ns.forget(old.ino, 1)  # closed; the kernel forgot the inode
    node = await ns.lookup(d.ino, b"f")
    assert node.size == len(b"new version"), (node.ino, node.size, node.superseded, old.ino)


async def test_a_superseded_node_made_only_to_be_refused_does_not_stay_in_the_inode_table() -> None:
    """`_resolve` makes a node of a cached listing's entry, finds it superseded (the listing began before the HEAD
    that named the new version), and asks the bucket instead: the node it made, which the kernel never got, stays in
    `_nodes` (lookups 0) for the life of the mount, counted in inode_count ("inodes the kernel holds")."""
    store = FakeStore()
    store.put("d/f", b"old")
    ns = Namespace(store, slow_listings(0.3), prefix="", ttl=30.0)
    d = await ns.lookup(ROOT_INODE, b"d")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.listing, d)
        await trio.sleep(0.1)  # the listing has read the bucket (the old version)
        store.put("d/f", b"new version")
        new = await ns.lookup(d.ino, b"f")  # HEAD: the new version
    before = ns.inode_count
    again = await ns.lookup(d.ino, b"f")  # from the cached listing: superseded, dropped, HEAD
    assert again.ino == new.ino
    stray = [n for n in ns._nodes.values() if n.lookups == 0 and n.ino != ROOT_INODE]
    assert ns.inode_count == before and not stray, (before, ns.inode_count, stray)


@pytest.mark.usefixtures("each_request_asks")
async def test_a_version_uploaded_again_after_a_replacement_is_current_again() -> None:
    """A rollback (the old bytes uploaded again) through a listing, a lookup and a refresh."""
    store = FakeStore()
    store.put("d/f", b"A")
    ns = Namespace(store, call, prefix="", ttl=0.05)
    d = await ns.lookup(ROOT_INODE, b"d")
    a = await ns.lookup(d.ino, b"f")
    await trio.sleep(0.06)
    store.put("d/f", b"BB")
    b = await ns.lookup(d.ino, b"f")  # HEAD
    assert b.ino != a.ino and b.size == 2
    await ns.refresh(ns.node(a.ino))
    assert ns.node(a.ino).superseded
    await trio.sleep(0.06)
    store.put("d/f", b"A")  # rollback
    await ns.listing(d)
    again = await ns.lookup(d.ino, b"f")
    assert again.ino == a.ino and not again.superseded and again.size == 1
    assert (await ns.open_file(again.ino)).size == 1
    await trio.sleep(0.06)
    await ns.refresh(ns.node(b.ino))
    assert ns.node(b.ino).superseded
    # B uploaded again: current again at its next GETATTR
    store.put("d/f", b"BB")
    await trio.sleep(0.06)
    n = await ns.refresh(ns.node(b.ino))
    assert not n.superseded
    again = await ns.lookup(d.ino, b"f")
    assert again.ino == b.ino and again.size == 2


async def test_a_failed_listing_leaves_no_change_record_behind() -> None:
    """Records kept for a listing that then failed went only when a later listing of the directory landed."""
    from fsmount.data import TransientError
    from fsmount.tree_changes import WritableNamespace

    store = FakeStore()
    store.put("a", b"1")
    state = {"fail": True}

    async def ask(fn: Any, *args: Any) -> Any:
        if fn is namespace.listing_page:
            await trio.sleep(0.1)
            if state["fail"]:
                raise TransientError("listing failed")
        return fn(*args)

    ns = WritableNamespace(store, ask, prefix="", ttl=60.0)
    root = ns.node(ROOT_INODE)

    async def failing() -> None:
        with pytest.raises(TransientError):
            await ns._list("")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(failing)
        await trio.sleep(0.05)
        ns._stored(ns.begin_file("b"), ObjectMeta("b", 1, '"b"', 0))
    assert ns._lists_under_way == {} and ns._changes == {}
    state["fail"] = False
    store.put("b", b"1")
    assert {e.name for e in await ns.listing(root)} == {b"a", b"b"}
    assert ns._changes == {}


def test_requests_not_sent_during_an_outage_are_one_warning_a_while(caplog: pytest.LogCaptureFixture,
                                                                    allowed_logs: list[str]) -> None:
    """Lookups failed at once during an outage each said "did not answer 0.3s ago ... asked again in 4.7s" with other
    seconds: none was a repeat, and two loaders polling through a 4 s restart logged 22 warnings (a tester)."""
    from fsmount import operations

    allowed_logs.append("lookup failed")
    operations._warned.clear()
    for ago, again in (("0.3", "4.7"), ("1.2", "3.8"), ("4.9", "0.1")):
        operations._log_failure("lookup", Unreachable(f"not asked: the origin did not answer {ago}s ago (cannot "
                                                      f"reach the endpoint); it is asked again in {again}s"))
    operations._log_failure("lookup", Unreachable("HEAD 'a': cannot reach the endpoint"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "0.3s ago" in warned[0] and "HEAD 'a'" in warned[1], warned


async def test_entry_drops_stuck_in_the_kernel_hold_no_other_thread_of_the_mount(monkeypatch) -> None:  # noqa: ANN001
    """A READ that finds its version gone drops the kernel's entry from a worker thread, given up on after
    INVALIDATE_WAIT_S while the thread waits for the directory's lock. On trio's shared limiter, 40 such threads
    (READs of replaced shards in a busy directory) held every token, and every open for writing, flush and page-cache
    push of the mount waited for them (the review). They have DROP_THREADS of their own; past that, a drop goes to
    the queue of the mount's calls into the session (one thread)."""
    from fsmount import holders, operations

    directory_lock = threading.Event()  # the kernel's lock of the directory, held by another request
    queued: list[tuple[int, bytes]] = []
    monkeypatch.setattr(operations.pyfuse3, "invalidate_entry", lambda parent, name: directory_lock.wait())
    monkeypatch.setattr(operations, "INVALIDATE_WAIT_S", 0.2)
    threads = trio.CapacityLimiter(operations.DROP_THREADS)
    calls = operations.SessionCalls()
    monkeypatch.setattr(calls, "queue", lambda fn, parent, name: queued.append((parent, name)))
    try:
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(operations._drop_entry, (1, f"shard-{i}".encode()), threads, calls)
        assert len(queued) == 40 - operations.DROP_THREADS
        with trio.move_on_after(3) as scope:  # an open for writing elsewhere in the mount
            assert await trio.to_thread.run_sync(holders.thread_group, os.getpid()) == os.getpid()
        assert not scope.cancelled_caught, "a worker thread waited for the entry drops given up on"
    finally:
        directory_lock.set()


# -- a lookup's answer of nothing, the newest about its path ------------------------------------------

async def test_a_listing_begun_before_a_lookup_found_a_file_the_kernel_forgot_deleted_does_not_bring_it_back(
        autojump_clock: Any) -> None:
    """A file read an hour ago (the kernel forgot its inode); a listing of its directory finds it, its answer on its
    way; another writer deletes it, and a lookup, asked after, finds nothing there; then the listing lands. The path
    still named the forgotten version as its latest (`_latest_file`), which no older answer is news against: the
    listing made it current again, and `stat` found the deleted file for the TTL (its reads EIO)."""
    store, answers, ns = a_namespace_answering_late({"m/w.bin": b"old", "m/other.bin": b"other"}, ttl=60)
    m = await ns.lookup(ROOT_INODE, b"m")
    ns.forget((await ns.lookup(m.ino, b"w.bin")).ino, 1)  # read, closed, and forgotten by the kernel
    ns._listings.clear()  # its TTL ran out: the next `ls` lists the bucket
    async with landing_after(answers, ns.listing, m):
        del store.objects["m/w.bin"]
        with pytest.raises(PathError) as exc:
            await ns.lookup(m.ino, b"w.bin")
        assert exc.value.errno == errno.ENOENT
    with pytest.raises(PathError) as exc:
        await ns.lookup(m.ino, b"w.bin")
    assert exc.value.errno == errno.ENOENT
    assert (await ns.lookup(m.ino, b"other.bin")).size == len(b"other")


@pytest.mark.parametrize("listing", ["kept-before", "landing-after"])
async def test_while_the_origin_is_down_a_listed_file_a_newer_lookup_found_deleted_is_not_served(
        listing: str, autojump_clock: Any, allowed_logs: list[str]) -> None:
    """`ls d` kept its listing (or one under way landed after), another writer deleted `d/f`, and `stat d/f` found
    nothing there. While the origin was away, the listing kept for outages still named it: `ls d` showed it again, and
    its lookup resolved it as the deleted version (its size, and its bytes from the NVMe cache)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G)
    d = await ns.lookup(ROOT_INODE, b"d")

    async def found_deleted() -> None:
        del store.objects["d/f"]
        with pytest.raises(PathError) as exc:
            await ns.lookup(d.ino, b"f")
        assert exc.value.errno == errno.ENOENT

    await beside_a_listing(ns, answers, d, listing, {b"f": False, b"g": False}, found_deleted)
    go_down(store)
    assert await names(ns, d.ino) == {b"g": False}
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"f")
    assert (await ns.lookup(d.ino, b"g")).size == 3


async def test_while_the_origin_is_down_a_file_this_mount_stored_after_a_lookup_found_it_gone_is_listed(
        autojump_clock: Any, allowed_logs: list[str]) -> None:
    """B381's other side: a name found gone while a listing was under way, then stored through this mount before the
    listing landed, is the newer news: the listing kept for outages names it."""
    from fsmount.tree_changes import WritableNamespace

    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G, kind=WritableNamespace)
    d = await ns.lookup(ROOT_INODE, b"d")
    async with landing_after(answers, ns.listing, d):
        del store.objects["d/f"]
        with pytest.raises(PathError):
            await ns.lookup(d.ino, b"f")
        node = ns.begin_file("d/f")
        store.put("d/f", b"new")
        ns.end_file(node, store.meta("d/f"))
    go_down(store)
    assert await names(ns, d.ino) == {b"f": False, b"g": False}
    assert (await ns.lookup(d.ino, b"f")).size == 3


@pytest.mark.parametrize("relisted", [True, False])
async def test_a_directory_handle_opened_before_a_lookup_found_a_file_deleted_never_hands_it_out_as_current(
        relisted: bool, allowed_logs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`ls -l` (or a walk) whose opendir came before another writer deleted `d/f`, its readdirplus after a lookup
    found `f` gone: the lookup's answer of nothing was dated only while a listing was under way, so the handle's
    snapshot made the deleted version current again (the path's latest); once the kernel forgot it, a lookup while the
    origin was away resolved it from the node kept. The lookup lists `d` again (B1200), or, in a directory bigger than
    RELIST_ENTRIES, asks `f` by name."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    if not relisted:
        monkeypatch.setattr(namespace, "RELIST_ENTRIES", 0)
    store = FakeStore()
    store.put("d/f", b"12345")
    store.put("d/g", b"123")
    ns = Namespace(store, call, prefix="", ttl=60.0)
    d = await ns.lookup(ROOT_INODE, b"d")
    entries, listed_at = await ns.open_dir(d.ino)  # opendir: the snapshot names f
    del store.objects["d/f"]
    ns._listings.clear()  # its TTL ran out: the next lookup asks the bucket
    with pytest.raises(PathError):
        await ns.lookup(d.ino, b"f")
    handed = ns.entry_node(ns.node(d.ino), next(e for e in entries if e.name == b"f"), listed_at)  # readdirplus
    ns.entry_taken(handed)
    assert handed.superseded, "the deleted version handed out as current"
    ns.forget(handed.ino, 1)
    ns._negative.clear()  # the lookup's TTL ran out too (its answer, a listing of `d` again: B1200)
    ns._listings.clear()
    go_down(store)
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"f")


@pytest.mark.parametrize("listing", ["kept-before", "landing-after"])
async def test_while_the_origin_is_down_a_listed_file_a_head_of_its_inode_found_deleted_is_not_listed(
        listing: str, autojump_clock: Any, allowed_logs: list[str]) -> None:
    """B381 by the other way a name is found gone: `d/f` held open (a descriptor's fstat, a GETATTR past the TTL: a
    HEAD of its inode, `refresh`) after another writer deleted it. The listing kept for outages still named it: while
    the origin was away, `ls d` listed the deleted file."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G)
    d = await ns.lookup(ROOT_INODE, b"d")
    f = await ns.lookup(d.ino, b"f")  # held open
    f.fresh_until = f.confirmed_at = 0.0  # its TTL is over: the next GETATTR asks

    async def found_deleted() -> None:
        del store.objects["d/f"]
        assert (await ns.refresh(f)).superseded

    await beside_a_listing(ns, answers, d, listing, {b"f": False, b"g": False}, found_deleted)
    go_down(store)
    assert await names(ns, d.ino) == {b"g": False}
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"f")


@pytest.mark.parametrize("listing", ["kept-before", "landing-after"])
async def test_while_the_origin_is_down_a_listed_file_a_head_of_its_inode_found_replaced_resolves_as_the_new_version(
        listing: str, autojump_clock: Any, allowed_logs: list[str]) -> None:
    """`d/f` held open (a GETATTR past the TTL: a HEAD of its inode, `refresh`) after another writer replaced it, then
    closed and forgotten by the kernel. The listing kept for outages (kept before, or one under way landing after)
    still named the version the HEAD found replaced, which is older news than that HEAD: while the origin was away,
    `stat d/f` was EIO, though the mount knew the new version (and the names kept in the cache dir held it)."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G)
    d = await ns.lookup(ROOT_INODE, b"d")
    f = await ns.lookup(d.ino, b"f")  # held open
    f.fresh_until = f.confirmed_at = 0.0  # its TTL is over: the next GETATTR asks

    async def found_replaced() -> None:
        store.put("d/f", b"1234567")
        assert (await ns.refresh(f)).superseded

    await beside_a_listing(ns, answers, d, listing, {b"f": False, b"g": False}, found_replaced)
    ns.forget(f.ino, 1)  # closed, and the kernel forgot the inode
    go_down(store)
    assert await names(ns, d.ino) == {b"f": False, b"g": False}
    node = await ns.lookup(d.ino, b"f")
    assert node.size == 7 and (await ns.open_file(node.ino)).size == 7


@pytest.mark.parametrize("listing", ["kept-before", "landing-after"])
async def test_while_the_origin_is_down_a_file_a_newer_lookup_found_created_is_listed(
        listing: str, autojump_clock: Any, allowed_logs: list[str]) -> None:
    """`ls d` kept its listing (or one under way landed after), another writer created `d/new`, and `stat d/new` found
    it. While the origin was away, `ls d` did not show it, though its lookup resolved it (the node kept once the
    kernel forgot it) and a remount from the names kept in the cache dir listed it."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late({"d/g": b"123"})
    d = await ns.lookup(ROOT_INODE, b"d")

    async def found_created() -> None:
        store.put("d/new", b"1234")
        ns.forget((await ns.lookup(d.ino, b"new")).ino, 1)  # `stat d/new`; the kernel forgot it since

    await beside_a_listing(ns, answers, d, listing, {b"g": False}, found_created)
    go_down(store)
    assert await names(ns, d.ino) == {b"g": False, b"new": False}
    assert (await ns.lookup(d.ino, b"new")).size == 4


async def test_while_the_origin_is_down_a_file_found_deleted_as_a_shared_listing_landed_is_not_listed(
        autojump_clock: Any, allowed_logs: list[str]) -> None:
    """Two `ls d` at once share one listing; a HEAD of `g`'s inode finds another writer's new version while it is under
    way (so the listing is kept for outages as a copy, `Listing.found_since`), and a HEAD of `f`'s, its answer landing
    as the listing does, finds `f` deleted. Where that answer came after the task that ran the listing had kept it and
    before the one waiting for it woke, the waiter kept the listing again, and `f` was back in `ls` while the origin
    was away. The two land in one scheduling batch, in either order (trio's choice): tried until both orders are met
    many times over."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    for _ in range(24):
        store, answers, ns = a_namespace_answering_late(dict.fromkeys(("d/f", "d/g", "d/h"), b"12345"))
        d = await ns.lookup(ROOT_INODE, b"d")
        f, g = (await ns.lookup(d.ino, b"f")), (await ns.lookup(d.ino, b"g"))  # held open
        f.confirmed_at = g.confirmed_at = 0.0  # the next GETATTR asks
        answers.late = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ns.listing, d)  # asked now, lands in 1 s
            nursery.start_soon(ns.listing, d)  # waits for that one
            await trio.sleep(0.5)
            answers.late = False
            store.put("d/g", b"123")
            assert (await ns.refresh(g)).superseded
            del store.objects["d/f"]
            await trio.sleep(0.5)  # as the listing lands
            assert (await ns.refresh(f)).superseded
        go_down(store)
        assert await names(ns, d.ino) == {b"g": False, b"h": False}
        with pytest.raises(Unreachable):
            await ns.lookup(d.ino, b"f")


async def test_while_the_origin_is_down_a_file_a_create_found_taken_after_a_lookup_found_it_gone_is_listed(
        autojump_clock: Any, allowed_logs: list[str]) -> None:
    """A listing of `d` under way; another writer deletes `d/f`, a lookup finds it gone, the writer stores it again,
    and this mount's `open(O_CREAT | O_EXCL)` of `d/f` finds it taken (EEXIST, `found_in_bucket`); then the listing
    lands, naming `f`. The lookup's record of `f` found gone was left: the listing was kept for outages without it,
    and while the origin was away `ls d` did not show the file the mount had just found there."""
    from fsmount.tree_changes import WritableNamespace

    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G, kind=WritableNamespace)
    d = await ns.lookup(ROOT_INODE, b"d")
    async with landing_after(answers, ns.listing, d):
        del store.objects["d/f"]
        with pytest.raises(PathError):
            await ns.lookup(d.ino, b"f")
        store.put("d/f", b"12345")
        ns.found_in_bucket("d/f")  # the create's HEAD found it there
    go_down(store)
    assert await names(ns, d.ino) == {b"f": False, b"g": False}


async def test_while_the_origin_is_down_a_file_an_older_head_found_after_a_newer_lookup_found_it_gone_is_not_listed(
        autojump_clock: Any, allowed_logs: list[str]) -> None:
    """`d/f` held open and listed; another writer deletes it (a lookup finds it gone), stores it again, and a HEAD of
    the held inode is asked (its answer slow); the writer deletes it again, and a second lookup finds it gone before
    that HEAD's answer lands. The HEAD's answer, the older news, put its version in the listing kept for outages: while
    the origin was away, `ls d` listed `f` and its lookup resolved it, though the newest answer had found nothing
    there."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G)
    d = await ns.lookup(ROOT_INODE, b"d")
    f = await ns.lookup(d.ino, b"f")  # held open
    assert await names(ns, d.ino) == {b"f": False, b"g": False}
    del store.objects["d/f"]
    with pytest.raises(PathError):
        await ns.lookup(d.ino, b"f")
    store.put("d/f", b"1234567")
    f.fresh_until = f.confirmed_at = 0.0  # the next GETATTR asks
    async with landing_after(answers, ns.refresh, f):
        del store.objects["d/f"]
        with pytest.raises(PathError):
            await ns.lookup(d.ino, b"f")
    go_down(store)
    assert await names(ns, d.ino) == {b"g": False}
    with pytest.raises(Unreachable):
        await ns.lookup(d.ino, b"f")


async def test_the_listing_kept_for_outages_counts_the_names_lookups_add_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ls e` and `ls d` kept their listings; another writer then stores files in `d` and lookups find them, each added
    to `d`'s listing kept for outages (B501). cachetools counts a listing's size when it is stored: the names added were
    never counted, and the listings kept grew past LISTING_CACHE_ENTRIES (their share of --memory-limit) for as long
    as such a directory was looked up and not listed again."""
    monkeypatch.setattr(namespace, "LISTING_CACHE_ENTRIES", 6)
    store = FakeStore()
    for key in ("e/a", "e/b", "d/a"):
        store.put(key, b"1")
    ns = Namespace(store, call, prefix="", ttl=0)
    ns._last_listings = cachetools.LRUCache(maxsize=6, getsizeof=lambda entries: max(1, len(entries)))
    for name_b in (b"e", b"d"):
        await names(ns, (await ns.lookup(ROOT_INODE, name_b)).ino)
    d = await ns.lookup(ROOT_INODE, b"d")
    for i in range(5):
        store.put(f"d/{i}", b"1")
        await ns.lookup(d.ino, str(i).encode())
    assert len(ns._last_listings["d"]) == 6
    assert sum(len(listing) for listing in ns._last_listings.values()) <= 6


async def test_the_listing_kept_for_outages_counts_the_files_this_mount_stores_without_restarting_the_cached_ones_ttl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`ls e` and `ls d` kept their listings; a job then writes files into `d` through this mount, each added to `d`'s
    listing kept for outages (`WritableNamespace._change`). cachetools counts a listing's size when it is stored: the
    names added were never counted, and the listings kept grew past LISTING_CACHE_ENTRIES (their share of
    --memory-limit). The cached listing (the same dict) is not stored again: its TTL would restart."""
    from fsmount.tree_changes import WritableNamespace

    monkeypatch.setattr(namespace, "LISTING_CACHE_ENTRIES", 6)
    store = FakeStore()
    for key in ("e/a", "e/b", "d/a"):
        store.put(key, b"1")
    now = [0.0]
    ns = WritableNamespace(store, call, prefix="", ttl=60.0)
    ns._listings = cachetools.TTLCache(maxsize=6, ttl=60.0, timer=lambda: now[0],
                                       getsizeof=lambda entries: max(1, len(entries)))
    ns._last_listings = cachetools.LRUCache(maxsize=6, getsizeof=lambda entries: max(1, len(entries)))
    for name_b in (b"e", b"d"):
        await names(ns, (await ns.lookup(ROOT_INODE, name_b)).ino)
    d = await ns.lookup(ROOT_INODE, b"d")
    now[0] = 30.0
    for i in range(5):
        node = ns.begin_file(f"d/{i}")
        ns.end_file(node, ObjectMeta(f"d/{i}", 1, f"etag{i}", 0))
    assert len(ns._last_listings["d"]) == 6
    assert sum(len(listing) for listing in ns._last_listings.values()) <= 6
    assert await names(ns, d.ino) == {b"a": False, **{str(i).encode(): False for i in range(5)}}
    now[0] = 61.0
    assert "d" not in ns._listings  # the TTL of `ls d`'s listing ran from that listing, not from the last store


@pytest.mark.parametrize("listing", ["kept-before", "landing-after"])
@pytest.mark.parametrize("stored_again", [b"12345", b"1234567"])
async def test_while_the_origin_is_down_a_file_a_create_found_taken_after_a_lookup_found_it_gone_resolves(
        listing: str, stored_again: bytes, autojump_clock: Any, allowed_logs: list[str]) -> None:
    """`ls d` kept its listing (or one under way lands after); another writer deletes `d/f`, a lookup finds it gone,
    the writer stores it again (the same bytes, or others), and this mount's `open(O_CREAT | O_EXCL)` of `d/f` finds it
    taken (EEXIST: its HEAD's answer, `found_in_bucket`). While the origin was away `ls d` showed `f` (B503) and
    `stat d/f` was EIO: the lookup's answer of nothing stayed the newest about the path, and the listing's version older
    news than it (kept before, `ls` did not show it either)."""
    from fsmount.tree_changes import WritableNamespace

    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G, kind=WritableNamespace)
    d = await ns.lookup(ROOT_INODE, b"d")

    async def found_taken() -> None:
        del store.objects["d/f"]
        with pytest.raises(PathError):
            await ns.lookup(d.ino, b"f")
        store.put("d/f", stored_again)
        asked = time.monotonic()
        ns.found_in_bucket("d/f", (False, store.head("d/f")), asked)  # the create's HEAD found it there

    await beside_a_listing(ns, answers, d, listing, {b"f": False, b"g": False}, found_taken)
    go_down(store)
    listed = {e.name: e for e in await ns.listing(d)}
    assert set(listed) == {b"f", b"g"} and listed[b"f"].meta.size == len(stored_again)
    node = await ns.lookup(d.ino, b"f")
    assert node.size == len(stored_again) and node.etag == store.etags["d/f"]


async def test_while_the_origin_is_down_a_file_a_lookup_found_replaced_as_a_read_of_the_old_version_failed_resolves(
        autojump_clock: Any, allowed_logs: list[str]) -> None:
    """`ls d` kept its listing; a reader holds `d/f` open; another writer replaces it, and a lookup of `d/f` is asked
    (its answer slow) while the reader's GET, sent before, is refused (412: `gone`, dated when it lands). The lookup,
    asked before that refusal landed, was taken for older news: the new version it found superseded, the listing kept
    for outages left naming the old one. While the origin was away `ls d` showed the old size and, the kernel having
    forgotten the new inode, `stat d/f` was EIO."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    store, answers, ns = a_namespace_answering_late(F_AND_G)
    d = await ns.lookup(ROOT_INODE, b"d")
    old = (await ns.lookup(d.ino, b"f")).version("")  # held open by the reader
    assert await names(ns, d.ino) == {b"f": False, b"g": False}
    store.put("d/f", b"1234567")
    found: list[Node] = []

    async def look_up() -> None:
        found.append(await ns.lookup(d.ino, b"f"))

    answers.late = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(look_up)  # asked now, lands in 1 s
        await trio.sleep(0.5)
        ns.gone(old)  # the reader's GET, sent before the lookup, refused as the lookup is under way
    answers.late = False
    assert not found[0].superseded and found[0].size == 7
    ns.forget(found[0].ino, 1)  # the kernel forgot it
    go_down(store)
    listed = {e.name: e for e in await ns.listing(d)}
    assert set(listed) == {b"f", b"g"} and listed[b"f"].meta.size == 7
    assert (await ns.lookup(d.ino, b"f")).size == 7


@pytest.mark.usefixtures("each_request_asks")
async def test_a_getattr_of_a_file_held_open_answers_at_once_and_its_head_runs_behind(
        autojump_clock) -> None:  # noqa: ANN001
    """`refresh_held` (a GETATTR of a file a descriptor holds open) answers what is known without waiting for the HEAD
    (each answered a second after it is asked here); the HEAD runs in `run`'s nursery, one at a time, and an open
    waiting for it gets its news. A GETATTR before a READ past the TTL held the read a whole HEAD (B790)."""
    store = FakeStore()
    store.put("f", b"old")
    ns = Namespace(store, answered_in_a_second, prefix="", ttl=60.0)
    node = await ns.lookup(ROOT_INODE, b"f")
    assert await ns.refresh_held(node) is node  # no nursery to run it behind (not mounted): waited for, as before
    async with trio.open_nursery() as nursery:
        await nursery.start(ns.run)
        store.put("f", b"newer!")
        node.fresh_until = 0.0  # past the TTL
        heads, began = store.heads, trio.current_time()
        for _ in range(3):  # the GETATTRs of three READs
            got = await ns.refresh_held(node)
            assert got is node and not node.superseded and node.size == 3
        assert trio.current_time() == began  # at once
        with pytest.raises(PathError) as exc:  # an open waits for the HEAD under way, and gets its news
            await ns.open_file(node.ino)
        assert exc.value.errno == errno.ESTALE and store.heads == heads + 1
        assert trio.current_time() == began + 1
        # A HEAD behind that fails ends nothing: the mount's nursery runs on, and the GETATTR got its answer.
        store.head = lambda key: (_ for _ in ()).throw(StoreError("refused"))  # type: ignore[method-assign]
        node.fresh_until = 0.0
        assert await ns.refresh_held(node) is node and node.size == 3
        await trio.sleep(2)
        nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("each_request_asks")
async def test_the_heads_behind_getattrs_of_many_files_held_open_run_a_few_at_once(
        autojump_clock) -> None:  # noqa: ANN001
    """`refresh_held` starts HEADS_BEHIND HEADs at once at most, whatever the number of files held open past the TTL:
    the rest are asked at later GETATTRs, and the mount's metadata slots stay for the lookups and opens that wait. One
    per inode, 1000 files read at once queued 1000 HEADs ahead of them (B940)."""
    store = FakeStore()
    names = [f"f{i}".encode() for i in range(10)]
    for name in names:
        store.put(name.decode(), b"x")
    ns = Namespace(store, answered_in_a_second, prefix="", ttl=60.0)
    nodes = [await ns.lookup(ROOT_INODE, name) for name in names]
    async with trio.open_nursery() as nursery:
        await nursery.start(ns.run)
        for node in nodes:
            node.fresh_until = 0.0  # past the TTL
        rounds = 0
        while any(node.fresh_until == 0.0 for node in nodes):
            for node in nodes:  # the GETATTRs of READs of every file, at once
                assert await ns.refresh_held(node) is node
            await trio.sleep(0.5)
            assert len(ns._refreshing_now) <= namespace.HEADS_BEHIND, len(ns._refreshing_now)
            await trio.sleep(1)
            rounds += 1
        assert rounds == -(-len(nodes) // namespace.HEADS_BEHIND)  # each round's GETATTRs asked the next ones
        nursery.cancel_scope.cancel()


async def test_a_push_found_file_by_file_sweeps_the_files_beside_them_once(monkeypatch) -> None:  # noqa: ANN001
    """Each read refused and each HEAD that found a file of a pushed directory replaced swept every node the mount
    holds (`_changed_beside`), and each refusal handed the kernel every other file of the directory to forget: a
    reload after a push of a 10,000-file directory cost 10,000 sweeps (16 ms each with 100,000 nodes). The files
    already asked again for that change sweep nothing; a later push, found by a file trusted since, sweeps again."""
    store = FakeStore()
    keys = [f"d/f{i}" for i in range(50)]
    for key in keys:
        store.put(key, b"old")
    ns = make_ns(store, ttl=float("inf"))
    d = await ns.lookup(ROOT_INODE, b"d")
    nodes = [await ns.lookup(d.ino, key[2:].encode()) for key in keys]
    sweeps = []
    changed_beside = ns._changed_beside
    monkeypatch.setattr(ns, "_changed_beside", lambda *args: sweeps.append(changed_beside(*args)) or sweeps[-1])
    for key in keys:
        store.put(key, b"newer!")  # the push
    entry, beside = ns.gone(nodes[0].version(""))  # the first read refused: news
    assert entry == (d.ino, b"f0") and len(beside) == 49
    for node in nodes[1:25]:  # the reload: each open asks, its HEAD finds the new version
        with pytest.raises(PathError):
            await ns.open_file(node.ino)
    for node in nodes[25:]:  # descriptors held across the push, their reads refused
        assert ns.gone(node.version("")) == ((d.ino, node.path[2:].encode()), [])
    assert sweeps == [True] + [False] * 49
    fresh = await ns.lookup(d.ino, b"f1")  # the new revision, trusted from now on
    assert await ns.open_file(fresh.ino) == fresh.version("")
    store.put("d/f1", b"newest!!")  # a second push
    assert ns.gone(fresh.version(""))[1] != [] and sweeps[-1] is True


async def test_a_version_found_gone_makes_the_files_beside_it_be_asked_again_at_their_next_open() -> None:
    """With --metadata-ttl forever, a read's 412 on one shard of a pushed model left the other shards the mount knew
    opening as the old revision for good: a reload loaded two revisions. The refusal makes the files of its directory
    be asked again (a HEAD) at their next open; names found missing there are looked up again; files elsewhere are
    not asked; and the kernel's entries of the files beside it are the ones to drop."""
    store = FakeStore()
    for key in ("d/a", "d/b", "e/c"):
        store.put(key, b"old")
    ns = make_ns(store, ttl=float("inf"))
    d, e = await ns.lookup(ROOT_INODE, b"d"), await ns.lookup(ROOT_INODE, b"e")
    a, b, c = await ns.lookup(d.ino, b"a"), await ns.lookup(d.ino, b"b"), await ns.lookup(e.ino, b"c")
    with pytest.raises(PathError):
        await ns.lookup(d.ino, b"n")  # cached missing, for good
    for key in ("d/a", "d/b", "d/n", "e/c"):
        store.put(key, b"newer!")  # the push
    assert await ns.open_file(b.ino) == b.version("")  # nothing says so yet: the TTL is forever
    assert ns.gone(a.version("")) == ((d.ino, b"a"), [(d.ino, b"b")])  # a read of a, refused
    heads = store.heads
    with pytest.raises(PathError) as exc:
        await ns.open_file(b.ino)
    assert exc.value.errno == errno.ESTALE and store.heads == heads + 1
    assert (await ns.lookup(d.ino, b"b")).size == 6 and (await ns.lookup(d.ino, b"n")).size == 6
    assert await ns.open_file(c.ino) == c.version("")  # another directory: as the TTL says
    new_b = await ns.lookup(d.ino, b"b")
    heads = store.heads
    assert await ns.open_file(new_b.ino) == new_b.version("") and store.heads == heads  # trusted again


@asynccontextmanager
async def slow_origin_past_ttl(ns: Namespace) -> AsyncIterator[None]:
    """`ns` (a TTL of 10 s) running (`Namespace.run`) 11 s later, past the TTL of what it knew then, each store call
    from now taking 3 s (with `namespace_on_trio_clock`)."""
    async def answered_in_3s(fn, *args):  # noqa: ANN001, ANN202
        await trio.sleep(3)
        return fn(*args)

    ns._ask = answered_in_3s
    async with trio.open_nursery() as nursery:
        await nursery.start(ns.run)
        await trio.sleep(11)
        yield
        nursery.cancel_scope.cancel()


@pytest.fixture
def namespace_on_trio_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The namespace's clock is trio's (virtual time with autojump_clock)."""
    monkeypatch.setattr(namespace.time, "monotonic", trio.current_time)


@pytest.mark.usefixtures("each_request_asks", "namespace_on_trio_clock")
async def test_a_lookup_of_a_known_name_waits_for_a_slow_origin_a_bounded_time_and_its_open_asks(
        autojump_clock) -> None:  # noqa: ANN001
    """A known name's lookup past the TTL waits KNOWN_NAME_WAIT_S at most for the bucket (each answer takes 3 s here),
    then answers what the mount knows; later lookups while that request is unanswered wait none. An open of the node
    so answered still asks the bucket, and gets its news (ESTALE: replaced)."""
    store = FakeStore()
    store.put("f", b"old")
    store.put("g", b"old")
    ns = Namespace(store, call, prefix="", ttl=10.0)
    f, g = await ns.lookup(ROOT_INODE, b"f"), await ns.lookup(ROOT_INODE, b"g")
    async with slow_origin_past_ttl(ns):
        store.put("f", b"newer!")
        began = trio.current_time()
        assert await ns.lookup(ROOT_INODE, b"f") is f
        assert trio.current_time() == began + namespace.KNOWN_NAME_WAIT_S and f.unchecked
        assert await ns.lookup(ROOT_INODE, b"g") is g  # the origin is silent: at once
        assert trio.current_time() == began + namespace.KNOWN_NAME_WAIT_S
        with pytest.raises(PathError) as exc:
            await ns.open_file(f.ino)
        assert exc.value.errno == errno.ESTALE
        new = await ns.lookup(ROOT_INODE, b"f")
        assert new.ino != f.ino and new.size == 6


@pytest.mark.usefixtures("each_request_asks", "namespace_on_trio_clock")
async def test_lookups_of_many_known_names_at_once_on_a_slow_origin_leave_few_requests_behind(
        autojump_clock) -> None:  # noqa: ANN001
    """Lookups of many known names at once past the TTL, the origin answering in 3 s: each left its request running
    behind its answer (a stat storm of 10,000 names queued 10,000 HEADs and listings for the metadata slots). Past
    KNOWN_BEHIND under way, a lookup waits for its own request, as before B1001."""
    store = FakeStore()
    names_b = [f"f{i:02d}".encode() for i in range(20)]
    for name in names_b:
        store.put(name.decode(), b"old")
    ns = Namespace(store, call, prefix="", ttl=10.0)
    known = {name: await ns.lookup(ROOT_INODE, name) for name in names_b}
    found: dict[bytes, Node] = {}

    async def look_up(name: bytes) -> None:
        found[name] = await ns.lookup(ROOT_INODE, name)

    async with slow_origin_past_ttl(ns):
        began = trio.current_time()
        async with trio.open_nursery() as lookups:
            for name in names_b:
                lookups.start_soon(look_up, name)
            await trio.sleep(0.5)
            assert ns._known_behind == namespace.KNOWN_BEHIND < len(names_b)
        assert found == known
        # The lookups past KNOWN_BEHIND waited for their own requests, and those behind had landed by then: uncapped,
        # each lookup answered after KNOWN_NAME_WAIT_S, leaving all 40 requests (a HEAD and a listing each) behind.
        assert trio.current_time() == began + 3 and ns._unanswered == {}


@pytest.mark.usefixtures("each_request_asks", "namespace_on_trio_clock")
async def test_stats_of_one_known_file_at_once_on_a_slow_origin_share_one_head_and_its_open_ends(
        autojump_clock) -> None:  # noqa: ANN001
    """Two GETATTRs of one known file at once past the TTL, the origin answering in 3 s: each started a HEAD behind
    (the second before the first had said so), the first's end dropped the second's from the table, and the second's
    end failed there before telling its waiters: an open of the file waiting for that HEAD waited for ever."""
    store = FakeStore()
    store.put("f", b"old")
    ns = Namespace(store, call, prefix="", ttl=10.0)
    f = await ns.lookup(ROOT_INODE, b"f")
    async with slow_origin_past_ttl(ns):
        heads = store.heads
        async with trio.open_nursery() as stats:
            for _ in range(2):
                stats.start_soon(ns.refresh_known, f)
        with trio.fail_after(10):
            assert await ns.open_file(f.ino) == f.version("")
        assert store.heads == heads + 1
