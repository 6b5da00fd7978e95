"""KV blocks between two real processes over each network backend, `tcp` (plain sockets, the
default) and `ucx` (UCX's TCP transport on loopback): exact bytes, head slicing, concurrency, and
every failure path freeing what it holds; each against an exporter whose cache is private (the
blocks go over the backend's connection) and one whose cache is in shared memory (the importer
copies them out of it: the local path). A peer that speaks the wire itself (`_raw_peer`) uses
what an attacker would: a plain socket for tcp, a UCX endpoint for ucx.
tests/integration/kvtransfer/test_tcp_hostile_peers.py goes further against the tcp listener."""

import asyncio
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")
try:
    import ucxx
except ImportError:  # the tcp backend needs no UCX
    ucxx = None

from pdserve.kvtransfer import protocol as p  # noqa: E402
from pdserve.kvtransfer.backends import BACKENDS  # noqa: E402
from pdserve.kvtransfer.blocks import block_run, gather_blocks, scatter_blocks  # noqa: E402
from tests.fakes import kv_peer  # noqa: E402
from tests.fakes.kv_exporter_proc import LAYOUT, NUM_BLOCKS, ExporterProcess as Exporter, make_cache, stall  # noqa: E402

NETWORK_BACKENDS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(ucxx is None, reason="ucxx is not installed"))]

# Which backends a test runs on. What the two network backends share is base.py's: the lease table
# (tokens, expiry, unknown requests), the layout check every pull makes before any byte moves,
# which frames a connection may send (`NetworkExporter.open_wire_read`), whether the importer can
# map the exporter's cache (`KVImporter.mapped_cache`) and the head slice. A test of only that runs
# on tcp (TCP_ONLY, with the reason at each). Each backend moves the bytes itself, so the others run
# on ucx too, for ucx_backend.py's own code: its sends from the cache or a staging buffer and its
# receives in place or staged, the local copy and its deadline, its endpoints (kept, replaced,
# capped, aborted on a failure or a timeout, carrying ERROR frames), its frame parsing (a control
# frame is one message) and `_buffer`'s bytes (bf16). (conftest.py: `leave_out` deselects.)
TCP_ONLY = pytest.mark.leave_out(backend="ucx")
# A peer that asks for the blocks over the connection, whatever the exporter's cache: on ucx the
# exporter's shared memory plays no part, so ucx against the private cache only (ucx's local path:
# test_blocks_arrive_bit_identical and the SHARED_MEMORY tests).
UCX_OVER_THE_WIRE = pytest.mark.leave_out(backend="ucx", exporter="shared-memory")
# A test of the local path: the exporter whose cache is in shared memory.
SHARED_MEMORY = pytest.mark.leave_out(exporter="wire")


def _importer(backend: str, kv: torch.Tensor, layout: p.KVLayout, **options):
    _, importer_cls = BACKENDS[backend]()
    return importer_cls(kv, layout, **options)


def _connections_created(importer) -> int:
    """Connections (UCX endpoints) the importer opened so far."""
    return importer.num_endpoints_created if hasattr(importer, "num_endpoints_created") \
        else importer.num_connections_created


@pytest.fixture(scope="module", params=NETWORK_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["wire", "shared-memory"])
def exporter(request, backend):
    e = Exporter(backend, lease_s=2.0, shared=request.param == "shared-memory")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def src():
    return make_cache()


@pytest.fixture
def importer(backend):
    kv = torch.zeros(LAYOUT["num_layers"], 2, 2048, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    imp = _importer(backend, kv, p.KVLayout(**LAYOUT))
    yield imp
    imp.close()


def _wait_all_free(exporter, timeout_s: float = 10.0) -> int:
    deadline = time.time() + timeout_s
    while exporter.free_blocks() != NUM_BLOCKS and time.time() < deadline:
        time.sleep(0.1)
    return exporter.free_blocks()


def _dst(n, offset=7):
    return [offset + 3 * i for i in range(n)]  # a scattered mapping, unlike the exporter's ids


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 1000])
def test_blocks_arrive_bit_identical(exporter, src, importer, num_tokens):
    handle = exporter.export(f"req-{num_tokens}", num_tokens)
    assert len(handle.block_ids) == -(-num_tokens // 16)
    dst = _dst(len(handle.block_ids))
    importer.pull(handle, dst)
    assert torch.equal(gather_blocks(importer.kv, dst), gather_blocks(src, list(handle.block_ids)))
    assert (handle.cache_region is not None) == exporter.shared
    assert importer.num_shared_memory_pulls == exporter.shared  # the local path wherever it is offered
    assert _wait_all_free(exporter, 5) == NUM_BLOCKS  # the ack released the lease


def test_bf16_blocks_arrive_bit_identical(backend):
    """A bf16 cache (`kv_cache_dtype: bfloat16`, or a bf16 model) moves as its bytes, in place and
    gathered (both ends in this process)."""
    from pdserve.engine.kv_cache import BlockPool

    layout = p.KVLayout(**{**LAYOUT, "dtype": "bfloat16"})
    src_bf16 = make_cache(64).bfloat16()
    pool = BlockPool(64, LAYOUT["block_size"])
    exporter = BACKENDS[backend]()[0]("prefill-bf16", src_bf16, layout, pool.incref, pool.free, lease_s=5.0)
    importer = _importer(backend, torch.zeros_like(src_bf16), layout)
    try:
        for blocks in (pool.allocate(3), pool.allocate(6)[::2]):  # one run; every other block
            handle = exporter.export(f"r{blocks[0]}", blocks, 40)
            importer.pull(handle, [7, 10, 13])
            assert torch.equal(gather_blocks(importer.kv, [7, 10, 13]), gather_blocks(src_bf16, blocks))
    finally:
        importer.close()
        exporter.close()


def test_sixteen_concurrent_transfers_do_not_mix(exporter, src, importer):
    handles = [exporter.export(f"c{i}", 40 + 17 * i) for i in range(16)]
    dsts, offset = [], 0
    for h in handles:
        dsts.append(list(range(offset, offset + len(h.block_ids))))
        offset += len(h.block_ids)
    errors = []

    def pull(h, d):
        try:
            importer.pull(h, d)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=pull, args=(h, d)) for h, d in zip(handles, dsts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for h, d in zip(handles, dsts):
        assert torch.equal(gather_blocks(importer.kv, d), gather_blocks(src, list(h.block_ids)))


@TCP_ONLY  # base.py's head slice; ucx sending sliced heads: test_pipelined_pulls_of_scattered_blocks_...
def test_tp1_to_tp2_each_rank_gets_its_heads(exporter, src, backend):
    for rank in (0, 1):
        handle = exporter.export(f"tp-rank{rank}", 100)  # one lease per pull: the ack releases it
        n = len(handle.block_ids)
        kv = torch.zeros(LAYOUT["num_layers"], 2, 64, 16, 2, LAYOUT["head_dim"])
        imp = _importer(backend, kv, p.KVLayout(**LAYOUT, tp_size=2, tp_rank=rank))
        try:
            imp.pull(handle, list(range(n)))
        finally:
            imp.close()
        expected = gather_blocks(src, list(handle.block_ids))[:, :, :, :, 2 * rank:2 * rank + 2]
        assert torch.equal(gather_blocks(kv, list(range(n))), expected)


@pytest.mark.parametrize("num_tokens", [17, 1000])  # one chunk of all slabs; one chunk per layer's K or V
def test_pipelined_pulls_of_scattered_blocks_land_exact_bytes(exporter, src, backend, num_tokens):
    """The exporter gathers chunk by chunk (its blocks are not one run), the importer scatters chunk
    by chunk or receives in place; with and without KV-head slicing."""
    for tp_size, rank in ((1, 0), (2, 0), (2, 1)):
        handle = exporter.export_scattered(f"scattered-{num_tokens}-{tp_size}-{rank}", num_tokens)
        n = len(handle.block_ids)
        assert n == 1 or block_run(list(handle.block_ids)) is None
        heads = LAYOUT["num_kv_heads"] // tp_size
        kv = torch.zeros(LAYOUT["num_layers"], 2, 256, 16, heads, LAYOUT["head_dim"])
        imp = _importer(backend, kv, p.KVLayout(**LAYOUT, tp_size=tp_size, tp_rank=rank))
        dst = list(range(n)) if rank == 1 else _dst(n)  # in place, or scattered on this side too
        try:
            imp.pull(handle, dst)
        finally:
            imp.close()
        expected = gather_blocks(src, list(handle.block_ids))[:, :, :, :, heads * rank:heads * (rank + 1)]
        assert torch.equal(gather_blocks(kv, dst), expected)
    assert _wait_all_free(exporter, 5) == NUM_BLOCKS


def test_two_ranks_read_one_lease_then_release_it(exporter, src, backend):
    """Decode TP 2 from prefill TP 1: both ranks read the same lease without acking; the
    release after the last read frees the blocks."""
    handle = exporter.export("shared-lease", 100)
    n = len(handle.block_ids)
    for rank in (0, 1):
        kv = torch.zeros(LAYOUT["num_layers"], 2, 64, 16, 2, LAYOUT["head_dim"])
        imp = _importer(backend, kv, p.KVLayout(**LAYOUT, tp_size=2, tp_rank=rank))
        try:
            imp.pull(handle, list(range(n)), ack=False)
            expected = gather_blocks(src, list(handle.block_ids))[:, :, :, :, 2 * rank:2 * rank + 2]
            assert torch.equal(gather_blocks(kv, list(range(n))), expected)
            assert exporter.free_blocks() == NUM_BLOCKS - n  # still leased
            if rank == 1:
                imp.release(handle)
        finally:
            imp.close()
    assert _wait_all_free(exporter, 5) == NUM_BLOCKS


@TCP_ONLY  # the lease table's errors; ucx carrying them in ERROR frames: test_a_request_id_without_its_
# lease_token_... (unknown), test_bad_peers_... and test_importer_gone_mid_pipeline_... (expired)
def test_unknown_request_and_expired_lease(exporter, importer):
    freed = []
    bogus = p.KVHandle("prefill-0", exporter.address, "nope", (1, 2), 20, p.KVLayout(**LAYOUT), "t")
    with pytest.raises(p.UnknownRequestError):
        importer.pull(bogus, [0, 1], on_failure=freed.extend)
    assert freed == [0, 1]
    idle = exporter.export("idle", 64)
    assert _wait_all_free(exporter, 5) == NUM_BLOCKS  # the lease (2 s) runs out with nobody pulling
    with pytest.raises(p.LeaseExpiredError) as e:
        importer.pull(idle, _dst(4))
    assert e.value.retryable


def test_a_request_id_without_its_lease_token_reads_and_releases_nothing(exporter, importer):
    handle = exporter.export("guessed", 32)
    for token in ("0" * 32, handle.lease_token[:-1] + "x", ""):
        stolen = replace(handle, lease_token=token)
        with pytest.raises(p.UnknownRequestError):
            importer.pull(stolen, _dst(2))
        importer.release(stolen)  # an ACK without the token: ignored
        assert exporter.free_blocks() == NUM_BLOCKS - 2  # the lease holds
    importer.pull(handle, _dst(2))  # the owner still reads it, and its ack frees it
    assert _wait_all_free(exporter, 5) == NUM_BLOCKS


@TCP_ONLY  # KVImporter.pull checks the layout before it calls the backend
def test_layout_mismatch_is_rejected_before_any_byte_moves(exporter, importer, backend):
    handle = exporter.export("mismatch", 32)
    other = dict(LAYOUT, block_size=32)
    imp = _importer(backend, torch.zeros(2, 2, 8, 32, 4, 64), p.KVLayout(**other))
    try:
        with pytest.raises(p.LayoutMismatchError, match="block_size"):
            imp.pull(handle, [0])
    finally:
        imp.close()
    with pytest.raises(p.LayoutMismatchError, match="decode TP >= prefill TP"):
        p.check_compatible(p.KVLayout(**LAYOUT, tp_size=2), p.KVLayout(**LAYOUT, tp_size=1))


def _kill_once_bytes_land(victim: Exporter, kv: torch.Tensor) -> threading.Thread:
    """Kill the exporter's process as soon as the first bytes of a pull land in block 0 of `kv`
    (received in place): a plain socket moves the 125 MiB below in a few tens of milliseconds on
    an idle loopback, too fast to kill at a fixed time."""
    first = kv[:, :, 0]

    def watch():
        deadline = time.monotonic() + 30
        while not first.any() and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(victim.proc.pid, signal.SIGKILL)

    return threading.Thread(target=watch, daemon=True)


@pytest.mark.slow
def test_exporter_killed_mid_transfer(importer, backend):
    victim = Exporter(backend)
    try:
        handle = victim.export("big", 2000 * 16)  # ~125 MiB of KV: a transfer that takes a while
        freed, outcome = [], {}
        importer.kv[:, :, 0] = 0

        def pull():
            t = time.monotonic()
            try:
                importer.pull(handle, list(range(2000)), timeout_s=5.0, on_failure=freed.extend)
                outcome["ok"] = True
            except p.KVTransferError as e:
                outcome["error"] = e
            outcome["elapsed"] = time.monotonic() - t

        thread = threading.Thread(target=pull)
        if backend == "tcp":
            killer = _kill_once_bytes_land(victim, importer.kv)
            killer.start()
            thread.start()
            killer.join(30)
        else:
            thread.start()
            time.sleep(0.05)
            os.kill(victim.proc.pid, signal.SIGKILL)
        thread.join(30)
    finally:
        victim.stop()
    assert "error" in outcome, "the transfer finished before the kill; make it larger"
    assert outcome["error"].retryable and outcome["elapsed"] < 8
    assert freed == list(range(2000))
    # The importer process is healthy: a fresh exporter works.
    other = Exporter(backend)
    try:
        h = other.export("after", 16)
        importer.pull(h, [0])
    finally:
        other.stop()


def _raw_peer(backend: str, address: str, *frames: bytes, read_reply: bool = True):
    """Connect to the exporter like an importer would, send raw bytes (over tcp, one `sendall` per
    frame, a moment apart), return the reply frame (or None)."""
    if backend == "tcp":
        return kv_peer.talk(address, *frames, read_reply=read_reply)

    import numpy as np

    from pdserve.kvtransfer.ucx_backend import _recv_frame, ucx_loop

    async def talk():
        host, port = address.rsplit(":", 1)
        ep = await ucxx.create_endpoint(host, int(port))
        try:
            for frame in frames:
                await ep.send(np.frombuffer(frame, dtype=np.uint8).copy())
            return await asyncio.wait_for(_recv_frame(ep), 5) if read_reply else None
        finally:
            ep.abort()

    return ucx_loop().run(talk(), 15)  # the importer's loop: one UCX loop per process


def _hold_connection(backend: str, address: str):
    """A connection to the exporter that says nothing; returns what closes it."""
    if backend == "tcp":
        return kv_peer.connect(address).close
    from pdserve.kvtransfer.ucx_backend import ucx_loop

    host, port = address.rsplit(":", 1)
    return ucx_loop().run(ucxx.create_endpoint(host, int(port)), 15).abort


def test_the_connection_cap_refuses_the_next_peer_and_keeps_serving(src, importer, backend):
    """Two peers hold connections open and silent: a third is closed at once; once they go, a pull works."""
    capped = Exporter(backend, max_connections=2)
    try:
        held = [_hold_connection(backend, capped.address) for _ in range(2)]
        deadline = time.monotonic() + 10
        while capped.connections()[1] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        read = p.encode_frame(p.READ, {"request_id": "x", "lease_token": "t", "layout": LAYOUT})
        with pytest.raises(Exception):  # closed before any answer
            _raw_peer(backend, capped.address, read)
        assert capped.connections()[1] == 2
        for close in held:
            close()
        deadline = time.monotonic() + 10
        while capped.connections()[1] > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        handle = capped.export("after-the-cap", 32)
        importer.pull(handle, _dst(2))
        assert torch.equal(gather_blocks(importer.kv, _dst(2)), gather_blocks(src, list(handle.block_ids)))
    finally:
        capped.stop()


@UCX_OVER_THE_WIRE
def test_bad_peers_get_typed_errors_and_the_exporter_keeps_serving(exporter, src, importer, backend):
    wrong_version = p.HEADER.pack(p.MAGIC, p.VERSION + 1, p.READ, 4)
    corrupt = p.HEADER.pack(b"JUNK", p.VERSION, p.READ, 4)
    for header in (wrong_version, corrupt):
        kind, reply = _raw_peer(backend, exporter.address, header)
        assert kind == p.ERROR and reply["code"] == "protocol"
    # A READ whose payload is not a map of the right fields.
    body = b"\xc1\xc1\xc1\xc1"  # msgpack's never-used byte: corrupt
    kind, reply = _raw_peer(backend, exporter.address, p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, len(body)) + body)
    assert kind == p.ERROR and reply["code"] == "protocol"
    split = p.encode_frame(p.READ, {"request_id": "split", "layout": LAYOUT})
    if backend == "ucx":
        # A frame split over two messages (protocol version 1's way): the first message, a header
        # alone, lacks its payload. (Only it is sent: the exporter answers it and closes, so a second
        # message could meet a reset connection before the reply is read.)
        kind, reply = _raw_peer(backend, exporter.address, split[:p.HEADER_SIZE])
        assert kind == p.ERROR and reply["code"] == "protocol"
        # A control frame larger than any control frame may be.
        kind, reply = _raw_peer(backend, exporter.address, bytes(p.CONTROL_FRAME_BYTES + 1))
        assert kind == p.ERROR and reply["code"] == "protocol"
    else:
        # On a stream a frame may come in pieces: the header, then its payload, is one frame (a
        # header whose payload never comes is a silent peer: test_tcp_hostile_peers.py).
        kind, reply = _raw_peer(backend, exporter.address, split[:p.HEADER_SIZE], split[p.HEADER_SIZE:])
        assert kind == p.ERROR and reply["code"] == "unknown"
        # A header that says its payload is larger than any control frame may be: refused on the
        # header alone, its payload unread.
        too_long = p.HEADER.pack(p.MAGIC, p.VERSION, p.READ, p.MAX_PAYLOAD_BYTES + 1)
        kind, reply = _raw_peer(backend, exporter.address, too_long + bytes(p.MAX_PAYLOAD_BYTES + 1))
        assert kind == p.ERROR and reply["code"] == "protocol"
    if not exporter.shared:  # a local read where the cache is private
        exporter.export("local-refused", 16)
        kind, reply = _raw_peer(backend, exporter.address, p.encode_frame(p.READ, {
            "request_id": "local-refused", "layout": LAYOUT, "local": True}))
        assert kind == p.ERROR and reply["code"] == "protocol" and "shared memory" in reply["message"]
    # An importer that asks for blocks and vanishes before reading them: the lease stays until it
    # expires (2 s here), then the blocks go back to the pool.
    handle = exporter.export("vanishing", 64)
    read = p.encode_frame(p.READ, {"request_id": "vanishing", "lease_token": handle.lease_token, "layout": LAYOUT})
    assert _raw_peer(backend, exporter.address, read, read_reply=False) is None
    assert _wait_all_free(exporter, 6) == NUM_BLOCKS
    with pytest.raises(p.LeaseExpiredError):
        importer.pull(handle, _dst(4))
    # The exporter still serves a well-formed pull.
    h = exporter.export("after-bad-peers", 40)
    importer.pull(h, _dst(3))
    assert torch.equal(gather_blocks(importer.kv, _dst(3)), gather_blocks(src, list(h.block_ids)))
    # The exporter closes a read when it has handled its end (the ACK, or the vanished peer's
    # reset), which may come just after the importer has its blocks: none may stay open.
    deadline = time.time() + 5
    while exporter.open_reads() and time.time() < deadline:
        time.sleep(0.05)
    assert exporter.open_reads() == 0


@UCX_OVER_THE_WIRE
def test_importer_gone_mid_pipeline_the_blocks_return_at_lease_expiry(exporter, src, importer, backend):
    """A peer asks for 32 MiB, takes the DATA frame and vanishes: the exporter's sends fail or run
    out of the peer's time, it lets go of the read, and the lease's expiry frees the blocks."""
    handle = exporter.export_scattered("abandoned", 500 * 16)
    read = p.encode_frame(p.READ, {"request_id": "abandoned", "lease_token": handle.lease_token, "layout": LAYOUT,
                                   "timeout_s": 1.0})
    kind, reply = _raw_peer(backend, exporter.address, read)
    assert kind == p.DATA and reply["num_chunks"] == 2 * LAYOUT["num_layers"]
    assert _wait_all_free(exporter, 10) == NUM_BLOCKS
    with pytest.raises(p.LeaseExpiredError):
        importer.pull(handle, list(range(500)))
    h = exporter.export_scattered("after-abandoned", 1000)
    importer.pull(h, _dst(63))
    assert torch.equal(gather_blocks(importer.kv, _dst(63)), gather_blocks(src, list(h.block_ids)))


# The exporter that stalls is a process of its own; `exporter` only serves the pull after the stall,
# which goes through the importer's staging path from a private cache (from a shared one it is a
# local copy: test_blocks_arrive_bit_identical's), on either backend.
@pytest.mark.leave_out(exporter="shared-memory")
def test_exporter_stalling_mid_pipeline_fails_the_pull_and_frees_its_blocks(exporter, src, importer, backend):
    """DATA and 2 of 4 chunks, then silence: the pull raises the retryable error at its deadline,
    hands its blocks back, and the next pull (through the same staging path) is exact."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    proc = ctx.Process(target=stall, args=(replies, 63, 2, None, backend), daemon=True)
    proc.start()
    try:
        kind, address = replies.get(timeout=60)
        handle = p.KVHandle("stalling", address, "stalled", tuple(range(63)), 1000, p.KVLayout(**LAYOUT), "t")
        freed = []
        with pytest.raises(p.ExporterUnreachableError) as e:
            importer.pull(handle, _dst(63), timeout_s=2.0, on_failure=freed.extend)
        assert e.value.retryable and freed == _dst(63)
    finally:
        proc.kill()
        proc.join(10)
    h = exporter.export_scattered("after-stall", 1000)
    importer.pull(h, _dst(63))
    assert torch.equal(gather_blocks(importer.kv, _dst(63)), gather_blocks(src, list(h.block_ids)))


@pytest.mark.parametrize("dst", [list(range(100, 163)), _dst(63)], ids=["in place", "staged"])
def test_a_timed_out_pull_never_writes_into_blocks_it_gave_back(importer, backend, dst):
    """The exporter sends the rest of the blocks after the importer's deadline: by then the pull
    has failed, cancelled its receives and handed its blocks back, and the caller reused them (a
    canary pattern here). The late bytes land nowhere: the canary survives."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    proc = ctx.Process(target=stall, args=(replies, 63, 1, 3.0, backend), daemon=True)
    proc.start()
    try:
        kind, address = replies.get(timeout=60)
        handle = p.KVHandle("late", address, "late", tuple(range(63)), 1000, p.KVLayout(**LAYOUT), "t")
        with pytest.raises(p.ExporterUnreachableError):
            importer.pull(handle, dst, timeout_s=1.5)
        canary = torch.full_like(gather_blocks(importer.kv, dst), -123.0)  # the blocks, reused
        scatter_blocks(importer.kv, dst, canary)
        assert replies.get(timeout=30)[0] == "late"  # the late chunks were sent (or refused)
        time.sleep(0.5)  # and any the importer would still take have landed
        assert torch.equal(gather_blocks(importer.kv, dst), canary)
    finally:
        proc.kill()
        proc.join(10)


@SHARED_MEMORY
def test_a_local_read_holds_its_blocks_until_the_importers_deadline(exporter, backend):
    """A peer that asks for a local read and never acks: the exporter answers DATA with no chunks,
    holds the blocks for the peer's time, then lets go, and the lease's expiry frees them."""
    handle = exporter.export("local-abandoned", 10 * 16)
    read = p.encode_frame(p.READ, {"request_id": "local-abandoned", "lease_token": handle.lease_token,
                                   "layout": LAYOUT, "timeout_s": 1.0, "local": True})
    kind, reply = _raw_peer(backend, exporter.address, read)
    assert kind == p.DATA and reply["local"] and reply["num_chunks"] == 0
    assert exporter.free_blocks() == NUM_BLOCKS - 10
    assert _wait_all_free(exporter) == NUM_BLOCKS


@SHARED_MEMORY
@TCP_ONLY  # KVImporter.mapped_cache's answer; the wire path it then takes is every other test's
def test_a_region_this_process_cannot_map_goes_over_the_wire(exporter, src, importer):
    """Another host's cache, or a file that is not the exporter's (its process gone, the fd number
    reused): the blocks come over the backend's connection instead, as exact."""
    for i, change in enumerate(({"file_id": (0, 0)}, {"host": "elsewhere/0"})):
        handle = exporter.export(f"unmappable-{i}", 100)
        handle = replace(handle, cache_region=replace(handle.cache_region, **change))
        importer.pull(handle, _dst(7))
        assert torch.equal(gather_blocks(importer.kv, _dst(7)), gather_blocks(src, list(handle.block_ids)))
    assert importer.num_shared_memory_pulls == 0
    assert _wait_all_free(exporter) == NUM_BLOCKS


@SHARED_MEMORY
@TCP_ONLY  # the tcp importer reads the board (lease_board.py); ucx's asks over the wire
def test_a_local_pull_asks_the_lease_board_not_the_exporter(exporter, src, importer):
    """The exporter publishes its leases on a board in shared memory: the importer checks the
    lease there before and after its copy and sends nothing but the ACK, which releases the lease."""
    handle = exporter.export("on-the-board", 100)
    assert handle.lease_board is not None and handle.lease_slot >= 0 and handle.lease_generation % 2 == 1
    importer.pull(handle, _dst(7))
    assert torch.equal(gather_blocks(importer.kv, _dst(7)), gather_blocks(src, list(handle.block_ids)))
    assert importer.num_board_reads == importer.num_shared_memory_pulls == 1
    assert _wait_all_free(exporter) == NUM_BLOCKS  # the ACK, sent without waiting, arrived
    with pytest.raises(p.UnknownRequestError):  # released: the board no longer vouches, the READ says why
        importer.pull(handle, _dst(7))
    assert importer.num_board_reads == 1


@SHARED_MEMORY
@TCP_ONLY
def test_a_lease_the_board_does_not_vouch_for_is_asked_over_the_wire(exporter, src, importer):
    """Another generation of the slot (a handle older than the slot's lease), or no slot (a full
    board): the READ decides, with the token, as before the board."""
    for i, change in enumerate(({"lease_generation": 1 << 40}, {"lease_slot": -1}, {"lease_board": None})):
        handle = exporter.export(f"off-the-board-{i}", 100)
        importer.pull(replace(handle, **change), _dst(7))
        assert torch.equal(gather_blocks(importer.kv, _dst(7)), gather_blocks(src, list(handle.block_ids)))
    assert importer.num_board_reads == 0 and importer.num_shared_memory_pulls == 3
    assert _wait_all_free(exporter) == NUM_BLOCKS


@SHARED_MEMORY
def test_a_local_copy_that_ends_past_the_deadline_is_void(exporter, importer, backend, monkeypatch):
    """The exporter holds the blocks only until the importer's deadline: a copy that ends after it
    may hold blocks reused meanwhile, so the pull fails (retryable) and hands its blocks back."""
    import importlib

    from pdserve.kvtransfer import base

    copy_blocks = base.copy_blocks

    def slow_copy(*args):
        time.sleep(1.2)
        copy_blocks(*args)

    # the copy after a READ (the backend's), or after the lease board vouched for the lease (base's)
    for module in (importlib.import_module(f"pdserve.kvtransfer.{backend}_backend"), base):
        monkeypatch.setattr(module, "copy_blocks", slow_copy)
    handle, freed = exporter.export("slow-copy", 100), []
    with pytest.raises(p.ExporterUnreachableError) as e:
        importer.pull(handle, _dst(7), timeout_s=1.0, on_failure=freed.extend)
    assert e.value.retryable and freed == _dst(7) and importer.num_shared_memory_pulls == 0
    assert _wait_all_free(exporter) == NUM_BLOCKS


def test_a_dead_exporters_cache_is_unmapped(importer, backend):
    """Pulls map the exporter's cache once; when its process dies, the next pull from it fails
    (retryable) and the importer lets go of the mapping, so the dead replica's memory is freed."""
    victim = Exporter(backend, shared=True)
    try:
        first, second = victim.export("before-death", 40), victim.export("after-death", 40)
        importer.pull(first, _dst(3))
        assert importer.num_shared_memory_pulls == 1 and first.cache_region in importer._sources
        victim.proc.kill()
        victim.proc.join(10)
        freed = []
        with pytest.raises(p.ExporterUnreachableError):
            importer.pull(second, _dst(3), timeout_s=2.0, on_failure=freed.extend)
        assert freed == _dst(3) and second.cache_region not in importer._sources
    finally:
        victim.stop()


def _mapped_inodes() -> set[int]:
    """The inodes of the memfds this process maps (a KV cache's, a lease board's)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "/memfd:" in line}


@TCP_ONLY  # KVImporter.mapped_cache's bookkeeping, the same on both backends
def test_an_exited_exporters_cache_is_unmapped_without_another_pull_from_it(importer):
    """A prefill replica killed (or removed) while nothing is pulled from it: no pull fails to tell
    the importer. The first pull from another exporter (its replacement) lets go of the exited
    one's cache and board, so the memory they hold goes back to the system."""
    victim, replacement = Exporter("tcp", shared=True), Exporter("tcp", shared=True)
    try:
        handle = victim.export("before-death", 40)
        importer.pull(handle, _dst(3))
        assert importer.num_mapped_caches == 1
        dead = {handle.cache_region.file_id[1], handle.lease_board.file_id[1]}
        assert dead <= _mapped_inodes()
        victim.proc.kill()
        victim.proc.join(10)
        importer.pull(replacement.export("elsewhere", 40), _dst(3))
        assert importer.num_shared_memory_pulls == 2
        assert importer.num_mapped_caches == 1  # the replacement's only
        assert handle.cache_region not in importer._sources and handle.lease_board not in importer._boards
        gc.collect()
        assert not dead & _mapped_inodes()
    finally:
        victim.stop()
        replacement.stop()


def test_exporter_reports_healthy_until_closed(backend):
    exporter = BACKENDS[backend]()[0]("health", make_cache(), p.KVLayout(**LAYOUT), lambda ids: None, lambda ids: None)
    assert exporter.is_healthy
    exporter.close()
    assert not exporter.is_healthy


def test_pulls_reuse_one_connection_and_replace_one_the_exporter_dropped(src, backend):
    """Consecutive pulls from one exporter go over the connection the first one opened; once the
    exporter has dropped it (idle timeout), the next pull opens a fresh one and lands exact bytes."""
    exporter = Exporter(backend, lease_s=30.0, idle_timeout_s=0.5)
    kv = torch.zeros(LAYOUT["num_layers"], 2, 2048, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    importer = _importer(backend, kv, p.KVLayout(**LAYOUT), idle_s=60.0)
    try:
        for i in range(5):
            h = exporter.export_scattered(f"reuse-{i}", 100)
            importer.pull(h, _dst(7, offset=100 * i))
            assert torch.equal(gather_blocks(kv, _dst(7, offset=100 * i)), gather_blocks(src, list(h.block_ids)))
        assert _connections_created(importer) == 1 and exporter.connections() == (1, 1)
        # What the kept connection costs the exporter while it waits (CPU time, wakeups) is
        # benchmarks/kvtransfer_idle.py's to measure.
        deadline = time.time() + 10  # the exporter drops the idle connection after 0.5 s
        while exporter.connections()[1] and time.time() < deadline:
            time.sleep(0.1)
        assert exporter.connections() == (1, 0)
        h = exporter.export("after-drop", 40)
        importer.pull(h, _dst(3))
        assert torch.equal(gather_blocks(kv, _dst(3)), gather_blocks(src, list(h.block_ids)))
        assert _connections_created(importer) == 2 and exporter.connections() == (2, 1)
        assert exporter.free_blocks() == NUM_BLOCKS  # every lease acked
    finally:
        importer.close()
        exporter.stop()
