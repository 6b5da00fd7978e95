"""Nodes on real (virtual) links for fault tests and benchmarks (issue #42): one network namespace
per node, each joined by a veth pair to a bridge in the root namespace, which holds the bridge's
address (where a Ray head in the root namespace listens). Every byte between two nodes then
crosses two veths and the bridge, where the lab can shape it: a rate limit (tc tbf), random loss
and partitions between two nodes only (nftables, so the head stays reachable from both), and a
delay (a relay on the path: this kernel has no netem).

Namespaces share the hostname, the boot id and IPC: a test must force the network path itself
(`transfer.shared_memory: false`, `UCX_TLS=tcp`), or KV never crosses the link. Needs root, `ip`
and (for loss and partitions) `nft`; `unavailable()` says why a machine cannot, for a skip. The
lab only touches what it created: names carry a per-lab tag, and `close()` removes them all.

A run killed before `close()` (SIGKILL, a CI timeout) leaves its namespaces and bridge behind; each
new lab first removes such leftovers (`sweep_stale`). A lab holds a lock on its tag while it lives
(a file under `LOCK_DIR`, which the kernel unlocks when its process dies), so a leftover is one of
the lab's names (`pdns<tag>-<n>`, `pdbr<tag>`) whose tag no live lab holds, and a namespace is
removed only while no process runs in it (with its bridge only when none of its tag's does)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
DELAY_MARK = 0x2A  # the delay relay marks its own connections with it (delay_relay.MARK)
REPO = Path(__file__).parents[2]
LOCK_DIR = Path("/run/pdserve-netns-lab")  # <tag>.lock, locked by the lab that holds the tag
# The lab's names (tags are digits: the subnet is derived from them); nothing else is ever swept.
NETNS_NAME = re.compile(r"pdns(\d+)-\d+")
BRIDGE_NAME = re.compile(r"pdbr(\d+)")


def unavailable() -> str | None:
    """Why this machine cannot host a lab (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, nftables)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if not shutil.which(tool):
            return f"needs `{tool}` (apt-get install {package})"
    return None


def enter(netns: str) -> None:
    """Move this process into network namespace `netns`. Call it before any thread starts (torch,
    UCX and Ray start threads): setns moves the calling thread only."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


# The lab's own commands run in the namespace it was made in (through nsenter and a descriptor of
# that namespace), so a process that has entered a node's namespace can still shape and close it.
_ROOT_NS: int | None = None


def _run(argv: list[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    global _ROOT_NS
    if _ROOT_NS is None:
        _ROOT_NS = os.open("/proc/self/ns/net", os.O_RDONLY)
    return subprocess.run(["nsenter", f"--net=/proc/self/fd/{_ROOT_NS}", *argv], pass_fds=(_ROOT_NS,),
                          check=check, capture_output=True, text=True, input=input)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _nft(netns: str, script: str) -> None:
    _run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=script)


def _lock_tag(tag: str) -> int | None:
    """A descriptor holding the lock on `tag`, or None when a live lab holds it. The file is
    checked to still be the one at the path after locking: a sweep unlinks the files it claims."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    path = LOCK_DIR / f"{tag}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # unlinked by a sweep meanwhile: lock the new file


def _unlock_tag(tag: str, fd: int) -> None:
    (LOCK_DIR / f"{tag}.lock").unlink(missing_ok=True)  # while still locked: see `_lock_tag`
    os.close(fd)


def _names(argv: list[str], pattern: re.Pattern, key: str) -> dict[str, list[str]]:
    """tag -> the names in `ip -j ...`'s listing that `pattern` matches whole."""
    tags: dict[str, list[str]] = {}
    for entry in json.loads(_run(argv).stdout or "[]"):
        if m := pattern.fullmatch(entry.get(key, "")):
            tags.setdefault(m[1], []).append(m[0])
    return tags


def sweep_stale() -> list[str]:
    """Remove what labs killed before `close()` left behind: namespaces and bridges with the lab's
    names whose tag no live lab holds, a namespace only when no process runs in it (a node's veth
    pair goes with it), a bridge only when no namespace of its tag is kept. Returns the names removed."""
    namespaces = _names(["ip", "-j", "netns", "list"], NETNS_NAME, "name")
    bridges = _names(["ip", "-j", "link", "show", "type", "bridge"], BRIDGE_NAME, "ifname")
    locks = {p.stem for p in LOCK_DIR.glob("*.lock") if p.stem.isdigit()} if LOCK_DIR.is_dir() else set()
    removed = []
    for tag in sorted(set(namespaces) | set(bridges) | locks):
        fd = _lock_tag(tag)
        if fd is None:  # its lab is alive
            continue
        try:
            kept = False
            for netns in namespaces.get(tag, []):
                if _run(["ip", "netns", "pids", netns], check=False).stdout.split():
                    kept = True
                elif _run(["ip", "netns", "del", netns], check=False).returncode == 0:
                    removed.append(netns)
            for bridge in bridges.get(tag, []) if not kept else []:
                if _run(["ip", "link", "del", bridge], check=False).returncode == 0:
                    removed.append(bridge)
        finally:
            _unlock_tag(tag, fd)
    return removed


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    ip: str
    veth: str  # the root-side end of its link

    def command(self, argv: list[str]) -> list[str]:
        """argv, run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Lab:
    """A bridge and its nodes. Use as a context manager: everything is removed on exit."""

    def __init__(self, tag: str | None = None):
        sweep_stale()
        self.tag, self._lock = self._claim(tag)
        self.bridge = f"pdbr{self.tag}"
        # 10.200-249.x.0/24, chosen per lab so two labs on one machine do not meet.
        self.subnet = f"10.{200 + int(self.tag) % 50}.{int(self.tag) // 50 % 250}"
        self.head_ip = f"{self.subnet}.1"
        self.nodes: dict[str, Node] = {}
        self._relays: list[tuple[Node, int, subprocess.Popen]] = []  # (node, port, relay)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    @staticmethod
    def _claim(tag: str | None) -> tuple[str, int]:
        """A tag no live lab holds (`tag` itself when given: digits) and its lock."""
        for _ in range(100):
            candidate = tag or f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
            if not candidate.isdigit():
                raise ValueError(f"a lab's tag is digits, not {candidate!r}")
            fd = _lock_tag(candidate)
            if fd is not None:
                return candidate, fd
            if tag:
                break
        raise RuntimeError(f"no free lab tag ({tag!r} is held by a live lab)" if tag else "no free lab tag")

    def add_node(self, name: str) -> Node:
        index = len(self.nodes)
        node = Node(name, f"pdns{self.tag}-{index}", f"{self.subnet}.{11 + index}", f"pdve{self.tag}{index}")
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        _ip("link", "set", node.veth, "master", self.bridge, "up")
        _ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
        _ip("-n", node.netns, "link", "set", "eth0", "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip("-n", node.netns, "route", "add", "default", "via", self.head_ip)
        _nft(node.netns, "table inet pdserve_lab {\n"
                         "  set cut { type ipv4_addr; }\n"
                         "  chain out { type filter hook output priority 0; ip daddr @cut drop; }\n"
                         "  chain in { type filter hook input priority 0; ip saddr @cut drop; }\n"
                         "}\n")
        self.nodes[name] = node
        return node

    # -- faults --------------------------------------------------------------------------------

    def partition(self, a: Node, b: Node) -> None:
        """Drop every packet between a and b (both directions); each still reaches the others."""
        for node, peer in ((a, b), (b, a)):
            _nft(node.netns, f"add element inet pdserve_lab cut {{ {peer.ip} }}\n")

    def heal(self, a: Node, b: Node) -> None:
        for node, peer in ((a, b), (b, a)):
            _nft(node.netns, f"delete element inet pdserve_lab cut {{ {peer.ip} }}\n")

    def loss(self, node: Node, percent: int, peer: Node | None = None) -> None:
        """Drop `percent`% of the packets `node` sends (to `peer` only, when given), at random;
        0 removes the rule."""
        to = f"ip daddr {peer.ip} " if peer else ""
        _nft(node.netns, "add chain inet pdserve_lab loss { type filter hook output priority 1; }\n"
                         "flush chain inet pdserve_lab loss\n"
                         + (f"add rule inet pdserve_lab loss oifname \"eth0\" {to}numgen random mod 100 < {percent} drop\n"
                            if percent else ""))

    def rate(self, node: Node, mbit: int | None) -> None:
        """Limit what `node` sends to `mbit` Mbit/s (None removes the limit)."""
        base = ["ip", "netns", "exec", node.netns, "tc", "qdisc"]
        _run([*base, "del", "dev", "eth0", "root"], check=False)
        if mbit:
            _run([*base, "add", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb",
                  "latency", "100ms"])

    def delay(self, node: Node, peer: Node, ms: float) -> None:
        """Delay every TCP connection `node` opens to `peer` from now on by `ms` each way, through
        a relay in `node`'s namespace (tests/harness/delay_relay.py; this kernel has no netem).
        Connections open before keep their path: call it before the traffic starts."""
        # Its port from the kernel: a fixed one can be held by a Ray worker of the node (10002-19999).
        relay = subprocess.Popen(node.command([sys.executable, "-m", "tests.harness.delay_relay",
                                               "--delay-ms", str(ms)]),
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, port = relay.stdout.readline().strip().partition(" ")
        if ready != "ready":
            relay.kill()
            raise RuntimeError(f"the delay relay in {node.netns} did not start")
        self._relays.append((node, int(port), relay))
        _nft(node.netns, f"table ip pdserve_delay_{port} {{\n"
                         f"  chain out {{ type nat hook output priority -100;\n"
                         f"    ip daddr {peer.ip} meta l4proto tcp meta mark != {DELAY_MARK} redirect to :{port}; }}\n"
                         "}\n")

    def reset(self) -> None:
        """Undo every fault: partitions healed, no loss, no rate limit, no relay (its redirect and its
        connections gone with it), so that a lab shared by several tests' apps gives each the links
        `add_node` made."""
        for node in self.nodes.values():
            _nft(node.netns, "flush set inet pdserve_lab cut\n")
            self.loss(node, 0)
            self.rate(node, None)
        for node, port, relay in self._relays:
            _nft(node.netns, f"delete table ip pdserve_delay_{port}\n")
            relay.kill()
            relay.wait(10)
        self._relays.clear()

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what still runs in the nodes, then remove the nodes and the bridge."""
        for node in self.nodes.values():
            pids = _run(["ip", "netns", "pids", node.netns], check=False).stdout.split()
            for pid in pids:
                if int(pid) != os.getpid():
                    try:
                        os.kill(int(pid), 9)
                    except ProcessLookupError:
                        pass
            _run(["ip", "netns", "del", node.netns], check=False)
            _run(["ip", "link", "del", node.veth], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        self.nodes.clear()
        for _, _, relay in self._relays:  # killed with their namespace; reaped here
            relay.wait(10)
        self._relays.clear()
        if self._lock is not None:
            _unlock_tag(self.tag, self._lock)
            self._lock = None

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
