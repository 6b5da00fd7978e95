"""The joint P:D policy's core: what each pool wants, the shared budget, and hysteresis."""

import heapq
import random
from dataclasses import replace

import pytest

from pdserve.autoscale.joint import (DecodeSignal, JointScaler, PrefillSignal, Slo, StartClock, kept_up,
                                     replicas_for_wait, resized_occupancy, wanted, within_budget)
from pdserve.decode.placement import kv_read_share

SLO = Slo(ttft_s=1.0, itl_s=0.05, percentile=99)


def prefill(n, tokens_per_s, queued=0.0, attainment=None, prompt_tokens=1_000):
    """Prompts of 1,000 tokens: 0.1 s each on a replica computing 10,000 a second."""
    return PrefillSignal(n, queued, tokens_per_s, tokens_per_s_per_replica=10_000, ttft_attainment=attainment,
                         prompts_per_s=tokens_per_s / prompt_tokens)


def decode(n, kv_usage, attainment=None):
    return DecodeSignal(n, kv_usage, attainment)


def test_each_pool_is_sized_by_its_load():
    # 40,000 prompt tokens/s over 10,000 per replica: 4 replicas' work, in prompts of 0.1 s. At 5
    # under 1% wait over half the TTFT target (replicas_for_wait); KV 3 x 0.8 / 0.8: 3.
    assert wanted(prefill(2, 40_000), decode(3, 0.8), SLO) == (5, 3)
    # A queue those 5 start within 0.5 s (25,000 tokens) is no backlog.
    assert wanted(prefill(2, 40_000, queued=25_000), decode(3, 0.8), SLO) == (5, 3)
    # 60,000 queued: 35,000 beyond, cleared within half the target by 7 more.
    assert wanted(prefill(2, 40_000, queued=60_000), decode(3, 0.8), SLO) == (12, 3)
    # Prompts not counted yet: each taken to last the whole wait (4 replicas' work in 0.5 s prompts).
    assert wanted(replace(prefill(2, 40_000), prompts_per_s=None), decode(3, 0.8), SLO) == (7, 3)
    # Nothing at all: one replica each.
    assert wanted(prefill(4, 0), decode(4, 0.0), SLO) == (1, 1)


def test_a_missed_latency_target_grows_the_pool_that_missed_it():
    # Prefill misses TTFT with 0.3 s of work queued a replica (30,000 tokens, 10 replicas of 10,000/s),
    # over a quarter of the target: it grows by 20% (its queue alone asks for 30,000 / 5,000 = 6).
    # Decode misses ITL: +20%.
    assert wanted(prefill(10, 0, queued=30_000, attainment=0.95), decode(10, 0.1, attainment=1.0), SLO) == (12, 2)
    assert wanted(prefill(10, 0, attainment=1.0), decode(10, 0.1, attainment=0.9), SLO) == (1, 12)
    assert wanted(prefill(1, 0, queued=3_000, attainment=0.5), decode(1, 0.1, attainment=0.5), SLO) == (2, 2)


def test_replicas_for_wait_is_erlangs_delay_formula():
    """2 servers' work on 3 servers (M/M/3): a job waits at all with chance 4/9 (the textbook
    value), longer than t with 4/9 e^-(3 - 2) t / s. For at most 10% late that is t >= 1.49 s at
    s = 1: 1.5 s takes 3 servers, 1.4 s a fourth."""
    assert replicas_for_wait(2.0, service_s=1.0, wait_s=1.5, late_share=0.1) == 3
    assert replicas_for_wait(2.0, service_s=1.0, wait_s=1.4, late_share=0.1) == 4
    assert replicas_for_wait(0.0, 1.0, 1.0, 0.1) == 0
    # Thousands of servers stay within floating point; the work in short jobs fills them nearly all.
    assert replicas_for_wait(3_600.0, service_s=0.07, wait_s=0.5, late_share=0.01) == 3_601
    # A rate measured near zero: no count to a trillion servers, the work's own count (the budget cuts it).
    assert replicas_for_wait(1e12, service_s=0.07, wait_s=0.5, late_share=0.01) == 10**12
    with pytest.raises(ValueError):
        replicas_for_wait(1.0, 1.0, 0.0, 0.1)


def test_replicas_for_wait_holds_in_a_queue_run_job_by_job():
    """Jobs into a first-come pool of servers, each taken by the first server free, Poisson
    arrivals and exponential service: at the size replicas_for_wait gives at most the share asked
    waits longer than the wait, one server fewer and more do."""
    offered, wait_s, late_share = 20.0, 1.0, 0.05
    n = replicas_for_wait(offered, 1.0, wait_s, late_share)

    def late(servers: int) -> float:
        rng, now, free, num_late, num_jobs = random.Random(0), 0.0, [0.0] * servers, 0, 200_000
        for _ in range(num_jobs):
            now += rng.expovariate(offered)  # arrivals at `offered` a second, jobs of 1 s on average
            start = max(now, heapq.heappop(free))
            num_late += start - now > wait_s
            heapq.heappush(free, start + rng.expovariate(1.0))
        return num_late / num_jobs

    assert n == 23
    assert late(n) <= late_share < late(n - 1)


def test_first_tokens_late_behind_an_empty_prefill_queue_are_decodes_to_fix():
    """TTFT misses while the prefill queue is short: the wait was for a decode slot, and the
    requests waiting for one grow the decode pool (256 slots a replica, 80% of them)."""
    late = prefill(4, 0, queued=1_000, attainment=0.5)
    # 2 replicas' slots all held: 2 x 1.0 / 0.8 = 2.5, and 512 waiting fill 2 more: 4.5 -> 5.
    assert wanted(late, DecodeSignal(2, 0.5, 1.0, seq_usage=1.0, num_waiting=512, slots_per_replica=256), SLO) \
        == (1, 5)


def test_arrivals_outpacing_the_pool_size_decode_for_the_occupancy_to_come():
    """Little's law: the pool will hold arrival rate x residence time requests. A 4x step of
    arrivals shows a tick after it happens, while the occupancy (full at most) cannot show it."""
    def want(arrivals, held, residence=2.0):
        return wanted(prefill(1, 0), DecodeSignal(2, 0.8, arrivals_per_s=arrivals, residence_s=residence,
                                                  num_held=held), SLO)[1]

    # 2 replicas at 80% (1.6 replicas' worth) holding 100 requests held 2 s each: 50/s balances them.
    assert want(arrivals=50, held=100) == 2
    # Arrivals step to 200/s: 400 requests to hold, 4x the occupancy: 6.4 -> 8 at 80%.
    assert want(arrivals=200, held=100) == 8
    # Mid-step, 250 held already (and the occupancy with them): the growth still to come, 1.6x.
    assert wanted(prefill(1, 0), DecodeSignal(2, 1.0, arrivals_per_s=200, residence_s=2.0, num_held=250),
                  SLO)[1] == 4
    # Fewer arriving than it holds (a drop): the occupancy as it is; nothing measured: the same.
    assert want(arrivals=10, held=100) == 2
    assert want(arrivals=200, held=0) == want(arrivals=200, held=100, residence=None) == 2


def test_decode_is_sized_for_the_longer_steps_of_a_smaller_pool():
    """A decode step reads the weights once and every sequence's KV: on fewer replicas each batch
    is larger, each step longer, requests stay longer and the pool holds more. Sized on the
    occupancy alone, 10 replicas at 40% shrink to 5, which cannot keep up when half of a step's
    bytes are KV."""
    assert kv_read_share(0, 1e9) == 0.0 and kv_read_share(3e9, 1e9) == 0.75
    # Half the bytes KV: at 80% of the replicas the occupancy is 0.4 x 0.5 / 0.3 = 2/3, at 70% 1.0.
    assert resized_occupancy(0.4, 0.5, 0.8) == pytest.approx(2 / 3)
    assert resized_occupancy(0.4, 0.5, 0.7) == pytest.approx(1.0)
    assert resized_occupancy(0.4, 0.5, 0.5) == float("inf")  # every step all the pool can do
    assert resized_occupancy(0.4, 0.0, 0.5) == pytest.approx(0.8)  # steps the same whatever the batch

    def want(occupancy, share):
        return wanted(prefill(1, 0), DecodeSignal(10, occupancy, kv_read_share=share), SLO)[1]

    assert want(0.4, 0.0) == 5  # 10 x 0.4 / 0.8
    assert want(0.4, 0.5) == 8  # 10 x (0.5 + 0.5 x 0.4 / 0.8) = 7.5: resized_occupancy(0.4, 0.5, 0.8) <= 0.8
    # At the target it holds; full, it grows, by less than the occupancy says (a larger pool's steps are shorter).
    assert want(0.8, 0.5) == 10
    assert want(1.0, 0.0) == 13 and want(1.0, 0.5) == 12


def test_no_latency_step_while_the_pools_last_growth_is_starting():
    """Misses while replicas are starting are the ones those replicas come to fix: stepping on
    each tick of a start would overshoot by a step a tick. The load figures still count, over the
    replicas serving."""
    starting = DecodeSignal(4, 0.5, attainment := 0.5, num_starting=2)
    assert wanted(prefill(1, 0), starting, SLO)[1] == 2  # 2 serving x 0.5 / 0.8 -> 2: no step
    assert wanted(prefill(1, 0), DecodeSignal(4, 0.5, attainment), SLO)[1] == 5  # all serving: +20%
    late = PrefillSignal(10, 30_000, 0, 10_000, ttft_attainment=0.5, num_starting=3)
    assert wanted(late, decode(1, 0.1), SLO)[0] == 6  # its queue's want (30,000 / 5,000), no step
    assert wanted(replace(late, num_starting=0), decode(1, 0.1), SLO)[0] == 12


def test_the_budget_is_shared_in_proportion():
    assert within_budget(3, 5, 10) == (3, 5)
    assert within_budget(30, 10, 20) == (15, 5)
    assert within_budget(100, 1, 10) == (9, 1)
    assert within_budget(1, 100, 10) == (1, 9)
    with pytest.raises(ValueError):
        within_budget(1, 1, 1)



def test_a_binding_budget_first_keeps_each_pool_up_with_its_load():
    """Prefill keeps up at 3 replicas (30,000 tokens/s at 10,000 each) and wants 5 with headroom;
    decode fills 5 (2 serving at full occupancy, the load to grow 2.5x, its steps' time all weights) and
    wants 6. In proportion to whole wants a budget of 8 is 4 + 4, and decode falls behind; its
    needs first, 3 + 5. When even the needs exceed the budget, in proportion to them."""
    # (Little's law: 100 requests a second held 5 s each, against the 200 held now: 2.5x.)
    need = kept_up(prefill(3, 30_000), DecodeSignal(2, 1.0, kv_read_share=0.0, arrivals_per_s=100, residence_s=5,
                                                    num_held=200))
    assert need == pytest.approx((3.0, 5.0))
    assert within_budget(5, 6, 8) == (4, 4)
    assert within_budget(5, 6, 8, needed=need) == (3, 5)
    assert within_budget(6, 8, 8, needed=(4.0, 6.0)) == (3, 5)  # 8 x 4 / 10 = 3.2


def test_a_spent_budget_moves_a_replica_across_pools_only_for_a_whole_replica_of_share():
    """Wants of 5 + 8 and 5 + 6 in a budget of 8 round to 3 + 5 and 4 + 4: each tick's noise
    would drain a replica in one pool and start one in the other. From 3 + 5 the split holds while
    prefill's share (8 x 5 / 11 = 3.6) is under a replica away, and moves once it is one."""
    assert within_budget(5, 6, 8, current=(3, 5)) == (3, 5)
    assert within_budget(5, 5, 8, current=(3, 5)) == (4, 4)  # a share of 4.0: one replica away
    assert within_budget(5, 8, 8, current=(4, 4)) == (4, 4)  # 3.08
    assert within_budget(2, 8, 8, current=(4, 4)) == (2, 6)  # 1.6: more than a replica away, rounded
    assert within_budget(5, 6, 8, current=(3, 4)) == (4, 4)  # the budget not all spent: rounded


def test_a_fluctuating_load_does_not_make_it_oscillate():
    """A load that swings every tick between what needs 9 and 6 prefill replicas: the pool goes
    to 9 and stays there."""
    scaler = JointScaler(SLO, max_total_replicas=100, downscale_delay_s=3)
    p, d, history = 4, 2, []
    for tick in range(40):
        rate = 80_000 if tick % 2 == 0 else 48_000
        p, d = scaler.decide(prefill(p, rate), decode(d, 0.4), now_s=tick)
        history.append(p)
    assert history[0] == 9 and set(history) == {9}


def test_it_scales_down_only_after_a_sustained_drop_and_in_bounded_steps():
    scaler = JointScaler(SLO, max_total_replicas=100, downscale_delay_s=3)
    p, d, history = 20, 2, []
    for tick in range(12):
        p, d = scaler.decide(prefill(p, 8_000), decode(d, 0.4), now_s=tick)  # wants 1
        history.append(p)
    # Low from t=0: held until 3 s have passed, then halved every 3 s, down to what it wants.
    assert history == [20, 20, 20, 10, 10, 10, 5, 5, 5, 3, 3, 3]


def test_a_pool_with_replicas_starting_never_shrinks_and_waits_a_whole_delay_after():
    """Its want counts the replicas serving only: shrinking then undoes the growth on its way."""
    scaler = JointScaler(SLO, max_total_replicas=100, downscale_delay_s=3)
    d, history = 4, []
    for tick in range(10):
        starting = 2 if tick < 4 else 0
        _, d = scaler.decide(prefill(1, 0), DecodeSignal(d, 0.1, num_starting=starting), now_s=tick)  # wants 1
        history.append(d)
    # Starting until t=3; low from t=4: held until 3 s have passed, then halved.
    assert history == [4, 4, 4, 4, 4, 4, 4, 2, 2, 2]


def test_a_want_inside_the_dead_band_holds():
    scaler = JointScaler(SLO, max_total_replicas=100, downscale_delay_s=0)
    # 10 replicas; 72,000 tokens/s wants 9, 10% below: inside the band, held. 64,000 wants 8: down.
    assert scaler.decide(prefill(10, 72_000), decode(1, 0.0), now_s=0) == (10, 1)
    assert scaler.decide(prefill(10, 64_000), decode(1, 0.0), now_s=1) == (8, 1)


def test_the_decision_keeps_to_the_budget():
    scaler = JointScaler(SLO, max_total_replicas=8, downscale_delay_s=0)
    assert sum(scaler.decide(prefill(4, 400_000), decode(4, 1.0, attainment=0.5), now_s=0)) == 8


def test_a_share_a_pool_cannot_take_stays_with_the_other():
    """Prefill wants 10 and may run 2, decode wants 2, the budget is 4: 2 + 2, not a proportional
    3 + 1 that the prefill pool's ceiling then cuts to 2 + 1 (a replica of the budget lost, and
    the decode pool shrunk at once)."""
    scaler = JointScaler(SLO, max_total_replicas=4, downscale_delay_s=600)
    assert scaler.decide(prefill(1, 80_000), decode(2, 0.4, attainment=0.5), now_s=0) == (3, 1)
    assert scaler.decide(prefill(1, 80_000), decode(2, 0.4, attainment=0.5), now_s=1, max_prefill=2,
                         max_decode=2) == (2, 2)


def test_the_start_clock_measures_from_the_ask_to_the_first_tick_serving():
    clock = StartClock(prior_s=0.0)
    assert clock.seconds == 0.0 and clock.num_samples == 0
    clock.saw("prefill", 0.0, num_serving=1, num_starting=0)
    clock.ask("prefill", 0.0, 2)
    clock.saw("prefill", 5.0, num_serving=1, num_starting=2)
    clock.saw("prefill", 20.0, num_serving=2, num_starting=1)  # the first of the two: 20 s
    assert (clock.seconds, clock.num_samples) == (20.0, 1)
    clock.saw("prefill", 40.0, num_serving=3, num_starting=0)  # the second: 40 s
    assert clock.num_samples == 2 and clock.seconds == pytest.approx(30.0)
    # Both pools feed one clock: a decode replica asked for at 100 s serves at 110 s.
    clock.saw("decode", 100.0, num_serving=1, num_starting=0)
    clock.ask("decode", 100.0, 1)
    clock.saw("decode", 110.0, num_serving=2, num_starting=0)
    assert clock.num_samples == 3 and clock.seconds == pytest.approx(70 / 3)
    with pytest.raises(ValueError):
        StartClock(prior_s=-1.0)


def test_the_start_clock_drops_asks_not_carried_out_and_times_no_replacement():
    clock = StartClock(prior_s=7.0)
    clock.saw("prefill", 0.0, num_serving=1, num_starting=0)
    clock.ask("prefill", 0.0, 1)
    clock.ask("prefill", 10.0, 3)  # of these three, one was carried out (a ceiling took the rest)
    clock.saw("prefill", 15.0, num_serving=1, num_starting=2)
    clock.saw("prefill", 30.0, num_serving=3, num_starting=0)  # the oldest asks answer: 30 s and 20 s
    assert clock.num_samples == 2 and clock.seconds == pytest.approx(25.0)
    # A replica lost and replaced: none was asked for, nothing is timed.
    clock.saw("prefill", 40.0, num_serving=2, num_starting=1)
    clock.saw("prefill", 45.0, num_serving=3, num_starting=0)
    assert clock.num_samples == 2
    # The pool shrinking answers no ask either.
    clock.ask("prefill", 50.0, 1)
    clock.saw("prefill", 55.0, num_serving=2, num_starting=1)
    assert clock.num_samples == 2


def test_a_backlog_asks_for_the_replicas_that_can_reach_it_in_time():
    """The queued tokens are sized for half the TTFT target until a replica is seen taking longer
    to start: a replica that serves after the backlog is cleared does not clear it."""
    scaler = JointScaler(SLO, max_total_replicas=100, downscale_delay_s=600)
    backlog = prefill(1, 0, queued=100_000)
    assert scaler.decide(backlog, decode(1, 0.1), now_s=0)[0] == 20  # 100,000 / (10,000 x 0.5 s)
    for t in (5, 10, 15):  # 19 replicas starting
        scaler.decide(replace(backlog, num_replicas=20, num_starting=19), decode(1, 0.1), now_s=t)
    scaler.decide(replace(backlog, num_replicas=20, num_starting=0, queued_tokens=0), decode(1, 0.1), now_s=20)
    assert scaler.starts.num_samples == 19 and scaler.starts.seconds == 20.0
    # The same backlog on one replica now asks for what clears it within 20 s: 100,000 / (10,000 x 20 s).
    fresh = JointScaler(SLO, max_total_replicas=100, downscale_delay_s=600, replica_start_s=20.0)
    assert fresh.decide(backlog, decode(1, 0.1), now_s=0)[0] == 1


def test_the_ray_serve_policy_sizes_both_pools_from_their_reports(monkeypatch):
    """`JointSloPolicy` on stand-ins for Ray Serve's contexts (the policy's decisions are counted
    in Ray's metrics: kept here instead)."""
    import sys
    from types import SimpleNamespace

    from pdserve.autoscale.policies import JointSloPolicy

    recorded = []
    monkeypatch.setitem(sys.modules, "pdserve.telemetry.metrics",
                        SimpleNamespace(autoscaling_decision=lambda *decision: recorded.append(decision)))

    def pool(name, current, target=None, requests=0, **metrics):
        return SimpleNamespace(deployment_name=name, app_name="app", current_num_replicas=current,
                               target_num_replicas=current if target is None else target, total_num_requests=requests,
                               capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=10,
                               aggregated_metrics={k: dict(enumerate(v)) for k, v in metrics.items()})

    policy = JointSloPolicy(ttft_ms=1000, itl_ms=50, percentile=99, max_total_replicas=12, downscale_delay_s=60)
    # Prefill: 20,000 prompt tokens/s over 10,000 a replica, prompts of 1,000 tokens: 3
    # (replicas_for_wait). Decode: KV 2 x 0.9 / 0.8 = 2.25 -> 3, and ITL attainment under 0.99 asks
    # for at least 2 + 1.
    prefill = pool("Prefill", 2, queued_prefill_tokens=[0, 0], prefill_tokens_per_s=[10_000, 10_000],
                   prompt_tokens_per_s=[10_000, 10_000], prompts_per_s=[10, 10])
    decode = pool("Decode", 2, kv_usage=[0.9, 0.9], itl_attainment=[0.9, 0.95], num_running=[100, 100])
    assert policy({"p": prefill, "d": decode})[0] == {"p": 3, "d": 3}
    assert recorded == [("prefill", "app", 2, 3), ("decode", "app", 2, 3)]
    # Reports of an idle app: held (the drop must last downscale_delay_s); a pool not up yet: held.
    idle = pool("Prefill", 3, queued_prefill_tokens=[0]), pool("Decode", 3, kv_usage=[0.0])
    # Serve starting what was asked (a replica of each pool), then both serving: the policy times the starts.
    policy({"p": pool("Prefill", 2, target=3, queued_prefill_tokens=[0]),
            "d": pool("Decode", 2, target=3, kv_usage=[0.0])})
    assert policy({"p": idle[0], "d": idle[1]})[0] == {"p": 3, "d": 3}
    assert policy.scaler.starts.num_samples == 2
    assert policy({"p": prefill})[0] == {"p": 2}
    # Decode: 60 requests/s held 1 s each, 20 held now: 3x the occupancy, 2 x 0.5 x 3 / 0.8 = 3.75 -> 4. Prefill
    # (0.4 replicas' work in 0.1 s prompts: 2) misses TTFT with 0.3 s queued on the replica serving,
    # but its second replica is still starting: no step to 3 while it starts.
    policy = JointSloPolicy(ttft_ms=1000, itl_ms=50, percentile=99, max_total_replicas=12, downscale_delay_s=60)
    growing = pool("Decode", 2, kv_usage=[0.5, 0.5], requests_per_s=[30, 30], residence_s=[1.0, 1.0],
                   num_in_flight_requests=[10, 10], ttft_attainment=[0.5, 0.5], num_running=[10, 10])
    starting = pool("Prefill", 1, target=2, queued_prefill_tokens=[3_000], prefill_tokens_per_s=[10_000],
                    prompt_tokens_per_s=[4_000], prompts_per_s=[4])
    assert policy({"p": starting, "d": growing})[0] == {"p": 2, "d": 4}
    # Decode waits for slots with 100 requests in callers' handles (300 asked, 200 on the replicas)
    # and 60 on the replicas; the other 40 are with the prefill pool, which is its load, not
    # decode's: 2 x 0.5 / 0.8 + 160 / 256 slots = 1.875 -> 2 (counting all 300 beyond those running: 3).
    policy = JointSloPolicy(ttft_ms=1000, itl_ms=50, percentile=99, max_total_replicas=12, downscale_delay_s=60)
    queued = pool("Decode", 2, requests=300, kv_usage=[0.5, 0.5], num_running=[50, 50],
                  num_in_flight_requests=[100, 100], num_waiting=[30, 30])
    assert policy({"p": idle[0], "d": queued})[0]["d"] == 2
    # Steps whose bytes are half KV: 4 replicas at 20% want 4 x (0.5 + 0.5 x 0.2 / 0.8) = 2.5 -> 3, not 1.
    policy = JointSloPolicy(ttft_ms=1000, itl_ms=50, percentile=99, max_total_replicas=12, downscale_delay_s=0)
    kv_bound = pool("Decode", 4, kv_usage=[0.2] * 4, kv_read_share=[0.4, 0.6, 0.5, 0.5])
    assert policy({"p": idle[0], "d": kv_bound})[0]["d"] == 3
    # Each pool's bounds apply.
    busy = pool("Prefill", 9, queued_prefill_tokens=[10**6], prefill_tokens_per_s=[10_000])
    assert policy({"p": busy, "d": decode})[0]["p"] <= 10
