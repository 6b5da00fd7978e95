"""The soak's CI-sized run (#42; benchmarks/soak.py is the long one): 1,000 requests of
pdserve.bench.soak's mix (whole and streamed, shared prefixes, cancellations mid-stream, client
timeouts, hostile bodies) against a disaggregated app of its own, its prefill replica and then its
decode replica killed with SIGKILL under the load. Only the accounting is asserted: every request
completed, was cancelled or timed out by its client, failed with a retryable error, or (hostile)
got its 4xx; once the load is over, no replica holds a KV block, lease, open transfer, in-flight
request or extra output connection, and the gateway no waiting sequence."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.bench import soak
from pdserve.config import ServeConfig
from tests.fakes.hostile_requests import hostile_requests

NUM_REQUESTS = 1000
KILLS = {300: "Prefill", 650: "Decode"}  # after this many requests, SIGKILL this pool's replica


@pytest.mark.slow
def test_a_soak_with_kills_accounts_for_every_request_and_leaks_nothing(serve_apps, tiny_llama):
    from ray import serve

    from pdserve.app import build

    name = "soak"
    pools = {"ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 1.0}
    cfg = ServeConfig(**{**soak.SOAK_CONFIG, "name": name, "prefill": pools, "decode": pools}, model=tiny_llama)
    serve.run(build(cfg), name=name, route_prefix=f"/{name}")
    kills: list[dict] = []
    killers: list[threading.Thread] = []
    num_done = [0]

    def kill(deployment: str) -> None:
        try:
            dead = soak.kill_replica(name, deployment)
            kills.append({"deployment": deployment, "dead": dead,
                          "new": soak.wait_for_replacement(name, deployment, dead, timeout_s=120)})
        except Exception as e:  # noqa: BLE001 - asserted below
            kills.append({"deployment": deployment, "error": repr(e)})

    def on_done(req, outcome) -> None:
        num_done[0] += 1
        if num_done[0] in KILLS:  # in a thread: the load goes on while the replica dies and comes back
            killers.append(threading.Thread(target=kill, args=(KILLS[num_done[0]],), daemon=True))
            killers[-1].start()

    try:
        plan = soak.plan_requests(NUM_REQUESTS, cfg.served_model_name, hostile_requests(cfg.served_model_name))
        result = asyncio.run(soak.drive(f"{serve_apps['base']}/{name}", plan, concurrency=12, on_done=on_done))
        for t in killers:
            t.join(150)
        assert len(kills) == len(KILLS) and all("new" in k for k in kills), kills
        assert result.num_requests == NUM_REQUESTS
        assert result.counts[soak.UNACCOUNTED] == 0, (result.as_dict()["counts"], result.unaccounted)
        assert result.counts[soak.COMPLETED] > NUM_REQUESTS // 2, result.as_dict()
        # A decode replica killed while it pulled leaves its leases on the prefill replica: they expire.
        accounting, held = soak.wait_for_quiescence(name, cfg.transfer.lease_s + 30)
        assert not held, (held, accounting)
    finally:
        serve.delete(name)
