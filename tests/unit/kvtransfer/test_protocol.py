"""Transfer protocol and block bookkeeping, without sockets."""

from dataclasses import replace

import msgpack
import pytest
import torch

from pdserve.engine.kv_cache import BlockPool
from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.blocks import LeaseTable, cache_bits, copy_blocks, gather_blocks, scatter_blocks
from pdserve.engine.cuda_ipc import CudaRegion
from pdserve.engine.shared_memory import SharedRegion

LAYOUT = p.KVLayout("m", num_layers=2, block_size=16, num_kv_heads=8, head_dim=64, dtype="float32")


def test_frames_round_trip_and_reject_garbage():
    frame = p.encode_frame(p.READ, {"request_id": "r1", "n": 3})
    kind, length = p.decode_header(frame[:p.HEADER_SIZE])
    assert kind == p.READ and p.decode_payload(frame[p.HEADER_SIZE:p.HEADER_SIZE + length]) == {"request_id": "r1", "n": 3}
    with pytest.raises(p.ProtocolError, match="short"):
        p.decode_header(frame[:10])
    with pytest.raises(p.ProtocolError, match="magic"):
        p.decode_header(b"HTTP" + frame[4:p.HEADER_SIZE])
    with pytest.raises(p.ProtocolError, match=f"version {p.VERSION - 1}"):
        p.decode_header(p.HEADER.pack(p.MAGIC, p.VERSION - 1, p.READ, 5))
    with pytest.raises(p.ProtocolError, match="kind"):
        p.decode_header(p.HEADER.pack(p.MAGIC, p.VERSION, 99, 5))
    with pytest.raises(p.ProtocolError, match="length"):
        p.decode_header(p.HEADER.pack(p.MAGIC, p.VERSION, p.DATA, 1 << 40))
    with pytest.raises(p.ProtocolError, match="corrupt"):
        p.decode_payload(b"\xc1\xff")
    with pytest.raises(p.ProtocolError, match="not a map"):
        p.decode_payload(msgpack.packb([1, 2]))


def test_a_frame_is_one_message_read_from_a_larger_buffer():
    frame = p.encode_frame(p.DATA, {"shape": [2, 2, 3]})
    padded = frame + bytes(p.CONTROL_FRAME_BYTES - len(frame))  # the receive buffer's unused rest
    assert p.decode_frame(padded) == (p.DATA, {"shape": [2, 2, 3]})
    with pytest.raises(p.ProtocolError, match="short frame"):
        p.decode_frame(frame[:-1])
    with pytest.raises(p.ProtocolError):  # a header sent alone: its payload reads as zeros
        p.decode_frame(frame[:p.HEADER_SIZE] + bytes(64))


def test_chunks_cover_every_slab_once_in_order():
    assert p.chunk_bounds(16, 2 << 20) == [(s, s + 1) for s in range(16)]  # large slabs: one each
    small = p.chunk_bounds(64, 40 << 10)  # 40 KiB slabs go together up to MIN_CHUNK_BYTES
    assert small[0] == (0, 7) and small[-1] == (63, 64)
    assert [s for a, b in small for s in range(a, b)] == list(range(64))


def test_handle_round_trips_through_plain_data():
    h = p.KVHandle("prefill-0", "127.0.0.1:1234", "r", (3, 4, 5), 40, LAYOUT, "ab" * 16)
    wire = msgpack.unpackb(msgpack.packb(h.to_dict()))
    assert p.KVHandle.from_dict(wire) == h
    shared = replace(h, cache_region=SharedRegion("host/boot", 77, 11, (1, 6157), 1 << 20))
    assert p.KVHandle.from_dict(msgpack.unpackb(msgpack.packb(shared.to_dict()))) == shared
    on_gpu = replace(h, cache_region=CudaRegion("host/boot", 77, "GPU-5d1c", "ab" * 32, 1 << 20, 0,
                                                b"/torch_77_1_0".hex(), 8, "cd" * 32, True))
    assert p.KVHandle.from_dict(msgpack.unpackb(msgpack.packb(on_gpu.to_dict()))) == on_gpu
    with pytest.raises(p.ProtocolError):
        p.KVHandle.from_dict({"request_id": "r"})


@pytest.mark.parametrize("prefill_tp, decode_tp, rank, local", [
    (1, 1, 0, (0, 8)), (1, 2, 1, (4, 8)), (2, 4, 1, (2, 4)), (2, 4, 2, (0, 2)), (1, 8, 5, (5, 6)),
])
def test_head_slices(prefill_tp, decode_tp, rank, local):
    exporter = p.KVLayout(**{**LAYOUT.__dict__, "tp_size": prefill_tp, "tp_rank": rank // (decode_tp // prefill_tp)})
    importer = p.KVLayout(**{**LAYOUT.__dict__, "tp_size": decode_tp, "tp_rank": rank})
    assert p.head_slice(exporter, importer) == local


def test_fewer_heads_than_ranks_replicates_one_head():
    two = {**LAYOUT.__dict__, "num_kv_heads": 2}
    exporter = p.KVLayout(**two)
    assert [p.head_slice(exporter, p.KVLayout(**{**two, "tp_size": 4, "tp_rank": r})) for r in range(4)] == \
        [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_incompatible_layouts():
    with pytest.raises(p.LayoutMismatchError, match="dtype"):
        p.check_compatible(LAYOUT, p.KVLayout(**{**LAYOUT.__dict__, "dtype": "bfloat16"}))
    with pytest.raises(p.LayoutMismatchError, match="model_id"):
        p.check_compatible(LAYOUT, p.KVLayout(**{**LAYOUT.__dict__, "model_id": "other"}))
    with pytest.raises(p.LayoutMismatchError, match="multiple"):
        p.check_compatible(p.KVLayout(**{**LAYOUT.__dict__, "tp_size": 2}), p.KVLayout(**{**LAYOUT.__dict__, "tp_size": 3}))


def test_gather_and_scatter_are_inverse():
    kv = torch.randn(2, 2, 10, 4, 8, 3)
    data = gather_blocks(kv, [7, 2, 5])
    assert data.is_contiguous() and data.shape == (2, 2, 3, 4, 8, 3)
    out = torch.zeros_like(kv)
    scatter_blocks(out, [0, 1, 9], data)
    assert torch.equal(out[:, :, [0, 1, 9]], kv[:, :, [7, 2, 5]])
    assert torch.equal(gather_blocks(kv, [1], (2, 4)), kv[:, :, [1], :, 2:4])


def test_gather_and_scatter_copy_bits_of_any_dtype_and_check_ids():
    kv = torch.randn(2, 2, 10, 4, 8, 3).to(torch.bfloat16)  # no numpy dtype: copied as int16
    data = gather_blocks(kv, [7, 2], (1, 5))
    assert data.dtype == torch.bfloat16 and torch.equal(data, kv[:, :, [7, 2], :, 1:5])
    out = torch.zeros_like(kv)
    scatter_blocks(out, [0, 9], gather_blocks(kv, [7, 2]))
    assert torch.equal(out[:, :, [0, 9]], kv[:, :, [7, 2]])
    for bad in ([10], [-1]):
        with pytest.raises(IndexError):
            gather_blocks(kv, bad)
        with pytest.raises(IndexError):
            scatter_blocks(out, bad, gather_blocks(kv, [0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_moves_another_caches_blocks_by_runs(dtype):
    """From another cache's bits (as mapped from another process) into this one's blocks: one run,
    runs broken on either side, a head slice; exact bits; ids outside either cache refused."""
    src = torch.randn(2, 2, 10, 4, 8, 3).to(dtype)
    src_bits = cache_bits(src.view(torch.uint8).numpy().tobytes(), src.element_size(), (2, 4, 8, 3))
    assert src_bits.shape == (2, 2, 10, 4, 8, 3) and not src_bits.flags.writeable
    for src_ids, dst_ids, heads in (([3, 4, 5], [0, 1, 2], (0, 8)), ([3, 4, 5, 9], [6, 7, 1, 2], (2, 6)),
                                    ([1], [9], (7, 8)), ([], [], (0, 8))):
        out = torch.zeros(2, 2, 10, 4, heads[1] - heads[0], 3, dtype=dtype)
        copy_blocks(src_bits, src_ids, heads, out, dst_ids)
        assert torch.equal(out[:, :, dst_ids], src[:, :, src_ids, :, heads[0]:heads[1]])
        untouched = [b for b in range(10) if b not in dst_ids]
        assert not out[:, :, untouched].any()
    with pytest.raises(IndexError):
        copy_blocks(src_bits, [10], (0, 8), torch.zeros(2, 2, 10, 4, 8, 3, dtype=dtype), [0])
    with pytest.raises(IndexError):
        copy_blocks(src_bits, [0], (0, 8), torch.zeros(2, 2, 10, 4, 8, 3, dtype=dtype), [10])
    assert cache_bits(bytes(100), 4, (2, 4, 8, 3)) is None  # not a whole number of blocks


def test_leases_pin_release_and_expire():
    now = [0.0]
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    leases = LeaseTable(pool.incref, pool.free, lease_s=30.0, clock=lambda: now[0])
    a = leases.add("a", blocks).token
    pool.free(blocks)  # the engine lets go; the lease still pins them
    assert pool.num_free_blocks == 5 and leases.get("a", a).block_ids == blocks
    with pytest.raises(ValueError):
        leases.add("a", blocks)
    assert leases.release("a", a) and not leases.release("a", a)
    assert pool.num_free_blocks == 8
    b = leases.add("b", pool.allocate(2)).token
    now[0] = 31.0
    assert leases.expire() == ["b"] and leases.was_expired("b", b) and not leases.was_expired("a", a)
    assert not leases.was_expired("b", "0" * 32)  # without the token, not even that it expired
    assert pool.num_free_blocks == 6  # "b"'s blocks are still the test's own allocation
    c = leases.add("c", [7]).token
    now[0] = 100.0
    assert leases.get("c", c) is None and leases.was_expired("c", c) and len(leases) == 0


def test_a_lease_without_its_token_is_no_lease():
    pool = BlockPool(8, 4)
    leases = LeaseTable(pool.incref, pool.free, lease_s=30.0)
    lease = leases.add("a", pool.allocate(2))
    assert len(lease.token) == 32 and leases.add("b", [5]).token != lease.token  # 128 random bits each
    for wrong in ("0" * 32, lease.token[:-1], lease.token + "0", "", None, 7):
        assert leases.get("a", wrong) is None and leases.hold("a", wrong) is None
        assert not leases.release("a", wrong)
    assert leases.get("a", lease.token) is lease and leases.release("a", lease.token)


def test_a_lease_being_read_keeps_its_blocks_past_ack_and_expiry():
    now = [0.0]
    pool = BlockPool(8, 4)
    leases = LeaseTable(pool.incref, pool.free, lease_s=30.0, clock=lambda: now[0])
    blocks = pool.allocate(3)
    a = leases.add("a", blocks).token
    pool.free(blocks)
    first, second = leases.hold("a", a), leases.hold("a", a)  # two ranks reading one lease
    assert leases.release("a", a) and leases.get("a", a) is None and leases.hold("a", a) is None
    assert pool.num_free_blocks == 5 and leases.num_open_reads == 2  # still on the wire
    leases.unhold(first)
    assert pool.num_free_blocks == 5 and leases.num_open_reads == 1
    leases.unhold(second)
    assert pool.num_free_blocks == 8 and leases.num_open_reads == 0
    blocks = pool.allocate(2)
    b = leases.add("b", blocks).token
    pool.free(blocks)
    reading = leases.hold("b", b)
    now[0] = 31.0
    assert leases.expire() == ["b"] and pool.num_free_blocks == 6
    leases.unhold(reading)
    assert pool.num_free_blocks == 8 and leases.num_open_reads == 0
