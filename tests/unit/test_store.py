"""The boto3 store's pure parts: error mapping and key decoding."""

from __future__ import annotations

import errno

from botocore.exceptions import ClientError, EndpointConnectionError

from fsmount.data.boto3_store import _decode_key, translate_error
from fsmount.data.store import (
    AccessDenied,
    BucketMissing,
    NotFound,
    PreconditionFailed,
    StoreError,
    TransientError,
    Unreachable,
)


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def test_error_mapping() -> None:
    assert isinstance(translate_error(client_error("NoSuchBucket", 404), "b", "x"), BucketMissing)
    assert isinstance(translate_error(client_error("NoSuchKey", 404), "b", "x"), NotFound)
    assert isinstance(translate_error(client_error("403", 403), "b", "x"), AccessDenied)
    assert isinstance(translate_error(client_error("SignatureDoesNotMatch", 403), "b", "x"), AccessDenied)
    assert isinstance(translate_error(client_error("PreconditionFailed", 412), "b", "x"), PreconditionFailed)
    assert isinstance(translate_error(client_error("SlowDown", 503), "b", "x"), TransientError)
    # 501: the server lacks the feature (a conditional write, say); asking again will not help.
    not_implemented = translate_error(client_error("NotImplemented", 501), "b", "x")
    assert isinstance(not_implemented, StoreError) and not isinstance(not_implemented, TransientError)
    unreachable = translate_error(EndpointConnectionError(endpoint_url="http://h"), "b", "x")
    assert isinstance(unreachable, Unreachable) and unreachable.errno == errno.EIO
    assert translate_error(client_error("AccessDenied", 403), "b", "x").errno == errno.EACCES


def test_listed_keys_are_url_decoded_and_non_utf8_kept_as_bytes() -> None:
    assert _decode_key("a%2Fb%20c/%E6%97%A5.txt", True) == "a/b c/日.txt"
    assert _decode_key("bad%FF%FEname", True) == b"bad\xff\xfename"
    assert _decode_key("plain", False) == "plain"
