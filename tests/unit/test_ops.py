"""Running modelfs as infrastructure, in-process: the systemd unit and its example configuration, the Alibaba
OSS client configuration (seen on the wire, no network), and the pyfuse3 log filter. With real daemons
(READY=1, SIGTERM, fstab, metrics, `modelfs stats`): tests/mount/test_ops_mount.py."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsmount import cli
from tests.helpers import REPO, TEST_SECRET

UNIT = REPO / "systemd" / "modelfs@.service"
EXAMPLE_CONF = REPO / "systemd" / "example.conf"
# Options that give the service a private mount namespace: the bucket would be mounted where the host
# and the inference servers cannot see it.
NAMESPACE_OPTIONS = {"PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectSystem", "ProtectHome",
                     "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                     "ProtectProc", "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem",
                     "BindPaths", "BindReadOnlyPaths", "RootDirectory", "RootImage", "DynamicUser", "MountAPIVFS"}


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; systemd allows repeated keys, so no configparser."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


# -- the systemd unit -----------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart= exists; point it at this checkout's entry point, change nothing else.
    entry = Path(sys.executable).with_name("modelfs")
    assert entry.exists(), "install the package (pip install -e .) so the modelfs entry point exists"
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/modelfs " in text
    (tmp_path / UNIT.name).write_text(text.replace("/usr/local/bin/modelfs", str(entry)))
    (tmp_path / "modelfs@models.service").symlink_to(UNIT.name)
    res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "modelfs@models.service")],
                         capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are only printed (exit status 0): any output is a failure.
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr


def test_unit_settings() -> None:
    entries = unit_entries(UNIT)
    values = {(section, key): value for section, key, value in entries}
    assert values["Service", "Type"] == "notify"
    assert values["Service", "Restart"] == "on-failure"
    assert values["Service", "RestartPreventExitStatus"] == "2"  # a config error does not restart forever
    assert values["Service", "EnvironmentFile"] == "/etc/modelfs/%i.conf"
    assert "network-online.target" in values["Unit", "After"]
    assert "network-online.target" in values["Unit", "Wants"]
    # A /dev/fuse still missing once the module was loaded is for good: exit 2, not restarted (B1082).
    assert "modprobe@fuse.service" in values["Unit", "After"].split()
    assert "modprobe@fuse.service" in values["Unit", "Wants"].split()
    exec_start = values["Service", "ExecStart"]
    assert "--foreground" in exec_start and "$MODELFS_OPTS" in exec_start
    assert values["Service", "KillMode"] == "mixed"  # SIGTERM to the daemon, which unmounts
    assert values["Service", "ExecReload"] == "/bin/kill -HUP $MAINPID"  # reopens the log; the mount stays
    # The service's UMask=0077 would make the mountpoint's new parents 0700, unreachable for its users.
    mkdir = next(v for s, k, v in entries if k == "ExecStartPre" and "mkdir" in v)
    assert "umask 022" in mkdir
    # Dead mounts are cleared by `modelfs unmount --stale`, which leaves anything but a dead modelfs mount alone and
    # fails the start at a live one (B336): with --lazy and a leading "-", a mount made by hand was detached.
    clear = [(k, v) for _, k, v in entries if k in ("ExecStartPre", "ExecStopPost") and "mkdir" not in v]
    assert clear == [("ExecStartPre", "/usr/local/bin/modelfs unmount --stale ${MOUNTPOINT}"),
                     ("ExecStopPost", "-/usr/local/bin/modelfs unmount --stale ${MOUNTPOINT}")], clear
    used = {key for _, key, _ in entries}
    assert not used & NAMESPACE_OPTIONS, f"these hide the mount from the host: {used & NAMESPACE_OPTIONS}"
    assert values["Service", "DeviceAllow"] == "/dev/fuse rw"
    assert "CAP_SYS_ADMIN" in values["Service", "CapabilityBoundingSet"]


# Calls the daemon makes that systemd's @system-service group leaves out (beside mount(2) and umount2(2)):
# mincore, which residency.py asks before a model stream runs again. Found with strace -f of a daemon taken
# through reads, a dropped page cache, writes, a metrics scrape, SIGHUP and an unmount.
CALLS_BEYOND_SYSTEM_SERVICE = {"mincore"}


def test_the_unit_lets_the_daemon_make_every_call_it_makes() -> None:
    """The unit's seccomp filter refused mincore (EPERM) and model streams that ran again fetched whole files."""
    allowed = next(v for _, k, v in unit_entries(UNIT) if k == "SystemCallFilter").split()
    assert {"@system-service", "@mount"} <= set(allowed)
    res = subprocess.run(["systemd-analyze", "syscall-filter", "@system-service", "@mount"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    in_groups = {line.strip() for line in res.stdout.splitlines() if line.startswith(" ") and "#" not in line}
    for call in CALLS_BEYOND_SYSTEM_SERVICE:
        assert call in allowed or call in in_groups, f"{call} is filtered out by the unit"


def test_example_conf_is_a_valid_mount_command() -> None:
    conf = env_file(EXAMPLE_CONF)
    assert {"BUCKET", "MOUNTPOINT", "MODELFS_OPTS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(conf)
    oss_opts = [line.split("=", 1)[1] for line in EXAMPLE_CONF.read_text().splitlines()
                if line.startswith("#MODELFS_OPTS=")]
    assert oss_opts, "the Alibaba OSS example is missing"
    for opts in [conf["MODELFS_OPTS"], *oss_opts]:
        # What ExecStart= runs: `modelfs mount ${BUCKET} ${MOUNTPOINT} --foreground $MODELFS_OPTS`.
        argv = cli.expand_mount_options(["mount", conf["BUCKET"], conf["MOUNTPOINT"], "--foreground",
                                         *opts.split()])
        args = cli.make_parser().parse_args(argv)
        cfg = cli.build_config(args)
        assert cfg.foreground and cfg.store.bucket == conf["BUCKET"]
    assert "AWS_" not in conf["MODELFS_OPTS"] and "SECRET" not in conf["MODELFS_OPTS"]


# -- Alibaba OSS: the boto3 client modelfs builds, seen on the wire (no network) ----------------------

class _Body(io.BytesIO):
    def stream(self, **_: object) -> Iterator[bytes]:
        yield self.getvalue()


LIST_XML = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
            b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>my-models</Name><Prefix></Prefix>'
            b"<KeyCount>0</KeyCount><MaxKeys>1</MaxKeys><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated>"
            b"</ListBucketResult>")


class _WireConnection:
    """Stands in for http.client's connection in fsmount.data.presigned: records the GET it is sent and
    answers it like OSS would (206, the range, the ETag)."""

    sent: list[tuple[str, int, str, dict[str, str]]] = []

    def __init__(self, host: str, port: int, **_: object):
        self.host, self.port, self.sock = host, port, None

    def open(self, until: float, resolve: object) -> None:  # presigned._Connection.open: no name looked up here
        self.sock = _Socket()

    def putrequest(self, method: str, target: str, **_: object) -> None:
        assert method == "GET"
        self.sent.append((self.host, self.port, target, {}))

    def putheader(self, name: str, value: str) -> None:
        self.sent[-1][3][name] = value

    def endheaders(self) -> None:
        pass

    def getresponse(self) -> _WireResponse:
        return _WireResponse()

    def close(self) -> None:
        self.sock = None


class _Socket:
    def settimeout(self, seconds: float) -> None:
        pass

    def gettimeout(self) -> float | None:
        return None


class _WireResponse:
    status, will_close = 206, False
    _headers = {"Content-Length": "4", "ETag": '"e1"', "Content-Range": "bytes 0-3/10"}

    def __init__(self) -> None:
        self._body = io.BytesIO(b"SAFE")

    def getheader(self, name: str) -> str | None:
        return self._headers.get(name)

    def readinto(self, buffer: memoryview) -> int:
        return self._body.readinto(buffer)

    def read(self, n: int) -> bytes:
        return self._body.read(n)


def oss_requests(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple:
    """Build the store exactly as `modelfs mount` does and record what it would send: the listing (a
    botocore request) and the ranged GET (a botocore request, or with presigned GETs the URL and headers
    http.client was given)."""
    from botocore.awsrequest import AWSResponse

    from fsmount.data import Boto3Store, presigned

    cfg = cli.build_config(cli.make_parser().parse_args(cli.expand_mount_options(argv)))
    store = Boto3Store(cfg.store)
    sent = []
    _WireConnection.sent = []
    monkeypatch.setattr(presigned, "_TLSConnection", _WireConnection)

    def answer(request, **_: object) -> AWSResponse:  # noqa: ANN001 - botocore's AWSPreparedRequest
        sent.append(request)
        if request.method == "GET" and "list-type=2" in request.url:
            return AWSResponse(request.url, 200, {"Content-Type": "application/xml"}, _Body(LIST_XML))
        return AWSResponse(request.url, 206, {"Content-Length": "4", "ETag": '"e1"',
                                              "Content-Range": "bytes 0-3/10"}, _Body(b"SAFE"))

    # botocore's documented hook: a handler of before-send that returns a response short-circuits HTTP.
    store._client.meta.events.register("before-send.s3", answer)
    store.check_bucket("")
    assert bytes(store.get_range("llama/model-00001.safetensors", '"e1"', 0, 4)) == b"SAFE"
    if cfg.store.get_client == "boto3":
        listing, get = sent
        url, headers = get.url, {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in get.headers.items()}
    else:
        (listing,), ((host, port, target, headers),) = sent, _WireConnection.sent
        assert port == 443
        url, headers = f"https://{host}{target}", {k.lower(): v for k, v in headers.items()}
    return listing, url, headers


@pytest.fixture
def clean_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    return tmp_path


OSS_ARGV = ["mount", "my-models", "/models", "--endpoint-url", "https://oss-cn-hangzhou.aliyuncs.com",
            "--region", "cn-hangzhou", "--addressing-style", "virtual"]


def check_oss_url(url_text: str) -> urllib.parse.SplitResult:
    url = urllib.parse.urlsplit(url_text)
    assert url.scheme == "https"
    assert url.hostname == "my-models.oss-cn-hangzhou.aliyuncs.com"  # virtual-hosted style
    assert not url.path.startswith("/my-models")
    return url


def check_oss_signature(listing, url: str, headers: dict[str, str], access_key: str, secret: str) -> None:  # noqa: ANN001
    """SigV4 for the region, on the listing (Authorization header) and on the GET (the header, or the
    presigned URL's query), and the secret nowhere."""
    check_oss_url(listing.url)
    auth = listing.headers["Authorization"]
    auth = auth.decode() if isinstance(auth, bytes) else auth
    assert auth.startswith(f"AWS4-HMAC-SHA256 Credential={access_key}/")
    assert "/cn-hangzhou/s3/aws4_request" in auth
    assert "x-amz-date" in {k.lower() for k in listing.headers}
    assert secret not in listing.url and secret not in str(listing.headers)
    query = dict(urllib.parse.parse_qsl(check_oss_url(url).query))
    if "authorization" in headers:
        assert headers["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={access_key}/")
        assert "/cn-hangzhou/s3/aws4_request" in headers["authorization"]
    else:
        assert query["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
        assert query["X-Amz-Credential"].startswith(f"{access_key}/")
        assert query["X-Amz-Credential"].endswith("/cn-hangzhou/s3/aws4_request")
        assert query["X-Amz-Signature"]
    assert secret not in url and secret not in str(headers)
    assert urllib.parse.urlsplit(url).path.endswith("/llama/model-00001.safetensors")
    assert headers["range"] == "bytes=0-3" and headers["if-match"] == '"e1"'


@pytest.mark.parametrize("get_client", ["presigned", "boto3"])
def test_oss_virtual_host_sigv4_with_env_credentials(clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                     get_client: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "LTAI5tEnvKey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    listing, url, headers = oss_requests([*OSS_ARGV, "--get-client", get_client], monkeypatch)
    assert listing.method == "GET" and "list-type=2" in listing.url
    check_oss_signature(listing, url, headers, "LTAI5tEnvKey", TEST_SECRET)


@pytest.mark.parametrize("get_client", ["presigned", "boto3"])
def test_oss_virtual_host_sigv4_with_a_profile(clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch,
                                               get_client: str) -> None:
    (clean_aws_env / "no-credentials").write_text(
        f"[oss]\naws_access_key_id = LTAI5tProfileKey\naws_secret_access_key = {TEST_SECRET}\n")
    listing, url, headers = oss_requests([*OSS_ARGV, "--profile", "oss", "--get-client", get_client], monkeypatch)
    check_oss_signature(listing, url, headers, "LTAI5tProfileKey", TEST_SECRET)


@pytest.mark.parametrize("endpoint", ["https://oss-cn-hangzhou-internal.aliyuncs.com",
                                      "https://s3.us-east-1.amazonaws.com"])
def test_only_a_no_such_upload_answer_says_the_upload_was_aborted(clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  endpoint: str) -> None:
    """B882's message is for NoSuchUpload (S3's and OSS's code for an upload aborted) on a part, a copied part, a
    completion; a NoSuchKey (a copied part's source gone) or a NoSuchBucket is not told as an aborted upload. An abort
    of an upload already gone is done, as before."""
    from botocore.awsrequest import AWSResponse

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store, NotFound, StoreError
    from fsmount.data.uploads import UPLOAD_GONE, Uploads

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "LTAI5tEnvKey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    store = Boto3Store(StoreConfig("tier", endpoint_url=endpoint, region="cn-hangzhou", addressing_style="virtual",
                                   get_client="boto3"))
    code = "NoSuchUpload"

    def answer(request, **_: object) -> AWSResponse:  # noqa: ANN001 - botocore's AWSPreparedRequest
        body = f"<Error><Code>{code}</Code><Message>gone</Message></Error>".encode()
        return AWSResponse(request.url, 404, {"Content-Type": "application/xml"}, _Body(body))

    store._client.meta.events.register("before-send.s3", answer)
    uploads = Uploads(store)
    calls = (lambda: uploads.put_part("ckpt.bin", "u1", 2, b"x"),
             lambda: uploads.copy_part("ckpt.bin", "u1", 2, "old.bin", '"e1"', 0, 1),
             lambda: uploads.finish("ckpt.bin", "u1", ['"p1"']))
    for call in calls:
        with pytest.raises(NotFound) as info:
            call()
        assert UPLOAD_GONE in info.value.message
    uploads.abort("ckpt.bin", "u1")
    for code in ("NoSuchKey", "NoSuchBucket"):
        for call in calls:
            with pytest.raises(StoreError) as other:
                call()
            assert "NoSuchUpload" not in other.value.message and "aborted" not in other.value.message, code


@pytest.mark.parametrize("endpoint, oss", [("https://oss-cn-hangzhou-internal.aliyuncs.com", True),
                                           ("https://s3.us-east-1.amazonaws.com", False)])
def test_a_create_only_put_says_it_in_the_endpoints_own_words(clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                               endpoint: str, oss: bool) -> None:
    """The shared tier's claims and a writable mount's create-only PUT and completion: OSS gets
    x-oss-forbid-overwrite (signed), other endpoints If-None-Match: *; the key already there (OSS: 409
    FileAlreadyExists; S3: 412) is a False or `Exists`, not another error. A plain PUT stays plain."""
    from botocore.awsrequest import AWSResponse

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store
    from fsmount.data.uploads import Exists, Uploads

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "LTAI5tEnvKey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    # get_client boto3: the plain PUT goes through botocore too (by default it is presigned).
    store = Boto3Store(StoreConfig("tier", endpoint_url=endpoint, region="cn-hangzhou", addressing_style="virtual",
                                   get_client="boto3"))
    sent: list[dict[str, str]] = []
    exists = False

    def answer(request, **_: object) -> AWSResponse:  # noqa: ANN001 - botocore's AWSPreparedRequest
        sent.append({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})
        if not exists:
            return AWSResponse(request.url, 200, {"ETag": '"e1"'}, _Body(b""))
        status, code = (409, "FileAlreadyExists") if oss else (412, "PreconditionFailed")
        return AWSResponse(request.url, status, {}, _Body(f"<Error><Code>{code}</Code></Error>".encode()))

    def create_only(headers: dict[str, str]) -> None:
        if oss:
            assert headers["x-oss-forbid-overwrite"] == "true" and "if-none-match" not in headers
            assert "x-oss-forbid-overwrite" in headers["authorization"].split("SignedHeaders=")[1].split(",")[0]
        else:
            assert headers["if-none-match"] == "*" and "x-oss-forbid-overwrite" not in headers

    store._client.meta.events.register("before-send.s3", answer)
    assert store.put_object("claims/c1", b"claim", only_if_absent=True) is True
    store.put_object("chunks/c1", b"data")
    exists = True
    assert store.put_object("claims/c1", b"claim", only_if_absent=True) is False
    with pytest.raises(Exists):
        Uploads(store).put("ckpt.bin", b"x", True)
    with pytest.raises(Exists):
        Uploads(store).finish("ckpt.bin", "upload-1", ['"p1"'], True)
    claim, plain, *more = sent
    for headers in (claim, *more):
        create_only(headers)
    assert "if-none-match" not in plain and "x-oss-forbid-overwrite" not in plain


@pytest.mark.parametrize(("status", "code", "held", "stored_plain"), [
    (412, "PreconditionFailed", '"opened"', True),  # the key holds the version opened: the server refuses its ETag
    (412, "PreconditionFailed", '"theirs"', False),  # another writer's object
    (409, "ConditionalRequestConflict", '"opened"', False),  # another write to the key under way (S3)
    (404, "NoSuchKey", None, False),  # deleted meanwhile (S3, moto)
])
def test_a_store_if_match_refused_is_stored_plain_only_where_the_key_holds_the_version_opened(
        clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str], status: int, code: str,
        held: str | None, stored_plain: bool) -> None:
    """A rewrite that keeps the version it opened is stored If-Match on it (B308): 412, 409 or NoSuchKey is
    `Replaced` (the close EIO), except a 412 while a HEAD finds the version opened, which is a server refusing its
    own ETag: the store goes plain. A 409 (a conditional write of another writer under way) is never taken so, whatever
    the HEAD finds."""
    from botocore.awsrequest import AWSResponse

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store
    from fsmount.data.uploads import Replaced, Uploads

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    store = Boto3Store(StoreConfig("b", endpoint_url="https://s3.us-east-1.amazonaws.com", region="us-east-1",
                                   get_client="boto3"))
    sent: list[tuple[str, str | None]] = []

    def answer(request, **_: object) -> AWSResponse:  # noqa: ANN001 - botocore's AWSPreparedRequest
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        sent.append((request.method, headers.get("if-match")))
        if request.method == "HEAD":
            if held is None:
                return AWSResponse(request.url, 404, {}, _Body(b""))
            return AWSResponse(request.url, 200, {"ETag": held, "Content-Length": "0"}, _Body(b""))
        if headers.get("if-match"):
            return AWSResponse(request.url, status, {}, _Body(f"<Error><Code>{code}</Code></Error>".encode()))
        return AWSResponse(request.url, 200, {"ETag": '"mine"'}, _Body(b""))

    store._client.meta.events.register("before-send.s3", answer)
    uploads = Uploads(store)
    allowed_logs.append("refused a store with If-Match")
    if stored_plain:
        assert uploads.put("log", b"mine", False, True, '"opened"') == '"mine"'
        assert not uploads.if_match_refused  # that store alone (B372)
        assert sent[-1] == ("PUT", None)
    else:
        with pytest.raises(Replaced):
            uploads.put("log", b"mine", False, True, '"opened"')
        assert not uploads.if_match_refused
        assert [m for m, if_match in sent if m == "PUT" and if_match is None] == []


def test_a_store_if_match_on_an_etag_the_server_refuses_goes_plain_for_that_store_alone(
        clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """A 412 to a rewrite's If-Match while a HEAD finds the key holding the version opened is the server refusing its
    own ETag: that store goes plain (B308). It was taken as the server refusing If-Match, for the mount: every later
    rewrite went plain, and one whose key another writer had stored since replaced it unchecked, though such a refusal
    may be of some objects alone (seaweedfs#7274). The next store sends If-Match again (B372)."""
    from botocore.awsrequest import AWSResponse

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store
    from fsmount.data.uploads import Replaced, Uploads

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    store = Boto3Store(StoreConfig("b", endpoint_url="https://s3.us-east-1.amazonaws.com", region="us-east-1",
                                   get_client="boto3"))
    held = {"old.log": '"opened"', "new.log": '"theirs"'}  # new.log: another writer stored it since its open
    sent: list[tuple[str, str, str | None]] = []

    def answer(request, **_: object) -> AWSResponse:  # noqa: ANN001 - botocore's AWSPreparedRequest
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        key = request.url.split("?")[0].rsplit("/", 1)[-1]
        sent.append((request.method, key, headers.get("if-match")))
        if request.method == "HEAD":
            return AWSResponse(request.url, 200, {"ETag": held[key], "Content-Length": "0"}, _Body(b""))
        if headers.get("if-match"):  # old.log: refused though it holds that ETag; new.log: another version there
            return AWSResponse(request.url, 412, {}, _Body(b"<Error><Code>PreconditionFailed</Code></Error>"))
        return AWSResponse(request.url, 200, {"ETag": '"mine"'}, _Body(b""))

    store._client.meta.events.register("before-send.s3", answer)
    uploads = Uploads(store)
    allowed_logs.append("refused a store with If-Match")
    assert uploads.put("old.log", b"mine", False, True, '"opened"') == '"mine"'
    assert sent[-1] == ("PUT", "old.log", None)
    with pytest.raises(Replaced):
        uploads.put("new.log", b"mine", False, True, '"opened"')
    assert [s for s in sent if s[1] == "new.log"] == [("PUT", "new.log", '"opened"'), ("HEAD", "new.log", None)]


def test_oss_claims_stay_with_botocore_when_bytes_go_presigned(clean_aws_env: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Elsewhere a claim is a presigned PUT with If-None-Match (test_presigned.py); OSS's create-only header
    is x-oss-*, which the URL would have to sign, so on OSS the claim goes through botocore, signed."""
    from botocore.awsrequest import AWSResponse

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "LTAI5tEnvKey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    store = Boto3Store(StoreConfig("tier", endpoint_url="https://oss-cn-hangzhou-internal.aliyuncs.com",
                                   region="cn-hangzhou", addressing_style="virtual"))
    assert store._ranges is not None  # the bytes of GETs and plain PUTs go presigned
    sent: list[dict[str, str]] = []

    def answer(request, **_: object) -> AWSResponse:  # noqa: ANN001 - botocore's AWSPreparedRequest
        sent.append({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})
        return AWSResponse(request.url, 200, {"ETag": '"e1"'}, _Body(b""))

    store._client.meta.events.register("before-send.s3", answer)
    assert store.put_object("claims/c1", b"claim", only_if_absent=True) is True
    assert len(sent) == 1 and sent[0]["x-oss-forbid-overwrite"] == "true"
    assert "x-oss-forbid-overwrite" in sent[0]["authorization"].split("SignedHeaders=")[1].split(",")[0]


def test_only_a_reply_to_a_dropped_request_is_downgraded_from_error() -> None:
    import logging

    from fsmount.mount import DroppedRequestReply

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("pyfuse3", logging.ERROR, __file__, 1, message, None, None)

    for message in ("fuse_release(): fuse_reply_* failed with No such file or directory",
                    "fuse_releasedir(): fuse_reply_* failed with No such file or directory",
                    "fuse_read(): fuse_reply_* failed with No such file or directory"):
        dropped = record(message)
        DroppedRequestReply().filter(dropped)
        assert dropped.levelno == logging.DEBUG, message
    for message in ("fuse_read(): fuse_reply_* failed with Broken pipe",
                    "fuse_release(): fuse_reply_* failed with Invalid argument",
                    "No such file or directory"):
        other = record(message)
        assert DroppedRequestReply().filter(other) and other.levelno == logging.ERROR, message


def stop_worst_s() -> float:
    """Every bound of a stop, in the order a SIGTERM runs them: pushes while the loop answers (_watch_signals),
    requests in flight, calls into the session still under way, before and after an abort for them, pushes still
    copying once it stopped and once the connection was aborted for them (serve), then the drains."""
    from fsmount import mount, operations, writes

    return (mount.PUSH_STOP_S + max(mount.STOP_GRACE_S, mount.STOP_GRACE_WRITING_S) + 2 * operations.SESSION_CALLS_S
            + mount.PUSH_STOP_S
            + mount.PUSH_ABORT_S + mount.MARK_DRAINING_S + writes.ABORT_ALL_S + writes.CACHE_FILL_S
            + mount.WRITE_DRAIN_S + mount.CLAIM_DROP_S + mount.NAMES_SAVE_S)


def test_the_units_stop_timeout_covers_every_bound_of_a_stop() -> None:
    """systemd SIGKILLs a daemon still stopping at TimeoutStopSec, which leaves a dead mount. Every step of a stop
    is bounded; together they came to 110 s with --writable, --cache-dir and a shared tier, against 60 s. And this
    sum left out three of them (B115): the pushes' second wait once the loop has stopped, the cache dir marked
    draining, and the names written to it: 121 s, against 120 s. A push still waiting then gets the connection
    aborted and PUSH_ABORT_S more (B116); calls into the session from worker threads, SESSION_CALLS_S before and after
    an abort for them (B124)."""
    timeout = next(value for section, key, value in unit_entries(UNIT) if key == "TimeoutStopSec")
    assert timeout.endswith("s")
    worst = stop_worst_s()
    assert float(timeout[:-1]) >= worst + 5, (timeout, worst)


@pytest.mark.parametrize("endpoint, longest", [("https://oss-cn-hangzhou-internal.aliyuncs.com", 1023),
                                               ("https://s3.us-east-1.amazonaws.com", 1024)])
def test_a_writable_mount_refuses_at_its_create_a_key_longer_than_its_store_takes(
        clean_aws_env: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str, longest: int) -> None:
    """OSS's longest key is 1023 bytes, S3's 1024: a key of exactly 1024 bytes passed the create's check on OSS and
    failed at its store, EIO at a write or the close, which safetensors' `save_file` drops (B551)."""
    import errno

    from fsmount.config import StoreConfig
    from fsmount.data import Boto3Store
    from fsmount.namespace import ROOT_INODE, PathError
    from fsmount.tree_changes import WritableNamespace

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "LTAI5tEnvKey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    store = Boto3Store(StoreConfig("b", endpoint_url=endpoint, region="cn-hangzhou", addressing_style="virtual"))
    assert store.max_key_bytes == longest

    async def call(fn, *args):  # noqa: ANN001, ANN202 - asks nothing of the bucket here
        raise AssertionError(fn)

    prefix = "r" * (longest - 10) + "/"  # a deep run directory: a name of 9 bytes makes the longest key
    ns = WritableNamespace(store, call, prefix=prefix, ttl=60.0, max_key_bytes=store.max_key_bytes)
    root = ns.node(ROOT_INODE)
    assert ns.child_path(root, b"f" * 9) == "f" * 9
    with pytest.raises(PathError) as info:
        ns.child_path(root, b"f" * 10)
    assert info.value.errno == errno.ENAMETOOLONG


def test_a_writable_daemon_s_namespace_takes_its_store_s_longest_key(clean_aws_env: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon gives its `WritableNamespace` the store's limit (`Boto3Store.max_key_bytes`), not S3's: on OSS a
    key of 1024 bytes is refused at its create (B551; the wiring, which the test above does by hand)."""
    from fsmount import mount
    from fsmount.config import MountConfig, StoreConfig

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "LTAI5tEnvKey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    cfg = MountConfig(store=StoreConfig("b", endpoint_url="https://oss-cn-hangzhou.aliyuncs.com", region="cn-hangzhou",
                                        addressing_style="virtual"), mountpoint="/m", writable=True)
    daemon = mount.Daemon(cfg, "/m", on_ready=lambda: None)
    assert daemon.namespace._max_key_bytes == 1023  # type: ignore[attr-defined]
