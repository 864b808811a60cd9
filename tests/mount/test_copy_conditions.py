"""The condition a rename's server-side copy sends on its source: the ETag the server gave, and none at all where it
gave none (an empty `x-amz-copy-source-if-match:` is a condition no version matches)."""

from __future__ import annotations

import http.client
import os
from pathlib import Path

import pytest

from fsmount.testing.http_wire import Request, Response
from tests.helpers import S3Server, mounted_via, new_bucket, put_objects
from tests.mount.test_server_quirks import NoETags

COPY_CONDITION = "x-amz-copy-source-if-match"


class RecordedNoETags(NoETags):
    """`NoETags`, noting each request's headers."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, str]] = []

    def _forward(self, req: Request, upstream: http.client.HTTPConnection | None
                 ) -> tuple[Response, http.client.HTTPConnection]:
        self.sent.extend(req.headers)
        return super()._forward(req, upstream)


@pytest.mark.parametrize("server", ["moto_server", "seaweed_server"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["create-only", "allow-overwrite"])
def test_a_copy_of_an_object_without_an_etag_sends_no_condition(request: pytest.FixtureRequest, tmp_path: Path,
                                                                 server: str, overwrite: bool) -> None:
    """Create-only renames copy in parts (UploadPartCopy), the others whole (CopyObject): neither sent its source
    condition empty (botocore sends `CopySourceIfMatch=""` as an empty header), nor the version tag."""
    s3: S3Server = request.getfixturevalue(server)
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {"m/a.bin": b"weights"})
    extra = ("--allow-overwrite",) if overwrite else ()
    with RecordedNoETags(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, tmp_path / "mnt", "--writable", "--allow-delete", *extra) as m:
        os.rename(m.path / "m" / "a.bin", m.path / "m" / "b.bin")
        assert os.listdir(m.path / "m") == ["b.bin"]
        assert (m.path / "m" / "b.bin").read_bytes() == b"weights"
    listed = s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    assert [o["Key"] for o in listed] == ["m/b.bin"]
    copies = [k for k, _v in proxy.sent if k.lower() == "x-amz-copy-source"]
    assert copies  # the rename was a server-side copy
    assert [(k, v) for k, v in proxy.sent if k.lower() == COPY_CONDITION] == []
