"""Security: what a hostile or careless S3 endpoint can get out of the daemon, and what other users of the node can.

The endpoint may be a third-party service: its answers may echo the request (a presigned URL's signature, its
credential scope, a session token) in an error's message or a redirect's Location, which the daemon must not log or
show in `modelfs stats` (the log file or syslog is often readable by every user of the node; a signature reads the
object for 20 minutes). Each hostile answer comes from a FaultProxy subclass in front of moto that replaces the answers
to data GETs."""

from __future__ import annotations

import errno
import json
import os
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
