"""credentials.Renewable on its own: when it looks the credentials up again, what it says, what it keeps."""

from __future__ import annotations

import logging

import pytest
from botocore.credentials import Credentials

from fsmount.data import credentials
from fsmount.data.credentials import Renewable


def test_a_renewal_looks_up_at_most_once_per_recheck_and_tells_requests_signed_before_it(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str], caplog: pytest.LogCaptureFixture) -> None:
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(shared-credentials-file\)")
    now = [100.0]
    monkeypatch.setattr(credentials.time, "monotonic", lambda: now[0])
    answers = [Credentials("OLD", "old-secret", method="shared-credentials-file"),
               Credentials("NEW", "new-secret", method="shared-credentials-file")]
    lookups: list[int] = []

    def resolve() -> Credentials:
        lookups.append(1)
        return answers[min(len(lookups), len(answers)) - 1]

    renewable = Renewable(answers[0], resolve, recheck_s=30)
    assert not renewable.renew("ExpiredToken")  # the same credentials: nothing to gain in sending again
    assert len(lookups) == 1 and renewable.access_key == "OLD"
    now[0] += 10
    assert not renewable.renew("ExpiredToken") and len(lookups) == 1  # within the recheck: no lookup
    now[0] += 25
    assert renewable.renew("ExpiredToken") and len(lookups) == 2
    frozen = renewable.get_frozen_credentials()
    assert (frozen.access_key, frozen.secret_key, renewable.method) == ("NEW", "new-secret", "shared-credentials-file")
    now[0] += 5
    # A request signed with the old key before the renewal, refused after it: it deserves its second try.
    assert renewable.renew("ExpiredToken") and len(lookups) == 2
    now[0] += 60
    assert not renewable.renew("ExpiredToken") and len(lookups) == 3
    said = [r.getMessage() for r in caplog.records if r.name == "fsmount.data.credentials"]
    assert len(said) == 1 and not any(s in said[0] for s in ("old-secret", "new-secret", "OLD", "NEW"))


def test_a_lookup_that_fails_keeps_the_credentials_and_says_why(allowed_logs: list[str]) -> None:
    allowed_logs.append(r"requests were refused \(403\); looking the credentials up again failed: OSError: gone")

    def resolve() -> Credentials:
        raise OSError("gone")

    renewable = Renewable(Credentials("OLD", "s", method="env"), resolve)
    assert not renewable.renew("403")
    assert renewable.access_key == "OLD" and renewable.token is None and renewable.account_id is None


def test_a_lookup_whose_credentials_fail_when_fetched_keeps_the_old_ones_and_says_why(
        allowed_logs: list[str]) -> None:
    """A role assumed through a profile (`role_arn`), SSO and web identity give credentials fetched when first
    used (botocore's DeferredRefreshableCredentials): their STS call, not the lookup, fails (STS unreachable, an MFA
    prompt with no terminal). It raised out of `renew`, through botocore's needs-retry hook, out of the request
    that was refused: an S3 read or HEAD failed as if the bucket's endpoint were unreachable (STS's error, taken for
    the bucket's), where the lookup's failure is to be said and the refusal kept."""
    from botocore.credentials import DeferredRefreshableCredentials

    allowed_logs.append(r"requests were refused \(ExpiredToken\); looking the credentials up again failed: "
                        r"OSError: sts unreachable")

    def fetch() -> dict[str, str]:
        raise OSError("sts unreachable")

    renewable = Renewable(Credentials("OLD", "s", method="assume-role"),
                          lambda: DeferredRefreshableCredentials(fetch, "assume-role"))
    assert not renewable.renew("ExpiredToken")
    assert renewable.access_key == "OLD"


def test_credentials_that_cannot_be_had_any_more_are_replaced_by_a_lookup_that_gives_some(
        allowed_logs: list[str]) -> None:
    """The credentials signed with fail when asked for again (a refresh that fails) while a lookup gives new ones:
    those are signed with from then on, not the failure raised out of `renew`."""
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(env\) have changed")

    class Failing(Credentials):  # type: ignore[misc]
        def get_frozen_credentials(self) -> None:
            raise OSError("refresh failed")

    renewable = Renewable(Failing("OLD", "s", method="env"), lambda: Credentials("NEW", "s2", method="env"))
    assert renewable.renew("ExpiredToken")
    assert renewable.access_key == "NEW"


def test_credentials_whose_refresh_fails_are_looked_up_again_when_signing(allowed_logs: list[str]) -> None:
    """A role assumed through a profile whose source key was rotated in the file and revoked: botocore refreshes
    the role's credentials with the source key it read at start, STS refuses it, and past their expiry every
    signing raised that refusal. No request was sent, so no refusal of the bucket looked the credentials up again:
    the mount refused everything until restarted. Signing now looks them up again (at most once per recheck)."""
    import datetime

    from botocore.credentials import RefreshableCredentials

    allowed_logs.append(r"the credentials' refresh failed \(OSError\) and the credentials \(assume-role\) have "
                        r"changed")
    lookups: list[int] = []

    def refuse() -> dict[str, str]:
        raise OSError("InvalidClientTokenId")

    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)
    expired = RefreshableCredentials("OLD", "s", "t", past, refuse, "assume-role")

    def resolve() -> Credentials:
        lookups.append(1)
        return Credentials("NEW", "s2", "t2", method="assume-role")

    renewable = Renewable(expired, resolve)
    assert renewable.get_frozen_credentials().access_key == "NEW" and len(lookups) == 1
    assert renewable.access_key == "NEW" and len(lookups) == 1


def minting_anew() -> tuple[Renewable, list[int]]:
    """Credentials of a source that mints new keys at each lookup (an assumed role): ASIA0, then ASIA1, ASIA2...; and
    the list its lookups are counted in."""
    lookups: list[int] = []

    def resolve() -> Credentials:
        lookups.append(1)
        return Credentials(f"ASIA{len(lookups)}", "s", "t", method="assume-role")

    return Renewable(Credentials("ASIA0", "s", "t", method="assume-role"), resolve, recheck_s=30), lookups


def test_a_policy_s_refusal_of_credentials_minted_anew_at_each_lookup_looks_them_up_no_more(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """A source that mints new keys at each lookup (an assumed role, SSO, a credential_process giving new session
    keys each run) looks changed at every lookup: a bucket policy's AccessDenied cost a lookup (an STS call), a "have
    changed" warning and a second request every RECHECK_S, for good. Once the credentials a renewal changed are
    refused again for such a code, such codes look nothing up; a code that names the credentials still does."""
    allowed_logs.extend([r"requests were refused \((AccessDenied|ExpiredToken)\) and the credentials \(assume-role\)",
                         r"refused again \(AccessDenied\): the bucket refuses them for a reason of its own"])
    now = [100.0]
    monkeypatch.setattr(credentials.time, "monotonic", lambda: now[0])
    renewable, lookups = minting_anew()
    assert renewable.renew("AccessDenied") and len(lookups) == 1  # minted anew: it looks changed
    renewable.refused_again("AccessDenied")  # and the request sent again with them is refused too
    for _ in range(5):
        now[0] += 31
        assert not renewable.renew("AccessDenied") and not renewable.renew("403") and not renewable.renew("400")
    assert len(lookups) == 1 and renewable.access_key == "ASIA1"
    assert renewable.renew("ExpiredToken") and len(lookups) == 2  # a code that names the credentials
    now[0] += 31
    assert renewable.renew("AccessDenied") and len(lookups) == 3  # they changed since: one more look
    said = [r.getMessage() for r in caplog.records if r.name == "fsmount.data.credentials"]
    assert len([s for s in said if "have changed" in s]) == 3 and len([s for s in said if "own" in s]) == 1


def test_a_policy_s_refusals_look_minted_credentials_up_again_after_a_while_so_a_revoked_session_is_replaced(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """Once a policy's refusal of credentials minted at each lookup was found the bucket's own (B108), AccessDenied
    and a HEAD's bare 403 looked nothing up for the life of the mount: an assumed role's sessions revoked in IAM
    (every request AccessDenied; a new session would be taken) were refused until botocore's own refresh, or for
    good for a credential_process without an expiry. Such refusals look them up once per POLICY_RECHECK_S, the
    repeated words at INFO."""
    import logging

    allowed_logs.extend([r"requests were refused \(AccessDenied\) and the credentials \(assume-role\)",
                         r"refused again \(AccessDenied\): the bucket refuses them for a reason of its own"])
    caplog.set_level(logging.INFO, logger="fsmount.data.credentials")
    monkeypatch.setattr(credentials, "POLICY_RECHECK_S", 300.0, raising=False)
    now = [100.0]
    monkeypatch.setattr(credentials.time, "monotonic", lambda: now[0])
    renewable, lookups = minting_anew()
    assert renewable.renew("AccessDenied")
    renewable.refused_again("AccessDenied")  # the bucket's own
    while now[0] + 31 < 100 + 300:
        now[0] += 31
        assert not renewable.renew("AccessDenied") and not renewable.renew("403")
    assert len(lookups) == 1  # B108's saving kept
    now[0] += 31
    assert renewable.renew("403") and len(lookups) == 2 and renewable.access_key == "ASIA2"  # a new session
    renewable.refused_again("AccessDenied")  # a policy still: looked up seldom again, said at INFO this time
    now[0] += 31
    assert not renewable.renew("AccessDenied") and len(lookups) == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "fsmount.data.credentials"
              and r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned


def test_a_request_refused_again_for_a_code_naming_the_credentials_keeps_them_looked_up(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """Credentials a renewal changed that are refused again as expired (a file rewritten with keys that are stale
    too) say nothing of a policy: the next refusal past RECHECK_S looks them up again."""
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(env\) have changed")
    now = [100.0]
    monkeypatch.setattr(credentials.time, "monotonic", lambda: now[0])
    lookups: list[int] = []

    def resolve() -> Credentials:
        lookups.append(1)
        return Credentials(f"K{len(lookups)}", "s", method="env")

    renewable = Renewable(Credentials("K0", "s", method="env"), resolve, recheck_s=30)
    assert renewable.renew("ExpiredToken")
    renewable.refused_again("ExpiredToken")
    now[0] += 31
    assert renewable.renew("ExpiredToken") and renewable.access_key == "K2"


def test_a_lookup_that_hangs_is_given_up_on_and_no_other_starts_until_it_ends(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """A credential_process that hangs (a vault agent down) held `renew` for good, under its lock: the thread
    refused first and every other one refused after it (metadata requests, writes: given up on by their deadline,
    never ended, their slots kept) waited forever, until every later stat or close timed out. A lookup is waited
    for at most LOOKUP_TIMEOUT_S now, and none other starts while it still runs; once it ends, lookups go on."""
    import threading

    allowed_logs.append(r"requests were refused \(ExpiredToken\); looking the credentials up again took more than "
                        r"0\.2 s \(a credential_process that hangs\?")
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(env\) have changed")
    monkeypatch.setattr(credentials, "LOOKUP_TIMEOUT_S", 0.2, raising=False)
    hang = threading.Event()
    lookups: list[int] = []

    def resolve() -> Credentials:
        lookups.append(1)
        if len(lookups) == 1:
            hang.wait(30)
        return Credentials(f"K{len(lookups)}", "s", method="env")

    renewable = Renewable(Credentials("K0", "s", method="env"), resolve, recheck_s=0)
    answers: list[bool] = []
    callers = [threading.Thread(target=lambda: answers.append(renewable.renew("ExpiredToken")), daemon=True)
               for _ in range(3)]
    try:
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(5)
        assert not any(c.is_alive() for c in callers) and answers == [False, False, False]
        assert len(lookups) == 1 and renewable.access_key == "K0"  # no second lookup beside the hung one
    finally:
        hang.set()
    renewable._lookup[0].join(5)  # type: ignore[index]
    # The lookup given up on has ended: its result, not a new lookup.
    assert renewable.renew("ExpiredToken") and renewable.access_key == "K1" and len(lookups) == 1
    assert renewable.renew("ExpiredToken") and renewable.access_key == "K2"  # then lookups go on


def test_a_source_whose_lookup_always_outlasts_the_timeout_is_renewed_by_the_lookup_given_up_on(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """A source whose every lookup takes longer than LOOKUP_TIMEOUT_S (a credential_process asking a slow vault):
    each lookup was given up on, its result thrown away when it came, and the next renewal past the recheck started
    another that was given up on too: a key rotated there was never picked up (before B111 it was, late). The next
    renewal after a lookup given up on has ended takes that lookup's result."""
    import threading
    import time

    allowed_logs.append(r"requests were refused \(ExpiredToken\); looking the credentials up again took more than "
                        r"0\.2 s")
    allowed_logs.append(r"requests were refused \(ExpiredToken\) and the credentials \(env\) have changed")
    monkeypatch.setattr(credentials, "LOOKUP_TIMEOUT_S", 0.2, raising=False)
    lookups: list[int] = []

    def resolve() -> Credentials:
        lookups.append(1)
        time.sleep(0.5)
        return Credentials("NEW", "s", method="env")

    renewable = Renewable(Credentials("OLD", "s", method="env"), resolve, recheck_s=0)
    assert not renewable.renew("ExpiredToken") and renewable.access_key == "OLD"  # given up on
    deadline = time.monotonic() + 5
    while any(t.name == "credentials-lookup" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert renewable.renew("ExpiredToken") and renewable.access_key == "NEW" and len(lookups) == 1


def sts_refusal(code: str, status: int, operation: str = "AssumeRoleWithWebIdentity") -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": f"{code} said STS"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, operation)


@pytest.mark.parametrize("cause, kind, said", [
    (sts_refusal("AccessDenied", 403), "CredentialsFailed",
     "AssumeRoleWithWebIdentity answered AccessDenied (AccessDenied said STS): check the role (AWS_ROLE_ARN"),
    (sts_refusal("AccessDenied", 403, "AssumeRole"), "CredentialsFailed",
     "AssumeRole answered AccessDenied (AccessDenied said STS): check the profile's role_arn"),
    (sts_refusal("InternalFailure", 500), "Unreachable", "AssumeRoleWithWebIdentity answered InternalFailure"),
    (sts_refusal("Throttling", 400), "Unreachable", "AssumeRoleWithWebIdentity answered Throttling"),
    (sts_refusal("IDPCommunicationError", 400), "Unreachable",
     "AssumeRoleWithWebIdentity answered IDPCommunicationError"),
    (FileNotFoundError(2, "No such file or directory", "/var/run/token"), "CredentialsFailed",
     "No such file or directory: /var/run/token (AWS_WEB_IDENTITY_TOKEN_FILE"),
])
def test_credentials_that_cannot_be_had_are_said_as_their_source_s_failure_not_the_bucket_s(
        allowed_logs: list[str], cause: Exception, kind: str, said: str) -> None:
    """A web identity's role STS will not give, or its token file missing: the signing raised STS's refusal (or the
    OSError) as it came, which the store's one mapping took for the bucket's: "access denied to bucket ... check
    credentials" (and at mount "a mount needs s3:ListBucket"), or a TransientError retried as a listing cut on the
    way. It is said as the credentials' failure, by their source (B280)."""
    from botocore.credentials import DeferredRefreshableCredentials

    from fsmount.data import store
    from fsmount.data.boto3_store import translate_error

    allowed_logs.append(r"the credentials' refresh failed \(\w+\); looking the credentials up again failed")

    def fetch() -> dict[str, str]:
        raise cause

    renewable = Renewable(DeferredRefreshableCredentials(fetch, "assume-role-with-web-identity"),
                          lambda: DeferredRefreshableCredentials(fetch, "assume-role-with-web-identity"))
    with pytest.raises(credentials.Unavailable) as caught:
        renewable.get_frozen_credentials()
    err = translate_error(caught.value, "b", "listing bucket 'b'")
    assert type(err) is getattr(store, kind)
    assert err.message.startswith("listing bucket 'b': the credentials (assume-role-with-web-identity) could not be "
                                  "had: " + said), err.message
    assert "bucket 'b' (" not in err.message and "s3:ListBucket" not in err.message


def test_the_expiry_of_the_credentials_signing_is_said_where_their_source_has_one() -> None:
    """What keeps a presigned URL from being reused past the session credentials it was signed with (B281)."""
    import datetime

    from botocore.credentials import DeferredRefreshableCredentials, RefreshableCredentials

    until = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(hours=1)
    temporary = RefreshableCredentials("ASIA", "s", "t", until, lambda: {}, "assume-role-with-web-identity")
    assert Renewable(temporary, lambda: None).expiry() == until.timestamp()
    assert Renewable(Credentials("AKIA", "s", method="env"), lambda: None).expiry() is None

    def fetch() -> dict[str, str]:
        return {"access_key": "ASIA", "secret_key": "s", "token": "t", "expiry_time": until.isoformat()}

    deferred = Renewable(DeferredRefreshableCredentials(fetch, "sso"), lambda: None)
    assert deferred.expiry() is None  # not fetched yet
    deferred.get_frozen_credentials()
    assert deferred.expiry() == until.timestamp()


def test_botocore_s_warnings_of_failed_refreshes_are_one_line_or_none() -> None:
    """botocore.credentials logs each failed refresh with its traceback (B282): a mandatory one, raised to the
    request (which says why), is dropped; an advisory one, after which the credentials there are still serve, is one
    line naming the error."""
    import sys

    from fsmount.mount import CredentialRefreshFailed

    try:
        raise FileNotFoundError(2, "No such file or directory", "/var/run/token")
    except FileNotFoundError:
        failed = sys.exc_info()

    def record(period: str) -> logging.LogRecord:
        return logging.LogRecord("botocore.credentials", logging.WARNING, __file__, 1,
                                 "Refreshing temporary credentials failed during %s refresh period.", (period,), failed)

    assert not CredentialRefreshFailed().filter(record("mandatory"))
    advisory = record("advisory")
    assert CredentialRefreshFailed().filter(advisory)
    assert advisory.exc_info is None and logging.Formatter().format(advisory) == (
        "Refreshing temporary credentials failed during advisory refresh period. (FileNotFoundError: [Errno 2] No "
        "such file or directory: '/var/run/token')")


def test_credentials_that_cannot_be_had_are_not_asked_for_again_within_the_hold(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """botocore asks the source at every signing once the credentials are due: a role STS refused was asked for at
    every request (B284). Within UNAVAILABLE_HOLD_S signing raises the same failure at once; after it, the source is
    asked again, and credentials it gives then are signed with."""
    from botocore.credentials import DeferredRefreshableCredentials

    allowed_logs.append(r"the credentials' refresh failed \(ClientError\); looking the credentials up again failed")
    now = [100.0]
    monkeypatch.setattr(credentials.time, "monotonic", lambda: now[0])
    asked: list[int] = []
    refuse = [True]

    def fetch() -> dict[str, str]:
        asked.append(1)
        if refuse[0]:
            raise sts_refusal("AccessDenied", 403)
        return {"access_key": "ASIA", "secret_key": "s", "token": "t", "expiry_time": "2999-01-01T00:00:00Z"}

    source = DeferredRefreshableCredentials(fetch, "assume-role-with-web-identity")
    renewable = Renewable(source, lambda: DeferredRefreshableCredentials(fetch, "assume-role-with-web-identity"))
    with pytest.raises(credentials.Unavailable):
        renewable.get_frozen_credentials()
    assert len(asked) == 2  # the source, and a lookup's
    for _ in range(5):
        now[0] += credentials.UNAVAILABLE_HOLD_S / 10
        with pytest.raises(credentials.Unavailable, match="AccessDenied"):
            renewable.get_frozen_credentials()
    assert len(asked) == 2
    refuse[0] = False
    now[0] += credentials.UNAVAILABLE_HOLD_S
    assert renewable.get_frozen_credentials().access_key == "ASIA" and len(asked) == 3


@pytest.mark.parametrize("method, kind", [("iam-role", "Unreachable"), ("container-role", "Unreachable"),
                                          ("custom-process", "Unreachable")])
def test_a_metadata_service_that_gives_nothing_for_a_moment_is_asked_again_not_said_as_refused(
        allowed_logs: list[str], method: str, kind: str) -> None:
    """The instance metadata service timing out once (one try of 1 s, throttled under load) while botocore refreshes
    an instance role's credentials: botocore raises "Credential refresh failed", and B280's mapping made it
    CredentialsFailed, EACCES, failing the read at once and every read of the next UNAVAILABLE_HOLD_S. It is
    Unreachable, asked again until the read's deadline (B297); a credential_process that exits with an error is too
    (B330: `test_a_credential_process_that_exits_with_an_error_is_asked_again_and_one_misconfigured_is_said`)."""
    import datetime

    from botocore.credentials import RefreshableCredentials
    from botocore.exceptions import CredentialRetrievalError

    from fsmount.data import store
    from fsmount.data.boto3_store import translate_error

    allowed_logs.append(r"the credentials' refresh failed \(CredentialRetrievalError\)")

    def refresh() -> dict[str, str]:
        if method == "iam-role":
            return {}  # what botocore's InstanceMetadataFetcher gives when IMDS does not answer
        raise CredentialRetrievalError(provider=method, error_msg="no answer")

    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)  # a mandatory refresh
    renewable = Renewable(RefreshableCredentials("ASIA", "s", "t", until, refresh, method), lambda: None)
    with pytest.raises(credentials.Unavailable) as caught:
        renewable.get_frozen_credentials()
    err = translate_error(caught.value, "b", "GET 'k'")
    assert type(err) is getattr(store, kind), err.message
    assert err.message.startswith(f"GET 'k': the credentials ({method}) could not be had: "), err.message


def test_credentials_still_good_are_signed_with_when_the_metadata_service_gives_nothing_before_they_are_due(
        allowed_logs: list[str]) -> None:
    """An instance role's credentials 12 minutes from their expiry (botocore's advisory refresh: 15 minutes before,
    its mandatory one 10) while the instance metadata service does not answer: botocore's fetch returns nothing, and
    its refresh raises "Credential refresh failed" where a source's error would have been passed over, so the signing
    failed (a renewal's lookup, then UNAVAILABLE_HOLD_S of every signing failing) with credentials good for 12 more
    minutes. They are signed with, and nothing is looked up (B298). Once due (5 minutes left), the failure is raised."""
    import datetime

    from botocore.credentials import RefreshableCredentials

    allowed_logs.append(r"the credentials' refresh failed \(CredentialRetrievalError\)")
    lookups: list[int] = []

    def look_up() -> None:
        lookups.append(1)

    def imds_silent() -> dict[str, str]:
        return {}

    for minutes_left, served in ((12, True), (5, False)):
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=minutes_left)
        renewable = Renewable(RefreshableCredentials("ASIAROLE", "s", "t", until, imds_silent, "iam-role"), look_up)
        if served:
            frozen = renewable.get_frozen_credentials()
            assert (frozen.access_key, frozen.secret_key, frozen.token) == ("ASIAROLE", "s", "t")
            assert not lookups
        else:
            with pytest.raises(credentials.Unavailable, match="Credential refresh failed"):
                renewable.get_frozen_credentials()
            assert lookups == [1]


def test_signing_threads_that_wait_for_due_credentials_ask_their_source_once_between_them(
        allowed_logs: list[str]) -> None:
    """Session credentials due (botocore's mandatory refresh) while STS fails slowly (an outage: 503 after 0.3 s), and
    eight fetch threads signing at once: botocore lets one refresh and blocks the others on its refresh lock, and each
    of them, let in in turn, asked STS again (UNAVAILABLE_HOLD_S only stops callers that come after): 9 calls, the
    last thread failed 2.7 s later. One refresh at a time now; the others wait for its result and raise its failure:
    the source asked once, and once by the lookup. Once STS answers again, eight threads at once ask it once."""
    import datetime
    import threading
    import time

    from botocore.credentials import RefreshableCredentials

    allowed_logs.append(r"the credentials' refresh failed \(ClientError\); looking the credentials up again failed")
    asked: list[int] = []
    outage = [True]

    def fetch() -> dict[str, str]:
        asked.append(1)
        time.sleep(0.3)
        if outage[0]:
            raise sts_refusal("ServiceUnavailable", 503)
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        return {"access_key": f"ASIA{len(asked)}", "secret_key": "s", "token": "t", "expiry_time": until.isoformat()}

    def due() -> RefreshableCredentials:
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
        return RefreshableCredentials("ASIA0", "s", "t", until, fetch, "assume-role-with-web-identity")

    renewable = Renewable(due(), due)

    def sign_at_once(threads: int) -> tuple[list[object], float]:
        answers: list[object] = []
        start = threading.Barrier(threads)

        def sign() -> None:
            start.wait()
            try:
                answers.append(renewable.get_frozen_credentials().access_key)
            except credentials.Unavailable as exc:
                answers.append(exc)

        signers = [threading.Thread(target=sign, daemon=True) for _ in range(threads)]
        began = time.monotonic()
        for signer in signers:
            signer.start()
        for signer in signers:
            signer.join(10)
        assert not any(s.is_alive() for s in signers)
        return answers, time.monotonic() - began

    answers, took = sign_at_once(8)
    assert len(answers) == 8 and all(isinstance(a, credentials.Unavailable) and "ServiceUnavailable" in str(a)
                                     for a in answers), answers
    assert len(asked) == 2, len(asked)  # the refresh, and the lookup's
    assert took < 2.0, took  # the refresh and the lookup: 0.6 s; each thread in turn, 2.7 s
    outage[0] = False
    renewable._unavailable = None  # the hold over: STS is asked again
    asked.clear()
    answers, _ = sign_at_once(8)
    assert answers == ["ASIA1"] * 8 and len(asked) == 1, (answers, asked)


def test_a_signing_thread_waits_for_another_s_refresh_of_due_credentials_until_its_own_deadline_only(
        allowed_logs: list[str]) -> None:
    """STS not answering while credentials are due: one thread's refresh runs (up to two fetches of FETCH_TIMEOUT_S
    and a lookup), and a metadata request or write waiting for it, run `within` a deadline, gives up then, said as
    no answer in time from the credentials' source (Unreachable), not the bucket's."""
    import datetime
    import threading
    import time

    from botocore.credentials import RefreshableCredentials

    from fsmount.data import store
    from fsmount.data.boto3_store import translate_error

    allowed_logs.append(r"the credentials' refresh failed")
    stuck = threading.Event()

    def fetch() -> dict[str, str]:
        stuck.wait(5)
        raise sts_refusal("ServiceUnavailable", 503)

    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
    deadline: list[float | None] = [None]
    renewable = Renewable(RefreshableCredentials("ASIA0", "s", "t", until, fetch, "assume-role-with-web-identity"),
                          lambda: None, deadline=lambda: deadline[0])
    leader = threading.Thread(target=lambda: pytest.raises(credentials.Unavailable, renewable.get_frozen_credentials),
                              daemon=True)
    leader.start()
    try:
        time.sleep(0.2)
        deadline[0] = time.monotonic() + 0.3
        began = time.monotonic()
        with pytest.raises(credentials.Unavailable) as caught:
            renewable.get_frozen_credentials()
        assert time.monotonic() - began < 1
        err = translate_error(caught.value, "b", "HEAD 'k'")
        assert type(err) is store.Unreachable and "the credentials (assume-role-with-web-identity) could not be had: "\
            "no answer in time" in err.message, err.message
    finally:
        stuck.set()
        leader.join(5)


@pytest.mark.parametrize("mode, kind, said", [
    ("exit", "Unreachable", "the credential_process exited with an error: vault agent is restarting"),
    ("silent-exit", "Unreachable", "the credential_process exited with an error: it said nothing"),
    ("garbage", "CredentialsFailed", "the credential_process printed no JSON object (JSONDecodeError: Expecting "
                                     "value: line 1 column 1 (char 0)): check the profile's credential_process"),
    ("version", "CredentialsFailed", "Unsupported version '2' for credential process provider, supported versions: 1:"
                                     " check the profile's credential_process"),
    ("expiration", "CredentialsFailed", "what the credential_process printed cannot be taken (ParserError: Unknown "
                                        "string format: soon): check the profile's credential_process"),
    ("gone", "CredentialsFailed", "No such file or directory: {script} (the profile's credential_process)"),
])
def test_a_credential_process_that_exits_with_an_error_is_asked_again_and_one_misconfigured_is_said(
        tmp_path: pytest.TempPathFactory, allowed_logs: list[str], mode: str, kind: str, said: str) -> None:
    """A credential_process with an Expiration (botocore refreshes it) whose credentials are due, run by botocore as
    it runs it, when it exits with an error (a vault agent restarting), prints what is not JSON, a Version botocore
    does not take, or is not there any more: its failure was EACCES at once, whatever it was. One that exits with an
    error is Unreachable, asked again until the request's deadline as B297's sources are; the others say what to
    fix, CredentialsFailed."""
    import datetime
    import sys
    from pathlib import Path

    from botocore.credentials import ProcessProvider

    from fsmount.data import store
    from fsmount.data.boto3_store import translate_error

    allowed_logs.append(r"the credentials' refresh failed \(\w+\); looking the credentials up again failed")
    home = Path(str(tmp_path))
    script, mode_file = home / "vault-creds", home / "mode"
    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)  # due: botocore must refresh them
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib, sys\n"
        f"mode = pathlib.Path({str(mode_file)!r}).read_text()\n"
        "if mode == 'exit':\n"
        "    sys.exit('vault agent is restarting')\n"
        "if mode == 'silent-exit':\n"
        "    sys.exit(1)\n"
        "if mode == 'garbage':\n"
        "    print('Enter your vault token:')\n"
        "    sys.exit()\n"
        "print(json.dumps({'Version': 2 if mode == 'version' else 1, 'AccessKeyId': 'ASIAP', 'SecretAccessKey': 's',"
        f" 'SessionToken': 't', 'Expiration': 'soon' if mode == 'expiration' else "
        f"{until.strftime('%Y-%m-%dT%H:%M:%SZ')!r}}}))\n")
    script.chmod(0o755)
    mode_file.write_text("ok")
    config = {"profiles": {"default": {"credential_process": str(script)}}}

    def look_up() -> Credentials:
        return ProcessProvider("default", lambda: config).load()

    renewable = Renewable(look_up(), look_up)
    if mode == "gone":
        script.unlink()
    else:
        mode_file.write_text(mode)
    with pytest.raises(credentials.Unavailable) as caught:
        renewable.get_frozen_credentials()
    err = translate_error(caught.value, "b", "GET 'k'")
    assert type(err) is getattr(store, kind), err.message
    assert err.message.startswith(
        f"GET 'k': the credentials (custom-process) could not be had: {said.format(script=script)}"), err.message


def test_a_credential_process_that_hangs_while_its_credentials_are_due_holds_no_signing_thread_past_the_wait(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """A credential_process with an Expiration that hangs when botocore refreshes its credentials (a vault agent that
    does not answer): botocore waits for it without a bound, and the signing thread that ran the refresh, a read's
    chunk fetch, which has no deadline of its own, waited as long, and so did every fetch thread behind it: the
    mount's fetch workers all held, no chunk served, not even from the cache dir. The refresh runs in a thread of its
    own now; a signing thread gives up on it REFRESH_WAIT_S after it began (no answer in time: Unreachable, a read
    asks again until its deadline), one coming later at once, and the credentials it gives in the end are signed with
    (B357)."""
    import datetime
    import sys
    import time
    from pathlib import Path

    from botocore.credentials import ProcessProvider

    from fsmount.data import store
    from fsmount.data.boto3_store import translate_error

    monkeypatch.setattr(credentials, "REFRESH_WAIT_S", 0.5, raising=False)
    home = Path(str(tmp_path))
    script, mode_file = home / "vault-creds", home / "mode"
    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)  # due: botocore must refresh them
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib, sys, time\n"
        f"mode = pathlib.Path({str(mode_file)!r})\n"
        "given_up = time.monotonic() + 8\n"
        "while mode.read_text() == 'hang' and time.monotonic() < given_up:\n"
        "    time.sleep(0.02)\n"
        "print(json.dumps({'Version': 1, 'AccessKeyId': 'ASIA' + mode.read_text().upper(), 'SecretAccessKey': 's',"
        f" 'SessionToken': 't', 'Expiration': {until.strftime('%Y-%m-%dT%H:%M:%SZ')!r}}}))\n")
    script.chmod(0o755)
    mode_file.write_text("first")
    config = {"profiles": {"default": {"credential_process": str(script)}}}

    def look_up() -> Credentials:
        return ProcessProvider("default", lambda: config).load()

    renewable = Renewable(look_up(), look_up)
    mode_file.write_text("hang")
    try:
        began = time.monotonic()
        with pytest.raises(credentials.Unavailable) as caught:
            renewable.get_frozen_credentials()  # a read's fetch: no deadline
        assert time.monotonic() - began < 2.5, time.monotonic() - began
        err = translate_error(caught.value, "b", "GET 'k'")
        assert type(err) is store.Unreachable and "the credentials (custom-process) could not be had: no answer in " \
            "time" in err.message, err.message
        began = time.monotonic()
        with pytest.raises(credentials.Unavailable):
            renewable.get_frozen_credentials()  # the refresh still hangs: given up on at once
        assert time.monotonic() - began < 0.3, time.monotonic() - began
    finally:
        mode_file.write_text("back")
    for _ in range(100):  # the refresh ends once the process answers: its credentials are signed with
        try:
            assert renewable.get_frozen_credentials().access_key == "ASIABACK"
            break
        except credentials.Unavailable:
            time.sleep(0.05)
    else:
        raise AssertionError("the credentials the process gave once it answered were never signed with")


def test_a_signing_thread_that_found_credentials_due_just_before_their_refresh_failed_does_not_ask_again(
        monkeypatch: pytest.MonkeyPatch, allowed_logs: list[str]) -> None:
    """A signing thread that found the credentials due (past UNAVAILABLE_HOLD_S's check) just before a refresh of them
    failed, and came to wait for it just after it ended: it began a refresh of its own, asking the source (STS in an
    outage) again within the hold that was to spare it. It takes the held failure (B358)."""
    import datetime
    import threading

    from botocore.credentials import RefreshableCredentials

    allowed_logs.append(r"the credentials' refresh failed \(ClientError\); looking the credentials up again failed")
    asked: list[int] = []

    def fetch() -> dict[str, str]:
        asked.append(1)
        raise sts_refusal("ServiceUnavailable", 503)

    def due() -> RefreshableCredentials:
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
        return RefreshableCredentials("ASIA0", "s", "t", until, fetch, "assume-role-with-web-identity")

    found_due = credentials._due
    failed = threading.Event()

    def due_after_the_failure(source: object) -> bool:
        if threading.current_thread().name == "late":
            failed.wait(5)  # it checked the hold before the refresh failed, and finds them due after
        return found_due(source)

    monkeypatch.setattr(credentials, "_due", due_after_the_failure)
    renewable = Renewable(due(), due)
    answers: list[object] = []

    def sign() -> None:
        try:
            answers.append(renewable.get_frozen_credentials())
        except credentials.Unavailable as exc:
            answers.append(exc)

    late = threading.Thread(target=sign, name="late", daemon=True)
    late.start()
    with pytest.raises(credentials.Unavailable, match="ServiceUnavailable"):
        renewable.get_frozen_credentials()
    assert len(asked) == 2  # the refresh, and the lookup's
    failed.set()
    late.join(5)
    assert not late.is_alive() and len(answers) == 1 and isinstance(answers[0], credentials.Unavailable)
    assert "ServiceUnavailable" in str(answers[0]) and len(asked) == 2, (answers, asked)


def test_credentials_in_their_advisory_window_sign_at_once_while_their_refresh_hangs(allowed_logs: list[str]) -> None:
    """Credentials 12 minutes from their expiry (botocore's advisory refresh: 15 minutes before, its mandatory one 10)
    whose source hangs (a credential_process that does not answer): botocore refreshes them in the first signing
    thread that comes, and waits for the source without a bound; that thread (a read's fetch, a metadata request's)
    waited for as long, though the credentials it held were good for 12 more minutes. The refresh runs in a thread of
    its own, one at a time; signing threads sign at once with the credentials there are, and with the new ones once
    it ends (B359)."""
    import datetime
    import threading
    import time

    from botocore.credentials import RefreshableCredentials

    answer = threading.Event()
    asked: list[int] = []

    def fetch() -> dict[str, str]:
        asked.append(1)
        answer.wait(5)
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        return {"access_key": "ASIANEW", "secret_key": "s", "token": "t", "expiry_time": until.isoformat()}

    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=12)
    renewable = Renewable(RefreshableCredentials("ASIAOLD", "s", "t", until, fetch, "custom-process"), lambda: None)
    try:
        for _ in range(3):
            began = time.monotonic()
            assert renewable.get_frozen_credentials().access_key == "ASIAOLD"
            assert time.monotonic() - began < 1, time.monotonic() - began
        assert len(asked) == 1  # one refresh runs: the signing threads after it begin none
    finally:
        answer.set()
    for _ in range(100):
        if renewable.get_frozen_credentials().access_key == "ASIANEW":
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the credentials the refresh gave were never signed with")
    assert len(asked) == 1
