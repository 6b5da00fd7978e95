"""The latent layout (multi-head latent attention's cache: one plane, one vector a token a layer) as
the transfer layer describes and moves it: no head slicing, every decode rank pulls the whole latent,
and a latent cache never pairs with a K/V one."""

import pytest
import torch

from pdserve.engine.kv_cache import BlockPool, KVCache
from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.backends import layout_of
from pdserve.kvtransfer.base import KVExporter
from pdserve.kvtransfer.blocks import gather_blocks
from pdserve.kvtransfer.local_backend import LocalImporter

LAYERS, BLOCK, LATENT = 3, 4, 40


def _latent_cache(num_blocks: int) -> torch.Tensor:
    return KVCache(LAYERS, num_blocks, BLOCK, 1, LATENT, is_latent=True).kv


def test_the_latent_cache_layout():
    cache = KVCache(LAYERS, 8, BLOCK, 1, LATENT, is_latent=True)
    assert cache.kv.shape == (LAYERS, 1, 8, BLOCK, 1, LATENT)
    assert cache.layer(1).shape == (8, BLOCK, LATENT) and cache.layer(1).data_ptr() == cache.kv[1].data_ptr()
    assert cache.bytes_per_token == LAYERS * LATENT * 4
    with pytest.raises(ValueError, match="no KV heads"):
        KVCache(LAYERS, 8, BLOCK, 2, LATENT, is_latent=True)


def test_layout_of_a_latent_cache_keeps_one_whole_head_on_every_rank():
    kv = _latent_cache(8)
    one, (r0, r1) = layout_of(kv, "m"), (layout_of(kv, "m", 2, r) for r in (0, 1))
    assert one.is_latent and one.num_planes == 1 and (one.num_kv_heads, one.head_dim) == (1, LATENT)
    assert r0.num_kv_heads == r1.num_kv_heads == 1  # not multiplied by the TP degree: nothing is split
    assert p.head_slice(one, r0) == p.head_slice(one, r1) == (0, 1)
    kv_layout = layout_of(torch.zeros(LAYERS, 2, 8, BLOCK, 1, LATENT), "m")
    assert not kv_layout.is_latent
    with pytest.raises(p.LayoutMismatchError, match="is_latent"):
        p.check_compatible(kv_layout, one)
    assert p.KVLayout(**p.KVHandle("e", "a", "r", (1,), 4, one, "t").to_dict()["layout"]) == one


def test_each_decode_rank_pulls_the_whole_latent():
    src = _latent_cache(32)
    src.copy_(torch.randn(src.shape))
    pool = BlockPool(32, BLOCK)
    exporter = KVExporter("prefill-0", src, layout_of(src, "m"), pool.incref, pool.free)
    try:
        blocks = [7, 3, 12]
        handle = exporter.export("r", blocks, 10)
        for rank in (0, 1):
            dst = _latent_cache(16)
            LocalImporter(dst, layout_of(dst, "m", 2, rank), {"prefill-0": exporter}).pull(
                handle, [9, 2, 5], ack=rank == 1)
            assert torch.equal(gather_blocks(dst, [9, 2, 5]), gather_blocks(src, blocks))
        assert pool.num_free_blocks == 32
    finally:
        exporter.close()


def test_any_prefill_degree_pairs_with_any_decode_degree():
    """Every prefill rank holds the whole latent: decode TP 1 takes a TP-2 prefill's rank 0 (the
    K/V layout refuses that pairing), decode TP 4 spreads over TP 2's ranks."""
    latent, kv = layout_of(_latent_cache(8), "m"), layout_of(torch.zeros(LAYERS, 2, 8, BLOCK, 2, LATENT), "m")
    prefill_tp2 = [p.KVLayout(**{**latent.__dict__, "tp_size": 2, "tp_rank": r}) for r in (0, 1)]
    assert p.source_rank(2, latent) == 0 and p.head_slice(prefill_tp2[0], latent) == (0, 1)
    with pytest.raises(p.LayoutMismatchError, match="must be a multiple"):
        p.check_compatible(p.KVLayout(**{**kv.__dict__, "tp_size": 2}), kv)
    decode_tp4 = [p.KVLayout(**{**latent.__dict__, "tp_size": 4, "tp_rank": r}) for r in range(4)]
    assert [p.source_rank(2, d) for d in decode_tp4] == [0, 1, 0, 1]
    assert all(p.head_slice(prefill_tp2[p.source_rank(2, d)], d) == (0, 1) for d in decode_tp4)
