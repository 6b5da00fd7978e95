"""What a decode replica's placement reads of the prefill pool: its process's prefix-aware router's
view of each prefill replica's queue (the last report, corrected by what the router sent since),
least of them. Ray Serve's own `RequestRouter` base, driven as Ray Serve drives it."""

from __future__ import annotations

import asyncio
import threading
import time

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol import GenerateRequest
from pdserve.router.pool_views import least_queued_tokens
from pdserve.router.request_router import PrefixAwareRouter

DEPLOYMENT = DeploymentID(name="Prefill", app_name="app")


class Replica:
    """What the router reads of a running replica: its id and its last routing-stats report."""

    def __init__(self, name: str, queued_prefill_tokens: int):
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats = {"queued_prefill_tokens": queued_prefill_tokens, "time": time.time()}

    async def get_queue_len(self, deadline_s: float) -> int:  # (Ray Serve probes a new replica)
        return 0


def _pending(request_id: str, num_prompt_tokens: int) -> PendingRequest:
    req = GenerateRequest(request_id, list(range(1, 1 + num_prompt_tokens)), SamplingParams(max_tokens=1))
    return PendingRequest([req], {}, RequestMetadata(request_id, request_id))


def test_placement_reads_the_least_queue_as_the_prefill_router_sees_it_now():
    async def main():
        router = PrefixAwareRouter(DEPLOYMENT, DeploymentHandleSource.REPLICA)
        assert least_queued_tokens("a pool without a router") is None
        router.initialize_state(pool="prefill-view-test", block_size=16)
        assert least_queued_tokens("prefill-view-test") is None  # no replica yet
        replicas = [Replica("busy", 500), Replica("idle", 100)]
        router.update_replicas(replicas)
        assert least_queued_tokens("prefill-view-test") == 100
        # A 120-token prompt goes to the less queued one: the view counts it there before any report.
        ranked = await router.choose_replicas(replicas, _pending("r1", 120))
        assert ranked[0][0].replica_id.unique_id == "idle"
        assert least_queued_tokens("prefill-view-test") == 220
        router.on_request_completed(ReplicaID("idle", DEPLOYMENT), "r1")  # (sent after the report: not in it)
        assert least_queued_tokens("prefill-view-test") == 100

        # Read from another thread (the decode replica's loop) while the router's loop sends: no
        # error from a dict or deque changed while it was read.
        replicas, errors, stop = [Replica("a", 0), Replica("b", 0)], [], threading.Event()

        def read():
            while not stop.is_set():
                try:
                    least_queued_tokens("prefill-view-test")
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    errors.append(e)

        router.update_replicas(replicas)
        reader = threading.Thread(target=read)
        reader.start()
        try:
            for i in range(3000):
                await router.choose_replicas(replicas, _pending(f"s{i}", 16))
                if i % 2:
                    router.on_request_completed(ReplicaID("a", DEPLOYMENT), f"s{i - 1}")
                    router.on_request_completed(ReplicaID("b", DEPLOYMENT), f"s{i - 1}")
        finally:
            stop.set()
            reader.join()
        assert errors == []
        await asyncio.sleep(0)  # (Ray Serve's probes of the new replicas run)

    asyncio.run(main())


def test_the_routers_take_waiting_requests_past_the_ttft_target_last():
    """Ray Serve's routing tasks take the next waiting request from `_get_next_pending_request_to_route`;
    with `ttft_s` pdserve's routers take those inside it first (policy.LateLast), skipping
    cancelled ones; without it, first come first served (Ray Serve's own)."""
    import inspect

    from ray.serve.request_router import RequestRouter

    from pdserve.router.request_router import KVHeadroomRouter

    assert "_get_next_pending_request_to_route" in inspect.getsource(RequestRouter._fulfill_pending_requests)

    async def main():
        taken = {}
        for kwargs in ({"ttft_s": 1.0}, {}):
            router = KVHeadroomRouter(DeploymentID(name="Decode", app_name="app"), DeploymentHandleSource.PROXY)
            router.initialize_state(pool="decode", **kwargs)
            now = time.time()
            for name, age_s in (("first", 5.0), ("second", 2.0), ("cancelled", 0.3), ("new", 0.2)):  # arrival order
                pending = _pending(name, 4)
                pending.created_at = now - age_s
                if name == "cancelled":
                    pending.future.cancel()
                router._pending_requests_to_route.append(pending)
            names = []
            while (pending := router._get_next_pending_request_to_route()) is not None:
                names.append(pending.metadata.request_id)
            taken[bool(kwargs)] = names
        assert taken == {True: ["new", "first", "second"], False: ["first", "second", "new"]}

    asyncio.run(main())
