"""Object names that URL (form) encoding changes: listed under their exact names, opened, read byte-exact,
through a real mount and at the store level across page boundaries, on moto and on SeaweedFS. (How the
store decodes them, without a server: tests/unit/test_names.py.)

S3 and SeaweedFS send a space as '+' in `EncodingType=url` listings (SeaweedFS: in keys, not in common
prefixes) and a literal '+' as '%2B'; moto sends '%20'. Only a test on both servers sees the difference.
"""

from __future__ import annotations

import os
import time
import unicodedata
from pathlib import Path

import pytest

from fsmount.config import StoreConfig
from fsmount.data import Boto3Store
from fsmount.testing.fault_proxy import FaultProxy
from tests.helpers import S3Server, mounted, mounted_via, new_bucket, put_objects

# One name per way an encoder can go wrong.
NAMES = [
    "my name.txt",          # space: '+' on S3 and SeaweedFS, '%20' on moto
    "a+b",                  # literal plus: '%2B'
    "100%",                 # literal percent
    "a%20b",                # an encoded space written literally
    "a%2Bb",                # an encoded plus written literally
    "x&y=z",
    "what?",
    "#hash",
    unicodedata.normalize("NFC", "café"),   # é as one code point
    unicodedata.normalize("NFD", "café"),   # e + combining acute: a different name
    "   ",                  # only spaces
    " lead and trail ",
    "+",
]


def _body(key: str) -> bytes:
    return key.encode() * 3 + os.urandom(64)


def _upload(server: S3Server, bucket: str, keys: list[str]) -> dict[str, bytes]:
    bodies = {k: _body(k) for k in keys}
    put_objects(server, bucket, bodies)
    return bodies


def test_names_that_encoding_changes_round_trip_through_a_mount(s3: S3Server, tmp_path: Path) -> None:
    bucket = new_bucket(s3)
    # Each name as a file at the top, inside a directory of the same name, and as a file in a directory
    # whose own name needs encoding (a common prefix, encoded differently from keys by SeaweedFS).
    keys = [*NAMES, *(f"{n}/inner {n}" for n in NAMES), *(f"sub dir+/{n}" for n in NAMES)]
    bodies = _upload(s3, bucket, keys)
    with mounted(s3, bucket, tmp_path / "mnt") as m:
        top = sorted(os.listdir(m.path))
        assert top == sorted([*NAMES, "sub dir+"])
        # A name that is both a file and a directory shows as the directory (files under it).
        assert sorted(os.listdir(m.path / "sub dir+")) == sorted(NAMES)
        for name in NAMES:
            assert (m.path / name).is_dir()
            assert os.listdir(m.path / name) == [f"inner {name}"]
            inner = f"{name}/inner {name}"
            assert (m.path / inner).read_bytes() == bodies[inner], inner
            nested = f"sub dir+/{name}"
            assert (m.path / nested).read_bytes() == bodies[nested], nested
            assert os.stat(m.path / nested).st_size == len(bodies[nested])


def test_names_that_encoding_changes_open_as_files(s3: S3Server, tmp_path: Path) -> None:
    """The same names as plain files in one directory: looked up by name without a listing first
    (HEAD), then listed, then read again."""
    bucket = new_bucket(s3)
    keys = [f"d/{n}" for n in NAMES]
    bodies = _upload(s3, bucket, keys)
    with mounted(s3, bucket, tmp_path / "mnt") as m:
        for key in keys:  # by path first: lookup without a cached listing
            assert (m.path / key).read_bytes() == bodies[key], key
        assert sorted(os.listdir(m.path / "d")) == sorted(NAMES)
        for entry in os.scandir(m.path / "d"):
            with open(entry.path, "rb") as f:
                assert f.read() == bodies[f"d/{entry.name}"], entry.name


def test_names_that_encoding_changes_are_looked_up_in_a_new_listing_past_the_ttl(s3: S3Server, tmp_path: Path) -> None:
    """Past the TTL, a lookup in a small directory listed before is answered by a new listing of it (B1200), not a
    HEAD: each name resolves there under its exact name, as the server encodes it in a listing."""
    bucket = new_bucket(s3)
    bodies = _upload(s3, bucket, [f"d/{n}" for n in NAMES])
    with FaultProxy(s3.endpoint_url) as proxy, mounted_via(proxy, s3, bucket, tmp_path / "mnt",
                                                           "--metadata-ttl", "1") as m:
        assert os.listdir(m.path) == ["d"]
        assert sorted(os.listdir(m.path / "d")) == sorted(NAMES)
        time.sleep(1.5)
        proxy.reset_counts()
        sizes = {name: os.stat(m.path / "d" / name).st_size for name in NAMES}
        counts = proxy.counts()
    assert sizes == {name: len(bodies[f"d/{name}"]) for name in NAMES}
    assert counts.get("heads", 0) == 0, counts


def test_listing_pages_continue_past_encoded_names(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two keys per page: every continuation token follows a name that encoding changes."""
    bucket = new_bucket(s3)
    keys = [f"p/{n}" for n in NAMES] + [f"p/{n}/x" for n in NAMES[:4]]
    _upload(s3, bucket, keys)
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    store = Boto3Store(StoreConfig(bucket, endpoint_url=s3.endpoint_url, addressing_style="path"))
    store.list_page_keys = 2
    pages = list(store.list_pages("p/"))
    assert len(pages) >= len(keys) // 2
    listed = [o.key for page in pages for o in page.objects]
    prefixes = [p for page in pages for p in page.prefixes]
    assert sorted(listed) == sorted(f"p/{n}" for n in NAMES)
    assert len(listed) == len(set(listed))
    assert sorted(prefixes) == sorted(f"p/{n}/" for n in NAMES[:4])
    assert not any(page.undecodable for page in pages)


def test_a_file_hidden_by_a_directory_of_its_name_is_named_in_the_log(s3: S3Server, tmp_path: Path) -> None:
    """B570: a key that is both a file and a prefix (`a` and `a/b`) shows as the directory, as README says; the file
    was gone from `ls`, `cp -r` and `modelfs prefetch` with no word in the log. Now one line per hidden key, found by a
    listing (on whichever page the file and the prefix fall: the file first, 1,000 keys apart) or by a lookup."""
    bucket = new_bucket(s3)
    fillers = {f"listed/a.{i:04d}": b"f" for i in range(1001)}  # between "a" and "a/" in key order: another page
    put_objects(s3, bucket, {"looked up": b"file", "looked up/inner": b"x", "listed/a": b"file",
                             "listed/a/b": b"x", "plain": b"p", **fillers})
    with mounted(s3, bucket, tmp_path / "mnt", "--metadata-ttl", "0") as m:
        assert (m.path / "looked up").is_dir()  # a lookup, its directory not listed
        assert "key 'looked up' is not shown" in m.log()
        names = os.listdir(m.path / "listed")
        assert len(names) == 1002 and "a" in names
        assert "key 'listed/a' is not shown" in m.log()
        assert (m.path / "listed" / "a").is_dir()
        os.listdir(m.path / "listed")  # listed again (TTL 0): not logged again
        assert sorted(os.listdir(m.path)) == ["listed", "looked up", "plain"]
        log = m.log()
    hidden = [line for line in log.splitlines() if "is not shown: keys under" in line]
    assert len([line for line in hidden if "'looked up'" in line]) == 1, hidden
    assert len([line for line in hidden if "'listed/a'" in line]) == 1, hidden
    assert len(hidden) == 2, hidden
