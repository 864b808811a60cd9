"""The bytes of a ranged GET: a presigned URL per object, read with http.client on kept-alive
connections straight into the caller's buffer.

boto3 stays the control plane: it signs the URL, so credentials (environment, profile, instance role,
--no-sign-request), the addressing style (OSS virtual hosts) and the endpoint are exactly boto3's. What
this module saves is botocore's per-request machinery and the fresh bytes object per body: a 1.63 GB
read cost 0.18-0.19 CPU-s/GB this way against 0.25-0.28 with `get_object().read()` (issue #10's
measurements; bench/clients.py), and reading into a recycled buffer takes no page faults.

One call is one request; it retries nothing and checks what it got (status, Content-Range, length,
ETag). Retries, backoff and the choice of this path over boto3's belong to `Boto3Store.get_range`.
Failures leave as `StoreError`s through the store's one mapping (`store.error_for_status`).

Threading: `RangeGetter` is shared by every fetch thread. Its connection pool (a list under a lock)
holds idle connections only; a connection is used by one thread at a time and goes back only after
its response was read whole, so a broken or half-read one is closed, never reused. The URL cache is a
dict under the same lock (an entry is replaced whole, never mutated).
"""

from __future__ import annotations

import http.client
import re
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable

from fsmount.data.identity import WritableBuffer
from fsmount.data.store import (
    AccessDenied,
    PreconditionFailed,
    TransientError,
    Unreachable,
    error_for_status,
)

# A URL is signed for this long and reused for half of it: a presign is ~0.1 ms, so signing rarely only
# saves a little, but a URL signed with temporary credentials must not outlive them (botocore refreshes
# those at least 10 minutes before they expire); a 403 on a reused URL signs a new one and tries again.
URL_EXPIRES_S = 1200
URL_REUSE_S = 600
# The most of an error body read to find its S3 error code (an XML document of a few hundred bytes).
ERROR_BODY_MAX = 64 * 1024
_CODE_RE = re.compile(rb"<Code>([^<]{1,128})</Code>")


def proxied(url: str) -> bool:
    """Whether the environment routes `url` through a proxy (HTTP(S)_PROXY, not bypassed by NO_PROXY):
    http.client would not, so such a mount keeps boto3's data path."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname or "")


class RangeGetter:
    """Ranged GETs of presigned URLs into caller buffers. Thread-safe (see the module's rules)."""

    def __init__(self, presign: Callable[[str], str], *, bucket: str, pool_size: int, connect_timeout: float,
                 read_timeout: float, ssl_context: ssl.SSLContext | None = None):
        """`presign(key)` returns a signed GET URL of the key, valid for URL_EXPIRES_S."""
        self._presign = presign
        self.bucket = bucket
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl_context = ssl_context if ssl_context is not None else ssl.create_default_context()
        self._lock = threading.Lock()
        self._idle: list[tuple[tuple[str, str, int], http.client.HTTPConnection]] = []
        self._urls: dict[str, tuple[float, str]] = {}

    # -- URLs ------------------------------------------------------------------------------------

    def _url(self, key: str, fresh: bool) -> str:
        now = time.monotonic()
        with self._lock:
            cached = None if fresh else self._urls.get(key)
        if cached is not None and now - cached[0] < URL_REUSE_S:
            return cached[1]
        url = self._presign(key)
        with self._lock:
            if len(self._urls) > 4096:  # many objects opened once: forget the old ones
                self._urls.clear()
            self._urls[key] = (now, url)
        return url

    # -- connections -----------------------------------------------------------------------------

    def _connection(self, origin: tuple[str, str, int]) -> http.client.HTTPConnection:
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] == origin:
                    return self._idle.pop(i)[1]
        scheme, host, port = origin
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=self._connect_timeout,
                                               context=self._ssl_context)
        return http.client.HTTPConnection(host, port, timeout=self._connect_timeout)

    def _give_back(self, origin: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self._pool_size:
                self._idle.append((origin, conn))
                return
        conn.close()

    # -- one GET ---------------------------------------------------------------------------------

    def get_into(self, key: str, etag: str, start: int, buffer: WritableBuffer | bytearray, what: str) -> None:
        """Fill `buffer` with bytes [start, start + len(buffer)) of the object version `etag`, or raise."""
        try:
            self._get(key, etag, start, buffer, what, fresh_url=False)
        except AccessDenied:
            # A reused URL may have been signed with credentials rotated since: sign again, once.
            self._get(key, etag, start, buffer, what, fresh_url=True)

    def _get(self, key: str, etag: str, start: int, buffer: WritableBuffer | bytearray, what: str,
             fresh_url: bool) -> None:
        url = urllib.parse.urlsplit(self._url(key, fresh_url))
        origin = (url.scheme, url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
        target = url.path + ("?" + url.query if url.query else "")
        want = len(buffer)
        headers = {"Range": f"bytes={start}-{start + want - 1}", "Accept-Encoding": "identity"}
        if etag:
            headers["If-Match"] = etag
        conn = self._connection(origin)
        kept_alive = conn.sock is not None
        reusable = False
        try:
            try:
                resp = self._send(conn, target, headers, origin)
            except (http.client.RemoteDisconnected, ConnectionError) as exc:
                if not kept_alive:
                    raise TransientError(f"{what}: {type(exc).__name__}: {exc}") from None
                # The server closed the idle connection meanwhile (an idle timeout): a new one, at once.
                conn.close()
                resp = self._send(conn, target, headers, origin)
            reusable = self._read(resp, start, want, etag, buffer, what)
        except (http.client.HTTPException, OSError) as exc:
            # Reset, timeout, a response cut short or not HTTP at all: worth another try.
            raise TransientError(f"{what}: {type(exc).__name__}: {exc}") from None
        finally:
            if reusable:
                self._give_back(origin, conn)
            else:
                conn.close()

    def _send(self, conn: http.client.HTTPConnection, target: str, headers: dict[str, str],
              origin: tuple[str, str, int]) -> http.client.HTTPResponse:
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as exc:
                raise Unreachable(f"cannot reach the endpoint {origin[1]}:{origin[2]}: {exc}") from None
            conn.sock.settimeout(self._read_timeout)
        conn.request("GET", target, headers=headers)
        return conn.getresponse()

    def _read(self, resp: http.client.HTTPResponse, start: int, want: int, etag: str,
              buffer: WritableBuffer | bytearray, what: str) -> bool:
        """Check the response and read its body into `buffer`; True if the connection may be reused."""
        if resp.status >= 300:
            body = resp.read(ERROR_BODY_MAX)
            match = _CODE_RE.search(body)
            code = match.group(1).decode("utf-8", "replace") if match else ""
            raise error_for_status(code, resp.status, self.bucket, what)
        length = resp.getheader("Content-Length")
        content_range = resp.getheader("Content-Range")
        if resp.status == 206:
            if not content_range or not content_range.startswith(f"bytes {start}-{start + want - 1}/"):
                raise TransientError(f"{what}: server answered with {content_range!r}")
        elif not (resp.status == 200 and start == 0 and length == str(want)):
            # A 200 is the whole object: right only if that is exactly the range asked for.
            raise TransientError(f"{what}: server answered {resp.status} without the range")
        if length is not None and length != str(want):
            raise TransientError(f"{what}: server sends {length} bytes, {want} asked for")
        got_etag = resp.getheader("ETag")
        if etag and got_etag and got_etag != etag:
            raise PreconditionFailed(f"{what}: object changed in the bucket since it was opened")
        with memoryview(buffer) as view:
            got = 0
            while got < want:
                n = resp.readinto(view[got:])
                if not n:
                    raise TransientError(f"{what}: short body, {got} of {want} bytes")
                got += n
        # Nothing may follow the body on a connection we keep (a server sending more is not trusted).
        return not resp.will_close and resp.read(1) == b""

