"""The namespace lab's faults themselves (tests/harness/netns.py), on plain sockets: what the
fault tests build on must do what it says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import netns
from tests.harness.waiting import wait_until

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


def _netns_exists(name: str) -> bool:
    return name in {e["name"] for e in json.loads(subprocess.run(["ip", "-j", "netns", "list"], capture_output=True,
                                                                text=True, check=True).stdout or "[]")}


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True, check=False).returncode == 0


def test_a_new_lab_sweeps_what_killed_labs_left_but_keeps_namespaces_with_a_process_and_live_labs():
    # Tags of seven digits: a lab draws six, so no running lab's names are touched by this test.
    stale, busy = (f"{d}{os.getpid() % 1000000:06d}" for d in (8, 9))
    stale_ns, busy_ns, foreign_ns = f"pdns{stale}-0", f"pdns{busy}-0", f"pdns{stale}"  # the last: not a lab's name
    for name in (stale_ns, busy_ns, foreign_ns):  # as a lab killed before close() leaves them
        subprocess.run(["ip", "netns", "add", name], check=True)
    for tag in (stale, busy):
        subprocess.run(["ip", "link", "add", f"pdbr{tag}", "type", "bridge"], check=True)
    netns.LOCK_DIR.mkdir(parents=True, exist_ok=True)
    (netns.LOCK_DIR / f"{stale}.lock").touch()  # its lab died holding it: the kernel let go
    sleeper = subprocess.Popen(["ip", "netns", "exec", busy_ns, "sleep", "60"])
    try:
        wait_until(lambda: subprocess.run(["ip", "netns", "pids", busy_ns], capture_output=True, text=True,
                                          check=False).stdout.split(), 10, "the process in the busy namespace")
        with netns.Lab() as live:
            live_node = live.add_node("a")  # no process in it: only its lab's lock keeps it
            assert not _netns_exists(stale_ns) and not _link_exists(f"pdbr{stale}")
            assert not (netns.LOCK_DIR / f"{stale}.lock").exists()
            assert _netns_exists(busy_ns) and _link_exists(f"pdbr{busy}")  # a process lives there
            assert _netns_exists(foreign_ns)  # not a name a lab makes
            with netns.Lab():
                assert _netns_exists(live_node.netns) and _link_exists(live.bridge)
        assert not _netns_exists(live_node.netns) and not (netns.LOCK_DIR / f"{live.tag}.lock").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        for name in (stale_ns, busy_ns, foreign_ns):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        for tag in (stale, busy):
            subprocess.run(["ip", "link", "del", f"pdbr{tag}"], capture_output=True, check=False)
            (netns.LOCK_DIR / f"{tag}.lock").unlink(missing_ok=True)
