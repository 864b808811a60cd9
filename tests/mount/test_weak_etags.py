"""A server that gives one version's ETag weak (`W/"x"`) in one answer and strong (`"x"`) in another: one version,
as `store.changed_etag` already held, not two (a new inode, and its chunks fetched again, every TTL)."""

from __future__ import annotations

import dataclasses
import http.client
import os
import re
import time
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.http_wire import Request, Response
from tests.helpers import S3Server, drop_page_cache, mounted_via, new_bucket, put_objects


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
