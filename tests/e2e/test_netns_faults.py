"""Faults on real (virtual) links (issue #42): the disaggregated app on a Ray cluster whose
prefill and decode nodes sit in their own network namespaces (tests/harness), so every KV pull,
output connection and Ray call between the pools crosses veths and a bridge the test can cut.

- Long prompts are prefilled on the prefill node and their KV pulled over the link (not through
  shared memory); their greedy outputs equal a short prompt's decode-side run of the same text.
- A 5 s partition between the prefill and decode nodes (nftables, the head still reachable from
  both): no request outlives its deadline, each one finishes or fails with a retryable status;
  once the link heals, service comes back and no replica holds a block or a lease.
- 2% loss on the link between prefill and decode: every request succeeds with the outputs of
  the loss-free run.
- kill -9 of the prefill replica with pulls in flight: every request completes (prefilled on
  the decode replica instead), Serve's replacement serves, and no block or lease is left.
- Redis (the KV-event stream, on the head's address) killed and restarted under load: no
  request fails, and the routers and replicas find the new server (every router asks for
  snapshots, the replicas publish them: routing is precise again).
- 200 ms each way (a relay: this kernel has no netem) and 2% loss on the link, with a new prefill
  replica behind it: every request succeeds with the outputs of the clean run."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest
import requests

from tests.harness import netns
from tests.harness.lab_app import (LONG_PROMPT, REQUEST_TIMEOUT_S, complete, holds_nothing, idle, replica_pids,
                                   wait_until_serving)

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=f"netns lab: {netns.unavailable()}")

@pytest.fixture(scope="module")
def lab_app(tiny_llama, netns_lab):
    """The app with precise routing: its KV events go through the lab's Redis."""
    with netns_lab.app(tiny_llama, router={"redis_url": netns_lab.redis.url}) as app:
        yield app


def test_kv_crosses_the_link_and_outputs_match(lab_app):
    _, driver, base = lab_app
    before = driver.call("stats", app="lab", pool="Decode")
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: complete(base, f"case {i % 2}: {LONG_PROMPT}"), range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    texts = [a.json()["choices"][0]["text"] for a in answers]
    assert texts[0::2] == [texts[0]] * 4 and texts[1::2] == [texts[1]] * 4  # greedy: same prompt, same text
    after = driver.call("stats", app="lab", pool="Decode")
    assert after["num_pulled_bytes"] > before["num_pulled_bytes"], "no KV was pulled from the prefill node"
    assert after["num_shared_memory_pulls"] == 0, "KV went through shared memory, not the link"
    stats = idle(driver)
    assert all(holds_nothing(s) for s in stats.values()), stats


@pytest.mark.parametrize("partition_s", [5, 12])  # 12: past the KV lease (10 s), well before the deadline
def test_a_partition_between_prefill_and_decode_ends_every_request_in_time(lab_app, partition_s):
    cluster, driver, base = lab_app
    prefill, decode = cluster.nodes["prefill"], cluster.nodes["decode"]
    client_timeout = REQUEST_TIMEOUT_S + 15

    def one(i: int) -> tuple[int | str, float]:
        start = time.monotonic()
        try:
            status = complete(base, f"partition {partition_s} {i}: {LONG_PROMPT}", 16, timeout=client_timeout).status_code
        except requests.Timeout:
            status = "hung"
        return status, time.monotonic() - start

    before = driver.call("stats", app="lab", pool="Decode")
    cluster.lab.partition(prefill, decode)
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(partition_s)
        cluster.lab.heal(prefill, decode)
        results = [f.result() for f in futures]
    after = driver.call("stats", app="lab", pool="Decode")
    print({k: (before[k], after[k]) for k in after if before.get(k) != after[k]})
    # Each request finished or failed with a status a client retries; none outlived its deadline.
    assert all(status in (200, 503, 504) for status, _ in results), results
    assert all(took < REQUEST_TIMEOUT_S + 10 for _, took in results), results
    recovered_s = wait_until_serving(base, 60)
    print(f"partition: {[(s, round(t, 1)) for s, t in results]}, service back {recovered_s:.1f} s after the heal")
    stats = idle(driver)
    assert all(holds_nothing(s) for s in stats.values()), stats


def _all_succeed(base: str, prompts: list[str], salt: str) -> tuple[list[str], float]:
    """The prompts at once, under a new cache_salt (nothing cached: every prompt prefilled and
    pulled again); each must succeed. Their texts, and how long the fastest took."""
    def timed(prompt: str):
        start = time.monotonic()
        return complete(base, prompt, 16, cache_salt=salt), time.monotonic() - start

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(timed, prompts))
    assert [a.status_code for a, _ in answers] == [200] * len(prompts), [a.text[:200] for a, _ in answers]
    return [a.json()["choices"][0]["text"] for a, _ in answers], min(t for _, t in answers)


def test_loss_on_the_kv_link_changes_no_output(lab_app):
    cluster, driver, base = lab_app
    prefill, decode = cluster.nodes["prefill"], cluster.nodes["decode"]
    prompts = [f"loss {i}: {LONG_PROMPT}" for i in range(6)]

    clean, _ = _all_succeed(base, prompts, "clean")
    before = driver.call("stats", app="lab", pool="Decode")
    for node, peer in ((prefill, decode), (decode, prefill)):
        cluster.lab.loss(node, 2, peer)
    try:
        lossy, _ = _all_succeed(base, prompts, "lossy")
    finally:
        for node in (prefill, decode):
            cluster.lab.loss(node, 0)
    after = driver.call("stats", app="lab", pool="Decode")
    assert lossy == clean
    assert after["num_remote_prefills"] - before["num_remote_prefills"] == len(prompts)
    assert after["num_failed_pulls"] == before["num_failed_pulls"]


def test_a_prefill_replica_killed_mid_transfer_costs_no_request(lab_app):
    cluster, driver, base = lab_app
    [pid] = replica_pids(cluster.nodes["prefill"], "Prefill")
    before = driver.call("stats", app="lab", pool="Decode")
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, base, f"kill {i}: {LONG_PROMPT}", 16) for i in range(8)]
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        answers = [f.result() for f in futures]
    # Each affected request is prefilled on the decode replica instead.
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:300] for a in answers]
    # Serve replaces the replica, and remote prefill comes back.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if replica_pids(cluster.nodes["prefill"], "Prefill") and complete(base, f"{time.monotonic()} {LONG_PROMPT}", 2).ok:
            after = driver.call("stats", app="lab", pool="Decode")
            if after["num_pulled_blocks"] > before["num_pulled_blocks"] and \
                    driver.call("stats", app="lab", pool="Prefill")["num_unfinished_requests"] == 0:
                break
        time.sleep(1)
    else:
        pytest.fail("no new prefill replica served within 120 s")
    stats = idle(driver)
    assert all(holds_nothing(s) for s in stats.values()), stats


def test_redis_killed_and_restarted_under_load_fails_no_request(lab_app, netns_lab):
    import redis

    cluster, driver, base = lab_app
    lab_redis = netns_lab.redis
    stream = "pdserve:kv-events:lab:Prefill"
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, base, f"redis {i}: {LONG_PROMPT}", 16) for i in range(16)]
        time.sleep(0.3)
        lab_redis.stop()  # kill -9; what it held is gone (in-memory only)
        time.sleep(2)
        lab_redis.start()  # the same address, empty
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [200] * 16, [a.text[:300] for a in answers]
    client = redis.Redis.from_url(lab_redis.url, password=lab_redis.password)
    try:
        deadline = time.monotonic() + 30
        while True:  # a router that reconnects asks every replica for a snapshot; the replica sends it
            asked = any(f.get(b"r") == b"*" for _, f in client.xrange(stream + ":resync"))
            if asked and client.xlen(stream) > 0:
                break
            assert time.monotonic() < deadline, "no router or replica came back to the new Redis in 30 s"
            time.sleep(0.5)
    finally:
        client.close()
    assert complete(base, f"after redis: {LONG_PROMPT}").status_code == 200
    stats = idle(driver)
    assert all(holds_nothing(s) for s in stats.values()), stats


def test_delay_and_loss_on_the_link_change_no_output(lab_app):
    """200 ms each way (a relay on the path) and 2% loss between the prefill and decode nodes. The
    relay takes new connections only, so the prefill replica is replaced first: the decode
    replica's calls to the new one and its KV pulls from it all cross the slow, lossy link.
    Last in this module: the relays stay for the connections they carry (until the module's app
    is gone: `LabCluster.app` then removes them)."""
    cluster, driver, base = lab_app
    prefill, decode = cluster.nodes["prefill"], cluster.nodes["decode"]
    prompts = [f"delay {i}: {LONG_PROMPT}" for i in range(6)]

    clean, _ = _all_succeed(base, prompts, "clean")
    for node, peer in ((prefill, decode), (decode, prefill)):
        cluster.lab.delay(node, peer, 200)
        cluster.lab.loss(node, 2, peer)
    try:
        [pid] = replica_pids(prefill, "Prefill")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not replica_pids(prefill, "Prefill") or not complete(base, f"{time.monotonic()} {LONG_PROMPT}", 2).ok:
            assert time.monotonic() < deadline, "no new prefill replica served within 120 s"
            time.sleep(1)
        before = driver.call("stats", app="lab", pool="Decode")
        slow, fastest_s = _all_succeed(base, prompts, "slow")
    finally:
        for node in (prefill, decode):
            cluster.lab.loss(node, 0)
    after = driver.call("stats", app="lab", pool="Decode")
    assert slow == clean
    assert after["num_remote_prefills"] - before["num_remote_prefills"] == len(prompts)
    assert after["num_failed_pulls"] == before["num_failed_pulls"]
    assert fastest_s > 0.8, "the requests did not cross the delayed link"  # a call and a pull: 2 round trips
    stats = idle(driver)
    assert all(holds_nothing(s) for s in stats.values()), stats
