"""A KV peer that speaks the tcp backend's wire with nothing but a socket: what an attacker has,
and what the tests' stalling exporter and raw importers use (so they do not lean on the backend's
own private helpers). A frame on the stream is its 16-byte header then its payload (protocol.py).
"""

from __future__ import annotations

import socket
import time

from pdserve.kvtransfer import protocol as p


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """`n` bytes; ConnectionResetError when the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(f"the peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, dict]:
    kind, length = p.decode_header(recv_exact(sock, p.HEADER_SIZE))
    return kind, p.decode_payload(recv_exact(sock, length))


def recv_rest(sock: socket.socket) -> bytes:
    """Every byte until the peer closes (a reset counts as closing)."""
    out = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    return bytes(out)


def connect(address: str, timeout_s: float = 5.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def talk(address: str, *frames: bytes, read_reply: bool = True, pause_s: float = 0.05):
    """Connect, send each of `frames` (`pause_s` apart, so that each can arrive on its own), and
    return the reply frame (None without `read_reply`); closes the connection."""
    with connect(address) as s:
        for i, frame in enumerate(frames):
            if i:
                time.sleep(pause_s)
            s.sendall(frame)
        return recv_frame(s) if read_reply else None
