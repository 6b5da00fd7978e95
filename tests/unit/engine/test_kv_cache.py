"""Block pool, chained hashes, prefix matching and LRU eviction, without a model."""

import subprocess
import sys

import pytest

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.kv_cache import BlockPool, BlockRemoved, BlockStored, KVCacheManager, NoFreeBlocksError


def test_hashes_chain_and_ignore_partial_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    assert a == b  # the partial third block does not count
    c = block_hashes([1] + list(range(1, 32)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # block 1's hash depends on block 0
    assert block_hashes(list(range(16, 32)), 16, parent=a[0]) == a[1:]


def test_hashes_are_stable_across_processes_and_hash_seeds():
    code = "from pdserve.engine.block_hash import block_hashes; print(block_hashes(list(range(64)), 16))"
    outs = {subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PATH": ""},
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert outs == {f"{block_hashes(list(range(64)), 16)}\n"}


def test_pool_refcounts_and_lru_eviction():
    pool = BlockPool(4, 16, enable_events=True)
    a = pool.allocate(2)
    pool.cache_block(a[0], 111, None)
    pool.cache_block(a[1], 222, 111)
    b = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(reversed(a))  # tail first: block a[1] is evicted before a[0]
    assert pool.num_free_blocks == 2 and pool.lookup(111) == a[0]
    assert pool.allocate(1) == [a[1]]
    assert pool.lookup(222) is None and pool.lookup(111) == a[0]
    pool.incref([a[0]])  # a prefix hit takes a cached free block back
    assert pool.num_free_blocks == 0
    pool.free([a[0]])
    pool.free(b)
    assert pool.num_free_blocks == 3
    events = pool.take_events()
    assert events == [BlockStored([111], None), BlockStored([222], 111), BlockRemoved([222])]


def test_manager_matches_prefix_and_shares_blocks():
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    hashes = block_hashes(tokens, 4)
    assert kv.allocate("a", 10)
    kv.cache_full_blocks("a", hashes, 10)
    hit = kv.match_prefix(hashes, 10)
    assert hit == kv.get_block_table("a")[:2]
    assert kv.allocate("b", 10, hit)
    assert kv.get_block_table("b")[:2] == hit and pool.ref_counts[hit[0]] == 2
    # An identical 8-token prompt may reuse only one block: its last token must be computed.
    assert len(kv.match_prefix(hashes, 8)) == 1
    kv.free("a")
    kv.free("b")
    assert pool.num_free_blocks == 16


def test_allocation_failure_changes_nothing():
    pool = BlockPool(3, 4)
    kv = KVCacheManager(pool)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 8)
    assert "b" not in kv.block_tables and pool.num_free_blocks == 1
