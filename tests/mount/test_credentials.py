"""Credentials over the life of a mount (fsmount.data.credentials): a store whose credentials are rotated while it
runs, the old key refused by the fault proxy (403 ExpiredToken, `FaultProxy.revoke_key`) in front of moto."""

from __future__ import annotations

import datetime
import http.server
import json
import os
import stat
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from fsmount.config import StoreConfig
from fsmount.data import Boto3Store
from fsmount.data.store import AccessDenied
from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.http_wire import error_response
from tests.helpers import TEST_REGION, S3Server, bucket_with, daemon_env, mounted, run_modelfs

DATA = bytes(range(256)) * 4096  # 1 MiB
OLD, NEW = "AKIAOLDOLDOLDOLD0001", "AKIANEWNEWNEWNEW0002"
OLD_SECRET, NEW_SECRET = "old-secret-never-logged", "new-secret-never-logged"


@pytest.fixture
def aws_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An AWS config and credentials file of our own; no credentials from the environment."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", TEST_REGION)
    (tmp_path / "config").write_text("")
    return tmp_path


def keys_seen(proxy: FaultProxy, since: int) -> set[str | None]:
    return {e.key_id for e in proxy.log()[since:] if e.outcome == "forwarded"}


def read(store: Boto3Store) -> None:
    assert bytes(store.get_range("w.bin", "", 0, len(DATA))) == DATA


def head(store: Boto3Store) -> None:
    meta = store.head("w.bin")
    assert meta is not None and meta.size == len(DATA)


def listing(store: Boto3Store) -> None:
    assert [o.key for page in store.list_pages("") for o in page.objects] == ["w.bin"]


def whole(store: Boto3Store) -> None:
    assert store.get_object("w.bin") == DATA


def write(store: Boto3Store) -> None:
    store.put_object("tier/x", b"chunk")
    store.delete_object("tier/x")


STEPS = {"read": read, "head": head, "listing": listing, "whole": whole, "write": write}


def exercise(store: Boto3Store, first: str = "read") -> None:
    """Each kind of request a mount sends through `store` (ranged reads, HEADs, listings, the shared tier's whole
    reads and writes), `first` first."""
    for name in [first, *(n for n in STEPS if n != first)]:
        STEPS[name](store)


@pytest.mark.parametrize("get_client", ["presigned", "boto3"])
@pytest.mark.parametrize("first", list(STEPS))
def test_a_credentials_file_rewritten_with_a_new_key_is_read_again_when_the_old_key_is_refused(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, allowed_logs: list[str],
        caplog: pytest.LogCaptureFixture, first: str, get_client: str) -> None:
    """botocore reads the credentials file once: an agent that rewrote it with a new key and revoked the old one
    left the daemon refusing every read, listing and write (EACCES) until it was restarted. A refusal now looks the
    credentials up again (at most once per RECHECK_S) and the request is sent once more, signed with the new key."""
    allowed_logs.append(r"requests were refused \((ExpiredToken|403)\) and the credentials \(shared-credentials-file\) "
                        r"have changed")
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    creds = aws_files / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = {OLD_SECRET}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path",
                                   get_client=get_client))
    exercise(store)
    assert keys_seen(proxy, 0) == {OLD}

    creds.write_text(f"[default]\naws_access_key_id = {NEW}\naws_secret_access_key = {NEW_SECRET}\n")
    proxy.revoke_key(OLD)
    since = len(proxy.log())
    exercise(store, first)  # the first request refused is sent again, signed with the new key
    assert keys_seen(proxy, since) == {NEW}
    warnings = [r.getMessage() for r in caplog.records if "have changed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert not any(secret in r.getMessage() for r in caplog.records for secret in (OLD_SECRET, NEW_SECRET))


@pytest.mark.parametrize("get_client", ["presigned", "boto3"])
@pytest.mark.parametrize("first", list(STEPS))
def test_session_credentials_expired_as_s3_says_it_400_are_read_again_from_the_rewritten_file(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, allowed_logs: list[str],
        caplog: pytest.LogCaptureFixture, first: str, get_client: str) -> None:
    """S3 refuses a session token past its expiry with 400 ExpiredToken, not 403 (a HEAD's 400 has no body, its
    code "400"). The needs-retry hook looked at 403s only: a file an agent rewrote with new session credentials was
    read again by a refused presigned GET, but a mount whose HEADs, listings or writes met the expiry first got
    EACCES (EIO for a HEAD) on every one of them while no GET came to renew them."""
    allowed_logs.append(r"requests were refused \((ExpiredToken|400)\) and the credentials \(shared-credentials-file\) "
                        r"have changed")
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    creds = aws_files / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = {OLD_SECRET}\n"
                     "aws_session_token = old-token\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path",
                                   get_client=get_client))
    exercise(store)
    creds.write_text(f"[default]\naws_access_key_id = {NEW}\naws_secret_access_key = {NEW_SECRET}\n"
                     "aws_session_token = new-token\n")
    proxy.revoke_key(OLD, status=400)
    since = len(proxy.log())
    exercise(store, first)
    assert keys_seen(proxy, since) == {NEW}
    assert len([r for r in caplog.records if "have changed" in r.getMessage()]) == 1


def test_a_key_refused_and_not_replaced_is_eacces_said_and_looked_up_at_most_once_per_recheck(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key revoked and not replaced: every request is EACCES with the reason (ExpiredToken), and the credentials
    are looked up again at most once per RECHECK_S, not on every refused request."""
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    (aws_files / "credentials").write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = s\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
    lookups = []
    renewable = store._credentials
    assert renewable is not None
    resolve = renewable._resolve
    monkeypatch.setattr(renewable, "_resolve", lambda: lookups.append(1) or resolve())
    proxy.revoke_key(OLD)
    for _ in range(3):
        with pytest.raises(AccessDenied, match=r"\(ExpiredToken\): the credentials' session token has expired"):
            store.get_range("w.bin", "", 0, 10)
        with pytest.raises(AccessDenied, match=r"\(403\): check credentials"):  # a HEAD's answer names no code
            store.head("w.bin")
        with pytest.raises(AccessDenied, match=r"\(ExpiredToken\): the credentials' session token has expired"):
            list(store.list_pages(""))
    assert len(lookups) == 1


def test_credentials_botocore_refreshes_sign_with_the_new_key_after_a_rotation(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy) -> None:
    """A credential_process with an Expiration (as container and instance credentials have one): botocore refreshes
    them itself, through the Renewable in front of them; presigned reads, HEADs, listings and writes all sign with
    the key it gives after a rotation."""
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    current = aws_files / "current-key"
    current.write_text(OLD)
    script = aws_files / "process.py"
    # Expiring in 12 minutes: within botocore's advisory refresh window (15 min), so each signing asks again.
    script.write_text(
        "import datetime, json, pathlib\n"
        f"key = pathlib.Path({str(current)!r}).read_text()\n"
        "until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=12)\n"
        "print(json.dumps({'Version': 1, 'AccessKeyId': key, 'SecretAccessKey': 's-' + key, 'SessionToken': 't',"
        " 'Expiration': until.strftime('%Y-%m-%dT%H:%M:%SZ')}))\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (aws_files / "config").write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
    exercise(store)
    current.write_text(NEW)
    proxy.revoke_key(OLD)
    since = len(proxy.log())
    exercise(store)
    assert keys_seen(proxy, since) == {NEW}


class CredentialServer(http.server.ThreadingHTTPServer):
    """A container-credentials endpoint and an instance metadata service (IMDSv2) on 127.0.0.1, both giving
    `key` (changed by the test) with an Expiration 12 minutes away: within botocore's advisory refresh window
    (15 min), so each signing asks again."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), CredentialHandler)
        self.key = OLD

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def document(self) -> bytes:
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=12)
        return json.dumps({"Code": "Success", "AccessKeyId": self.key, "SecretAccessKey": "s-" + self.key,
                           "Token": "t", "Expiration": until.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()


class CredentialHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CredentialServer

    def log_message(self, *args: object) -> None:
        pass

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        self.answer(b"imds-token")  # IMDSv2's session token (latest/api/token)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/").endswith("security-credentials"):
            self.answer(b"role")
        else:
            self.answer(self.server.document())


@pytest.mark.parametrize("source", ["container", "imds"])
def test_container_and_instance_credentials_sign_with_the_new_key_after_a_rotation(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        allowed_logs: list[str], source: str) -> None:
    """Container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI) and an instance role (IMDS, at
    AWS_EC2_METADATA_SERVICE_ENDPOINT): after a rotation every kind of request signs with the new key. botocore
    refreshes container credentials itself; instance credentials this close to their expiry it does not (it sets
    their expiry 17 to 25 minutes ahead, as if the metadata service were failing), so before the Renewable the old
    key, refused, stayed in use: the first refusal now fetches them again (one warning)."""
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(iam-role\) have changed")
    server = CredentialServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        if source == "container":
            monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", server.url + "/creds")
        else:
            monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
            monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.url + "/")
        bucket = bucket_with(moto_server, {"w.bin": DATA})
        store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
        exercise(store)
        assert keys_seen(proxy, 0) == {OLD}
        server.key = NEW
        proxy.revoke_key(OLD)
        since = len(proxy.log())
        exercise(store)
        assert keys_seen(proxy, since) == {NEW}
    finally:
        server.shutdown()
        server.server_close()


def test_the_renewal_is_installed_in_front_of_the_chain_and_keeps_its_order(aws_files: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Environment credentials still win over the file (botocore's order), through the Renewable."""
    from fsmount.data.credentials import Renewable

    (aws_files / "credentials").write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = s\n")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", NEW)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s2")
    store = Boto3Store(StoreConfig(bucket="b", endpoint_url="http://127.0.0.1:9", addressing_style="path"))
    assert isinstance(store._credentials, Renewable)
    assert store._credentials.method == "env" and store._credentials.access_key == NEW
    assert f"X-Amz-Credential={NEW}" in store._presign("k")


@pytest.mark.seaweedfs
@pytest.mark.parametrize("first", list(STEPS))
def test_a_key_the_server_refuses_is_replaced_by_the_file_s_new_one_on_seaweedfs(
        aws_files: Path, seaweed_server: S3Server, allowed_logs: list[str], first: str) -> None:
    """On a server that checks signatures: a key it does not know (its own refusal, as it words it) is looked up
    again, and the request sent again with the key the credentials file holds now."""
    allowed_logs.append(r"requests were refused \(\w+\) and the credentials \(shared-credentials-file\) have changed")
    bucket = bucket_with(seaweed_server, {"w.bin": DATA})
    creds = aws_files / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = {OLD_SECRET}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=seaweed_server.endpoint_url, addressing_style="path"))
    env = seaweed_server.env
    creds.write_text(f"[default]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    exercise(store, first)


def test_a_mount_reads_on_after_its_profile_s_key_is_rotated_in_its_file_and_the_old_one_revoked(
        tmp_path: Path, moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """Through FUSE, with --profile: a file read across the rotation (through a handle opened before it), a file
    never opened, a listing and a stat past the metadata TTL all succeed, exact, once the old key is refused."""
    big = os.urandom(6 << 20)
    bucket = bucket_with(moto_server, {"a.bin": big, "b.bin": DATA})
    creds, config = tmp_path / "credentials", tmp_path / "config"
    creds.write_text(f"[rot]\naws_access_key_id = {OLD}\naws_secret_access_key = {OLD_SECRET}\n")
    config.write_text("")
    server = S3Server("moto via proxy", proxy.endpoint_url,
                      {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": str(config),
                       "AWS_DEFAULT_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true"})
    with mounted(server, bucket, mountpoint, "--profile", "rot", "--chunk-size", "1M", "--max-readahead", "0",
                 "--no-model-prefetch", "--metadata-ttl", "1", "--read-timeout", "10",
                 allowed=(r"requests were refused \(ExpiredToken\) and the credentials \(shared-credentials-file\)",)
                 ) as m:
        with open(mountpoint / "a.bin", "rb", buffering=0) as f:
            head = f.read(1 << 20)
            creds.write_text(f"[rot]\naws_access_key_id = {NEW}\naws_secret_access_key = {NEW_SECRET}\n")
            proxy.revoke_key(OLD)
            since = len(proxy.log())
            rest = b"".join(iter(lambda: f.read(1 << 20), b""))
        assert head + rest == big
        assert (mountpoint / "b.bin").read_bytes() == DATA
        time.sleep(1.2)  # past the TTL: the listing and the HEAD are asked again
        assert sorted(os.listdir(mountpoint)) == ["a.bin", "b.bin"]
        assert (mountpoint / "b.bin").stat().st_size == len(DATA)
        assert keys_seen(proxy, since) == {NEW}
        log = m.log()
        assert log.count("have changed since they were read") == 1, log[-3000:]
        assert OLD_SECRET not in log and NEW_SECRET not in log


def minting_process(runs: Path, script: Path) -> str:
    """A credential_process (`script`, written here; the config line's value returned) that gives new session keys at
    each run, as an assumed role or SSO does at each lookup; each run adds a byte to `runs`."""
    script.write_text(
        "import json, pathlib\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "n = len(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text('x' * (n + 1))\n"
        "print(json.dumps({'Version': 1, 'AccessKeyId': f'ASIAMINTED{n:010d}', 'SecretAccessKey': 's',"
        " 'SessionToken': 't'}))\n")
    return f"{sys.executable} {script}"


@pytest.mark.parametrize("get_client", ["presigned", "boto3"])
def test_a_bucket_policy_refusing_credentials_minted_at_each_lookup_costs_one_lookup_not_one_per_refusal(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, allowed_logs: list[str],
        caplog: pytest.LogCaptureFixture, get_client: str) -> None:
    """A credential_process that gives new session keys at each run (as an assumed role or SSO does at each lookup):
    every lookup looked changed, so a bucket policy's AccessDenied ran the process, warned "have changed" and sent
    the request twice at each refusal (each RECHECK_S; 0 here). The second refusal of credentials a lookup changed
    says the refusal is the bucket's: no more lookups, nor second requests, for AccessDenied (the first request of a
    refusal after which the process is not run again, one warning of each kind). A presigned GET was sent twice at
    every refusal all the same, the second signed now with the same credentials (B130)."""
    allowed_logs.extend([r"requests were refused \(AccessDenied\) and the credentials \(custom-process\) have changed",
                         r"refused again \(AccessDenied\): the bucket refuses them for a reason of its own"])
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    runs = aws_files / "runs"
    (aws_files / "config").write_text(f"[default]\ncredential_process = {minting_process(runs, aws_files / 'p.py')}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path",
                                   get_client=get_client))
    assert store._credentials is not None
    store._credentials._recheck_s = 0.0  # every refusal may look them up: what RECHECK_S spaces out
    read(store)
    proxy.inject("error", status=403, code="AccessDenied", data_only=False)  # the bucket's policy now refuses all
    since, before = len(proxy.log()), len(runs.read_text())
    for _ in range(4):
        with pytest.raises(AccessDenied):
            store.get_range("w.bin", "", 0, 10)
        with pytest.raises(AccessDenied):
            list(store.list_pages(""))
    assert len(runs.read_text()) - before == 1  # one lookup: the first refusal's
    # The listings sent once each; the reads twice the first time only (the lookup changed the credentials), not
    # again with a URL signed now with the same ones (B130).
    assert len([e for e in proxy.log()[since:] if "list-type=2" in e.target]) == 4
    assert len([e for e in proxy.log()[since:] if e.range is not None]) == 5
    said = [r.getMessage() for r in caplog.records if r.name == "fsmount.data.credentials"]
    assert len(said) == 2, said


def test_a_head_refused_with_a_bare_400_and_no_new_credentials_says_what_it_probably_means(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy) -> None:
    """A session token past its expiry, as AWS S3 answers a HEAD signed with it (400, no body), and no new
    credentials in the file: the HEAD's EIO said "HEAD 'w.bin': 400" alone. It names the probable cause and what to
    do now; a listing's refusal names its code (B97)."""
    from fsmount.data.store import StoreError

    bucket = bucket_with(moto_server, {"w.bin": DATA})
    (aws_files / "credentials").write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = s\n"
                                           "aws_session_token = old-token\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
    proxy.revoke_key(OLD, status=400)
    with pytest.raises(StoreError, match=r"HEAD 'w.bin': 400 without an error code: AWS S3 answers so a HEAD whose "
                                         r"credentials' session token has expired\. If the credentials are temporary"):
        store.head("w.bin")
    with pytest.raises(AccessDenied, match=r"\(ExpiredToken\): the credentials' session token has expired"):
        list(store.list_pages(""))


def test_a_listing_refused_at_the_mount_names_the_permission_it_needs(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy) -> None:
    """Credentials without s3:ListBucket (a policy granting s3:GetObject alone): the mount's check said "access
    denied ... check credentials", which sent an operator to the keys, not to the policy (B131)."""
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    (aws_files / "credentials").write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = s\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
    proxy.inject("error", status=403, code="AccessDenied", kind="lists")
    with pytest.raises(AccessDenied, match=r"\(AccessDenied\): check credentials, and that they may list it: a mount "
                                           r"needs s3:ListBucket on the bucket for its prefix"):
        store.check_bucket("")


def test_probes_of_missing_keys_refused_403_leave_credentials_minted_at_each_lookup_renewed_at_a_revocation(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, allowed_logs: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """S3 answers a HEAD of a missing key 403 to a caller without s3:ListBucket on it (B131). botocore's hook looked
    the credentials up at that refusal, a source minting keys at each lookup (SSO, an assumed role) looked changed,
    the HEAD was refused again, and `Renewable.refused_again` took it for the bucket refusing them: one probe of an
    optional file warned "the bucket refuses them for a reason of its own (a bucket or IAM policy?)", and a HEAD's
    bare 403 looked them up once per POLICY_RECHECK_S (10 minutes) after that, so a session revoked later left every
    HEAD EACCES. A listing now says first whether the key is there; only a key it names renews them (B135)."""
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(custom-process\) have changed")
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    runs = aws_files / "runs"
    (aws_files / "config").write_text(f"[default]\ncredential_process = {minting_process(runs, aws_files / 'p.py')}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
    assert store._credentials is not None
    head(store)
    proxy.inject("error", status=403, code="AccessDenied", kind="heads")  # a HEAD of a missing key, as S3 answers it
    before = len(runs.read_text())
    for name in ("generation_config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert store.head(name) is None
    proxy.clear()
    assert len(runs.read_text()) == before  # no lookup: a missing key's refusal is not the credentials'
    assert not [r.getMessage() for r in caplog.records if r.name == "fsmount.data.credentials"]
    proxy.revoke_key(store._credentials.access_key)  # the session revoked: a HEAD's bare 403, a listing's named
    head(store)  # looked up again (once: RECHECK_S), signed with the new session's key
    assert len(runs.read_text()) == before + 1


def test_a_loader_s_probes_through_a_mount_where_heads_of_missing_keys_are_refused_look_nothing_up(
        tmp_path: Path, moto_server: S3Server, proxy: FaultProxy, mountpoint: Path) -> None:
    """Through FUSE, with a profile whose credential_process gives new session keys at each run (as SSO or a role
    assumed through a profile do at each lookup), where the server answers a HEAD of a missing key 403: a loader's
    probes of optional files are ENOENT, and run the process no more nor warn. The first probe ran it, sent the HEAD
    again, and warned that the bucket refuses the credentials "for a reason of its own (a bucket or IAM policy?)"
    (B135)."""
    bucket = bucket_with(moto_server, {"m/config.json": b"{}", "m/model.safetensors": b"x" * 100})
    runs, config = tmp_path / "runs", tmp_path / "config"
    config.write_text(f"[profile minted]\ncredential_process = {minting_process(runs, tmp_path / 'p.py')}\n")
    server = S3Server("moto via proxy", proxy.endpoint_url,
                      {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(config),
                       "AWS_DEFAULT_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true"})
    with mounted(server, bucket, mountpoint, "--profile", "minted", "--metadata-ttl", "60",
                 "--no-model-prefetch") as m:
        assert (mountpoint / "m" / "config.json").read_bytes() == b"{}"
        proxy.inject("error", status=403, code="AccessDenied", kind="heads")  # as S3 answers a missing key's HEAD
        before, heads = len(runs.read_text()), proxy.counts().get("heads", 0)
        probes = ["generation_config.json", "model.safetensors.index.json", "tokenizer.json"]
        for name in probes:
            with pytest.raises(FileNotFoundError):
                open(mountpoint / "m" / name, "rb")  # noqa: SIM115 - it must fail
        assert len(runs.read_text()) == before  # no lookup
        assert proxy.counts().get("heads", 0) - heads == len(probes)  # each HEAD sent once
        log = m.log()
        assert "reason of its own" not in log and "have changed" not in log, log[-3000:]


def test_a_credential_process_that_hangs_holds_no_request_past_the_lookup_timeout(
        aws_files: Path, moto_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        allowed_logs: list[str]) -> None:
    """A credential_process that hangs when run again (a vault agent down): the refused request that ran it, and
    every other refused one queued behind it, waited for good; a mount's metadata and write threads, abandoned at
    their deadline but never ended, kept their slots until every stat and close timed out. Each now gets its refusal
    within about LOOKUP_TIMEOUT_S, and the process is not run again while it hangs."""
    from fsmount.data import credentials

    allowed_logs.append(r"requests were refused \(\w+\); looking the credentials up again took more than 0\.5 s")
    monkeypatch.setattr(credentials, "LOOKUP_TIMEOUT_S", 0.5, raising=False)
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    runs, script = aws_files / "runs", aws_files / "process.py"
    script.write_text(
        "import json, pathlib, time\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "n = len(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text('x' * (n + 1))\n"
        "if n:\n"
        "    time.sleep(4)\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {OLD!r}, 'SecretAccessKey': 's'}}))\n")
    (aws_files / "config").write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
    assert store._credentials is not None
    store._credentials._recheck_s = 0.0
    read(store)
    proxy.revoke_key(OLD)
    started = time.monotonic()
    failed: list[BaseException] = []

    def refused() -> None:
        for step in (head, listing, whole):
            try:
                step(store)
            except AccessDenied as exc:
                failed.append(exc)

    callers = [threading.Thread(target=refused, daemon=True) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert not any(c.is_alive() for c in callers) and len(failed) == 9
    assert time.monotonic() - started < 3
    assert len(runs.read_text()) == 2  # the first run, and the one that hangs: not run again meanwhile
    lookup = store._credentials._lookup
    assert lookup is not None
    lookup[0].join(10)  # the process ends by itself


class RefusesSignatures(FaultProxy):
    """Refuses, SignatureDoesNotMatch, the presigned URLs whose signature is in `refused`: those signed with a secret
    the server no longer holds for their key id."""

    refused: set[str] = set()

    def _forward(self, req: Any, upstream: Any) -> Any:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(req.target).query)
        if self.refused & set(query.get("X-Amz-Signature", ())):
            return error_response(403, "SignatureDoesNotMatch"), upstream
        return super()._forward(req, upstream)


def test_a_url_cached_before_the_secret_of_its_key_was_rotated_is_not_sent(
        aws_files: Path, moto_server: S3Server, allowed_logs: list[str]) -> None:
    """A key id kept with a new secret (MinIO's or Ceph's users rotate so; a credentials file rewritten): a lookup
    took the new secret, but a URL cached before it, signed with the old one, was reused for up to URL_REUSE_S. Its
    refusal, once the lookup had nothing newer (RECHECK_S later), was not sent again, a URL signed now naming the
    same key id (B130): each file's next read was EACCES. A URL signed before a renewal changed the credentials is
    not reused (B133)."""
    allowed_logs.append(r"requests were refused \(403\) and the credentials \(shared-credentials-file\) have changed")
    bucket = bucket_with(moto_server, {"w.bin": DATA})
    creds = aws_files / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = {OLD_SECRET}\n")
    with RefusesSignatures(moto_server.endpoint_url) as proxy:
        store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=proxy.endpoint_url, addressing_style="path"))
        assert bytes(store.get_range("w.bin", "", 0, 10)) == DATA[:10]  # its URL cached, signed with OLD_SECRET
        old_url = store._ranges._urls["w.bin"][-1]
        creds.write_text(f"[default]\naws_access_key_id = {OLD}\naws_secret_access_key = {NEW_SECRET}\n")
        proxy.refused = set(urllib.parse.parse_qs(urllib.parse.urlsplit(old_url).query)["X-Amz-Signature"])
        proxy.inject("error", status=403, code="SignatureDoesNotMatch", kind="heads", times=1)
        assert store.head("w.bin") is not None  # refused, looked up: the new secret, the HEAD sent again
        store._credentials._recheck_s = 0  # as RECHECK_S after that renewal: its change is not news any more
        assert bytes(store.get_range("w.bin", "", 0, 10)) == DATA[:10]


@pytest.mark.parametrize("mode", ["exit", "garbage"])
def test_a_running_mount_whose_credential_process_fails_for_a_moment_serves_the_read_that_waited_for_it(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, mode: str) -> None:
    """A credential_process with an Expiration (a vault agent's helper) whose credentials are due while it exits with
    an error for three seconds (the agent restarting): the read waiting for them was EACCES at once. It is asked
    again until --read-timeout, as an STS answering 503 is (B297), and served exact once the process gives them. One
    that prints what is not JSON (a prompt for a token) is still EACCES at once, its log saying what to fix (B330)."""
    data = os.urandom(8 << 20)
    bucket = bucket_with(moto_server, {"a.bin": data})
    script, mode_file, config = tmp_path / "vault-creds.py", tmp_path / "mode", tmp_path / "config"
    # Expiring a minute and a second after each run: within botocore's mandatory refresh window (10 minutes), so each
    # signing runs it, and a presigned URL is not reused past a second (presigned.CREDENTIALS_ROOM_S, a minute).
    script.write_text(
        "import datetime, json, pathlib, sys\n"
        f"mode = pathlib.Path({str(mode_file)!r}).read_text()\n"
        "if mode == 'exit':\n"
        "    sys.exit('vault agent is restarting')\n"
        "if mode == 'garbage':\n"
        "    print('Enter your vault token:')\n"
        "    sys.exit()\n"
        "until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=61)\n"
        "print(json.dumps({'Version': 1, 'AccessKeyId': 'ASIAVAULT', 'SecretAccessKey': 's', 'SessionToken': 't',"
        " 'Expiration': until.strftime('%Y-%m-%dT%H:%M:%SZ')}))\n")
    mode_file.write_text("ok")
    config.write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    server = S3Server("moto", moto_server.endpoint_url,
                      {"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
                       "AWS_DEFAULT_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true"})
    with mounted(server, bucket, mountpoint, "--chunk-size", "1M", "--max-readahead", "0", "--no-model-prefetch",
                 "--metadata-ttl", "forever", "--read-timeout", "20",
                 allowed=(r"could not be had", r"the credentials' refresh failed \(\w+\)")) as m:
        with open(mountpoint / "a.bin", "rb", buffering=0) as f:
            assert f.read(1 << 20) == data[:1 << 20]
            mode_file.write_text(mode)
            time.sleep(1.5)  # the URL signed for the first read is not reused
            started = time.monotonic()
            if mode == "garbage":
                with pytest.raises(PermissionError):
                    os.pread(f.fileno(), 1 << 20, 4 << 20)
                assert time.monotonic() - started < 5
            else:
                mended = threading.Timer(3.0, mode_file.write_text, ("ok",))
                mended.start()
                try:
                    assert os.pread(f.fileno(), 1 << 20, 4 << 20) == data[4 << 20:5 << 20]
                    assert time.monotonic() - started < 20
                finally:
                    mended.cancel()
        log = m.log()
        said = ("the credential_process printed no JSON object" if mode == "garbage" else
                "the credential_process exited with an error: vault agent is restarting")
        assert said in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("mode, said", [
    ("garbage", "the credential_process printed no JSON object (JSONDecodeError: Expecting value: line 1 column 1 "
                "(char 0)): check the profile's credential_process"),
    ("exit", "the credential_process exited with an error: vault agent is restarting"),
    ("gone", "No such file or directory: {script} (the profile's credential_process)"),
])
def test_a_credential_process_that_fails_at_mount_is_said_as_the_credentials_failure(
        tmp_path: Path, moto_server: S3Server, mountpoint: Path, mode: str, said: str) -> None:
    """A profile's credential_process that prints what is not JSON (a prompt for a token), exits with an error, or is
    not there, when the mount starts: botocore runs it when the first client is made, and its error went bare to the
    user: "modelfs: cannot mount: Expecting value: line 1 column 1 (char 0)", nothing naming the credentials. It is
    said as their source's failure, as a running mount says it (B331)."""
    bucket = bucket_with(moto_server, {"w.bin": b"x"})
    script, config = tmp_path / "vault-creds", tmp_path / "config"
    if mode != "gone":
        script.write_text("#!/bin/sh\n" + ("echo 'Enter your vault token:'\n" if mode == "garbage" else
                                           "echo 'vault agent is restarting' >&2\nexit 1\n"))
        script.chmod(0o755)
    config.write_text(f"[default]\ncredential_process = {script}\n")
    server = S3Server("moto", moto_server.endpoint_url,
                      {"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
                       "AWS_DEFAULT_REGION": TEST_REGION, "AWS_EC2_METADATA_DISABLED": "true"})
    res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", server.endpoint_url, env=daemon_env(server))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res
    assert res.stderr.strip().splitlines()[-1].startswith(
        f"modelfs: bucket '{bucket}': the credentials (custom-process) could not be had: "
        f"{said.format(script=script)}"), res.stderr


@pytest.mark.parametrize("get_client", ["presigned", "boto3"])
def test_a_read_whose_credential_process_hangs_at_their_refresh_is_not_held_past_the_refresh_wait(
        aws_files: Path, moto_server: S3Server, monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str],
        get_client: str) -> None:
    """A credential_process with an Expiration whose credentials are due, which hangs when botocore refreshes them
    (a vault agent that does not answer): a read's fetch thread (no deadline of its own) that ran the refresh, and
    every one behind it, waited for as long as it hung, holding the mount's fetch workers. Each is given up on
    REFRESH_WAIT_S after the refresh began, no answer in time from the credentials' source (Unreachable: the read asks
    again until --read-timeout), and reads are served again once the process answers (B357)."""
    from fsmount.data import credentials
    from fsmount.data.store import Unreachable

    monkeypatch.setattr(credentials, "REFRESH_WAIT_S", 0.5, raising=False)
    bucket = bucket_with(moto_server, {"w.bin": DATA, "x.bin": DATA})
    script, mode = aws_files / "vault-creds.py", aws_files / "mode"
    # Expiring in five minutes: within botocore's mandatory refresh window, so that each signing runs it.
    script.write_text(
        "import datetime, json, pathlib, time\n"
        f"mode = pathlib.Path({str(mode)!r})\n"
        "given_up = time.monotonic() + 8\n"
        "while mode.read_text() == 'hang' and time.monotonic() < given_up:\n"
        "    time.sleep(0.02)\n"
        "until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)\n"
        "print(json.dumps({'Version': 1, 'AccessKeyId': 'ASIAVAULT', 'SecretAccessKey': 's', 'SessionToken': 't',"
        " 'Expiration': until.strftime('%Y-%m-%dT%H:%M:%SZ')}))\n")
    mode.write_text("ok")
    (aws_files / "config").write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    store = Boto3Store(StoreConfig(bucket=bucket, endpoint_url=moto_server.endpoint_url, addressing_style="path",
                                   get_client=get_client))
    read(store)
    mode.write_text("hang")
    try:
        started = time.monotonic()
        with pytest.raises(Unreachable, match=r"credentials \(custom-process\) could not be had: no answer in time"):
            store.get_range("x.bin", "", 0, 10)  # (a key whose URL is not cached: it is signed now)
        # REFRESH_WAIT_S, and the presigned GET's own tries (failing at once) with their backoff; 8 s on the old code
        assert time.monotonic() - started < 5, time.monotonic() - started
    finally:
        mode.write_text("ok")
    for _ in range(100):
        try:
            read(store)
            break
        except Unreachable:
            time.sleep(0.05)
    else:
        raise AssertionError("reads were not served once the credential_process answered")
