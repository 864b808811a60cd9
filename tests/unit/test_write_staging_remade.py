"""The `writes/` folder of a cache dir removed under a mount (an operator's `rm -rf CACHE/writes`): made again, with
the disk cache's care (B56), so that files written afterwards are still kept on this node."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from fsmount.write_staging import Staging


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("removed", ["writes", "cache dir"])
def test_a_removed_writes_folder_is_made_again_with_one_log_line(tmp_path: Path, caplog, removed: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    staging = Staging(str(cache))
    caplog.set_level(logging.INFO, logger="fsmount.write_staging")
    for _ in range(2):
        shutil.rmtree(cache / "writes" if removed == "writes" else cache)
        staged = staging.open()
        assert staged is not None and staged.ok  # was None (logged once): no copy kept until the next mount
        staged.write(0, b"weights")
        buf = bytearray(7)
        assert staged.read_into(0, buf) and buf == b"weights"
        staged.discard()
    assert _mode(cache / "writes") == 0o700 and _mode(cache) == 0o700
    said = [r for r in caplog.records if r.levelno >= logging.INFO and "made again" in r.getMessage()]
    assert len(said) == 1  # one line, not one per file


def test_a_writes_folder_replaced_by_a_symlink_is_not_written_through(tmp_path: Path, caplog, allowed_logs) -> None:
    allowed_logs.append("cannot keep written files")
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    elsewhere.mkdir()
    staging = Staging(str(cache))
    shutil.rmtree(cache / "writes")
    (cache / "writes").symlink_to(elsewhere)
    os.rmdir(elsewhere)  # a dangling link: os.open through it fails with ENOENT, as a removed folder's does
    assert staging.open() is None
    assert not elsewhere.exists() and (cache / "writes").is_symlink()


def test_a_cache_disk_gone_from_under_the_path_is_not_filled(tmp_path: Path, monkeypatch, allowed_logs) -> None:
    """The cache dir's path now on another filesystem (its disk unmounted lazily): nothing is made there."""
    allowed_logs.append("no longer on the cache dir's filesystem")
    cache = tmp_path / "cache"
    cache.mkdir()
    staging = Staging(str(cache))
    shutil.rmtree(cache)
    monkeypatch.setattr(staging, "_dev", os.stat(tmp_path).st_dev + 1)
    assert staging.open() is None
    assert not cache.exists()
