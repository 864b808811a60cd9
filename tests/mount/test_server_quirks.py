"""S3-compatible servers that are not AWS: what they answer differently, through a real mount.

SeaweedFS (a real server, `seaweed_server`) for what it does of itself; the fault proxy for answers no server
here gives (tests/helpers.py, fsmount/testing/fault_proxy.py).
"""

from __future__ import annotations

import dataclasses
import errno
import http.client
import os
import re
import socket
import time
from pathlib import Path

import pytest

from fsmount.namespace import RELIST_ENTRIES
from fsmount.testing.fault_proxy import Fault, FaultProxy, synthetic_body
from fsmount.testing.http_wire import Request, Response, error_response, head_bytes, send, send_raw
from tests.helpers import S3Server, drop_page_cache, mounted, mounted_via, new_bucket, put_objects


def test_a_folder_left_by_deleted_keys_is_a_directory_to_lookups_as_to_listings(s3: S3Server, tmp_path: Path) -> None:
    """SeaweedFS keeps a folder after its last key is deleted, and its delimited listings name it: `ls` showed it,
    while a lookup that no cached listing answered was ENOENT (its one-key listing without a delimiter finds nothing
    there), so `stat`, `cd`, `os.walk` and `find` failed on a name `ls` had just printed. Whatever the server keeps,
    a lookup and the parent's listing agree; on moto (AWS) a prefix whose keys are all gone is nothing."""
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {"a/gone/x": b"1", "a/nested/deep/y": b"2", "a/kept/z": b"3"})
    client = s3.client()
    client.delete_object(Bucket=bucket, Key="a/gone/x")
    client.delete_object(Bucket=bucket, Key="a/nested/deep/y")
    with mounted(s3, bucket, tmp_path / "mnt", "--metadata-ttl", "0", "--writable", "--allow-delete") as m:
        # Asked by name first, on a fresh mount: no listing of `a` to answer from.
        looked_up = {}
        for name in ("gone", "nested", "kept"):
            try:
                looked_up[name] = os.stat(m.path / "a" / name).st_mode
            except FileNotFoundError:
                looked_up[name] = None
        listed = {e.name: e.is_dir() for e in os.scandir(m.path / "a")}
        assert set(listed) == {name for name, mode in looked_up.items() if mode is not None}, (listed, looked_up)
        assert all(listed.values()), listed
        assert "kept" in listed
        # Every directory the listing names can be entered and walked, nothing is an error.
        errors: list[OSError] = []
        walked = {os.path.relpath(top, m.path) for top, _, _ in os.walk(m.path, onerror=errors.append)}
        assert not errors, errors
        assert {"a", "a/kept"} <= walked
        if "nested" in listed:  # SeaweedFS: a folder holding only an emptied folder
            assert {"a/nested", "a/nested/deep"} <= walked
            assert os.listdir(m.path / "a" / "nested" / "deep") == []
        if listed.keys() > {"kept"}:
            # Such a folder is removed as an empty directory is, and its name then takes a file.
            for gone in ("a/nested/deep", "a/nested", "a/gone"):
                os.rmdir(m.path / gone)
            assert os.listdir(m.path / "a") == ["kept"]
            (m.path / "a" / "gone").write_bytes(b"a file now")
            assert (m.path / "a" / "gone").read_bytes() == b"a file now"
        if s3.name == "moto":
            assert set(listed) == {"kept"}
            with pytest.raises(OSError) as gone:
                os.stat(m.path / "a" / "gone")
            assert gone.value.errno == errno.ENOENT


def test_an_open_file_keeps_its_attributes_when_heads_are_refused_after_the_mount(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """Credentials that expire, or a bucket policy changed, after the mount: HEADs answer 403. A descriptor opened
    before keeps its file's attributes and what is cached of it, as a local file's outlives a chmod: `fstat` of it,
    and the GETATTR the kernel sends before a read(2) of pages it holds once the attributes are a TTL old, were
    EACCES. New opens and lookups are refused (EACCES), as is a read that must ask the bucket."""
    bucket = new_bucket(moto_server)
    body = os.urandom(3 * 1024 * 1024 + 17)
    put_objects(moto_server, bucket, {"m/w.bin": body, "m/other.bin": b"other"})
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", "1", "--no-model-prefetch",
                     allowed=(r"(getattr|open|lookup|read) failed: ", "access denied", "refused")):
        path = mountpoint / "m" / "w.bin"
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, len(body) + 1, 0) == body  # all of it cached now (memory, page cache)
            proxy.inject(Fault.ERROR, status=403, code="AccessDenied", kind="heads")
            time.sleep(1.2)  # the attributes' TTL, which the kernel and the mount hold them for
            assert os.pread(fd, 4096, 1024 * 1024) == body[1024 * 1024:1024 * 1024 + 4096]
            assert os.fstat(fd).st_size == len(body)
            with pytest.raises(PermissionError):
                os.open(path, os.O_RDONLY)
            # A listing, allowed, does not name it: missing, as S3 answers a HEAD of a missing key 403 without
            # s3:ListBucket (B131).
            with pytest.raises(FileNotFoundError):
                os.stat(mountpoint / "m" / "never-seen.bin")
        finally:
            os.close(fd)


def test_names_a_loader_probes_for_are_enoent_where_heads_of_missing_keys_are_refused(
        moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """AWS S3 answers a HEAD of a key that does not exist 403, not 404, to a caller without s3:ListBucket on it (a
    policy granting ListBucket under some prefixes only does not grant it to a HEAD). A loader's probes of optional
    files (transformers: generation_config.json, model.safetensors.index.json) were EACCES, each sent again for good
    (no negative entry), and logged "lookup failed: access denied ... check credentials": `open` raised
    PermissionError where the loader catches FileNotFoundError. A HEAD's bare 403 is now checked by a listing: a key
    it does not name is missing (ENOENT, cached as such); one it names stays refused (B131)."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"m/config.json": b"{}", "m/model.safetensors": b"x" * 100})
    proxy.inject(Fault.ERROR, status=403, code="AccessDenied", kind="heads")
    with mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", "60", "--no-model-prefetch",
                     allowed=(r"(lookup|open) failed: access denied",)):
        probes = ["generation_config.json", "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja"]
        assert (mountpoint / "m").is_dir()
        heads = proxy.counts().get("heads", 0)
        for _ in range(3):
            for name in probes:
                assert not os.path.isfile(mountpoint / "m" / name)
                with pytest.raises(FileNotFoundError):
                    open(mountpoint / "m" / name, "rb")  # noqa: SIM115 - it must fail
        assert proxy.counts().get("heads", 0) - heads == len(probes)  # once per name, then known missing
        with pytest.raises(PermissionError):  # there, and refused: as before
            open(mountpoint / "m" / "config.json", "rb")  # noqa: SIM115 - it must fail


class UnquotedListingETags(FaultProxy):
    """A server that lists ETags without their double quotes, while HEAD and GET give them quoted, as NetApp ONTAP
    does (and a few other S3 gateways)."""

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        resp, upstream = super()._forward(req, upstream)
        if req.kind == "lists":
            body = re.sub(rb"<ETag>(?:&quot;|&#34;|\")([^<&\"]*)(?:&quot;|&#34;|\")</ETag>", rb"<ETag>\1</ETag>",
                          resp.body)
            assert body != resp.body or b"<ETag>" not in body, resp.body[:400]
            resp = dataclasses.replace(resp, body=body, content_length=None,
                                       headers=[(k, v) for k, v in resp.headers if k.lower() != "content-length"])
        return resp, upstream


def read_as_one_version(proxy: FaultProxy, mountpoint: Path, body: bytes) -> None:
    """`m/w.bin` (`body`), mounted with a TTL of 1 s: one inode from its listing and its HEAD, and across two TTLs,
    its bytes fetched once."""
    path = mountpoint / "m" / "w.bin"
    listed = {e.name: e.inode() for e in os.scandir(mountpoint / "m")}  # the entry from the listing
    assert path.read_bytes() == body
    first = os.stat(path).st_ino
    assert listed["w.bin"] == first
    gets = proxy.counts().get("data_gets", 0)
    for _ in range(2):
        time.sleep(1.2)  # a TTL: asked of the bucket again, by name (HEAD), then by a listing
        assert os.stat(path).st_ino == first
        drop_page_cache(path)
        assert path.read_bytes() == body
        assert {e.name: e.inode() for e in os.scandir(mountpoint / "m")} == {"w.bin": first}
    assert proxy.counts().get("data_gets", 0) == gets, "an unchanged file was fetched again"


def test_a_version_listed_and_headed_in_two_forms_of_its_etag_is_one_version(moto_server: S3Server,
                                                                          mountpoint: Path) -> None:
    """Listed as `abc`, HEADed as `"abc"`: one version, not two. Taken for two, every TTL an unchanged file was
    found "replaced": its inode number changed (`ls -i`, `find -samefile`, tar's hard-link check), the kernel's
    pages of it were dropped and its cached chunks, keyed by the ETag, missed: it was fetched again whole."""
    bucket = new_bucket(moto_server)
    body = os.urandom(2 * 1024 * 1024 + 5)
    put_objects(moto_server, bucket, {"m/w.bin": body})
    with UnquotedListingETags(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", "1", "--no-model-prefetch"):
        read_as_one_version(proxy, mountpoint, body)


class OddLastModified(FaultProxy):
    """A server whose HEAD sends Last-Modified in a form beside the standard: a numeric zone and a named one."""

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        resp, upstream = super()._forward(req, upstream)
        if req.kind == "heads":
            resp = dataclasses.replace(resp, headers=[
                *((k, v) for k, v in resp.headers if k.lower() != "last-modified"),
                ("Last-Modified", "Thu, 13 Sep 2018 13:28:18 -0000 GMT")])
        return resp, upstream


def test_a_last_modified_in_an_odd_form_is_read_not_eio(moto_server: S3Server, mountpoint: Path) -> None:
    """`Thu, 13 Sep 2018 13:28:18 -0000 GMT` (a server s4cmd users met): botocore cannot parse it, and every lookup of
    a file, by HEAD, failed with EIO ("ValueError: Invalid timestamp")."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"m/w.bin": b"weights"})
    with OddLastModified(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--no-model-prefetch"):
        path = mountpoint / "m" / "w.bin"  # by name first: a HEAD, no listing
        st = os.stat(path)
        assert st.st_size == 7 and st.st_mtime == 1536845298
        assert path.read_bytes() == b"weights"


def test_a_key_ending_in_a_slash_that_holds_bytes_is_a_directory_never_a_file(s3: S3Server, tmp_path: Path) -> None:
    """`dir/` with bytes in it (S3 keeps them; SeaweedFS makes the key a folder and drops them): a directory, alone or
    with keys under it, whose own bytes no name of the mount serves; never a file, nor an entry of an empty name."""
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {"full/": b"bytes of the marker", "full/x": b"x", "alone/": b"bytes of the marker"})
    with mounted(s3, bucket, tmp_path / "mnt") as m:
        assert (m.path / "alone").is_dir() and (m.path / "full").is_dir()  # by name, no listing yet
        assert {e.name: e.is_dir() for e in os.scandir(m.path)} == {"alone": True, "full": True}
        assert os.listdir(m.path / "alone") == []
        assert os.listdir(m.path / "full") == ["x"]
        assert (m.path / "full" / "x").read_bytes() == b"x"


class HeadsWithoutLength(FaultProxy):
    """A server whose HEAD answers carry no Content-Length (Supabase Storage for an empty object, s3ninja, a gateway
    compressing on the way)."""

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.kind != "heads":
            return super()._handle(conn, req, upstream)
        resp, upstream = self._forward(req, upstream)
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}", *(f"{k}: {v}" for k, v in resp.headers),
                 "Connection: keep-alive"]
        return send_raw(conn, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")), upstream


def test_a_head_without_a_content_length_is_sized_by_a_listing(moto_server: S3Server, mountpoint: Path) -> None:
    """Every lookup by name of such a file failed "unexpectedly" (EIO: a KeyError in the store client)."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"m/empty": b"", "m/w.bin": b"weights"})
    with HeadsWithoutLength(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--no-model-prefetch"):
        assert os.stat(mountpoint / "m" / "w.bin").st_size == 7  # by name first: HEAD, no listing of m
        assert os.stat(mountpoint / "m" / "empty").st_size == 0
        assert (mountpoint / "m" / "w.bin").read_bytes() == b"weights"
        assert proxy.counts()["heads"] >= 2


class RefusesItsOwnETag(FaultProxy):
    """A server that answers every GET sent with If-Match 412, the ETag its HEAD and listings give included (SeaweedFS
    3.97 for objects older versions stored, seaweedfs#7274; a server giving weak ETags, which If-Match never
    matches)."""

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.method == "GET" and req.header("if-match"):
            return send(conn, error_response(412, "PreconditionFailed"), req), upstream
        return super()._handle(conn, req, upstream)


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_a_server_refusing_if_match_with_its_own_etag_is_read_by_the_etag_of_each_answer(
        moto_server: S3Server, mountpoint: Path, client: str) -> None:
    """Every read was EIO ("object changed"), nothing having changed. Once a HEAD says the version refused is the one
    the bucket holds, GETs go without If-Match and each answer's ETag is checked instead: a version replaced while
    open is still never read mixed (EIO), and the next open reads the new one whole."""
    bucket = new_bucket(moto_server)
    old, new = os.urandom(3 * 1024 * 1024), os.urandom(3 * 1024 * 1024)
    put_objects(moto_server, bucket, {"m/w.bin": old})
    with RefusesItsOwnETag(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--no-model-prefetch", "--chunk-size", "1M",
                        "--metadata-ttl", "1", "--get-client", client,
                        allowed=(r"refuses If-Match", r"read failed: ", r"object changed")):
        path = mountpoint / "m" / "w.bin"
        with open(path, "rb") as held:
            assert held.read(1024 * 1024) == old[:1024 * 1024]
            put_objects(moto_server, bucket, {"m/w.bin": new})
            with pytest.raises(OSError) as changed:
                held.read()  # the next chunks are of another version now
            assert changed.value.errno == errno.EIO
        time.sleep(1.2)  # the TTL
        assert path.read_bytes() == new


class NoETags(FaultProxy):
    """A server that gives no ETag at all: none on HEAD or GET, none in listings."""

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        resp, upstream = super()._forward(req, upstream)
        body = re.sub(rb"<ETag>[^<]*</ETag>", b"", resp.body) if req.kind == "lists" else resp.body
        return dataclasses.replace(resp, body=body, content_length=None if body != resp.body else resp.content_length,
                                   headers=[(k, v) for k, v in resp.headers if k.lower() != "etag"]), upstream


@pytest.mark.parametrize("client", ["presigned", "boto3", "cache-dir"])
def test_a_server_that_gives_no_etag_is_read_exactly(moto_server: S3Server, tmp_path: Path, client: str) -> None:
    """Nothing pins a version by its ETag then. An object replaced by one of another size kept its inode and its chunk
    ids: an open after the TTL read the old version's bytes (from the page cache and the chunk memory) under the new
    size. Its size and Last-Modified name the version now; names, sizes and bytes are right, by name and by listing,
    and no cache level (which outlives versions) holds such chunks."""
    bucket = new_bucket(moto_server)
    body = os.urandom(2 * 1024 * 1024 + 3)
    put_objects(moto_server, bucket, {"m/w.bin": body, "m/sub/x": b"x"})
    extra = ("--cache-dir", str(tmp_path / "cache")) if client == "cache-dir" else ("--get-client", client)
    with NoETags(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--no-model-prefetch", "--chunk-size", "1M",
                        "--metadata-ttl", "1", *extra) as m:
        path = m.path / "m" / "w.bin"
        by_name = os.stat(path)  # HEAD
        assert by_name.st_size == len(body)
        assert path.read_bytes() == body
        listed = {e.name: (e.is_dir(), e.inode()) for e in os.scandir(m.path / "m")}
        assert listed == {"w.bin": (False, by_name.st_ino), "sub": (True, listed["sub"][1])}  # one version, not two
        smaller = os.urandom(1024 * 1024 + 1)
        put_objects(moto_server, bucket, {"m/w.bin": smaller})
        time.sleep(1.2)  # the TTL
        assert path.read_bytes() == smaller
        if client == "cache-dir":
            assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file() and "chunks" in f.parts]


class HeadCutBeforeItsETag(FaultProxy):
    """`head_cuts` HEAD answers cut as CUT_HEADERS cuts a head, after a line, where a server that sends its header lines
    by name (MinIO) has sent its Content-Length but not yet its ETag: every line from `ETag` on lost. (This proxy
    writes Content-Length last, so CUT_HEADERS itself never leaves a size without an ETag.)"""

    head_cuts = 0  # set by the test between requests; taken by the connection thread of the next HEAD
    cut_at = "etag"  # the first header line lost (by name, lower case), and every one after it

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        resp, upstream = super()._forward(req, upstream)
        if req.method != "HEAD" or self.head_cuts <= 0:
            return resp, upstream
        self.head_cuts -= 1
        kept = [(k, v) for k, v in sorted(resp.headers) if k.lower() < self.cut_at]
        return dataclasses.replace(resp, headers=kept), upstream


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_a_head_cut_before_its_etag_pins_the_version_all_the_same(moto_server: S3Server, tmp_path: Path,
                                                                  client: str) -> None:
    """A HEAD whose answer lost its ETag line (cut after Content-Length) gave the size of a version and no ETag: the
    object was taken for one of a server that gives none, read unpinned (no If-Match, any answer's ETag taken), and
    once replaced while open, its handle read the new version's bytes after the old one's: wrong bytes. Such an answer
    is asked of a listing now, as one without a size is (the listing gives size and ETag of one same answer)."""
    bucket = new_bucket(moto_server)
    old, new = os.urandom(3 * 1024 * 1024), os.urandom(3 * 1024 * 1024)
    put_objects(moto_server, bucket, {"m/w.bin": old})
    with HeadCutBeforeItsETag(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--no-model-prefetch", "--chunk-size", "1M",
                        "--max-readahead", "0", "--metadata-ttl", "300", "--get-client", client,
                        allowed=(r"read failed: ", r"object changed", r"fetching chunk")) as m:
        path = m.path / "m" / "w.bin"
        assert (m.path / "m").is_dir()
        proxy.head_cuts = 1
        assert os.stat(path).st_size == len(old)  # the lookup: its HEAD cut before the ETag
        assert proxy.head_cuts == 0
        with open(path, "rb", buffering=0) as held:
            assert held.read(1024 * 1024) == old[:1024 * 1024]
            put_objects(moto_server, bucket, {"m/w.bin": new})
            drop_page_cache(path)
            try:
                got = os.pread(held.fileno(), 1024 * 1024, 2 * 1024 * 1024)  # a chunk no read-ahead has fetched
            except OSError as exc:
                assert exc.errno == errno.EIO  # the version opened is gone: EIO, as with any ETag
            else:
                assert got == old[2 * 1024 * 1024:], "the handle read another version's bytes"


def test_a_head_cut_before_its_last_modified_gives_the_real_mtime(moto_server: S3Server, tmp_path: Path) -> None:
    """A HEAD whose answer lost its Last-Modified line (cut after its ETag, as a server that sends its lines by name
    does) gave size and ETag, and no mtime: the file was dated the mount's start for the metadata's TTL, the newest
    of its directory to a script that keeps the newest checkpoints by mtime (B168). Such an answer is asked of a
    listing now, as one without an ETag is (B150). The object is stored seconds before the mount, to tell the two."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"m/w.bin": b"w" * 4096})
    stored = moto_server.client().head_object(Bucket=bucket, Key="m/w.bin")["LastModified"].timestamp()
    time.sleep(3)
    with HeadCutBeforeItsETag(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--no-model-prefetch",
                        "--metadata-ttl", "300") as m:
        proxy.cut_at = "last-modified"
        assert (m.path / "m").is_dir()
        proxy.head_cuts = 1
        st = os.stat(m.path / "m" / "w.bin")  # the lookup: its HEAD cut before Last-Modified
        assert proxy.head_cuts == 0
        assert st.st_size == 4096 and abs(st.st_mtime - stored) < 1.5, (st.st_mtime, stored)


class HeadCutInItsLength(FaultProxy):
    """`head_cuts` HEAD answers cut inside their Content-Length line, `digits` digits of its number sent, then the
    connection closed: http.client takes the shorter number for a whole one (CUT_HEADERS cuts between lines only). This
    proxy writes Content-Length after the ETag (and every other line but Connection), as AWS does."""

    head_cuts = 0  # set by the test between requests; taken by the connection thread of the next HEAD
    digits = 3

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.method != "HEAD" or self.head_cuts <= 0:
            return super()._handle(conn, req, upstream)
        self.head_cuts -= 1
        resp, upstream = self._forward(req, upstream)
        head = head_bytes(resp, req)
        cut = head.index(b"\r\nContent-Length: ") + len(b"\r\nContent-Length: ") + self.digits
        send_raw(conn, head[:cut])
        return False, upstream


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_a_head_cut_inside_its_content_length_reads_eio_then_whole_not_short(moto_server: S3Server, tmp_path: Path,
                                                                              client: str) -> None:
    """A HEAD answer cut inside its Content-Length line gave a smaller size with the right ETag: every GET matched
    If-Match, and `cat` read the file back short, as if whole (wrong bytes for a loader). Each GET's Content-Range
    total is compared with the size pinned now: the read is EIO, the name is looked up again, and the next open reads
    it whole, TTL or not (B209)."""
    bucket = new_bucket(moto_server)
    body = os.urandom(2 * 1024 * 1024 + 3)
    put_objects(moto_server, bucket, {"m/w.bin": body})
    with HeadCutInItsLength(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--no-model-prefetch", "--chunk-size", "1M",
                        "--metadata-ttl", "300", "--get-client", client,
                        allowed=(r"read failed: ", r"fetching chunk", r"its version was pinned at")) as m:
        path = m.path / "m" / "w.bin"
        assert (m.path / "m").is_dir()
        proxy.head_cuts = 1
        assert os.stat(path).st_size == int(str(len(body))[:3])  # the lookup: its HEAD cut inside Content-Length
        assert proxy.head_cuts == 0
        with pytest.raises(OSError) as refused:
            path.read_bytes()
        assert refused.value.errno == errno.EIO
        assert os.stat(path).st_size == len(body)  # asked again (the TTL is 300 s)
        assert path.read_bytes() == body


class HeadCutAndItsListingUnanswered(HeadCutBeforeItsETag):
    """`HeadCutBeforeItsETag`, and the one-key listing of `m/w.bin` itself answered `listing`: "refused" (403
    AccessDenied, as from a policy that grants s3:ListBucket for the directory's prefix, "m/", only) or "unnamed"
    (a listing that does not name the key yet)."""

    listing = "refused"
    listings = 0  # how many of those listings were answered so

    def _synthetic_response(self, req: Request) -> Response | None:
        if req.method != "GET" or req.query().get("prefix") != "m/w.bin":
            return super()._synthetic_response(req)
        self.listings += 1
        if self.listing == "refused":
            return error_response(403, "AccessDenied")
        body = (b'<?xml version="1.0" encoding="UTF-8"?>\n'
                b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>'
                b"<Prefix>m/w.bin</Prefix><KeyCount>0</KeyCount><MaxKeys>1</MaxKeys>"
                b"<IsTruncated>false</IsTruncated></ListBucketResult>")
        return Response(200, "OK", [("Content-Type", "application/xml")], body)


@pytest.mark.parametrize("listing", ["refused", "unnamed"])
def test_a_head_cut_before_its_last_modified_whose_listing_cannot_date_it_finds_the_file(
        moto_server: S3Server, tmp_path: Path, listing: str) -> None:
    """A HEAD that lost only its Last-Modified gave the object's size and ETag; the listing asked for its mtime
    (B168) refused, or not naming the key, made the file EACCES or ENOENT, where before B168 it was found (B200).
    It is found, undated (the mount's start), and read whole."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"m/w.bin": b"w" * 4096})
    with HeadCutAndItsListingUnanswered(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--no-model-prefetch",
                        "--metadata-ttl", "300") as m:
        proxy.cut_at, proxy.listing = "last-modified", listing
        assert (m.path / "m").is_dir()
        proxy.head_cuts = 1
        st = os.stat(m.path / "m" / "w.bin")  # the lookup: its HEAD cut before Last-Modified, then its listing
        assert proxy.head_cuts == 0 and proxy.listings >= 1
        assert st.st_size == 4096
        assert (m.path / "m" / "w.bin").read_bytes() == b"w" * 4096


class RecordedNoETags(NoETags):
    """`NoETags`, noting each request's headers."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, str]] = []

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        self.sent.extend(req.headers)
        return super()._forward(req, upstream)


@pytest.mark.parametrize("server", ["moto_server", "seaweed_server"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["create-only", "allow-overwrite"])
def test_a_file_the_server_gave_no_etag_is_renamed_whole(request: pytest.FixtureRequest, tmp_path: Path, server: str,
                                                         overwrite: bool) -> None:
    """Its version tag (size and Last-Modified, `store.version_tag`) is no ETag: a rename's copy and its DELETE of the
    old key went with it as their condition, which no server holds, and the old name stayed beside the new one ("another
    writer has stored a new m/a.bin since") (B75). Create-only renames copy in parts (UploadPartCopy), the others whole
    (CopyObject): neither sends its source condition empty either (botocore sends `CopySourceIfMatch=""` as an empty
    header, a condition no version matches) (B79)."""
    s3: S3Server = request.getfixturevalue(server)
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {"m/a.bin": b"weights"})
    extra = ("--allow-overwrite",) if overwrite else ()
    with RecordedNoETags(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, tmp_path / "mnt", "--writable", "--allow-delete", *extra) as m:
        os.rename(m.path / "m" / "a.bin", m.path / "m" / "b.bin")
        assert os.listdir(m.path / "m") == ["b.bin"]
        assert (m.path / "m" / "b.bin").read_bytes() == b"weights"
    listed = s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    assert [o["Key"] for o in listed] == ["m/b.bin"]
    assert not [(k, v) for k, v in proxy.sent if "no-etag" in v.lower()]
    assert [k for k, _v in proxy.sent if k.lower() == "x-amz-copy-source"]  # the rename was a server-side copy
    assert [(k, v) for k, v in proxy.sent if k.lower() == "x-amz-copy-source-if-match"] == []


class RefusesIfNoneMatch(FaultProxy):
    """A server that refuses a PUT or a completion sent with If-None-Match (501 NotImplemented, or a 400 of its own),
    as one without conditional writes may."""

    def __init__(self, upstream_url: str, status: int, code: str):
        super().__init__(upstream_url)
        self.refusal = error_response(status, code)

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.method in ("PUT", "POST") and req.header("if-none-match"):
            return send(conn, self.refusal, req), upstream
        return super()._handle(conn, req, upstream)


@pytest.mark.parametrize(("status", "code"), [(501, "NotImplemented"), (400, "InvalidArgument")])
def test_an_o_excl_file_is_stored_on_a_server_refusing_if_none_match_with_allow_overwrite(
        moto_server: S3Server, mountpoint: Path, status: int, code: str) -> None:
    """An O_EXCL file's store is create-only under --allow-overwrite too (B84); a server that refuses the header
    itself stored such files before it was sent, and still does: without it, with one warning."""
    bucket = new_bucket(moto_server)
    small, big = os.urandom(1000), os.urandom(12 * 1024 * 1024)
    with RefusesIfNoneMatch(moto_server.endpoint_url, status, code) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--allow-overwrite",
                        "--write-part-size", "5M", allowed=(r"refused it with If-None-Match",)) as m:
        for name, data in (("big", big), ("small", small)):  # the completion refused first, then the PUT goes plain
            fd = os.open(mountpoint / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
        assert m.log().count("refused it with If-None-Match") == 1
    client = moto_server.client()
    assert client.get_object(Bucket=bucket, Key="small")["Body"].read() == small
    assert client.get_object(Bucket=bucket, Key="big")["Body"].read() == big


@pytest.mark.parametrize(("status", "code"), [(501, "NotImplemented"), (400, "InvalidArgument")])
def test_a_server_refusing_if_none_match_without_allow_overwrite_is_named_with_what_to_do(
        moto_server: S3Server, mountpoint: Path, status: int, code: str) -> None:
    """Without --allow-overwrite every store is create-only; on a server that refuses If-None-Match itself every
    close got EIO, and each file's warning gave the server's error alone, nothing said why nor what to do. The stores
    stay create-only (nothing is replaced silently) and still fail, and one warning says that the server refused the
    condition and that --allow-overwrite stores without it."""
    bucket = new_bucket(moto_server)
    advice = "mount with --allow-overwrite"
    with RefusesIfNoneMatch(moto_server.endpoint_url, status, code) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--write-part-size", "5M",
                        allowed=(code, r"will not be stored")) as m:
        for name, size in (("big", 12 * 1024 * 1024), ("small", 1000), ("again", 10)):
            fd = os.open(mountpoint / name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, os.urandom(size))
            with pytest.raises(OSError) as info:
                os.close(fd)
            assert info.value.errno == errno.EIO
        log = m.log()
        assert log.count(advice) == 1, log
        assert f"refused a create-only store (If-None-Match: *) with {status} {code}" in log, log
    assert moto_server.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0


class RefusesIfMatch(FaultProxy):
    """A server that refuses a PUT or a completion sent with If-Match (501 NotImplemented, or a 400 of its own), as one
    without conditional writes may; a DELETE or GET with it goes through."""

    def __init__(self, upstream_url: str, status: int, code: str):
        super().__init__(upstream_url)
        self.refusal = error_response(status, code)
        self.refused = 0

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.method in ("PUT", "POST") and req.header("if-match"):
            self.refused += 1
            return send(conn, self.refusal, req), upstream
        return super()._handle(conn, req, upstream)


@pytest.mark.parametrize(("status", "code"), [(501, "NotImplemented"), (400, "InvalidArgument"),
                                            (412, "PreconditionFailed")])
def test_a_rewrite_that_keeps_its_version_is_stored_on_a_server_refusing_if_match(
        moto_server: S3Server, mountpoint: Path, status: int, code: str) -> None:
    """A rewrite that keeps the version it opened (an append to an empty file) is stored If-Match on that version
    (B308); a server that refuses the header itself stored such rewrites before it was sent, and still does: without
    it, with one warning for the mount. So does one that refuses the ETag it gives (412 while a HEAD says the key
    holds that version: weak ETags, seaweedfs#7274), where every such close was EIO (B308); that store alone, the
    next one sent with it again (B372)."""
    bucket = new_bucket(moto_server)
    put_objects(moto_server, bucket, {"big.log": b"", "small.log": b"", "again.log": b""})
    small, big = os.urandom(1000), os.urandom(12 * 1024 * 1024)
    with RefusesIfMatch(moto_server.endpoint_url, status, code) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--writable", "--allow-overwrite",
                        "--write-part-size", "5M", allowed=(r"refused a store with If-Match",)) as m:
        # The completion refused first, then the PUTs go plain.
        for name, data in (("big.log", big), ("small.log", small), ("again.log", small)):
            fd = os.open(mountpoint / name, os.O_WRONLY | os.O_APPEND)
            os.write(fd, data)
            os.close(fd)
        assert m.log().count("refused a store with If-Match") == 1
        # Its own ETag refused: each store is sent with it, and goes without it alone (B372).
        assert proxy.refused == (3 if status == 412 else 1)
    client = moto_server.client()
    assert client.get_object(Bucket=bucket, Key="big.log")["Body"].read() == big
    assert client.get_object(Bucket=bucket, Key="small.log")["Body"].read() == small
    assert client.get_object(Bucket=bucket, Key="again.log")["Body"].read() == small


class RefusesOneKey(FaultProxy):
    """A server that refuses every PUT of the key `refused` with a 400 of its own (as S3 refuses a key over 1024
    bytes: KeyTooLongError), with If-None-Match or without it; conditional writes it does honour."""

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.method == "PUT" and req.target.split("?", 1)[0].endswith("/refused"):
            return send(conn, error_response(400, "KeyTooLongError"), req), upstream
        return super()._handle(conn, req, upstream)


def test_a_create_only_store_refused_for_its_key_does_not_advise_allow_overwrite(
        moto_server: S3Server, mountpoint: Path) -> None:
    """Without --allow-overwrite every store is create-only, and the first refusal of one that was not the 412/409 of
    a key that exists logged that the server may not take If-None-Match and to mount with --allow-overwrite, also
    for a 400 that names the key (KeyTooLongError): advice that sent a user to replace other writers' files for
    nothing. Only a refusal that may be of the condition (501, a generic 400) tells it."""
    bucket = new_bucket(moto_server)
    with RefusesOneKey(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--writable",
                        allowed=(r"KeyTooLongError", r"will not be stored", r"allow-overwrite")) as m:
        fd = os.open(mountpoint / "refused", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"mine")
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.EIO
        with open(mountpoint / "kept", "wb") as f:  # the server takes If-None-Match: other files are stored
            f.write(b"kept")
        log = m.log()
        assert "KeyTooLongError" in log and "--allow-overwrite" not in log, log
    assert moto_server.client().get_object(Bucket=bucket, Key="kept")["Body"].read() == b"kept"


def test_a_store_refused_for_another_reason_keeps_o_excl_files_create_only(s3: S3Server, mountpoint: Path) -> None:
    """An O_EXCL file's store refused with a 400 that is not about If-None-Match (a key the server refuses) was taken
    for a server refusing the header: the log said so, and every O_EXCL file of the mount was stored without it from
    then on, replacing what another writer stored at its name meanwhile. The store is sent again without the header
    once; only where that succeeds is the header taken as refused."""
    bucket = new_bucket(s3)
    with RefusesOneKey(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, mountpoint, "--writable", "--allow-overwrite",
                        allowed=(r"KeyTooLongError", r"created meanwhile by another writer",
                                 r"will not be stored")) as m:
        fd = os.open(mountpoint / "refused", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"mine")
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.EIO
        fd = os.open(mountpoint / "lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"mine")
        put_objects(s3, bucket, {"lock": b"theirs"})
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.EIO
        assert "refused it with If-None-Match" not in m.log()
    assert s3.client().get_object(Bucket=bucket, Key="lock")["Body"].read() == b"theirs"


class SyntheticListingsToTheMillisecond(FaultProxy):
    """The proxy's synthetic directory answering its listings with a LastModified to the millisecond (`.500Z`), as
    MinIO and Ceph RGW do; its HEADs' Last-Modified is an HTTP date, to the second."""

    def _synthetic_response(self, req: Request) -> Response | None:
        resp = super()._synthetic_response(req)
        if resp is None or req.method != "GET" or b"<ListBucketResult" not in resp.body:
            return resp
        return dataclasses.replace(resp, body=resp.body.replace(b".000Z</LastModified>", b".500Z</LastModified>"))


def test_a_file_listed_to_the_millisecond_keeps_its_mtime_once_a_head_asks_again(moto_server: S3Server,
                                                                                  tmp_path: Path) -> None:
    """A listing gives LastModified to the millisecond on some servers, a HEAD's Last-Modified is to the second. A
    file's times came from whichever answered last: `ls -l` showed the listing's 00:00:00.500, a `stat` past the TTL
    (a HEAD) 00:00:00, and the next listing .500 again, so an inode's mtime stepped back and forth (to a tool that
    compares nanoseconds, such as `find -newer` or `make`, the file changed). Both answers give the second."""
    bucket = new_bucket(moto_server)
    # More names than RELIST_ENTRIES: a lookup past the TTL asks its name (a HEAD), not a new listing (B1200).
    padding = [f"pad{i:04d}" for i in range(RELIST_ENTRIES)]
    with SyntheticListingsToTheMillisecond(moto_server.endpoint_url) as proxy:
        proxy.serve_directory(bucket, "m/", ["a.bin", "b.bin", *padding], size=4096)
        with mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--metadata-ttl", "1",
                         "--no-model-prefetch") as m:
            listed = {entry.name: entry.stat().st_mtime_ns for entry in os.scandir(m.path / "m")
                      if entry.name.endswith(".bin")}
            time.sleep(1.5)
            before = len(proxy.log())
            asked = {name: os.stat(m.path / "m" / name).st_mtime_ns for name in listed}  # past the TTL: a HEAD each
            heads = {e.target.rsplit("/", 2)[-1] for e in proxy.log()[before:] if e.method == "HEAD"}
    assert {"a.bin", "b.bin"} <= heads, heads
    whole_second = 1_767_225_600 * 1_000_000_000  # 2026-01-01T00:00:00Z, the synthetic objects' time
    assert listed == asked == {"a.bin": whole_second, "b.bin": whole_second}


class SyntheticHeadsWithoutETags(FaultProxy):
    """The proxy's synthetic directory (keys of any bytes, which moto refuses) answering its HEADs without an ETag."""

    def _synthetic_response(self, req: Request) -> Response | None:
        resp = super()._synthetic_response(req)
        if resp is None or req.method != "HEAD":
            return resp
        return dataclasses.replace(resp, headers=[(k, v) for k, v in resp.headers if k.lower() != "etag"])


def test_a_control_character_key_whose_head_has_no_etag_is_found_by_its_listing(moto_server: S3Server,
                                                                                 tmp_path: Path) -> None:
    """A HEAD without an ETag is asked of a one-key listing (B150), which must carry keys XML 1.0 cannot (a control
    character): asked for raw keys, such a listing is no XML, and the file was EIO on a server whose HEADs lack an
    ETag. botocore asks with encoding-type=url by itself and decodes the keys (`Boto3Store._listed` relies on that):
    the file is found, with the listing's ETag, and read exactly."""
    bucket = new_bucket(moto_server)
    name = "a\x01b.bin"
    with SyntheticHeadsWithoutETags(moto_server.endpoint_url) as proxy:
        proxy.serve_directory(bucket, "m/", [name, "z.bin"], size=4096)
        with mounted_via(proxy, moto_server, bucket, tmp_path / "mnt", "--no-model-prefetch") as m:
            path = m.path / "m" / name
            assert os.stat(path).st_size == 4096  # by name: the HEAD, then its listing
            asked = [e.target for e in proxy.log() if "max-keys=1&" in e.target and "prefix=m%2Fa%01b" in e.target]
            assert asked and all("encoding-type=url" in target for target in asked), asked
            assert path.read_bytes() == synthetic_body(f"m/{name}".encode(), 4096)
