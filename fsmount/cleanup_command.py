"""`modelfs cleanup BUCKET`: find the incomplete multipart uploads under a prefix, or of named keys, and abort them.

A writable mount aborts its own uploads when a file fails or the mount stops; only a daemon killed
outright (kill -9, a lost node) leaves parts behind, which the bucket keeps (and bills) until they are
aborted. Runs in the CLI process, never in the daemon; uploads begun less than `older_than` seconds ago
are left alone, since a running mount may be writing them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TextIO

from fsmount.config import StoreConfig
from fsmount.data import Boto3Store, BucketMissing, NoCredentials, NotFound, StoreError, Uploads, endpoint_path_hint

# A command someone waits for, not the daemon: each request gets this long to answer, and one retry, so that
# an endpoint that accepts connections and never answers fails it in a minute (with the daemon's 120 s and
# four attempts it hung for ten).
REQUEST_TIMEOUT_S = 20.0
RETRIES = 1


class CleanupError(Exception):
    """The bucket could not be listed; the message says why."""


def cleanup(cfg: StoreConfig, older_than: float, *, keys: Sequence[str] = (), dry_run: bool,
            out: TextIO) -> tuple[int, int]:
    """(uploads found old enough, uploads aborted); one line per upload on `out`. With `keys`, the uploads of
    exactly those keys (whole keys, `cfg.prefix` unused), else every one under `cfg.prefix`."""
    cfg = dataclasses.replace(cfg, read_timeout=REQUEST_TIMEOUT_S, connect_timeout=min(cfg.connect_timeout,
                                                                                       REQUEST_TIMEOUT_S))
    try:
        store = Boto3Store(cfg, retries=RETRIES)
    except Exception as exc:  # noqa: BLE001 - botocore's ProfileNotFound and the like: one line, no traceback
        raise CleanupError(str(exc)) from None
    uploads = Uploads(store)
    try:
        if keys:  # listed by the key as a prefix (the API's only filter), then only that key itself
            pending = [upload for key in dict.fromkeys(keys) for upload in uploads.pending(key) if upload.key == key]
        else:
            pending = uploads.pending(cfg.prefix)
    except NoCredentials:
        raise CleanupError("no credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or use --profile (with "
                           "a profile, only its own credentials count: botocore does not read the AWS_* keys then); "
                           "aborting an upload needs the bucket's credentials") from None
    except StoreError as exc:
        raise CleanupError(_not_listed(store, cfg, exc)) from None
    now = time.time()
    found = aborted = young = 0
    for upload in pending:
        # By the server's clock, as `initiated` is: a machine whose clock was a day ahead (a wrong RTC, a VM resumed)
        # took the uploads a running mount was writing for a day old and aborted them. This machine's clock only
        # where the listing had no Date.
        # Below 0 (a Date of the second the upload began, to the millisecond; a server's nodes whose clocks
        # disagree) it is 0: `--older-than 0`, what the daemon's warnings advise, left such an upload alone.
        if upload.age_s is not None:
            age = max(0.0, upload.age_s)
        else:
            age = now - upload.initiated.timestamp() if upload.initiated is not None else float("inf")
        if age < older_than:
            young += 1
            continue
        found += 1
        if dry_run:
            print(f"would abort {upload.key} (begun {age:.0f}s ago)", file=out)
            continue
        try:
            uploads.abort(upload.key, upload.upload_id)
        except StoreError as exc:
            print(f"could not abort {upload.key}: {exc.message}", file=out)
            continue
        aborted += 1
        print(f"aborted {upload.key} (begun {age:.0f}s ago)", file=out)
    if young:
        # Right after a daemon was killed, its uploads are this young: "0 incomplete uploads; aborted 0" alone read as
        # nothing left to bill.
        print(f"left {young} incomplete upload{'' if young == 1 else 's'} begun less than {older_than:g}s ago alone "
              "(a running mount may be writing them; a smaller --older-than takes them too)", file=out)
    return found, aborted


def _not_listed(store: Boto3Store, cfg: StoreConfig, exc: StoreError) -> str:
    """Why the uploads could not be listed. An answer without an S3 error (an endpoint that is not the S3 API, such
    as SeaweedFS's filer port, or one with the bucket in its path) read "listing uploads: not found", where `modelfs
    mount` says what is wrong: the listing of objects its pre-flight sends (`check_bucket`) tells those apart, and
    is sent on this failure only (cleanup's own permissions need not include s3:ListBucket). A refusal or a failure
    to reach the endpoint is said as it was."""
    if not isinstance(exc, NotFound) and type(exc) is not StoreError:
        return exc.message
    try:
        store.check_bucket(cfg.prefix)
    except BucketMissing as missing:
        return missing.message + endpoint_path_hint(store.configured_endpoint_url)
    except StoreError as other:
        return other.message if type(other) is StoreError else exc.message
    return exc.message
