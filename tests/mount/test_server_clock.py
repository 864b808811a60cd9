"""Ages of what another node wrote (shared-tier claims, incomplete uploads), measured on the server's clock rather
than this machine's, on moto and SeaweedFS (claims by both GET paths, presigned and boto3): this machine's clock
stepped ahead (time.time patched in this process) changes nothing. The claims' rules without a server:
tests/unit/test_shared_tier.py."""

from __future__ import annotations

import dataclasses
import http.client
import io
import time

import pytest

from fsmount.cleanup_command import cleanup
from fsmount.config import GET_CLIENTS, StoreConfig
from fsmount.data import Boto3Store, ChunkId
from fsmount.data.shared_tier import SharedTier
from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.http_wire import Request, Response
from tests.helpers import S3Server, new_bucket


@pytest.mark.parametrize("get_client", GET_CLIENTS)
def test_a_node_whose_clock_is_an_hour_ahead_leaves_a_live_claim_alone(s3: S3Server, get_client: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = new_bucket(s3)
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)

    def node() -> SharedTier:
        store = Boto3Store(StoreConfig(bucket, endpoint_url=s3.endpoint_url, addressing_style="path",
                                       get_client=get_client))
        return SharedTier(store, origin="http://origin.example", prefix="t/", wait=0.5, read_only=False, threads=2,
                          clock=time.monotonic)

    claimer, waiter = node(), node()
    cid = ChunkId("models", "llm/model.safetensors", '"e1"', 1 << 20, 0)
    assert claimer.get(cid) is None and claimer.stats.claims == 1
    held = claimer.client.get_object(claimer.claim_key(cid))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    # Waited the wait out, then the origin: the claim was live (the server gave both Date and Last-Modified).
    assert waiter.get(cid) is None
    assert waiter.stats.claim_waits == 1 and waiter.stats.claims == 0 and waiter.stats.fallbacks == 1
    assert waiter.client.get_object(claimer.claim_key(cid)) == held  # still the claimer's


@pytest.mark.seaweedfs
def test_cleanup_on_a_machine_whose_clock_is_days_ahead_leaves_a_fresh_upload_alone(
        seaweed_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """`modelfs cleanup` (default: uploads begun over a day ago) run where the clock is two days ahead: it aborted the
    upload a running mount had begun a moment before, and that mount's close then failed. SeaweedFS only: moto lists
    every upload as initiated on 2010-11-10."""
    s3 = seaweed_server
    bucket = new_bucket(s3)
    client = s3.client()
    upload_id = client.create_multipart_upload(Bucket=bucket, Key="ckpt/model.bin")["UploadId"]
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 2 * 86400)
    out = io.StringIO()
    assert cleanup(StoreConfig(bucket, endpoint_url=s3.endpoint_url, addressing_style="path"), 86400, dry_run=False,
                   out=out) == (0, 0), out.getvalue()
    assert "left 1 incomplete upload" in out.getvalue()
    assert [u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == [upload_id]
    assert cleanup(StoreConfig(bucket, endpoint_url=s3.endpoint_url, addressing_style="path"), 0, dry_run=False,
                   out=out) == (1, 1)  # what --older-than 0 asks for (the advised command after a failed close)


class OddDate(FaultProxy):
    """A server whose every answer gives `date` as its Date header."""

    def __init__(self, upstream_url: str, date: str):
        super().__init__(upstream_url)
        self.date = date

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        resp, upstream = super()._forward(req, upstream)
        headers = [(k, v) for k, v in resp.headers if k.lower() != "date"]
        return dataclasses.replace(resp, headers=[*headers, ("Date", self.date)]), upstream


@pytest.mark.parametrize("get_client", GET_CLIENTS)
def test_a_claim_read_with_a_date_no_clock_can_hold_is_aged_by_its_body(s3: S3Server, get_client: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A Date header that parses to a year past what a datetime holds raised OverflowError out of the tier's read of
    a claim (and out of every GET of a tier object): the node's chunk read failed, where a Date it cannot read is
    one it does not have. The claim is aged by its body's time, as on a server that gives no Date."""
    bucket = new_bucket(s3)
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)

    def node(endpoint_url: str) -> SharedTier:
        store = Boto3Store(StoreConfig(bucket, endpoint_url=endpoint_url, addressing_style="path",
                                       get_client=get_client))
        return SharedTier(store, origin="http://origin.example", prefix="t/", wait=0.5, read_only=False, threads=2,
                          clock=time.monotonic)

    with OddDate(s3.endpoint_url, "Mon, 01 Jan 99999999999 00:00:00 GMT") as proxy:  # a year no datetime holds
        claimer, waiter = node(s3.endpoint_url), node(proxy.endpoint_url)
        cid = ChunkId("models", "llm/model.safetensors", '"e1"', 1 << 20, 0)
        assert claimer.get(cid) is None and claimer.stats.claims == 1
        assert waiter.get(cid) is None  # the claim is live: waited for, then the origin
        assert waiter.stats.claim_waits == 1 and waiter.stats.claims == 0 and waiter.stats.fallbacks == 1


def test_cleanup_older_than_0_takes_an_upload_the_server_dates_before_its_initiated(
        s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--older-than 0`, the command the daemon's warnings advise for a key's upload, left it alone ("left 1
    incomplete upload begun less than 0s ago") where the listing's Date was before the upload's Initiated: the age
    came out negative (S3 gives Initiated to the millisecond and Date to the second, so an upload of the current
    second; a server whose nodes' clocks disagree, by more). An age below 0 is 0: every upload is at least that old."""
    bucket = new_bucket(s3)
    client = s3.client()
    client.create_multipart_upload(Bucket=bucket, Key="ckpt/model.bin")
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    with OddDate(s3.endpoint_url, "Mon, 01 Jan 2001 00:00:00 GMT") as proxy:  # before every Initiated here
        cfg = StoreConfig(bucket, endpoint_url=proxy.endpoint_url, addressing_style="path")
        out = io.StringIO()
        assert cleanup(cfg, 86400, dry_run=False, out=out) == (0, 0), out.getvalue()  # younger than a day
        assert cleanup(cfg, 0, keys=["ckpt/model.bin"], dry_run=False, out=out) == (1, 1), out.getvalue()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
