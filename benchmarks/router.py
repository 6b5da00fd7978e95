"""Router benchmark (#6): index speed against Ray Serve LLM's `PrefixTree`, and placement quality
against round-robin, power-of-two-choices, Ray's prefix-affinity rule and an oracle, in one run.

    python benchmarks/router.py [--requests 20000] [--quick]

Trace: `--requests` prompts over 8 replicas; 50 shared prefixes of 1,000-2,000 tokens drawn with
Zipf popularity (s=1.1), each followed by a unique suffix of 50-300 tokens; block size 16.

Speed: per request, pdserve hashes the token ids (`block_hashes`), matches them in `RadixIndex`
and inserts them for the chosen replica (longest match, else round-robin). Ray's `PrefixTree`
does the same match-then-insert on the prompt as text, which is its real input: 4 characters per
token (English text runs ~4 characters per token), and, as a lower bound on its cost, 1 character
per token. Same decisions, same process, same run.

Quality: a discrete-event simulation. Each replica has a prefix cache of `--cache-blocks` blocks
(LRU, a request's tail evicted before its head, as the engine frees) and computes its uncached
prompt tokens FIFO at `--tokens-per-s`. Caches publish stored/removed events into one precise
`RadixIndex` that every policy reads; the policies differ only in how they choose. Prints a
markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections import OrderedDict

import numpy as np

from machine import machine_line  # this folder's scripts run with it on sys.path
from pdserve.router import RadixIndex, block_hashes
from pdserve.router.policy import DEFAULT_QUEUE_WEIGHT, rank_prefill

BLOCK = 16


def make_trace(num_requests: int, num_prefixes: int, seed: int) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, rng.integers(1000, 2001)).tolist() for _ in range(num_prefixes)]
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** 1.1
    tenants = rng.choice(num_prefixes, size=num_requests, p=weights / weights.sum())
    out = []
    for t in tenants.tolist():
        suffix = rng.integers(0, 32000, rng.integers(50, 301)).tolist()
        out.append((t, prefixes[t] + suffix))
    return out


# ---- speed

def place(idx: RadixIndex, tokens: list[int], replicas: list[str], i: int) -> None:
    """One decision: hash, match, then insert for the longest match (round-robin when none)."""
    hashes = block_hashes(tokens, BLOCK)
    matched = idx.match(hashes, replicas)
    best = max(matched, key=matched.__getitem__)
    idx.insert(best if matched[best] else replicas[i % len(replicas)], hashes)


def speed_pdserve(prompts: list[list[int]], replicas: list[str], max_blocks: int) -> dict:
    idx = RadixIndex(max_blocks_per_replica=max_blocks)
    lat = []
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for i, tokens in enumerate(prompts):
        t0 = clock()
        place(idx, tokens, replicas, i)
        lat.append(clock() - t0)
    elapsed = time.perf_counter() - start
    return _speed_report(len(prompts), elapsed, lat)


def speed_ray(texts: list[str], replicas: list[str]) -> dict:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    tree = PrefixTree()
    tree.add_tenants(replicas, 0.0)
    lat = []
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for i, text in enumerate(texts):
        t0 = clock()
        matched_text, tenants = tree.prefix_match(text, replicas)
        best = tenants[0] if matched_text and tenants else replicas[i % len(replicas)]
        tree.insert(text, best, time.time())
        lat.append(clock() - t0)
    elapsed = time.perf_counter() - start
    return _speed_report(len(texts), elapsed, lat)


def _speed_report(n: int, elapsed: float, lat_ns: list[int]) -> dict:
    lat_us = sorted(x / 1000 for x in lat_ns)
    return {"requests": n, "elapsed_s": elapsed, "requests_per_s": n / elapsed,
            "p50_us": lat_us[len(lat_us) // 2], "p99_us": lat_us[int(len(lat_us) * 0.99)]}


def memory_per_block(prompts: list[list[int]], replicas: list[str], max_blocks: int) -> dict:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = RadixIndex(max_blocks_per_replica=max_blocks)
    for i, tokens in enumerate(prompts):
        place(idx, tokens, replicas, i)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    held = sum(idx.num_blocks(r) for r in replicas)
    return {"bytes": used, "distinct_blocks": len(idx), "held_blocks": held,
            "bytes_per_distinct_block": used / max(len(idx), 1), "bytes_per_held_block": used / max(held, 1)}


# ---- placement quality

def simulate(policy: str, trace: list[tuple[int, list[int]]], hashes: list[list[int]], num_replicas: int,
             cache_blocks: int, tokens_per_s: float, arrival_rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / arrival_rate, len(trace))).tolist()
    names = [f"replica-{i}" for i in range(num_replicas)]
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in names]
    index = RadixIndex()
    for r in names:
        index.clear_replica(r)
    backlog = [0.0] * num_replicas  # queued prefill tokens
    work = [0] * num_replicas
    count = [0] * num_replicas
    hit_tokens = prompt_tokens = 0
    latency = []
    t_last = 0.0
    for i, ((_, tokens), h) in enumerate(zip(trace, hashes)):
        t = arrivals[i]
        drained = tokens_per_s * (t - t_last)
        backlog = [max(0.0, b - drained) for b in backlog]
        t_last = t
        n = len(tokens)
        matched = index.match(h, names)
        queued = dict(zip(names, backlog))
        if policy == "round-robin":
            r = i % num_replicas
        elif policy == "power-of-two":
            a, b = rng.sample(range(num_replicas), 2)
            r = a if backlog[a] <= backlog[b] else b
        elif policy == "oracle":  # always the longest hit, load ignored
            best = max(matched.values())
            r = min((j for j, name in enumerate(names) if matched[name] == best), key=backlog.__getitem__)
        elif policy == "ray-prefix-affinity":
            # Ray Serve LLM's PrefixCacheAffinityRouter rule (imbalanced_threshold default: never):
            # match rate >= 10%: the longest-matching replicas, else the smallest trees; then the
            # shortest queue among them.
            best = max(matched.values())
            if best * BLOCK / n >= 0.1:
                pool = [j for j, name in enumerate(names) if matched[name] == best]
            else:
                smallest = min(index.num_blocks(name) for name in names)
                pool = [j for j, name in enumerate(names) if index.num_blocks(name) == smallest]
            r = min(pool, key=backlog.__getitem__)
        elif policy.startswith("pdserve"):
            weight = float(policy.partition("queue_weight=")[2] or DEFAULT_QUEUE_WEIGHT)
            r = names.index(rank_prefill(names, n, matched, queued, BLOCK, weight, rng)[0])
        else:
            raise ValueError(policy)
        # What the chosen replica really has cached (its cache, not the index).
        cache = caches[r]
        hit = 0
        limit = (n - 1) // BLOCK
        while hit < min(len(h), limit) and h[hit] in cache:
            hit += 1
        uncached = n - hit * BLOCK
        hit_tokens += hit * BLOCK
        prompt_tokens += n
        latency.append((backlog[r] + uncached) / tokens_per_s)
        backlog[r] += uncached
        work[r] += uncached
        count[r] += 1
        # The replica caches the prompt's blocks; the tail is freed first, so it is evicted first.
        for blk in reversed(h):
            cache[blk] = None
            cache.move_to_end(blk)
        evicted = []
        while len(cache) > cache_blocks:
            evicted.append(cache.popitem(last=False)[0])
        index.insert(names[r], h)
        if evicted:
            index.remove(names[r], evicted)
    latency.sort()
    return {"policy": policy, "hit_rate": hit_tokens / prompt_tokens,
            "max_min_work": max(work) / max(min(work), 1), "max_min_requests": max(count) / max(min(count), 1),
            "p50_prefill_s": latency[len(latency) // 2], "p99_prefill_s": latency[int(len(latency) * 0.99)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--prefixes", type=int, default=50)
    ap.add_argument("--max-blocks-per-replica", type=int, default=16384,
                    help="RadixIndex bound in the speed run (the trace holds more, so trimming runs)")
    ap.add_argument("--cache-blocks", type=int, default=2048, help="each simulated replica's prefix cache")
    ap.add_argument("--tokens-per-s", type=float, default=20000.0, help="a simulated replica's prefill speed")
    ap.add_argument("--utilization", type=float, default=0.7,
                    help="arrival rate as a share of the fleet's capacity at the oracle's hit rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2,000 requests (a smoke run)")
    args = ap.parse_args()
    n = 2000 if args.quick else args.requests

    trace = make_trace(n, args.prefixes, args.seed)
    prompts = [tokens for _, tokens in trace]
    # A token as text: 4 letters (unique per id), or 1 character.
    word = ["".join(chr(97 + (t // 26**k) % 26) for k in range(4)) for t in range(32000)]
    texts4 = ["".join([word[t] for t in tokens]) for tokens in prompts]
    texts1 = ["".join(map(chr, (0x100 + t for t in tokens))) for tokens in prompts]
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    gc.collect()
    gc.freeze()  # the trace itself is not what is measured

    ours = speed_pdserve(prompts, replicas, args.max_blocks_per_replica)
    ray4 = speed_ray(texts4, replicas)
    del texts4
    ray1 = speed_ray(texts1, replicas)
    del texts1
    mem = memory_per_block(prompts, replicas, args.max_blocks_per_replica)

    hashes = [block_hashes(tokens, BLOCK) for tokens in prompts]
    mean_prompt = statistics.fmean(len(p) for p in prompts)
    oracle = simulate("oracle", trace, hashes, args.replicas, args.cache_blocks, args.tokens_per_s, 1.0, args.seed)
    capacity = args.replicas * args.tokens_per_s / (mean_prompt * (1 - oracle["hit_rate"]))
    rate = args.utilization * capacity
    quality = [simulate(p, trace, hashes, args.replicas, args.cache_blocks, args.tokens_per_s, rate, args.seed)
               for p in ("round-robin", "power-of-two", "ray-prefix-affinity", "oracle", "pdserve",
                         "pdserve queue_weight=1")]
    oracle_hit = next(q for q in quality if q["policy"] == "oracle")["hit_rate"]

    machine = machine_line()
    print(f"machine: {machine}\ntrace: {n} requests, {args.replicas} replicas, {args.prefixes} prefixes, "
          f"mean prompt {mean_prompt:.0f} tokens, block {BLOCK}\n")
    print("| index (match + insert per request, hashing included) | requests/s | p50 us | p99 us |\n|---|---|---|---|")
    for name, s in (("pdserve RadixIndex (token ids)", ours), ("Ray Serve LLM PrefixTree (text, 4 chars/token)", ray4),
                    ("Ray Serve LLM PrefixTree (text, 1 char/token)", ray1)):
        print(f"| {name} | {s['requests_per_s']:,.0f} | {s['p50_us']:.1f} | {s['p99_us']:.1f} |")
    print(f"\nspeed-up over Ray's tree: {ours['requests_per_s'] / ray4['requests_per_s']:.1f}x (4 chars/token), "
          f"{ours['requests_per_s'] / ray1['requests_per_s']:.1f}x (1 char/token); memory: "
          f"{mem['bytes_per_distinct_block']:.0f} B per distinct block, {mem['bytes_per_held_block']:.0f} B per "
          f"(replica, block) held ({mem['distinct_blocks']:,} blocks, {mem['bytes'] / 2**20:.1f} MiB)\n")
    print(f"placement: cache {args.cache_blocks} blocks/replica, {args.tokens_per_s:,.0f} prefill tok/s/replica, "
          f"{rate:.1f} requests/s ({args.utilization:.0%} of capacity at the oracle's hit rate)\n")
    print("| policy | hit rate | vs oracle | max/min work | max/min requests | p50 prefill s | p99 prefill s |\n"
          "|---|---|---|---|---|---|---|")
    for q in quality:
        print(f"| {q['policy']} | {q['hit_rate']:.1%} | {q['hit_rate'] / oracle_hit:.2f} | {q['max_min_work']:.2f} | "
              f"{q['max_min_requests']:.2f} | {q['p50_prefill_s']:.3f} | {q['p99_prefill_s']:.3f} |")
    print(json.dumps({"bench": "router", "machine": machine, "requests": n, "speed": {"pdserve": ours, "ray_4_chars_per_token": ray4,
                                                                          "ray_1_char_per_token": ray1},
                      "memory": mem, "arrival_rate": rate, "quality": quality}))


if __name__ == "__main__":
    main()
