"""A tensor-parallel replica on Ray Serve: the replica actor drives, a rank worker actor in its
placement group holds the other half of the model; greedy output equals a one-rank replica's,
and a killed rank worker gets the whole replica replaced."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.config import ServeConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol import GenerateRequest
from tests.harness.fixed_costs import REMOTE_PREFILL_SLO

ENGINE = {"num_threads": 1, "num_kv_blocks": 64, "block_size": 8, "max_model_len": 256, "max_num_seqs": 8,
          "max_num_batched_tokens": 64}
PROMPTS = [[5, 17, 99, 3, 44, 7, 8, 9], list(range(20, 60)), [300, 301, 7]]


def greedy(app: str, prompt: list[int], tag: str, pool: str = "Unified") -> list[int]:
    from ray import serve

    handle = serve.get_deployment_handle(pool, app).options(stream=True)
    req = GenerateRequest(f"{app}-{tag}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return [t for out in handle.generate.remote(req) for t in out.new_token_ids]


def rank_workers() -> list[dict]:
    """The tp2 replica's worker ranks, as its stats report them: [{rank, pid, node_id}]."""
    from ray import serve

    return serve.get_deployment_handle("Unified", "tp2").stats.remote().result(timeout_s=30)["worker_ranks"]


@pytest.fixture(scope="module")
def tp_apps(ray_session, tiny_llama):
    from ray import serve
    from ray.serve.context import _get_global_client

    from pdserve.app import build

    pool = {"ray_actor_options": {"num_cpus": 0.2}, "health_check_period_s": 1.0}
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    # Both apps at once: their replicas start side by side (most of a start is waiting on Serve).
    serve.run_many([serve.RunTarget(build(ServeConfig(name=name, model=tiny_llama, mode="colocated", engine=ENGINE,
                                                      decode={**pool, "engine": {"tensor_parallel_size": tp}})),
                                    name=name, route_prefix=f"/{name}")
                    for name, tp in (("tp1", 1), ("tp2", 2))])
    yield
    _get_global_client().delete_apps(["tp1", "tp2"])  # both at once, as they came


def test_tp2_replica_serves_the_same_greedy_tokens(tp_apps):
    assert len(rank_workers()) == 1
    for i, p in enumerate(PROMPTS):
        assert greedy("tp2", p, f"a{i}") == greedy("tp1", p, f"a{i}")


def test_a_killed_rank_worker_gets_the_replica_replaced(tp_apps):
    [victim] = rank_workers()
    expected = greedy("tp1", PROMPTS[0], "k")
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # requests may fail until Serve has replaced the replica; then they succeed again
        try:
            got = greedy("tp2", PROMPTS[0], f"k{time.monotonic()}")
            workers = rank_workers()
            if workers and workers[0]["pid"] != victim["pid"]:
                break
        except Exception:  # noqa: BLE001 - the dying replica's error, retryable
            pass
        assert time.monotonic() < deadline, "the replica with a dead rank was not replaced"
        time.sleep(1)
    assert got == expected


@pytest.fixture(scope="module")
def disagg_tp_apps(tp_apps, tiny_llama):
    """Prefill TP 1 -> decode TP 2 (each decode rank pulls its heads from the one prefill rank) and
    prefill TP 2 -> decode TP 2 (rank to rank), every prompt prefilled remotely."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from pdserve.app import build

    pool = {"ray_actor_options": {"num_cpus": 0.2}, "health_check_period_s": 1.0}
    names = {"pd12": (1, 2), "pd22": (2, 2)}
    targets = []
    for name, (p, d) in names.items():
        cfg = ServeConfig(name=name, model=tiny_llama, engine=ENGINE, slo=REMOTE_PREFILL_SLO,
                          transfer={"host": "127.0.0.1"},
                          prefill={**pool, "engine": {"tensor_parallel_size": p}},
                          decode={**pool, "engine": {"tensor_parallel_size": d}})
        targets.append(serve.RunTarget(build(cfg), name=name, route_prefix=f"/{name}"))
    serve.run_many(targets)  # side by side, as tp_apps'
    yield list(names)
    _get_global_client().delete_apps(list(names))


def test_disaggregated_tensor_parallel_pools_match_one_rank(disagg_tp_apps):
    from ray import serve

    for app in disagg_tp_apps:
        for i, p in enumerate(PROMPTS):
            assert greedy(app, p, f"d{i}", pool="Decode") == greedy("tp1", p, f"d{i}"), (app, i)
        stats = serve.get_deployment_handle("Decode", app).stats.remote().result(timeout_s=30)
        # Every prompt went through prefill and came over as KV: no pull fell back to recompute.
        assert stats["num_remote_prefills"] == len(PROMPTS) and stats["num_failed_pulls"] == 0, stats
        assert stats["num_pulled_blocks"] > 0
