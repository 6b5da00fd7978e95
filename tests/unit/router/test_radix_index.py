"""RadixIndex semantics, the LRU bound, and a randomized check against a brute-force model."""

import random
import subprocess
import sys

import pytest

from pdserve.engine.block_hash import block_hashes as engine_block_hashes
from pdserve.router import RadixIndex, block_hashes

BS = 4


def chain(tokens):
    return block_hashes(tokens, BS)


def count_nodes(index):
    todo, n = [index._root], 0
    while todo:
        node = todo.pop()
        n += 1
        todo.extend(node.children.values())
    return n - 1


def test_block_hashes_are_shared_chained_and_stable():
    assert engine_block_hashes is block_hashes  # one function for engine and router
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # full blocks only
    assert block_hashes(list(range(32)) + [7], 16) == a
    assert block_hashes([1] + list(range(1, 32)), 16)[1] != a[1]  # block 1 depends on block 0
    assert block_hashes(list(range(16, 32)), 16, parent=a[0]) == a[1:]
    code = "from pdserve.router import block_hashes; print(block_hashes(list(range(64)), 16))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("0", "1", "random")}
    assert outs == {f"{block_hashes(list(range(64)), 16)}\n"}
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1] * 16, 16)


def test_shared_prefixes_share_nodes_and_divergence_splits():
    idx = RadixIndex()
    a = chain(list(range(16)))            # 4 blocks
    b = chain(list(range(8)) + [99] * 8)  # shares 2 blocks with a
    idx.insert("r1", a)
    assert count_nodes(idx) == 1  # one compressed run
    idx.insert("r2", b)
    assert count_nodes(idx) == 3  # shared [0, 1], then the two tails
    assert len(idx) == 6
    assert idx.match(a) == {"r1": 4, "r2": 2}
    assert idx.match(b) == {"r1": 2, "r2": 4}
    idx.insert("r2", a)
    assert idx.match(a) == {"r1": 4, "r2": 4}


def test_query_longer_than_stored_and_candidate_filtering():
    idx = RadixIndex()
    long = chain(list(range(40)))
    idx.insert("r1", long[:3])
    idx.insert("r2", long[:6])
    assert idx.match(long) == {"r1": 3, "r2": 6}
    assert idx.match(long, replicas=["r2", "r9"]) == {"r2": 6, "r9": 0}
    assert idx.match(chain([5] * 12)) == {"r1": 0, "r2": 0}
    assert idx.match([]) == {"r1": 0, "r2": 0}


def test_removed_middle_block_truncates_the_match():
    idx = RadixIndex()
    h = chain(list(range(24)))  # 6 blocks
    idx.insert("r1", h)
    idx.insert("r2", h)
    idx.remove("r1", [h[2]])
    assert idx.match(h) == {"r1": 2, "r2": 6}
    assert idx.num_blocks("r1") == 5 and idx.num_blocks("r2") == 6
    idx.insert("r1", [h[2]], parent=h[1])  # stored again: the whole chain matches again
    assert idx.match(h) == {"r1": 6, "r2": 6}
    assert count_nodes(idx) == 1  # and the split nodes merged back


def test_insert_after_parent_and_unknown_parent():
    idx = RadixIndex()
    h = chain(list(range(24)))
    idx.insert("r1", h[:2])
    assert idx.insert("r1", h[2:], parent=h[1]) == 4
    assert idx.match(h) == {"r1": 6}
    assert idx.insert("r1", [123], parent=456) == 0  # the parent is not here: nothing to hang it on


def test_remove_replica_prunes_its_nodes_and_leaves_others_intact():
    idx = RadixIndex()
    a = chain(list(range(16)))
    b = chain(list(range(8)) + [99] * 8)
    idx.insert("r1", a)
    idx.insert("r2", b)
    idx.remove_replica("r1")
    assert idx.replicas == ["r2"]
    assert idx.match(a) == {"r2": 2}
    assert idx.match(b) == {"r2": 4}
    assert len(idx) == 4 and count_nodes(idx) == 1  # r1's tail is gone; r2's path merged back
    idx.remove_replica("r2")
    assert len(idx) == 0 and count_nodes(idx) == 0


def test_dropping_the_oldest_in_slices_ends_where_clearing_does():
    rng = random.Random(3)
    sliced, whole = RadixIndex(), RadixIndex()
    other = chain(list(range(12)))
    for idx in (sliced, whole):
        idx.insert("other", other)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(4, 40))]
        for idx in (sliced, whole):
            idx.insert("r", chain(tokens))
    left = [sliced.drop_oldest("r", 5) for _ in range(200)]
    assert left == sorted(left, reverse=True) and left[-1] == 0 and left[0] > 0  # it took several slices
    whole.clear_replica("r")
    assert sliced.num_blocks("r") == whole.num_blocks("r") == 0
    assert sliced.match(other) == whole.match(other) == {"other": 3, "r": 0}
    assert count_nodes(sliced) == count_nodes(whole)


def test_lru_bound_trims_least_recently_used_leaves_first():
    idx = RadixIndex(max_blocks_per_replica=10, clock=iter(range(1000)).__next__)
    shared = list(range(16))  # 4 blocks
    a, b, c = (chain(shared + [t] * 12) for t in (100, 200, 300))  # 7 blocks each, 3 unique
    idx.insert("r", a)
    idx.insert("r", b)  # 4 + 3 + 3 = 10 blocks
    assert idx.num_blocks("r") == 10
    idx.insert("r", c)  # 13 > 10: a's tail (least recently used) goes, the shared head stays
    assert idx.num_blocks("r") == 10
    assert idx.match(a) == {"r": 4}
    assert idx.match(b) == {"r": 7}
    assert idx.match(c) == {"r": 7}
    idx.insert("r", b)  # b is now the newest; the next trim takes c
    idx.insert("r", chain([7] * 8))  # 2 new blocks
    assert idx.num_blocks("r") == 10
    assert idx.match(c)["r"] == 5  # c's tail trimmed by just the two blocks needed
    assert idx.match(b)["r"] == 7


def test_a_replicas_own_limit_bounds_it_and_outlives_a_clear():
    idx = RadixIndex(max_blocks_per_replica=1000)
    idx.insert("big", chain(list(range(400))))  # 100 blocks
    idx.insert("small", chain(list(range(400))))
    idx.set_limit("small", 10)  # trims at once
    assert idx.num_blocks("small") <= 10 and idx.num_blocks("big") == 100
    idx.clear_replica("small")
    idx.insert("small", chain(list(range(1000, 1400))))
    assert idx.num_blocks("small") <= 10  # the bound stayed through the clear
    idx.set_limit("small", 10_000)
    idx.insert("small", chain(list(range(2000, 2400))))
    assert idx.num_blocks("small") > 10
    with pytest.raises(ValueError):
        idx.set_limit("small", 0)


def test_lru_bound_with_a_long_chain_trims_its_tail():
    idx = RadixIndex(max_blocks_per_replica=3)
    h = chain(list(range(40)))
    idx.insert("r", h)
    assert idx.num_blocks("r") == 3
    assert idx.match(h) == {"r": 3}


def test_expire_drops_old_holds():
    now = [0.0]
    idx = RadixIndex(clock=lambda: now[0])
    a = chain(list(range(16)))
    b = chain(list(range(8)) + [1] * 8)
    idx.insert("r1", a)
    now[0] = 10.0
    idx.insert("r1", b)  # touches the shared head again
    assert idx.expire(older_than=5.0) == 2  # a's own tail only
    assert idx.match(a) == {"r1": 2}
    assert idx.match(b) == {"r1": 4}


def test_random_operations_agree_with_a_brute_force_model():
    """match() == the number of leading query blocks each replica holds, under any mix of updates."""
    rng = random.Random(0)
    idx = RadixIndex()
    held: dict[str, set[int]] = {}
    stems = [[rng.randrange(5) for _ in range(BS * 6)] for _ in range(4)]

    def random_chain():
        stem = rng.choice(stems)
        cut = rng.randrange(0, len(stem) + 1)
        tail = [rng.randrange(3) for _ in range(rng.randrange(0, BS * 4))]
        return chain(stem[:cut] + tail)

    for step in range(3000):
        r = f"r{rng.randrange(4)}"
        op = rng.random()
        if op < 0.5:
            h = random_chain()
            if h and rng.random() < 0.3:
                k = rng.randrange(len(h))
                if k == 0 or h[k - 1] in idx._where:  # as an engine event: after a known parent
                    idx.insert(r, h[k:], parent=h[k - 1] if k else None)
                    held.setdefault(r, set()).update(h[k:])
            elif h:
                idx.insert(r, h)
                held.setdefault(r, set()).update(h)
        elif op < 0.8 and held.get(r):
            gone = rng.sample(sorted(held[r]), k=min(len(held[r]), rng.randrange(1, 4)))
            idx.remove(r, gone)
            held[r].difference_update(gone)
        elif op < 0.83:
            idx.remove_replica(r)
            held.pop(r, None)
        q = random_chain()
        expected = {}
        for rep, blocks in held.items():
            n = 0
            while n < len(q) and q[n] in blocks:
                n += 1
            expected[rep] = n
        assert idx.match(q) == expected, step
        for rep, blocks in held.items():
            assert idx.num_blocks(rep) == len(blocks) and idx.blocks(rep) == blocks, step


def test_random_operations_under_the_lru_bound_stay_consistent():
    rng = random.Random(1)
    idx = RadixIndex(max_blocks_per_replica=12)
    stems = [[rng.randrange(5) for _ in range(BS * 6)] for _ in range(4)]
    for step in range(3000):
        r = f"r{rng.randrange(3)}"
        stem = rng.choice(stems)
        h = chain(stem[:rng.randrange(len(stem) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(BS * 4))])
        if rng.random() < 0.7:
            idx.insert(r, h)
        elif h:
            idx.remove(r, rng.sample(h, k=1))
        if rng.random() < 0.01:
            idx.expire(older_than=idx._clock() - 1e-4)
        for rep in idx.replicas:
            blocks = idx.blocks(rep)
            assert idx.num_blocks(rep) == len(blocks) <= 12, step
            n = 0
            while n < len(h) and h[n] in blocks:
                n += 1
            assert idx.match(h)[rep] == n, step
        assert set(idx._where) >= set().union(*(idx.blocks(rep) for rep in idx.replicas)), step
