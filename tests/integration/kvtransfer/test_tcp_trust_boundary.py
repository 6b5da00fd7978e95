"""The trust boundary of a process running the tcp backend (the default), where
test_ucx_trust_boundary.py shows UCX's TCP transport writing wherever any peer says: a prefill
process serving KV with a `TCPExporter` listens on one TCP port, the exporter's, on the one address
it was given (UCX never started: none of its listeners on every interface), and a peer without a
lease's token can neither read nor write the leased blocks through it, whatever it sends there,
UCX's PUT request included.

The exporter runs in a process of its own (tests/fakes/kv_exporter_proc.py, spawned), so that this
test process's own listeners (Ray's, UCX's from other tests) are not counted.
"""

import os
import socket
import struct
from dataclasses import replace

import pytest
import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.blocks import gather_blocks
from pdserve.kvtransfer.tcp_backend import TCPImporter
from tests.fakes import kv_peer
from tests.fakes.kv_exporter_proc import LAYOUT, NUM_BLOCKS, ExporterProcess, make_cache

HOST = "127.0.0.2"  # loopback, but not the address a socket bound to "every interface" would show

# What UCX's TCP transport accepts (test_ucx_trust_boundary.py has the format): its magic, a
# connection request, then a PUT request naming the address to write to.
UCT_MAGIC = struct.pack("<Q", 0xCAFEBABE12345678)
UCT_AM = struct.Struct("<BI")
UCT_CONN_REQ = struct.Struct("<iBQ").pack(1, 0, 7) + struct.pack("<H", socket.AF_INET) + struct.pack(">H", 9) \
    + socket.inet_aton("127.0.0.9") + bytes(8)


@pytest.fixture(scope="module")
def exporter():
    e = ExporterProcess("tcp", lease_s=60.0, host=HOST)
    yield e
    e.stop()


def test_a_tcp_exporter_process_listens_on_one_port_on_its_address_and_starts_no_ucx(exporter):
    listeners, is_ucx_imported = exporter.call("listeners")
    assert [tuple(x) for x in listeners] == [(HOST, int(exporter.address.rsplit(":", 1)[1]))]
    assert exporter.address.startswith(f"{HOST}:")
    assert not is_ucx_imported


def _attempts(handle: p.KVHandle, block_address: int) -> dict[str, bytes]:
    """What a peer without the token might send to reach the leased blocks."""
    rid, block = handle.request_id, bytes(range(256)) * 64
    read = {"request_id": rid, "layout": LAYOUT, "first_block": 0, "timeout_s": 5.0}
    put = struct.pack("<QQI", block_address, len(block), 1)
    return {
        "READ, no token": p.encode_frame(p.READ, read),
        "READ, a guessed token": p.encode_frame(p.READ, {**read, "lease_token": os.urandom(16).hex()}),
        "READ, the token's prefix": p.encode_frame(p.READ, {**read, "lease_token": handle.lease_token[:8]}),
        "READ of a later block": p.encode_frame(p.READ, {**read, "first_block": 3, "lease_token": "x"}),
        "DATA and blocks, pushed": p.encode_frame(p.DATA, {"shape": [2, 2, 4, 16, 4, 64], "num_chunks": 1}) + block,
        "ACK and blocks": p.encode_frame(p.ACK, {"request_id": rid, "lease_token": "x"}) + block,
        "DONE and blocks": p.encode_frame(p.DONE, {"request_id": rid, "lease_token": "x"}) + block,
        "UCX's PUT": (UCT_MAGIC + UCT_AM.pack(32, len(UCT_CONN_REQ)) + UCT_CONN_REQ
                      + UCT_AM.pack(33, len(put)) + put + block),
    }


def test_a_peer_without_the_lease_token_can_neither_read_nor_write_the_leased_blocks(exporter):
    handle = p.KVHandle.from_dict(exporter.call("export", "victim", 4 * LAYOUT["block_size"])[0])
    ids = list(handle.block_ids)
    before, block_address = exporter.call("digest", ids)
    [(_, port)] = exporter.call("listeners")[0]  # every port the process listens on: one
    for name, attempt in _attempts(handle, block_address).items():
        with kv_peer.connect(f"{HOST}:{port}") as s:
            try:
                s.sendall(attempt)
            except OSError:  # closed on the first bad bytes: nothing more goes in
                pass
            received = kv_peer.recv_rest(s)
        if received:  # an ERROR frame and nothing else (an ACK or DONE gets no answer)
            kind, length = p.decode_header(received[:p.HEADER_SIZE])
            assert kind == p.ERROR and len(received) == p.HEADER_SIZE + length, name
        assert exporter.call("digest", ids)[0] == before, f"{name} changed the leased blocks"
    assert exporter.call("free")[0] == NUM_BLOCKS - 4 and exporter.call("open_reads")[0] == 0  # the lease holds
    # The token's holder reads them, exact, and its ack frees them.
    kv = torch.zeros(LAYOUT["num_layers"], 2, 8, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    importer = TCPImporter(kv, p.KVLayout(**LAYOUT))
    try:
        with pytest.raises(p.UnknownRequestError):
            importer.pull(replace(handle, lease_token="0" * 32), [0, 1, 2, 3])
        importer.pull(handle, [0, 1, 2, 3])
    finally:
        importer.close()
    assert torch.equal(gather_blocks(kv, [0, 1, 2, 3]), gather_blocks(make_cache(), ids))
    assert exporter.call("free")[0] == NUM_BLOCKS
