"""A cache dir on tmpfs (a pod's emptyDir with `medium: Memory`) under a cgroup's limit: `mount.bound_by_memory`
(B901, B960). The tmpfs is real (root only); the cgroup's numbers are given, so that the test does not depend on the
memory of the host or CI container it runs in."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fsmount import sysmem
from fsmount.config import CacheSize, MountConfig, StoreConfig
from fsmount.mount import SettingError, open_disk_cache
from tests.helpers import MiB, tmpfs

GiB = 1024 * MiB
MEMORY_LIMIT = 256 * MiB
# 2 GiB limit, 1 GiB left that is not page cache: beyond --memory-limit 768 MiB, half of it 384 MiB for the cache
CGROUP = sysmem.CgroupMemory(limit=2 * GiB, available=GiB, free=GiB)
BOUND = 384 * MiB


@pytest.fixture(autouse=True)
def limited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sysmem, "cgroup_memory", lambda *a: CGROUP)


def config(cache_dir: Path, size: CacheSize) -> MountConfig:
    return MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(cache_dir),
                       cache_size=size, memory_limit=MEMORY_LIMIT)


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_explicit_cache_size_the_cgroup_cannot_give_is_refused_not_replaced(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """`--cache-size 1G` given by the operator on a 2 GiB memory-backed emptyDir, with 384 MiB to give: the mount
    replaced the operator's number by 384 MiB with a warning, a surprise the operator reads in a log at best. It is
    refused now (exit status 2, a setting), naming the size that fits and the way out (B960)."""
    with tmpfs(tmp_path / "emptydir", "size=2g") as emptydir:
        with caplog.at_level(logging.INFO, logger="fsmount"), pytest.raises(SettingError) as refused:
            open_disk_cache(config(emptydir / "cache", CacheSize(bytes=GiB))).close()
    message = str(refused.value)
    assert message.startswith("--cache-size 1073741824: the cache dir "), message
    assert "is on tmpfs, memory charged to this daemon's cgroup" in message, message
    assert f"give --cache-size {BOUND // MiB}M at most" in message and "a cache dir on a disk" in message, message


def test_the_default_share_of_a_tmpfs_is_bounded_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 allowed_logs: list[str]) -> None:
    """The default (80% of the tmpfs, sized by the node or the pod) is not the operator's number: bounded, said."""
    allowed_logs.append(r"is on tmpfs, memory charged to this daemon's cgroup")
    with tmpfs(tmp_path / "emptydir", "size=2g") as emptydir, caplog.at_level(logging.INFO, logger="fsmount"):
        cache = open_disk_cache(config(emptydir / "cache", CacheSize(fraction=0.8)))
        try:
            assert cache.max_bytes == BOUND
        finally:
            cache.close()
    warnings = said(caplog)
    assert len(warnings) == 1 and "the cache holds at most 384.00 MiB" in warnings[0], warnings


def test_a_tmpfs_smaller_than_the_bound_is_neither_bounded_nor_refused(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A 64 MiB tmpfs holds at most 64 MiB of chunks whatever --cache-size says (the cache keeps its free-space floor
    there), within the 384 MiB the cgroup can give: comparing the bound with --cache-size alone warned "the cache
    holds at most 384 MiB, not the 1 GiB" of a cache that could never hold a fifth of that, and failed the mount
    tests that use a small tmpfs as a full disk when run in a memory-limited CI container (B960)."""
    with tmpfs(tmp_path / "small", "size=64m") as small, caplog.at_level(logging.INFO, logger="fsmount"):
        cache = open_disk_cache(config(small / "cache", CacheSize(bytes=GiB)))
        try:
            assert cache.max_bytes == GiB
        finally:
            cache.close()
    assert said(caplog) == []
