"""The namespace against the fake store: names, listings, lookups, inode numbers, lookup counts."""

from __future__ import annotations

import errno

import pytest

from fsmount.data import Unreachable
from fsmount.namespace import ROOT_INODE, Namespace, PathError
from tests.helpers import ORIGIN_UNAVAILABLE
from tests.unit.fake_store import FakeStore


async def call(fn, *args):  # noqa: ANN001, ANN201
    return fn(*args)


def make_ns(store: FakeStore, prefix: str = "", ttl: float = 60.0) -> Namespace:
    return Namespace(store, call, prefix=prefix, ttl=ttl)


async def names(ns: Namespace, ino: int) -> dict[bytes, bool]:
    return {e.name: e.is_dir for e in await ns.listing(ns.node(ino))}


def origin_down(*args: object) -> None:
    """Stands in for a store call while the origin is down."""
    raise Unreachable("cannot reach the endpoint")


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


async def test_more_than_1000_entries_paginate() -> None:
    store = FakeStore()
    for i in range(2500):
        store.put(f"many/f{i:05d}", b"")
    ns = make_ns(store)
    many = await ns.lookup(ROOT_INODE, b"many")
    assert len(await names(ns, many.ino)) == 2500


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
    with pytest.raises(PathError):
        await ns.refresh(node)


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
