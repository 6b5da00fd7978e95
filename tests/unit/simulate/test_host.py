"""A shared host in the simulator (`SimConfig.host`): the request path's latency lands on the
first token by the path taken, engines' steps stretch only when more asks for the cores than
there are, and every request still finishes once with nothing held."""

import dataclasses
import math

import pytest

from pdserve.simulate.hardware import Host, load_host
from pdserve.simulate.replicas import SharedCores
from pdserve.simulate.sim import Simulation
from pdserve.simulate.workload import SimRequest, bench_requests
from tests.unit.simulate.fixtures import config
from tests.unit.simulate.test_sim import MIX, assert_balanced

ROOMY = Host(cores=64, idle_cores=0.0, request_cpu_s=0.0, token_cpu_s=0.0, decode_request_s=0.0, decode_step_s=0.0,
             decode_token_s=0.0, prefill_request_s=0.0, local_path_s=0.04, remote_path_s=0.07)


def test_shared_cores_stretch_only_past_the_cores():
    cores = SharedCores(dataclasses.replace(ROOMY, cores=2, idle_cores=0.5))
    cores.num_busy = 1
    assert cores.stretch(0.0) == 1.0  # 1.5 cores asked for of 2
    cores.num_busy = 2
    assert cores.stretch(0.0) == pytest.approx(2.5 / 2)
    cores.spend(1.0, 0.0)  # a CPU second of path work just now: a core's worth, decaying
    assert cores.stretch(0.0) == pytest.approx(3.5 / 2)
    assert cores.stretch(1.0) == pytest.approx((2.5 + math.exp(-1)) / 2)
    assert cores.stretch(50.0) == pytest.approx(2.5 / 2)


def one(prompt: int, output: int = 8) -> list[SimRequest]:
    return [SimRequest(0.0, prompt, output)]


@pytest.mark.parametrize("prefill", [0, 1], ids=["colocated", "disaggregated"])
def test_the_path_latency_lands_on_the_first_token_by_the_path_taken(prefill):
    base = Simulation(config(prefill=prefill, decode=1, ttft_s=30.0))
    plain = base.run(one(600))
    host = dataclasses.replace(ROOMY, local_path_s_per_prompt_token=1e-5, remote_path_s_per_prompt_token=3e-5)
    sim = Simulation(dataclasses.replace(config(prefill=prefill, decode=1, ttft_s=30.0), host=host))
    result = sim.run(one(600))
    assert result["placements"] == plain["placements"]
    [where] = {key.split(":")[0] for key in result["placements"]}
    extra = 0.04 + 600 * 1e-5 if where == "local" else 0.07 + 600 * 3e-5
    assert result["ttft_ms"]["p50"] == pytest.approx(plain["ttft_ms"]["p50"] + extra * 1000, rel=0.02)
    assert result["itl_ms"]["p50"] == pytest.approx(plain["itl_ms"]["p50"], rel=1e-6)  # roomy: no stretch


@pytest.mark.parametrize("prefill", [0, 1], ids=["colocated", "disaggregated"])
def test_a_prompt_token_found_cached_costs_its_own(prefill):
    """The path's cost per prompt token is per token computed: a prompt whose 992-token prefix
    the replicas hold (from the request before) pays the cached tokens' own, measured apart."""
    def second_ttft(host) -> float:
        sim = Simulation(dataclasses.replace(config(prefill=prefill, decode=1, ttft_s=30.0), host=host))
        first, record = {}, sim.first_token

        def first_token(req, now):
            first[req.id] = now - req.arrival
            record(req, now)

        sim.first_token = first_token
        sim.run(iter([SimRequest(0.0, 1056, 8, prefix_id=7, prefix_tokens=992),
                      SimRequest(5.0, 1056, 8, prefix_id=7, prefix_tokens=992)]))
        return first[1]

    costs = dataclasses.replace(ROOMY, local_path_s_per_prompt_token=1e-5, remote_path_s_per_prompt_token=3e-5,
                                local_path_s_per_cached_token=1e-6, remote_path_s_per_cached_token=2e-6,
                                prefill_s_per_prompt_token=3e-6, prefill_s_per_cached_token=1e-7)
    extra = 64 * 1e-5 + 992 * 1e-6 if prefill == 0 else 64 * 3e-5 + 992 * 2e-6  # (ROOMY's own path in both)
    assert second_ttft(costs) == pytest.approx(second_ttft(ROOMY) + extra, rel=1e-3)


def test_steps_stretch_when_the_engines_outnumber_the_cores():
    """Two decode replicas streaming at once: on one core each step takes twice as long; on two, as
    long as alone."""
    requests = [SimRequest(0.0, 64, 200), SimRequest(0.0, 64, 200)]

    def itl(cores: int) -> float:
        host = dataclasses.replace(ROOMY, cores=cores, local_path_s=0.0, remote_path_s=0.0)
        sim = Simulation(dataclasses.replace(config(prefill=0, decode=2), host=host))
        result = sim.run(iter(requests))
        assert {r.num_steps > 0 for r in sim.pools["decode"]} == {True}  # each replica took one
        return result["itl_ms"]["p50"]

    assert itl(1) == pytest.approx(2 * itl(2), rel=0.02)


def test_a_replicas_own_python_lengthens_its_steps():
    """Per decode step, per request joining a decode replica (the part measured in the step it
    joins in), per prompt a prefill replica hands over: each adds its time once where it happens
    (a roomy host: nothing stretches)."""
    def prefilled(host) -> list[float]:  # two prompts at once, prefilled one after the other
        sim = Simulation(dataclasses.replace(config(prefill=1, decode=1, ttft_s=30.0, split=False), host=host))
        done, prefill_done = {}, sim.prefill_done

        def record(req, replica, now):
            done[req.id] = now
            prefill_done(req, replica, now)

        sim.prefill_done = record
        sim.run(iter([SimRequest(0.0, 1000, 20), SimRequest(0.0, 1000, 20)]))
        return [done[0], done[1]]

    plain, own = prefilled(ROOMY), prefilled(dataclasses.replace(ROOMY, prefill_request_s=0.005))
    assert own[0] == pytest.approx(plain[0] + 0.005) and own[1] == pytest.approx(plain[1] + 0.010)
    plain = Simulation(dataclasses.replace(config(prefill=1, decode=1, ttft_s=30.0), host=ROOMY)).run(one(600, 20))
    own = dataclasses.replace(ROOMY, decode_step_s=0.002, decode_request_s=0.003, decode_join_s=0.001,
                              prefill_request_s=0.005)
    result = Simulation(dataclasses.replace(config(prefill=1, decode=1, ttft_s=30.0), host=own)).run(one(600, 20))
    assert list(result["placements"]) == ["remote: remote meets the TTFT target"] == list(plain["placements"])
    # The prefill replica's 5 ms are part of the remote path as measured: the first token is no later,
    # but that replica is busy 5 ms longer (a prompt queued behind this one would wait for them).
    assert result["ttft_ms"]["mean"] == pytest.approx(plain["ttft_ms"]["mean"])
    # The first decode step carries the join's 1 ms (the other 2 run beside the engine) and the step's
    # own cost; every later one the step's.
    assert result["itl_ms"]["p50"] == pytest.approx(plain["itl_ms"]["p50"] + 2, rel=0.02)
    assert result["tpot_ms"]["mean"] == pytest.approx(plain["tpot_ms"]["mean"] + 2 + 1 / 19, rel=0.01)


def test_a_steps_own_cost_spreads_as_measured():
    """`decode_step_jitter_s`: the step's own cost about its median at 100 percentiles, one
    drawn per step. 2 of 100 at +10 ms: the tail of the gaps moves by 10 ms, their median not."""
    def itl(host) -> dict:
        sim = Simulation(dataclasses.replace(config(prefill=0, decode=1), host=host))
        return sim.run(iter([SimRequest(0.0, 64, 2000)]))["itl_ms"]

    steady = dataclasses.replace(ROOMY, decode_step_s=0.001)
    plain, spread = itl(steady), itl(dataclasses.replace(steady, decode_step_jitter_s=(-0.002,) + (0.0,) * 97
                                                         + (0.010, 0.010)))
    assert spread["p50"] == pytest.approx(plain["p50"], rel=0.02)
    assert spread["p99"] == pytest.approx(plain["p99"] + 10, rel=0.05)
    # Never shorter than the engine's own step: the -2 ms percentile takes off the 1 ms it has.
    assert spread["mean"] == pytest.approx(plain["mean"] + (-1 + 20) / 100, rel=0.05)


def test_the_path_cpu_stretches_steps():
    busy = dataclasses.replace(ROOMY, cores=1, request_cpu_s=0.0, token_cpu_s=0.002, local_path_s=0.0,
                               remote_path_s=0.0)
    quiet = dataclasses.replace(busy, token_cpu_s=0.0)
    itl = {}
    for name, host in (("busy", busy), ("quiet", quiet)):
        sim = Simulation(dataclasses.replace(config(prefill=0, decode=1), host=host))
        itl[name] = sim.run(iter([SimRequest(0.0, 64, 400)]))["itl_ms"]["p50"]
    assert itl["busy"] > 1.05 * itl["quiet"]


def test_a_shared_host_under_load_leaves_nothing_held():
    host = dataclasses.replace(ROOMY, cores=2, idle_cores=0.3, request_cpu_s=0.01, token_cpu_s=0.0005)
    sim = Simulation(dataclasses.replace(config(prefill=2, decode=3, ttft_s=0.3), host=host))
    result = sim.run(bench_requests(MIX, seed=1, rate=60, duration_s=10))
    assert_balanced(sim, result)
    assert sim.cores.num_busy == 0


def test_the_shipped_host_measurement_loads():
    host = load_host()
    assert host.cores >= 1 and host.local_path_s > 0 and host.remote_path_s > 0
    assert host.decode_join_s >= 0 and len(host.decode_step_jitter_s) == 100
    assert host.request_cpu_s >= 0 and host.token_cpu_s >= 0 and host.idle_cores >= 0
