"""How the daemon counts stop signals (`mount.Daemon._take_signals`): the first SIGTERM / SIGINT is a stop, the second
cuts it short (B692), whatever ended the loop first. The signals are fed as `early_stops` (those noted before the
receiver existed), so no real signal is sent."""

from __future__ import annotations

import logging
import signal
import types

import pytest
import trio

from fsmount.mount import Daemon


def daemon_after_unmount(stops: list[int]) -> Daemon:
    """A daemon whose loop has ended (`modelfs unmount`: `_served` set), in its drains, no stop signal taken yet."""
    daemon = Daemon.__new__(Daemon)
    daemon.ops = types.SimpleNamespace(writers=0, open_files=0)
    daemon._served, daemon._drains, daemon._grace = trio.Event(), trio.CancelScope(), None
    daemon._stopping, daemon.cut_short = False, False
    daemon._served.set()
    daemon.early_stops = list(stops)
    return daemon


def take(daemon: Daemon) -> bool:
    """Runs the daemon's signal receiver over its `early_stops`; whether the drains were cancelled."""
    async def main() -> bool:
        async with trio.open_nursery() as stops:
            with trio.move_on_after(0.2):
                await daemon._take_signals(stops)
            stops.cancel_scope.cancel()
        return daemon._drains.cancel_called

    return trio.run(main)


def test_one_sigterm_after_modelfs_unmount_lets_the_drains_end(caplog: pytest.LogCaptureFixture) -> None:
    """B820: `modelfs unmount`, then `systemctl stop` (or restart) during the drains: systemd's one SIGTERM cut the
    stop short as a second one does: the cache levels' drains skipped, exit status 1, the unit marked failed."""
    daemon = daemon_after_unmount([signal.SIGTERM])
    with caplog.at_level(logging.INFO, logger="fsmount.mount"):
        drains_cancelled = take(daemon)
    assert not daemon.cut_short and not drains_cancelled, caplog.text
    assert "received SIGTERM: already unmounted, the stop's drains go on" in caplog.text


def test_a_second_stop_after_modelfs_unmount_cuts_the_drains_short(caplog: pytest.LogCaptureFixture,
                                                                   allowed_logs: list[str]) -> None:
    allowed_logs.append("received SIGINT while stopping: the stop is cut short")
    daemon = daemon_after_unmount([signal.SIGTERM, signal.SIGINT])
    with caplog.at_level(logging.INFO, logger="fsmount.mount"):
        drains_cancelled = take(daemon)
    assert daemon.cut_short and drains_cancelled
    assert "received SIGINT while stopping: the stop is cut short, the drains are skipped" in caplog.text
