"""Ages of what another node wrote, measured on the server's clock rather than this node's, on moto and SeaweedFS
and by both GET paths (presigned, boto3): this node's clock stepped an hour ahead (time.time patched in this
process) changes nothing. The rules without a server: tests/unit/test_shared_tier.py."""

from __future__ import annotations

import time

import pytest

from fsmount.config import GET_CLIENTS, StoreConfig
from fsmount.data import Boto3Store, ChunkId
from fsmount.data.shared_tier import SharedTier
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
