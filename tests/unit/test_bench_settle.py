"""bench/run.py's settle_memory: it waits while the VM is still handing freed memory back to its host, and no
longer than it must."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import run  # noqa: E402 - bench/ is not a package


def counter(values: list[int | None]) -> Iterator[int | None]:
    """The reporting counter's readings, the last one repeated for ever."""
    yield from values
    while True:
        yield values[-1]


def test_waits_until_the_counter_is_still(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = counter([0, 0, 2 << 30, 3 << 30, 3 << 30])  # read every 0.25 s: still after the 4th reading
    monkeypatch.setattr(run, "memory_returned_to_host", lambda: next(readings))
    started = time.monotonic()
    waited, returned_gb = run.settle_memory(quiet_s=0.5, max_s=10)
    assert returned_gb == pytest.approx(3 * (1 << 30) / 1e9)
    # three readings before it moved for the last time, then 0.5 s still
    assert 1.0 <= waited <= 3.0 and time.monotonic() - started == pytest.approx(waited, abs=0.1)


def test_gives_up_after_max(monkeypatch: pytest.MonkeyPatch) -> None:
    rising = iter(range(0, 1 << 40, 1 << 20))
    monkeypatch.setattr(run, "memory_returned_to_host", lambda: next(rising))
    waited, returned_gb = run.settle_memory(quiet_s=0.5, max_s=1.0)
    assert 1.0 <= waited < 1.6 and returned_gb > 0


def test_nothing_to_wait_for_without_the_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "memory_returned_to_host", lambda: None)
    started = time.monotonic()
    assert run.settle_memory(quiet_s=5, max_s=10) is None
    assert time.monotonic() - started < 0.1
