"""Security: what a hostile or careless S3 endpoint can get out of the daemon, and what other users of the node can.

The endpoint may be a third-party service: its answers may echo the request (a presigned URL's signature, its
credential scope, a session token) in an error's message or a redirect's Location, which the daemon must not log or
show in `modelfs stats` (the log file or syslog is often readable by every user of the node; a signature reads the
object for 20 minutes). Each hostile answer comes from a FaultProxy subclass in front of moto that replaces the answers
to data GETs."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.http_wire import Response, xml_escape
from tests.helpers import TEST_KEY, S3Server, bucket_with, mount_stats, mounted_via

DATA = os.urandom(1 << 20)


class Echoes(FaultProxy):
    """Answers each data GET with `status`: a 400 whose error Message quotes the request's target (the presigned URL's
    query, unquoted), or a 307 whose Location is the same URL on another host. `signatures`: those it was sent."""

    status = 400
    signatures: list[str]

    def _forward(self, req: Any, upstream: Any) -> Any:
        if not req.is_data_get:
            return super()._forward(req, upstream)
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(req.target).query)
        self.signatures.extend(query.get("X-Amz-Signature", ()))
        if self.status == 307:
            return Response(307, "Temporary Redirect", [("Location", f"http://127.0.0.2:1{req.target}")], b""), upstream
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidArgument</Code>'
                f"<Message>{xml_escape(urllib.parse.unquote(req.target))}</Message></Error>").encode()
        return Response(400, "Bad Request", [("Content-Type", "application/xml")], body), upstream


@pytest.mark.parametrize("status", [400, 307])
def test_a_server_echoing_the_presigned_url_gets_no_signature_into_the_log_or_stats(
        moto_server: S3Server, mountpoint: Path, status: int) -> None:
    """A 400 whose message quotes the request, and a 307 to another host: the read fails EIO, and neither the debug
    log nor `modelfs stats` holds the URL's signature or its credential (B1220: the log had both, whole)."""
    bucket = bucket_with(moto_server, {"a.bin": DATA})
    with Echoes(moto_server.endpoint_url) as proxy:
        proxy.status, proxy.signatures = status, []
        with mounted_via(proxy, moto_server, bucket, mountpoint, "--read-timeout", "5",
                         allowed=(r"fetching chunk \d+ of 'a.bin' failed",)) as m:
            with pytest.raises(OSError) as failed:
                (mountpoint / "a.bin").read_bytes()
            stats = json.dumps(mount_stats(mountpoint))
        log = m.log()
    assert failed.value.errno == errno.EIO
    assert proxy.signatures, "the proxy saw no presigned GET"
    said = "InvalidArgument" if status == 400 else "307 Temporary Redirect"
    assert said in log  # the failure is still told
    for text in (log, stats):
        assert not any(signature[:16] in text for signature in proxy.signatures)
        assert f"{TEST_KEY}/" not in text and f"{TEST_KEY}%2F" not in text


class Oversized(FaultProxy):
    """Says `size` for the objects named huge*.bin: in a listing's <Size>, and in a HEAD's Content-Length."""

    size = 1 << 63

    def _forward(self, req: Any, upstream: Any) -> Any:
        resp, upstream = super()._forward(req, upstream)
        if req.kind == "heads" and re.search(r"/huge[^/?]*\.bin(\?|$)", req.target):
            resp = dataclasses.replace(resp, content_length=self.size)
        elif req.kind == "lists":
            body = re.sub(rb"(<Key>[^<]*huge[^<]*\.bin</Key>.*?<Size>)\d+(</Size>)",
                          rb"\g<1>" + str(self.size).encode() + rb"\g<2>", resp.body, flags=re.DOTALL)
            resp = dataclasses.replace(resp, body=body)
        return resp, upstream


@pytest.mark.parametrize("size", [1 << 63, 1 << 64, -1])
def test_an_object_of_a_size_no_file_can_have_fails_alone_and_says_why(
        moto_server: S3Server, mountpoint: Path, size: int) -> None:
    """A listing or a HEAD saying 2^63 bytes or more (or fewer than none) for one object: the listing of its whole
    directory was EIO and every lookup of the object "failed unexpectedly" with a traceback (pyfuse3's OverflowError
    on st_size, B1221). Now its neighbours are listed and read as before, and the object alone fails: its HEAD's
    lookup EIO, and left out of its directory's listing (ENOENT after it), a warning saying what the server said."""
    bucket = bucket_with(moto_server, {"d/ok.bin": DATA, "d/huge.bin": b"x" * 10, "d/huge2.bin": b"y"})
    said = rf"the server says its size is {size} bytes, which no file can have"
    with Oversized(moto_server.endpoint_url) as proxy:
        proxy.size = size
        with mounted_via(proxy, moto_server, bucket, mountpoint, allowed=(said,)) as m:
            with pytest.raises(OSError) as failed:  # looked up first: its HEAD
                os.stat(mountpoint / "d/huge.bin")
            assert failed.value.errno == errno.EIO
            assert sorted(os.listdir(mountpoint / "d")) == ["ok.bin"]
            assert (mountpoint / "d/ok.bin").read_bytes() == DATA
            for name in ("huge.bin", "huge2.bin"):
                with pytest.raises(OSError) as failed:
                    os.stat(mountpoint / "d" / name)
                assert failed.value.errno == errno.ENOENT  # left out of the listing, as a key that cannot be named
    assert said in m.log() and "unexpectedly" not in m.log()
