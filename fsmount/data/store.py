"""The object store seen by modelfs: the ObjectStore protocol every store client implements, the
metadata it returns, and the `StoreError`s (each with an errno and a message for humans) it raises.

A client module (boto3_store today) turns its library's failures into these errors; nothing above the
store sees a library exception. Every method blocks; callers run them in worker threads.
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import errno
import os
import re
from collections.abc import Iterator
from typing import Protocol, Self

from fsmount.data.identity import WritableBuffer


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectMeta:
    """One object version as listed or HEADed. `key` is the full key in the bucket."""

    key: str
    size: int
    etag: str
    mtime_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class ListingPage:
    """One page of a delimited listing: objects directly under the prefix, and sub-prefixes.

    Keys that are not valid UTF-8 arrive as `bytes` so the namespace can skip them by name.
    """

    objects: list[ObjectMeta]
    prefixes: list[str]
    undecodable: list[bytes]
    last: bool = False  # the listing's last page: asking for another would send no request


# A request's secrets as a server's answer may echo them (an error's message, a redirect's Location, a body botocore
# could not parse): a presigned URL's signature, credential and session token, an Authorization header's value. A
# third-party endpoint echoed the whole URL in an error's message, which went to the log and `modelfs stats` (B1220).
_SECRET_RE = re.compile(r"((?<![\w-])(?:x-amz-(?:signature|credential|security-token)|signature|credential|"
                        r"awsaccesskeyid)\s*(?:=|%3D|:)\s*)[^&\s,;\"'<>]+", re.IGNORECASE)
_AUTHORIZATION_RE = re.compile(r"((?<![\w-])authorization\s*[:=]\s*)[^\r\n<>\"']+", re.IGNORECASE)
HIDDEN = "(hidden)"


def without_secrets(text: str) -> str:
    """`text` with the values of the request secrets it names (`_SECRET_RE`) replaced by HIDDEN."""
    return _SECRET_RE.sub(rf"\g<1>{HIDDEN}", _AUTHORIZATION_RE.sub(rf"\g<1>{HIDDEN}", text))


class StoreError(Exception):
    """A failure talking to the bucket. `errno` is what a FUSE reader sees. Its message never holds a request's
    secrets (`without_secrets`), whatever text of a server's it quotes."""

    errno = errno.EIO

    def __init__(self, message: str):
        message = without_secrets(message)
        super().__init__(message)
        self.message = message
        # Set once it has been logged as a warning, so that the READs it fails (the kernel re-sends a failed
        # READ at once, and both join the one failed fetch) do not log it again.
        self.reported = False

    def detached(self) -> Self:
        """A copy that holds no frames (no traceback, cause or context), to keep or to raise to many waiters: one
        raised keeps, through those, the frames of the fetch that failed, and their chunk buffer (the audit)."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.args = self.args
        return copy


class NotFound(StoreError):
    errno = errno.ENOENT


class AccessDenied(StoreError):
    errno = errno.EACCES
    code = ""  # the S3 error code of the refusal, where the answer gave one (`error_for_status`)
    # The server said the request has expired (a presigned URL past its X-Amz-Expires on the server's clock): the
    # URL's age, not the credentials, was refused (`presigned.RangeGetter._signed_again` signs it anew, B136).
    expired = False
    # The server said the request is not valid yet: its X-Amz-Date, this machine's clock, is ahead of the server's by
    # more than the skew the server allows. No URL signed here helps, nor do other credentials
    # (`presigned.RangeGetter._signed_again` sends nothing more and looks nothing up, B175).
    not_yet_valid = False


class NoCredentials(AccessDenied):
    """botocore found no credentials; the message names a mount's ways to give them (`modelfs cleanup`, which
    takes no --no-sign-request, says its own)."""


class CredentialsFailed(AccessDenied):
    """The credentials could not be had when a request was to be signed: their source failed (STS refused to give
    a role's, a web identity token file missing, a credential_process failing). No request was sent: the message
    says the source's failure, not a refusal of the bucket's."""


class BucketMissing(StoreError):
    errno = errno.ENOENT


class Unreachable(StoreError):
    errno = errno.EIO


class OutOfResources(StoreError):
    """This machine could not open a connection: no descriptors left (EMFILE, ENFILE: `ulimit -n`, systemd's
    LimitNOFILE) or no memory for one. Not the origin's doing, so not retried as an unreachable endpoint is (every
    READ waited --read-timeout, and the log blamed the endpoint)."""


# connect(2) errors that are this machine's, not the endpoint's.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def local_failure(exc: BaseException | None, what: str) -> OutOfResources | None:
    """An OutOfResources for `exc` (or an OSError it was raised from) if it is one of LOCAL_ERRNOS, else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in LOCAL_ERRNOS:
            hint = (" (raise the daemon's open-file limit: `ulimit -n`, or LimitNOFILE= in its systemd unit)"
                    if exc.errno in (errno.EMFILE, errno.ENFILE) else "")
            return OutOfResources(f"{what}: {os.strerror(exc.errno)} on this machine{hint}")
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "kwargs", {}).get("error")
        seen += 1
    return None


# What a request pinned to a version the bucket no longer holds (If-Match, x-amz-copy-source-if-match: 412) says. Since
# the mount saw that version, not since the open: a file opened after a new revision was pushed, within
# --metadata-ttl of the listing that named the old one, is opened as the old version ("since it was opened" told the
# user who had pushed first that it changed after). Nothing of where the mount saw it: a listing, a HEAD, its own
# write, a predecessor's saved names while the origin was away; a rename's copy has no open at all.
CHANGED = "object changed in the bucket since the mount saw the version asked for"


class PreconditionFailed(StoreError):
    """The object changed since the mount saw the version asked for (If-Match failed): `CHANGED`."""

    errno = errno.EIO


class SizeChanged(PreconditionFailed):
    """A GET's answer says the object is another size than the one its version was pinned at (ObjectVersion.size, from
    a HEAD or a listing): the total after the `/` of its Content-Range. The ETag may match all the same: a HEAD cut
    inside its Content-Length line (http.client takes the shorter number for a whole one), a listing or a proxy
    giving a wrong size, or, on a server that gives no ETag, an object replaced by one of another size. The file was
    read back short (or long) as if it were whole. Handled as the object having changed (the handle EIO, the name
    looked up again), and, like any PreconditionFailed, not retried: the same answer would come again. Not a 412:
    `Boto3Store.get_range` never takes it for a server refusing its own ETags."""


def size_changed(total: str | None, size: int | None, what: str) -> SizeChanged | None:
    """The error for a GET answered with the object size `total` (a Content-Range's text after its `/`, or the length
    of a 200's whole object) of a version pinned at `size` bytes, if they differ. None where either is unknown: no
    `size` given (GETs of objects no version's size was pinned for), no total said, or `*` (the range syntax's
    "unknown"). One string compare per GET."""
    if size is None or total is None or total == "*" or total == str(size):
        return None
    return SizeChanged(f"{what}: the server says the object is {total} bytes, its version was pinned at {size} bytes "
                       "(a HEAD or listing answer cut or wrong, or the object replaced): not served")


def changed_etag(pinned: str, got: str | None, what: str, *, needed: bool = False) -> StoreError | None:
    """The error for a GET of the version `pinned` answered with the ETag `got`, if that is another version. One
    version's ETag in two forms is not another: weak (`W/"x"`) or not, quoted or not, in either case (servers that
    differ between a listing's and a GET's failed every read "object changed", nothing having changed). `needed`:
    nothing else pins the version (a GET sent without If-Match), so an answer without an ETag is refused too."""
    if pinned and not got and needed:
        return StoreError(f"{what}: the server sent no ETag, and refuses If-Match: which version it sent is unknown")
    if not pinned or not got:
        return None
    if _etag_value(pinned) == _etag_value(got):
        return None
    return PreconditionFailed(f"{what}: {CHANGED} (ETag {got}, opened as {pinned})")


def quoted_etag(etag: str) -> str:
    """An ETag in the form headers give it, in double quotes (none given stays ''): NetApp ONTAP, and other S3
    gateways, list ETags without them (and SeaweedFS answers CopyObject so), and one version's two forms were taken
    for two versions (a new inode and its chunks fetched again every TTL). A weak ETag (`W/"x"`) is one version's with
    `"x"` too, as `changed_etag` holds: a server listing one and HEADing the other got two versions the same way. The
    form If-Match sends, too, strong: it never matches a weak one, and a server that keeps weak ETags refuses it,
    which `Boto3Store._refuses_its_own_etag` (B66) takes as a server refusing If-Match. The form `uploads` returns for
    what it stored."""
    etag = etag.strip()
    if etag[:2] in ("W/", "w/"):
        etag = etag[2:].strip()
    if not etag or etag.startswith('"'):
        return etag
    return f'"{etag}"'


# The version tag of an object the server gave no ETag for (`version_tag`): not an ETag, never sent as one.
UNPINNED = "no-etag:"


def version_tag(etag: str, size: int, mtime_ns: int) -> str:
    """`etag`, or where the server gave none, a tag of the version its size and Last-Modified second name (what a
    HEAD's header and a listing say alike): one tag for every version, and an object replaced by one of another size,
    or a second later, kept the same inode and the same chunk ids: a new open read the old version's bytes from the
    page cache and the chunk memory (wrong bytes, mixed with the new size)."""
    if etag:
        return etag
    return f"{UNPINNED}{size}:{mtime_ns // 1_000_000_000}"


def sent_etag(etag: str) -> str:
    """The ETag a request may pin (If-Match) and an answer's ETag is compared with: none for a `version_tag` made up
    where the server gave none."""
    return "" if etag.startswith(UNPINNED) else etag


def _etag_value(etag: str) -> str:
    return quoted_etag(etag).strip('"').lower()


def server_age_s(date: object, last_modified: object) -> float | None:
    """An object's age on the server's own clock: its answer's Date less the object's Last-Modified (each an HTTP
    date, or a datetime as botocore parses them), whole seconds; None unless both are there and readable. What the
    age of something another node wrote is measured by: this node's clock may be hours off the writer's (a clock
    stepped at boot, a VM resumed after days), the server's is one clock for all."""
    stamps = []
    for value in (date, last_modified):
        if not isinstance(value, datetime.datetime):
            try:
                value = email.utils.parsedate_to_datetime(str(value)) if value else None
            except (TypeError, ValueError, OverflowError):  # OverflowError: a year no datetime holds
                value = None
        if value is None:
            return None
        stamps.append(value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC))
    return (stamps[0] - stamps[1]).total_seconds()


class TransientError(StoreError):
    errno = errno.EIO


class CutShort(TransientError):
    """An answer that reached botocore as a success with nothing in it (its head cut after the status line, its body
    cut before the first byte), which botocore does not send again: a read-only request so answered may be."""


class TimedOut(TransientError):
    """A request that got no answer within its deadline (a metadata call given up on after --read-timeout)."""


# The most of a server's error message kept in a StoreError's.
MESSAGE_MAX = 300


# What an operator should know of a refusal whose code says more than "access denied".
CREDENTIAL_ADVICE = {
    "ExpiredToken": "the credentials' session token has expired: give new credentials (a credentials file or a "
                    "profile is read again when requests are refused; credentials in the environment need a remount)",
    "InvalidToken": "the credentials' session token is not valid: give new credentials",
    "InvalidAccessKeyId": "the server does not know the access key id (revoked, or mistyped): give new credentials",
    # A request signed in its headers (a HEAD, a listing, a write: botocore's) whose X-Amz-Date is off the server's
    # clock by more than it allows (15 minutes on AWS S3 and MinIO), either way: the clock's, not the credentials'
    # (B191; a presigned URL's refusals for the clock are told by their message, B136, B175).
    "RequestTimeTooSkewed": "this machine's clock and the server's differ by more than the server allows (AWS S3, "
                            "MinIO: 15 minutes): check both clocks (NTP); the credentials may be right",
    # A 400 without an error document: what AWS S3 answers a HEAD signed with a session token past its expiry (its
    # answer has no body to say ExpiredToken; B104). It stays EIO, a bad request being possible too, but says so.
    "400": "400 without an error code: AWS S3 answers so a HEAD whose credentials' session token has expired. If the "
           "credentials are temporary, give new ones (a credentials file or a profile is read again when requests "
           "are refused; credentials in the environment need a remount)",
}


# What AWS S3 and MinIO say of a presigned URL past its expiry (AccessDenied, "Request has expired").
_EXPIRED_RE = re.compile(r"request has expired", re.IGNORECASE)
# What they say of a presigned URL whose X-Amz-Date is ahead of the server's clock by more than the skew it allows:
# AWS S3 answers AccessDenied, "Request is not yet valid" (its error document names X-Amz-Date and ServerTime);
# MinIO AccessDenied, "Request is not valid yet" (cmd/api-errors.go, ErrRequestNotReadyYet; raised by
# cmd/signature-v4.go's doesPresignedSignatureMatch where X-Amz-Date is after its time plus globalMaxSkewTime, 15
# minutes); SeaweedFS keeps MinIO's error (weed/s3api/s3err/s3api_errors.go, ErrRequestNotReadyYet, "Request is not
# valid yet."), which its older presigned check raised for any X-Amz-Date after its time, with no skew allowed, and
# its newer one does not raise (it checks the expiry only).
_NOT_YET_VALID_RE = re.compile(r"request is not (?:yet valid|valid yet)", re.IGNORECASE)


def error_for_status(code: str, status: int, bucket: str, what: str, message: str = "", *,
                     method: str = "", url_life_s: float | None = None) -> StoreError:
    """The StoreError for an S3 error answer (its error code, its HTTP status, its message) to a request of `method`
    ("HEAD", "GET"...; "" where no answer of it is told apart) that `what` names for the message: the one mapping,
    used by every client whatever library carried the request. `url_life_s`: how long the request's URL was signed
    for, where it was a presigned URL (`presigned.URL_EXPIRES_S`), which a refusal as expired names."""
    if code == "NoSuchBucket":
        return BucketMissing(f"bucket {bucket!r} does not exist")
    if code in ("NoSuchKey", "NotFound") or status == 404:
        return NotFound(f"{what}: not found")
    if code in ("InvalidObjectState", "ObjectNotInActiveTierError"):
        # A 403 too, but no matter of credentials: the object is in an archive storage class (Glacier, Deep
        # Archive, an archived Intelligent-Tiering tier) and must be restored before it can be read.
        return StoreError(f"{what}: the object is archived ({code}): restore it before reading it")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "AllAccessDisabled",
                "InvalidToken", "ExpiredToken") or status == 403:
        if code == "AccessDenied" and _EXPIRED_RE.search(message):
            said = " ".join(message.split())[:100]
            life = f" ({url_life_s / 60:g} minutes)" if url_life_s else ""
            denied = AccessDenied(f"access denied to bucket {bucket!r} ({code}: {said}): a URL signed just now "
                                  "refused so means the server's clock is ahead of this machine's by more than a URL's "
                                  f"life{life}: check both clocks (NTP)")
            denied.expired = True
        elif code == "AccessDenied" and _NOT_YET_VALID_RE.search(message):
            said = " ".join(message.split())[:100]
            denied = AccessDenied(f"access denied to bucket {bucket!r} ({code}: {said}): this machine's clock is "
                                  "ahead of the server's by more than the server allows (MinIO: 15 minutes): a URL "
                                  "signed here cannot be read there until the clocks agree: check both (NTP)")
            denied.not_yet_valid = True
        else:
            denied = AccessDenied(f"access denied to bucket {bucket!r} ({code or status}): "
                                  + CREDENTIAL_ADVICE.get(code, "check credentials"))
        denied.code = code
        return denied
    if code == "PreconditionFailed" or status == 412:
        return PreconditionFailed(f"{what}: {CHANGED}")
    if status == 400 and code in ("", "400") and method == "HEAD":
        # A HEAD's only: the answer to any other request has a body to say ExpiredToken in, so a bare 400 of a PUT, a
        # GET or a multipart call is something else (a gateway, a header refused) and keeps its server's words.
        return StoreError(f"{what}: {CREDENTIAL_ADVICE['400']}")
    if code == "NotImplemented" or status == 501:  # a feature the server lacks: asking again will not help
        return StoreError(f"{what}: not implemented by the server")
    if status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout", "InternalError"):
        return TransientError(f"{what}: server error {code or status}")
    said = " ".join(message.split())[:MESSAGE_MAX]
    return StoreError(f"{what}: {code or status}" + (f" ({said})" if said else ""))


class ObjectStore(Protocol):
    bucket: str

    def check_bucket(self, prefix: str) -> None:
        """Raise a StoreError with a clear message if the bucket cannot be listed."""
        ...

    def head(self, key: str) -> ObjectMeta | None:
        """The object's metadata, or None if there is no such key."""
        ...

    def list_pages(self, prefix: str) -> Iterator[ListingPage]:
        """Delimited ('/') listing of `prefix`, all pages."""
        ...

    def has_children(self, prefix: str) -> bool:
        """Whether any key starts with `prefix` (which ends with '/'), or the server's delimited listings name a
        folder there (SeaweedFS keeps one whose keys were all deleted): a directory, as the parent's listing says."""
        ...

    def get_range(self, key: str, etag: str, start: int, end: int, buffer: WritableBuffer | None = None,
                  size: int | None = None) -> bytes | WritableBuffer:
        """Bytes [start, end) of the object version `etag`; exactly end - start bytes or an error. With
        `buffer` (end - start bytes long) the bytes are read into it and it is returned. `size`: the object size the
        version was pinned at, which the answer's must be (`SizeChanged` else); None: not checked. A try that got
        no answer in time is `TimedOut` at once, not tried again: the caller knows whether anyone still waits."""
        ...
