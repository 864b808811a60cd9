"""`modelfs cleanup BUCKET`: find the incomplete multipart uploads under a prefix and abort them.

A writable mount aborts its own uploads when a file fails or the mount stops; only a daemon killed
outright (kill -9, a lost node) leaves parts behind, which the bucket keeps (and bills) until they are
aborted. Runs in the CLI process, never in the daemon; uploads begun less than `older_than` seconds ago
are left alone, since a running mount may be writing them.
"""

from __future__ import annotations

import time
from typing import TextIO

from fsmount.config import StoreConfig
from fsmount.data import Boto3Store, StoreError, Uploads


class CleanupError(Exception):
    """The bucket could not be listed; the message says why."""


def cleanup(cfg: StoreConfig, older_than: float, *, dry_run: bool, out: TextIO) -> tuple[int, int]:
    """(uploads found old enough, uploads aborted); one line per upload on `out`."""
    uploads = Uploads(Boto3Store(cfg))
    try:
        pending = uploads.pending(cfg.prefix)
    except StoreError as exc:
        raise CleanupError(exc.message) from None
    now = time.time()
    found = aborted = 0
    for upload in pending:
        age = now - upload.initiated.timestamp() if upload.initiated is not None else float("inf")
        if age < older_than:
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
    return found, aborted
