"""The boto3 store client: ranged GETs, HEAD and delimited listings over boto3, and the one place where
botocore / urllib3 failures become `StoreError`s.

The bytes of a ranged GET travel by `presigned.RangeGetter` (http.client into the caller's buffer, less
CPU per byte) unless `--get-client boto3` or a proxy in the environment says otherwise; the signing, the
retries and the checks are the same either way.

Every method blocks; callers run them in worker threads. Nothing here caches or decides what to fetch.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsmount.config import METADATA_THREADS, StoreConfig
from fsmount.data.identity import WritableBuffer, new_buffer
from fsmount.data.presigned import URL_EXPIRES_S, Body, RangeGetter, proxied
from fsmount.data.store import (
    MESSAGE_MAX,
    AccessDenied,
    BucketMissing,
    CredentialsFailed,
    CutShort,
    ListingPage,
    NoCredentials,
    NotFound,
    ObjectMeta,
    PreconditionFailed,
    SizeChanged,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
    changed_etag,
    error_for_status,
    local_failure,
    quoted_etag,
    sent_etag,
    server_age_s,
    size_changed,
    version_tag,
)

log = logging.getLogger(__name__)

# A body that breaks mid-transfer (reset, truncation) is retried here; botocore retries only
# failures before the body starts. Three tries with jittered backoff, as botocore's standard mode.
GET_ATTEMPTS = 3
GET_BACKOFF_BASE = 0.2
# botocore's own retries for request-level failures (5xx, throttling, connection refused).
BOTO_MAX_ATTEMPTS = 4
# One presigned GET is one request (botocore's retries are not under it): as many tries in all as
# botocore's standard mode makes, with the same kinds of failure retried (5xx, throttling, resets,
# refused connections, bodies cut short).
PRESIGNED_GET_ATTEMPTS = BOTO_MAX_ATTEMPTS + 1
# Its backoff: 50 ms doubling, with jitter (0.025-0.075, ..., 0.2-0.6 s: at most 1.1 s in all). A
# chain that gives up before the READ's deadline hands the kernel's re-sent READ a fresh fetch and a
# fresh deadline, so a slow chain (0.2 s doubling: up to 4.5 s) let one failing read(2) take 8 s.
PRESIGNED_BACKOFF_BASE = 0.05
# Keys per ListObjectsV2 page: S3's maximum.
LIST_PAGE_KEYS = 1000
# The error codes of a 400 or 403 worth looking the credentials up again for (`Boto3Store._signed_anew`). AWS S3
# refuses a session token past its expiry (ExpiredToken), a malformed one (InvalidToken) and one to refresh
# (TokenRefreshRequired) with 400, the others with 403. "400" and "403" are what botocore says of a refused HEAD,
# whose answer has no body to name a code.
CREDENTIAL_CODES = frozenset({"400", "403", "ExpiredToken", "InvalidToken", "InvalidAccessKeyId",
                              "TokenRefreshRequired", "SignatureDoesNotMatch", "AccessDenied"})
CREDENTIAL_STATUSES = (400, 403)
# Pre-flight check: one attempt, short timeouts, so a wrong endpoint fails in seconds.
PREFLIGHT_TIMEOUT = 5.0


# What OpenSSL says when the other end answers a TLS hello in plain HTTP (SeaweedFS's or MinIO's port given as https://):
# "SSL validation failed ... wrong version number" did not tell a user what to change.
NOT_TLS_SIGNS = ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure", "packet length too long")


class _NoRetryQuota:
    """A retry quota that never runs out, in place of the one botocore's standard mode keeps per client (500 units,
    14 per retried 5xx or connection error, 5 per throttling retry, 1 back per request answered at once): an
    outage of about 35 retried failures drained it, and for hundreds of requests after it a lookup, a listing or a
    write that met one 5xx failed at its first error, EIO, where botocore retries them (B114). Every call's retries
    are bounded already (`BOTO_MAX_ATTEMPTS`, and `--read-timeout` for a call given up on), and calls at once by the
    connections (`max_pool_connections`): that quota only took retries from the calls after an outage."""

    def acquire(self, capacity_amount: int) -> bool:
        return True

    def release(self, capacity_amount: int) -> None:
        pass


def _without_retry_quota(client: Any) -> None:
    """Gives `client`'s standard-mode retry handler a quota that never runs out (`_NoRetryQuota`). botocore offers no
    setting for it: the handler is found by the name botocore registers it under. Should a botocore release keep it
    elsewhere, its quota stays, and a warning says so (tests/mount/test_faults.py notices too)."""
    try:
        event = client.meta.service_model.service_id.hyphenize()
        handler = client.meta.events._emitter._unique_id_handlers[f"retry-config-{event}"]["handler"]
        checker = handler.__self__._retry_quota
        if not hasattr(checker, "_quota"):
            raise AttributeError("_quota")
        checker._quota = _NoRetryQuota()
    except (AttributeError, KeyError, TypeError) as exc:
        log.warning("botocore's retry quota is left on (not found: %r): after a long outage, requests that meet one "
                    "5xx may fail without a retry until successes refill it", exc)


# The deadline (time.monotonic()) of the request this thread runs for a caller that gives up on it then
# (`within`: a write request of `Writes.call`, a metadata request of the mount's store call), None outside one.
_deadline = threading.local()


def within(deadline: float, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in this thread, where no try of a request begins after `deadline` (time.monotonic())."""
    _deadline.at = deadline
    try:
        return fn(*args)
    finally:
        _deadline.at = None


def _no_try_past_the_deadline(**_: Any) -> None:
    """botocore's before-send, before each try of a request (a cut listing asked again too,
    `Boto3Store._list_objects`). A write request given up on at its deadline went on in its abandoned thread,
    botocore trying it again after its backoff (up to 8 s after a SlowDown): a rename that had got EIO was done
    seconds later, the file under both names (the write fault fuzzer)."""
    deadline = getattr(_deadline, "at", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TimedOut("given up on at its deadline: not tried again")


# The most bytes of an answer that botocore reads whole before parsing it (a listing page, an error document, a
# multipart call's): a page of 1000 keys of 1024 bytes each, percent-encoded, is under 4 MiB. A hostile or broken
# endpoint's endless body (chunked, or a Content-Length of 2^62) was read into memory until it ran out, past
# --memory-limit, the thread of a lookup given up on at --read-timeout reading on (B1222).
RESPONSE_MAX = 32 << 20


def _bounded_send(send: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """botocore's `http_session.send`, reading an answer it would read whole (all but a streamed GET's body: a
    streamed GET's error document too) up to RESPONSE_MAX bytes: one longer is a TransientError, its connection
    closed."""
    from botocore import exceptions as bex
    from urllib3.exceptions import ProtocolError
    from urllib3.exceptions import ReadTimeoutError as URLLib3ReadTimeoutError

    def bounded(request: Any) -> Any:
        streamed = request.stream_output
        request.stream_output = True  # its head only: its body is read below
        try:
            response = send(request)
        finally:
            request.stream_output = streamed
        if streamed and response.status_code < 300:  # a GET's body, which botocore reads as it is asked for
            return response
        parts, got = [], 0
        try:
            for part in response.raw.stream():
                got += len(part)
                if got > RESPONSE_MAX:
                    response.raw.close()
                    path = urllib.parse.urlsplit(request.url).path
                    raise TransientError(f"the server's answer to {request.method} {path!r} went on past "
                                         f"{RESPONSE_MAX >> 20} MiB, which no S3 answer of it needs")
                parts.append(part)
        except URLLib3ReadTimeoutError as exc:  # as botocore's own read of it maps them (httpsession.send)
            raise bex.ReadTimeoutError(endpoint_url=request.url, error=exc) from None
        except ProtocolError as exc:
            raise bex.ConnectionClosedError(error=exc, request=request, endpoint_url=request.url) from None
        response._content = b"".join(parts)
        return response

    return bounded


def _listing(resp: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A ListObjectsV2 answer, checked to hold a listing: every one holds a ListBucketResult (its Name, Prefix,
    MaxKeys, IsTruncated...). A 200 whose body was cut to nothing with a Content-Length that says so (a proxy, a
    server restarting) parsed as a listing of no keys: a directory of files was empty, each of them ENOENT for the
    TTL, and a lookup's probe found no directory (B125). CutShort: `Boto3Store._list_objects` asks it once more
    (B221, B245); a second one so fails the listing, whole."""
    if not resp.keys() - {"ResponseMetadata"}:
        raise CutShort(f"listing {prefix!r}: the server's answer had no listing in it (an empty body)")
    return resp


def _mtime_ns(value: Any) -> int:
    """A Last-Modified to the whole second: a HEAD's is an HTTP date, while a listing's is to the millisecond on some
    servers (MinIO, Ceph RGW), and an inode's mtime must not change with which of the two answered last (`find
    -newer` and `make` compare it to the nanosecond)."""
    try:
        return int(value.timestamp() // 1) * 1_000_000_000
    except AttributeError:
        return 0


def parse_timestamp(value: Any) -> Any:
    """botocore's parse of a date (Last-Modified, LastModified, Initiated), or else the e-mail form's parse, which
    takes what servers send beside the standard (a named zone after a numeric one, `-0000 GMT`; a header sent twice,
    joined by a comma: its first). botocore's alone failed the HEAD, or a listing of a whole directory, with EIO
    ("ValueError: Invalid timestamp"). What neither can read still fails so: a made-up date would pass an upload's
    age check (`modelfs cleanup`)."""
    import datetime
    import email.utils

    from botocore.utils import parse_timestamp as botocore_parse

    try:
        return botocore_parse(value)
    except ValueError as exc:
        try:
            parsed = email.utils.parsedate_to_datetime(str(value))
        except (TypeError, ValueError):
            raise exc from None
        # `-0000` is "zone unknown", which leaves it naive: HTTP dates are GMT, not this machine's local time.
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)


# The largest size a file can have (the kernel's st_size and file offsets are signed 64-bit).
MAX_FILE_SIZE = (1 << 63) - 1


def _meta(key: str, size: int, etag: str, last_modified: Any) -> ObjectMeta:
    """One object version as HEAD or a listing gives it: its ETag quoted (`quoted_etag`), or a tag of its size and
    Last-Modified where the server gives none (`version_tag`). A size no file can have (negative, or past
    MAX_FILE_SIZE: a hostile or broken server's) is a StoreError: every stat of it, and the listing of its whole
    directory, failed "unexpectedly" (pyfuse3's OverflowError, B1221)."""
    if not 0 <= size <= MAX_FILE_SIZE:
        raise StoreError(f"{key!r}: the server says its size is {size} bytes, which no file can have")
    mtime_ns = _mtime_ns(last_modified)
    return ObjectMeta(key, size, version_tag(quoted_etag(etag), size, mtime_ns), mtime_ns)


def _client_error_code(exc: Exception) -> tuple[str, int, str]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status, str(response.get("Error", {}).get("Message", ""))


def translate_error(exc: Exception, bucket: str, what: str, *, method: str = "") -> StoreError:
    """Map a botocore/urllib3 exception to a StoreError. The one error mapping of the project; `method` as
    `error_for_status` takes it."""
    from botocore import exceptions as bex
    from botocore.parsers import ResponseParserError

    from fsmount.data.credentials import Unavailable

    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, Unavailable):
        return _credentials_failed(exc, bucket, what)
    if isinstance(exc, bex.NoCredentialsError):
        return NoCredentials(
            "no credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, use --profile (with a profile, "
            "only its own credentials count: botocore does not read the AWS_* keys then), or --no-sign-request for "
            "a public bucket"
        )
    if isinstance(exc, bex.ClientError):
        code, status, message = _client_error_code(exc)
        return error_for_status(code, status, bucket, what, message, method=method)
    local = local_failure(exc, f"{what}: cannot open a connection")
    if local is not None:
        return local
    if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError)):
        unresolved = _name_not_resolved(exc)
        if unresolved is not None:
            # A typo in the endpoint's host read as any connection that failed: "Could not connect to the endpoint
            # URL" (B233). Still Unreachable: DNS that is not up yet at boot mends by itself.
            url = str(getattr(exc, "kwargs", {}).get("endpoint_url", ""))
            parts = urllib.parse.urlsplit(url)
            host = parts.hostname or ""
            check = "check the endpoint URL's host, or this machine's DNS"
            if host == "amazonaws.com" or host.endswith((".amazonaws.com", ".amazonaws.com.cn")):
                # AWS's names are made of the region, with or without an endpoint URL: `--region us-eest-1` was told
                # to check an endpoint URL not given, and to use path style, whose name does not resolve either (B236).
                check = ("S3's host names are made of the region: check --region (AWS_DEFAULT_REGION, the profile's "
                         "region) and the endpoint URL if one is given, or this machine's DNS")
            elif bucket and host.startswith(f"{bucket.lower()}.") and not is_oss(url):  # OSS takes virtual only
                check = ("the bucket is in it (virtual-hosted addressing): check the endpoint URL's host, and a server "
                         "without a DNS name for each bucket needs --addressing-style path")
            return Unreachable(f"cannot reach the endpoint: its host name {host!r} does not resolve "
                               f"({unresolved.strerror or unresolved}): {check} ({parts.scheme}://{parts.netloc})")
        return Unreachable(f"cannot reach the endpoint: {exc}")
    if isinstance(exc, (bex.ReadTimeoutError, TimeoutError)):
        return TimedOut(f"{what}: no answer in time: {type(exc).__name__}: {exc}")
    if isinstance(exc, (bex.ResponseStreamingError, bex.IncompleteReadError,
                        bex.ConnectionClosedError, ResponseParserError, ConnectionError)):
        # ResponseParserError: a listing or error document cut short (truncated XML) is a broken
        # response, not an answer. Its text ends with the whole body botocore could not parse (an HTML page, up to
        # RESPONSE_MAX of a hostile server's): its start only, or each warning of it was that long (B1223).
        return TransientError(f"{what}: {type(exc).__name__}: {str(exc)[:MESSAGE_MAX]}")
    if isinstance(exc, bex.SSLError) and any(sign in str(exc) for sign in NOT_TLS_SIGNS):
        return StoreError(f"{what}: the endpoint does not answer in TLS: is it http://, not https://? ({exc})")
    if isinstance(exc, bex.BotoCoreError):
        return StoreError(f"{what}: {exc}")
    if isinstance(exc, OSError):
        return TransientError(f"{what}: {exc}")
    return StoreError(f"{what}: {type(exc).__name__}: {exc}")


# The codes of a credentials source's answer that say to ask again (`_credentials_failed`): it throttles (STS's
# Throttling, the SSO portal's TooManyRequestsException), or STS could not reach the identity provider a web identity
# is checked with (IDPCommunicationError: its documented transient error, an EKS cluster's OIDC issuer for a moment).
SOURCE_BUSY_CODES = frozenset({"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
                               "IDPCommunicationError"})
# Sources whose failure botocore says only as "could not be retrieved" (CredentialRetrievalError): the instance
# metadata service (IMDS: one try of 1 s, throttled under load) and container credentials (ECS, EKS Pod Identity's
# agent), once the credentials are due (before, `credentials._still_good`). Asked again, they give them.
METADATA_SOURCES = frozenset({"iam-role", "container-role"})
# What botocore says of a credential_process (method `custom-process`) whose output it cannot take
# (`CredentialRetrievalError`'s error_msg): a Version other than 1, a key missing. Any other such error is the
# process's own exit with an error (error_msg: what it wrote to stderr); output that is not JSON is botocore's
# JSONDecodeError, a program that cannot be run Popen's OSError (`_credentials_failed`).
PROCESS_OUTPUT_REFUSED = ("Unsupported version", "Missing required key")
PROCESS_ADVICE = ("check the profile's credential_process: it must print JSON with Version 1, AccessKeyId, "
                  "SecretAccessKey (and SessionToken, Expiration)")

# What a refusal to give a role's credentials asks to check, by the STS call refused (`_credentials_failed`).
ROLE_ADVICE = {
    "AssumeRoleWithWebIdentity": "check the role (AWS_ROLE_ARN, or the profile's role_arn), that its trust policy "
                                 "allows this web identity (the service account's, on EKS), and the token file "
                                 "(AWS_WEB_IDENTITY_TOKEN_FILE)",
    "AssumeRole": "check the profile's role_arn, that the role's trust policy allows its source credentials "
                  "(source_profile, credential_source), and those",
}


def _credentials_failed(exc: Any, bucket: str, what: str) -> StoreError:
    """The StoreError of credentials that could not be had when signing (`credentials.Unavailable`): said as their
    source's failure. An STS refusal of the role was said as the bucket's ("access denied to bucket ...: a mount
    needs s3:ListBucket"), a web identity token file missing as the bucket's listing failing now and then (a
    TransientError, retried; a mount with a cache dir came up as if the origin were away). A source that cannot be
    reached, does not answer in time, answers 5xx or to ask again (SOURCE_BUSY_CODES), or a metadata service that
    gave nothing (METADATA_SOURCES) is `Unreachable`, named as the credentials': no request reached the bucket, and a
    read, a metadata request or a write asks again until its deadline (--read-timeout), as for an origin refusing
    connections. A TransientError or TimedOut had a read's 5 tries in 1 s, all failed at once within the credentials'
    UNAVAILABLE_HOLD_S, and an IMDS that timed out once was EACCES (B297). So is a credential_process that exited
    with an error (a vault agent restarting), which was EACCES at once; one whose output botocore cannot take (not
    JSON, PROCESS_OUTPUT_REFUSED) or that cannot be run is `CredentialsFailed`, saying what to fix."""
    from botocore import exceptions as bex

    cause = exc.cause
    said = f"{what}: the credentials ({exc.method or 'unknown source'}) could not be had"
    if isinstance(cause, bex.ClientError):
        code, status, message = _client_error_code(cause)
        operation = str(getattr(cause, "operation_name", "") or "their request")
        words = " ".join(message.split())[:300]
        refused = f"{said}: {operation} answered {code or status}" + (f" ({words})" if words else "")
        if status >= 500 or code in SOURCE_BUSY_CODES:
            return Unreachable(refused)
        advice = ROLE_ADVICE.get(operation, "check them")
        return CredentialsFailed(f"{refused}: {advice}")
    if isinstance(cause, OSError) and cause.filename is not None:  # a file of theirs: a token file, a process
        where = {"assume-role-with-web-identity": " (AWS_WEB_IDENTITY_TOKEN_FILE, or the profile's "
                                                  "web_identity_token_file)",
                 "custom-process": " (the profile's credential_process)"}.get(exc.method, "")
        return CredentialsFailed(f"{said}: {cause.strerror or cause}: {cause.filename}{where}")
    if exc.method == "custom-process":
        if isinstance(cause, bex.CredentialRetrievalError):
            text = " ".join(str(cause.kwargs.get("error_msg", "")).split())[:300]
            if not text.startswith(PROCESS_OUTPUT_REFUSED):
                return Unreachable(f"{said}: the credential_process exited with an error: {text or 'it said nothing'}")
            return CredentialsFailed(f"{said}: {text}: {PROCESS_ADVICE}")
        if isinstance(cause, json.JSONDecodeError):  # its output is not JSON
            return CredentialsFailed(f"{said}: the credential_process printed no JSON object ({type(cause).__name__}: "
                                     f"{cause}): {PROCESS_ADVICE}")
        if isinstance(cause, ValueError):  # an Expiration that is no date, output that is not UTF-8
            return CredentialsFailed(f"{said}: what the credential_process printed cannot be taken "
                                     f"({type(cause).__name__}: {cause}): {PROCESS_ADVICE}")
    inner = translate_error(cause, bucket, what)
    text = " ".join(inner.message.removeprefix(f"{what}: ").split())  # botocore's may span lines
    if isinstance(inner, (Unreachable, TransientError)) or (
            isinstance(cause, bex.CredentialRetrievalError) and exc.method in METADATA_SOURCES):
        return Unreachable(f"{said}: {text}")
    return CredentialsFailed(f"{said}: {text}")


def _name_not_resolved(exc: BaseException | None) -> socket.gaierror | None:
    """The resolver's failure that `exc` was raised from (botocore keeps urllib3's error in `kwargs`), if any."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, socket.gaierror):
            return exc
        kwargs = getattr(exc, "kwargs", None)  # botocore's; any other exception's attribute of that name is not
        exc = exc.__cause__ or exc.__context__ or (kwargs.get("error") if isinstance(kwargs, dict) else None)
        seen += 1
    return None


def endpoint_path_hint(endpoint_url: str | None, bucket: str = "the first argument", prefix: str = "--prefix") -> str:
    """What a missing bucket's message adds where the endpoint URL has a path: the bucket put there too (as a
    path-style URL spells it), which sends every request to a bucket of that path's name. `bucket` and `prefix` name
    where they go instead (the shared tier's flags for its endpoint)."""
    path = urllib.parse.urlsplit(endpoint_url or "").path.strip("/")
    return (f" (the endpoint URL has a path, /{path}: the bucket is {bucket}, a path inside it {prefix})"
            if path else "")


# The longest key a bucket takes, in UTF-8 bytes: S3's limit, and SeaweedFS's and MinIO's; OSS's is one less.
MAX_KEY_BYTES = 1024
OSS_MAX_KEY_BYTES = 1023


def is_oss(endpoint_url: str) -> bool:
    """Whether the endpoint is Alibaba OSS (its public, internal and accelerate endpoints)."""
    host = urllib.parse.urlsplit(endpoint_url).hostname or ""
    return host == "aliyuncs.com" or host.endswith(".aliyuncs.com")


def _oss_forbid_overwrite(request: Any, **_: Any) -> None:
    """OSS's create-only PUT: `x-oss-forbid-overwrite: true` (refused with 409 FileAlreadyExists if the key
    exists) in place of If-None-Match: *, which OSS documents only for reads. A botocore before-sign handler,
    so the header is signed."""
    if request.headers.get("If-None-Match") == "*":
        del request.headers["If-None-Match"]
        request.headers["x-oss-forbid-overwrite"] = "true"


def _ssl_context(profile: str | None, endpoint_url: str) -> Any:
    """The TLS settings boto3 uses for this profile, for an https endpoint (None for http): its CA bundle, found as
    botocore finds it (the `ca_bundle` setting: AWS_CA_BUNDLE or the profile's, then REQUESTS_CA_BUNDLE) or
    botocore's default one. A bundle that cannot be read is a StoreError naming it."""
    import ssl

    import botocore.session
    from botocore.httpsession import get_cert_path

    if urllib.parse.urlsplit(endpoint_url).scheme.lower() != "https":
        return None
    configured = botocore.session.Session(profile=profile).get_config_variable("ca_bundle")
    requests_bundle = os.environ.get("REQUESTS_CA_BUNDLE")
    cafile = configured or requests_bundle or get_cert_path(True)
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        source = ("AWS_CA_BUNDLE or the profile's ca_bundle" if configured else
                  "REQUESTS_CA_BUNDLE" if requests_bundle else "botocore's default")
        raise StoreError(f"cannot use the CA bundle {cafile} ({source}): {exc}") from None


def _decode_key(raw: str, encoded: bool) -> str | bytes:
    """Keys are listed url-encoded so that non-UTF-8 keys survive; those come back as bytes.

    The encoding is form encoding: S3 and SeaweedFS send a space as '+' and a literal '+' as '%2B'
    (moto sends '%20' for a space, which decodes the same way)."""
    if not encoded:
        return raw
    data = urllib.parse.unquote_to_bytes(raw.replace("+", " "))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


class Boto3Store:
    """ObjectStore over boto3. Thread-safe: one client, shared by all worker threads."""

    def __init__(self, cfg: StoreConfig, *, preflight: bool = False, retries: int = BOTO_MAX_ATTEMPTS,
                 sign_payloads: bool = True):
        """`sign_payloads=False` sends request bodies as UNSIGNED-PAYLOAD: botocore would otherwise hash
        every byte of a PUT with SHA-256 (the shared tier writes whole chunks: 1.8 of 6.7 daemon CPU-s in
        writing 1.7 GB, measured), and a chunk object carries its own checksum, checked on every read."""
        import boto3
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        import fsmount.data.credentials as credentials

        self.bucket = cfg.bucket
        self._cfg = cfg
        core = botocore.session.Session()
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
        session = boto3.session.Session(botocore_session=core, profile_name=cfg.profile or None)
        # Credentials looked up again when the bucket refuses them (a file rewritten with a new key): `_renew`.
        # Their fetches (STS, SSO) bounded as the pre-flight's requests are, or credentials.FETCH_TIMEOUT_S; a
        # request run `within` a deadline waits for another thread's refresh of them until then.
        credentials.install(core, cfg.profile or None, deadline=lambda: getattr(_deadline, "at", None),
                            **({"timeout_s": PREFLIGHT_TIMEOUT, "retries": 0} if preflight else {}))
        timeout = PREFLIGHT_TIMEOUT if preflight else cfg.connect_timeout
        # `auto` is botocore's own default: left out, so that an AWS config file's `s3 = addressing_style = ...`
        # holds, as it does for boto3 (OSS needs `virtual`, and a profile for it says so).
        s3_options: dict[str, Any] = {}
        if cfg.addressing_style != "auto":
            s3_options["addressing_style"] = cfg.addressing_style
        if not sign_payloads:
            s3_options["payload_signing_enabled"] = False
        botocfg = Config(
            region_name=cfg.region,
            # SigV4 named, not left to botocore: it presigns URLs with SigV2 otherwise (us-east-1 and
            # custom endpoints), which newer regions refuse.
            signature_version=UNSIGNED if cfg.no_sign_request else "s3v4",
            # A connection for each thread that may use the client at once: the data fetches (--get-client boto3)
            # or the writes' requests (--max-connections each), and the metadata calls. A smaller pool
            # (--max-connections + 4) had urllib3 drop the spare connections with a WARNING each (B89).
            max_pool_connections=2 * cfg.max_connections + METADATA_THREADS,
            connect_timeout=timeout,
            read_timeout=PREFLIGHT_TIMEOUT if preflight else cfg.read_timeout,
            # botocore's max_attempts counts retries after the first request.
            retries={"max_attempts": 1 if preflight else retries, "mode": "standard"},
            s3=s3_options,
            tcp_keepalive=True,
            # Integrity is the ETag's job (If-Match) and the cache's own checksum; botocore's
            # response checksums would cost a CPU pass over every byte, and some S3-compatible
            # servers reject the extra signed header.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self._client = session.client("s3", endpoint_url=cfg.endpoint_url, config=botocfg)
            found = None if cfg.no_sign_request else session.get_credentials()
        except credentials.Unavailable as exc:
            # Their first lookup failed (`credentials._Provider.load`): no client is made without them, so nothing
            # would ask again; CredentialsFailed, a source failing for a moment too, so that a mount fails saying
            # so rather than coming up from its cache dir as if the origin were away.
            raise CredentialsFailed(translate_error(exc, cfg.bucket, f"bucket {cfg.bucket!r}").message) from None
        _without_retry_quota(self._client)
        self._bound_answers()
        self._credentials = found if isinstance(found, credentials.Renewable) else None
        self._client.meta.events.register("needs-retry.s3", self._signed_anew)
        # A request whose caller gave up on it at its deadline (`within`) is not sent again in its abandoned thread.
        self._client.meta.events.register("before-send.s3", _no_try_past_the_deadline)
        # What presigns URLs: the client, or one for the bucket's region once a read found it elsewhere
        # (`_use_region`); replaced, never changed, under `_region_lock`.
        self._presigner = self._client
        self._session, self._botocfg = session, botocfg
        self._region_lock = threading.Lock()  # also guards get_retries
        self.get_retries = 0  # ranged GETs sent again after a transient failure (get_range's own retries)
        self._if_match_refused = False  # the server refuses its own ETags in If-Match (`_refuses_its_own_etag`)
        self._missing_as_403_told = False  # `_listed_after_refusal` logged; set once, only ever to True (any thread)
        # OSS's create-only header is x-oss-*, which a presigned URL would have to sign: conditional PUTs to
        # OSS stay with botocore.
        self._oss = is_oss(self._client.meta.endpoint_url)
        if self._oss:
            for operation in ("PutObject", "CompleteMultipartUpload"):
                self._client.meta.events.register(f"before-sign.s3.{operation}", _oss_forbid_overwrite)
        self.list_page_keys = LIST_PAGE_KEYS
        self._ranges: RangeGetter | None = None
        if preflight:
            # botocore's failure to read the CA bundle names no file ("SSL validation failed for URL [Errno 2] No such
            # file or directory"): the pre-flight reads it as the reads will, whose failure names it (B232).
            _ssl_context(cfg.profile, self._client.meta.endpoint_url)
        if cfg.get_client == "presigned" and not preflight:
            if proxied(self._client.meta.endpoint_url):
                log.info("a proxy is set for %s: ranged GETs go through boto3", self._client.meta.endpoint_url)
            else:
                self._ranges = RangeGetter(self._presign, presign_put=self._presign_put,
                                           presign_delete=self._presign_delete, bucket=self.bucket,
                                           pool_size=cfg.max_connections + 4,
                                           connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout,
                                           ssl_context=_ssl_context(cfg.profile, self._client.meta.endpoint_url),
                                           on_wrong_region=self._use_region, on_refused=self._renew,
                                           on_refused_again=self._refused_again,
                                           credentials_changes=self._credentials_changes,
                                           credentials_expiry=self._credentials_expiry)
        # How many tries a ranged GET gets, and the backoff between them, by what carries its bytes.
        self._get_attempts, self._backoff_base = ((GET_ATTEMPTS, GET_BACKOFF_BASE) if self._ranges is None
                                                  else (PRESIGNED_GET_ATTEMPTS, PRESIGNED_BACKOFF_BASE))

    @property
    def client(self) -> Any:
        """The boto3 client (for the write requests of `uploads.Uploads`, which share it)."""
        return self._client

    @property
    def endpoint_url(self) -> str:
        """The endpoint requests go to: --endpoint-url, or what the AWS configuration says (AWS_ENDPOINT_URL_S3,
        AWS_ENDPOINT_URL, a profile's endpoint_url), or AWS's own for the region."""
        return str(self._client.meta.endpoint_url)

    @property
    def max_key_bytes(self) -> int:
        """The longest key this bucket takes, in UTF-8 bytes: OSS's limit is 1023, S3's (and SeaweedFS's, MinIO's)
        1024. The bucket says so only when a longer key's bytes are sent: `WritableNamespace.child_path` asks first."""
        return OSS_MAX_KEY_BYTES if self._oss else MAX_KEY_BYTES

    @property
    def configured_endpoint_url(self) -> str | None:
        """The endpoint if it is not AWS's own (given by --endpoint-url or by the AWS configuration), else None."""
        if self._cfg.endpoint_url:
            return self._cfg.endpoint_url
        host = (urllib.parse.urlsplit(self.endpoint_url).hostname or "").lower()
        return None if host == "amazonaws.com" or host.endswith((".amazonaws.com", ".amazonaws.com.cn")) \
            else self.endpoint_url

    @property
    def region(self) -> str:
        """The region requests are signed for: --region, or what the AWS configuration and environment say."""
        return self._client.meta.region_name or ""

    def check_bucket(self, prefix: str) -> None:
        try:
            self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, Delimiter="/", MaxKeys=1)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one clear StoreError
            err = translate_error(exc, self.bucket, f"listing bucket {self.bucket!r}")
            code, status, _ = _client_error_code(exc)
            if code == str(status) and 400 <= status < 500 and status != 403:
                # An answer without an S3 error code comes from a server that does not speak S3 (SeaweedFS's filer or
                # volume port given for its S3 one): no word of a bucket that does not exist, or of a bad request.
                err = (BucketMissing if status == 404 else StoreError)(
                    f"listing bucket {self.bucket!r}: {self.endpoint_url} answered {status} without an S3 error: is "
                    "it the S3 API's address and port?")
            elif isinstance(err, NotFound):
                err = BucketMissing(f"bucket {self.bucket!r} does not exist")
            elif type(err) is AccessDenied and err.code in ("AccessDenied", "403"):
                # A policy's word as much as the credentials': a mount lists its prefix (and answers lookups by
                # listings), which S3 grants by s3:ListBucket, not s3:GetObject.
                code, err = err.code, AccessDenied(f"{err.message}, and that they may list it: a mount needs "
                                                   "s3:ListBucket on the bucket for its prefix, and s3:GetObject")
                err.code = code
            raise err from None

    def head(self, key: str) -> ObjectMeta | None:
        try:
            return self._head(key)
        except AccessDenied as err:
            # A bare 403, which botocore's hook leaves to this (`_signed_anew`): a listing says first whether the
            # key is there at all, for S3 answers a HEAD of a missing key so (`_listed_after_refusal`). Only then
            # are the credentials looked up again, and the HEAD sent once more if they changed: renewed on a missing
            # key's refusal, credentials minted at each lookup (SSO, an assumed role) were refused again, which
            # `Renewable.refused_again` took for the bucket refusing them (B135).
            if err.code != "403":
                raise
            if not self._listed_after_refusal(key):
                return None
            if not self._renew("403"):
                raise
        try:
            return self._head(key)
        except AccessDenied as err:
            if err.code == "403":
                self._refused_again("403")
            raise

    def _head(self, key: str) -> ObjectMeta | None:
        """One HEAD of `key`: None if the server says it is not there (404)."""
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            err = translate_error(exc, self.bucket, f"HEAD {key!r}", method="HEAD")
            if isinstance(err, NotFound):
                return None
            raise err from None
        if resp.get("ContentLength") is None or not resp.get("ETag"):
            # No Content-Length (Supabase Storage for an empty object, s3ninja, a gateway compressing on the way):
            # the key's entry of a listing says its size, with the ETag of that same answer. Read as a missing key
            # (KeyError), every lookup of the file failed "unexpectedly", EIO. No ETag: an answer whose head was cut
            # after its size (a server sending Content-Length before ETag) is no answer of a server that gives none,
            # whose versions nothing pins (B150); a server that gives none pays a listing per HEAD.
            return self._listed(key)
        if resp.get("LastModified") is None:
            # No Last-Modified (an answer cut after its ETag, by a server sending its lines by name): no mtime, so the
            # file was dated the mount's start for the TTL, wrongly the newest of its directory (B168). A listing
            # dates it; S3 servers send one with every HEAD (moto and SeaweedFS too, for empty objects, directory
            # markers and implicit directories), so only a cut answer pays it. The HEAD's size and ETag are the
            # object's all the same: a listing that cannot date it (refused by a policy that grants s3:ListBucket
            # for the directory's prefix only, or only with the delimiter "/", which this one does not send; failed;
            # not naming the key yet) leaves it undated, as before, and never makes the file missing (EACCES,
            # ENOENT) or a lookup fail (B200).
            try:
                listed = self._listed(key)
            except StoreError:
                listed = None
            if listed is not None:
                return listed
        return _meta(key, int(resp["ContentLength"]), resp.get("ETag", ""), resp.get("LastModified"))

    def _listed_after_refusal(self, key: str) -> bool:
        """After a HEAD of `key` refused with a bare 403: whether a listing names the key (or cannot say: refused too,
        failed). AWS S3 answers a HEAD of a key that does not exist 403, not 404, to a caller without s3:ListBucket
        on it (a policy granting ListBucket only under some prefixes does not grant it to a HEAD), so a loader's
        probe of an optional file (generation_config.json) was EACCES, with a warning to check the credentials,
        and asked again at each probe. A listing that answers and does not name the key makes it a missing key."""
        try:
            if self._listed(key) is not None:
                return True
        except StoreError:
            return True
        if not self._missing_as_403_told:
            self._missing_as_403_told = True
            log.info("HEAD %r was refused (403) and a listing does not name the key: read as missing (S3 answers a "
                     "HEAD of a missing key 403 to a caller without s3:ListBucket on it)", key)
        return False

    def _list_objects(self, prefix: str, **kwargs: Any) -> dict[str, Any]:
        """One ListObjectsV2 of `prefix` (a page of a directory's listing, a lookup's or a create's one-key probe, a
        HEAD's fallback), checked to hold a listing (`_listing`). One whose answer was cut short (its head cut
        after the status line: a 200 with no listing in it, which botocore does not send again) is asked once more:
        a listing is read-only. One such answer failed a lookup of a name, a directory's `ls`, with EIO (B245), and
        a create (B221). Where the caller runs it `within` a deadline, no try begins past it
        (`_no_try_past_the_deadline`): given up on, a second try in the abandoned thread outlasted --read-timeout."""
        def ask() -> dict[str, Any]:
            try:
                return _listing(self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, **kwargs), prefix)
            except Exception as exc:  # noqa: BLE001
                raise translate_error(exc, self.bucket, f"listing {prefix!r}") from None

        try:
            return ask()
        except CutShort as exc:
            log.info("%s; asked again", exc.message)
            return ask()

    def _listed(self, key: str) -> ObjectMeta | None:
        """The key as a listing gives it (None if there is none): the first key a listing of it as a prefix names.
        Keys XML 1.0 cannot carry (control characters) come through: botocore asks with encoding-type=url where the
        caller does not, and decodes the keys itself (`list_pages` asks for it, and so decodes them: `_decode_key`).
        A non-UTF-8 key decodes to one with U+FFFD, which is never the key asked, so it is not listed
        (`tests/mount/test_server_quirks.py::test_a_control_character_key_whose_head_has_no_etag_is_found_by_its_listing`)."""
        resp = self._list_objects(key, MaxKeys=1)
        for item in resp.get("Contents", ())[:1]:
            if item.get("Key") == key:
                return _meta(key, int(item.get("Size", 0)), item.get("ETag", ""), item.get("LastModified"))
        return None

    def list_pages(self, prefix: str) -> Iterator[ListingPage]:
        token: str | None = None
        tokens: set[str] = set()  # every continuation token given so far: a server that ignores them repeats one
        while True:
            kwargs: dict[str, Any] = dict(prefix=prefix, Delimiter="/", EncodingType="url",
                                          MaxKeys=self.list_page_keys)
            if token:
                # Opaque (S3) or the last key as it is (SeaweedFS): never encoded, so sent back unchanged.
                kwargs["ContinuationToken"] = token
            resp = self._list_objects(**kwargs)
            encoded = resp.get("EncodingType") == "url"
            objects: list[ObjectMeta] = []
            prefixes: list[str] = []
            undecodable: list[bytes] = []
            for item in resp.get("Contents", ()):
                key = _decode_key(item["Key"], encoded)
                if isinstance(key, bytes):
                    undecodable.append(key)
                    continue
                try:
                    objects.append(_meta(key, int(item.get("Size", 0)), item.get("ETag", ""), item.get("LastModified")))
                except StoreError as exc:  # left out of the listing, its neighbours listed; its lookup says why
                    log.warning("listing %r: %s: left out", prefix, exc.message)
            for item in resp.get("CommonPrefixes", ()):
                sub = _decode_key(item["Prefix"], encoded)
                if isinstance(sub, bytes):
                    undecodable.append(sub)
                else:
                    prefixes.append(sub)
            token = resp.get("NextContinuationToken")
            last = not resp.get("IsTruncated")
            # A listing the server says goes on, and that cannot: a listing that failed is EIO, said, where a
            # listing cut short left files out in silence (ENOENT for files the bucket holds), and a repeated token
            # (a server that ignores it sends page one again) listed for good, with every reader of the directory
            # waiting in the kernel, beyond the reach of SIGKILL.
            if not last and not token:
                raise StoreError(f"listing {prefix!r}: the server said the listing goes on, but gave no continuation "
                                 "token")
            if not last and token in tokens:
                raise StoreError(f"listing {prefix!r}: the server gave the continuation token {token[:64]!r} a second "
                                 "time (it sends the same page again: does it ignore continuation tokens?)")
            if token:
                tokens.add(token)
            yield ListingPage(objects, prefixes, undecodable, last)
            if last:
                return

    def has_children(self, prefix: str) -> bool:
        # Delimited, as the listings are: SeaweedFS keeps a folder whose keys were all deleted, and names it in its
        # parent's delimited listing and in its own (as the object `prefix`), but not in an undelimited one, so a
        # lookup called ENOENT a directory `ls` showed. On S3 both find the same keys.
        resp = self._list_objects(prefix, Delimiter="/", MaxKeys=1, EncodingType="url")
        return bool(resp.get("KeyCount") or resp.get("Contents") or resp.get("CommonPrefixes"))

    def _renew(self, why: str) -> bool:
        """After a request was refused for its credentials (`why`: the error code): whether they are other now
        than when it was signed (`credentials.Renewable.renew`), so that sending it again may help."""
        return self._credentials is not None and self._credentials.renew(why)

    def _credentials_changes(self) -> int:
        """How many renewals changed the credentials (`credentials.Renewable.changes`; 0 if nothing renews them)."""
        return self._credentials.changes if self._credentials is not None else 0

    def _credentials_expiry(self) -> float | None:
        """When the credentials signing now expire (`credentials.Renewable.expiry`; None if nothing says)."""
        return self._credentials.expiry() if self._credentials is not None else None

    def _refused_again(self, why: str) -> None:
        """A request sent again, signed anew because `_renew` said the credentials changed, was refused again for
        `why` (`credentials.Renewable.refused_again`: a policy's refusal looks the credentials up no more)."""
        if self._credentials is not None:
            self._credentials.refused_again(why)

    def _signed_anew(self, response: Any = None, request_dict: Any = None, operation: Any = None,
                     **_: Any) -> int | None:
        """botocore's `needs-retry` hook (called after its own retry handler said no): a request refused for its
        credentials is sent once more, signed anew, if they changed (`_renew`). Every call on the client: HEADs,
        listings, the writes of `uploads.Uploads`, GETs of --get-client boto3; a HEAD's bare 403 excepted, which
        `head` renews for once a listing named the key (a missing key's answer too, B131/B135)."""
        if not response or response[0] is None or response[0].status_code not in CREDENTIAL_STATUSES:
            return None
        code = str((response[1] or {}).get("Error", {}).get("Code", ""))
        context = request_dict.get("context", {}) if request_dict else {}
        if code not in CREDENTIAL_CODES:
            return None
        if code == "403" and getattr(operation, "name", "") == "HeadObject":
            return None  # maybe a missing key's answer: `head` lists it first, then renews (B135)
        if context.get("modelfs_signed_anew"):
            self._refused_again(code)
            return None
        if not self._renew(code):
            return None
        context["modelfs_signed_anew"] = True
        return 0

    def _bound_answers(self) -> None:
        """The client's answers read to RESPONSE_MAX at most (`_bounded_send`), by a botocore attribute of its own:
        where a botocore has it no more, they are read as it reads them, said at mount."""
        session_of = getattr(getattr(self._client, "_endpoint", None), "http_session", None)
        if not callable(getattr(session_of, "send", None)):
            log.warning("this botocore's client has no _endpoint.http_session.send: its answers are read whole, "
                        "unbounded")
            return
        session_of.send = _bounded_send(session_of.send)

    def _use_region(self, region: str) -> bool:
        """Presign for `region` from now on: the bucket said it is there (presigned.WrongRegion). False if that is
        the region already signed for (the endpoint is another region's: nothing to gain in trying again)."""
        from botocore.config import Config

        with self._region_lock:
            if self._presigner.meta.region_name == region:
                return False
            was = self._presigner.meta.region_name
            self._presigner = self._session.client("s3", endpoint_url=self._cfg.endpoint_url,
                                                   config=self._botocfg.merge(Config(region_name=region)))
        log.warning("bucket %s is in region %s, not %s: its reads and writes are signed for %s from now on (say "
                    "--region %s to start so)", self.bucket, region, was, region, region)
        return True

    def _presign(self, key: str, operation: str = "get_object") -> str:
        try:
            return self._presigner.generate_presigned_url(
                operation, Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=URL_EXPIRES_S)
        except Exception as exc:  # noqa: BLE001
            raise translate_error(exc, self.bucket, f"signing a {operation} of {key!r}") from None

    def _presign_put(self, key: str) -> str:
        return self._presign(key, "put_object")

    def _presign_delete(self, key: str) -> str:
        return self._presign(key, "delete_object")

    def get_range(self, key: str, etag: str, start: int, end: int, buffer: WritableBuffer | None = None,
                  size: int | None = None) -> bytes | WritableBuffer:
        etag = sent_etag(etag)  # none for a version the server gave no ETag for
        if_match = not self._if_match_refused
        try:
            return self._get_range(key, etag, start, end, buffer, if_match, size)
        except SizeChanged:
            raise  # the ETag matched: no refusal of it (a HEAD would say "the same version", and If-Match be dropped)
        except PreconditionFailed:
            if not (etag and if_match and self._refuses_its_own_etag(key, etag)):
                raise
            return self._get_range(key, etag, start, end, buffer, False, size)

    def _refuses_its_own_etag(self, key: str, etag: str) -> bool:
        """Whether a GET of version `etag` refused with 412 met a server that refuses If-Match with the ETags it gives
        (a HEAD says `etag` is the current version): SeaweedFS 3.97 for objects older versions stored
        (seaweedfs#7274), a server giving weak ETags (If-Match never matches them). Every read was EIO ("object
        changed"). GETs are then sent without If-Match, for good, each answer's ETag checked instead (and needed)."""
        try:
            meta = self.head(key)
        except StoreError:
            return False
        if meta is None or changed_etag(etag, meta.etag, "") is not None:
            return False  # replaced indeed
        with self._region_lock:
            told, self._if_match_refused = self._if_match_refused, True
        if not told:
            log.warning("%s: the server refuses If-Match with the ETag %s its HEAD gives: reads are sent without "
                        "If-Match from now on, the ETag of each answer checked instead", key, etag)
        return True

    def _get_range(self, key: str, etag: str, start: int, end: int, buffer: WritableBuffer | None,
                   if_match: bool, size: int | None) -> bytes | WritableBuffer:
        want = end - start
        if want <= 0:
            return b""
        what = f"GET {key!r} bytes {start}-{end - 1}"
        attempts = self._get_attempts
        for attempt in range(1, attempts + 1):
            try:
                if self._ranges is None:
                    return self._boto3_get_range(key, etag, start, end, buffer, what, if_match, size)
                if buffer is None:
                    buffer = new_buffer(want)
                self._ranges.get_into(key, etag, start, buffer, what, if_match=if_match, size=size)
                return buffer
            except Exception as exc:  # noqa: BLE001
                err = translate_error(exc, self.bucket, what)
                # A try that timed out (a head or body that stalled, or came too slowly, for --read-timeout) is not
                # tried again here: the level stack does, while a READ still waits for the chunk. Here a chunk that
                # stalls on every try would hold its fetch thread for all of them (10 minutes at the default).
                retry = (isinstance(err, TransientError) and not isinstance(err, TimedOut)
                         or self._ranges is not None and isinstance(err, Unreachable))
                if not retry or attempt == attempts:
                    raise err from None
                with self._region_lock:  # fetch threads count here at once, rarely (a failure each time)
                    self.get_retries += 1
                delay = self._backoff_base * (2 ** (attempt - 1)) * (0.5 + random.random())
                log.debug("%s failed (%s), retry %d in %.2fs", what, err.message, attempt, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _boto3_get_range(self, key: str, etag: str, start: int, end: int, buffer: WritableBuffer | None,
                         what: str, if_match: bool = True, size: int | None = None) -> bytes | WritableBuffer:
        want = end - start
        kwargs: dict[str, Any] = dict(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        if etag and if_match:
            kwargs["IfMatch"] = etag
        # No botocore try of it begins past --read-timeout after the first (`within`): a head not in by then was sent
        # again BOTO_MAX_ATTEMPTS times in this fetch thread, a read timeout each, where a presigned GET's try is one
        # (B420: the level stack tries it again, while a READ waits for the chunk).
        deadline = time.monotonic() + self._cfg.read_timeout
        try:
            resp = within(deadline, lambda: self._client.get_object(**kwargs))
        except TimedOut:  # (`_no_try_past_the_deadline`'s; botocore's own timeouts are its exceptions)
            raise TimedOut(f"{what}: no answer within the read timeout ({self._cfg.read_timeout:g}s)") from None
        content_range = resp.get("ContentRange")
        if content_range and not content_range.startswith(f"bytes {start}-{end - 1}/"):
            raise TransientError(f"{what}: server answered with {content_range!r}")
        # The object's size on the server (a 200's whole length where no range is said) against the one the version
        # was pinned at (B209, as `RangeGetter._read`); the body is left unread. A 206 without a Content-Range says no
        # total: not compared; nor a 200 that does not name the version (another ETag, or none where the version has
        # one: a proxy's page of its own, the transient error it was, B215).
        if content_range:
            total: str | None = content_range.rpartition("/")[2]
        else:
            got = resp.get("ETag")
            ours = not etag or bool(got) and changed_etag(etag, got, what) is None
            whole = (resp.get("ResponseMetadata", {}).get("HTTPStatusCode") == 200 and "ContentLength" in resp
                     and ours)
            total = str(resp["ContentLength"]) if whole else None
        wrong_size = size_changed(total, size, what)
        if wrong_size is not None:
            resp["Body"].close()
            raise wrong_size
        changed = changed_etag(etag, resp.get("ETag"), what, needed=not if_match)
        if changed is not None:
            raise changed
        # A body longer than the range is as wrong as a short one: ask for one byte more than the range.
        # Its body by the same deadline (B770), as a presigned GET's: read by --read-timeout after the request began.
        with ObjectReader(resp["Body"], want, self.bucket, what, deadline=deadline,
                          read_timeout=self._cfg.read_timeout) as reader:
            if buffer is None:
                data: bytes | WritableBuffer = reader.read(want + 1)
                got = len(data)
            else:
                data, got = buffer, reader.readinto(buffer)
                got += len(reader.read(1))
        if got != want:
            raise TransientError(f"{what}: {got} bytes of body, {want} asked for")
        return data

    # -- whole objects (the shared chunk tier) ---------------------------------------------------

    def get_object(self, key: str) -> bytes | None:
        """The whole object, or None if there is no such key."""
        reader = self.open_object(key)
        if reader is None:
            return None
        with reader:
            return reader.read(reader.size)

    def open_object(self, key: str) -> ObjectReader | Body | None:
        """The object as a stream to read (into a buffer of the caller's), or None if there is no such key.
        One request (the tier's reads: a failed one falls back to the origin), by the same path as ranged
        GETs: the presigned one reads straight into the caller's buffer, where botocore's body reads into
        fresh bytes and copies them (a warm-tier load of 1.72 GB cost the daemon 2.9-3.4 CPU-s that way,
        1.6-1.9 this way; bench/fleet.py one-warm, pinned)."""
        what = f"GET {key!r}"
        if self._ranges is not None:
            try:
                return self._ranges.open(key, what)
            except NotFound:
                return None
        # Its body read by --read-timeout (the tier's request timeout) after the request began, as the presigned
        # path's (B771); botocore begins no try past it (`within`).
        deadline = time.monotonic() + self._cfg.read_timeout
        try:
            resp = within(deadline, lambda: self._client.get_object(Bucket=self.bucket, Key=key))
        except TimedOut:
            raise TimedOut(f"{what}: no answer within the read timeout ({self._cfg.read_timeout:g}s)") from None
        except Exception as exc:  # noqa: BLE001
            err = translate_error(exc, self.bucket, what)
            if isinstance(err, NotFound):
                return None
            raise err from None
        reader = ObjectReader(resp["Body"], int(resp["ContentLength"]), self.bucket, what, deadline=deadline,
                              read_timeout=self._cfg.read_timeout)
        reader.server_age_s = server_age_s(resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"),
                                           resp.get("LastModified"))
        return reader

    def put_object(self, key: str, body: bytes | Sequence[bytes | WritableBuffer], *,
                   only_if_absent: bool = False) -> bool:
        """Store an object (`body` may be a list of parts, stored joined); with `only_if_absent` (If-None-Match:
        *, on OSS x-oss-forbid-overwrite) False if the key exists already. An unconditional PUT takes the
        presigned path (the shared tier's chunk objects: its parts are sent without being joined first, 0.4
        against 0.7-0.9 client CPU-s/GB through botocore, measured against SeaweedFS), and so does a
        conditional one (the tier's claims: 0.9-1.3 against 2.1 client ms a request) except on OSS, whose
        create-only header botocore signs."""
        if self._ranges is not None and not (only_if_absent and self._oss):
            return self._ranges.put(key, [body] if isinstance(body, bytes) else body, f"PUT {key!r}",
                                    only_if_absent=only_if_absent)
        if not isinstance(body, bytes):
            body = b"".join(body)
        kwargs: dict[str, Any] = dict(Bucket=self.bucket, Key=key, Body=body)
        if only_if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            self._client.put_object(**kwargs)
            return True
        except Exception as exc:  # noqa: BLE001
            err = translate_error(exc, self.bucket, f"PUT {key!r}")
            # 412: the key exists; 409: a concurrent conditional write to it is in progress (S3), or the
            # key exists (OSS's FileAlreadyExists).
            if only_if_absent and (isinstance(err, PreconditionFailed) or _client_error_code(exc)[1] == 409):
                return False
            raise err from None

    def delete_object(self, key: str) -> None:
        """Delete a key (the shared tier's claims and markers): by the presigned path when there is one
        (1.3 client ms a request through botocore)."""
        if self._ranges is not None:
            self._ranges.delete(key, f"DELETE {key!r}")
            return
        try:
            self._client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            raise translate_error(exc, self.bucket, f"DELETE {key!r}") from None


# The most one readinto of a body asks for. urllib3's HTTPResponse.readinto reads the whole request into a new
# bytes object, then copies it: asked for a whole chunk at once, each fetch held a second chunk outside the
# memory budget (16 x 256 MiB at --chunk-size 256M, 325 MiB over --memory-limit measured), and woke once per
# chunk, not once per MiB as the stall check counts on.
READ_SLICE = 1024 * 1024


class Alarms:
    """One thread that calls each `at(deadline, fn)`'s `fn` at its deadline (time.monotonic()) unless cancelled
    before: `ObjectReader`'s read timeouts (B862), a thread started per GET saved (0.1-0.2 ms of CPU each, measured
    on the 2-core test machine, a tenth of botocore's own per request). `fn` runs in that thread, so it must be
    short and never wait for a thread that waits for it. `_heap`, `_live` and `_thread` are under `_cond`; a
    cancelled alarm lets go of its `fn` at once, its (deadline, id) left in the heap until it comes to the top or
    the heap is rebuilt of the live ones (when four times as many)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, deadline: float, fn: Callable[[], None]) -> int:
        """Call `fn` at `deadline`; the alarm's id, for `cancel`."""
        with self._cond:
            alarm = next(self._ids)
            heapq.heappush(self._heap, (deadline, alarm))
            self._live[alarm] = fn
            if self._thread is None or not self._thread.is_alive():  # (not after a fork either)
                self._thread = threading.Thread(target=self._run, name="modelfs-read-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == alarm:  # sooner than the one the thread waits for
                self._cond.notify()
        return alarm

    def cancel(self, alarm: int) -> None:
        """No call from here on (one under way in the alarm thread may still run)."""
        with self._cond:
            self._live.pop(alarm, None)
            if len(self._heap) > 64 and len(self._heap) > 4 * len(self._live):
                self._heap = [entry for entry in self._heap if entry[1] in self._live]
                heapq.heapify(self._heap)

    def pending(self) -> int:
        with self._cond:
            return len(self._live)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        fn = self._live.pop(heapq.heappop(self._heap)[1])
                        break
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            try:
                fn()
            except Exception:  # noqa: BLE001 -- one alarm's failure must not end the others'
                log.exception("a read deadline's alarm failed")


ALARMS = Alarms()


class ObjectReader:
    """The body of one GET: `read(n)` and `readinto(buffer)` until `size` bytes are in, with botocore's
    failures turned into StoreErrors. Close it (or use it as a context manager) when done.

    With a `deadline` (time.monotonic()) the body is read by then, not per packet only (B770): botocore's read
    timeout is one recv's, so a body sent a few bytes at a time, each in time, held its fetch thread for as long as
    the server went on. A timer shuts the socket's reading side down at the deadline (urllib3's
    `HTTPResponse.shutdown`, meant for a read blocked in another thread); the read under way then ends, and every
    failure of this body from then on is `TimedOut`. Bytes read before it are whole (a shutdown only ends the
    stream). The timer, `close` and urllib3's giving the connection back to its pool (`release_conn`, which it calls
    inside the read that takes the body's last bytes) meet under `_lock` (B860): a shutdown is made only while the
    connection is still this body's, and a connection whose reading side was shut down is closed, not pooled, so a
    deadline never cuts a later request on it. With a urllib3 older than 2.3 (no `HTTPResponse.shutdown`) the socket
    under the response is shut down itself."""

    def __init__(self, body: Any, size: int, bucket: str, what: str, *, deadline: float | None = None,
                 read_timeout: float = 0.0):
        self._body = body
        self.size = size
        self.server_age_s: float | None = None  # the object's age on the server's clock (store.server_age_s)
        self._bucket, self._what = bucket, what
        self._read_timeout = read_timeout
        # `_timer`, `_timed_out`, `_closed` and `_released` are written under `_lock` (this thread and the timer's);
        # `_timed_out`, once set never cleared, is read without it. The shutdown is made under it too.
        self._lock = threading.Lock()
        self._timer: int | None = None  # its `ALARMS` id
        self._timed_out = self._closed = self._released = False
        self._raw = getattr(body, "_raw_stream", None)  # botocore's StreamingBody over urllib3's HTTPResponse
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._timed_out = True
            else:
                release = getattr(self._raw, "release_conn", None)
                if release is not None:  # urllib3 calls it by `self.release_conn()`: the instance's is this one
                    self._raw.release_conn = lambda: self._release_conn(release)
                self._timer = ALARMS.at(deadline, self._time_out)

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop_timer()
        self._body.close()

    def _stop_timer(self) -> None:
        """No shutdown from here on."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            ALARMS.cancel(timer)
            getattr(self._raw, "__dict__", {}).pop("release_conn", None)  # (its cycle: freed now, not by the GC)

    def _release_conn(self, release: Callable[[], None]) -> None:
        """urllib3 gives the connection back to its pool (the body read whole, in this thread): no shutdown from
        here on, as the connection may serve another request at once (B860); one shut down already is closed."""
        with self._lock:
            self._released = True
            conn = getattr(self._raw, "_connection", None)
            if self._timed_out and conn is not None:
                conn.close()  # (pooled closed: the pool connects it again)
            release()

    def _time_out(self) -> None:
        """In the timer's thread, at the deadline: end the read under way, while the connection is still ours."""
        with self._lock:
            if self._closed or self._released:
                return
            self._timed_out = True
            try:
                try:
                    self._raw.shutdown()
                except (AttributeError, NotImplementedError):  # urllib3 before 2.3: the socket, ours until released
                    self._raw._connection.sock.shutdown(socket.SHUT_RD)
            except Exception as exc:  # noqa: BLE001 -- already closed, or not urllib3's: nothing to end
                log.debug("%s: the read timeout could not end the body's read: %r", self._what, exc)

    def _timed_out_error(self) -> TimedOut:
        return TimedOut(f"{self._what}: the body was not in within the read timeout ({self._read_timeout:g}s)")

    def read(self, n: int) -> bytes:
        """Exactly n bytes, or fewer only at the end of the object."""
        parts, left = [], n
        while left > 0:
            part = self._call(self._body.read, left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` (fewer bytes only at the end of the object); the count."""
        view, got = memoryview(buffer).cast("B"), 0
        while got < len(view):
            n = self._call(self._body.readinto, view[got:got + READ_SLICE])
            if not n:
                break
            got += n
        return got

    def _call(self, fn: Any, arg: Any) -> Any:
        if self._timed_out:
            raise self._timed_out_error()
        try:
            got = fn(arg)
        except Exception as exc:  # noqa: BLE001
            if self._timed_out:
                raise self._timed_out_error() from None
            raise translate_error(exc, self._bucket, self._what) from None
        if self._timed_out:  # ended by the shutdown: the stream's end is not the body's
            raise self._timed_out_error()
        return got
