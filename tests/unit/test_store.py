"""The boto3 store's pure parts: error mapping and key decoding."""

from __future__ import annotations

import contextlib
import errno
import io
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from fsmount.data.boto3_store import READ_SLICE, ObjectReader, _decode_key, translate_error
from fsmount.data.store import (
    AccessDenied,
    BucketMissing,
    NotFound,
    PreconditionFailed,
    StoreError,
    TransientError,
    Unreachable,
    error_for_status,
)


def client_error(code: str, status: int, message: str = "m") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
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
    # An archived object (Glacier) is a 403 that no credential fixes: EIO, and the message says what to do.
    archived = translate_error(client_error("InvalidObjectState", 403), "b", "GET 'k'")
    assert type(archived) is StoreError and archived.errno == errno.EIO
    assert "archived (InvalidObjectState): restore it" in archived.message and "credentials" not in archived.message
    # An error this mapping has no words for keeps the server's own (SSE-C without the key: InvalidArgument).
    sse_c = translate_error(client_error("InvalidArgument", 400, "Requests specifying Server Side Encryption\n"
                                         "with Customer provided keys must provide the customer key."), "b", "GET")
    assert sse_c.message == ("GET: InvalidArgument (Requests specifying Server Side Encryption with Customer "
                             "provided keys must provide the customer key.)")


def test_listed_keys_are_url_decoded_and_non_utf8_kept_as_bytes() -> None:
    assert _decode_key("a%2Fb%20c/%E6%97%A5.txt", True) == "a/b c/日.txt"
    assert _decode_key("bad%FF%FEname", True) == b"bad\xff\xfename"
    assert _decode_key("plain", False) == "plain"


def test_a_body_is_read_into_the_buffer_a_slice_at_a_time() -> None:
    """urllib3's readinto reads the whole request into new bytes first: asked for a whole chunk, each fetch held
    a second chunk outside the memory budget."""
    asked: list[int] = []

    class Body:
        def __init__(self, data: bytes):
            self.data = io.BytesIO(data)

        def readinto(self, view: memoryview) -> int:
            asked.append(len(view))
            return self.data.readinto(view)

        def close(self) -> None:
            pass

    data = bytes(range(256)) * (12 * READ_SLICE // 256) + b"tail"
    buffer = bytearray(len(data))
    with ObjectReader(Body(data), len(data), "b", "GET") as reader:
        assert reader.readinto(buffer) == len(data)
    assert bytes(buffer) == data
    assert max(asked) == READ_SLICE and len(asked) >= 12


# -- what the AWS configuration says, as boto3 reads it --------------------------------------------------------------

@pytest.fixture
def aws_config(tmp_path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """An AWS config file of our own (and no endpoint from the environment); returns a writer of its text."""
    path = tmp_path / "config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to look for
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    return path.write_text


def test_a_profile_s_addressing_style_holds_unless_the_mount_names_one(aws_config) -> None:  # noqa: ANN001
    """`--addressing-style auto` (the default) was passed to botocore, where it overrides the config file: an OSS
    profile saying `s3 = addressing_style = virtual` got path-style URLs, which OSS refuses."""
    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    aws_config("[profile oss]\naws_access_key_id = k\naws_secret_access_key = s\nregion = cn-hangzhou\nendpoint_url = https://oss-cn-hangzhou.aliyuncs.com\n"
               "s3 =\n  addressing_style = virtual\n")
    url = Boto3Store(StoreConfig(bucket="models", profile="oss"))._presign("k")
    assert url.startswith("https://models.oss-cn-hangzhou.aliyuncs.com/k?"), url
    path = Boto3Store(StoreConfig(bucket="models", profile="oss", addressing_style="path"))._presign("k")
    assert path.startswith("https://oss-cn-hangzhou.aliyuncs.com/models/k?"), path


def test_the_endpoint_comes_from_the_aws_configuration_in_botocore_s_order(aws_config, monkeypatch) -> None:  # noqa: ANN001, E501
    """modelfs took $AWS_ENDPOINT_URL as --endpoint-url's default, before $AWS_ENDPOINT_URL_S3, the reverse of
    botocore's order; and a shared tier named every origin given by the configuration `s3:REGION`, as AWS's own."""
    from fsmount.cli import make_parser
    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    aws_config("[default]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    assert make_parser().parse_args(["mount", "b", "/m"]).endpoint_url is None  # left to botocore
    store = Boto3Store(StoreConfig(bucket="models"))
    assert store.endpoint_url == store.configured_endpoint_url == "http://127.0.0.1:9000"
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    aws = Boto3Store(StoreConfig(bucket="models"))
    assert "amazonaws.com" in aws.endpoint_url and aws.configured_endpoint_url is None  # AWS's own: s3:REGION
    assert Boto3Store(StoreConfig(bucket="models", endpoint_url="http://h:1")).configured_endpoint_url == "http://h:1"


def test_reads_are_signed_for_the_region_the_bucket_named(aws_config, allowed_logs) -> None:  # noqa: ANN001
    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    aws_config("[default]\nregion = us-east-1\n")
    store = Boto3Store(StoreConfig(bucket="models", endpoint_url="http://127.0.0.1:9000"))
    assert "%2Fus-east-1%2Fs3%2F" in store._presign("k")
    allowed_logs.append(r"bucket models is in region eu-west-1, not us-east-1: its reads and writes are signed")
    assert store._use_region("eu-west-1") and not store._use_region("eu-west-1")
    url = store._presign("k")
    assert "%2Feu-west-1%2Fs3%2F" in url and url.startswith("http://127.0.0.1:9000/"), url
    assert store.region == "us-east-1"  # the control plane's client is botocore's to redirect


def test_no_credentials_for_a_profile_says_the_environment_s_keys_do_not_count(aws_config) -> None:  # noqa: ANN001
    """With --profile, botocore ignores AWS_ACCESS_KEY_ID: the message told a user who had given --profile to "use
    --profile"."""
    from fsmount.config import StoreConfig
    from fsmount.data import AccessDenied, Boto3Store

    aws_config("[profile bare]\nregion = us-east-1\n")
    with pytest.raises(AccessDenied, match=r"with a profile, only its own credentials count"):
        Boto3Store(StoreConfig(bucket="models", profile="bare", endpoint_url="http://127.0.0.1:9"))._presign("k")


@pytest.mark.parametrize("server", ["repeats_its_token", "gives_no_token"])
def test_a_listing_the_server_says_goes_on_and_cannot_fails_said(aws_config, server: str) -> None:  # noqa: ANN001
    """A server that ignores continuation tokens sends page one again with the same token: the listing went on for
    good (180k requests), and every reader of the directory waited in the kernel beyond SIGKILL. One that says the
    listing is truncated without a token had it cut short in silence: ENOENT for files the bucket holds (a tester's
    proxy, as such servers answer)."""
    from botocore.stub import Stubber

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    aws_config("[default]\nregion = us-east-1\n")
    store = Boto3Store(StoreConfig(bucket="models", endpoint_url="http://127.0.0.1:9000"))
    page = {"IsTruncated": True, "KeyCount": 1, "Contents": [{"Key": "m/a.bin", "Size": 3, "ETag": '"e"'}]}
    if server == "repeats_its_token":
        page["NextContinuationToken"] = "AAA"
    with Stubber(store._client) as stub:  # noqa: SLF001
        for _ in range(3):
            stub.add_response("list_objects_v2", page)
        pages = store.list_pages("m/")
        if server == "repeats_its_token":
            assert [o.key for o in next(pages).objects] == ["m/a.bin"]  # the first page, as any
            with pytest.raises(StoreError, match=r"gave the continuation token 'AAA' a second time"):
                next(pages)
        else:
            with pytest.raises(StoreError, match="said the listing goes on, but gave no continuation token"):
                next(pages)


def test_etags_are_kept_in_the_quoted_form_headers_give() -> None:
    """NetApp ONTAP lists ETags without their quotes while HEAD and GET give them quoted: one form for both, so one
    version is one version (test_server_quirks.py has the mount's side). A weak ETag is its strong form's version too
    (test_weak_etags.py); an absent one stays absent."""
    from fsmount.data.store import quoted_etag

    assert quoted_etag("abc") == quoted_etag('"abc"') == '"abc"'
    assert quoted_etag(" abc-2 ") == '"abc-2"'
    assert quoted_etag('W/"abc"') == quoted_etag('w/"abc"') == quoted_etag('"abc"') == '"abc"'
    assert quoted_etag("") == ""


def test_dates_in_forms_beside_the_standard_are_read_and_unreadable_ones_still_fail() -> None:
    """botocore's parser refused these, and the HEAD or the listing that carried one failed with EIO. What no parser
    reads still fails: a made-up date would pass `modelfs cleanup`'s age check."""
    import datetime

    from fsmount.data.boto3_store import parse_timestamp

    when = datetime.datetime(2018, 9, 13, 13, 28, 18, tzinfo=datetime.UTC)
    assert parse_timestamp("Thu, 13 Sep 2018 13:28:18 GMT") == when
    assert parse_timestamp("2018-09-13T13:28:18.000Z") == when
    assert parse_timestamp("Thu, 13 Sep 2018 13:28:18 -0000 GMT") == when  # GMT, not this machine's zone
    # A header sent twice, joined by a comma: the first.
    assert parse_timestamp("Thu, 13 Sep 2018 13:28:18 GMT, Fri, 14 Sep 2018 00:00:00 GMT") == when
    for unreadable in ("", "garbage", "Thu, 31 Feb 2026 00:00:00 GMT"):
        with pytest.raises(ValueError, match="Invalid timestamp"):
            parse_timestamp(unreadable)


def test_a_head_without_a_content_length_takes_the_size_a_listing_gives(aws_config) -> None:  # noqa: ANN001
    """Supabase Storage (for an empty object), s3ninja, a gateway compressing on the way: HEAD answers 200 without a
    Content-Length. Read as a missing field, every lookup of such a file failed "unexpectedly" (EIO). The key's entry of
    a listing gives its size and ETag, in one answer; a key the listing no longer holds is none."""
    from botocore.stub import Stubber

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    aws_config("[default]\nregion = us-east-1\n")
    store = Boto3Store(StoreConfig(bucket="models", endpoint_url="http://127.0.0.1:9000"))
    with Stubber(store._client) as stub:  # noqa: SLF001
        stub.add_response("head_object", {"ETag": '"e1"'}, {"Bucket": "models", "Key": "m/a.bin"})
        stub.add_response("list_objects_v2", {"KeyCount": 1, "Contents": [{"Key": "m/a.bin", "Size": 0, "ETag": "e1"}]},
                          {"Bucket": "models", "Prefix": "m/a.bin", "MaxKeys": 1})
        meta = store.head("m/a.bin")
        assert meta is not None and (meta.key, meta.size, meta.etag) == ("m/a.bin", 0, '"e1"')
        stub.add_response("head_object", {"ETag": '"e2"'}, {"Bucket": "models", "Key": "m/b.bin"})
        stub.add_response("list_objects_v2", {"KeyCount": 1, "Contents": [{"Key": "m/b.bin.tmp", "Size": 5}]},
                          {"Bucket": "models", "Prefix": "m/b.bin", "MaxKeys": 1})
        assert store.head("m/b.bin") is None
        stub.assert_no_pending_responses()


def test_a_version_without_an_etag_is_named_by_its_size_and_last_modified_second_never_sent() -> None:
    """HEAD's Last-Modified has seconds, a listing's milliseconds: one tag for both. It is never sent as an ETag."""
    from fsmount.data.store import sent_etag, version_tag

    listed, headed = version_tag("", 5, 1_700_000_000_123_000_000), version_tag("", 5, 1_700_000_000_000_000_000)
    assert listed == headed != version_tag("", 6, 1_700_000_000 * 10**9) != version_tag("", 5, 1_700_000_001 * 10**9)
    assert sent_etag(listed) == "" and sent_etag('"abc"') == '"abc"' and version_tag('"abc"', 5, 0) == '"abc"'


def test_a_refusal_for_expired_or_unknown_credentials_says_so() -> None:
    """Temporary credentials past their expiry (AWS_SESSION_TOKEN in the environment, read once) said only "check
    credentials", as any 403 does: an operator learnt nothing of a token that had expired."""
    expired = translate_error(client_error("ExpiredToken", 400), "b", "x")
    assert isinstance(expired, AccessDenied) and expired.errno == errno.EACCES and expired.code == "ExpiredToken"
    assert "(ExpiredToken): the credentials' session token has expired" in expired.message
    assert "credentials in the environment need a remount" in expired.message
    unknown = translate_error(client_error("InvalidAccessKeyId", 403), "b", "x")
    assert "does not know the access key id" in unknown.message
    assert translate_error(client_error("AccessDenied", 403), "b", "x").message.endswith("check credentials")


def test_a_request_refused_for_the_clock_says_the_clock_not_the_credentials() -> None:
    """This machine's clock off the server's by more than 15 minutes: AWS S3, MinIO and SeaweedFS refuse a request
    signed in its headers (the mount's first listing, every HEAD) with 403 RequestTimeTooSkewed, which read "check
    credentials": the operator looked at the keys, which were right (B191; its presigned sibling: B175)."""
    skewed = translate_error(client_error("RequestTimeTooSkewed", 403, "The difference between the request time and "
                                          "the current time is too large."), "b", "x")
    assert isinstance(skewed, AccessDenied) and skewed.errno == errno.EACCES and skewed.code == "RequestTimeTooSkewed"
    assert "this machine's clock and the server's differ by more than the server allows" in skewed.message
    assert "check credentials" not in skewed.message and not skewed.expired and not skewed.not_yet_valid


def test_a_bare_400_says_it_may_be_an_expired_session_token() -> None:
    """AWS S3 answers a HEAD signed with a session token past its expiry with 400 and no body (botocore names its
    code "400"). With no new credentials to be had, a stat was EIO with "HEAD 'k': 400" alone in the log: nothing
    said what it probably meant or what to do. It stays EIO (a bad request may be one) and says both."""
    bare = translate_error(client_error("400", 400), "b", "HEAD 'k'", method="HEAD")
    assert type(bare) is StoreError and bare.errno == errno.EIO
    assert bare.message.startswith("HEAD 'k': 400 without an error code: AWS S3 answers so a HEAD whose credentials' "
                                   "session token has expired"), bare.message
    assert "credentials in the environment need a remount" in bare.message
    named = translate_error(client_error("InvalidArgument", 400), "b", "PUT 'k'")  # a code: the server's own word
    assert "session token" not in named.message and "InvalidArgument" in named.message


def test_a_bare_400_of_a_request_other_than_a_head_is_not_told_to_be_an_expired_session_token() -> None:
    """Only a HEAD's answer has no body to name ExpiredToken in: B110's advice was given to every bare 400, so a PUT
    (a create-only store a gateway refuses, the tier's probe), a GET or a DELETE refused so logged "AWS S3 answers so
    a HEAD whose credentials' session token has expired", which sent an operator to the credentials, and lost the
    server's message."""
    for what in ("PUT 'k'", "GET 'k' bytes 0-9", "DELETE 'k'", "listing 'p/'"):
        bare = translate_error(client_error("400", 400, "Bad Request"), "b", what)
        assert type(bare) is StoreError and bare.errno == errno.EIO
        assert bare.message == f"{what}: 400 (Bad Request)", bare.message
    # Told apart by the request's method, not by the words its message begins with.
    assert "session token" not in translate_error(client_error("400", 400), "b", "HEAD 'k'").message
    assert "session token" in translate_error(client_error("400", 400), "b", "stat of 'k'", method="HEAD").message


def test_a_resolver_failure_is_found_down_the_chain_and_nothing_else_breaks_the_search() -> None:
    """`_name_not_resolved` follows causes and botocore's `kwargs["error"]`; an exception of another library with an
    attribute of that name that is not a dict ends the search instead of raising out of the error mapping."""
    import socket

    from botocore.exceptions import EndpointConnectionError

    from fsmount.data.boto3_store import _name_not_resolved

    class Odd(OSError):
        kwargs = ("not", "a", "dict")

    lookup = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert _name_not_resolved(EndpointConnectionError(endpoint_url="http://x.invalid", error=lookup)) is lookup
    try:
        try:
            raise lookup
        except socket.gaierror as exc:
            raise Odd("wrapped") from exc
    except Odd as odd:
        assert _name_not_resolved(odd) is lookup
    assert _name_not_resolved(Odd("alone")) is None
    assert _name_not_resolved(EndpointConnectionError(endpoint_url="http://x", error=ConnectionRefusedError())) is None


def test_an_endpoint_host_that_does_not_resolve_is_said_so(aws_config, monkeypatch) -> None:  # noqa: ANN001
    """B233: a typo in the endpoint's host name (`--endpoint-url http://minio.lcoal:9000`) failed the mount as "cannot
    reach the endpoint: Could not connect to the endpoint URL", as if the server were down; with virtual-hosted
    addressing the name is the bucket's, which a server without wildcard DNS does not have. Still Unreachable (DNS
    not up yet at boot mends by itself); a connection refused is said as before."""
    import socket

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store, Unreachable

    aws_config("[default]\nregion = us-east-1\n")
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(host).endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    for style, host, says in (
            ("path", "minio.invalid", "check the endpoint URL's host, or this machine's DNS (http://minio.invalid:9000)"),
            ("virtual", "models.minio.invalid", "the bucket is in it (virtual-hosted addressing): check the endpoint "
                                                "URL's host, and a server without a DNS name for each bucket needs "
                                                "--addressing-style path (http://models.minio.invalid:9000)")):
        store = Boto3Store(StoreConfig(bucket="models", endpoint_url="http://minio.invalid:9000",
                                       addressing_style=style), preflight=True)
        with pytest.raises(Unreachable) as err:
            store.check_bucket("")
        assert err.value.message == (f"cannot reach the endpoint: its host name '{host}' does not resolve (Name or "
                                     f"service not known): {says}"), err.value.message
    # B236: AWS's names are made of the region, and OSS takes virtual-hosted requests only: neither is told to use
    # path style, and a region typo (no endpoint URL given) is said as one.
    for cfg, host, says in (
            (StoreConfig(bucket="models", region="us-eest-1"), "models.s3.us-eest-1.amazonaws.com",
             "S3's host names are made of the region: check --region (AWS_DEFAULT_REGION, the profile's region) and "
             "the endpoint URL if one is given, or this machine's DNS (https://models.s3.us-eest-1.amazonaws.com)"),
            (StoreConfig(bucket="models", endpoint_url="https://oss-cn-hangzou.aliyuncs.com",
                         addressing_style="virtual"),
             "models.oss-cn-hangzou.aliyuncs.com",
             "check the endpoint URL's host, or this machine's DNS (https://models.oss-cn-hangzou.aliyuncs.com)")):
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(  # noqa: ARG005
            socket.gaierror(socket.EAI_NONAME, "Name or service not known")))
        with pytest.raises(Unreachable) as err:
            Boto3Store(cfg, preflight=True).check_bucket("")
        assert err.value.message == (f"cannot reach the endpoint: its host name '{host}' does not resolve (Name or "
                                     f"service not known): {says}"), err.value.message
    monkeypatch.setattr(socket, "getaddrinfo", real)
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(Unreachable, match="cannot reach the endpoint: Could not connect to the endpoint URL"):
        Boto3Store(StoreConfig(bucket="models", endpoint_url=f"http://127.0.0.1:{port}"), preflight=True) \
            .check_bucket("")


def test_a_copy_refused_for_its_source_version_says_nothing_of_an_open() -> None:
    """A rename's copy pinned to the source's version (x-amz-copy-source-if-match) and refused with 412 has no open:
    B752's "(a listing or HEAD, at most --metadata-ttl before the open)" was said of it too."""
    from types import SimpleNamespace

    from fsmount.data.uploads import Uploads

    def copy_object(**kwargs: object) -> None:
        assert kwargs["CopySourceIfMatch"] == '"abc"'
        raise ClientError({"Error": {"Code": "PreconditionFailed", "Message": "At least one of the pre-conditions "
                                     "you specified did not hold"}, "ResponseMetadata": {"HTTPStatusCode": 412}},
                          "CopyObject")

    client = SimpleNamespace(copy_object=copy_object, meta=SimpleNamespace(events=SimpleNamespace(
        register=lambda *args: None)))
    uploads = Uploads(SimpleNamespace(bucket="b", client=client, head=None, has_children=None))  # type: ignore[arg-type]
    with pytest.raises(PreconditionFailed) as exc:
        uploads.copy("m/a.bin", '"abc"', "m/b.bin")
    assert exc.value.message == ("copying 'm/a.bin' to 'm/b.bin': object changed in the bucket since the mount saw "
                                 "the version asked for"), exc.value.message


def test_a_server_message_quoting_the_request_leaves_its_secrets_out_of_the_error() -> None:
    """An error document or a botocore message quoting a presigned URL or an Authorization header: the StoreError
    keeps the rest of the text and none of the signature, credential or session token (B1220)."""
    url = ("/b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDEXAMPLE%2F20261207%2Fus-east-1%2Fs3"
           "%2Faws4_request&X-Amz-Date=20261207T000000Z&X-Amz-Expires=1200&X-Amz-SignedHeaders=host"
           "&X-Amz-Security-Token=FwoGZXIvYXdzE%2Fsecret&X-Amz-Signature=0123456789abcdef0123")
    header = ("Authorization: AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261207/us-east-1/s3/aws4_request, "
              "SignedHeaders=host, Signature=0123456789abcdef0123")
    for said in (url, urllib.parse.unquote(url), header, "x-amz-security-token: FwoGZXIvYXdzE/secret"):
        err = error_for_status("InvalidArgument", 400, "b", "GET 'k'", f"bad request {said}")
        assert "InvalidArgument" in str(err) and "bad request" in str(err)
        for secret in ("AKIDEXAMPLE", "0123456789abcdef", "FwoGZXIvYXdzE"):
            assert secret not in str(err) and secret not in err.message
    err = translate_error(ClientError({"Error": {"Code": "AuthorizationHeaderMalformed", "Message": header},
                                       "ResponseMetadata": {"HTTPStatusCode": 400}}, "HeadObject"), "b", "HEAD 'k'")
    assert "AuthorizationHeaderMalformed" in str(err) and "AKIDEXAMPLE" not in str(err)


@contextlib.contextmanager
def _endless_answer(monkeypatch: pytest.MonkeyPatch, status: str, head: bytes, tail: bytes,
                    **cfg: str) -> Iterator[Any]:
    """A Boto3Store (`cfg`: its StoreConfig's settings) of a server answering one request with `status` and a chunked
    body: `head`, 3 * RESPONSE_MAX bytes, `tail`; after the block, the server is checked to have sent it not all."""
    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store
    from fsmount.data.boto3_store import RESPONSE_MAX

    sent = [0]

    def answer(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while rfile.readline() not in (b"\r\n", b""):
                pass
            conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\nTransfer-Encoding: chunked\r\n\r\n"
                         % status.encode())
            blob = b"x" * (1 << 20)
            try:
                conn.sendall(b"%x\r\n%s\r\n" % (len(head), head))
                for _ in range(3 * RESPONSE_MAX >> 20):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(blob), blob))
                    sent[0] += len(blob)
                conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
            except OSError:  # the client closed it
                pass

    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(30)
        port = server.getsockname()[1]
        for name, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        store = Boto3Store(StoreConfig(bucket="b", endpoint_url=f"http://127.0.0.1:{port}", addressing_style="path",
                                       **cfg))
        serving = threading.Thread(target=lambda: answer(server.accept()[0]), daemon=True)
        serving.start()
        yield store
        serving.join(30)
    assert not serving.is_alive()
    # The client read no further: the server could not send it all (loopback's socket buffers may hold 36 MiB).
    assert sent[0] < 3 * RESPONSE_MAX


def test_a_listing_answer_that_goes_on_is_read_no_further_than_response_max(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server answering a listing with a chunked body that goes on (here 3 * RESPONSE_MAX bytes, a comment after
    the listing's head): botocore read it whole into memory, an endless one until memory ran out, past
    --memory-limit (B1222). It is read to RESPONSE_MAX, then the listing fails, TransientError, its connection
    closed."""
    from fsmount.data.boto3_store import RESPONSE_MAX

    head = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><KeyCount>0</KeyCount>'
            b"<IsTruncated>false</IsTruncated><!--")
    with _endless_answer(monkeypatch, "200 OK", head, b"--></ListBucketResult>") as store:
        with pytest.raises(TransientError, match=f"went on past {RESPONSE_MAX >> 20} MiB"):
            list(store.list_pages(""))


def test_a_streamed_gets_error_answer_that_goes_on_is_read_no_further_than_response_max(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With --get-client boto3, a GET answered by an error whose body goes on: botocore reads an error document whole
    to parse it, the body of a GET's too, which B1222's bound left out (a GET's answer went by unread, as a streamed
    one). It is read to RESPONSE_MAX, then the GET fails, TransientError."""
    from fsmount.data.boto3_store import RESPONSE_MAX

    head = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>no</Message><!--'
    with _endless_answer(monkeypatch, "403 Forbidden", head, b"--></Error>", get_client="boto3") as store:
        with pytest.raises(TransientError, match=f"went on past {RESPONSE_MAX >> 20} MiB"):
            store.get_object("k")


def test_a_botocore_without_the_session_it_bounds_is_said_and_left_unbounded(
        caplog: pytest.LogCaptureFixture, allowed_logs: list[str]) -> None:
    """The bound of B1222 wraps a private attribute of botocore's client: one without it (another botocore) is a
    warning, where the mount failed "unexpectedly" with an AttributeError; a client with it has its send wrapped."""
    from fsmount.data import Boto3Store

    def send(request: Any) -> None: ...

    allowed_logs.append("its answers are read whole, unbounded")
    Boto3Store._bound_answers(SimpleNamespace(_client=object()))  # type: ignore[arg-type]
    assert "its answers are read whole, unbounded" in caplog.text
    session = SimpleNamespace(send=send)
    client = SimpleNamespace(_endpoint=SimpleNamespace(http_session=session))
    Boto3Store._bound_answers(SimpleNamespace(_client=client))  # type: ignore[arg-type]
    assert session.send is not send


def test_an_answer_botocore_cannot_parse_is_told_by_its_start_only() -> None:
    """botocore's ResponseParserError ends with the whole body it could not parse: a 10 MB page that is no XML (a
    captive portal's, a hostile server's) made a 10 MB error message, and as many bytes in each warning line of the
    log (B1223). Its start is kept: what botocore said and the body's first bytes."""
    from botocore.parsers import ResponseParserError

    body = "<html>" + "x" * (10 << 20)
    err = translate_error(ResponseParserError(f"Unable to parse response (syntax error), invalid XML received. "
                                              f"Further retries may succeed:\n{body}"), "b", "listing 'd/'")
    assert isinstance(err, TransientError)
    assert "listing 'd/': ResponseParserError: Unable to parse response (syntax error)" in str(err)
    assert "<html>" in str(err) and len(str(err)) < 1000
