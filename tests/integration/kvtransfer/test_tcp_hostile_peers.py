"""Hostile peers against the tcp backend's listener (`TCPExporter`), with nothing but a socket:
exactly what anyone who can reach the exporter's address has. Each attack ends with an honest
pull from the same exporter landing exact bytes, and with nothing left behind: no lease, no open
read (`leases.num_open_reads`), no connection (`num_open_connections`), every block back in the
pool. The exporter runs in this process (its counters read directly) with short timeouts.
"""

import os
import select
import socket
import threading
import time
import tracemalloc

import pytest
import torch

from pdserve.engine.kv_cache import BlockPool
from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.blocks import gather_blocks
from pdserve.kvtransfer.tcp_backend import TCPExporter, TCPImporter
from tests.fakes import kv_peer
from tests.fakes.kv_exporter_proc import LAYOUT, make_cache

NUM_BLOCKS = 128
ACK_TIMEOUT_S = 1.5  # how long a peer may take to send its first frame
MAX_CONNECTIONS = 8


class Victim:
    """A prefill replica's exporter and the pool its leases pin."""

    def __init__(self, src: torch.Tensor, **options):
        self.src, self.pool = src, BlockPool(NUM_BLOCKS, LAYOUT["block_size"])
        options = {"lease_s": 5.0, "ack_timeout_s": ACK_TIMEOUT_S, "idle_timeout_s": 5.0,
                   "max_connections": MAX_CONNECTIONS, **options}
        self.exporter = TCPExporter("victim", src, p.KVLayout(**LAYOUT), self.pool.incref, self.pool.free,
                                    shared_memory=False, **options)  # the blocks go over the socket
        self.address = self.exporter.address

    def export(self, request_id: str, num_blocks: int) -> p.KVHandle:
        blocks = self.pool.allocate(num_blocks)
        handle = self.exporter.export(request_id, blocks, num_blocks * LAYOUT["block_size"])
        self.pool.free(blocks)  # the lease holds them now
        return handle

    def honest_pull(self, importer: TCPImporter, request_id: str, num_blocks: int = 3) -> None:
        handle = self.export(request_id, num_blocks)
        dst = [5 + 2 * i for i in range(num_blocks)]
        importer.pull(handle, dst, timeout_s=5.0)
        assert torch.equal(gather_blocks(importer.kv, dst), gather_blocks(self.src, list(handle.block_ids)))

    def wait_until_clean(self, timeout_s: float = ACK_TIMEOUT_S + 5) -> None:
        """Nothing left: no connection, open read or lease, every block back in the pool."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._left():
            time.sleep(0.05)
        assert not self._left()

    def _left(self) -> dict:
        e = self.exporter
        left = {"connections": e.num_open_connections, "open reads": e.leases.num_open_reads,
                "leases": len(e.leases), "blocks pinned": NUM_BLOCKS - self.pool.num_free_blocks}
        return {k: v for k, v in left.items() if v}


@pytest.fixture(scope="module")
def victim():
    v = Victim(make_cache(NUM_BLOCKS))
    yield v
    v.exporter.close()


@pytest.fixture
def importer():
    kv = torch.zeros(LAYOUT["num_layers"], 2, NUM_BLOCKS, LAYOUT["block_size"], LAYOUT["num_kv_heads"],
                     LAYOUT["head_dim"])
    imp = TCPImporter(kv, p.KVLayout(**LAYOUT))
    yield imp
    imp.close()  # its kept connection goes: the exporter's count must come back to 0


@pytest.fixture(autouse=True)
def nothing_left_after(victim):
    yield
    victim.wait_until_clean()


def _is_closed(s: socket.socket, within_s: float) -> bool:
    """The exporter closed `s` (end of stream or reset) within `within_s`, having sent nothing."""
    s.settimeout(within_s)
    try:
        return kv_peer.recv_rest(s) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize("sent", [b"", p.encode_frame(p.READ, {"request_id": "x"})[:p.HEADER_SIZE],
                                  p.encode_frame(p.READ, {"request_id": "x"})[:7]],
                         ids=["nothing", "a header, no payload", "half a header"])
def test_a_peer_that_says_nothing_is_dropped_after_ack_timeout(victim, importer, sent):
    t = time.monotonic()
    with kv_peer.connect(victim.address) as s:
        s.sendall(sent)
        assert _is_closed(s, ACK_TIMEOUT_S + 5)
    elapsed = time.monotonic() - t
    assert ACK_TIMEOUT_S - 0.1 < elapsed < ACK_TIMEOUT_S + 3
    victim.honest_pull(importer, f"after-silence-{len(sent)}")


@pytest.mark.parametrize("claimed", [p.MAX_PAYLOAD_BYTES + 1, 1 << 30, 1 << 60])
def test_a_header_claiming_a_huge_payload_is_refused_unread(victim, importer, claimed):
    """Refused on the header alone (an ERROR at once, not after waiting for the payload), with no
    buffer of the claimed size allocated."""
    tracemalloc.start()
    try:
        with kv_peer.connect(victim.address) as s:
            t = time.monotonic()
            s.sendall(p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, claimed) + os.urandom(1024))
            kind, reply = kv_peer.recv_frame(s)
            answered_s = time.monotonic() - t
            assert _is_closed(s, 5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kind == p.ERROR and reply["code"] == "protocol" and str(claimed) in reply["message"]
    assert answered_s < ACK_TIMEOUT_S and peak < 1 << 20
    victim.honest_pull(importer, f"after-huge-{claimed}")


GARBAGE = {
    "random bytes": b"\x00JUNK" + os.urandom(4091),
    "another protocol version": p.HEADER.pack(p.MAGIC, p.VERSION + 1, p.READ, 8) + bytes(8),
    "an unknown frame kind": p.HEADER.pack(p.MAGIC, p.VERSION, 99, 8) + bytes(8),
    "a payload that is not msgpack": p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, 4) + b"\xc1" * 4,
    "a payload that is not a map": p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, 1) + b"\x07",
    "an empty payload": p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, 0),
    "a READ without a layout": p.encode_frame(p.READ, {"request_id": "x", "lease_token": "t"}),
    "a READ with a garbage layout": p.encode_frame(p.READ, {"request_id": "x", "layout": {"evil": 1}}),
    "a DATA frame to the exporter": p.encode_frame(p.DATA, {"shape": [1], "num_chunks": 1}) + os.urandom(4096),
    "UCX's TCP transport's magic": (0xCAFEBABE12345678).to_bytes(8, "little") + os.urandom(64),
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_gets_a_protocol_error_and_the_connection_closed(victim, importer, garbage, request):
    with kv_peer.connect(victim.address) as s:
        s.sendall(garbage)
        kind, reply = kv_peer.recv_frame(s)
        assert kind == p.ERROR and reply["code"] == "protocol"
        assert _is_closed(s, 5)
    victim.honest_pull(importer, f"after-{request.node.callspec.id}")


def test_a_read_without_the_lease_token_gets_an_error_and_no_block_bytes(victim, importer):
    """Every way of naming a leased request without its token: an ERROR frame ("unknown": the
    request's existence is not revealed either), then the connection closes, with not one byte
    of the blocks sent. ACKs and DONEs with those tokens release nothing."""
    handle, other = victim.export("victim-lease", 4), victim.export("other-lease", 2)
    base = {"request_id": handle.request_id, "layout": LAYOUT}
    tokens = {"absent": {}, "empty": {"lease_token": ""}, "zeros": {"lease_token": "0" * 32},
              "one character off": {"lease_token": handle.lease_token[:-1] + "x"},
              "another lease's": {"lease_token": other.lease_token},
              "not a string": {"lease_token": 12345}, "its bytes": {"lease_token": handle.lease_token.encode()}}
    for token in tokens.values():
        # A local read is refused first here (the cache is private), a token that is not a string
        # before any lease is looked up: neither says whether the request exists.
        malformed = not isinstance(token.get("lease_token", ""), str)
        for local in (False, True):
            with kv_peer.connect(victim.address) as s:
                s.sendall(p.encode_frame(p.READ, {**base, **token, "local": local}))
                kind, reply = kv_peer.recv_frame(s)
                assert kind == p.ERROR and reply["code"] == ("protocol" if local or malformed else "unknown")
                assert kv_peer.recv_rest(s) == b""  # nothing follows the ERROR: no DATA, no block bytes
        for kind in (p.ACK, p.DONE):
            kv_peer.talk(victim.address, p.encode_frame(kind, {"request_id": handle.request_id, **token}),
                         read_reply=False)
    for rid in ([handle.request_id], {"id": handle.request_id}, 7):  # not a string: refused before any lookup
        with kv_peer.connect(victim.address) as s:
            s.sendall(p.encode_frame(p.READ, {**base, "request_id": rid, "lease_token": handle.lease_token}))
            kind, reply = kv_peer.recv_frame(s)
            assert kind == p.ERROR and reply["code"] == "protocol"
    time.sleep(0.2)  # the last ACK read and ignored
    assert victim.pool.num_free_blocks == NUM_BLOCKS - 6 and len(victim.exporter.leases) == 2
    assert victim.exporter.leases.num_open_reads == 0
    for h in (handle, other):  # the owners still read their leases, and their acks free the blocks
        dst = list(range(40, 40 + len(h.block_ids)))
        importer.pull(h, dst)
        assert torch.equal(gather_blocks(importer.kv, dst), gather_blocks(victim.src, list(h.block_ids)))


def test_an_ack_that_releases_nothing_ends_the_connection(victim):
    """An ACK is answered by nothing. One that releases a lease (as an importer sends after a read
    the lease board vouched for) leaves the connection open for the importer's next frame; one
    that releases nothing closes it at once, so a peer cannot keep the exporter's thread spinning
    on ACKs."""
    handle, other = victim.export("acked", 2), victim.export("not-acked", 2)
    with kv_peer.connect(victim.address) as s:
        s.sendall(p.encode_frame(p.ACK, {"request_id": handle.request_id, "lease_token": handle.lease_token}))
        assert not _is_closed(s, 0.5) and len(victim.exporter.leases) == 1  # released; the connection stays
        s.sendall(p.encode_frame(p.ACK, {"request_id": other.request_id, "lease_token": "0" * 32}))
        assert _is_closed(s, 5.0)
    assert len(victim.exporter.leases) == 1  # the wrong token released nothing
    assert victim.exporter.ack(other.request_id, other.lease_token)


def test_a_flood_of_connections_over_the_cap_is_refused_then_pulls_work(importer):
    """`max_connections` held silent (an exporter whose peers may wait long for their first frame):
    every connection over the cap is closed at once, a pull meanwhile fails fast and retryable;
    once the flood goes, pulls work and nothing is left."""
    flooded = Victim(make_cache(NUM_BLOCKS), ack_timeout_s=60.0)
    flood: list[socket.socket] = []
    try:
        flood = [kv_peer.connect(flooded.address) for _ in range(MAX_CONNECTIONS)]
        over = []
        for _ in range(8):
            try:
                over.append(kv_peer.connect(flooded.address))
            except ConnectionResetError:  # refused before connect() returned (this process woke late)
                pass
        flood += over
        deadline = time.monotonic() + 10
        while flooded.exporter.num_open_connections < MAX_CONNECTIONS:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert all(_is_closed(s, 5) for s in over)  # the kernel queues them in order
        assert not select.select(flood[:MAX_CONNECTIONS], [], [], 0)[0]  # the first ones still held
        assert flooded.exporter.num_open_connections == MAX_CONNECTIONS
        freed, during = [], flooded.export("during-the-flood", 2)
        with pytest.raises(p.ExporterUnreachableError) as e:
            importer.pull(during, [0, 1], timeout_s=2.0, on_failure=freed.extend)
        assert e.value.retryable and freed == [0, 1]
        for s in flood:
            s.close()
        deadline = time.monotonic() + 10
        while flooded.exporter.num_open_connections:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        flooded.honest_pull(importer, "after-the-flood")
        assert flooded.exporter.ack(during.request_id, during.lease_token)  # the decode replica gave up on it
        importer.close()  # its kept connection
        flooded.wait_until_clean()
    finally:
        for s in flood:
            s.close()
        flooded.exporter.close()


def test_a_slowloris_peer_cannot_hold_the_listener(victim, importer):
    """Peers sending a READ one byte a second: each is dropped at `ack_timeout_s` (the deadline
    covers the whole first frame, not each byte), and meanwhile honest pulls go through."""
    frame = p.encode_frame(p.READ, {"request_id": "slow", "lease_token": "t", "layout": LAYOUT})
    results = []

    def slowloris():
        t, sent = time.monotonic(), 0
        with kv_peer.connect(victim.address) as s:
            try:
                for byte in frame:
                    s.sendall(bytes([byte]))
                    sent += 1
                    readable, _, _ = select.select([s], [], [], 1.0)  # one byte a second, unless closed
                    if readable and not s.recv(1):
                        break
            except OSError:  # reset by the exporter
                pass
        results.append((sent, time.monotonic() - t))

    peers = [threading.Thread(target=slowloris) for _ in range(3)]
    for t in peers:
        t.start()
    deadline = time.monotonic() + 5
    while victim.exporter.num_open_connections < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i in range(5):  # while the slow peers are connected
        victim.honest_pull(importer, f"beside-slowloris-{i}")
    for t in peers:
        t.join(ACK_TIMEOUT_S + 10)
    assert len(results) == 3
    for sent, held_s in results:
        assert sent < len(frame) and held_s < ACK_TIMEOUT_S + 3
