"""A server that gives one version's ETag weak (`W/"x"`) in one answer and strong (`"x"`) in another: one version,
as `store.changed_etag` already held, not two (a new inode, and its chunks fetched again, every TTL). A warm restart
finds such an object's chunks in its --cache-dir."""

from __future__ import annotations

import dataclasses
import http.client
import os
import re
import socket
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.http_wire import Request, Response, error_response, send
from tests.helpers import S3Server, mounted_via, new_bucket, put_objects
from tests.mount.test_server_quirks import read_as_one_version


class WeakETags(FaultProxy):
    """ETags made weak in listings (`weak="lists"`), or in the ETag header of HEADs and GETs (`weak="heads"`)."""

    def __init__(self, endpoint_url: str, weak: str) -> None:
        super().__init__(endpoint_url)
        self.weak = weak

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        resp, upstream = super()._forward(req, upstream)
        if self.weak == "lists" and req.kind == "lists":
            body = re.sub(rb"<ETag>(&quot;|&#34;|\")", rb"<ETag>W/\1", resp.body)
            assert body != resp.body or b"<ETag>" not in body, resp.body[:400]
            resp = dataclasses.replace(resp, body=body, content_length=None,
                                       headers=[(k, v) for k, v in resp.headers if k.lower() != "content-length"])
        elif self.weak == "heads" and req.kind in ("heads", "data_gets"):
            resp = dataclasses.replace(resp, headers=[(k, f"W/{v}" if k.lower() == "etag" else v)
                                                      for k, v in resp.headers])
        return resp, upstream


@pytest.mark.parametrize("server", ["moto_server", "seaweed_server"])
@pytest.mark.parametrize("weak", ["lists", "heads"], ids=["weak-listing", "weak-head"])
def test_a_version_listed_and_headed_weak_and_strong_is_one_version(request: pytest.FixtureRequest,
                                                                    mountpoint: Path, server: str,
                                                                    weak: str) -> None:
    s3: S3Server = request.getfixturevalue(server)
    bucket = new_bucket(s3)
    body = os.urandom(2 * 1024 * 1024 + 5)
    put_objects(s3, bucket, {"m/w.bin": body})
    with WeakETags(s3.endpoint_url, weak) as proxy, \
            mounted_via(proxy, s3, bucket, mountpoint, "--metadata-ttl", "1", "--no-model-prefetch"):
        read_as_one_version(proxy, mountpoint, body)


class OnlyWeakETags(WeakETags):
    """Weak ETags everywhere, and If-Match refused as RFC 9110's strong comparison refuses it for them (412)."""

    def __init__(self, endpoint_url: str) -> None:
        super().__init__(endpoint_url, "all")

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        self.weak = "lists" if req.kind == "lists" else "heads"
        return super()._forward(req, upstream)

    def _handle(self, conn: socket.socket, req: Request, upstream: http.client.HTTPConnection | None
                ) -> tuple[bool, http.client.HTTPConnection | None]:
        if req.method == "GET" and req.header("if-match"):
            return send(conn, error_response(412, "PreconditionFailed"), req), upstream
        return super()._handle(conn, req, upstream)


def test_a_server_giving_only_weak_etags_is_read_without_if_match(moto_server: S3Server, mountpoint: Path) -> None:
    """If-Match goes out in the strong form, which such a server refuses: read as B66 reads a server refusing its own
    ETags, one version throughout."""
    bucket = new_bucket(moto_server)
    body = os.urandom(2 * 1024 * 1024 + 5)
    put_objects(moto_server, bucket, {"m/w.bin": body})
    with OnlyWeakETags(moto_server.endpoint_url) as proxy, \
            mounted_via(proxy, moto_server, bucket, mountpoint, "--metadata-ttl", "1", "--no-model-prefetch",
                        allowed=(r"refuses If-Match",)):
        path = mountpoint / "m" / "w.bin"
        listed = {e.name: e.inode() for e in os.scandir(mountpoint / "m")}
        assert path.read_bytes() == body
        assert listed["w.bin"] == os.stat(path).st_ino


@pytest.mark.parametrize("weak", ["lists", "heads", "all"], ids=["weak-listing", "weak-head", "only-weak"])
def test_a_warm_restart_reads_the_chunks_of_an_object_with_weak_etags_from_the_cache_dir(
        moto_server: S3Server, mountpoint: Path, tmp_path: Path, weak: str) -> None:
    """Chunks are keyed by the strong form (B81), so a restarted mount finds them in its --cache-dir: no data GET,
    also where it learnt the version in the other form (weak in the listing before, strong now, or the reverse: each
    would key its chunks by the form it saw). (Only chunks a version before B81 stored under the weak form are
    fetched once more.)"""
    bucket = new_bucket(moto_server)
    body = os.urandom(3 * 1024 * 1024 + 5)
    put_objects(moto_server, bucket, {"m/w.bin": body})
    args = ("--cache-dir", str(tmp_path / "cache"), "--chunk-size", "1M", "--no-model-prefetch")
    for restart in (False, True):
        form = {"lists": "heads", "heads": "lists"}.get(weak, weak) if restart else weak
        proxy = OnlyWeakETags(moto_server.endpoint_url) if form == "all" else WeakETags(moto_server.endpoint_url, form)
        with proxy, mounted_via(proxy, moto_server, bucket, mountpoint, *args, allowed=(r"refuses If-Match",)):
            assert (mountpoint / "m" / "w.bin").read_bytes() == body
            gets = proxy.counts().get("data_gets", 0)  # (the first mount's: 4, and those refused If-Match)
            assert (gets == 0) if restart else (gets >= 4), proxy.counts()
