"""The write side of the store (`--writable`): single PUTs, multipart uploads, server-side copies, deletes,
and the listing of incomplete uploads that `modelfs cleanup` aborts.

It sends what it is told and maps failures through the one error mapping (`boto3_store.translate_error`);
which bytes go where, and when, is `writes.py`'s business. botocore retries each request (5xx, throttling,
resets) in its standard mode, so a failure that reaches the caller is final. Every method blocks; callers
run them in worker threads. Thread-safe: one boto3 client, shared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from fsmount.data.boto3_store import Boto3Store, _client_error_code, _deadline, translate_error
from fsmount.data.store import (
    NotFound,
    PreconditionFailed,
    StoreError,
    TimedOut,
    TransientError,
    changed_etag,
    quoted_etag,
    sent_etag,
    server_age_s,
)

log = logging.getLogger(__name__)

# The error codes a server that does not take If-None-Match answers a create-only store with: S3 before its
# conditional writes, MinIO, Ceph and the like say NotImplemented (501), others a generic 400 (InvalidArgument,
# InvalidRequest, an unsupported header). A code that names something else (KeyTooLongError, InvalidObjectName,
# EntityTooLarge, a part lost: InvalidPart, NoSuchUpload) is a refusal of the key or the body, not of the condition.
CONDITION_REFUSAL_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest", "BadRequest",
                                     "UnsupportedHeader", "NotSupported"})


# What a part, a copied part or a completion is told when the bucket no longer has its multipart upload (NoSuchUpload):
# something outside this mount aborted it while the file was written.
UPLOAD_GONE = ("the bucket no longer has this file's multipart upload (NoSuchUpload): it was aborted from outside this "
               "mount, as `modelfs cleanup --older-than` below the upload's age or a lifecycle rule that aborts "
               "incomplete uploads do")


def refuses_the_condition(exc: Exception) -> bool:
    """Whether a create-only store's refusal (not the 412/409 of a key that exists) may be of If-None-Match itself:
    a 501, a code of CONDITION_REFUSAL_CODES, an answer with no code (botocore names it by its status), or a message
    that names the header."""
    code, status, message = _client_error_code(exc)
    if status == 501 or code in CONDITION_REFUSAL_CODES or code in ("", str(status)):
        return True
    return any(word in message.lower() for word in ("if-none-match", "ifnonematch", "conditional"))


# S3's limits on multipart uploads (and what OSS, SeaweedFS and MinIO accept).
MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PART_SIZE = 5 * 1024 * 1024 * 1024
MAX_PARTS = 10_000
# One CopyObject copies at most this much; above it a copy is a multipart upload of UploadPartCopy parts.
COPY_OBJECT_MAX = 5 * 1024 * 1024 * 1024


class Exists(StoreError):
    """A create-only PUT or completion found the key there: another writer created it meanwhile."""


class Replaced(StoreError):
    """A conditional DELETE, or a store sent with If-Match (`put`, `finish`), found another object under the key, or
    (a store) none: another writer stored it, or deleted it, meanwhile."""

    # The server answered 412, the condition did not hold: not a 409 (S3: a conditional write to the key is in
    # progress) nor a 404 (nothing there). Only such a 412 may be a server refusing its own ETag (`Uploads._or_plain`).
    precondition_failed = False


# Whether a try of the CreateMultipartUpload this thread sends may have begun an upload whose id never came back:
# it got no answer, or a 5xx other than 503 (a proxy's 502/504, a 500 after the work). A 503 (SlowDown) or a 4xx
# began nothing, so a start retried after those leaves nothing behind to name. And how many tries were answered 2xx,
# each an upload begun: botocore retries one whose document it cannot parse (cut short), so only the last one's id
# comes back.
_start_tries = threading.local()
# 503: S3's SlowDown and Service Unavailable, refused before any work.
REFUSED_UNDONE = 503


def _note_start_answer(response_dict: dict[str, Any] | None = None, exception: Exception | None = None,
                       **_: Any) -> None:
    """botocore's response-received of a CreateMultipartUpload, after each try, in the request's thread (its status
    is the HTTP one, before botocore takes a 200 it cannot parse for a 500). A try its deadline stopped
    (`_no_try_past_the_deadline`) was never sent."""
    if isinstance(exception, TimedOut):
        return
    status = response_dict.get("status_code", 0) if response_dict is not None else 0
    if response_dict is None or (status >= 500 and status != REFUSED_UNDONE):
        _start_tries.maybe_begun = True
    elif status < 300:
        _start_tries.answered_2xx = getattr(_start_tries, "answered_2xx", 0) + 1  # 0 in a thread no start ran in


def _if_absent(only_if_absent: bool) -> dict[str, str]:
    return {"IfNoneMatch": "*"} if only_if_absent else {}


def _if_version(etag: str | None) -> dict[str, str]:
    """The condition of a store that replaces the version `etag` only: none where there is none to pin (a version the
    server gave no ETag for, `store.version_tag`)."""
    etag = sent_etag(etag) if etag else ""
    return {"IfMatch": etag} if etag else {}


def _if_source(etag: str) -> dict[str, str]:
    """The condition pinning a copy's source to the version `etag`: none for one the server gave no ETag for (and so
    none for its `store.version_tag`), where botocore sent an empty `x-amz-copy-source-if-match:`, which no version
    matches."""
    etag = sent_etag(etag)
    return {"CopySourceIfMatch": etag} if etag else {}


def _field(resp: dict[str, Any], name: str, what: str) -> Any:
    """`name` of an answer. A 200 whose body was cut short before its first byte reaches botocore as a success with
    nothing in it: a broken answer (whether the request took effect is unknown), never a KeyError that leaves a
    file half set up."""
    try:
        return resp[name]
    except KeyError:
        raise TransientError(f"{what}: the answer was cut short (no {name} in it)") from None


def put_etag(body: bytes | bytearray) -> str:
    """The ETag S3 gives an object stored by one PUT of `body` (without SSE-KMS or SSE-C)."""
    return f'"{hashlib.md5(body, usedforsecurity=False).hexdigest()}"'


def multipart_etag(etags: list[str]) -> str | None:
    """The ETag S3 gives a multipart upload completed from parts of these ETags (MD5s): the MD5 of their digests,
    and their count; None where a part's ETag is no MD5 (encryption), so it cannot be told."""
    try:
        digests = b"".join(bytes.fromhex(etag.strip('"')) for etag in etags)
    except ValueError:
        return None
    if len(digests) != 16 * len(etags):
        return None
    return f'"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"'


@dataclasses.dataclass(frozen=True, slots=True)
class PendingUpload:
    """An incomplete multipart upload in the bucket; `age_s` its age on the server's clock (the listing's Date less
    `initiated`: store.server_age_s), None if the server did not give both."""

    key: str
    upload_id: str
    initiated: datetime | None
    age_s: float | None = None


class Uploads:
    """Write requests on the bucket of a `Boto3Store` (its client, its credentials, its addressing)."""

    def __init__(self, store: Boto3Store):
        self.bucket = store.bucket
        self._client = store.client
        self.head = store.head
        self.has_children = store.has_children
        self._client.meta.events.register("response-received.s3.CreateMultipartUpload", _note_start_answer)
        # Set once the server refused If-None-Match itself (`_or_plain`): an O_EXCL file's store then goes without it.
        # Written from request threads, only ever to True.
        self.if_none_match_refused = False
        # The same for If-Match on a store (`_or_plain`): a rewrite that keeps the version it opened is then stored
        # without it. Written from request threads, only ever to True.
        self.if_match_refused = False
        # Set once a store's If-Match was answered 412 while a HEAD found the key holding that ETag, and stored
        # without it (`_or_plain`; one warning). Not `if_match_refused`: the next store sends it again. Written from
        # request threads, only ever to True (two at once may both log it).
        self.own_etag_refusal_told = False
        # Set once a create-only store that cannot go without the condition (no --allow-overwrite) was refused for a
        # reason of the server's own, and the warning saying what to do was logged (`_call`). Written from request
        # threads, only ever to True (two refusals at once may both log it).
        self.create_only_refusal_told = False
        # Told the key of an upload the server may have begun that `start` never returned (an answer lost, and
        # botocore sent the request again; or an answer cut short): nothing of this mount will abort it. Called in
        # the request's thread.
        self.on_unknown_upload: Callable[[str], None] | None = None

    def _call(self, what: str, fn: Any, *, advise: bool = False, gone_is_replaced: bool = False, **kwargs: Any) -> Any:
        """`fn` on the bucket, its failure as a StoreError. `advise`: a create-only store that has no way without
        the condition; refused for a reason of the server's own, the first such refusal is told with what to do.
        `gone_is_replaced`: a store sent with If-Match, to which a key that holds nothing any more (S3 and moto: 404
        NoSuchKey; SeaweedFS: 412) is `Replaced` too (a NoSuchUpload is not: the upload is gone, not the object)."""
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one StoreError
            err = translate_error(exc, self.bucket, what)
            # 412 (S3, SeaweedFS, MinIO) or 409 (OSS's FileAlreadyExists; S3's conflicting conditional write)
            # to a create-only request: the key exists.
            if "IfNoneMatch" in kwargs and (isinstance(err, PreconditionFailed) or _client_error_code(exc)[1] == 409):
                raise Exists(f"{what}: the key was created meanwhile by another writer (a create-only store: "
                             "no --allow-overwrite, or a file created O_EXCL)") from None
            # 412 to a conditional DELETE (409: a conditional write to the key is in progress, S3).
            if "IfMatch" in kwargs and (isinstance(err, PreconditionFailed) or _client_error_code(exc)[1] == 409):
                replaced = Replaced(f"{what}: another object is under the key now")
                replaced.precondition_failed = isinstance(err, PreconditionFailed)
                raise replaced from None
            if "IfMatch" in kwargs and gone_is_replaced and _client_error_code(exc)[0] == "NoSuchKey":
                raise Replaced(f"{what}: the key holds nothing now") from None
            if isinstance(err, NotFound) and _client_error_code(exc)[0] == "NoSuchUpload":
                # Said as "not found", the writer's warning read as if its key were missing (B882).
                raise NotFound(f"{what}: {UPLOAD_GONE}") from None
            # Not the 412/409 of a key that exists, nor a refusal of the key or the body (KeyTooLongError).
            if advise and "IfNoneMatch" in kwargs and type(err) is StoreError and refuses_the_condition(exc):
                self._tell_create_only_refused(what, exc)
            raise err from None

    def _tell_create_only_refused(self, what: str, exc: Exception) -> None:
        """Without --allow-overwrite every store is create-only, and on a server that refuses If-None-Match itself
        (501, a 400 of its own) every close got EIO with the server's error alone: nothing said why, nor what to do.
        One warning says it (the refusal may be of the key instead, hence the "if"; a code that names the key or the
        body, KeyTooLongError, does not tell it: `refuses_the_condition`)."""
        if self.create_only_refusal_told:
            return
        self.create_only_refusal_told = True
        code, status, _ = _client_error_code(exc)
        answer = " ".join(part for part in (str(status) if status else "", code) if part) or "an error"
        log.warning("%s: the server refused a create-only store (If-None-Match: *) with %s. Without "
                    "--allow-overwrite every store of this mount is create-only (nothing another writer stored is "
                    "replaced), so if this server does not take If-None-Match no file can be stored here (each "
                    "close gets EIO): mount with --allow-overwrite, which then stores without the condition, "
                    "replacing what another writer stored under the same name meanwhile", what, answer)

    def _or_plain(self, or_plain: bool, what: str, fn: Any, **kwargs: Any) -> Any:
        """`_call`; with `or_plain`, a server that refuses the request's condition itself (If-None-Match, or a store's
        If-Match; 501, a 4xx of its own: not the 412 or 409 of another object there) gets the request again without
        it, and so do the next ones with that condition (one warning). The header counts as refused only where the
        request without it is taken: a refusal for another reason (a key the server refuses, a part it lost) made
        every later O_EXCL file of the mount replace another writer's. A store's 412 to If-Match on the ETag a HEAD
        then finds the key holding gets this request without it, not the next ones."""
        header = "IfMatch" if "IfMatch" in kwargs else "IfNoneMatch" if "IfNoneMatch" in kwargs else None
        refused_before = header is not None and (self.if_match_refused if header == "IfMatch"
                                                 else self.if_none_match_refused)
        if or_plain and refused_before:
            kwargs.pop(header)
        try:
            return self._call(what, fn, advise=not or_plain, gone_is_replaced=header == "IfMatch", **kwargs)
        except Replaced as exc:
            # A 412 to If-Match on the ETag the key still holds is the server refusing its own ETag (a weak one, or
            # SeaweedFS 3.97's for objects older versions stored, seaweedfs#7274: reads met it too, B66), not another
            # writer's update: every such rewrite's close was EIO there. (A 409 is another write to the key under way:
            # the HEAD may still find the version opened.)
            if not (or_plain and header == "IfMatch" and exc.precondition_failed
                    and self._holds(kwargs["Key"], kwargs["IfMatch"])):
                raise
            # That object's store only goes without it: such a refusal may be of some objects alone (seaweedfs#7274:
            # those older versions stored), and taken as the server's, every later rewrite of the mount replaced
            # another writer's update unchecked (B372). The next one sends it again.
            etag = kwargs.pop(header)
            result = self._call(what, fn, **kwargs)
            if not self.own_etag_refusal_told:
                log.warning("%s: the server refused a store with If-Match on the ETag %s that a HEAD finds the key "
                            "holding (412: it refuses its own ETag): such a store goes without it, replacing what "
                            "another writer stored there since that HEAD", what, etag)
            self.own_etag_refusal_told = True
            return result
        except StoreError as exc:
            if not or_plain or header not in kwargs or type(exc) is not StoreError:
                raise
            refused = exc
        del kwargs[header]
        result = self._call(what, fn, **kwargs)
        if header == "IfMatch":
            if not self.if_match_refused:
                log.warning("%s: the server refused a store with If-Match (%s): a rewrite that keeps the bytes of the "
                            "file it opened (an append to an empty file, r+) is stored without it on this server, "
                            "replacing what another writer stored under its name since its open", what, refused.message)
            self.if_match_refused = True
            return result
        if not self.if_none_match_refused:
            log.warning("%s: the server refused it with If-None-Match (%s): an O_EXCL file's store replaces "
                        "what another writer stored meanwhile on this server", what, refused.message)
        self.if_none_match_refused = True
        return result

    def _holds(self, key: str, etag: str) -> bool:
        """Whether `key` holds the version `etag` now (a HEAD; False if it cannot be told)."""
        try:
            meta = self.head(key)
        except StoreError:
            return False
        return meta is not None and changed_etag(etag, meta.etag, "") is None

    def put(self, key: str, body: bytes | bytearray, only_if_absent: bool = False, or_plain: bool = False,
            if_version: str | None = None) -> str:
        """Store a whole object in one PUT; its ETag. `only_if_absent`, `or_plain`, `if_version`: see `finish`."""
        what = f"PUT {key!r}"
        return quoted_etag(_field(self._or_plain(or_plain, what, self._client.put_object, Key=key, Body=body,
                                                 **_if_absent(only_if_absent), **_if_version(if_version)),
                                  "ETag", what))

    def start(self, key: str) -> str:
        """Begin a multipart upload; its upload id."""
        what = f"starting an upload of {key!r}"
        _start_tries.maybe_begun, _start_tries.answered_2xx = False, 0
        cut = False
        try:
            resp = self._call(what, self._client.create_multipart_upload, Key=key)
            if "UploadId" not in resp:
                # Its head cut after the status line (or its body before the first byte): a 200 with nothing in it,
                # which botocore does not send again, and the file's write got EIO (B220). Sent once more; the
                # upload the first try likely began is named below (`cut`), never used, as a lost answer's is.
                # A second try past the deadline is never sent (`_no_try_past_the_deadline`: TimedOut).
                cut = True
                log.info("%s: the answer was cut short; sent again", what)
                resp = self._call(what, self._client.create_multipart_upload, Key=key)
        except StoreError as exc:
            # A try may have reached the server (no answer in time, a connection cut) and begun an upload whose id
            # never came back: a rename given up on left one in the bucket, named nowhere (the write fault fuzzer).
            # One answered 2xx (cut short: `cut`) began one for certain, whatever the try sent again then met: its
            # connection refused (a server restarting after the cut) was Unreachable, which `Writes.call` starts
            # again, and the cut try's upload was named nowhere (B222). A refused connection alone began nothing.
            if cut or _start_tries.answered_2xx or (isinstance(exc, TransientError) and _start_tries.maybe_begun):
                self._unknown_upload(key)
            raise
        deadline = getattr(_deadline, "at", None)
        if deadline is not None and time.monotonic() > deadline and "UploadId" in resp:
            # Its caller gave up on it meanwhile (a try in flight at the deadline answered late): nothing will use
            # this upload, nor abort it (a rename given up on left one in the bucket: the write fault fuzzer).
            _deadline.at = None
            try:
                self.abort(key, resp["UploadId"])
                aborted = True
            except StoreError:
                aborted = False
            # The upload of a cut try, or of one whose answer was lost (botocore sent it again), is not the one
            # aborted: it was named nowhere (B223).
            if cut or not aborted or _start_tries.maybe_begun or _start_tries.answered_2xx > 1:
                self._unknown_upload(key)
            raise TimedOut(f"{what}: answered after its deadline (the upload is aborted)")
        if cut or _start_tries.maybe_begun or _start_tries.answered_2xx > 1 or "UploadId" not in resp:
            self._unknown_upload(key)
        return _field(resp, "UploadId", what)

    def _unknown_upload(self, key: str) -> None:
        if self.on_unknown_upload is not None:
            self.on_unknown_upload(key)

    def put_part(self, key: str, upload_id: str, number: int, body: bytes | bytearray) -> str:
        """Upload part `number` (1-based); its ETag."""
        what = f"uploading part {number} of {key!r}"
        resp = self._once_more_if_cut(what, lambda r: r.get("ETag"), self._client.upload_part, Key=key,
                                      UploadId=upload_id, PartNumber=number, Body=body)
        return _field(resp, "ETag", what)

    def copy_part(self, key: str, upload_id: str, number: int, source: str, source_etag: str, start: int,
                  end: int) -> str:
        """Part `number` of `key` is bytes [start, end) of `source` (version `source_etag`), copied by the
        server; its ETag."""
        what = f"copying part {number} of {key!r}"
        resp = self._once_more_if_cut(what, lambda r: (r.get("CopyPartResult") or {}).get("ETag"),
                                      self._client.upload_part_copy, Key=key, UploadId=upload_id, PartNumber=number,
                                      CopySource={"Bucket": self.bucket, "Key": source}, **_if_source(source_etag),
                                      CopySourceRange=f"bytes={start}-{end - 1}")
        return _field(_field(resp, "CopyPartResult", what), "ETag", what)

    def _once_more_if_cut(self, what: str, etag_of: Callable[[dict[str, Any]], Any], fn: Any,
                          **kwargs: Any) -> dict[str, Any]:
        """`_call`, sent once more where its answer has no ETag (`etag_of`): a part's upload or copy answered with its
        head cut after the status line reaches botocore as a 200 with nothing in it, which it does not send again, and
        the file's write, or the rename, got EIO although the server had likely stored the part (B166). A part sent
        again under the same number replaces the one stored (S3, MinIO and SeaweedFS keep the last), and the
        completion names the ETag that second answer gives, so it is the same done twice, as a copy is (B151)."""
        resp = self._call(what, fn, **kwargs)
        if not etag_of(resp):
            log.info("%s: the answer was cut short; sent again", what)
            resp = self._call(what, fn, **kwargs)
        return resp

    def finish(self, key: str, upload_id: str, etags: list[str], only_if_absent: bool = False,
               or_plain: bool = False, if_version: str | None = None) -> str:
        """Complete the upload from its parts' ETags, in part order; the object's ETag. With `only_if_absent`
        the server refuses it if the key exists by then (If-None-Match: *, on OSS x-oss-forbid-overwrite):
        `Exists`, and the upload is left to abort. With `or_plain` too, a server that refuses the condition itself
        gets the request without it (`_or_plain`): for an O_EXCL file under --allow-overwrite, which stored so before
        the condition was sent. With `if_version` (an ETag) the server refuses it unless the key still holds that
        version (If-Match; S3 and SeaweedFS take it on a completion, moto 5.2.6 ignores it there): `Replaced` where
        another writer stored or deleted the key since, and the upload is left to abort; with `or_plain`, a server
        that refuses If-Match itself gets the request without it, as above."""
        parts = [{"PartNumber": i, "ETag": etag} for i, etag in enumerate(etags, 1)]
        what = f"completing the upload of {key!r}"
        resp = self._or_plain(or_plain, what, self._client.complete_multipart_upload, Key=key, UploadId=upload_id,
                              MultipartUpload={"Parts": parts}, **_if_absent(only_if_absent),
                              **_if_version(if_version))
        return quoted_etag(_field(resp, "ETag", what))

    def abort(self, key: str, upload_id: str) -> None:
        """Drop an incomplete upload and its parts (one already gone counts as done)."""
        try:
            self._call(f"aborting the upload of {key!r}", self._client.abort_multipart_upload, Key=key,
                       UploadId=upload_id)
        except NotFound:
            pass

    def copy(self, source: str, source_etag: str, key: str) -> str:
        """Copy an object of at most COPY_OBJECT_MAX bytes, as it is at `source_etag`; the copy's ETag."""
        what = f"copying {source!r} to {key!r}"
        kwargs: dict[str, Any] = dict(Key=key, CopySource={"Bucket": self.bucket, "Key": source},
                                      **_if_source(source_etag))
        resp = self._call(what, self._client.copy_object, **kwargs)
        if not (resp.get("CopyObjectResult") or {}).get("ETag"):
            # An answer cut short (a head cut after its status line: a 200 with no body, parsed as a result with
            # nothing in it, which botocore does not send again): the copy was likely made, and a rename got EIO with
            # the file under both names (B151). Pinned to its source's version and replacing whatever `key` holds, it
            # is the same done twice: sent once more.
            log.info("%s: the answer was cut short; sent again", what)
            resp = self._call(what, self._client.copy_object, **kwargs)
        return quoted_etag(_field(_field(resp, "CopyObjectResult", what), "ETag", what))

    def delete(self, key: str) -> None:
        """Delete a key (S3 answers a missing key with success too)."""
        self._call(f"DELETE {key!r}", self._client.delete_object, Key=key)

    def delete_version(self, key: str, etag: str) -> bool:
        """Delete a key if it still holds the object `etag` names (If-Match; S3, SeaweedFS, MinIO and moto take it):
        False, and nothing deleted, if another writer stored an object there since. A server that refuses the
        condition itself (501, or a 4xx of its own) gets the plain DELETE, as before it was asked."""
        try:
            self._call(f"DELETE {key!r}", self._client.delete_object, Key=key, IfMatch=etag)
        except Replaced:
            return self.head(key) is None  # SeaweedFS answers 412 for a key that is gone, too
        except NotFound:
            return True
        except StoreError as exc:
            if type(exc) is not StoreError:  # refused, unreachable, overloaded: the plain DELETE would be too
                raise
            log.info("DELETE %r: the server refused it with If-Match (%s): deleted without", key, exc.message)
            self.delete(key)
        return True

    def pending(self, prefix: str) -> list[PendingUpload]:
        """Every incomplete multipart upload of a key under `prefix`, all pages."""
        out: list[PendingUpload] = []
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            what = f"listing uploads under {prefix!r}" if prefix else "listing uploads"  # not "under ''"
            resp = self._call(what, self._client.list_multipart_uploads, **kwargs)
            date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            for item in resp.get("Uploads", ()):
                out.append(PendingUpload(item["Key"], item["UploadId"], item.get("Initiated"),
                                         server_age_s(date, item.get("Initiated"))))
            if not resp.get("IsTruncated"):
                return out
            kwargs.update(KeyMarker=resp.get("NextKeyMarker", ""), UploadIdMarker=resp.get("NextUploadIdMarker", ""))
