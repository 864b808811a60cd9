"""The presigned data plane (fsmount.data.presigned): what it accepts and refuses from a server, on a real
HTTP/1.1 server in this process whose answers each test scripts."""

from __future__ import annotations

import contextlib
import errno
import http.server
import mmap
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsmount.data import AccessDenied, NotFound, PreconditionFailed, StoreError, TransientError, Unreachable, presigned
from fsmount.data.presigned import RECEIVE_LOWAT, RangeGetter, since_boot
from fsmount.data.store import SizeChanged, TimedOut

DATA = bytes(range(256)) * 64  # 16 KiB
ETAG = '"abc"'


class Origin(http.server.ThreadingHTTPServer):
    """Serves DATA at any path with Range support; `script(handler, start, end)` may answer instead (return
    True when it did)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script: Callable[[Handler, int, int], bool] | None = None
        self.requests: list[dict[str, str]] = []
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Origin

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.requests.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
        spec = (self.headers["Range"] or f"bytes=0-{len(DATA) - 1}").removeprefix("bytes=")
        start, end = (int(x) for x in spec.split("-"))
        if self.server.script and self.server.script(self, start, end + 1):
            return
        if self.headers["Range"] is None:  # a whole-object GET (RangeGetter.open)
            self.answer(200, DATA)
        else:
            self.answer(206, DATA[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"})

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append({"method": "PUT", "path": self.path, "body": body,
                                     **{k.lower(): v for k, v in self.headers.items()}})
        if self.server.script and self.server.script(self, 0, len(body)):
            return
        self.answer(200, b"")

    def do_DELETE(self) -> None:  # noqa: N802 - http.server's name
        self.server.requests.append({"method": "DELETE", "path": self.path,
                                     **{k.lower(): v for k, v in self.headers.items()}})
        if self.server.script and self.server.script(self, 0, 0):
            return
        self.answer(204, b"")

    def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None, length: int | None = None,
               etag: str = ETAG) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.send_header("ETag", etag)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()


@pytest.fixture
def origin() -> Iterator[Origin]:
    server = Origin()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def getter(origin: Origin, presigned: list[str] | None = None, read_timeout: float = 5.0) -> RangeGetter:
    def presign(key: str) -> str:
        if presigned is not None:
            presigned.append(key)
        return f"{origin.url}/bucket/{key}?X-Amz-Signature=s{len(presigned or ())}"

    return RangeGetter(presign, presign_put=presign, presign_delete=presign, bucket="bucket", pool_size=4,
                       connect_timeout=2.0, read_timeout=read_timeout)


def get(g: RangeGetter, start: int, length: int, key: str = "k", etag: str = ETAG) -> bytes:
    buffer = mmap.mmap(-1, length)
    g.get_into(key, etag, start, buffer, f"GET {key}")
    return bytes(buffer)


def test_exact_bytes_on_one_kept_alive_connection_with_range_and_if_match(origin: Origin) -> None:
    presigned: list[str] = []
    g = getter(origin, presigned)
    for start in (0, 1000, 4096, len(DATA) - 100):
        assert get(g, start, 100) == DATA[start:start + 100]
    assert origin.connections == 1
    assert presigned == ["k"]  # signed once, reused
    assert origin.requests[1]["range"] == "bytes=1000-1099" and origin.requests[1]["if-match"] == ETAG
    assert origin.requests[1]["path"] == "/bucket/k?X-Amz-Signature=s1"


def test_a_whole_object_answer_is_taken_only_when_it_is_the_range(origin: Origin) -> None:
    origin.script = lambda h, start, end: h.answer(200, DATA) or True
    g = getter(origin)
    assert get(g, 0, len(DATA)) == DATA
    with pytest.raises(TransientError, match="without the range"):
        get(g, 100, 100)


@pytest.mark.parametrize("answer, error", [
    (lambda h, s, e: h.answer(206, DATA[s:e], {"Content-Range": f"bytes {s + 1}-{e}/{len(DATA)}"}),
     "answered with"),
    (lambda h, s, e: h.answer(206, DATA[s:e]), "answered with None"),
    (lambda h, s, e: h.answer(206, DATA[s:e + 10], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}),
     "sends 110 bytes"),
], ids=["wrong-range", "no-content-range", "longer-body"])
def test_an_answer_for_other_bytes_is_refused(origin: Origin, answer: Callable, error: str) -> None:
    origin.script = lambda h, s, e: answer(h, s, e) or True
    with pytest.raises(TransientError, match=error):
        get(getter(origin), 100, 100)


def test_a_body_cut_short_is_transient_and_the_connection_is_not_reused(origin: Origin) -> None:
    def cut(h: Handler, s: int, e: int) -> bool:
        h.answer(206, DATA[s:s + 10], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}, length=e - s)
        h.close_connection = True
        return True

    origin.script = cut
    g = getter(origin)
    with pytest.raises(TransientError):
        get(g, 0, 100)
    origin.script = None
    assert get(g, 0, 100) == DATA[:100]
    assert origin.connections == 2


def test_another_etag_is_precondition_failed(origin: Origin) -> None:
    origin.script = lambda h, s, e: h.answer(206, DATA[s:e], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"},
                                             etag='"other"') or True
    with pytest.raises(PreconditionFailed):
        get(getter(origin), 0, 10)


@pytest.mark.parametrize("status, code, error", [
    (412, "PreconditionFailed", PreconditionFailed),
    (404, "NoSuchKey", NotFound),
    (503, "SlowDown", TransientError),
    (500, "InternalError", TransientError),
])
def test_error_answers_map_through_the_one_mapping(origin: Origin, status: int, code: str, error: type) -> None:
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()
    origin.script = lambda h, s, e: h.answer(status, body) or True
    with pytest.raises(error):
        get(getter(origin), 0, 10)


def test_an_archived_object_is_said_so_once_and_its_message_kept(origin: Origin) -> None:
    """Glacier's 403 is no matter of credentials: no second signing, and the answer says to restore it. An
    error code the mapping has no words for keeps the server's message."""
    presigned: list[str] = []
    archived = (b"<Error><Code>InvalidObjectState</Code><Message>The operation is not valid for the object's "
                b"storage class</Message></Error>")
    origin.script = lambda h, s, e: h.answer(403, archived) or True
    g = getter(origin, presigned)
    with pytest.raises(StoreError, match=r"archived \(InvalidObjectState\): restore it") as info:
        get(g, 0, 10)
    assert not isinstance(info.value, AccessDenied) and presigned == ["k"]
    origin.script = lambda h, s, e: h.answer(400, b"<Error><Code>InvalidArgument</Code><Message>Requests specifying "
                                                b"SSE-C must provide the customer key.</Message></Error>") or True
    with pytest.raises(StoreError, match=r"InvalidArgument \(Requests specifying SSE-C must provide the customer "
                                         r"key\.\)"):
        get(g, 0, 10)


def test_403_signs_again_once_then_access_denied(origin: Origin) -> None:
    key_id = ["old"]

    def presign(key: str) -> str:
        return f"{origin.url}/bucket/{key}?X-Amz-Credential={key_id[0]}%2F20261206%2Fus-east-1%2Fs3%2Faws4_request"

    body = b"<Error><Code>AccessDenied</Code></Error>"
    origin.script = lambda h, s, e: h.answer(403, body) or True
    renewals: list[str] = []

    def renew(code: str) -> bool:  # a lookup finds new credentials
        renewals.append(code)
        key_id[0] = "new"
        return True

    g = RangeGetter(presign, bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0, on_refused=renew)
    with pytest.raises(AccessDenied):  # refused, looked up (other credentials), sent again, refused
        get(g, 0, 10)
    assert renewals == ["AccessDenied"] and len(origin.requests) == 2
    # Rotated credentials: the first (cached) URL, signed with the old ones, is refused; one signed now works.
    key_id[:] = ["new"]
    g = RangeGetter(presign, bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0)
    g._urls["k"] = ((since_boot(), time.time()), 0, float("inf"), presign("k").replace("new", "old"))
    origin.script = lambda h, s, e: "old" in h.path and h.answer(403, body) or False
    assert get(g, 0, 10) == DATA[:10]


def test_a_refusal_of_the_credentials_there_are_is_not_sent_again(origin: Origin) -> None:
    """A bucket policy that refuses the GETs of a prefix: each read cost two GETs, the second signed anew with the same
    credentials, once `credentials.Renewable` looked them up no more (B108, B118: `on_refused` False). A URL signed
    with the credentials there are is refused once, as the control plane's requests are."""
    presigned: list[str] = []
    body = b"<Error><Code>AccessDenied</Code></Error>"
    origin.script = lambda h, s, e: h.answer(403, body) or True
    told: list[str] = []
    g = RangeGetter(lambda key: presigned.append(key) or f"{origin.url}/bucket/{key}?X-Amz-Credential=same%2Fscope"
                    f"&X-Amz-Security-Token=t&X-Amz-Signature=s{len(presigned)}",
                    presign_put=lambda key: f"{origin.url}/bucket/{key}?X-Amz-Credential=same%2Fscope",
                    bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    on_refused=lambda code: told.append(code) and False)
    for _ in range(3):
        with pytest.raises(AccessDenied):
            get(g, 0, 10)
    with pytest.raises(AccessDenied):
        g.open("k", "GET k").close()
    with pytest.raises(AccessDenied):
        g.put("k", [b"x"], "PUT k")
    assert len(origin.requests) == 5 and told == ["AccessDenied"] * 5
    # Unsigned (--no-sign-request): nothing to sign anew either.
    origin.requests.clear()
    plain = RangeGetter(lambda key: f"{origin.url}/bucket/{key}", bucket="bucket", pool_size=2, connect_timeout=2.0,
                        read_timeout=2.0)
    with pytest.raises(AccessDenied):
        get(plain, 0, 10)
    assert len(origin.requests) == 1


def test_a_url_kept_while_the_machine_was_frozen_is_not_reused_past_its_expiry(
        origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM paused by its hypervisor (a saved state restored, a laptop's host asleep) counts no time on any of its
    clocks but the wall clock, set right at its resume: a URL cached before the pause looked a minute old on
    CLOCK_BOOTTIME and was hours past its X-Amz-Expires. S3 refused it (AccessDenied, "Request has expired") and,
    the URL signed now naming the same credentials, it was not sent again (B130): every read of a file opened before
    the pause was EACCES for up to URL_REUSE_S. A URL is reused only while its age on the wall clock is too (B132)."""
    from fsmount.data import presigned

    wall = [time.time()]
    monkeypatch.setattr(presigned.time, "time", lambda: wall[0])

    def presign(key: str) -> str:  # signed with the wall clock's time, as botocore signs
        return f"{origin.url}/bucket/{key}?X-Amz-Credential=same%2Fscope&X-Amz-Date={int(wall[0])}"

    def expired(h: Handler, s: int, e: int) -> bool:
        signed = int(h.path.rpartition("X-Amz-Date=")[2])
        return wall[0] - signed > 1200 and h.answer(403, b"<Error><Code>AccessDenied</Code><Message>Request has "
                                                          b"expired</Message></Error>") or False

    origin.script = expired
    g = RangeGetter(presign, bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    on_refused=lambda code: False)
    assert get(g, 0, 10) == DATA[:10]
    wall[0] += 3 * 3600  # frozen for three hours: CLOCK_BOOTTIME has not moved
    assert get(g, 0, 10) == DATA[:10]
    assert len(origin.requests) == 2  # signed anew, not sent expired
    # The wall clock set back (it was ahead when the URL was signed): not reused either.
    wall[0] -= 4 * 3600
    assert get(g, 0, 10) == DATA[:10]
    assert int(origin.requests[-1]["path"].rpartition("X-Amz-Date=")[2]) == int(wall[0])


def test_a_url_is_not_reused_past_the_expiry_of_the_session_credentials_it_was_signed_with(
        origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session credentials with less life left than URL_REUSE_S (a credential_process handing out cached keys near
    their end): botocore refreshed them before each signing, but a URL cached with the old ones was reused past their
    Expiration, refused (ExpiredToken), looked up again and sent twice. A URL is reused only until CREDENTIALS_ROOM_S
    before the expiry of those it was signed with (B281)."""
    from fsmount.data import presigned

    wall = [time.time()]
    monkeypatch.setattr(presigned.time, "time", lambda: wall[0])
    expiry = [wall[0] + 100.0]
    signed: list[str] = []

    def presign(key: str) -> str:
        signed.append(key)
        return f"{origin.url}/bucket/{key}?X-Amz-Credential=K{len(signed)}%2Fscope"

    g = RangeGetter(presign, bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    credentials_expiry=lambda: expiry[0])
    assert get(g, 0, 10) == DATA[:10]
    wall[0] += 30  # 70 s left: reused
    assert get(g, 0, 10) == DATA[:10] and len(signed) == 1
    wall[0] += 20  # 50 s left, less than CREDENTIALS_ROOM_S: signed anew with the credentials there are now
    expiry[0] = wall[0] + 3600
    assert get(g, 0, 10) == DATA[:10] and len(signed) == 2
    wall[0] += 300  # credentials that expire in an hour: reused for URL_REUSE_S as before
    assert get(g, 0, 10) == DATA[:10] and len(signed) == 2
    assert [r["path"].rpartition("=")[2] for r in origin.requests] == ["K1%2Fscope"] * 2 + ["K2%2Fscope"] * 2


def test_a_url_reused_where_the_server_s_clock_is_ahead_is_signed_anew_when_refused_as_expired(
        origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose clock is ahead of ours by more than URL_EXPIRES_S - URL_REUSE_S (here 700 s) finds a URL reused
    near the end of URL_REUSE_S past its X-Amz-Expires: AccessDenied, "Request has expired". Before B130 the refusal
    was sent again with a URL signed now, which hid the skew; after it, a URL signed now naming the same credentials,
    the read was EACCES. A refusal for expiry is the URL's age, not the credentials': sent again signed now (B136).
    Signed now and refused as expired still (the clock more than a URL's life ahead), it says to check the clocks."""
    from fsmount.data import presigned

    wall, ahead = [time.time()], [700]
    monkeypatch.setattr(presigned.time, "time", lambda: wall[0])
    monkeypatch.setattr(presigned, "since_boot", lambda: wall[0])

    def presign(key: str) -> str:  # signed with our clock's time, as botocore signs
        return f"{origin.url}/bucket/{key}?X-Amz-Credential=same%2Fscope&X-Amz-Date={int(wall[0])}"

    def expired(h: Handler, s: int, e: int) -> bool:  # expiry judged on the server's clock
        signed = int(h.path.rpartition("X-Amz-Date=")[2])
        return wall[0] + ahead[0] - signed > presigned.URL_EXPIRES_S and h.answer(
            403, b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>") or False

    origin.script = expired
    g = RangeGetter(presign, bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    on_refused=lambda code: False)
    assert get(g, 0, 10) == DATA[:10]
    wall[0] += presigned.URL_REUSE_S - 50  # reused: 550 s old here, 1250 s on the server's clock
    assert get(g, 0, 10) == DATA[:10]
    assert len(origin.requests) == 3  # refused as expired, then sent signed now
    assert get(g, 0, 10) == DATA[:10]  # the URL signed now is reused
    assert len(origin.requests) == 4
    ahead[0] = 2 * presigned.URL_EXPIRES_S  # even a URL signed now is past its expiry there
    with pytest.raises(AccessDenied, match=r"Request has expired\): a URL signed just now refused so means the "
                                           r"server's clock is ahead"):
        get(g, 0, 10)
    # A policy's refusal without a word of expiry is not sent again (B130).
    origin.requests.clear()
    origin.script = lambda h, s, e: h.answer(403, b"<Error><Code>AccessDenied</Code></Error>") or True
    with pytest.raises(AccessDenied, match="check credentials"):
        get(g, 0, 10)
    assert len(origin.requests) == 1


def test_a_url_refused_as_expired_looks_no_credentials_up(origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal for the URL's age (a server's clock ahead, B136) is not the credentials': it looked them up
    (`on_refused`: a process run or an STS call, and with a source minting keys at each lookup a "have changed"
    warning and every cached URL dropped), and a URL signed now refused as expired too was told to
    `on_refused_again`, which takes it for a bucket policy's refusal (one warning, and AccessDenied looking the
    credentials up once per POLICY_RECHECK_S only). It is now signed anew and sent again without a lookup; a URL signed
    now refused for its credentials after all (a key rotated too) gets the lookup and its second try (B137)."""
    from fsmount.data import presigned

    wall, ahead, key_id, revoked = [time.time()], [700], ["old"], set()
    monkeypatch.setattr(presigned.time, "time", lambda: wall[0])
    monkeypatch.setattr(presigned, "since_boot", lambda: wall[0])
    looked_up: list[str] = []
    again: list[str] = []

    def presign(key: str) -> str:
        return f"{origin.url}/bucket/{key}?X-Amz-Credential={key_id[0]}%2Fscope&X-Amz-Date={int(wall[0])}"

    def answer(h: Handler, s: int, e: int) -> bool:
        signed = int(h.path.rpartition("X-Amz-Date=")[2])
        if wall[0] + ahead[0] - signed > presigned.URL_EXPIRES_S:
            h.answer(403, b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>")
            return True
        if h.path.partition("X-Amz-Credential=")[2].partition("%2F")[0] in revoked:
            h.answer(403, b"<Error><Code>InvalidAccessKeyId</Code></Error>")
            return True
        return False

    def on_refused(code: str) -> bool:  # a source minting keys at each lookup: always "changed"
        looked_up.append(code)
        if key_id[0] in revoked:
            key_id[0] = "new"
        return True

    origin.script = answer
    g = RangeGetter(presign, bucket="bucket", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    on_refused=on_refused, on_refused_again=again.append)
    assert get(g, 0, 10) == DATA[:10]
    wall[0] += presigned.URL_REUSE_S - 50  # reused: past its expiry on the server's clock
    assert get(g, 0, 10) == DATA[:10]
    assert len(origin.requests) == 3 and looked_up == []
    ahead[0] = 2 * presigned.URL_EXPIRES_S  # even a URL signed now is past its expiry there
    with pytest.raises(AccessDenied, match="Request has expired"):
        get(g, 0, 10)
    assert looked_up == [] and again == []
    # Expired, and its key revoked meanwhile: the URL signed now is refused for its key, which is looked up.
    ahead[0] = 700
    revoked.add("old")
    wall[0] += presigned.URL_REUSE_S - 50
    origin.requests.clear()
    assert get(g, 0, 10) == DATA[:10]
    assert looked_up == ["InvalidAccessKeyId"] and again == [] and len(origin.requests) == 3


@pytest.mark.parametrize("said", [b"Request is not valid yet.", b"Request is not yet valid"], ids=["minio", "aws"])
def test_a_url_refused_as_not_valid_yet_says_the_clock_and_looks_nothing_up(origin: Origin, said: bytes) -> None:
    """This machine's clock ahead of the server's by more than the skew it allows: a presigned URL is refused
    AccessDenied, "Request is not valid yet" (MinIO, SeaweedFS's error) or "Request is not yet valid" (AWS S3). It read
    "check credentials", and the refusal looked the credentials up (`on_refused`: a process run or an STS call at every
    read, a source minting keys at each lookup warning "have changed") and sent a URL signed now, which bears the same
    clock's time. It says the clock now, and sends nothing more (B175)."""
    looked_up: list[str] = []
    again: list[str] = []
    origin.script = lambda h, s, e: h.answer(
        403, b"<Error><Code>AccessDenied</Code><Message>" + said + b"</Message></Error>") or True
    g = RangeGetter(lambda key: f"{origin.url}/bucket/{key}?X-Amz-Credential=id%2Fscope", bucket="bucket",
                    pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    on_refused=lambda code: looked_up.append(code) or True, on_refused_again=again.append)
    for _ in range(3):
        with pytest.raises(AccessDenied, match=r"this machine's clock is ahead of the server's") as caught:
            get(g, 0, 10)
        assert caught.value.not_yet_valid and caught.value.errno == errno.EACCES
        assert "check credentials" not in str(caught.value)
    assert looked_up == [] and again == [] and len(origin.requests) == 3


def test_a_refusal_as_expired_names_the_life_urls_are_signed_for() -> None:
    """It said "20 minutes" whatever URL_EXPIRES_S was: the life is the constant's (B175)."""
    from fsmount.data import presigned
    from fsmount.data.store import error_for_status

    for life in (presigned.URL_EXPIRES_S, 3600):
        denied = error_for_status("AccessDenied", 403, "b", "GET 'k'", "Request has expired", url_life_s=life)
        assert isinstance(denied, AccessDenied) and denied.expired
        assert f"by more than a URL's life ({life / 60:g} minutes)" in str(denied), str(denied)


def test_an_idle_connection_the_server_closed_is_replaced_at_once(origin: Origin) -> None:
    def close_after(h: Handler, s: int, e: int) -> bool:
        h.answer(206, DATA[s:e], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"})
        h.close_connection = True  # an idle timeout, as the next request finds out
        return True

    origin.script = close_after
    g = getter(origin)
    assert get(g, 0, 10) == DATA[:10]
    time.sleep(0.1)
    origin.script = None
    started = time.monotonic()
    assert get(g, 10, 10) == DATA[10:20]
    assert time.monotonic() - started < 1
    assert origin.connections == 2


def test_refused_connection_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed
    g = RangeGetter(lambda key: f"http://127.0.0.1:{port}/b/{key}", bucket="b", pool_size=2,
                    connect_timeout=2.0, read_timeout=2.0)
    with pytest.raises(Unreachable):
        get(g, 0, 10)


def test_a_stalled_answer_fails_after_the_read_timeout(origin: Origin) -> None:
    release = threading.Event()
    origin.script = lambda h, s, e: release.wait(10) or True
    g = getter(origin, read_timeout=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(TransientError, match="timed out"):
            get(g, 0, 10)
    finally:
        release.set()
    assert time.monotonic() - started < 3



LONG = random.Random(7).randbytes(3 * RECEIVE_LOWAT + 5)  # longer than twice the raised mark, not a multiple


def serve_long(h: Handler, s: int, e: int) -> bool:
    """LONG at any range of it (a whole-object GET gets all of it), its last 5 bytes 0.2 s after the rest."""
    whole = h.headers["Range"] is None
    s, e = (0, len(LONG)) if whole else (s, e)
    h.send_response(200 if whole else 206)
    h.send_header("Content-Length", str(e - s))
    h.send_header("ETag", ETAG)
    if not whole:
        h.send_header("Content-Range", f"bytes {s}-{e - 1}/{len(LONG)}")
    h.end_headers()
    h.wfile.write(LONG[s:e - 5])
    h.wfile.flush()
    time.sleep(0.2)
    h.wfile.write(LONG[e - 5:e])
    h.wfile.flush()
    return True


@pytest.fixture
def marks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every receive low-water mark the getter sets, in order (it still sets them)."""
    import fsmount.data.presigned as presigned

    seen: list[int] = []
    real = presigned._set_lowat
    monkeypatch.setattr(presigned, "_set_lowat", lambda sock, n: seen.append(n) or real(sock, n))
    return seen


def test_a_long_body_is_received_with_a_raised_low_water_mark_then_the_connection_is_as_before(
        origin: Origin, marks: list[int]) -> None:
    """While the mark is raised a read waits for a MiB (or the timeout): the last bytes of a body and the
    next answer on the kept connection are read at the default mark, so neither waits the read timeout."""
    origin.script = serve_long
    g = getter(origin, read_timeout=2.0)
    started = time.monotonic()
    # Once its last 5 bytes arrive, less than a MiB is left to read: read at the raised mark, that waits.
    assert get(g, 0, len(LONG)) == LONG
    assert marks == [RECEIVE_LOWAT, 1]
    assert get(g, 100, 10) == LONG[100:110]  # 10 bytes on the same connection: the mark is 1 again
    assert get(g, 5, 2 * RECEIVE_LOWAT) == LONG[5:5 + 2 * RECEIVE_LOWAT]  # not longer than twice: not raised
    assert marks == [RECEIVE_LOWAT, 1]
    assert time.monotonic() - started < 1.8  # 3 x 0.2 s held back by the server; no read waited for the 2 s timeout
    assert origin.connections == 1


def test_a_long_whole_object_is_received_with_a_raised_low_water_mark(origin: Origin, marks: list[int]) -> None:
    origin.script = serve_long
    g = getter(origin, read_timeout=2.0)
    started = time.monotonic()
    with g.open("k", "GET k") as body:
        assert body.read(16) == LONG[:16]
        buffer = mmap.mmap(-1, len(LONG))
        assert body.readinto(buffer) == len(LONG) - 16
        assert buffer[:len(LONG) - 16] == LONG[16:]
    assert marks == [RECEIVE_LOWAT, 1]
    assert get(g, 0, 10) == LONG[:10]
    assert time.monotonic() - started < 1.5  # 2 x 0.2 s held back by the server
    assert origin.connections == 1


def test_a_long_body_cut_short_fails_at_once_with_the_mark_raised(origin: Origin) -> None:
    """A server that closes mid-body wakes the reader whatever the mark (end of stream)."""
    def cut(h: Handler, s: int, e: int) -> bool:
        h.send_response(206)
        h.send_header("Content-Length", str(e - s))
        h.send_header("Content-Range", f"bytes {s}-{e - 1}/{len(LONG)}")
        h.send_header("ETag", ETAG)
        h.end_headers()
        h.wfile.write(LONG[s:s + RECEIVE_LOWAT + RECEIVE_LOWAT // 2])
        h.wfile.flush()
        h.close_connection = True
        return True

    origin.script = cut
    g = getter(origin, read_timeout=5.0)
    started = time.monotonic()
    with pytest.raises(TransientError, match="short body|IncompleteRead"):
        get(g, 0, len(LONG))
    assert time.monotonic() - started < 2


# -- whole objects (the shared tier's chunk objects) -------------------------------------------------

def test_open_reads_a_whole_object_into_the_callers_buffer_on_a_kept_alive_connection(origin: Origin) -> None:
    g = getter(origin)
    for _ in range(2):
        with g.open("k", "GET k") as body:
            assert body.size == len(DATA)
            assert body.read(100) == DATA[:100]
            buffer = mmap.mmap(-1, len(DATA))  # bigger than what is left: filled up to the end only
            assert body.readinto(buffer) == len(DATA) - 100
            assert buffer[:len(DATA) - 100] == DATA[100:]
            assert body.read(10) == b""  # at the end
    assert origin.connections == 1
    assert "range" not in origin.requests[0] and "if-match" not in origin.requests[0]


def test_a_body_left_unread_closes_its_connection(origin: Origin) -> None:
    g = getter(origin)
    with g.open("k", "GET k") as body:
        assert body.read(10) == DATA[:10]
    with g.open("k", "GET k") as body:
        assert body.read(len(DATA)) == DATA
    assert origin.connections == 2  # the half-read one was not reused


def test_a_whole_object_cut_short_is_transient(origin: Origin) -> None:
    def cut(h: Handler, s: int, e: int) -> bool:
        h.answer(200, DATA[:10], length=len(DATA))
        h.close_connection = True
        return True

    origin.script = cut
    with getter(origin).open("k", "GET k") as body, pytest.raises(TransientError, match="short body"):
        body.readinto(bytearray(len(DATA)))


@pytest.mark.parametrize("status, code, error", [
    (404, "NoSuchKey", NotFound),
    (503, "SlowDown", TransientError),
    (206, None, TransientError),  # a partial answer to a whole-object GET
])
def test_open_errors_map_through_the_one_mapping_and_keep_the_connection(origin: Origin, status: int,
                                                                         code: str | None, error: type) -> None:
    body = f"<Error><Code>{code}</Code></Error>".encode() if code else DATA[:10]
    origin.script = lambda h, s, e: h.answer(status, body) or True
    g = getter(origin)
    for _ in range(2):  # a waiting node polls for a missing chunk object: one connection for the polls
        with pytest.raises(error):
            g.open("k", "GET k")
    assert origin.connections == (1 if code else 2)


def dribble(h: Handler, body: bytes, piece: int, every_s: float, for_s: float, status: int = 200,
            headers: dict[str, str] | None = None) -> None:
    """A 200 (or `status`, with `headers`) of `body`: its head, then `piece` bytes every `every_s` seconds for `for_s`
    seconds, then the rest at once (so that a reader that waits for it all is not held for ever). Each packet comes in
    time for any read timeout longer than `every_s`."""
    h.send_response(status)
    h.send_header("Content-Length", str(len(body)))
    h.send_header("ETag", ETAG)
    for name, value in (headers or {}).items():
        h.send_header(name, value)
    h.end_headers()
    h.wfile.flush()
    at, until = 0, time.monotonic() + for_s
    with contextlib.suppress(OSError):  # the reader gave up and closed
        while at < len(body) and time.monotonic() < until:
            h.wfile.write(body[at:at + piece])
            h.wfile.flush()
            at += piece
            time.sleep(every_s)
        h.wfile.write(body[at:])
        h.wfile.flush()


@pytest.mark.parametrize("connection", ["keep-alive", "close"])
@pytest.mark.parametrize("how", ["read", "readinto"])
def test_a_whole_object_sent_slowly_ends_at_the_read_timeout(origin: Origin, how: str, connection: str) -> None:
    """B315: each packet of the body in time for the read timeout, the body not: the read ends by the read timeout
    after the request began, with the error a timeout gives (TimedOut), and the connection is not reused. Without the
    deadline it took as long as the server (3 s) and read the whole object. B364: so for an answer that ends its
    connection (`Connection: close`), whose socket the response holds, not the connection."""
    origin.script = lambda h, s, e: dribble(h, DATA, 16, 0.05, 3.0, headers={"Connection": connection}) or True
    g = getter(origin, read_timeout=1.0)
    started = time.monotonic()
    with g.open("k", "GET k") as body, pytest.raises(TimedOut):
        if how == "read":
            body.read(body.size)
        else:
            body.readinto(bytearray(body.size))
    assert time.monotonic() - started < 1.0 + 0.5
    origin.script = None
    with g.open("k", "GET k") as body:
        assert body.read(body.size) == DATA
    assert origin.connections == 2


@pytest.mark.parametrize("how", ["open", "get_into"])
def test_a_whole_object_in_time_leaves_its_kept_connection_with_the_read_timeout(origin: Origin, how: str) -> None:
    """A body received under its deadline sets the socket's timeout to the time left; the connection it gives back
    has the read timeout again: the next answer on it may take nearly all of it. (`get_into`: the same for a ranged
    GET's body, B365.)"""
    def slow_head(h: Handler, s: int, e: int) -> bool:
        time.sleep(1.2)  # within the 1.5 s read timeout, past what the last body left of it
        return False

    def in_time(h: Handler, s: int, e: int) -> bool:
        ranged = h.headers["Range"] is not None
        dribble(h, DATA[s:e], len(DATA) // 4, 0.2, 5.0, 206 if ranged else 200,
                {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"} if ranged else None)
        return True

    origin.script = in_time
    g = getter(origin, read_timeout=1.5)
    if how == "open":
        with g.open("k", "GET k") as body:
            buffer = bytearray(body.size)
            assert body.readinto(buffer) == len(DATA) and buffer == DATA
    else:
        assert get(g, 0, len(DATA)) == DATA
    origin.script = slow_head
    assert get(g, 0, 100) == DATA[:100]
    assert origin.connections == 1


@pytest.mark.parametrize("connection", ["keep-alive", "close"])
def test_a_range_sent_slowly_ends_at_the_read_timeout(origin: Origin, connection: str) -> None:
    """B365: a ranged GET (the origin's chunk fetches) whose body comes a few bytes at a time, each packet in time: it
    ends by the read timeout after the request began (TimedOut, tried again while a READ waits), and its connection is
    not reused. Without the deadline it took as long as the server (3 s), and held its fetch thread so."""
    def slow(h: Handler, s: int, e: int) -> bool:
        dribble(h, DATA[s:e], 16, 0.05, 3.0, 206, {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}",
                                                    "Connection": connection})
        return True

    origin.script = slow
    g = getter(origin, read_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(TimedOut):
        get(g, 0, len(DATA))
    assert time.monotonic() - started < 1.0 + 0.5
    origin.script = None
    assert get(g, 0, len(DATA)) == DATA
    assert get(g, 100, 100) == DATA[100:200]
    assert origin.connections == 2


def dribble_head(h: Handler, status: int, headers: dict[str, str], body: bytes, piece: int, every_s: float,
                 for_s: float) -> None:
    """An answer whose head (status line and headers) comes `piece` bytes every `every_s` seconds for `for_s` seconds,
    then the rest of it and `body` at once: each packet in time for any read timeout longer than `every_s`."""
    lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", f"ETag: {ETAG}"]
    head = ("\r\n".join(lines + [f"{k}: {v}" for k, v in headers.items()]) + "\r\n\r\n").encode()
    at, until = 0, time.monotonic() + for_s
    with contextlib.suppress(OSError):  # the reader gave up and closed
        while at < len(head) and time.monotonic() < until:
            h.wfile.write(head[at:at + piece])
            at += piece
            time.sleep(every_s)
        h.wfile.write(head[at:] + body)


@pytest.mark.parametrize("how", ["get_into", "open", "put", "delete"])
def test_a_head_sent_slowly_ends_at_the_read_timeout(origin: Origin, how: str) -> None:
    """The status line and headers a few bytes at a time, each packet in time: the request ends by the read timeout
    after it began (TimedOut, as for a body sent so), for a ranged GET (the origin's chunk fetches), a whole-object GET,
    a PUT and a DELETE (the shared tier's). Without the deadline on the head it took as long as the server (3 s), and
    held its fetch thread so; the connection is not reused."""
    def slow(h: Handler, s: int, e: int) -> bool:
        if h.command == "GET" and h.headers["Range"] is not None:
            dribble_head(h, 206, {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}, DATA[s:e], 1, 0.05, 3.0)
        else:
            dribble_head(h, 200 if h.command != "DELETE" else 204, {}, DATA if h.command == "GET" else b"", 1, 0.05,
                         3.0)
        return True

    def request() -> None:
        if how == "get_into":
            assert get(g, 0, len(DATA)) == DATA
        elif how == "open":
            with g.open("k", "GET k") as body:
                assert body.read(body.size) == DATA
        elif how == "put":
            assert g.put("k", [b"abc"], "PUT k")
        else:
            g.delete("k", "DELETE k")

    origin.script = slow
    g = getter(origin, read_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(TimedOut):
        request()
    assert time.monotonic() - started < 1.0 + 0.5
    origin.script = None
    request()
    request()
    assert origin.connections == 2


def test_a_connect_counts_in_the_request_s_read_timeout() -> None:
    """A TLS endpoint that takes the connection and never shakes hands, with a connect timeout longer than the read
    timeout: the request ends by the read timeout after it began (the connect is given the time left), not at the
    connect timeout. Without it, the handshake alone waited the connect timeout (3 s). Nothing was sent: Unreachable,
    naming the read timeout that bounded it (B610: B533's rule had made it TimedOut)."""
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    with listener:
        url = f"https://127.0.0.1:{listener.getsockname()[1]}"
        g = RangeGetter(lambda key: f"{url}/b/{key}", bucket="b", pool_size=2, connect_timeout=3.0, read_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(Unreachable, match=r"127.0.0.1:.*: the TLS handshake with it took longer than the read "
                                              r"timeout \(1s\)"):
            get(g, 0, 10)
        assert time.monotonic() - started < 1.0 + 0.5


@contextlib.contextmanager
def blackholed() -> Iterator[tuple[str, int]]:
    """An address whose connects hang, as a firewall that drops SYNs makes them: a listener whose backlog (of one) is
    full, so the kernel drops the next SYNs."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener, socket.socket() as first:
        first.connect(listener.getsockname())  # waits in the backlog, never accepted
        yield listener.getsockname()


class Names:
    """A resolver in place of the system's (`socket.getaddrinfo`, monkeypatched): the names in `answers` resolve to
    what `answers[name]()` returns, (host, port) pairs, after it returns; any other name or an address as the system's
    does. `calls` counts the lookups of each name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: dict[str, Callable[[], list[tuple[str, int]]]] = {}
        self.calls: dict[str, int] = {}
        real = socket.getaddrinfo

        def getaddrinfo(host: str, port: object, *args: object, **kwargs: object) -> list:
            if host not in self.answers or int(kwargs.get("flags", 0)) & socket.AI_NUMERICHOST:  # type: ignore[arg-type]
                return real(host, port, *args, **kwargs)  # type: ignore[arg-type]
            self.calls[host] = self.calls.get(host, 0) + 1
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)
                    for address in self.answers[host]()]

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_with_several_addresses_is_connected_to_within_the_one_connect_timeout(
        monkeypatch: pytest.MonkeyPatch, origin: Origin) -> None:
    """B531: `socket.create_connection` gave each address of a name the whole connect timeout in turn: a name of two
    black-holed addresses took twice the connect timeout (2.0 s here) to be found unreachable. They share it now, and
    one that answers after a black-holed one is still reached within it."""
    names = Names(monkeypatch)
    with blackholed() as one, blackholed() as two:
        names.answers["away.test"] = lambda: [one, two]
        names.answers["half.test"] = lambda: [one, ("127.0.0.1", origin.server_address[1])]
        g = RangeGetter(lambda key: f"http://{key}:{one[1]}/b/k", bucket="b", pool_size=2, connect_timeout=1.0,
                        read_timeout=5.0)
        started = time.monotonic()
        with pytest.raises(Unreachable, match=r"connecting to it took longer than the connect timeout \(1s\)"):
            get(g, 0, 10, key="away.test")
        assert time.monotonic() - started < 1.0 + 0.5
        started = time.monotonic()
        assert get(g, 0, 10, key="half.test") == DATA[:10]
        assert time.monotonic() - started < 1.0 + 0.5


def test_a_tls_handshake_has_what_the_connect_left_of_the_connect_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B530: http.client's HTTPS connect gave the TCP connect the timeout, then TLS's handshake the whole of it again:
    a name that took 0.7 s to resolve, then an endpoint that takes the connection and never shakes hands, took 1.7 s
    to be found unreachable with a connect timeout of 1 s. The connect is bounded once, its name, addresses and
    handshake together."""
    names = Names(monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel accepts; nobody answers
        names.answers["slow.test"] = lambda: time.sleep(0.7) or [listener.getsockname()]
        url = f"https://slow.test:{listener.getsockname()[1]}"
        g = RangeGetter(lambda key: f"{url}/b/{key}", bucket="b", pool_size=2, connect_timeout=1.0, read_timeout=5.0)
        started = time.monotonic()
        with pytest.raises(Unreachable, match="the TLS handshake with it took longer than the connect timeout"):
            get(g, 0, 10)
        assert time.monotonic() - started < 1.0 + 0.5


def test_a_resolver_that_does_not_answer_fails_the_request_by_its_time_saying_dns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B532: a name's resolution was not bounded at all: a local resolver that takes queries and never answers held
    the fetch thread as long as it did (3 s here, then the name resolved; for ever in the field). It fails by the
    connect timeout now, Unreachable saying DNS, or by the request's time where that is less (said so, B610); the
    stuck lookup is left to end, and the requests meanwhile wait for it, not for lookups of their own."""
    names = Names(monkeypatch)
    answer = threading.Event()

    def stuck() -> list[tuple[str, int]]:
        answer.wait(3.0)
        return [("127.0.0.1", 9)]

    names.answers["stuck.test"] = stuck
    timer = threading.Timer(3.0, answer.set)
    timer.start()
    try:
        g = RangeGetter(lambda key: f"http://stuck.test/b/{key}", bucket="b", pool_size=2, connect_timeout=0.5,
                        read_timeout=5.0)
        started = time.monotonic()
        with pytest.raises(Unreachable, match=r"stuck.test:80: resolving the name \(DNS\) of it took longer than "
                                              r"the connect timeout \(0.5s\)"):
            get(g, 0, 10)
        assert time.monotonic() - started < 0.5 + 0.5
        short = RangeGetter(lambda key: f"http://stuck.test/b/{key}", bucket="b", pool_size=2, connect_timeout=5.0,
                            read_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(Unreachable, match=r"stuck.test:80: resolving the name \(DNS\) of it took longer than "
                                              r"the read timeout \(0.5s\)"):
            get(short, 0, 10)
        assert time.monotonic() - started < 0.5 + 0.5
        with pytest.raises(Unreachable, match="DNS"):
            get(g, 0, 10)
        assert names.calls["stuck.test"] == 2  # one lookup per getter at a time, however many tries
    finally:
        answer.set()
        timer.cancel()


def test_a_connect_not_done_is_unreachable_when_both_timeouts_are_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """B610: the shared tier's getter has one timeout for the connect and the request. A first connect, to a
    black-holed address or behind a resolver that does not answer, began a few microseconds into the request, so the
    time left was less than the connect timeout: B533's rule made it TimedOut ("was not done within the request's time
    (the read timeout, ...)"), which the tier's log then named, and which tells a write's caller that the bucket may
    hold what it sent. Nothing was sent: Unreachable, as before B533."""
    names = Names(monkeypatch)
    answer = threading.Event()
    names.answers["stuck.test"] = lambda: answer.wait(2.0) and [("127.0.0.1", 9)] or []
    try:
        with blackholed() as away:
            g = RangeGetter(lambda key: f"http://{key}:{away[1]}/b/k", bucket="b", pool_size=2, connect_timeout=0.5,
                            read_timeout=0.5)
            with pytest.raises(Unreachable, match=r"127.0.0.1:\d+: connecting to it took longer than the connect "
                                                  r"timeout \(0.5s\)"):
                get(g, 0, 10, key="127.0.0.1")
            with pytest.raises(Unreachable, match=r"resolving the name \(DNS\) of it took longer than the connect "
                                                  r"timeout \(0.5s\)"):
                get(g, 0, 10, key="stuck.test")
    finally:
        answer.set()


def test_a_name_that_does_not_exist_is_said_at_once_not_timed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """B532's resolver thread hands the resolver's own error on: a name that does not exist fails as soon as the
    resolver says so, saying DNS, not at the connect timeout as a lookup that took too long (a rule of B532's, guarded:
    the old code said it too, as "[Errno -2] Name or service not known")."""
    names = Names(monkeypatch)

    def no_such_name() -> list[tuple[str, int]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    names.answers["nowhere.test"] = no_such_name
    g = RangeGetter(lambda key: f"http://nowhere.test/b/{key}", bucket="b", pool_size=2, connect_timeout=5.0,
                    read_timeout=5.0)
    started = time.monotonic()
    with pytest.raises(Unreachable, match=r"nowhere.test:80: DNS: its name does not resolve \(Name or service not "
                                          r"known\)"):
        get(g, 0, 10)
    assert time.monotonic() - started < 0.5


def test_the_first_of_many_addresses_has_time_for_a_syn_sent_again(origin: Origin) -> None:
    """B611: a name's addresses shared the connect timeout equally: the first, the one the system prefers, had 0.5 s of
    a 3 s connect timeout among 6, less than the 1 s after which the kernel sends a lost SYN again, so one lost SYN to a
    working endpoint cost its whole share and the request, the other addresses being away. Each now has half the time
    left (the last all of it). The lost SYN here: the listener's backlog is full until 0.2 s in, so the kernel drops the
    first SYN and takes the one sent again."""
    with contextlib.ExitStack() as stack:
        slow = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
        queued = stack.enter_context(socket.socket())
        queued.connect(slow.getsockname())  # fills the backlog: the next SYN is dropped
        away = [stack.enter_context(blackholed()) for _ in range(5)]
        accepted: list[socket.socket] = []
        freed = threading.Timer(0.2, lambda: accepted.append(slow.accept()[0]))
        freed.start()
        stack.callback(lambda: [s.close() for s in accepted])
        stack.callback(freed.join)
        addresses = [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", a)
                     for a in [slow.getsockname(), *away]]
        started = time.monotonic()
        sock = presigned._connect(addresses, started + 3.0)
        with sock:
            assert sock.getpeername() == slow.getsockname()
        assert 0.8 < time.monotonic() - started < 3.0


def test_an_address_of_a_family_this_machine_has_not_is_passed_over(monkeypatch: pytest.MonkeyPatch,
                                                                   origin: Origin) -> None:
    """B612: a name with an IPv6 address first, on a machine with IPv6 turned off (socket(2) refuses the family:
    EAFNOSUPPORT), failed the connect at that address, where `socket.create_connection` went on to the next: the
    socket's making is tried as its connect is. Out of descriptors still fails at once (OutOfResources)."""
    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: object, **kwargs: object) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
        return real(family, *args, **kwargs)  # type: ignore[arg-type]

    names = Names(monkeypatch)
    names.answers["dual.test"] = lambda: [("127.0.0.1", origin.server_address[1])]
    real_answer = socket.getaddrinfo

    def ipv6_first(host: str, port: object, *args: object, **kwargs: object) -> list:
        found = real_answer(host, port, *args, **kwargs)  # type: ignore[arg-type]
        if host != "dual.test":
            return found
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", port, 0, 0)), *found]

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    g = RangeGetter(lambda key: f"http://dual.test:{origin.server_address[1]}/b/{key}", bucket="b", pool_size=2,
                    connect_timeout=2.0, read_timeout=2.0)
    monkeypatch.setattr(socket, "socket", no_ipv6)
    assert get(g, 0, 10) == DATA[:10]


def test_a_kept_connection_found_closed_late_is_timed_out_when_its_reconnect_runs_out_of_time(
        monkeypatch: pytest.MonkeyPatch, origin: Origin) -> None:
    """B533: a kept-alive connection the server closed only after holding the request 0.8 s of the 1 s read timeout
    was opened again with the 0.2 s left; a connect that did not make it in them was "cannot reach the endpoint ...:
    timed out" (Unreachable, retried as an endpoint away) though the request's own time had run out: TimedOut now,
    saying so."""
    names = Names(monkeypatch)
    with blackholed() as away:
        at = [("127.0.0.1", origin.server_address[1])]
        names.answers["moving.test"] = lambda: at
        g = RangeGetter(lambda key: f"http://moving.test:{at[0][1]}/b/{key}", bucket="b", pool_size=2,
                        connect_timeout=2.0, read_timeout=1.0)
        assert get(g, 0, 10) == DATA[:10]

        def held_then_closed(h: Handler, s: int, e: int) -> bool:
            time.sleep(0.8)
            h.close_connection = True
            return True

        origin.script = held_then_closed
        at[:] = [away]
        started = time.monotonic()
        with pytest.raises(TimedOut, match="connecting to moving.test:.* was not done within the request's time"):
            get(g, 10, 10)
        assert time.monotonic() - started < 1.0 + 0.5


@pytest.mark.parametrize("how", ["open", "get_into"])
def test_a_body_sent_slowly_over_tls_ends_at_the_read_timeout(tls_origin: tuple[Origin, Path], how: str) -> None:
    """B315, B365 over TLS: the deadline sits under the TLS socket's reader as under a plain one, with the same
    meaning (a TLS receive waits at most the socket's timeout); a body sent in time there keeps its connection."""
    origin, ca = tls_origin

    def slow(h: Handler, s: int, e: int) -> bool:
        if h.headers["Range"] is None:
            dribble(h, DATA, 16, 0.05, 3.0)
        else:
            dribble(h, DATA[s:e], 16, 0.05, 3.0, 206, {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"})
        return True

    url = origin.url.replace("http://", "https://")
    g = RangeGetter(lambda key: f"{url}/b/{key}", bucket="b", pool_size=2, connect_timeout=2.0, read_timeout=1.0,
                    ssl_context=ssl.create_default_context(cafile=str(ca)))

    def read_all() -> bytes:
        if how == "open":
            with g.open("k", "GET k") as body:
                return body.read(body.size)
        return get(g, 0, len(DATA))

    origin.script = slow
    started = time.monotonic()
    with pytest.raises(TimedOut):
        read_all()
    assert time.monotonic() - started < 1.0 + 0.5
    origin.script = lambda h, s, e: dribble(h, DATA[s:e], len(DATA) // 4, 0.1, 5.0, 200 if h.headers["Range"] is None
                                            else 206, {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}) or True
    assert read_all() == DATA  # in 0.4 s, the timeout set down on the way
    origin.script = None
    assert read_all() == DATA
    assert origin.connections == 2


def test_the_store_opens_objects_by_the_presigned_path(origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_on(origin, monkeypatch)
    with store.open_object("a key") as body:
        assert body.read(body.size) == DATA
    assert origin.requests[0]["path"].startswith("/bucket/a%20key?X-Amz-Algorithm=AWS4-HMAC-SHA256&")
    origin.script = lambda h, s, e: h.answer(404, b"<Error><Code>NoSuchKey</Code></Error>") or True
    assert store.open_object("a key") is None
    assert store.get_object("a key") is None


def test_put_sends_the_parts_as_one_body_on_a_kept_alive_connection(origin: Origin) -> None:
    g = getter(origin)
    data = mmap.mmap(-1, 3000)
    data[:] = DATA[:3000]
    g.put("a", [b"head", bytes(4), data], "PUT a")
    g.put("b", [b"x"], "PUT b")
    assert [r["body"] for r in origin.requests] == [b"head" + bytes(4) + DATA[:3000], b"x"]
    assert origin.requests[0]["content-length"] == "3008" and origin.requests[0]["method"] == "PUT"
    assert origin.connections == 1


@pytest.mark.parametrize("status, code, error", [
    (403, "AccessDenied", AccessDenied),
    (503, "SlowDown", TransientError),
    (507, "InsufficientStorage", TransientError),
])
def test_a_refused_put_maps_through_the_one_mapping(origin: Origin, status: int, code: str, error: type) -> None:
    presigned: list[str] = []
    origin.script = lambda h, s, e: h.answer(status, f"<Error><Code>{code}</Code></Error>".encode()) or True
    with pytest.raises(error):
        getter(origin, presigned).put("a", [b"body"], "PUT a")
    assert presigned == (["a", "a"] if status == 403 else ["a"])  # a 403 signs again, once


def test_the_store_puts_unconditional_objects_by_the_presigned_path(origin: Origin,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_on(origin, monkeypatch)
    assert store.put_object("chunks/a b", [b"head", b"data"]) is True
    request = origin.requests[0]
    assert request["method"] == "PUT" and request["body"] == b"headdata"
    assert request["path"].startswith("/bucket/chunks/a%20b?X-Amz-Algorithm=AWS4-HMAC-SHA256&")


@pytest.mark.parametrize("status", [412, 409])
def test_a_conditional_put_says_whether_it_created_the_key(origin: Origin, status: int) -> None:
    """A claim: If-None-Match: * on the presigned PUT; 412 (the key exists) or 409 (a concurrent conditional
    write) is False, not an error, and the connection stays fit."""
    g = getter(origin)
    assert g.put("claim", [b"1.0 node"], "PUT claim", only_if_absent=True) is True
    origin.script = lambda h, s, e: h.answer(status, b"<Error><Code>PreconditionFailed</Code></Error>") or True
    assert g.put("claim", [b"1.0 other"], "PUT claim", only_if_absent=True) is False
    origin.script = None
    assert g.put("chunk", [b"x"], "PUT chunk") is True
    assert [r.get("if-none-match") for r in origin.requests] == ["*", "*", None]
    assert origin.connections == 1


def test_the_store_claims_by_the_presigned_path(origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_on(origin, monkeypatch)
    assert store.put_object("claims/a", b"1.0 node", only_if_absent=True) is True
    origin.script = lambda h, s, e: h.answer(412, b"<Error><Code>PreconditionFailed</Code></Error>") or True
    assert store.put_object("claims/a", b"1.0 node", only_if_absent=True) is False
    assert [r["if-none-match"] for r in origin.requests] == ["*", "*"]
    assert all(r["path"].startswith("/bucket/claims/a?X-Amz-Algorithm=AWS4-HMAC-SHA256&") for r in origin.requests)


def test_delete_on_a_kept_alive_connection_and_its_errors_through_the_one_mapping(origin: Origin) -> None:
    presigned: list[str] = []
    g = getter(origin, presigned)
    g.delete("claims/a", "DELETE a")
    g.delete("claims/b", "DELETE b")
    assert [(r["method"], r["path"].split("?")[0]) for r in origin.requests] == \
        [("DELETE", "/bucket/claims/a"), ("DELETE", "/bucket/claims/b")]
    assert origin.connections == 1
    origin.script = lambda h, s, e: h.answer(403, b"<Error><Code>AccessDenied</Code></Error>") or True
    with pytest.raises(AccessDenied):
        g.delete("claims/c", "DELETE c")
    assert presigned[-2:] == ["claims/c", "claims/c"]  # a 403 signs again, once
    origin.script = lambda h, s, e: h.answer(503, b"<Error><Code>SlowDown</Code></Error>") or True
    with pytest.raises(TransientError):
        g.delete("claims/c", "DELETE c")


def test_the_store_deletes_by_the_presigned_path(origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_on(origin, monkeypatch)
    store.delete_object("claims/a b")
    request = origin.requests[0]
    assert request["method"] == "DELETE"
    assert request["path"].startswith("/bucket/claims/a%20b?X-Amz-Algorithm=AWS4-HMAC-SHA256&")


def store_on(origin: Origin, monkeypatch: pytest.MonkeyPatch, **config: object):  # noqa: ANN201
    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store, boto3_store

    monkeypatch.setattr(boto3_store, "PRESIGNED_BACKOFF_BASE", 0.001)
    for var, value in (("AWS_ACCESS_KEY_ID", "AKIDTEST"), ("AWS_SECRET_ACCESS_KEY", "s" * 40),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(var, value)
    return Boto3Store(StoreConfig("bucket", endpoint_url=origin.url, addressing_style="path", **config))


def test_the_store_retries_transient_answers_a_bounded_number_of_times(origin: Origin,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fsmount.data.boto3_store import PRESIGNED_GET_ATTEMPTS

    store = store_on(origin, monkeypatch)
    failures = iter(range(PRESIGNED_GET_ATTEMPTS - 1))
    origin.script = lambda h, s, e: next(failures, None) is not None and (h.answer(503, b"") or True)
    buffer = mmap.mmap(-1, 100)
    assert store.get_range("some key", ETAG, 10, 110, buffer) is buffer
    assert bytes(buffer) == DATA[10:110]
    assert len(origin.requests) == PRESIGNED_GET_ATTEMPTS
    request = origin.requests[0]
    assert request["path"].startswith("/bucket/some%20key?X-Amz-Algorithm=AWS4-HMAC-SHA256&")
    assert "X-Amz-Credential=AKIDTEST" in request["path"]
    origin.requests.clear()
    origin.script = lambda h, s, e: h.answer(503, b"<Error><Code>SlowDown</Code></Error>") or True
    with pytest.raises(TransientError, match="SlowDown"):
        store.get_range("some key", ETAG, 10, 110)
    assert len(origin.requests) == PRESIGNED_GET_ATTEMPTS
    # Not worth another try: one request.
    origin.requests.clear()
    origin.script = lambda h, s, e: h.answer(412, b"") or True
    with pytest.raises(PreconditionFailed):
        store.get_range("some key", ETAG, 10, 110)
    assert len(origin.requests) == 1


def test_a_range_that_timed_out_is_not_tried_again_by_the_store(origin: Origin,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """B420: a ranged GET that got no answer within the read timeout is `TimedOut` after that one request: whether to
    try again is the level stack's (while a READ waits for the chunk). The store tried it 5 times in its thread, so a
    chunk that stalls on every try held its fetch thread for 5 read timeouts."""
    release = threading.Event()
    origin.script = lambda h, s, e: release.wait(10) or True
    store = store_on(origin, monkeypatch, read_timeout=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(TimedOut):
            store.get_range("k", ETAG, 0, 100)
    finally:
        release.set()
    assert time.monotonic() - started < 0.5 + 0.5
    assert len(origin.requests) == 1
    assert store.get_retries == 0


def test_no_sign_request_sends_a_plain_url(origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_on(origin, monkeypatch, no_sign_request=True)
    assert bytes(store.get_range("k", ETAG, 0, 10)) == DATA[:10]
    assert origin.requests[0]["path"] == "/bucket/k"
    assert "authorization" not in origin.requests[0]


# -- TLS: the CA bundle boto3 would use, and a refused certificate -------------------------------------------------

def make_ca_and_cert(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA (its PEM) and a certificate it signed for 127.0.0.1 (cert and key PEMs), made with `cryptography`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("modelfs test CA")).issuer_name(name("modelfs test CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@pytest.fixture
def tls_origin(origin: Origin, tmp_path: Path) -> Iterator[tuple[Origin, Path]]:
    """The origin behind TLS, with a certificate of a CA of its own; (the origin, the CA's PEM)."""
    ca, cert, key = make_ca_and_cert(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    origin.socket = context.wrap_socket(origin.socket, server_side=True)
    yield origin, ca


def tls_getter(origin: Origin, context: ssl.SSLContext | None) -> RangeGetter:
    url = origin.url.replace("http://", "https://")
    return RangeGetter(lambda key: f"{url}/b/{key}", bucket="b", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                       ssl_context=context)


def test_a_refused_certificate_fails_at_once_and_says_so(tls_origin: tuple[Origin, Path]) -> None:
    """A certificate the CA bundle does not vouch for was taken for an endpoint that cannot be reached: tried again
    with backoff, each READ failed at --read-timeout as "timed out", and the cause was at debug level only."""
    origin, _ = tls_origin
    began = time.monotonic()
    with pytest.raises(StoreError, match=r"TLS: the certificate of 127\.0\.0\.1:\d+ was refused") as err:
        get(tls_getter(origin, ssl.create_default_context()), 0, 10)
    assert not isinstance(err.value, (Unreachable, TransientError)) and time.monotonic() - began < 1.5


@pytest.mark.parametrize("variable", ["AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE"])
def test_reads_trust_the_ca_bundle_botocore_would(tls_origin: tuple[Origin, Path], monkeypatch: pytest.MonkeyPatch,
                                                  variable: str) -> None:
    """botocore takes REQUESTS_CA_BUNDLE where no ca_bundle is set (AWS_CA_BUNDLE, the profile's); the reads took
    only the latter, so a mount that listed through boto3 failed every read."""
    from fsmount.data.boto3_store import _ssl_context

    origin, ca = tls_origin
    for name in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(ca))
    context = _ssl_context(None, origin.url.replace("http://", "https://"))
    assert get(tls_getter(origin, context), 100, 10) == DATA[100:110]


def test_no_ca_bundle_is_read_for_an_http_endpoint_and_an_unreadable_one_is_named(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AWS_CA_BUNDLE naming a missing file failed even a plain-http mount, with "[Errno 2] No such file or
    directory" and no file name."""
    from fsmount.data.boto3_store import _ssl_context

    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    assert _ssl_context(None, "http://127.0.0.1:9000") is None
    with pytest.raises(StoreError, match=r"cannot use the CA bundle .*missing\.pem \(AWS_CA_BUNDLE or the profile"):
        _ssl_context(None, "https://127.0.0.1:9000")


def test_the_mounts_pre_flight_names_a_ca_bundle_it_cannot_read(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """B232: the reads named an unreadable bundle (above), but `modelfs mount` never got that far: its pre-flight
    listing went through botocore, which said "listing bucket 'b': SSL validation failed for https://... [Errno 2] No
    such file or directory", naming neither the file nor the variable that gave it."""
    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    for name in [n for n in os.environ if n.startswith("AWS_") or n == "REQUESTS_CA_BUNDLE"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with socket.create_server(("127.0.0.1", 0)) as listening:  # connects, never answers: TLS is what fails
        cfg = StoreConfig(bucket="b", endpoint_url=f"https://127.0.0.1:{listening.getsockname()[1]}",
                          region="us-east-1")
        with pytest.raises(StoreError, match=r"cannot use the CA bundle .*missing\.pem \(AWS_CA_BUNDLE or the profile"):
            Boto3Store(cfg, preflight=True).check_bucket("")


def test_a_machine_out_of_descriptors_is_said_and_not_retried_as_an_endpoint_away(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE from connect(2) was "cannot reach the endpoint", tried again until --read-timeout."""
    from fsmount.data import OutOfResources
    from fsmount.data.boto3_store import translate_error

    def out_of_files(*args: object, **kwargs: object) -> socket.socket:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(socket, "socket", out_of_files)  # socket(2) is where EMFILE comes from
    g = RangeGetter(lambda key: f"http://127.0.0.1:9/b/{key}", bucket="b", pool_size=2, connect_timeout=2.0,
                    read_timeout=2.0)
    with pytest.raises(OutOfResources, match=r"Too many open files on this machine \(raise the daemon's open-file "
                                             r"limit: `ulimit -n`"):
        get(g, 0, 10)
    from botocore.exceptions import EndpointConnectionError
    wrapped = EndpointConnectionError(endpoint_url="http://h", error=OSError(errno.ENFILE, "Too many open files"))
    assert isinstance(translate_error(wrapped, "b", "HEAD 'k'"), OutOfResources)


def test_no_proxy_with_a_port_is_read_as_botocore_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore matches NO_PROXY against host and port; the reads matched the host alone, so the two paths
    disagreed about which requests go through the proxy."""
    from fsmount.data.presigned import proxied

    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)  # urllib prefers the lower-case ones
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1:9000")
    assert not proxied("http://127.0.0.1:9000/b")
    assert proxied("http://127.0.0.1:9001/b")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert not proxied("http://127.0.0.1:9001/b")


def bucket_in_eu_west_1(origin: Origin, region: list[str], told: list[str]
                        ) -> tuple[Callable[[str], str], Callable[[str], None]]:
    """`origin` answers as S3 does a request signed for another region than the bucket's (eu-west-1): 301 and the
    bucket's region. Returns a presigner that signs for `region[0]`, and an `on_wrong_region` that appends the
    region it is told to `told` and signs for it from then on."""
    def presign(key: str) -> str:
        return f"{origin.url}/b/{key}?X-Amz-Credential=k%2F20261205%2F{region[0]}%2Fs3%2Faws4_request"

    def redirect(h: Handler, start: int, end: int) -> bool:
        if "us-east-1" not in h.path:
            return False
        h.answer(301, b"<Error><Code>PermanentRedirect</Code><Message>must be addressed using the specified "
                      b"endpoint</Message></Error>", {"x-amz-bucket-region": "eu-west-1"})
        return True

    def on_wrong_region(bucket_region: str) -> None:
        told.append(bucket_region)
        region[0] = bucket_region

    origin.script = redirect
    return presign, on_wrong_region


def test_a_bucket_in_another_region_is_read_with_urls_signed_for_its_region(origin: Origin) -> None:
    """botocore follows S3's 301 PermanentRedirect for listings (re-signed for the bucket's region), so a mount
    whose AWS configuration named another region listed, and every presigned read failed "PermanentRedirect"."""
    region, told = ["us-east-1"], []
    presign, on_wrong_region = bucket_in_eu_west_1(origin, region, told)
    g = RangeGetter(presign, bucket="b", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                    on_wrong_region=on_wrong_region)
    assert get(g, 100, 10) == DATA[100:110] and get(g, 200, 10, key="other") == DATA[200:210]
    assert told == ["eu-west-1"] and len(origin.requests) == 3  # one refused, then two in the right region
    plain = RangeGetter(presign, bucket="b", pool_size=2, connect_timeout=2.0, read_timeout=2.0)
    region[0] = "us-east-1"
    with pytest.raises(StoreError, match=r"the bucket is in region eu-west-1 \(pass --region eu-west-1"):
        get(plain, 0, 10)
    # A GET signed before another one switched the region is sent again, though the switch is done already.
    switched = RangeGetter(presign, bucket="b", pool_size=2, connect_timeout=2.0, read_timeout=2.0,
                           on_wrong_region=lambda bucket_region: None)
    # signed for us-east-1 before the switch
    switched._urls["k"] = ((since_boot(), time.time()), 0, float("inf"), presign("k"))
    region[0] = "eu-west-1"
    assert get(switched, 0, 10) == DATA[:10]
    # Signed for the bucket's region already, and refused all the same (an --endpoint-url of another region): one
    # request, not one more per GET.
    origin.script = lambda h, s_, e: h.answer(301, b"<Error><Code>PermanentRedirect</Code></Error>",
                                              {"x-amz-bucket-region": "eu-west-1"}) or True
    origin.requests.clear()
    with pytest.raises(StoreError, match=r"the bucket is in region eu-west-1"):
        get(switched, 100, 10, key="third")
    assert len(origin.requests) == 1


def test_a_shared_tier_in_another_region_is_written_and_read_with_urls_signed_for_its_region(origin: Origin) -> None:
    """The tier's PUTs, DELETEs and whole-object GETs did not follow a bucket in another region as ranged GETs do: a
    tier bucket elsewhere than the AWS configuration's region was read and written by none of them."""
    region, told = ["us-east-1"], []
    presign, on_wrong_region = bucket_in_eu_west_1(origin, region, told)
    for request in ("put", "delete", "open"):
        region[0] = "us-east-1"
        g = RangeGetter(presign, presign_put=presign, presign_delete=presign, bucket="b", pool_size=2,
                        connect_timeout=2.0, read_timeout=2.0, on_wrong_region=on_wrong_region)
        origin.requests.clear()
        if request == "put":
            assert g.put("k", [b"body"], "PUT k") is True
            assert [r["body"] for r in origin.requests] == [b"body", b"body"]
        elif request == "delete":
            g.delete("k", "DELETE k")
        else:
            with g.open("k", "GET k") as body:
                assert body.read(len(DATA)) == DATA
        assert len(origin.requests) == 2 and "eu-west-1" in origin.requests[1]["path"], request
    assert told == ["eu-west-1"] * 3
    # Signed for the bucket's region and refused all the same (another region's endpoint): one request, an error.
    origin.script = lambda h, s_, e: h.answer(301, b"<Error><Code>PermanentRedirect</Code></Error>",
                                              {"x-amz-bucket-region": "eu-west-1"}) or True
    origin.requests.clear()
    with pytest.raises(StoreError, match=r"the bucket is in region eu-west-1"):
        g.put("k", [b"body"], "PUT k")
    assert len(origin.requests) == 1


@pytest.mark.parametrize("framing", ["chunked", "until_close"])
def test_a_body_without_a_length_that_goes_on_past_the_range_is_refused(origin: Origin, framing: str) -> None:
    """With no Content-Length (a chunked body, or one that ends with the connection), a body longer than the range was
    read up to the range's length and served: a server that ignored the range (206 and the right Content-Range, then
    the whole object), or compressed the bytes on the way, gave wrong bytes with no error (a tester's proxy)."""
    whole = [True]

    def answer(h: Handler, start: int, end: int) -> bool:
        body = DATA if whole[0] else DATA[start:end]  # the whole object from offset 0, whatever was asked; or the range
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(DATA)}")
        h.send_header("ETag", ETAG)
        if framing == "chunked":
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        else:
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(body)
            h.close_connection = True
        h.wfile.flush()
        return True

    origin.script = answer
    with pytest.raises(TransientError, match="server sent more than the 100 bytes asked for"):
        get(getter(origin), 4096, 100)
    whole[0] = False  # the same framing, ending where the range does: read
    assert get(getter(origin), 4096, 100) == DATA[4096:4196]


def test_one_version_s_etag_in_another_form_is_not_another_version(origin: Origin) -> None:
    """A server whose GETs give the ETag weak, unquoted or in capitals where its listing gave `"abc"` failed every
    read "object changed in the bucket", nothing having changed (a tester's proxy)."""
    for form in ('W/"abc"', "abc", '"ABC"', ' "abc" '):
        origin.script = lambda h, s, e, form=form: h.answer(  # noqa: B023
            206, DATA[s:e], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}, etag=form) or True
        assert get(getter(origin), 100, 10) == DATA[100:110], form
    origin.script = lambda h, s, e: h.answer(206, DATA[s:e], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"},
                                             etag='"def"') or True
    with pytest.raises(PreconditionFailed, match=r'object changed in the bucket since the mount saw the version '
                                                 r'asked for \(ETag "def", opened as "abc"\)'):
        get(getter(origin), 100, 10)


def test_a_redirect_is_said_for_what_it_is(origin: Origin) -> None:
    """A 307 or a 304 to a GET was logged as a bare number ("GET k: 307"), saying nothing (a tester's proxy)."""
    origin.script = lambda h, s, e: h.answer(307, b"", {"Location": "http://elsewhere:9000/k"}) or True
    with pytest.raises(StoreError, match=r"GET k: the server answered 307 Temporary Redirect \(to "
                                         r"http://elsewhere:9000/k\), which S3 does not for an object"):
        get(getter(origin), 0, 10)


def test_without_if_match_the_version_is_checked_by_the_answers_etag_which_must_be_there(origin: Origin) -> None:
    """For a server that refuses its own ETags in If-Match (Boto3Store._refuses_its_own_etag): no If-Match sent; an
    answer of another ETag, or of none (nothing else would pin the version then), is refused."""
    g = getter(origin)
    buffer = mmap.mmap(-1, 100)
    g.get_into("k", ETAG, 0, buffer, "GET k", if_match=False)
    assert bytes(buffer) == DATA[:100] and "if-match" not in origin.requests[-1]
    origin.script = lambda h, start, end: h.answer(206, DATA[start:end], {"Content-Range": f"bytes {start}-{end - 1}/"
                                                                          f"{len(DATA)}"}, etag='"other"') or True
    with pytest.raises(PreconditionFailed, match="object changed"):
        g.get_into("k", ETAG, 0, buffer, "GET k", if_match=False)

    class NoETag(Handler):
        def end_headers(self) -> None:
            self._headers_buffer = [line for line in self._headers_buffer if not line.lower().startswith(b"etag:")]
            super().end_headers()
    origin.script = None
    origin.RequestHandlerClass = NoETag
    with pytest.raises(StoreError, match="sent no ETag, and refuses If-Match"):
        g.get_into("k2", ETAG, 0, buffer, "GET k2", if_match=False)
    g.get_into("k2", ETAG, 0, buffer, "GET k2")  # with If-Match, the server's 206 is the version's
    assert bytes(buffer) == DATA[:100]


def test_an_answer_whose_total_is_not_the_size_pinned_is_refused_unread(origin: Origin) -> None:
    """A HEAD cut inside its Content-Length line gives a smaller size with the right ETag; every GET matched If-Match
    and the file read back short as if whole (B209). The Content-Range total (or a whole-object 200's length) must be
    the size the version was pinned at; `*` says nothing and passes, as does a GET given no size."""
    g = getter(origin)
    buffer = mmap.mmap(-1, 100)
    g.get_into("k", ETAG, 100, buffer, "GET k", size=len(DATA))
    assert bytes(buffer) == DATA[100:200]
    g.get_into("k", ETAG, 100, buffer, "GET k")  # no size known: not checked
    with pytest.raises(SizeChanged, match=f"the server says the object is {len(DATA)} bytes, its version was pinned "
                                          f"at {len(DATA) - 1000} bytes"):
        g.get_into("k", ETAG, 100, buffer, "GET k", size=len(DATA) - 1000)
    assert isinstance(SizeChanged(""), PreconditionFailed)  # the handle EIO, the name looked up again (operations)
    origin.script = lambda h, s, e: h.answer(200, DATA) or True  # a whole-object answer: its length is the total
    whole = mmap.mmap(-1, len(DATA))
    with pytest.raises(SizeChanged):
        g.get_into("k", ETAG, 0, whole, "GET k", size=len(DATA) + 1)
    g.get_into("k", ETAG, 0, whole, "GET k", size=len(DATA))
    assert bytes(whole) == DATA
    origin.script = lambda h, s, e: h.answer(206, DATA[s:e], {"Content-Range": f"bytes {s}-{e - 1}/*"}) or True
    g.get_into("k", ETAG, 100, buffer, "GET k", size=1)
    assert bytes(buffer) == DATA[100:200]


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_the_store_refuses_a_size_other_than_pinned_once_and_keeps_if_match(origin: Origin,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          client: str) -> None:
    """Both GET clients (`--get-client`): a total other than the size pinned is SizeChanged at the first answer, not
    retried (the same answer would come again), and not taken for a server refusing its own ETags (no HEAD asked, If-
    Match still sent)."""
    store = store_on(origin, monkeypatch, get_client=client)
    with pytest.raises(SizeChanged, match=f"its version was pinned at {len(DATA) // 2} bytes"):
        store.get_range("k", ETAG, 10, 110, None, len(DATA) // 2)
    assert len(origin.requests) == 1
    assert bytes(store.get_range("k", ETAG, 10, 110, None, len(DATA))) == DATA[10:110]
    assert origin.requests[-1]["if-match"] == ETAG and len(origin.requests) == 2
    origin.script = lambda h, s, e: h.answer(200, DATA) or True  # a whole-object answer: its length is the total
    with pytest.raises(SizeChanged):
        store.get_range("k", ETAG, 0, len(DATA), None, len(DATA) + 1)
    assert bytes(store.get_range("k", ETAG, 0, len(DATA), None, len(DATA))) == DATA


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_a_whole_object_200_longer_than_the_size_pinned_is_refused_not_retried(origin: Origin,
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              client: str) -> None:
    """A server that answers a ranged GET with the whole object (200), to a version pinned smaller than it is (a HEAD
    cut inside its Content-Length line, B209): the presigned client took it for a 200 that is not the range asked for,
    a transient error retried to the last try, then an EIO that left the wrong size pinned for the TTL; the boto3
    client refused the version at once. Both refuse it now (SizeChanged), with one GET (B214)."""
    store = store_on(origin, monkeypatch, get_client=client)
    origin.script = lambda h, s, e: h.answer(200, DATA) or True
    pinned = len(DATA) - 1000
    with pytest.raises(SizeChanged, match=f"object is {len(DATA)} bytes, its version was pinned at {pinned}"):
        store.get_range("k", ETAG, 0, pinned, None, pinned)
    assert len(origin.requests) == 1


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_a_200_that_does_not_name_the_version_is_retried_not_taken_for_its_size(origin: Origin,
                                                                               monkeypatch: pytest.MonkeyPatch,
                                                                               client: str) -> None:
    """A 200 to a ranged GET without the version's ETag (a proxy's page of its own, for a moment) is not the object:
    its length is no size of it. The boto3 client took it for the whole object of another size (B209's check):
    SizeChanged at once, the version refused for GONE_FOR_S and its inode superseded, where it had been a transient
    error, tried again. It is that again, in both clients (B215)."""
    store = store_on(origin, monkeypatch, get_client=client)
    pages = [1]  # the answers that are the proxy's page; the next ones the object's

    def answer(h: Handler, s: int, e: int) -> bool:
        if pages[0] > 0:
            pages[0] -= 1
            h.answer(200, b"<html>one moment</html>", etag="")
        else:
            h.answer(206, DATA[s:e], {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"})
        return True

    origin.script = answer
    assert bytes(store.get_range("k", ETAG, 0, 100, None, len(DATA))) == DATA[:100]  # the next try: the object
    assert len(origin.requests) == 2


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_the_stores_range_sent_slowly_ends_at_the_read_timeout_in_both_clients(origin: Origin,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             client: str) -> None:
    """B770: with --get-client boto3 a range whose body came 16 bytes every 50 ms (each packet within botocore's read
    timeout, which is one receive's) was read for as long as the server went on: 3 s at a read timeout of 1 s. The
    body is now read by the read timeout after the request began, as a presigned GET's (B365): TimedOut, one
    request (not tried again in the fetch thread, B420); then exact once the origin sends it at once."""
    store = store_on(origin, monkeypatch, get_client=client, read_timeout=1.0)
    origin.script = lambda h, s, e: dribble(h, DATA[s:e], 16, 0.05, 3.0, 206,
                                            {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}) or True
    started = time.monotonic()
    with pytest.raises(TimedOut):
        store.get_range("k", ETAG, 0, len(DATA), None, len(DATA))
    assert time.monotonic() - started < 1.0 + 0.5
    assert len(origin.requests) == 1
    origin.script = None
    assert bytes(store.get_range("k", ETAG, 0, len(DATA), None, len(DATA))) == DATA
    buffer = mmap.mmap(-1, 100)
    assert store.get_range("k", ETAG, 10, 110, buffer, len(DATA)) is buffer
    assert bytes(buffer) == DATA[10:110]


@pytest.mark.parametrize("client", ["presigned", "boto3"])
def test_the_stores_whole_object_sent_slowly_ends_at_the_read_timeout_in_both_clients(
        origin: Origin, monkeypatch: pytest.MonkeyPatch, client: str) -> None:
    """B771: the shared tier's whole-object GET (`open_object`) on the boto3 path (an HTTP(S) proxy from the
    environment) read a body sent 16 bytes every 50 ms for as long as the server went on (3 s at a read timeout, the
    tier's request timeout, of 1 s). It ends by the read timeout after the request began, as the presigned path's
    (B315): TimedOut; then exact."""
    store = store_on(origin, monkeypatch, get_client=client, read_timeout=1.0)
    origin.script = lambda h, s, e: dribble(h, DATA, 16, 0.05, 3.0) or True
    started = time.monotonic()
    with pytest.raises(TimedOut), store.open_object("k") as body:
        body.read(body.size)
    assert time.monotonic() - started < 1.0 + 0.5
    origin.script = None
    with store.open_object("k") as body:
        assert body.read(body.size) == DATA
    assert store.get_object("k") == DATA


def test_a_deadline_met_as_urllib3_pools_the_connection_does_not_shut_the_pooled_connection(
        origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """B860: B770's timer, firing as urllib3 gave the connection back to its pool (inside the read that took the
    body's last bytes), shut down the reading side of a connection that was no longer the body's: the body read whole
    was TimedOut, and the pooled connection (or a request already sent on it) was cut. The timer's shutdown and
    urllib3's release now meet under one lock: the body read whole is taken, and its connection serves the next
    GET. (The timer is made to fire in that window: in its own thread, while `_put_conn` runs.)"""
    import urllib3.connectionpool

    from fsmount.data import boto3_store

    store = store_on(origin, monkeypatch, get_client="boto3", read_timeout=5.0)
    assert bytes(store.get_range("k", ETAG, 0, 100, None, len(DATA))) == DATA[:100]
    readers: list[boto3_store.ObjectReader] = []
    init = boto3_store.ObjectReader.__init__

    def recording_init(self: boto3_store.ObjectReader, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        readers.append(self)

    put_conn = urllib3.connectionpool.HTTPConnectionPool._put_conn
    fired: list[threading.Thread] = []

    def put_conn_as_the_timer_fires(pool: object, conn: object) -> None:
        put_conn(pool, conn)
        if readers and not fired:
            fired.append(threading.Thread(target=readers[-1]._time_out, daemon=True))
            fired[0].start()
            fired[0].join(0.5)  # (it waits for the release, with the fix)

    monkeypatch.setattr(boto3_store.ObjectReader, "__init__", recording_init)
    monkeypatch.setattr(urllib3.connectionpool.HTTPConnectionPool, "_put_conn", put_conn_as_the_timer_fires)
    assert bytes(store.get_range("k", ETAG, 100, 300, None, len(DATA))) == DATA[100:300]
    assert fired, "the connection was not given back inside the read"
    fired[0].join(5)
    assert bytes(store.get_range("k", ETAG, 300, 400, None, len(DATA))) == DATA[300:400]
    assert origin.connections == 1, "the pooled connection was shut down"


def test_a_body_sent_slowly_ends_at_the_read_timeout_with_a_urllib3_without_shutdown(
        origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """B861: the project allows a urllib3 older than 2.3, whose HTTPResponse has no `shutdown`: B770's timer then
    ended nothing (logged at debug level) and a range sent 16 bytes every 50 ms was read for 3 s at a read timeout of
    1 s. The socket under the response is shut down itself then."""
    import urllib3.response

    monkeypatch.delattr(urllib3.response.HTTPResponse, "shutdown")
    monkeypatch.delattr(urllib3.response.BaseHTTPResponse, "shutdown")
    store = store_on(origin, monkeypatch, get_client="boto3", read_timeout=1.0)
    origin.script = lambda h, s, e: dribble(h, DATA[s:e], 16, 0.05, 3.0, 206,
                                            {"Content-Range": f"bytes {s}-{e - 1}/{len(DATA)}"}) or True
    started = time.monotonic()
    with pytest.raises(TimedOut):
        store.get_range("k", ETAG, 0, len(DATA), None, len(DATA))
    assert time.monotonic() - started < 1.0 + 0.5
    origin.script = None
    assert bytes(store.get_range("k", ETAG, 0, len(DATA), None, len(DATA))) == DATA


def test_the_boto3_bodys_read_timeouts_share_one_thread() -> None:
    """B862: B770 started a thread (threading.Timer) for each GET's read timeout, 0.1-0.2 ms of CPU a GET; the
    timeouts now share one thread (`boto3_store.ALARMS`): 50 bodies open at once add at most that one thread, and
    each closed body's alarm is gone (none left to fire). An alarm set sooner than the one the thread waits for
    fires at its own time; a cancelled one never does."""
    import io

    from fsmount.data import boto3_store

    before = threading.active_count()
    readers = [boto3_store.ObjectReader(io.BytesIO(b"x"), 1, "bucket", "GET", deadline=time.monotonic() + 60,
                                        read_timeout=60) for _ in range(50)]
    assert threading.active_count() <= before + 1
    for reader in readers:
        reader.close()
    assert boto3_store.ALARMS.pending() == 0
    fired: list[str] = []
    late = boto3_store.ALARMS.at(time.monotonic() + 30, lambda: fired.append("late"))
    cancelled = boto3_store.ALARMS.at(time.monotonic() + 0.1, lambda: fired.append("cancelled"))
    boto3_store.ALARMS.cancel(cancelled)
    started = time.monotonic()
    boto3_store.ALARMS.at(started + 0.2, lambda: fired.append("soon"))
    while not fired and time.monotonic() < started + 10:
        time.sleep(0.01)
    assert fired == ["soon"] and time.monotonic() - started < 10
    boto3_store.ALARMS.cancel(late)
    time.sleep(0.2)
    assert fired == ["soon"]
