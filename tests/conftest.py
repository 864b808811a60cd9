"""Shared by every test: a log checker that fails any test logging an unexpected warning or error, and the
marking of each test by its folder: `unit` (tests/unit: in-process, fake store, virtual time) or `mount`
(tests/mount: real FUSE mounts, daemons and S3 servers; their fixtures are in tests/mount/conftest.py)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "mount")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        kind = next((k for k in KINDS if TESTS / k in item.path.parents), None)
        if kind is None:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in tests/unit or tests/mount")
        item.add_marker(kind)


# -- log checking (in-process) --------------------------------------------------------------------

@pytest.fixture
def allowed_logs() -> list[str]:
    """Regexes of warning/error messages a test expects; anything else at WARNING+ fails it."""
    return []


@pytest.fixture(autouse=True)
def _check_logs(caplog: pytest.LogCaptureFixture, allowed_logs: list[str]) -> Iterator[None]:
    caplog.set_level(logging.DEBUG, logger="fsmount")
    yield
    bad = [r for r in caplog.get_records("call") if r.levelno >= logging.WARNING
           and r.name.startswith("fsmount")
           and not any(re.search(p, r.getMessage()) for p in allowed_logs)]
    if bad:
        pytest.fail("unexpected log records:\n" + "\n".join(f"{r.levelname} {r.getMessage()}" for r in bad))
