"""KV blocks through the Ray object store between a named actor and the driver."""

import pytest
import torch

ray = pytest.importorskip("ray")

from pdserve.kvtransfer import protocol as p  # noqa: E402
from pdserve.kvtransfer.blocks import gather_blocks  # noqa: E402
from pdserve.kvtransfer.ray_backend import RayImporter, RayKVExporter, RayKVExportMixin  # noqa: E402
from tests.fakes.kv_exporter_proc import LAYOUT, make_cache  # noqa: E402


@ray.remote(num_cpus=0)
class PrefillStub(RayKVExportMixin):
    """Stands in for a prefill replica: an engine-like pool and cache, and the export mixin."""

    def __init__(self, name: str):
        from pdserve.engine.kv_cache import BlockPool

        self.pool = BlockPool(512, LAYOUT["block_size"])
        self.kv_exporter = RayKVExporter(name, name, make_cache(512), p.KVLayout(**LAYOUT),
                                         self.pool.incref, self.pool.free, lease_s=30)

    def export(self, rid: str, num_tokens: int) -> dict:
        blocks = self.pool.allocate(-(-num_tokens // LAYOUT["block_size"]))
        handle = self.kv_exporter.export(rid, blocks, num_tokens)
        self.pool.free(blocks)
        return handle.to_dict()

    def free_blocks(self) -> int:
        return self.pool.num_free_blocks


@pytest.fixture(scope="module")
def prefill(ray_session):
    actor = PrefillStub.options(name="prefill-ray-0").remote("prefill-ray-0")
    yield actor
    ray.kill(actor)


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 1000])
def test_blocks_arrive_bit_identical(prefill, num_tokens):
    handle = p.KVHandle.from_dict(ray.get(prefill.export.remote(f"r{num_tokens}", num_tokens)))
    assert handle.address == "ray:prefill-ray-0"
    kv = torch.zeros(LAYOUT["num_layers"], 2, 128, 16, 4, 64)
    dst = list(range(127, 127 - len(handle.block_ids), -1))
    RayImporter(kv, p.KVLayout(**LAYOUT)).pull(handle, dst)
    assert torch.equal(gather_blocks(kv, dst), gather_blocks(make_cache(512), list(handle.block_ids)))


def test_errors_come_back_typed_and_free_blocks(prefill):
    importer = RayImporter(torch.zeros(2, 2, 8, 16, 4, 64), p.KVLayout(**LAYOUT))
    freed = []
    unknown = p.KVHandle("x", "ray:prefill-ray-0", "nope", (1,), 4, p.KVLayout(**LAYOUT), "t", 0.0)
    with pytest.raises(p.UnknownRequestError):
        importer.pull(unknown, [0], on_failure=freed.extend)
    handle = p.KVHandle.from_dict(ray.get(prefill.export.remote("last", 20)))
    ray.kill(prefill)
    with pytest.raises(p.ExporterUnreachableError) as e:
        importer.pull(handle, [1, 2], timeout_s=10, on_failure=freed.extend)
    assert e.value.retryable and freed == [0, 1, 2]
