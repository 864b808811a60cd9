"""credentials.Renewable on its own: when it looks the credentials up again, what it says, what it keeps."""

from __future__ import annotations

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
