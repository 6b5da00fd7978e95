"""The simulator's invariants: every request finishes exactly once, every replica ends with
nothing held (blocks, streams, queues, context), replica-seconds are the integral of the replica
count, and a seed gives one result."""

from dataclasses import replace

import pytest

from pdserve.simulate.replicas import SimDecode
from pdserve.simulate.sim import AutoscaleSpec, Simulation
from pdserve.simulate.workload import SimRequest, WorkloadSpec, bench_requests
from tests.unit.simulate.fixtures import config

SHARED = WorkloadSpec("shared-prefix", output_len="1:64", num_tenants=4, system_prompt_len=600, question_len="8:64")
MIX = WorkloadSpec("long-prompt-mix", input_len="32:256", output_len="1:96", long_len="2048:6000", long_fraction=0.2)


def replicas(sim):
    return [*sim.pools["prefill"], *sim.pools["decode"], *sim.draining, *sim.retired]


def assert_balanced(sim, result):
    assert result["completed"] == result["num_requests"] == len(sim.finish_counts) > 0
    assert set(sim.finish_counts) == {1}  # each request finished once
    for r in replicas(sim):
        if r.pool == "decode":
            held = (r.used_blocks, r.routed_blocks, r.num_in_flight, r.num_running, r.context_tokens)
            assert held == (0,) * 5, r.name
            assert not (r.ready or r.joining or r.local or r.finishing), r.name
            assert (r.local_queued_tokens, r.remote_queued_tokens) == (0, 0), r.name
        else:
            assert not r.queue and r.queued_tokens == 0, r.name
    assert not sim.pending and not sim.late  # the callers' queue
    lifetimes = sum(end - start for _, start, end in sim.lifetimes)
    assert len(sim.lifetimes) == len(replicas(sim))
    assert result["replica_seconds"]["total"] == pytest.approx(lifetimes, rel=1e-9)


@pytest.mark.parametrize("spec", [SHARED, MIX], ids=["shared-prefix", "long-prompt-mix"])
def test_every_request_finishes_once_and_replicas_end_empty(spec):
    sim = Simulation(config(prefill=2, decode=3, ttft_s=0.3))
    result = sim.run(bench_requests(spec, seed=1, rate=60, duration_s=10))
    assert_balanced(sim, result)
    assert not sim.pending
    assert result["replica_seconds"]["total"] == pytest.approx(5 * sim.end_s)
    wheres = {key.split(":")[0] for key in result["placements"]}
    assert wheres == {"remote", "local"}  # both ways of prefilling ran
    # Each placed request's first token measured its path's prediction error, as on a real replica.
    errors = {where: sum(len(r.cm.errors[where]) for r in sim.pools["decode"]) for where in ("remote", "local")}
    assert errors["remote"] > 0 and errors["local"] > 0


def test_prefix_hits_cut_the_prefill_work():
    sim = Simulation(config(prefill=2, decode=3))
    sim.run(bench_requests(SHARED, seed=2, num_requests=200, rate=20))
    computed = sum(r.prefill_rate.num_samples for r in sim.pools["prefill"])
    assert computed
    assert sim.prefill_router.index.num_blocks("prefill-0") + sim.prefill_router.index.num_blocks("prefill-1") > 0
    # Requests carrying a tenant's prompt mostly found it cached on their decode replica or a prefill one.
    assert sim.window.prompt_tokens < 200 * 600 / 2 or sim.ttft.total == 200


def test_colocated_prefills_everything_locally():
    sim = Simulation(config(prefill=0, decode=2))
    result = sim.run(bench_requests(MIX, seed=3, rate=20, duration_s=5))
    assert_balanced(sim, result)
    assert list(result["placements"]) == ["local: no prefill pool"]


def test_autoscaling_follows_a_burst_and_drains_what_it_removes():
    spec = AutoscaleSpec(max_total_replicas=12, tick_s=1.0, downscale_delay_s=2.0, replica_start_s=2.0)
    sim = Simulation(config(prefill=1, decode=1, autoscale=spec, ttft_s=0.5))
    steps = [(0.0, 5.0), (10.0, 120.0), (25.0, 5.0)]
    result = sim.run(bench_requests(MIX, seed=4, rate_steps=steps, duration_s=60))
    assert_balanced(sim, result)
    peak = max(sum(1 for pool, start, end in sim.lifetimes if start <= t < end) for t in range(0, 60))
    assert 2 < peak <= 12  # it grew, within the budget
    assert sim.retired  # and shrank again, draining
    assert result["replica_seconds"]["total"] < 12 * sim.end_s


def test_each_pool_keeps_to_its_own_bounds_and_the_policy_times_the_starts():
    """The burst above with the prefill pool held to [1, 2] and decode to [2, 5], as Ray Serve
    holds each deployment to its autoscaling config's bounds whatever the policy asks."""
    spec = AutoscaleSpec(max_total_replicas=12, tick_s=1.0, downscale_delay_s=2.0, replica_start_s=3.0,
                         prefill_bounds=(1, 2), decode_bounds=(2, 5))
    sim = Simulation(config(prefill=1, decode=2, autoscale=spec, ttft_s=0.5))
    steps = [(0.0, 5.0), (10.0, 120.0), (25.0, 5.0)]
    result = sim.run(bench_requests(MIX, seed=4, rate_steps=steps, duration_s=60))
    assert_balanced(sim, result)

    def count(pool, t):
        return sum(1 for p, start, end in sim.lifetimes if p == pool and start <= t < end)

    live = [(count("prefill", t), count("decode", t)) for t in range(0, 60)]
    assert max(p for p, _ in live) == 2 and max(d for _, d in live) <= 5 and min(d for _, d in live) >= 2
    # A new replica serves 3 s after it is asked for; the policy sees it at its next 1 s tick.
    assert sim.scaler.starts.num_samples > 0 and 3.0 <= sim.scaler.starts.seconds <= 4.0


def test_a_seed_gives_one_result():
    def run(seed):
        result = Simulation(config(seed=seed)).run(bench_requests(MIX, seed=seed, rate=40, duration_s=5))
        return {k: v for k, v in result.items() if k not in ("wall_s", "real_time_ratio")}

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_a_request_asking_for_one_token_finishes_as_it_joins():
    sim = Simulation(config(prefill=1, decode=1))
    result = sim.run(iter([SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 2)]))
    assert_balanced(sim, result)
    assert sim.itl.total == 1  # one gap: the second request's second token


def test_a_warmup_teaches_the_replicas_and_the_result_starts_after_it():
    requests = list(bench_requests(MIX, seed=7, num_requests=40, rate=10))
    cold = Simulation(config(prefill=1, decode=1))
    cold_result = cold.run(iter(requests))
    warm = Simulation(config(prefill=1, decode=1))
    result = warm.run(iter(requests), warmup=[SimRequest(0.0, 128, 32)])
    assert_balanced(warm, result)
    assert result["num_requests"] == cold_result["num_requests"] == len(requests)
    assert sum(result["placements"].values()) == len(requests)  # the warm-up's placement is not counted
    assert warm.start_s > 0 and warm.pools["decode"][0].started_s == warm.start_s
    # The run's clock starts after the warm-up: the same arrivals span about the same time.
    assert result["simulated_s"] == pytest.approx(cold_result["simulated_s"], rel=0.2)
    assert result["replica_seconds"]["total"] == pytest.approx(2 * result["simulated_s"])

    # What the replicas know when the first request comes: the warm-up's steps and remote prefill.
    only = Simulation(config(prefill=1, decode=1))
    assert only.run(iter([]), warmup=[SimRequest(0.0, 128, 32)])["num_requests"] == 0
    cm = only.pools["decode"][0].cm
    assert cm.decode_step.num_samples >= 31 and cm.remote_rate.num_samples == 1 and cm.link.num_samples == 1


def _watch_decode_steps(monkeypatch) -> list[tuple[int, int, int]]:
    """(sequences held, requests in flight, pulled ones waiting) of each decode step as it starts."""
    seen = []
    start = SimDecode._start

    def watched(self, now):
        start(self, now)
        seen.append((self.num_seqs, self.num_in_flight, len(self.ready)))

    monkeypatch.setattr(SimDecode, "_start", watched)
    return seen


def test_a_decode_replica_takes_max_ongoing_requests_and_runs_max_num_seqs(monkeypatch):
    """As the engine does: 16 prompts at once on a replica of 2 slots that takes 8 requests: 8 are
    prefilled remotely meanwhile (not 2), at most 2 run, and the pulled ones wait in `ready`."""
    seen = _watch_decode_steps(monkeypatch)
    sim = Simulation(replace(config(prefill=2, decode=1, ttft_s=5.0), max_num_seqs=2, max_ongoing_requests=8))
    result = sim.run(iter([SimRequest(0.0, 512, 32)] * 16))
    assert_balanced(sim, result)
    assert max(s for s, _, _ in seen) == 2
    assert max(n for _, n, _ in seen) == 8
    assert max(w for _, _, w in seen) > 0
    assert set(result["placements"]) == {"remote: remote meets the TTFT target"}


def test_a_pull_with_no_free_blocks_recomputes_on_the_decode_replica(monkeypatch):
    """1,024 blocks of 16 tokens; 12 requests of 2,000 + 1,000 tokens (188 blocks each) prefilled
    remotely at once: 5 hold blocks, the other 7 find none at their import (the first still
    decode) and are prefilled where they are as blocks free; every request finishes, nothing is
    held after."""
    seen = _watch_decode_steps(monkeypatch)
    sim = Simulation(replace(config(prefill=2, decode=1, ttft_s=30.0), max_num_seqs=64))
    result = sim.run(iter([SimRequest(0.0, 2000, 1000)] * 12))
    assert_balanced(sim, result)
    assert result["recomputed"] == 7
    assert max(s for s, _, _ in seen) <= 5  # (the blocks bound them, not the 64 slots)


def test_requests_waiting_for_a_replica_with_room_go_late_ones_last(monkeypatch):
    """As pdserve's routers take them (`LateLast`): one replica taking one request, busy ~6 s with
    the first; the second waited past the 1 s TTFT target by then, the third (arrived at 5.5 s) has
    not: the third goes first and meets the target, the second after it."""
    sim = Simulation(replace(config(prefill=0, decode=1, ttft_s=1.0), max_num_seqs=1, max_ongoing_requests=1))
    first_token, firsts = sim.first_token, {}

    def seen(req, now):
        firsts[req.id] = now - req.arrival
        first_token(req, now)

    monkeypatch.setattr(sim, "first_token", seen)
    result = sim.run(iter([SimRequest(0.0, 64, 2000), SimRequest(0.1, 64, 4), SimRequest(5.5, 64, 4)]))
    assert_balanced(sim, result)
    assert firsts[2] <= 1.0 < firsts[1]
    assert 0.1 + firsts[1] > 5.5 + firsts[2]  # the second's first token came after the third's
