"""The metrics endpoint's hold on the daemon: connections time out, are capped, and a failing accept() waits."""

from __future__ import annotations

import errno
import os
import socket
import socketserver
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from fsmount import prometheus
from fsmount.prometheus import MetricsServer
from tests.helpers import expects_warning


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    served = MetricsServer("127.0.0.1:0")
    served.start(stats=None)  # type: ignore[arg-type] - never scraped here
    yield served
    served.close()


def port_of(server: MetricsServer) -> int:
    return server._server.server_address[1]


def test_an_idle_metrics_connection_is_closed_by_the_daemon(server: MetricsServer) -> None:
    """A client that connects and never finishes its request held a thread and a descriptor of the daemon."""
    with socket.create_connection(("127.0.0.1", port_of(server))) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\n")  # no blank line: the request never ends
        client.settimeout(10)  # HANDLER_TIMEOUT_S and then some
        assert client.recv(1024) == b""  # closed, without an answer


def test_connections_beyond_the_cap_are_closed_at_once_and_slots_come_back(server: MetricsServer) -> None:
    port = port_of(server)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(prometheus.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # every one accepted and holding its thread
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.settimeout(1)  # well under HANDLER_TIMEOUT_S: closed at accept, not by the timeout
            assert extra.recv(1024) == b""
    finally:
        for c in idle:
            c.close()
    time.sleep(0.3)  # their threads end, and give their slots back
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.settimeout(5)
        client.sendall(b"GET /nothing HTTP/1.0\r\n\r\n")
        assert client.recv(1024).startswith(b"HTTP/1.0 404")


@expects_warning("metrics: cannot accept a connection")
def test_a_failing_accept_waits_before_it_is_tried_again(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    """At the daemon's fd limit accept() fails with EMFILE and the listening socket stays readable: the metrics
    thread went straight back to accept(), 60-95% of a core while every read of the mount failed."""
    tries: list[float] = []
    served = MetricsServer("127.0.0.1:0")

    def out_of_descriptors() -> None:
        tries.append(time.monotonic())
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(socketserver.TCPServer, "get_request", lambda self: out_of_descriptors())
    served.start(stats=None)  # type: ignore[arg-type]
    try:  # a connection waits in the backlog: the listening socket is readable all along
        with socket.create_connection(("127.0.0.1", port_of(served))):
            time.sleep(1.0)
    finally:
        served.close()
    assert 1 <= len(tries) <= 1.0 / prometheus.ACCEPT_BACKOFF_S + 2, len(tries)
    assert sum("cannot accept" in r.getMessage() for r in caplog.records) == 1  # once, not once a try


def test_the_metrics_thread_does_not_spin_when_the_daemon_is_out_of_descriptors() -> None:
    """As measured on a mount: the process at its RLIMIT_NOFILE, clients still connecting."""
    script = r'''
import os, resource, socket, time
from fsmount.prometheus import MetricsServer
from tests.helpers import expects_warning
server = MetricsServer("127.0.0.1:0"); server.start(stats=None)
port = server._server.server_address[1]
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 10, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
clients = []
for _ in range(30):  # the clients' own descriptors count too: a few are refused, the server's side fills up
    try:
        clients.append(socket.create_connection(("127.0.0.1", port), timeout=1))
    except OSError:
        break
time.sleep(0.5)
t0 = sum(os.times()[:2]); time.sleep(2); print(sum(os.times()[:2]) - t0)
os._exit(0)
'''
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    cpu = float(done.stdout.strip().splitlines()[-1])
    assert cpu < 0.5, f"the metrics thread used {cpu:.2f} s of CPU in 2 s while out of descriptors"
