"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import trio.testing

from fsmount import namespace


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """Virtual time for trio tests: the clock jumps ahead whenever every task is blocked."""
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def each_request_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TTL of 0 (or a short one, slept past) as "every request asks the bucket", for tests that change the store
    between two requests at once: without the grace of one system call's requests (`namespace.ONE_CALL_S`)."""
    monkeypatch.setattr(namespace, "ONE_CALL_S", 0.0)
