"""The namespace lab's faults themselves (tests/harness/netns.py), on plain sockets: what the
fault tests build on must do what it says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=f"netns lab: {netns.unavailable()}")

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 9000)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    while data := c.recv(1 << 20):
        c.sendall(data)
    c.close()
"""

ROUND_TRIPS = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 9000), timeout=10)
payload = bytes(range(256)) * 4096  # 1 MiB
times = []
for _ in range(3):
    t = time.monotonic()
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += s.recv(1 << 20)
    assert got == payload
    times.append(time.monotonic() - t)
print(min(times))
"""


def _round_trip_s(node: netns.Node, peer: netns.Node) -> float:
    out = subprocess.run(node.command([sys.executable, "-c", ROUND_TRIPS, peer.ip]), capture_output=True, text=True,
                         timeout=30, check=True)
    return float(out.stdout)


def test_the_delay_relay_delays_new_connections_each_way_and_keeps_the_bytes():
    with netns.Lab() as lab:
        a, b = lab.add_node("a"), lab.add_node("b")
        echo = subprocess.Popen(b.command([sys.executable, "-c", ECHO, b.ip]), stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "ready"
        before = _round_trip_s(a, b)
        lab.delay(a, b, 100)
        after = _round_trip_s(a, b)  # a new connection: through the relay, 100 ms each way
        assert before < 0.1 and 0.2 <= after < 1.0, (before, after)
        echo.kill()
