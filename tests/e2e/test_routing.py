"""Prefix-aware routing on a running app: 3 prefill replicas, KV events through a real redis-server.

Tenants share long prompt prefixes. Each tenant's requests must land where its prefix is cached
(the engines report the hits in `usage.prompt_tokens_details.cached_tokens`, and the KV events
say which replica holds which prefix), and a hot tenant's burst must spread over replicas.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from pdserve.config import ServeConfig
from pdserve.router import block_hashes
from pdserve.router.kv_events import KVEventIndex, stream_name
from pdserve.router.redis_server import LocalRedis

from tests.harness.fixed_costs import REMOTE_PREFILL_SLO
from .conftest import ENGINE

BLOCK = ENGINE["block_size"]
PREFIX = 12 * BLOCK  # 96 tokens per tenant
SUFFIX = 40


@pytest.fixture(scope="module")
def routed(serve_apps, tiny_llama):
    from ray import serve

    from pdserve.app import build

    pool = {"ray_actor_options": {"num_cpus": 0.5}, "max_queued_requests": 300}
    with LocalRedis() as redis:
        cfg = ServeConfig(name="routed", model=tiny_llama, engine=ENGINE, prefill={**pool, "num_replicas": 3},
                          decode=pool, slo=REMOTE_PREFILL_SLO, transfer={"host": "127.0.0.1"},
                          router={"redis_url": redis.url, "stats_period_s": 0.5})
        serve.run(build(cfg), name="routed", route_prefix="/routed")
        # An observer on the same KV-event stream the routers read: who holds which prefix.
        observer = KVEventIndex(redis.url, stream_name("routed", "Prefill"), poll_s=0.02).start()
        client = openai.OpenAI(base_url=f"{serve_apps['base']}/routed/v1", api_key="unused", max_retries=0,
                               timeout=120)
        aclient = openai.AsyncOpenAI(base_url=f"{serve_apps['base']}/routed/v1", api_key="unused",
                                     max_retries=0, timeout=120)
        try:
            yield client, aclient, observer, redis
        finally:
            observer.close()
            serve.delete("routed")


def holders(observer: KVEventIndex, prefix: list[int]) -> set[str]:
    """Prefill replicas holding the whole prefix, by their KV events."""
    hashes = block_hashes(prefix, BLOCK)
    with observer._lock:
        matched = observer.precise.match(hashes)
    return {r for r, n in matched.items() if n == len(hashes)}


def wait_for(cond, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not (result := cond()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


def test_tenants_land_on_the_replica_holding_their_prefix_and_a_hot_tenant_spreads(routed):
    client, aclient, observer, _ = routed
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 400) for _ in range(PREFIX)] for _ in range(4)]

    def prompt(t: int) -> list[int]:
        return prefixes[t] + [rng.randrange(10, 400) for _ in range(SUFFIX)]

    cached = {t: [] for t in range(4)}
    for _ in range(4):
        for t in range(4):
            out = client.completions.create(model="tiny-llama", prompt=prompt(t), max_tokens=2, temperature=0)
            cached[t].append(out.usage.prompt_tokens_details.cached_tokens)
    for t in range(4):
        # The first request computes the prefix somewhere; every later one finds it cached there.
        assert all(c >= PREFIX for c in cached[t][1:]), (t, cached[t])
        assert len(wait_for(lambda: holders(observer, prefixes[t]))) == 1, f"tenant {t}'s prefix went to 2 replicas"
    replicas = set(observer.precise.replicas)
    assert len(replicas) == 3
    hit_rate = sum(map(sum, cached.values())) / (16 * (PREFIX + SUFFIX))
    assert hit_rate > 0.5  # 12 of 16 requests reuse 96 of 136 tokens

    # Tenant 0 turns hot: a burst of its requests at once. Queued work on its replica outweighs
    # the prefix, so other replicas compute the prefix too and share the burst.
    async def burst():
        return await asyncio.gather(*(aclient.completions.create(model="tiny-llama", prompt=prompt(0), max_tokens=2,
                                                                 temperature=0) for _ in range(24)))

    outs = asyncio.run(burst())
    assert all(o.choices[0].text is not None for o in outs)
    assert len(wait_for(lambda: len(holders(observer, prefixes[0])) >= 2 and holders(observer, prefixes[0]))) >= 2
    # ...while most of the burst still reused a cached prefix.
    assert sum(o.usage.prompt_tokens_details.cached_tokens >= PREFIX for o in outs) >= 12


def test_requests_keep_flowing_while_redis_is_down_and_precision_returns(routed):
    client, _, observer, redis = routed
    prefix = [7] * PREFIX

    def ask(i: int):
        return client.completions.create(model="tiny-llama", prompt=prefix + [11 + i] * SUFFIX, max_tokens=2,
                                         temperature=0)

    redis.stop()
    try:
        outs = [ask(i) for i in range(4)]  # routers approximate: their own placements
        assert all(o.choices for o in outs)
        assert all(o.usage.prompt_tokens_details.cached_tokens >= PREFIX for o in outs[1:])
    finally:
        redis.start()
    assert wait_for(lambda: observer.mode == "precise")
    outs = [ask(i) for i in range(4, 6)]
    assert all(o.choices for o in outs)
    # The replicas republish what they hold once redis is back: the prefix is known again.
    assert wait_for(lambda: holders(observer, prefix))
