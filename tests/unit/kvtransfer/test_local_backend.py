"""The same-process backend, and the exporter/importer contract every backend shares."""

import time

import pytest
import torch

from pdserve.engine.kv_cache import BlockPool
from pdserve.kvtransfer import BACKENDS, KVExporter, KVLayout, LocalImporter
from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.blocks import gather_blocks

LAYOUT = KVLayout("m", num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype="float32")


@pytest.fixture
def side():
    kv = torch.randn(2, 2, 32, 4, 4, 8)
    pool = BlockPool(32, 4)
    exporter = KVExporter("prefill-0", kv, LAYOUT, pool.incref, pool.free, lease_s=0.5)
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


def test_failures_free_the_importers_blocks(side):
    kv, pool, exporter = side
    importer = LocalImporter(torch.zeros(2, 2, 8, 4, 4, 8), LAYOUT, {"prefill-0": exporter})
    freed = []
    handle = exporter.export("idle", pool.allocate(2), 8)
    time.sleep(0.9)  # the lease (0.5 s) expires; the expiry thread frees the blocks
    assert pool.num_free_blocks == 30  # this test's own allocation is still out
    with pytest.raises(p.LeaseExpiredError):
        importer.pull(handle, [0, 1], on_failure=freed.extend)
    unknown = p.KVHandle("prefill-0", "local:prefill-0", "nope", (1,), 4, LAYOUT, 0.0)
    with pytest.raises(p.UnknownRequestError):
        importer.pull(unknown, [3], on_failure=freed.extend)
    gone = p.KVHandle("prefill-9", "local:prefill-9", "r", (1,), 4, LAYOUT, 0.0)
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
