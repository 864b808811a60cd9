"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import trio.testing


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """Virtual time for trio tests: the clock jumps ahead whenever every task is blocked."""
    return trio.testing.MockClock(autojump_threshold=0)
