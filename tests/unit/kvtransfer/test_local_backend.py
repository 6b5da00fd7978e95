"""The same-process backend, and the exporter/importer contract every backend shares."""

import pytest
import torch

from pdserve.engine.kv_cache import BlockPool
from pdserve.kvtransfer.backends import BACKENDS
from pdserve.kvtransfer.base import KVExporter
from pdserve.kvtransfer.local_backend import LocalImporter
from pdserve.kvtransfer.protocol import KVLayout
from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.blocks import gather_blocks
from tests.fakes.clock import Clock
from tests.harness.waiting import wait_until

LAYOUT = KVLayout("m", num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype="float32")


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def side(clock):
    kv = torch.randn(2, 2, 32, 4, 4, 8)
    pool = BlockPool(32, 4)
    exporter = KVExporter("prefill-0", kv, LAYOUT, pool.incref, pool.free, lease_s=0.5, clock=clock.time)
    yield kv, pool, exporter
    exporter.close()


def test_backends_by_name():
    assert BACKENDS["local"]() == (KVExporter, LocalImporter)


def test_pull_copies_blocks_and_ack_releases_the_lease(side):
    kv, pool, exporter = side
    blocks = pool.allocate(3)
    handle = exporter.export("r", blocks, 10)
    pool.free(blocks)  # the engine lets go; the lease holds them
    assert pool.num_free_blocks == 29
    dst_kv = torch.zeros(2, 2, 16, 4, 4, 8)
    LocalImporter(dst_kv, LAYOUT, {"prefill-0": exporter}).pull(handle, [9, 2, 5])
    assert torch.equal(gather_blocks(dst_kv, [9, 2, 5]), gather_blocks(kv, blocks))
    assert pool.num_free_blocks == 32


def test_tp2_importer_gets_its_heads(side):
    kv, pool, exporter = side
    handle = exporter.export("r", [4, 5], 8)
    dst = torch.zeros(2, 2, 4, 4, 2, 8)
    LocalImporter(dst, KVLayout(**{**LAYOUT.__dict__, "tp_size": 2, "tp_rank": 1}), {"prefill-0": exporter}).pull(
        handle, [0, 1])
    assert torch.equal(dst[:, :, :2], kv[:, :, [4, 5], :, 2:4])


def test_failures_free_the_importers_blocks(side, clock):
    kv, pool, exporter = side
    importer = LocalImporter(torch.zeros(2, 2, 8, 4, 4, 8), LAYOUT, {"prefill-0": exporter})
    freed = []
    handle = exporter.export("idle", pool.allocate(2), 8)
    clock.offset_s += 1.0  # past the lease (0.5 s): the expiry thread frees the blocks on its next round
    wait_until(lambda: pool.num_free_blocks == 30, what="the expired lease's blocks freed")  # the test's own 2 out
    with pytest.raises(p.LeaseExpiredError):
        importer.pull(handle, [0, 1], on_failure=freed.extend)
    unknown = p.KVHandle("prefill-0", "local:prefill-0", "nope", (1,), 4, LAYOUT, "t")
    with pytest.raises(p.UnknownRequestError):
        importer.pull(unknown, [3], on_failure=freed.extend)
    gone = p.KVHandle("prefill-9", "local:prefill-9", "r", (1,), 4, LAYOUT, "t")
    with pytest.raises(p.ExporterUnreachableError) as e:
        importer.pull(gone, [4], on_failure=freed.extend)
    assert e.value.retryable
    with pytest.raises(p.LayoutMismatchError):
        LocalImporter(torch.zeros(2, 2, 8, 8, 4, 8), KVLayout(**{**LAYOUT.__dict__, "block_size": 8}),
                      {"prefill-0": exporter}).pull(exporter.export("x", [7], 4), [0], on_failure=freed.extend)
    assert freed == [0, 1, 3, 4, 0]


def test_an_exporter_reports_healthy_until_closed():
    exporter = KVExporter("x", torch.randn(2, 2, 4, 4, 4, 8), LAYOUT, lambda ids: None, lambda ids: None)
    assert exporter.is_healthy
    exporter.close()
    assert not exporter.is_healthy


def test_a_read_yields_chunks_in_place_or_gathered_and_holds_its_blocks():
    """Slabs of 256 KiB: one chunk per layer's K or V (half the heads: 128 KiB, two slabs a chunk).
    Blocks in one run with every head go out as views of the cache; scattered blocks or a head
    slice are gathered into staging."""
    kv = torch.randn(2, 2, 64, 16, 4, 64)
    layout = KVLayout("m", num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")
    pool = BlockPool(64, 16)
    exporter = KVExporter("prefill-0", kv, layout, pool.incref, pool.free)
    run, scattered = list(range(8, 24)), list(range(24, 56, 2))
    tokens = {"run": exporter.export("run", run, 256).lease_token,
              "scattered": exporter.export("scattered", scattered, 256).lease_token}
    tp2_rank1 = KVLayout(**{**layout.__dict__, "tp_size": 2, "tp_rank": 1})
    try:
        for rid, ids, importer, heads, num_chunks, is_in_place in (
                ("run", run, layout, None, 4, True), ("scattered", scattered, layout, None, 4, False),
                ("run", run, tp2_rank1, (2, 4), 2, False)):
            with exporter.open_read(rid, tokens[rid], importer) as read:
                assert len(read.chunks) == num_chunks
                chunks = [read.chunk(i) for i in range(num_chunks)]
                shares_cache = [c.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for c in chunks]
                assert all(c.is_contiguous() for c in chunks) and shares_cache == [is_in_place] * num_chunks
                assert [read.is_in_place(i) for i in range(num_chunks)] == shares_cache
                data = torch.cat([c.reshape(-1) for c in chunks]).view(read.shape)
                assert torch.equal(data, gather_blocks(kv, ids, heads))
        # An ack while a read is still sending: the lease ends, the blocks stay until the read closes.
        with exporter.open_read("run", tokens["run"], layout):
            assert exporter.ack("run", tokens["run"])
            assert pool.num_free_blocks == 64 - 32
            with pytest.raises(p.UnknownRequestError):
                exporter.open_read("run", tokens["run"], layout)
        assert pool.num_free_blocks == 64 - 16
    finally:
        exporter.close()
