"""The bytes of a ranged GET: a presigned URL per object, read with http.client on kept-alive
connections straight into the caller's buffer. The shared tier's whole-object GETs (`open`) and chunk
PUTs (`put`, the parts sent from the caller's buffers) take the same path.

boto3 stays the control plane: it signs the URL, so credentials (environment, profile, instance role,
--no-sign-request), the addressing style (OSS virtual hosts) and the endpoint are exactly boto3's. What
this module saves is botocore's per-request machinery and the fresh bytes object per body: a 1.63 GB
read cost 0.18-0.19 CPU-s/GB this way against 0.25-0.28 with `get_object().read()` (issue #10's
measurements; bench/clients.py), and reading into a recycled buffer takes no page faults.

One call is one request; it retries nothing and checks what it got (status, Content-Range and its total against the
size the version was pinned at, length, ETag). A request ends by the read timeout after it began, its connect, its
head and its body all counted, not per packet only (`_Deadline`). A new connection is opened by the connect timeout
or the time left, whichever is less, as a whole: its name's lookup (DNS, in a thread of its own that is waited for
no longer: `_Resolver`), every address tried and TLS's handshake (`_Connection.open`); Unreachable where it was not
done in that time, TimedOut only where it was opened again (a kept connection found closed) and the request's time ran
out first. A kept-alive connection costs none of it. Retries, backoff
and the choice of this path over boto3's belong to `Boto3Store`. Failures leave as `StoreError`s through the store's
one mapping (`store.error_for_status`).

Threading: `RangeGetter` is shared by every fetch thread. Its connection pool (a list under a lock)
holds idle connections only; a connection is used by one thread at a time and goes back only after
its response was read whole, so a broken or half-read one is closed, never reused. The URL cache is a
dict under the same lock (an entry is replaced whole, never mutated). A name's lookup runs in a daemon thread, one
at a time per name and port (`_Resolver`, under a lock of its own): one stuck in the system's resolver is left to end.
"""

from __future__ import annotations

import errno
import http.client
import re
import socket
import ssl
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fsmount.data.identity import WritableBuffer
from fsmount.data.store import (
    LOCAL_ERRNOS,
    AccessDenied,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
    changed_etag,
    error_for_status,
    local_failure,
    server_age_s,
    size_changed,
)

# A URL is signed for this long and reused for half of it: a presign is ~0.1 ms, so signing rarely only
# saves a little, but a URL signed with temporary credentials must not outlive them (botocore refreshes
# those at least 10 minutes before they expire); a 403 on a URL signed with other credentials than those there are
# now signs a new one and tries again (`RangeGetter._signed_again`). Its age is counted on CLOCK_BOOTTIME, which goes
# on while the machine is suspended (CLOCK_MONOTONIC does not), and on the wall clock, which its X-Amz-Date is read
# by: a VM its hypervisor paused counts the pause on neither of the others (B132). A URL kept over a suspend or a
# pause of an hour was expired, and the same credentials' refusal is not sent again.
URL_EXPIRES_S = 1200
URL_REUSE_S = 600
# Nor is a URL reused within this many seconds of the expiry of the session credentials it was signed with (a server
# refuses it past their Expiration, ExpiredToken, whatever its X-Amz-Expires): botocore refreshes them before it, but
# a URL cached meanwhile still names the old ones. One minute of room for a server's clock ahead of ours.
CREDENTIALS_ROOM_S = 60.0


def since_boot() -> float:
    """Seconds on the clock a URL's age is counted on (suspended time included); the wall clock too (`_reusable`)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _reusable(signed: tuple[float, float], now: tuple[float, float]) -> bool:
    """Whether a URL signed at `signed` (`since_boot()`, `time.time()`) may be sent at `now`: younger than URL_REUSE_S
    on both clocks. A VM paused by its hypervisor (a saved state restored, a laptop's host asleep) counts the pause
    on no clock of its own but the wall clock, set right at its resume; a wall clock set back means the URL's
    X-Amz-Date was ahead of the time."""
    return all(0 <= b - a < URL_REUSE_S for a, b in zip(signed, now, strict=True))


# The most of an error body read to find its S3 error code (an XML document of a few hundred bytes).
ERROR_BODY_MAX = 64 * 1024
_CODE_RE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_MESSAGE_RE = re.compile(rb"<Message>([^<]{1,1024})</Message>")
_REGION_RE = re.compile(rb"<Region>([a-z0-9-]{1,64})</Region>")


class WrongRegion(StoreError):
    """The bucket answered that it is in another region than the URL was signed for (S3's 301 PermanentRedirect,
    or a 400 naming the region expected): `region` is the bucket's."""

    def __init__(self, message: str, region: str):
        super().__init__(message)
        self.region = region
        self.signed_for: str | None = None  # the region of the URL refused, where it says (RangeGetter._error)


_SCOPE_RE = re.compile(r"Credential=[^/,&]+/\d{8}/([a-z0-9-]+)/")


def signed_region(text: str) -> str | None:
    """The region a SigV4 signature is scoped to: of a presigned URL (its X-Amz-Credential, percent-encoded or not)
    or an Authorization header. None if it has none."""
    found = _SCOPE_RE.search(urllib.parse.unquote(text))
    return found.group(1) if found else None


def signed_by(url: str) -> tuple[str, str, str]:
    """The credentials a presigned URL is signed with, as it names them: its access key id (SigV4's X-Amz-Credential
    less its scope, SigV2's AWSAccessKeyId) and session token; empty strings for a URL not signed."""
    query = {name.lower(): values[-1] for name, values in
             urllib.parse.parse_qs(urllib.parse.urlsplit(url).query, keep_blank_values=True).items()}
    return (query.get("x-amz-credential", "").split("/", 1)[0], query.get("awsaccesskeyid", ""),
            query.get("x-amz-security-token", ""))


# A body longer than twice this is received with the socket's receive low-water mark (SO_RCVLOWAT) at this
# many bytes, up to its last this-many bytes: a fetch thread then wakes once per MiB that arrived instead of
# once per burst of segments (~180 KB on loopback). 16 threads of 8 MiB GETs of 1 GiB from SeaweedFS on
# the pinned bed, 8 paired rounds: 0.22 against 0.28 CPU-s and 1.1k against 6.0k voluntary context switches
# (512 KiB and 2 MiB read the same as 1 MiB). The last bytes are read at the default mark (1) again, so a
# body's end never waits for bytes that will not come and a kept connection goes back as it was. A GET must
# then receive a MiB, not any byte, within the read timeout (120 s by default: 9 KB/s).
RECEIVE_LOWAT = 1 << 20

T = TypeVar("T")


def _set_lowat(sock: socket.socket, nbytes: int) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
    except OSError:
        return False
    return True


def _receive(sock: socket.socket | None, view: memoryview, read_some: Callable[[memoryview], int],
             short: Callable[[int], Exception]) -> None:
    """Fill `view` by calls of `read_some(the rest of it)`, each returning the bytes it read; `short(got)` is
    raised when one reads none. A view longer than twice RECEIVE_LOWAT is received with the low-water mark
    raised until its last RECEIVE_LOWAT bytes (see there)."""
    want = len(view)
    raised = sock is not None and want > 2 * RECEIVE_LOWAT and _set_lowat(sock, RECEIVE_LOWAT)
    got = 0
    for stop in (want - RECEIVE_LOWAT, want) if raised else (want,):
        if raised and stop == want and sock is not None:
            _set_lowat(sock, 1)
        while got < stop:
            n = read_some(view[got:stop])
            if not n:
                raise short(got)
            got += n


def _transport_error(what: str, exc: BaseException) -> TransientError:
    """A request cut short on the way (reset, refused mid-way, not HTTP): worth another try. TimedOut where nothing
    came in time, which callers may tell apart from an answer (the shared tier: a DELETE then waits as long)."""
    words = f"{what}: {type(exc).__name__}: {exc}"
    return TimedOut(words) if isinstance(exc, TimeoutError) else TransientError(words)


def proxied(url: str) -> bool:
    """Whether the environment routes `url` through a proxy (HTTP(S)_PROXY, not bypassed by NO_PROXY):
    http.client would not, so such a mount keeps boto3's data path."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in urllib.request.getproxies():
        return False
    try:  # host and port, as botocore tests NO_PROXY: the two paths must agree on what goes through the proxy
        return not urllib.request.proxy_bypass(parts.netloc)
    except (TypeError, socket.gaierror):
        return True


class RangeGetter:
    """Ranged GETs of presigned URLs into caller buffers. Thread-safe (see the module's rules)."""

    def __init__(self, presign: Callable[[str], str], *, bucket: str, pool_size: int, connect_timeout: float,
                 read_timeout: float, ssl_context: ssl.SSLContext | None = None,
                 presign_put: Callable[[str], str] | None = None, presign_delete: Callable[[str], str] | None = None,
                 on_wrong_region: Callable[[str], object] | None = None,
                 on_refused: Callable[[str], object] | None = None,
                 on_refused_again: Callable[[str], object] | None = None,
                 credentials_changes: Callable[[], int] | None = None,
                 credentials_expiry: Callable[[], float | None] | None = None):
        """`presign(key)` returns a signed GET URL of the key, valid for URL_EXPIRES_S; `presign_put(key)` a
        signed PUT URL (for `put`), `presign_delete(key)` a signed DELETE URL (for `delete`).
        `on_wrong_region(region)`, if given, is told the bucket's region when a GET signed for another one is
        refused; `presign` signs for it from then on, and the GET is sent again once. `on_refused(code)`, if
        given, is told the error code of a request refused for its credentials before it is signed again (it may
        look them up again, `credentials.Renewable.renew`: True if they changed; see `_signed_again`);
        `on_refused_again(code)` is told the code of that request's second refusal if `on_refused` returned True
        (they changed, and are refused still). `credentials_changes()`, if given, counts the renewals that changed
        the credentials (`credentials.Renewable.changes`): a URL cached before one is signed anew, not reused.
        `credentials_expiry()`, if given, says when the credentials a URL signed now is signed with expire
        (`time.time()`; None: they do not, `credentials.Renewable.expiry`): such a URL is not reused past it, less
        CREDENTIALS_ROOM_S."""
        self._presign = presign
        self._on_refused = on_refused
        self._on_refused_again = on_refused_again
        self._changes = credentials_changes or (lambda: 0)
        self._expiry = credentials_expiry or (lambda: None)
        self._on_wrong_region = on_wrong_region
        self._presign_put = presign_put
        self._presign_delete = presign_delete
        self.bucket = bucket
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl_context = ssl_context if ssl_context is not None else ssl.create_default_context()
        self._resolve = _Resolver()
        self._lock = threading.Lock()
        self._idle: list[tuple[tuple[str, str, int], _Connection]] = []
        # key: (when signed, `_reusable`), `credentials_changes()` then, reused until (time.time(): the expiry of the
        # credentials signed with, less CREDENTIALS_ROOM_S), URL
        self._urls: dict[str, tuple[tuple[float, float], int, float, str]] = {}

    # -- URLs ------------------------------------------------------------------------------------

    def _url(self, key: str, fresh: bool) -> str:
        now, changes = (since_boot(), time.time()), self._changes()
        with self._lock:
            cached = None if fresh else self._urls.get(key)
        # Signed before a renewal changed the credentials: a key id kept with a new secret (MinIO's and Ceph's users
        # rotate so) names nothing new in a URL signed now, so its refusal would not be sent again (B133).
        # Nor one signed with session credentials near their expiry: botocore refreshes them before it, but the
        # URL names the old ones, refused past it (ExpiredToken: a second request, a lookup, a "have changed" warning).
        if cached is not None and cached[1] == changes and _reusable(cached[0], now) and now[1] < cached[2]:
            return cached[3]
        # Asked before signing and after: the sooner counts (credentials refreshed meanwhile expire later; those not
        # fetched before the first signing say nothing until then).
        before = self._expiry()
        url = self._presign(key)
        said = [t for t in (before, self._expiry()) if t is not None]
        until = min(said) - CREDENTIALS_ROOM_S if said else float("inf")
        with self._lock:
            if len(self._urls) > 4096:  # many objects opened once: forget the old ones
                self._urls.clear()
            self._urls[key] = (now, changes, until, url)
        return url

    # -- connections -----------------------------------------------------------------------------

    def _connection(self, origin: tuple[str, str, int]) -> _Connection:
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] == origin:
                    return self._idle.pop(i)[1]
        scheme, host, port = origin
        if scheme == "https":
            return _TLSConnection(host, port, timeout=self._connect_timeout, context=self._ssl_context)
        return _Connection(host, port, timeout=self._connect_timeout)

    def _give_back(self, origin: tuple[str, str, int], conn: _Connection) -> None:
        if conn.bounded is not None:
            conn.bounded.restore(self._read_timeout)  # as the next request on it expects it
        with self._lock:
            if len(self._idle) < self._pool_size:
                self._idle.append((origin, conn))
                return
        conn.close()

    # -- one GET ---------------------------------------------------------------------------------

    def get_into(self, key: str, etag: str, start: int, buffer: WritableBuffer | bytearray, what: str, *,
                 if_match: bool = True, size: int | None = None) -> None:
        """Fill `buffer` with bytes [start, start + len(buffer)) of the object version `etag`, or raise. Without
        `if_match` (a server that refuses its own ETags there) the version is checked by the answer's ETag alone,
        which must then be there. `size`: the object size the version was pinned at, which the answer's total must be
        (SizeChanged); None: not checked."""
        self._signed_again(lambda fresh: self._url(key, fresh),
                           lambda url: self._get(key, etag, start, buffer, what, url, if_match=if_match, size=size))

    def _signed_again(self, sign: Callable[[bool], str], send: Callable[[str], T]) -> T:
        """`send(url)`: one request to `url`, which `sign(fresh)` gives: a URL reused (False) or signed now (True).
        Sent again once, signed anew, when refused for a URL signed with credentials rotated since (AccessDenied: the
        credentials a lookup finds, `on_refused`, or a URL signed now, are others than the refused one's), or for
        another region than the bucket's (WrongRegion, whose `signed_for` the request set). A refusal of a URL signed
        with the credentials there are is not sent again: a bucket policy's refusal cost every read a second GET (and
        a lookup, `on_refused`, until `credentials.Renewable.refused_again` found it the bucket's own). Signed for the
        region the AWS configuration said while the bucket is elsewhere: botocore follows such redirects for
        listings, so the mount listed and every read (and every write of a shared tier) failed. URLs are signed for
        the bucket's region from then on, unless the refused one was signed for it already (the endpoint is another
        region's: --endpoint-url). Requests in flight when another switched get their second try too. A URL refused
        as expired ("Request has expired") is sent again signed now whatever its credentials, and without a lookup: a
        server whose clock is ahead of ours by more than URL_EXPIRES_S - URL_REUSE_S finds a URL reused near the end
        of URL_REUSE_S past its expiry (B136, B137); one signed now and refused for its credentials is then a refusal
        as above (at most three requests). A URL refused as not valid yet (our clock ahead of the server's by more
        than it allows) is raised at once: a URL signed now bears the same clock's time, and a lookup of credentials
        (a process run, an STS call, and with a source minting keys at each one a "have changed" warning and every
        cached URL dropped) would follow every read for nothing (B175)."""
        url = sign(False)
        try:
            return send(url)
        except AccessDenied as exc:
            refused = exc
        except WrongRegion as exc:
            if self._on_wrong_region is None or exc.signed_for == exc.region:
                raise
            self._on_wrong_region(exc.region)
            with self._lock:
                self._urls.clear()  # every URL signed so far is for the old region
            return send(sign(True))
        if refused.not_yet_valid:
            raise refused
        if refused.expired:
            # The URL's age was refused, not its credentials: signed now, nothing looked up. A lookup there ran a
            # process or an STS call, a source minting keys at each one warned "have changed", and a URL signed now
            # refused as expired too was told to `on_refused_again` as a bucket policy's refusal (B137).
            url = sign(True)
            try:
                return send(url)
            except AccessDenied as again:
                if again.expired or again.not_yet_valid:
                    raise
                refused = again  # refused for its credentials after all (a key rotated too): as any refusal
        renewed = self._on_refused is not None and self._on_refused(refused.code or "403")
        fresh = sign(True)
        if not renewed and signed_by(fresh) == signed_by(url):
            raise refused  # the credentials there are were refused: the same refusal again, at the cost of a request
        try:
            return send(fresh)
        except AccessDenied as again:
            # Refused for the clock (not valid yet, expired): not the new credentials' refusal by a policy.
            if renewed and self._on_refused_again is not None and not (again.not_yet_valid or again.expired):
                self._on_refused_again(again.code or "403")
            raise

    def _get(self, key: str, etag: str, start: int, buffer: WritableBuffer | bytearray, what: str, url: str,
             if_match: bool = True, size: int | None = None) -> None:
        want = len(buffer)
        headers = {"Range": f"bytes={start}-{start + want - 1}", "Accept-Encoding": "identity"}
        if etag and if_match:
            headers["If-Match"] = etag
        # The request ends by the read timeout after it began (B365; its head and connect too): a body or a head sent a
        # few bytes at a time, each in time, held its fetch thread as long as the server went on, and with them all
        # held, READs of chunks the origin served well failed. Cut, it is a timeout the store tries again, as a
        # stalled body is.
        origin, conn, resp = self._request(url, headers, what)
        reusable = False
        try:
            reusable = self._read(resp, conn.sock, start, want, etag, buffer, what, url, etag_needed=not if_match,
                                  size=size)
        except (http.client.HTTPException, OSError) as exc:
            # Reset, timeout, a response cut short: worth another try.
            raise _transport_error(what, exc) from None
        finally:
            if reusable:
                self._give_back(origin, conn)
            else:
                conn.close()

    def open(self, key: str, what: str) -> Body:
        """A GET of the whole object (the current version), its body left to read: for objects whose
        length is not known beforehand (the shared tier's chunk objects). Failures, a missing key
        included (NotFound), are raised as StoreErrors; nothing is retried but a stale kept-alive
        connection and a URL refused as `_signed_again` says. The body is read by the read timeout after the
        request began, or not at all (TimedOut, as for a packet that did not come: `Body`)."""
        return self._signed_again(lambda fresh: self._url(key, fresh), lambda url: self._open(url, what))

    def _open(self, url: str, what: str) -> Body:
        origin, conn, resp = self._request(url, {"Accept-Encoding": "identity"}, what)
        try:
            if resp.status >= 300:
                raise self._error(resp, what, url)
            length = resp.getheader("Content-Length")
            if resp.status != 200 or length is None or not length.isdigit():
                raise TransientError(f"{what}: server answered {resp.status} with length {length!r}")
        except (http.client.HTTPException, OSError) as exc:
            conn.close()
            raise _transport_error(what, exc) from None
        except BaseException:
            self._release(origin, conn, resp)  # an error document read whole leaves the connection fit
            raise
        return Body(self, origin, conn, resp, int(length), what)

    def put(self, key: str, parts: Sequence[bytes | WritableBuffer], what: str, *,
            only_if_absent: bool = False) -> bool:
        """Store `parts`, joined, as the object `key` (one PUT; each part is sent as it is, not copied into
        one body); with `only_if_absent` (If-None-Match: *, an unsigned header the URL allows) False if the
        key exists (412, or 409 for a concurrent conditional write). Failures are raised as StoreErrors;
        nothing is retried but a stale kept-alive connection and a URL refused as `_signed_again` says."""
        assert self._presign_put is not None, "RangeGetter built without presign_put"
        headers = {"Content-Length": str(sum(memoryview(p).nbytes for p in parts))}
        if only_if_absent:
            headers["If-None-Match"] = "*"
        return self._change(self._presign_put, key, "PUT", headers, parts, what, conditional=only_if_absent)

    def delete(self, key: str, what: str) -> None:
        """Delete the object `key` (the shared tier's claims and markers). Failures are raised as StoreErrors,
        as botocore's would be; nothing is retried but a stale kept-alive connection and a URL refused as
        `_signed_again` says."""
        assert self._presign_delete is not None, "RangeGetter built without presign_delete"
        self._change(self._presign_delete, key, "DELETE", {"Content-Length": "0"}, (), what, conditional=False)

    def _change(self, presign: Callable[[str], str], key: str, method: str, headers: dict[str, str],
                body: Sequence[bytes | WritableBuffer], what: str, *, conditional: bool) -> bool:
        """One PUT or DELETE whose answer has no body worth reading (signed now, every time; `_signed_again`).
        True; False if `conditional` and the server says the precondition failed (409, 412)."""
        return self._signed_again(lambda fresh: presign(key),
                                  lambda url: self._send_change(url, method, headers, body, what, conditional))

    def _send_change(self, url_text: str, method: str, headers: dict[str, str],
                     body: Sequence[bytes | WritableBuffer], what: str, conditional: bool) -> bool:
        origin, conn, resp = self._request(url_text, headers, what, method=method, body=body)
        try:
            if conditional and resp.status in (409, 412):
                resp.read(ERROR_BODY_MAX)
                return False
            if resp.status >= 300:
                raise self._error(resp, what, url_text)
            resp.read(ERROR_BODY_MAX)
            return True
        except (http.client.HTTPException, OSError) as exc:
            raise _transport_error(what, exc) from None
        finally:
            self._release(origin, conn, resp)

    def _request(self, url_text: str, headers: dict[str, str], what: str, *, method: str = "GET",
                 body: Sequence[bytes | WritableBuffer] = ()
                 ) -> tuple[tuple[str, str, int], _Connection, http.client.HTTPResponse]:
        """Send one request to a presigned URL (with `body`'s parts) on a pooled connection; the connection
        and the response, whose body the caller reads and then gives the connection back (or closes it). The
        request ends by the read timeout after now: its connect, its body's sending, the response's head and its body
        (`_Connection`)."""
        deadline = time.monotonic() + self._read_timeout
        url = urllib.parse.urlsplit(url_text)
        origin = (url.scheme, url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
        target = url.path + ("?" + url.query if url.query else "")
        conn = self._connection(origin)
        kept_alive = conn.sock is not None
        try:
            try:
                return origin, conn, self._send(conn, target, headers, origin, deadline, what, method, body)
            except (http.client.RemoteDisconnected, ConnectionError) as exc:
                if not kept_alive:
                    raise TransientError(f"{what}: {type(exc).__name__}: {exc}") from None
                # The server closed the idle connection meanwhile (an idle timeout): a new one, at once.
                conn.close()
                return origin, conn, self._send(conn, target, headers, origin, deadline, what, method, body,
                                                again=True)
        except (http.client.HTTPException, OSError) as exc:
            conn.close()
            # Reset, timeout, a response cut short or not HTTP at all: worth another try.
            raise _transport_error(what, exc) from None
        except BaseException:
            conn.close()
            raise

    def _connect_by(self, conn: _Connection, origin: tuple[str, str, int], deadline: float, what: str,
                    again: bool) -> None:
        """Connect `conn`: its name resolved, its addresses tried and TLS's handshake, all together within the connect
        timeout or the time left before `deadline`, whichever is less (`_Connection.open`). Unreachable where the
        connection was the request's first step (the endpoint is not there, or DNS does not answer: retried as a
        refused connection is; nothing was sent, so a write's request never reached the bucket), whichever of the two
        timeouts bounded it; TimedOut where it opened `again` (a kept connection found closed) with less than the
        connect timeout left of the request's own time, as a head or a body not in by then."""
        left = deadline - time.monotonic()
        limit = min(self._connect_timeout, max(left, DEADLINE_SLACK_S))
        where = f"{origin[1]}:{origin[2]}"
        try:
            conn.open(time.monotonic() + limit, self._resolve)
        except ssl.SSLCertVerificationError as exc:
            # Not the endpoint being away: tried again, it failed each READ at --read-timeout as "timed out".
            raise StoreError(f"TLS: the certificate of {where} was refused: "
                             f"{exc.verify_message or exc} (the CA bundle: AWS_CA_BUNDLE, the profile's "
                             "ca_bundle, or REQUESTS_CA_BUNDLE)") from None
        except _NotInTime as exc:
            if again and left < self._connect_timeout:  # the request's time ran out (a kept one found closed late)
                raise TimedOut(f"{what}: timed out: {exc.doing} {where} was not done within the request's time (the "
                               f"read timeout, {self._read_timeout:g}s)") from None
            bound = (f"the connect timeout ({self._connect_timeout:g}s)" if self._connect_timeout <= self._read_timeout
                     else f"the read timeout ({self._read_timeout:g}s)")
            raise Unreachable(f"cannot reach the endpoint {where}: {exc.doing} it took longer than {bound}") from None
        except socket.gaierror as exc:
            raise Unreachable(f"cannot reach the endpoint {where}: DNS: its name does not resolve "
                              f"({exc.strerror or exc})") from None
        except OSError as exc:
            raise (local_failure(exc, f"cannot open a connection to {where}")
                   or Unreachable(f"cannot reach the endpoint {where}: {exc}")) from None
        assert conn.sock is not None
        conn.sock.settimeout(self._read_timeout)

    def _send(self, conn: _Connection, target: str, headers: dict[str, str], origin: tuple[str, str, int],
              deadline: float, what: str, method: str = "GET",
              body: Sequence[bytes | WritableBuffer] = (), *, again: bool = False) -> http.client.HTTPResponse:
        if conn.sock is None:
            self._connect_by(conn, origin, deadline, what, again)
        conn.bounded = bounded = _Deadline(conn.sock, deadline)
        conn.putrequest(method, target, skip_accept_encoding="Accept-Encoding" in headers)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        for part in body:  # straight from the caller's buffers: http.client would copy a body it is given
            bounded.sendall(part)
        return conn.getresponse()

    def _read(self, resp: http.client.HTTPResponse, sock: socket.socket | None, start: int, want: int, etag: str,
              buffer: WritableBuffer | bytearray, what: str, url: str, etag_needed: bool = False,
              size: int | None = None) -> bool:
        """Check the response (to a GET of `url`) and read its body into `buffer`; True if the connection may be
        reused. `etag_needed`: an answer without an ETag is refused (nothing else pins the version). `size`: the
        object size the version was pinned at; an answer whose total differs is refused (SizeChanged), its body
        unread."""
        if resp.status >= 300:
            raise self._error(resp, what, url)
        length = resp.getheader("Content-Length")
        content_range = resp.getheader("Content-Range")
        if resp.status == 206:
            if not content_range or not content_range.startswith(f"bytes {start}-{start + want - 1}/"):
                raise TransientError(f"{what}: server answered with {content_range!r}")
            total: str | None = content_range.rpartition("/")[2]
        else:
            # A 200 is the whole object, its length the object's size: where it names the version (its ETag, or the
            # version has none). One that does not (a proxy's page of its own) is left to the checks below (B215).
            got = resp.getheader("ETag")
            ours = not etag or bool(got) and changed_etag(etag, got, what) is None
            total = length if resp.status == 200 and ours else None
        # The object's size on the server, against the one the version was pinned at: a HEAD cut inside its
        # Content-Length line gave a smaller one with the right ETag, and the file read back short, every GET
        # matching If-Match (B209). A 200 is compared before its range is: the whole of an object asked for by a
        # version pinned smaller is not the range asked for, and was a transient error retried to the last try,
        # the wrong size left pinned, where the boto3 client refused the version at once (B214).
        wrong_size = size_changed(total, size, what)
        if wrong_size is not None:
            raise wrong_size
        if resp.status != 206 and not (resp.status == 200 and start == 0 and length == str(want)):
            # A 200 is the whole object: right only if that is exactly the range asked for.
            raise TransientError(f"{what}: server answered {resp.status} without the range")
        if length is not None and length != str(want):
            raise TransientError(f"{what}: server sends {length} bytes, {want} asked for")
        changed = changed_etag(etag, resp.getheader("ETag"), what, needed=etag_needed)
        if changed is not None:
            raise changed
        with memoryview(buffer) as view:
            _receive(sock, view, resp.readinto,
                     lambda got: TransientError(f"{what}: short body, {got} of {want} bytes"))
        if length is None and resp.read(1):
            # No length said (a chunked body, or one that ends with the connection): the body must end here. A
            # server that ignored the range, or compressed the bytes on the way, sent more, and these were not the
            # range's bytes (read whole and served: a 20 MB file read back its first chunk three times).
            raise TransientError(f"{what}: server sent more than the {want} bytes asked for")
        # Nothing may follow the body on a connection we keep (a server sending more is not trusted).
        return not resp.will_close and resp.read(1) == b""

    def _release(self, origin: tuple[str, str, int], conn: _Connection,
                 resp: http.client.HTTPResponse) -> None:
        """Back to the pool if the response was read whole and the server keeps the connection; else closed."""
        if resp.isclosed() and not resp.will_close:
            self._give_back(origin, conn)
        else:
            conn.close()

    def _error(self, resp: http.client.HTTPResponse, what: str, url: str) -> Exception:
        """The StoreError an error response stands for (its S3 error code read from the body); `url`, the request's,
        says what region it was signed for (WrongRegion.signed_for)."""
        body = resp.read(ERROR_BODY_MAX)
        match = _CODE_RE.search(body)
        code = match.group(1).decode("utf-8", "replace") if match else ""
        said = _MESSAGE_RE.search(body)
        message = said.group(1).decode("utf-8", "replace") if said else ""
        named = _REGION_RE.search(body)
        region = resp.getheader("x-amz-bucket-region") or (named.group(1).decode() if named else "")
        if region and (resp.status == 301 or code in ("AuthorizationHeaderMalformed",
                                                      "AuthorizationQueryParametersError")):
            wrong = WrongRegion(f"{what}: {code or resp.status}: the bucket is in region {region} (pass --region "
                                f"{region}, and an --endpoint-url of that region if you give one)", region)
            wrong.signed_for = signed_region(url)
            return wrong
        if 300 <= resp.status < 400 and not code:
            # A bare number ("GET 'k': 307") said nothing: S3 answers object requests with no other redirect.
            location = resp.getheader("Location")
            return StoreError(f"{what}: the server answered {resp.status} {resp.reason}"
                              + (f" (to {location[:200]})" if location else "")
                              + ", which S3 does not for an object: is the endpoint a web server or a proxy?")
        return error_for_status(code, resp.status, self.bucket, what, message, url_life_s=URL_EXPIRES_S)


# A receive under a deadline (`_Deadline`) may end this much after it: the socket's timeout is set again only when the
# one set last runs past the deadline by more, so a body received a MiB or a segment at a time costs one settimeout
# (an ioctl) per this many seconds of its time, not one per receive.
DEADLINE_SLACK_S = 0.05


class _Deadline:
    """A request's socket as its sender and its response's reader see it (the `socket.SocketIO` under http.client's
    buffered reader reads through `_sock`): each send or receive waits at most the time left before `deadline`
    (time.monotonic()), within DEADLINE_SLACK_S, and none begins past it: TimeoutError, as a socket timeout raises. A
    per-packet timeout bounded each receive, not the response: a head or a body sent a few bytes at a time, each in
    time, held its reader as long as it took. `changed`: the socket's timeout was set here (to be set back before the
    connection is reused)."""

    __slots__ = ("_sock", "_deadline", "_timeout", "changed")

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline
        self._timeout = sock.gettimeout()
        self.changed = False

    def _time_left(self) -> None:
        """The socket's timeout set to the time left, within DEADLINE_SLACK_S; TimeoutError where none is."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out (the request was not done by its deadline)")
        if self._timeout is None or self._timeout > left + DEADLINE_SLACK_S:
            self._sock.settimeout(left)
            self._timeout, self.changed = left, True

    def recv_into(self, *args: Any) -> int:
        self._time_left()
        return self._sock.recv_into(*args)

    def sendall(self, data: bytes | WritableBuffer) -> None:
        """All of `data` (a sendall's timeout bounds the whole of it)."""
        self._time_left()
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def restore(self, timeout: float) -> None:
        """The socket's timeout back to `timeout` if it was changed here (a connection kept for the next request)."""
        if self.changed:
            self._sock.settimeout(timeout)


def _bounded(resp: http.client.HTTPResponse, bounded: _Deadline) -> None:
    """Put `bounded` between http.client's buffered reader of `resp` and its socket, which `socket.SocketIO` reads
    through its `_sock`: the response's head and body are received by its deadline. (A response that ends its
    connection, `Connection: close` or HTTP/1.0, takes the socket over, the connection's `sock` None then: the reader
    holds it still.) Left as it is where the reader is not that (no Python so far differs, 3.11-3.14): each receive is
    then bounded by the socket's timeout alone."""
    raw = getattr(getattr(resp, "fp", None), "raw", None)
    if isinstance(raw, socket.SocketIO) and raw._sock is bounded._sock:  # type: ignore[attr-defined]
        raw._sock = bounded  # type: ignore[attr-defined]


class _NotInTime(TimeoutError):
    """A connection not open by its time (`_Connection.open`); `doing`: at what, in words ("connecting to", "the TLS
    handshake with")."""

    def __init__(self, doing: str):
        super().__init__(f"timed out: {doing} the endpoint took too long")
        self.doing = doing


Addresses = list[tuple[Any, Any, int, str, Any]]  # socket.getaddrinfo's


class _Lookup:
    """One resolution of a name in its own thread: `done` set when `addresses` or `error` is there."""

    __slots__ = ("done", "addresses", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.addresses: Addresses = []
        self.error: tuple[int, str] | None = None


class _Resolver:
    """Host names resolved by a deadline. `socket.getaddrinfo` waits as long as the system's resolver does (timeout x
    attempts x nameservers of resolv.conf; for ever behind a local resolver that takes the query and never answers),
    and cannot be interrupted: a fetch thread opening a connection waited so, whatever its deadline. A name is looked
    up in a thread of its own, waited for until the deadline: a lookup still stuck then is left to end by itself, and a
    request for the same name and port meanwhile waits for that one, not a new one, so a dead resolver holds one
    thread per name, not one per try. An address (no lookup) is taken as it is, in the caller's thread. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _Lookup] = {}

    def __call__(self, host: str, port: int, until: float) -> Addresses:
        """`host`'s addresses (TCP, port `port`), by `until` (time.monotonic()): else _NotInTime; gaierror where the
        name does not resolve."""
        try:
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except (socket.gaierror, UnicodeError):
            pass  # a name
        with self._lock:
            lookup = self._pending.get((host, port))
            if lookup is None:
                lookup = self._pending[host, port] = _Lookup()
                threading.Thread(target=self._look_up, args=(host, port, lookup), name=f"resolve {host}",
                                 daemon=True).start()
        if not lookup.done.wait(max(until - time.monotonic(), 0)):
            raise _NotInTime("resolving the name (DNS) of")
        if lookup.error is not None:
            raise socket.gaierror(*lookup.error)
        return lookup.addresses

    def _look_up(self, host: str, port: int, lookup: _Lookup) -> None:
        try:
            lookup.addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            lookup.error = (exc.errno or socket.EAI_FAIL, exc.strerror or str(exc))
        except Exception as exc:  # noqa: BLE001 - a name http.client or idna cannot take: said as unresolved
            lookup.error = (socket.EAI_NONAME, f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                if self._pending.get((host, port)) is lookup:
                    del self._pending[host, port]
            lookup.done.set()


def _connect(addresses: Addresses, until: float) -> socket.socket:
    """A TCP connection to one of `addresses`, tried in turn, by `until` (time.monotonic()): each is given half of
    the time left, the last all of it, so the first one black-holed (an IPv6 route that drops) leaves the others time,
    and all together take no longer than the one connect timeout (`socket.create_connection` gave each the whole of it
    in turn). Half, not an equal share: the first address, the one the system prefers, keeps time for a SYN sent again
    (1 s after a lost one) however many addresses the name has (an equal share of a 3 s connect timeout among 6 was
    0.5 s). An address that refuses or has no route fails at once and takes nothing from the next, as does one of a
    family this machine has not (IPv6 turned off). _NotInTime where the time ran out; else the last address's error."""
    error: OSError | None = None
    for i, (family, kind, proto, _, address) in enumerate(addresses):
        left = until - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            if exc.errno in LOCAL_ERRNOS:
                raise  # no descriptor or memory left: this machine's, at once (`store.local_failure`)
            error = exc  # a family this machine has not (IPv6 turned off): the next address
            continue
        try:
            sock.settimeout(left if i == len(addresses) - 1 else left / 2)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return sock
    if not addresses:
        raise OSError("its name resolved to no address")
    if error is None or isinstance(error, TimeoutError) or until - time.monotonic() <= 0:
        raise _NotInTime("connecting to")
    raise error


class _Connection(http.client.HTTPConnection):
    """A pooled connection whose responses are read under the deadline of the request they answer: `bounded`, set by
    `RangeGetter._send` before each request, from the response's first byte (its status line and headers, then its
    body). Opened by `open`, bounded as a whole."""

    bounded: _Deadline | None = None

    def open(self, until: float, resolve: Callable[[str, int, float], Addresses]) -> None:
        """Connect by `until` (time.monotonic()), the name's resolution (`resolve`) and every address tried counted
        (http.client's `connect` gave each address the whole timeout, and DNS had none); _NotInTime where it ran out."""
        sys.audit("http.client.connect", self, self.host, self.port)
        self.sock = _connect(resolve(self.host, self.port, until), until)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            if exc.errno != errno.ENOPROTOOPT:
                raise

    def response_class(self, sock: socket.socket, *args: Any, **kwargs: Any  # type: ignore[override]
                       ) -> http.client.HTTPResponse:
        """http.client's response, `bounded` put under its reader before it reads its head (`getresponse` reads it
        as soon as it makes the response)."""
        resp = http.client.HTTPResponse(sock, *args, **kwargs)
        if self.bounded is not None:
            _bounded(resp, self.bounded)
        return resp


class _TLSConnection(_Connection, http.client.HTTPSConnection):
    """`_Connection` over TLS."""

    def open(self, until: float, resolve: Callable[[str, int, float], Addresses]) -> None:
        """As `_Connection.open`, TLS's handshake by the same `until` (http.client's gave it the whole timeout again
        after the TCP connect)."""
        super().open(until, resolve)
        assert self.sock is not None
        left = until - time.monotonic()
        try:
            if left <= 0:
                raise _NotInTime("the TLS handshake with")
            self.sock.settimeout(left)
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)  # type: ignore[attr-defined]
        except TimeoutError:
            self.close()
            raise _NotInTime("the TLS handshake with") from None


class Body:
    """The body of `RangeGetter.open`: `size` bytes, read front to back with `read` / `readinto`, by the read timeout
    after the request began (each receive waits at most the time left: `_Deadline`). `close` gives the connection back
    only when the body was read whole and the server keeps it open. Used by one thread at a time."""

    def __init__(self, getter: RangeGetter, origin: tuple[str, str, int], conn: _Connection,
                 resp: http.client.HTTPResponse, size: int, what: str):
        self.size = size
        self.server_age_s = server_age_s(resp.getheader("Date"), resp.getheader("Last-Modified"))
        self._getter, self._origin, self._conn, self._resp, self._what = getter, origin, conn, resp, what
        self._got = 0

    def __enter__(self) -> Body:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def read(self, n: int) -> bytes:
        """Exactly n bytes, or fewer only at the end of the object."""
        parts, left = [], min(n, self.size - self._got)
        while left > 0:
            part = self._io(self._resp.read, left)
            self._count(len(part))
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def readinto(self, buffer: WritableBuffer | bytearray) -> int:
        """Fill `buffer` (fewer bytes only at the end of the object); the count."""
        with memoryview(buffer) as whole:
            want = min(whole.nbytes, self.size - self._got)
            at = self._got
            _receive(self._conn.sock if self._conn is not None else None, whole.cast("B")[:want],
                     lambda part: self._io(self._resp.readinto, part),
                     lambda got: TransientError(f"{self._what}: short body, {at + got} of {self.size} bytes"))
            self._got += want
        return want

    def _io(self, fn: Callable[[Any], T], arg: Any) -> T:
        try:
            return fn(arg)
        except (http.client.HTTPException, OSError) as exc:
            raise _transport_error(self._what, exc) from None

    def _count(self, n: int) -> None:
        if not n:
            raise TransientError(f"{self._what}: short body, {self._got} of {self.size} bytes")
        self._got += n

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._got == self.size:
            self._getter._release(self._origin, conn, self._resp)
        else:
            conn.close()

