"""Layer groups and their block tables (engine/kv_groups.py): pure, no tensors."""

from __future__ import annotations

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.engine.kv_groups import (HybridKVCacheManager, LayerGroup, first_needed_block, layer_groups, layer_slots,
                                      max_blocks_per_group)

BS = 4
W = 10  # a window that is not a whole number of blocks


def _manager(num_blocks: int = 64, windows=(W, None, W)) -> HybridKVCacheManager:
    groups = layer_groups(len(windows), windows)
    return HybridKVCacheManager(BlockPool(num_blocks, BS, enable_events=True), groups)


def test_one_kind_of_layer_is_one_group_of_every_layer():
    assert layer_groups(3) == [LayerGroup((0, 1, 2), None)]
    assert layer_groups(2, (8, 8)) == [LayerGroup((0, 1), 8)]


def test_groups_are_runs_of_the_smallest_kinds_size_global_first():
    # Gemma 3's pattern: five sliding layers to one global.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(12)]
    groups = layer_groups(12, windows)
    assert groups[0] == LayerGroup((5, 11), None)
    assert [g.layers for g in groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    slots, group_of = layer_slots(groups)
    assert max(slots) == 1 and group_of[5] == group_of[11] == 0 and group_of[6] == 3 and slots[6] == 1


def test_first_needed_block_follows_the_window():
    # The query at position p sees p - W + 1 .. p.
    assert first_needed_block(0, W, BS) == 0
    assert first_needed_block(12, W, BS) == 0  # next query 12 sees 3..12: block 0 still
    assert first_needed_block(13, W, BS) == 1  # sees 4..13
    assert first_needed_block(100, None, BS) == 0
    assert max_blocks_per_group(1000, W, BS, 1) == -(-(W - 1 + 1) // BS) + 1
    assert max_blocks_per_group(6, W, BS, 1) == 2


def test_a_sliding_group_holds_at_most_its_window_while_decoding():
    kv = _manager()
    tokens = list(range(100, 160))
    hashes = block_hashes(tokens, BS)
    assert kv.allocate("r", 20)
    kv.cache_full_blocks("r", hashes, 20)
    held = kv.num_held_blocks("r")
    assert held[0] == 5 and held[1] == held[2] == 5 - first_needed_block(20, W, BS)
    for n in range(21, 61):  # decode one token a step
        assert kv.allocate("r", n)
        kv.cache_full_blocks("r", hashes, n)
        global_blocks, *sliding = kv.num_held_blocks("r")
        assert global_blocks == -(-n // BS)
        assert all(s <= -(-(W - 1) // BS) + 1 for s in sliding), (n, sliding)
    tables = kv.get_block_tables("r")
    assert all(len(t) == len(tables[0]) for t in tables)
    kv.free("r")
    assert kv.pool.num_free_blocks == 64


def test_a_prefix_hit_needs_every_groups_blocks_and_stays_exact():
    kv = _manager()
    tokens = list(range(200, 240))  # 10 blocks
    hashes = block_hashes(tokens, BS)
    assert kv.allocate("a", 40)
    kv.cache_full_blocks("a", hashes, 40)
    kv.free("a")
    # Everything was named before it was given back: a longer request hits 9 blocks (the last
    # prompt token is always computed), each sliding group from its window's first block.
    longer = tokens + [7, 8, 9, 10]
    hit = kv.match_prefix(block_hashes(longer, BS), len(longer))
    assert len(hit) == 10
    start = first_needed_block(40, W, BS)
    assert all(e[0] is not None for e in hit)
    assert all((e[1] is None) == (j < start) for j, e in enumerate(hit))
    # Evict one sliding block inside that window: the hit shrinks until no window reaches it.
    evicted = hit[8][2]
    kv.pool.free_queue.move_to_end(evicted, last=False)
    kv.pool.allocate(1)
    hit = kv.match_prefix(block_hashes(longer, BS), len(longer))
    assert len(hit) < 9 and all(evicted not in e for e in hit)
    assert first_needed_block(len(hit) * BS, W, BS) >= 0


def test_only_the_first_group_publishes_kv_events():
    kv = _manager()
    hashes = block_hashes(list(range(16)), BS)
    kv.allocate("r", 16)
    kv.cache_full_blocks("r", hashes, 16)
    stored = [h for e in kv.pool.take_events() for h in getattr(e, "block_hashes", [])]
    assert stored == hashes


def test_transfer_order_and_a_decode_side_prefix():
    bs_tokens = list(range(300, 328))  # 7 blocks
    hashes = block_hashes(bs_tokens, BS)
    prefill = _manager()
    prefill.allocate("p", 28)
    prefill.cache_full_blocks("p", hashes, 28)
    exported = prefill.export_blocks("p")
    held = prefill.num_held_blocks("p")
    assert len(exported) == sum(held)
    # A decode side with nothing cached takes every exported block, in the same order of groups.
    decode = _manager()
    assert decode.allocate("d", 28)
    num_local, dst = decode.import_blocks("d", 28, 0)
    assert num_local == 0 and len(dst) == len(exported) and decode.num_held_blocks("d") == held
    # One that caches the first 4 blocks holds a prefix of that order and pulls the rest.
    cached = _manager()
    cached.allocate("x", 16)
    cached.cache_full_blocks("x", hashes, 16)
    cached.free("x")
    hit = cached.match_prefix(hashes, 28)
    assert len(hit) == 4
    assert cached.allocate("d", 28, hit)
    num_local, dst = cached.import_blocks("d", 28, len(hit))
    assert num_local + len(dst) == len(exported)
    assert cached.export_blocks("d")[num_local:] == dst


def test_the_plain_manager_answers_for_its_one_group():
    kv = KVCacheManager(BlockPool(8, BS))
    kv.allocate("r", 9)
    assert kv.get_block_tables("r") == [kv.get_block_table("r")] and kv.num_held_blocks("r") == [3]
    assert kv.export_blocks("r") == kv.get_block_table("r")
    assert kv.import_blocks("r", 9, 1) == (1, kv.get_block_table("r")[1:])
    assert kv.max_blocks_for(9, 4) == 3


def test_an_import_takes_no_block_its_windows_do_not_need():
    tokens = list(range(400, 440))  # 10 blocks, 4 past a 10-token window's reach
    hashes = block_hashes(tokens, BS)
    kv = _manager(num_blocks=24)  # too few for 10 blocks in each of three groups
    assert kv.allocate("d", 40, (), num_computed_tokens=40)
    held = kv.num_held_blocks("d")
    assert held[0] == 10 and held[1] == held[2] == 10 - first_needed_block(40, W, BS)
    num_local, dst = kv.import_blocks("d", 40, 0)
    assert num_local == 0 and len(dst) == sum(held) and kv.pool.num_free_blocks == 24 - sum(held)
    # With a local prefix that the windows have left behind, its sliding blocks go straight back.
    kv.cache_full_blocks("d", hashes, 40)
    kv.free("d")
    longer = tokens + list(range(500, 516))  # 14 blocks: the windows reach back to block 11
    hit = kv.match_prefix(block_hashes(longer, BS), len(longer))
    assert len(hit) == 10
    assert kv.allocate("e", 56, hit, num_computed_tokens=56)
    num_local, dst = kv.import_blocks("e", 56, len(hit))
    assert kv.num_held_blocks("e") == [14, 3, 3] and num_local == 10 and len(dst) == 4 + 3 + 3
    assert kv.export_blocks("e")[num_local:] == dst
    kv.free("e")
    assert kv.pool.num_free_blocks == 24
