"""Credentials a fleet's nodes get from STS (fsmount.data.credentials): a web identity (EKS IRSA: AWS_ROLE_ARN and
AWS_WEB_IDENTITY_TOKEN_FILE, botocore calling sts:AssumeRoleWithWebIdentity) and a profile assuming a role
(`role_arn` + `source_profile`), against moto's STS or `FakeSts` (an STS of our own whose answers a test chooses:
credentials that expire soon, a refusal). moto checks no signature: the session token a presigned GET must carry is
looked for in its URL."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import http.server
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsmount.data import credentials
from fsmount.testing.fault_proxy import FaultProxy, signed_key_id
from fsmount.testing.http_wire import error_response
from tests.helpers import TEST_KEY, TEST_REGION, S3Server, bucket_with, daemon_env, mounted, run_modelfs

ROLE = "arn:aws:iam::123456789012:role/model-reader"


class FakeSts(http.server.ThreadingHTTPServer):
    """sts:AssumeRoleWithWebIdentity and sts:AssumeRole on 127.0.0.1: each call gives new session credentials
    (`ASIAFAKE...` numbered from 1, in `issued`) expiring `lifetime` from now, or, while `refusal` is set, that
    (status, code, message) as STS words a refusal."""

    daemon_threads = True

    def __init__(self, lifetime: datetime.timedelta = datetime.timedelta(hours=1)) -> None:
        super().__init__(("127.0.0.1", 0), FakeStsHandler)
        self.lifetime = lifetime
        self.refusal: tuple[int, str, str] | None = None
        self.issued: list[str] = []
        self.expiry: dict[str, float] = {}  # key id: its Expiration (time.time())
        self.calls: list[dict[str, str]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    def answer(self, form: dict[str, str]) -> tuple[int, bytes]:
        action = form.get("Action", "")
        with self._lock:
            self.calls.append(form)
            if self.refusal is not None:
                status, code, message = self.refusal
                return status, (f'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender'
                                f"</Type><Code>{code}</Code><Message>{message}</Message></Error>"
                                "<RequestId>fake</RequestId></ErrorResponse>").encode()
            key = f"ASIAFAKE{len(self.issued) + 1:012d}"
            self.issued.append(key)
            until = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + self.lifetime
            self.expiry[key] = until.timestamp()
        return 200, (f'<{action}Response xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><{action}Result>'
                     f"<Credentials><AccessKeyId>{key}</AccessKeyId><SecretAccessKey>s-{key}</SecretAccessKey>"
                     f"<SessionToken>token-{key}</SessionToken>"
                     f"<Expiration>{until.strftime('%Y-%m-%dT%H:%M:%SZ')}</Expiration></Credentials>"
                     "<AssumedRoleUser><AssumedRoleId>AROAFAKE:s</AssumedRoleId>"
                     "<Arn>arn:aws:sts::123456789012:assumed-role/model-reader/s</Arn></AssumedRoleUser>"
                     f"</{action}Result><ResponseMetadata><RequestId>fake</RequestId></ResponseMetadata>"
                     f"</{action}Response>").encode()


    def role_credentials(self) -> tuple[int, bytes]:
        """SSO's GetRoleCredentials: the same credentials, as the SSO portal words them (JSON, expiry in ms)."""
        status, document = self.answer({"Action": "GetRoleCredentials"})
        if status != 200:
            return 401, b'{"message": "Session token not found or invalid"}'
        key = self.issued[-1]
        return 200, json.dumps({"roleCredentials": {
            "accessKeyId": key, "secretAccessKey": f"s-{key}", "sessionToken": f"token-{key}",
            "expiration": int(self.expiry[key] * 1000)}}).encode()


class FakeStsHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeSts

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        status, document = self.server.answer(dict(urllib.parse.parse_qsl(body)))
        self.send_response(status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(document)))
        self.end_headers()
        self.wfile.write(document)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status, document = self.server.role_credentials()  # the only GET: /federation/credentials
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(document)))
        self.end_headers()
        self.wfile.write(document)


@pytest.fixture
def fake_sts() -> FakeSts:
    sts = FakeSts()
    try:
        yield sts
    finally:
        sts.close()


def irsa_env(tmp_path: Path, sts_url: str, token: str | None = "eyJ.fake.jwt") -> dict[str, str]:
    """The environment EKS gives a pod of a service account with a role (IRSA), STS at `sts_url`; no keys. The token
    file is written unless `token` is None."""
    token_file = tmp_path / "eks.amazonaws.com" / "serviceaccount" / "token"
    if token is not None:
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text(token)
    (tmp_path / "aws-config").write_text("")
    return {"AWS_ROLE_ARN": ROLE, "AWS_WEB_IDENTITY_TOKEN_FILE": str(token_file), "AWS_ENDPOINT_URL_STS": sts_url,
            "AWS_DEFAULT_REGION": TEST_REGION, "AWS_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials")}


def presigned_gets(proxy: FaultProxy, since: int = 0) -> list[dict[str, str]]:
    """The query of each ranged GET the proxy forwarded (the presigned data path), names lower-cased."""
    return [{k.lower(): v[-1] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(e.target).query).items()}
            for e in proxy.log()[since:] if e.range is not None and e.outcome == "forwarded"]


def test_a_mount_with_a_web_identity_reads_with_the_role_s_session_credentials(
        tmp_path: Path, moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """EKS IRSA against moto's STS: the mount starts with no keys but the role and its token file, reads the right
    bytes, and every request is signed with the session credentials STS gave (a key id that is not the server's
    test key); the presigned GETs carry their session token (X-Amz-Security-Token), without which S3 refuses them."""
    data = os.urandom(3 << 20)
    bucket = bucket_with(moto_server, {"m/model.safetensors.bin": data, "m/config.json": b"{}"})
    server = S3Server("moto via proxy", proxy.endpoint_url, irsa_env(tmp_path, moto_server.endpoint_url))
    with mounted(server, bucket, mountpoint, "--chunk-size", "1M", "--no-model-prefetch"):
        assert (mountpoint / "m" / "model.safetensors.bin").read_bytes() == data
        assert (mountpoint / "m" / "config.json").read_bytes() == b"{}"
    keys = {e.key_id for e in proxy.log() if e.outcome == "forwarded"}
    assert keys and None not in keys and TEST_KEY not in keys, keys
    gets = presigned_gets(proxy)
    assert gets and all(q.get("x-amz-security-token") for q in gets), gets[:2]


def test_a_mount_with_a_web_identity_sends_the_token_file_s_token_to_sts(
        tmp_path: Path, moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, fake_sts: FakeSts) -> None:
    """What STS is asked (the role, the token read from the file) and that the key it gives signs the reads."""
    bucket = bucket_with(moto_server, {"w.bin": b"x" * 100})
    server = S3Server("moto via proxy", proxy.endpoint_url, irsa_env(tmp_path, fake_sts.url, token="eyJ.my.jwt"))
    with mounted(server, bucket, mountpoint, "--no-model-prefetch"):
        assert (mountpoint / "w.bin").read_bytes() == b"x" * 100
    assert fake_sts.calls and all(c["Action"] == "AssumeRoleWithWebIdentity" and c["RoleArn"] == ROLE
                                  and c["WebIdentityToken"] == "eyJ.my.jwt" for c in fake_sts.calls), fake_sts.calls
    assert {e.key_id for e in proxy.log() if e.outcome == "forwarded"} <= set(fake_sts.issued)
    gets = presigned_gets(proxy)
    assert gets and all(q["x-amz-security-token"] == "token-" + q["x-amz-credential"].split("/")[0]
                        for q in gets), gets


def mount_refused(server: S3Server, bucket: str, mountpoint: Path, *extra: str) -> list[str]:
    """`modelfs mount` in the background (as a user runs it) that must fail before mounting: what it said, by line."""
    res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", server.endpoint_url, *extra,
                      env=daemon_env(server))
    assert res.returncode == 1, res
    # botocore's warning of each failed refresh, with its traceback, came twice before the reason (B282).
    assert "Traceback" not in res.stderr and "Refreshing temporary credentials failed" not in res.stderr, res.stderr
    return res.stderr.strip().splitlines()


@pytest.mark.parametrize("foreground", [False, True])
def test_a_web_identity_token_file_that_is_not_there_is_said_at_mount(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts, foreground: bool) -> None:
    """The pod's token file missing (a service account without the projected token, a path mistyped): the mount
    failed as if listing the bucket had failed on the way ("[Errno 2] No such file or directory"), and a mount with a
    cache dir that kept names came up as if the origin were away. It names the credentials, the file and the
    variable."""
    bucket = bucket_with(moto_server, {"w.bin": b"x"})
    env = irsa_env(tmp_path, fake_sts.url, token=None)
    said = mount_refused(S3Server("moto", moto_server.endpoint_url, env), bucket, mountpoint,
                         *(["--foreground"] if foreground else []))
    assert said[-1].startswith(f"modelfs: listing bucket '{bucket}': the credentials (assume-role-with-web-identity) "
                               "could not be had: No such file or directory: "
                               f"{env['AWS_WEB_IDENTITY_TOKEN_FILE']} (AWS_WEB_IDENTITY_TOKEN_FILE"), said
    assert not fake_sts.calls


@pytest.mark.parametrize("code, message", [
    ("AccessDenied", "Not authorized to perform sts:AssumeRoleWithWebIdentity"),
    ("InvalidIdentityToken", "Couldn't retrieve verification key from your identity provider"),
    ("ExpiredTokenException", "Token expired: current date/time 1700000000 must be before the expiration date/time"),
])
def test_a_role_sts_will_not_give_is_said_at_mount_as_sts_s_refusal_not_the_bucket_s(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts, code: str, message: str) -> None:
    """STS refusing the web identity's role (a trust policy that does not name the service account, a role ARN
    mistyped, the cluster's identity provider not registered, a token past its expiry): the mount said "access
    denied to bucket ... check credentials, and that they may list it: a mount needs s3:ListBucket", sending an
    operator to the bucket's policy, which no request had reached. It says STS's answer and what to check."""
    bucket = bucket_with(moto_server, {"w.bin": b"x"})
    fake_sts.refusal = (400 if code != "AccessDenied" else 403, code, message)
    said = mount_refused(S3Server("moto", moto_server.endpoint_url, irsa_env(tmp_path, fake_sts.url)), bucket,
                         mountpoint)
    assert said[-1] == (f"modelfs: listing bucket '{bucket}': the credentials (assume-role-with-web-identity) could "
                        f"not be had: AssumeRoleWithWebIdentity answered {code} ({message}): check the role "
                        "(AWS_ROLE_ARN, or the profile's role_arn), that its trust policy allows this web identity "
                        "(the service account's, on EKS), and the token file (AWS_WEB_IDENTITY_TOKEN_FILE)"), said
    assert "s3:ListBucket" not in "\n".join(said)


class RefusesExpired(FaultProxy):
    """Refuses a request signed with session credentials `sts` gave once their Expiration has passed, as S3 does: 400
    ExpiredToken (a HEAD's without a body). `refused` counts them."""

    sts: FakeSts
    refused = 0

    def _forward(self, req: Any, upstream: Any) -> Any:
        key = signed_key_id(req.header("Authorization") or "", req.target)
        until = self.sts.expiry.get(key or "")
        if until is not None and time.time() >= until:
            self.refused += 1
            return error_response(400, "ExpiredToken"), upstream
        return super()._forward(req, upstream)


def test_session_credentials_that_expire_during_a_long_read_are_refreshed_before_a_url_outlives_them(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts) -> None:
    """Session credentials whose life is shorter than a presigned URL's reuse (URL_REUSE_S: a credential_process
    handing out cached keys near their end, a short role session): botocore refreshed them before each signing, but a
    URL signed with the old ones was reused past their Expiration, refused (ExpiredToken), looked up again with a
    warning that they "have changed", and sent twice. A file read across many such expiries reads right, and no
    URL is sent past the credentials it was signed with."""
    fake_sts.lifetime = datetime.timedelta(seconds=3)
    data = os.urandom(4 << 20)
    bucket = bucket_with(moto_server, {"a.bin": data})
    with RefusesExpired(moto_server.endpoint_url) as proxy:
        proxy.sts = fake_sts
        server = S3Server("moto via proxy", proxy.endpoint_url, irsa_env(tmp_path, fake_sts.url))
        with mounted(server, bucket, mountpoint, "--chunk-size", "1M", "--max-readahead", "0", "--no-model-prefetch",
                     "--memory-limit", "256M", "--read-timeout", "10"):
            with open(mountpoint / "a.bin", "rb", buffering=0) as f:
                got = [f.read(1 << 20)]
                for _ in range(3):
                    time.sleep(3.5)  # past the credentials' Expiration: those the cached URL was signed with too
                    got.append(f.read(1 << 20))
            assert b"".join(got) == data
        assert proxy.refused == 0
        gets = presigned_gets(proxy)
        assert gets and all(q.get("x-amz-security-token") for q in gets)


def assume_role_profiles(tmp_path: Path, sts_url: str) -> dict[str, str]:
    """A config file whose profile `reader` assumes ROLE with the keys of profile `base` (in the credentials file),
    STS at `sts_url`; the environment that names them, and no keys of its own."""
    (tmp_path / "aws-config").write_text(f"[profile reader]\nrole_arn = {ROLE}\nsource_profile = base\n"
                                         "role_session_name = modelfs\n\n[profile base]\n")
    (tmp_path / "aws-credentials").write_text("[base]\naws_access_key_id = AKIABASEBASEBASE0001\n"
                                              "aws_secret_access_key = base-secret\n")
    return {"AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"), "AWS_ENDPOINT_URL_STS": sts_url,
            "AWS_DEFAULT_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def test_a_profile_that_assumes_a_role_reads_with_the_role_s_session_credentials(
        tmp_path: Path, moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """--profile naming a profile with `role_arn` and `source_profile`, against moto's STS (sts:AssumeRole signed
    with the source profile's key): the reads are signed with the role's session credentials, never the source key,
    and the presigned GETs carry the session token."""
    data = os.urandom(2 << 20)
    bucket = bucket_with(moto_server, {"a.bin": data})
    server = S3Server("moto via proxy", proxy.endpoint_url, assume_role_profiles(tmp_path, moto_server.endpoint_url))
    with mounted(server, bucket, mountpoint, "--profile", "reader", "--chunk-size", "1M", "--no-model-prefetch"):
        assert (mountpoint / "a.bin").read_bytes() == data
    keys = {e.key_id for e in proxy.log() if e.outcome == "forwarded"}
    assert keys and None not in keys and not keys & {TEST_KEY, "AKIABASEBASEBASE0001"}, keys
    gets = presigned_gets(proxy)
    assert gets and all(q.get("x-amz-security-token") for q in gets), gets[:2]


def test_a_role_sts_will_not_give_a_profile_is_said_at_mount_as_sts_s_refusal(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts) -> None:
    """The same profile where STS refuses the source key the role (a trust policy that does not name it, a source key
    revoked): said as STS's answer, not as the bucket refusing a listing."""
    bucket = bucket_with(moto_server, {"w.bin": b"x"})
    fake_sts.refusal = (403, "AccessDenied", "User: arn:aws:iam::123456789012:user/base is not authorized to "
                        "perform: sts:AssumeRole")
    server = S3Server("moto", moto_server.endpoint_url, assume_role_profiles(tmp_path, fake_sts.url))
    said = mount_refused(server, bucket, mountpoint, "--profile", "reader")
    assert said[-1] == (f"modelfs: listing bucket '{bucket}': the credentials (assume-role) could not be had: "
                        f"AssumeRole answered AccessDenied ({fake_sts.refusal[2]}): check the profile's role_arn, "
                        "that the role's trust policy allows its source credentials (source_profile, "
                        "credential_source), and those"), said
    assert [c["Action"] for c in fake_sts.calls][:1] == ["AssumeRole"]


SSO_START = "https://example.awsapps.com/start"


def sso_profile(tmp_path: Path, sso_url: str, expires_in: datetime.timedelta) -> dict[str, str]:
    """A profile `sso` signed in with IAM Identity Center (`aws sso login`: its token in HOME's cache, expiring
    `expires_in` from now), the SSO portal at `sso_url`; the environment that names them, and no keys."""
    (tmp_path / "aws-config").write_text(f"[profile sso]\nsso_start_url = {SSO_START}\nsso_region = {TEST_REGION}\n"
                                         "sso_account_id = 123456789012\nsso_role_name = model-reader\n")
    cache = tmp_path / "home" / ".aws" / "sso" / "cache"
    cache.mkdir(parents=True)
    until = datetime.datetime.now(datetime.UTC) + expires_in
    (cache / f"{hashlib.sha1(SSO_START.encode()).hexdigest()}.json").write_text(json.dumps({
        "startUrl": SSO_START, "region": TEST_REGION, "accessToken": "sso-access-token",
        "expiresAt": until.strftime("%Y-%m-%dT%H:%M:%SZ")}))
    return {"HOME": str(tmp_path / "home"), "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"), "AWS_ENDPOINT_URL_SSO": sso_url,
            "AWS_DEFAULT_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def test_a_profile_signed_in_with_sso_reads_with_its_role_credentials(
        tmp_path: Path, moto_server: S3Server, proxy: FaultProxy, mountpoint: Path, fake_sts: FakeSts) -> None:
    """--profile naming an IAM Identity Center (SSO) profile after `aws sso login`: the reads are signed with the
    role credentials the SSO portal gives for the cached token, session token in each presigned GET."""
    data = os.urandom(2 << 20)
    bucket = bucket_with(moto_server, {"a.bin": data})
    env = sso_profile(tmp_path, fake_sts.url, datetime.timedelta(hours=8))
    with mounted(S3Server("moto via proxy", proxy.endpoint_url, env), bucket, mountpoint, "--profile", "sso",
                 "--chunk-size", "1M", "--no-model-prefetch"):
        assert (mountpoint / "a.bin").read_bytes() == data
    assert fake_sts.issued
    assert {e.key_id for e in proxy.log() if e.outcome == "forwarded"} <= set(fake_sts.issued)
    gets = presigned_gets(proxy)
    assert gets and all(q["x-amz-security-token"] == "token-" + q["x-amz-credential"].split("/")[0]
                        for q in gets), gets


def test_an_sso_login_that_has_expired_is_said_at_mount(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts) -> None:
    """The SSO login's token past its expiry (a node where `aws sso login` ran yesterday): the mount fails saying
    the credentials could not be had and to run `aws sso login`; the portal is not asked."""
    bucket = bucket_with(moto_server, {"w.bin": b"x"})
    env = sso_profile(tmp_path, fake_sts.url, -datetime.timedelta(hours=1))
    said = mount_refused(S3Server("moto", moto_server.endpoint_url, env), bucket, mountpoint, "--profile", "sso")
    assert said[-1].startswith(f"modelfs: listing bucket '{bucket}': the credentials (sso) could not be had: "), said
    assert "aws sso login" in said[-1], said
    assert not fake_sts.calls


@contextlib.contextmanager
def mounted_with_short_sessions(tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts,
                                read_timeout: str) -> Iterator[tuple[Any, bytes]]:
    """A mount by web identity whose session credentials last 3 s, reading an 8 MiB `a.bin` chunk by chunk (1 MiB,
    no read-ahead, names kept for good): (the mount, the file's bytes). Its log may say the credentials could not be
    had."""
    fake_sts.lifetime = datetime.timedelta(seconds=3)
    data = os.urandom(8 << 20)
    bucket = bucket_with(moto_server, {"a.bin": data})
    server = S3Server("moto", moto_server.endpoint_url, irsa_env(tmp_path, fake_sts.url))
    with mounted(server, bucket, mountpoint, "--chunk-size", "1M", "--max-readahead", "0", "--no-model-prefetch",
                 "--metadata-ttl", "forever", "--read-timeout", read_timeout,
                 allowed=(r"could not be had", r"the credentials' refresh failed \(\w+\)")) as m:
        yield m, data


def test_a_running_mount_whose_role_sts_stops_giving_refuses_reads_in_one_line_and_reads_again_once_it_does(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts) -> None:
    """Session credentials expired while STS refuses the role (its trust policy changed, the identity provider
    removed): each read of a chunk not in memory is EACCES at once, saying the credentials could not be had, and the
    log holds no traceback: botocore logged its 24-line warning at every request it signed (B282). Once STS gives the
    role again, reads go on with new session credentials, exact."""
    with mounted_with_short_sessions(tmp_path, moto_server, mountpoint, fake_sts, "10") as (m, data):
        with open(mountpoint / "a.bin", "rb", buffering=0) as f:
            assert f.read(1 << 20) == data[:1 << 20]
            fake_sts.refusal = (403, "AccessDenied", "Not authorized to perform sts:AssumeRoleWithWebIdentity")
            time.sleep(3.5)  # the session credentials have expired
            asked = len(fake_sts.calls)
            for at in (4, 5, 6):  # chunks far from those read: not fetched ahead by the kernel's read-ahead
                started = time.monotonic()
                with pytest.raises(PermissionError):
                    os.pread(f.fileno(), 1 << 20, at << 20)
                assert time.monotonic() - started < 5
            # STS asked by the first signing and its lookup, not at each request signed (B284: 8 times)
            assert len(fake_sts.calls) - asked <= 3, fake_sts.calls[asked:]
            fake_sts.refusal = None
            time.sleep(credentials.UNAVAILABLE_HOLD_S)  # credentials that could not be had are asked for again then
            assert os.pread(f.fileno(), 4 << 20, 4 << 20) == data[4 << 20:]
        log = m.log()
        assert "Traceback" not in log and "Refreshing temporary credentials failed" not in log, log[-3000:]
        assert "AssumeRoleWithWebIdentity answered AccessDenied" in log, log[-3000:]


def test_an_sts_that_does_not_answer_fails_the_mount_in_seconds_saying_so(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path) -> None:
    """STS that takes the connection and never answers (a VPC with no route or endpoint to it, a proxy eating it):
    botocore's own timeouts and tries held the pre-flight for 190 s (60 s a read, 3 tries, then a lookup's 10 s),
    and a running mount's signing as long. Its fetches are bounded (credentials.FETCH_TIMEOUT_S; the pre-flight's
    5 s, one try): the mount fails in seconds saying the credentials got no answer (B283)."""
    bucket = bucket_with(moto_server, {"w.bin": b"x"})
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)
    held: list[socket.socket] = []

    def take() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(silent.accept()[0])

    threading.Thread(target=take, daemon=True).start()
    try:
        env = irsa_env(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        said = mount_refused(S3Server("moto", moto_server.endpoint_url, env), bucket, mountpoint)
        assert time.monotonic() - started < 30, said
        assert said[-1].startswith(f"modelfs: listing bucket '{bucket}': the credentials "
                                   "(assume-role-with-web-identity) could not be had: no answer in time"), said
    finally:
        silent.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("status, code", [(503, "ServiceUnavailable"), (400, "IDPCommunicationError")])
def test_a_running_mount_whose_sts_fails_for_a_moment_serves_the_read_that_waited_for_it(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, fake_sts: FakeSts, status: int, code: str) -> None:
    """Session credentials expired while STS answers 503, or that it could not reach the identity provider
    (IDPCommunicationError, its documented transient error), for two seconds: the read waiting for them failed EIO
    within about a second (a TransientError's 5 tries in 1.1 s, all failed at once within UNAVAILABLE_HOLD_S), or
    EACCES. It is asked again until --read-timeout, as for an origin refusing connections, and served exact once STS
    gives them (B297)."""
    with mounted_with_short_sessions(tmp_path, moto_server, mountpoint, fake_sts, "20") as (_, data):
        with open(mountpoint / "a.bin", "rb", buffering=0) as f:
            assert f.read(1 << 20) == data[:1 << 20]
            fake_sts.refusal = (status, code, "try again")
            time.sleep(3.5)  # the session credentials have expired
            mended = threading.Timer(2.0, lambda: setattr(fake_sts, "refusal", None))
            mended.start()
            try:
                started = time.monotonic()
                assert os.pread(f.fileno(), 1 << 20, 4 << 20) == data[4 << 20:5 << 20]
                assert time.monotonic() - started < 20
            finally:
                mended.cancel()
