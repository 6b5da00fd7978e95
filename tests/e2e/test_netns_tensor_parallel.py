"""A tensor-parallel decode replica across the namespace lab (issue #42): its two ranks on the
decode node, each pulling its half of the KV heads from the prefill node over the link. One rank
worker killed (kill -9) while requests run: they succeed or fail with a status a client retries
(the engine's death is a 503, not a 500) within their deadline, Serve replaces the replica, later requests succeed with the outputs from before, and no replica
holds a block or a lease."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

from tests.harness import netns
from tests.harness.lab_app import LONG_PROMPT, REQUEST_TIMEOUT_S, complete, holds_nothing, idle

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=f"netns lab: {netns.unavailable()}")


@pytest.fixture(scope="module")
def tp_lab_app(tiny_llama, netns_lab):
    decode = {"ray_actor_options": {"num_cpus": 0.5, "resources": {"pdserve_decode": 0.001}},
              "health_check_period_s": 1.0, "engine": {"tensor_parallel_size": 2}}
    with netns_lab.app(tiny_llama, decode=decode) as app:
        yield app


def _rank_pids(driver) -> list[int]:
    return [w["pid"] for w in driver.call("stats", app="lab", pool="Decode")["worker_ranks"]]


def test_a_killed_rank_worker_gets_the_replica_replaced(tp_lab_app):
    cluster, driver, base = tp_lab_app
    prompts = [f"rank {i}: {LONG_PROMPT}" for i in range(4)]
    expected = [complete(base, p, 12) for p in prompts]
    assert [a.status_code for a in expected] == [200] * 4
    before = driver.call("stats", app="lab", pool="Decode")
    assert before["num_pulled_bytes"] > 0 and before["num_shared_memory_pulls"] == 0  # over the link
    [victim] = _rank_pids(driver)
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, base, f"during {i}: {LONG_PROMPT}", 32) for i in range(8)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        during = [f.result() for f in futures]
    # Each finishes, or fails with a status a client retries (503: the engine died under it; 504:
    # its deadline passed first), and none outlives its deadline.
    assert all(a.status_code in (200, 503, 504) for a in during), [(a.status_code, a.text[:200]) for a in during]
    assert all(a.elapsed.total_seconds() < REQUEST_TIMEOUT_S + 10 for a in during)
    deadline = time.monotonic() + 180
    while True:  # Serve replaces the replica (its health check fails on the dead rank)
        try:
            pids = _rank_pids(driver)
            if pids and victim not in pids and complete(base, f"{time.monotonic()} {LONG_PROMPT}", 2).ok:
                break
        except Exception:  # noqa: BLE001 - the dying replica answers errors meanwhile
            pass
        assert time.monotonic() < deadline, "the replica with a dead rank was not replaced within 180 s"
        time.sleep(1)
    after = [complete(base, p, 12) for p in prompts]
    assert [a.json()["choices"][0]["text"] for a in after] == [a.json()["choices"][0]["text"] for a in expected]
    stats = idle(driver)
    assert all(holds_nothing(s) for s in stats.values()), stats
