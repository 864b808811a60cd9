"""A fault-injecting HTTP reverse proxy for tests: it sits on 127.0.0.1 between modelfs and an S3 server
and, on command, delays, stalls, dribbles, resets or truncates responses (their bodies, or their heads: dribbled, or cut
between two header lines), answers with 5xx storms, or plays dead.

It must never listen beyond 127.0.0.1, never alter a byte it forwards (a fault only delays, cuts or
replaces a whole response), and never wait without a bound: every hold ends at `MAX_HOLD_S`, at
`clear()`/`origin_back()`, or when the proxy stops.

Usage::

    with FaultProxy(moto.endpoint_url) as proxy:          # daemon gets proxy.endpoint_url
        proxy.inject(Fault.ERROR, status=503, code="SlowDown", times=6)
        ...                                               # read through the mount
        assert proxy.counts()["data_gets"] <= bound
        proxy.origin_down()                               # connections refused
        proxy.origin_back()                               # same port again

Facts this relies on:

- SigV4 signs the Host header. The client signs `127.0.0.1:<proxy port>` and the proxy forwards every
  request header unchanged, so a server that verifies signatures recomputes them over the same Host
  and accepts them (checked with SeaweedFS, which refuses a wrong secret); moto does not verify.
- botocore keeps connections alive (HTTP/1.1); the proxy serves many requests per connection, one
  thread per client connection, and keeps one upstream connection per client connection.
- "Data GETs" are GETs with a `Range` header: modelfs fetches object bytes only that way, and lists
  and HEADs without one, so faults limited to them leave metadata working.

Besides forwarding, `serve_directory` makes the proxy answer ListObjectsV2, HEAD and GET for a set of
keys under one prefix itself (synthetic_dir.py; deterministic bodies, see `synthetic_body`). It exists
because moto lists a 100k-key prefix in ~55 s (100 pages, each an O(n) scan; measured here) and cannot
store keys that are not valid UTF-8; the proxy lists 100k keys in a few seconds and can return any bytes
as a key. The HTTP wire (parsing, writing, resets) is http_wire.py.

Concurrency: rules, counters and the down state are guarded by `_lock`; a connection thread takes a
snapshot of what applies to its request under the lock and then works without it. Only the accept
thread opens or closes the listening socket.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import http.client
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Self

from fsmount.data.presigned import signed_region
from fsmount.testing.http_wire import (
    Request,
    Response,
    cut_head,
    error_response,
    head_bytes,
    read_request,
    reset,
    send,
    send_raw,
    shutdown,
)
from fsmount.testing.synthetic_dir import SyntheticDirectory, list_response, object_response, synthetic_body

HOST = "127.0.0.1"
#: No hold (stall, latency, black hole) lasts longer than this, whatever a test asked for.
MAX_HOLD_S = 120.0
# The bytes of body a DRIBBLE (of head, a DRIBBLE_HEAD) sends at a time, unless told.
DRIBBLE_BYTES = 16
#: The accept loop wakes this often to notice stop and down/up requests.
ACCEPT_POLL_S = 0.05
#: A client connection idle this long (no next request) is closed; botocore reconnects.
IDLE_TIMEOUT_S = 60.0
#: How long the proxy waits on the upstream server for one response.
UPSTREAM_TIMEOUT_S = 60.0
#: How long stop() waits for connection threads.
STOP_JOIN_S = 5.0
#: Requests remembered for `log()`.
LOG_ENTRIES = 20_000

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
              "expect", "content-length"}
S3_ERROR_CODES = {500: "InternalError", 503: "SlowDown", 502: "BadGateway", 504: "GatewayTimeout"}


class Fault(enum.StrEnum):
    LATENCY = "latency"    # wait `seconds`, then forward normally
    STALL = "stall"        # hold the response `seconds` (before anything, or after `after_bytes` of body)
    RESET = "reset"        # send headers and `after_bytes` of body, then RST the connection
    TRUNCATE = "truncate"  # send headers (full Content-Length) and `after_bytes` of body, then close
    SHORT = "short"        # send only `after_bytes` of body with a Content-Length that says so; keep alive
    ERROR = "error"        # answer `status` with an S3 error document (`code`); the server never sees it
    DROP = "drop"          # forward the request, then RST the connection unanswered: the server did it, the
                           # client never hears (a reply lost on the way back)
    CUT_HEADERS = "cut_headers"  # send the head up to a line's end (`after_bytes` of it, rounded down; None: the
                                 # status line alone), never the blank line that ends it; hold `seconds`, then close
    DRIBBLE = "dribble"    # send the head, then the body `after_bytes` (16 by default) at a time, `seconds` apart:
                           # each packet in time for any read timeout longer than that, the whole body far from it
    DRIBBLE_HEAD = "dribble_head"  # the same for the head (status line and headers), then the body at once


class Down(enum.StrEnum):
    REFUSE = "refuse"        # nothing listens: connect() gets ECONNREFUSED; open connections are cut
    BLACKHOLE = "blackhole"  # connections are accepted and requests read, but nothing is ever answered


@dataclasses.dataclass
class Rule:
    """One injected fault. A request gets the first rule that matches it."""

    fault: Fault
    seconds: float = 0.0
    after_bytes: int | None = None
    status: int = 503
    code: str | None = None
    times: int | None = None     # applies to this many more requests; None: until cleared
    fraction: float = 1.0        # chance that a matching request is hit
    data_only: bool = True       # only GETs with a Range header
    kind: str | None = None      # only requests of this kind (http_wire.Request.kind: "lists", "heads",
                                 # "data_gets", "parts", "completes", ...); wins over data_only
    op: str | None = None        # only write requests of this operation (http_wire.Request.operation: "put",
                                 # "start", "part", "complete", "copy", "part_copy", "delete", "abort"); wins over kind
    skip: int = 0                # the first `skip` requests it matches pass untouched (page 3 of 5: skip=2)
    range_from: int | None = None  # only GETs whose Range starts at this byte (one chunk's fetches)
    hits: int = 0
    seen: int = 0

    def matches(self, req: Request) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.range_from is not None and not (req.header("range") or "").startswith(f"bytes={self.range_from}-"):
            return False
        if self.op is not None:
            return req.operation == self.op
        if self.kind is not None:
            return req.kind == self.kind
        return req.is_data_get or not self.data_only


@dataclasses.dataclass(frozen=True)
class LogEntry:
    t: float
    method: str
    target: str
    range: str | None
    outcome: str
    key_id: str | None = None  # the access key id it was signed with (`signed_key_id`)


def signed_key_id(authorization: str, target: str) -> str | None:
    """The access key id a SigV4 request is signed with: its Authorization header's `Credential=` or a presigned
    URL's `X-Amz-Credential`. None if it has neither."""
    for text, mark in ((authorization, "Credential="), (urllib.parse.unquote(target), "X-Amz-Credential=")):
        at = text.find(mark)
        if at >= 0:
            return text[at + len(mark):].split("/", 1)[0]
    return None


class FaultProxy:
    """A threaded reverse proxy on 127.0.0.1 with faults switchable at runtime. A context manager."""

    def __init__(self, upstream_url: str, *, seed: int = 0):
        parts = urllib.parse.urlsplit(upstream_url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://HOST:PORT, not {upstream_url!r}")
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._release = threading.Event()
        self._rules: list[Rule] = []
        self._rng = random.Random(seed)
        self._counts: collections.Counter[str] = collections.Counter()
        self._log: collections.deque[LogEntry] = collections.deque(maxlen=LOG_ENTRIES)
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._down: Down | None = None
        self._listening = threading.Event()   # set while the listener is open
        self._synthetic: list[SyntheticDirectory] = []
        # `bucket_region`: requests signed for another region are refused as S3 refuses them (301).
        self._region: str | None = None
        # `revoke_key`: access key ids whose signatures are refused (ExpiredToken), each with its HTTP status.
        self._revoked: dict[str, int] = {}
        self.port = 0

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        self._open_listener(0)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fault-proxy-accept", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._release.set()
        if self._accept_thread is not None:
            self._accept_thread.join(STOP_JOIN_S)
        self._close_listener()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            shutdown(conn)
        deadline = time.monotonic() + STOP_JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- faults --------------------------------------------------------------------------------

    def inject(self, fault: Fault | str, *, seconds: float = 0.0, after_bytes: int | None = None,
               status: int = 503, code: str | None = None, times: int | None = None, fraction: float = 1.0,
               data_only: bool = True, kind: str | None = None, op: str | None = None, skip: int = 0,
               range_from: int | None = None) -> Rule:
        """Add a fault rule (checked after those added before it). Returns it; `rule.hits` counts."""
        fault = Fault(fault)
        if fault in (Fault.RESET, Fault.TRUNCATE, Fault.SHORT) and after_bytes is None:
            after_bytes = 0
        if fault in (Fault.DRIBBLE, Fault.DRIBBLE_HEAD) and not after_bytes:
            after_bytes = DRIBBLE_BYTES
        rule = Rule(fault, seconds=min(seconds, MAX_HOLD_S), after_bytes=after_bytes, status=status,
                    code=code or S3_ERROR_CODES.get(status, "InternalError"), times=times, fraction=fraction,
                    data_only=data_only, kind=kind, op=op, skip=skip, range_from=range_from)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and release every held response (they then proceed normally)."""
        with self._lock:
            self._rules.clear()
            self._release.set()
            self._release = threading.Event()

    def bucket_region(self, region: str | None) -> None:
        """Answer every request signed for another region than `region` (SigV4's credential scope, in the
        Authorization header or a presigned URL's X-Amz-Credential) as S3 answers one sent to the wrong region:
        301 PermanentRedirect with the bucket's region in `x-amz-bucket-region`. None: forward them all."""
        with self._lock:
            self._region = region

    def revoke_key(self, key_id: str, status: int = 403) -> None:
        """Refuse every request signed with access key id `key_id` (in the Authorization header's or a presigned
        URL's credential) as credentials past their expiry are refused: ExpiredToken, with HTTP `status`. AWS S3
        answers 400 (a HEAD's answer then has no body: botocore names its code "400"); 403 is the status of the
        other refusals for credentials (AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch)."""
        with self._lock:
            self._revoked[key_id] = status

    def origin_down(self, mode: Down | str = Down.REFUSE) -> None:
        """Play dead until `origin_back()`. Returns once the new state holds."""
        mode = Down(mode)
        with self._lock:
            self._down = mode
            conns = list(self._conns)
        if mode is Down.REFUSE:
            for conn in conns:  # a crashed server: every open connection is cut
                shutdown(conn)
            self._wait_listening(False)

    def origin_back(self) -> None:
        with self._lock:
            self._down = None
            self._release.set()
            self._release = threading.Event()
        self._wait_listening(True)

    def serve_directory(self, bucket: str, prefix: str, names: Iterable[bytes | str], *, size: int = 0) -> None:
        """Answer listings under `prefix` (which ends with '/') and HEAD/GET of `prefix + name` here."""
        raw = [n.encode() if isinstance(n, str) else n for n in names]
        directory = SyntheticDirectory(bucket, prefix.encode(), raw, size)
        with self._lock:
            self._synthetic.append(directory)

    # -- observation ---------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """requests, data_gets, heads, lists, gets, other, connections, faulted, fault:<kind>, dropped."""
        with self._lock:
            return dict(self._counts)

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()

    def log(self) -> list[LogEntry]:
        with self._lock:
            return list(self._log)

    # -- accept loop ---------------------------------------------------------------------------

    def _open_listener(self, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(128)
        sock.settimeout(ACCEPT_POLL_S)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._listening.set()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._listening.clear()

    def _wait_listening(self, want: bool) -> None:
        deadline = time.monotonic() + STOP_JOIN_S
        while self._listening.is_set() != want and time.monotonic() < deadline:
            time.sleep(ACCEPT_POLL_S / 2)
        if self._listening.is_set() != want:
            raise RuntimeError(f"fault proxy: listener did not {'open' if want else 'close'}")

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                refuse = self._down is Down.REFUSE
            if refuse and self._listener is not None:
                self._close_listener()
            elif not refuse and self._listener is None:
                try:
                    self._open_listener(self.port)  # the same port: the client's endpoint does not change
                except OSError:  # taken meanwhile; origin_back() reports it after its wait
                    self._stop.wait(ACCEPT_POLL_S)
                    continue
            if self._listener is None:
                self._stop.wait(ACCEPT_POLL_S)
                continue
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            conn.settimeout(IDLE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve_connection, args=(conn,), name="fault-proxy-conn", daemon=True)
            with self._lock:
                self._counts["connections"] += 1
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    # -- one client connection -----------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while not self._stop.is_set():
                try:
                    req = read_request(rfile, conn)
                except (OSError, ValueError):
                    return
                if req is None:
                    return
                with self._lock:
                    self._counts["requests"] += 1
                    self._counts[req.kind] += 1
                keep, upstream = self._handle(conn, req, upstream)
                if not keep:
                    return
        finally:
            if upstream is not None:
                upstream.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            rfile.close()
            conn.close()

    def _pick(self, req: Request) -> tuple[Down | None, Rule | None, threading.Event]:
        with self._lock:
            release = self._release
            if self._down is not None:
                return self._down, None, release
            for rule in self._rules:
                if not rule.matches(req):
                    continue
                rule.seen += 1
                if rule.seen <= rule.skip:
                    continue
                if rule.fraction >= 1.0 or self._rng.random() < rule.fraction:
                    rule.hits += 1
                    self._counts["faulted"] += 1
                    self._counts[f"fault:{rule.fault.value}"] += 1
                    return None, rule, release
        return None, None, release

    def _note(self, req: Request, outcome: str) -> None:
        with self._lock:
            self._log.append(LogEntry(time.monotonic(), req.method, req.target, req.header("range"), outcome,
                                      signed_key_id(req.header("Authorization") or "", req.target)))

    def _hold(self, seconds: float, release: threading.Event) -> None:
        release.wait(min(seconds, MAX_HOLD_S))

    def _handle(self, conn: socket.socket, req: Request,
                upstream: http.client.HTTPConnection | None) -> tuple[bool, http.client.HTTPConnection | None]:
        """Answer one request. Returns (keep the connection, the upstream connection to reuse)."""
        down, rule, release = self._pick(req)
        if down is not None:
            with self._lock:
                self._counts["dropped"] += 1
            self._note(req, f"down:{down.value}")
            if down is Down.BLACKHOLE:
                self._hold(MAX_HOLD_S, release)
            return False, upstream
        with self._lock:
            region, revoked = self._region, dict(self._revoked)
        refused = revoked.get(signed_key_id(req.header("Authorization") or "", req.target) or "") if revoked else None
        if refused is not None:
            self._note(req, "revoked-key")
            send(conn, error_response(refused, "ExpiredToken"), req)
            return True, upstream
        signed = signed_region(req.header("Authorization") or "") or signed_region(req.target)
        if region is not None and signed not in (None, region):
            self._note(req, "wrong-region")
            redirect = error_response(301, "PermanentRedirect")
            send(conn, dataclasses.replace(redirect, headers=[*redirect.headers, ("x-amz-bucket-region", region)]), req)
            return True, upstream
        fault = rule.fault if rule is not None else None
        self._note(req, fault.value if fault is not None else "forwarded")
        if rule is not None and rule.fault is Fault.ERROR:
            send(conn, error_response(rule.status, rule.code or "InternalError"), req)
            return True, upstream
        # Faults that only delay: hold first, then answer in full.
        delay_only = rule is not None and (rule.fault is Fault.LATENCY
                                           or (rule.fault is Fault.STALL and rule.after_bytes is None))
        if rule is not None and delay_only:
            self._hold(rule.seconds, release)
            if self._stop.is_set():
                return False, upstream
        resp = self._synthetic_response(req)
        if resp is None:
            try:
                resp, upstream = self._forward(req, upstream)
            except (OSError, http.client.HTTPException):
                send(conn, error_response(502, "BadGateway"), req)
                return False, None
        if rule is None or delay_only:
            return send(conn, resp, req), upstream
        if rule.fault is Fault.DROP:
            reset(conn)
            return False, upstream
        if rule.fault is Fault.CUT_HEADERS:
            if send_raw(conn, cut_head(head_bytes(resp, req), rule.after_bytes)):
                self._hold(rule.seconds, release)
            return False, upstream
        cut = rule.after_bytes or 0
        if rule.fault in (Fault.DRIBBLE, Fault.DRIBBLE_HEAD):
            head, body = head_bytes(resp, req), b"" if req.method == "HEAD" else resp.body
            parts = (head, body, b"") if rule.fault is Fault.DRIBBLE else (b"", head, body)
            return self._dribble(conn, *parts, cut, rule.seconds, release), upstream
        if rule.fault is Fault.STALL:
            if not send(conn, resp, req, body_end=cut):
                return False, upstream
            self._hold(rule.seconds, release)
            return send_raw(conn, resp.body[cut:]), upstream
        if rule.fault is Fault.SHORT:
            # A HEAD has no body to cut: its Content-Length is the object's size and stays.
            length = resp.content_length if req.method == "HEAD" else None
            return send(conn, dataclasses.replace(resp, body=resp.body[:cut], content_length=length), req), upstream
        send(conn, resp, req, body_end=cut)  # RESET or TRUNCATE: the promised length never arrives
        if rule.fault is Fault.RESET:
            reset(conn)
        return False, upstream

    def _dribble(self, conn: socket.socket, at_once: bytes, slowly: bytes, then: bytes, piece: int, seconds: float,
                 release: threading.Event) -> bool:
        """`at_once`, then `slowly` `piece` bytes at a time, `seconds` apart, then `then`; the rest at once when the
        rule is cleared (`release`) or after MAX_HOLD_S, nothing more once the proxy stops. False if the client has
        gone."""
        if not send_raw(conn, at_once):
            return False
        until = time.monotonic() + MAX_HOLD_S
        for at in range(0, len(slowly), piece):
            if release.is_set() or time.monotonic() > until:
                return send_raw(conn, slowly[at:] + then)
            if self._stop.is_set() or not send_raw(conn, slowly[at:at + piece]):
                return False
            release.wait(seconds)
        return send_raw(conn, then)

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        for attempt in (1, 2):  # a kept-alive upstream connection may have been closed by the server
            if upstream is None:
                upstream = http.client.HTTPConnection(*self._upstream, timeout=UPSTREAM_TIMEOUT_S)
            try:
                upstream.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
                for k, v in req.headers:
                    if k.lower() not in HOP_BY_HOP:
                        upstream.putheader(k, v)
                if req.body or req.method in ("PUT", "POST"):
                    upstream.putheader("Content-Length", str(len(req.body)))
                upstream.endheaders(req.body or None)
                r = upstream.getresponse()
                body = r.read()
                headers = [(k, v) for k, v in r.getheaders() if k.lower() not in HOP_BY_HOP]
                claimed = r.getheader("Content-Length")
                length = int(claimed) if req.method == "HEAD" and claimed is not None else None
                if r.will_close:
                    upstream.close()
                    upstream = None
                resp = Response(r.status, r.reason, headers, body, length)
                return resp, upstream or http.client.HTTPConnection(*self._upstream, timeout=UPSTREAM_TIMEOUT_S)
            except (OSError, http.client.HTTPException):
                upstream.close()
                upstream = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # -- synthetic directories -----------------------------------------------------------------

    def _synthetic_response(self, req: Request) -> Response | None:
        if req.method not in ("GET", "HEAD") or not self._synthetic:
            return None
        bucket, key = req.path_parts()
        query = req.query()
        for d in self._synthetic:
            if d.bucket != bucket:
                continue
            if key == b"" and req.method == "GET" and query.get("list-type") == "2":
                prefix = query.get("prefix", "").encode("utf-8", "surrogateescape")
                if d.answers_listing(prefix):
                    return list_response(d, query)
            elif key and d.holds(key):
                return object_response(d, key, req)
        return None


__all__ = ["Down", "Fault", "FaultProxy", "LogEntry", "Rule", "synthetic_body"]
