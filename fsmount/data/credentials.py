"""Credentials over the life of a mount: looked up again when the bucket refuses them.

botocore resolves a session's credentials once. Those it can refresh (a credential_process with an Expiration, an
instance role, container credentials, an assumed role) it refreshes before they expire; those it read from a file
(the shared credentials file, the config file, a profile's `credential_process` without an Expiration) or from the
environment it keeps for the life of the process. An outside agent that rewrites the credentials file with a new
key and revokes the old one (a rotation job, `aws configure`, a vault agent) left a daemon that runs for weeks
refusing every request (EACCES) until it was restarted.

`install(session, profile)` puts a `Renewable` in front of a botocore session's credential chain: it signs with
what the chain resolved, and `renew()` resolves the chain again (a fresh botocore session: files read again,
processes run again) at most once per `RECHECK_S`, and signs with the result from then on if it differs. The
store calls `renew()` when a request is refused for its credentials (AccessDenied, ExpiredToken, InvalidToken,
InvalidAccessKeyId) and sends that request once more, signed anew, if it returned True. Signing calls it too when
the credentials' own refresh fails (a role assumed with a source key rotated in the file and revoked), for no
request is sent then to be refused (unless they are outside botocore's mandatory refresh window: those it holds
still serve, `_still_good`). When that lookup gives none either, signing raises `Unavailable` with the
source's own error (STS refusing the role, a web identity token file missing, an SSO login expired), which the store
says as the credentials' failure: no request reached the bucket; for `UNAVAILABLE_HOLD_S` after, signing raises it
again at once without asking the source. `Renewable.expiry()` says when the credentials signing now expire, so that a
presigned URL signed with them is not reused past it (`presigned.RangeGetter`).

Some refusals are not only the credentials' (`NOT_ONLY_CREDENTIALS`: AccessDenied, a HEAD's bare 400 or 403): a bucket
policy refuses so too. A source that mints new keys at each lookup (a role assumed through a profile, SSO, a
credential_process giving new session keys each run) looks changed at every lookup, so a policy's refusal cost a
lookup (an STS call, a process run), a "have changed" warning and a second request per `RECHECK_S`, for good. When a
request sent again with credentials a renewal changed is refused again for such a code (`refused_again`), the
refusal is the bucket's own: such codes look the credentials up no more than once per `POLICY_RECHECK_S`, until a
renewal for another reason (a code that names the credentials, a failed refresh) changes them. Not never: a key
revoked is refused so too (an assumed role's sessions revoked in IAM, a server that names no other code), and a
HEAD's refusal never names its code.

Thread-safety: `Renewable.get_frozen_credentials` is called by every signing thread without a lock: it reads one
reference (`_source`), replaced whole by `renew` (never changed in place), so a signature never mixes a key id and
a secret of two generations; only when the source fails does it call `renew`. Credentials due (botocore's mandatory
refresh) are refreshed one refresh at a time, in a thread of its own (`_flight`, set under `_flight_lock` by the
signing thread that starts it, cleared under it by the refresh's thread, which alone writes its answer); every signing
thread waits for that answer until its request's deadline, and no longer than `REFRESH_WAIT_S` after the refresh
began. Credentials in botocore's advisory window begin such a refresh too, and sign meanwhile with what they hold,
not waiting for it. `renew` serializes lookups under
`_lock`; `_next_check`, `_changed_at`, `_policy_refusals`, `_policy_told` and `_lookup` are only touched under it. A
lookup runs in a thread of its own, waited for at most `LOOKUP_TIMEOUT_S` (under `_lock`, so a caller of `renew` waits
at most about that long); one that takes longer is left to end there, no other starts meanwhile, and the next renewal
takes its result (its thread writes only its own box, read once it has ended). No secret is ever logged:
only how the credentials were found (botocore's method name).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from botocore.credentials import Credentials

log = logging.getLogger(__name__)

# At most one lookup per this many seconds: a lookup may run a credential_process or ask an instance's metadata
# service, and a bucket that refuses the credentials for good (a policy, a revoked key not replaced yet) refuses
# every request.
RECHECK_S = 30.0
# Refusals a bucket also gives for reasons of its own (a policy, an ACL, a prefix the role may not read), not only
# for credentials it does not take: AccessDenied, and a HEAD's answer without a body (botocore names its code by the
# status). The others (ExpiredToken, InvalidToken, InvalidAccessKeyId, SignatureDoesNotMatch...) name the credentials.
NOT_ONLY_CREDENTIALS = frozenset({"AccessDenied", "400", "403"})
# How often such refusals look the credentials up once they were found the bucket's own (`Renewable.refused_again`):
# seldom, for a source minting keys at each lookup pays a lookup and a second request each time, but not never, for a
# key revoked is refused so too (IAM's "revoke active sessions" of an assumed role: AccessDenied, and a new session
# would be taken; a server naming an unknown key AccessDenied), and a HEAD's bare 403 names nothing.
POLICY_RECHECK_S = 600.0
# The longest a lookup is waited for: a credential_process that hangs (a vault agent down, a prompt with no
# terminal), an STS or SSO endpoint that does not answer. botocore's lookup has no bound of its own, and the threads
# that waited on it (metadata requests, writes, given up on by their deadline but never ended) kept their slots for
# good: every later stat or close timed out. The lookup goes on in its thread; none other starts until it ends.
LOOKUP_TIMEOUT_S = 10.0
# The timeouts and retries of the requests botocore sends to fetch credentials (STS for an assumed role or a web
# identity, the SSO portal): its defaults (60 s to connect, 60 s to read, 3 tries) held a mount's pre-flight for 190 s
# when STS did not answer (a VPC without a route or an endpoint to it), and a running mount's signing threads, behind
# botocore's refresh lock, as long. STS answers in well under a second; two tries of 5 s each.
FETCH_TIMEOUT_S = 5.0
FETCH_RETRIES = 1
# How long credentials that could not be had (`Unavailable`) are not asked for again: every request signed meanwhile
# fails at once with the same reason. botocore asks its source at each signing once they are within their mandatory
# refresh window: a running mount whose role STS refused sent STS 8 requests for 3 failed reads, a fleet's nodes as
# many each (STS throttles an account's calls). Short, for a source that is back (an STS that answers again) is
# asked again within it.
UNAVAILABLE_HOLD_S = 5.0
# The longest a refresh of credentials due is waited for, from when it began (`Renewable._one_refresh_at_a_time`),
# by signing threads whose request has no deadline of their own (a read's chunk fetch) or a later one. botocore waits
# for a credential_process without a bound: one that hung (a vault agent that does not answer) held the thread that
# ran it and every fetch thread waiting for it for as long, their READs failed at --read-timeout, and the mount's
# fetch workers (--max-connections of them) all held, chunks in the cache dir or the shared tier were not served
# either. Past it, signing fails at once (`Unavailable`: no answer in time, said `Unreachable`) until the refresh
# ends: a read asks again until its deadline, as for an origin that does not answer. Longer than a refresh that ends:
# two STS tries of FETCH_TIMEOUT_S (to connect, and to read) and a lookup of LOOKUP_TIMEOUT_S.
REFRESH_WAIT_S = 30.0


class _GivenUp(Exception):
    """A lookup that took longer than LOOKUP_TIMEOUT_S (`Renewable._look_up`)."""


class Unavailable(Exception):
    """The credentials could not be had when a request was to be signed: their source (`method`, botocore's name of
    it) failed to give them (STS refused the role, the web identity token file is missing, a credential_process
    failed), and a lookup gave none either. `cause`: the source's own error. No request was sent, so nothing the
    bucket said: `boto3_store.translate_error` says it as the credentials' failure, not the bucket's."""

    def __init__(self, method: str, cause: BaseException):
        super().__init__(f"the credentials ({method or 'unknown source'}) could not be had: "
                         f"{type(cause).__name__}: {cause}")
        self.method = method
        self.cause = cause


def _frozen(credentials: Any) -> tuple[str, str, str | None]:
    frozen = credentials.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token


def _still_good(source: Any) -> Any:
    """The frozen credentials botocore's refreshable `source` holds, if they are outside its mandatory refresh window
    (they serve still), else None. Its refresh within the advisory window raises where the source gave nothing
    rather than an error: the instance metadata service not answering (botocore's fetch, one try of 1 s, returns
    nothing then, and IMDS throttles a busy node) failed a signing with credentials good for 10 minutes or more, and
    every signing for UNAVAILABLE_HOLD_S after it (B298). botocore keeps them itself when the source raises there."""
    frozen = getattr(source, "_frozen_credentials", None)  # botocore's RefreshableCredentials'; no public getter
    needed = getattr(source, "refresh_needed", None)
    mandatory = getattr(source, "_mandatory_refresh_timeout", None)
    if frozen is None or needed is None or mandatory is None:
        return None
    try:
        return None if needed(mandatory) else frozen
    except Exception:  # noqa: BLE001 - what botocore's private state holds: no answer is "none"
        return None


def _due(source: Any, window: str = "_mandatory_refresh_timeout") -> bool:
    """Whether botocore's refreshable `source` must be refreshed before it signs (its mandatory window, or not
    fetched yet), or, with `window` "_advisory_refresh_timeout", whether botocore would refresh it at a signing (it
    lets one thread try, and signs the others with what it holds); False for credentials that do not expire."""
    needed = getattr(source, "refresh_needed", None)
    seconds = getattr(source, window, None)  # botocore's RefreshableCredentials'
    if needed is None or seconds is None:
        return False
    try:
        return bool(needed(seconds))
    except Exception:  # noqa: BLE001 - what botocore's private state holds: signing will say it
        return False


class _Flight:
    """One refresh of credentials (due, or in botocore's advisory window), run in a thread of its own, that signing
    threads wait for (`Renewable._one_refresh_at_a_time`): its frozen credentials or its error, written by that
    thread before `done` is set."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class Renewable(Credentials):  # type: ignore[misc]
    """Credentials botocore signs with, whose source a lookup may replace (`renew`). Every attribute botocore
    reads is the source's (Credentials.__init__ is not called: it would set them)."""

    def __init__(self, first: Any, resolve: Callable[[], Any], *, recheck_s: float = RECHECK_S,
                 deadline: Callable[[], float | None] = lambda: None):
        self._source = first  # botocore credentials, refreshable or not; replaced whole, never changed
        self._resolve = resolve
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._changed_at = -float("inf")  # monotonic time of the last renewal that changed them
        # How many renewals changed them: a presigned URL cached before one is not reused (`presigned.RangeGetter`'s
        # `credentials_changes`; a key id kept with a new secret names nothing new in the URL). Written under the
        # lock, only ever up; read without it (an int).
        self.changes = 0
        # When credentials a renewal changed were refused again for a code of NOT_ONLY_CREDENTIALS (`refused_again`),
        # monotonic; None until then, and again after a change: such refusals are the bucket's own, and look the
        # credentials up once per POLICY_RECHECK_S only. `_policy_told`: its warning was logged (later ones are INFO).
        self._policy_refusals: float | None = None
        self._policy_told = False
        # A lookup given up on (`LOOKUP_TIMEOUT_S`) that may still run, and the box its result or error lands in.
        self._lookup: tuple[threading.Thread, dict[str, Any]] | None = None
        # Credentials that could not be had: until when (monotonic) signing raises this `Unavailable` at once, without
        # asking their source (`UNAVAILABLE_HOLD_S`). Replaced whole, read without the lock.
        self._unavailable: tuple[float, str, BaseException] | None = None
        # The refresh of credentials due that runs now (`_one_refresh_at_a_time`), None when none: set and cleared
        # under `_flight_lock` by the thread that runs it, which alone writes its result; others wait on its `done`.
        self._flight_lock = threading.Lock()
        self._flight: _Flight | None = None
        # The deadline (time.monotonic()) of the request the calling thread signs for, None if it has none: a thread
        # waiting for another's refresh gives up then.
        self._deadline = deadline

    @property
    def method(self) -> str:
        return str(getattr(self._source, "method", "") or "")

    def get_frozen_credentials(self) -> Any:
        held = self._unavailable
        if held is not None and time.monotonic() < held[0]:
            raise Unavailable(held[1], held[2])  # a new one: raised in many threads at once
        source = self._source
        if _due(source):
            return self._one_refresh_at_a_time()
        if _due(source, "_advisory_refresh_timeout"):
            # botocore would refresh them in this thread, and wait for their source without a bound (a
            # credential_process that hangs): in the refresh's own thread instead, while this one signs with them.
            still = _still_good(source)
            if still is not None:
                self._refresh_begun()
                return still
        return self._signed_with()

    def _signed_with(self) -> Any:
        """The source's frozen credentials, refreshed by botocore if due; looked up again (`renew`) if that fails, or
        `Unavailable` raised and held."""
        try:
            return self._source.get_frozen_credentials()
        except Exception as exc:
            still = _still_good(self._source)
            if still is not None:
                return still
            # Credentials botocore refreshes, whose refresh fails (a role assumed with a source key rotated in the
            # file and revoked): no request is sent, so no refusal would look them up again.
            if not self.renew(type(exc).__name__, event="the credentials' refresh failed"):
                self._unavailable = (time.monotonic() + UNAVAILABLE_HOLD_S, self.method, exc)
                raise Unavailable(self.method, exc) from exc
            return self._source.get_frozen_credentials()

    def _one_refresh_at_a_time(self) -> Any:
        """`_signed_with` for credentials due (botocore's mandatory refresh), one refresh at a time, in a thread of its
        own (`_refresh`): every signing thread waits for its answer (until its own deadline, `deadline`, and no longer
        than REFRESH_WAIT_S after it began) and takes it, its failure too. botocore lets one thread refresh and blocks
        the others on its refresh lock, then lets each in, in turn, to refresh again if the first failed: eight fetch
        threads signing while STS failed asked it 9 times (with the lookup), the last one failing 8 refreshes later;
        UNAVAILABLE_HOLD_S spared only the callers that came after. Run in the signing thread, a refresh that hung
        (a credential_process) held it, a read's fetch, for as long (`REFRESH_WAIT_S`)."""
        flight = self._refresh_begun()
        until = flight.began + REFRESH_WAIT_S
        deadline = self._deadline()
        if deadline is not None:
            until = min(until, deadline)
        if not flight.done.wait(max(0.0, until - time.monotonic())):
            raise Unavailable(self.method, TimeoutError("the refresh this request waited for still runs"))
        error = flight.error
        if isinstance(error, Unavailable):
            raise Unavailable(error.method, error.cause)  # a new one: raised in many threads at once
        if error is not None:
            raise Unavailable(self.method, error)
        return flight.result

    def _refresh_begun(self) -> _Flight:
        """The refresh that runs now, begun in a thread of its own (`_refresh`) if none does."""
        with self._flight_lock:
            flight = self._flight
            if flight is not None:
                return flight
            # A refresh that failed sets the hold before it ends: a thread that found the credentials due before
            # that, and comes after it, takes its failure rather than asking the source again within the hold.
            held = self._unavailable
            if held is not None and time.monotonic() < held[0]:
                raise Unavailable(held[1], held[2])
            flight = self._flight = _Flight()
        try:
            threading.Thread(target=self._refresh, args=(flight,), name="credentials-refresh", daemon=True).start()
        except BaseException as exc:  # no thread to be had: this refresh fails, the next one is another
            self._refresh_ended(flight, exc)
            raise
        return flight

    def _refresh(self, flight: _Flight) -> None:
        """The thread of `flight`: `_signed_with`, its answer handed to the signing threads waiting for it."""
        try:
            flight.result = self._signed_with()
        except BaseException as exc:  # noqa: BLE001 - handed to the signing threads, raised there
            self._refresh_ended(flight, exc)
        else:
            self._refresh_ended(flight, None)

    def _refresh_ended(self, flight: _Flight, error: BaseException | None) -> None:
        """`flight` ended (with `error`, or None): the next signing that needs a refresh begins another."""
        flight.error = error
        with self._flight_lock:
            self._flight = None
        flight.done.set()

    def expiry(self) -> float | None:
        """When the credentials signing now expire (`time.time()`), as their source says: temporary ones botocore
        refreshes (an assumed role, a web identity, SSO, a credential_process with an Expiration, an instance or
        container role) keep it; None for others, and for those not fetched yet."""
        when = getattr(self._source, "_expiry_time", None)  # botocore's RefreshableCredentials'; no public getter
        try:
            return float(when.timestamp())
        except (AttributeError, TypeError, ValueError, OverflowError):
            return None

    @property
    def access_key(self) -> str:
        return str(self.get_frozen_credentials().access_key)

    @property
    def secret_key(self) -> str:
        return str(self.get_frozen_credentials().secret_key)

    @property
    def token(self) -> str | None:
        return self.get_frozen_credentials().token  # type: ignore[no-any-return]

    @property
    def account_id(self) -> str | None:
        return getattr(self._source, "account_id", None)

    def renew(self, why: str, *, event: str = "requests were refused") -> bool:
        """Look the credentials up again (at most once per `recheck_s`) after a request was refused for `why`
        (an error code), or another `event` (what the log says). True if they are other than before, now or at a
        renewal within `recheck_s`: a request signed before that renewal deserves its second try too."""
        now = time.monotonic()
        with self._lock:
            since = self._policy_refusals if why in NOT_ONLY_CREDENTIALS else None
            if since is not None and now < since + POLICY_RECHECK_S:
                return False
            if now < self._next_check:
                return now - self._changed_at < self._recheck_s
            self._next_check = now + self._recheck_s
            if self._lookup is not None and self._lookup[0].is_alive():
                return False  # the one given up on still runs (said when given up on)
            try:
                fresh, new = self._look_up()
            except _GivenUp:
                log.warning("%s (%s); looking the credentials up again took more than %g s (a credential_process "
                            "that hangs? an STS or SSO endpoint that does not answer?): keeping those there are, "
                            "and looking up no more until it ends", event, why, LOOKUP_TIMEOUT_S)
                return False
            except Exception as exc:  # noqa: BLE001 - whatever a provider raises: keep the credentials there are
                log.warning("%s (%s); looking the credentials up again failed: %s: %s",
                            event, why, type(exc).__name__, str(exc)[:200])
                return False
            try:
                old = _frozen(self._source)
            except Exception:  # noqa: BLE001 - those signed with cannot be had any more (a refresh fails): take the new
                old = None
            if new is None or new == old:
                return False
            self._source, self._changed_at, self._policy_refusals = fresh, now, None
            self.changes += 1
            method = self.method
        # Past POLICY_RECHECK_S of a policy's refusals, a source minting keys at each lookup looks changed each time.
        log.log(logging.INFO if since is not None else logging.WARNING, "%s (%s) and the credentials (%s) have changed "
                "since they were read: signing with the new ones from now on", event, why, method or "unknown source")
        return True

    def _look_up(self) -> tuple[Any, tuple[str, str, str | None] | None]:
        """The chain resolved anew and its frozen credentials (a role assumed through a profile, SSO, a web
        identity: fetched here, from STS), in a thread of its own: _GivenUp past `LOOKUP_TIMEOUT_S`, the
        thread left running in `_lookup`. A lookup given up on that has ended since gives its result instead of
        a new one: a source that always takes longer (a slow vault's credential_process) was never renewed, each
        lookup given up on in turn. Called under `_lock`."""
        if self._lookup is not None:
            late, self._lookup = self._lookup[1], None
            if "result" in late:
                return late["result"]  # type: ignore[no-any-return]
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                fresh = self._resolve()
                box["result"] = (fresh, None if fresh is None else _frozen(fresh))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                box["error"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=run, name="credentials-lookup", daemon=True)
        thread.start()
        if not done.wait(LOOKUP_TIMEOUT_S):
            self._lookup = (thread, box)
            raise _GivenUp
        if "error" in box:
            raise box["error"]
        return box["result"]  # type: ignore[no-any-return]

    def refused_again(self, why: str) -> None:
        """A request sent again because `renew` said the credentials changed was refused again for `why`. For a
        code of NOT_ONLY_CREDENTIALS the refusal is the bucket's own, not the credentials' (a source that mints new
        keys at each lookup looks changed every time): such codes look the credentials up once per POLICY_RECHECK_S
        only (one warning; INFO after the first)."""
        if why not in NOT_ONLY_CREDENTIALS:
            return
        with self._lock:
            if self._policy_refusals is not None:
                return
            self._policy_refusals, told, self._policy_told = time.monotonic(), self._policy_told, True
        log.log(logging.INFO if told else logging.WARNING,
                "requests sent again with the credentials looked up anew were refused again (%s): the bucket refuses "
                "them for a reason of its own (a bucket or IAM policy?), not for their key. Such refusals "
                "(AccessDenied, a HEAD's bare 400 or 403) look the credentials up again every %g s only; an expired "
                "or unknown key, named so by the server, still does", why, POLICY_RECHECK_S)


class _Provider:
    """The only entry of a session's credential chain: the chain it replaced, resolved once, as a `Renewable`."""

    METHOD = "modelfs-renewable"
    CANONICAL_NAME = "modelfs-renewable"

    def __init__(self, chain: Any, resolve: Callable[[], Any], deadline: Callable[[], float | None]):
        self._chain = chain
        self._resolve = resolve
        self._deadline = deadline

    def load(self) -> Renewable | None:
        """The first credentials a provider of the chain gives (botocore's `CredentialResolver.load_credentials`), as
        a `Renewable`. A provider that raises (a credential_process that exits with an error or prints no JSON,
        container credentials not answering) raises `Unavailable` with its error, named by its method, as signing
        does: botocore's own error went bare to the user ("cannot mount: Expecting value: line 1 column 1")."""
        for provider in self._chain.providers:
            try:
                first = provider.load()
            except Exception as exc:
                raise Unavailable(str(getattr(provider, "METHOD", "") or ""), exc) from exc
            if first is not None:
                return Renewable(first, self._resolve, deadline=self._deadline)
        return None


def install(core: Any, profile: str | None, *, timeout_s: float = FETCH_TIMEOUT_S,
            retries: int = FETCH_RETRIES, deadline: Callable[[], float | None] = lambda: None) -> None:
    """Make the credentials of botocore session `core` (with `profile`, the one it was given) a `Renewable`: every
    client it creates afterwards signs with it, and its `get_credentials()` returns it. The requests that fetch them
    (STS, SSO), in `core` and in each lookup, time out after `timeout_s` (to connect, and to read), tried `retries`
    more times: they are the clients `core` creates with no setting of their own (`core`'s default client config, which
    a client given its own settings, as the store's S3 client is, overrides). `deadline`: that of the request the
    calling thread signs for (time.monotonic(), None if none), the longest it waits for another thread's refresh."""
    import botocore.credentials
    import botocore.session
    from botocore.config import Config

    bounded = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                     retries={"max_attempts": retries, "mode": "standard"})
    core.set_default_client_config(bounded)

    def resolve() -> Any:
        session = botocore.session.Session(profile=profile)
        session.set_default_client_config(bounded)
        return session.get_credentials()

    resolver = core.get_component("credential_provider")
    chain = botocore.credentials.CredentialResolver(list(resolver.providers))
    resolver.providers[:] = [_Provider(chain, resolve, deadline)]



def missing_profile(profile: str) -> tuple[list[str], list[str]] | None:
    """None where `profile` is in the AWS configuration (the config file's `[profile NAME]`, the shared credentials
    file's `[NAME]`, as botocore reads them: AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/); else the
    files looked in (expanded) that exist, and those that do not. A file that exists without the profile is a
    setting only an edit mends; no file at all may be one a configuration tool writes after boot."""
    import botocore.session

    session = botocore.session.Session()
    if profile in session.available_profiles:
        return None
    files = [os.path.expanduser(str(session.get_config_variable(name))) for name in ("config_file", "credentials_file")]
    return [f for f in files if os.path.exists(f)], [f for f in files if not os.path.exists(f)]
