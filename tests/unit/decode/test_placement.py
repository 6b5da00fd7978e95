"""The placement cost model: its predictions, its decision boundaries and what it learns."""

from dataclasses import replace

import pytest

from pdserve.decode.placement import (ERROR_HORIZON_S, MIN_ERROR_SAMPLES, CostModel, Load, Rates, Target,
                                      local_chunk_tokens, place)

# 20 ms a decode step, 1 ms a prompt token here, the prefill pool at 1,000 tokens/s and 10 ms of
# hops, 1 GB/s.
RATES = Rates(decode_step_s=0.02, prefill_token_s=1e-3, remote_tokens_per_s=1000.0, remote_wait_s=0.01,
              link_bytes_per_s=1e9)
TARGET = Target(ttft_s=4.0, itl_s=0.15)


def load(uncached=1400, remote_queued=0, local_queued=0, running=8, kv_bytes=1000, budget=2048) -> Load:
    return Load(uncached, remote_queued, local_queued, running, kv_bytes, budget)


def test_predictions():
    p = place(load(), RATES, TARGET)
    # Remote: the hops, 1,400 tokens at 1,000/s, 1.4 MB at 1 GB/s, one decode step to join.
    assert p.remote_ttft_s == pytest.approx(0.01 + 1.4 + 0.0014 + 0.02)
    # Local: 130-token chunks (20 ms + 130 ms a step), 11 steps, beside 8 streams.
    assert p.chunk_tokens == 130
    assert p.local_ttft_s == pytest.approx(11 * 0.02 + 1.4)
    assert p.local_damage_s == pytest.approx(1.4 * 8)


def test_remote_whenever_it_meets_the_target_even_where_local_is_sooner():
    # Nothing decodes here: local would be sooner (no queue, no transfer), but it costs the streams
    # that join meanwhile; the prefill pool meets the target at no cost to them.
    p = place(load(uncached=80, running=0), RATES, TARGET)
    assert p.local_ttft_s < p.remote_ttft_s <= TARGET.ttft_s
    assert p.where == "remote" and p.local_damage_s == pytest.approx(0.08)


def test_the_decision_flips_where_the_remote_queue_takes_ttft_past_the_target():
    # Remote TTFT = 0.01 + (queued + 1,400) / 1,000 + 0.0014 + 0.02: 4 s at 2,568.6 queued tokens.
    assert place(load(remote_queued=2568), RATES, TARGET).where == "remote"
    p = place(load(remote_queued=2569), RATES, TARGET)
    assert p.where == "local" and p.reason == "only local meets the TTFT target"


def test_when_neither_path_meets_the_target_the_sooner_one_is_taken():
    slow_target = Target(ttft_s=0.5, itl_s=0.15)
    assert place(load(remote_queued=5000), RATES, slow_target).where == "local"  # 6.4 s vs 1.6 s
    assert place(load(local_queued=9000), RATES, slow_target).where == "remote"  # 1.4 s vs 11+ s
    assert place(load(local_queued=9000), RATES, slow_target).reason == "neither meets the TTFT target; " \
                                                                         "remote is sooner"


def test_a_local_prefill_pauses_for_the_targets_slack_only_where_streams_decode():
    p = place(load(remote_queued=4000), RATES, TARGET)
    # 4 s - 1.62 s predicted, less one chunk step (0.15 s) of margin.
    assert p.pause_s == pytest.approx(4.0 - 1.62 - 0.15)
    idle = place(load(remote_queued=4000, running=0), RATES, TARGET)
    assert idle.where == "local" and idle.pause_s == 0 and idle.chunk_tokens == 0
    assert idle.local_ttft_s == pytest.approx(1.4)
    late = place(load(remote_queued=4000), RATES, Target(ttft_s=1.7, itl_s=0.15))
    assert late.where == "local" and late.pause_s == 0  # no slack left to spend


def test_chunks_keep_a_step_inside_the_itl_target_within_the_step_budget():
    assert local_chunk_tokens(load(), RATES, Target(4.0, 0.05)) == 30  # 20 ms + 30 x 1 ms
    assert local_chunk_tokens(load(budget=64), RATES, TARGET) == 64  # the engine's step budget
    # A decode step alone misses the target: the prompt still advances, a block's worth a step.
    assert local_chunk_tokens(load(), RATES, Target(4.0, 0.01)) == 16


def test_priors_then_the_first_sample_then_a_moving_average():
    costs = CostModel()
    assert costs.rates() == Rates(0.02, 1e-3, 1000.0, 0.0, 1e9)  # the pool assumed as fast as this replica
    costs.step(num_decodes=4, num_prefill_tokens=0, seconds=0.01)
    assert costs.rates().decode_step_s == 0.01  # the first sample replaces the prior
    costs.step(4, 0, 0.02)
    assert costs.rates().decode_step_s == pytest.approx(0.015)  # then 1/n ...
    for _ in range(50):
        costs.step(4, 0, 0.03)
    assert costs.rates().decode_step_s == pytest.approx(0.03, rel=0.01)  # ... falling to EMA_WEIGHT
    # A step with prompt tokens: what it took beyond a decode step, per token.
    costs.step(4, 100, 0.03 + 0.05)
    assert costs.rates().prefill_token_s == pytest.approx(5e-4, rel=1e-3)  # (the decode step: ~0.03 s)
    assert costs.rates().remote_tokens_per_s == pytest.approx(2000.0, rel=1e-3)  # until the pool is measured
    # A prefill replica reports 3,000 tokens/s; the call took 0.3 s beyond 3,000 tokens at that.
    costs.remote_prefill(num_tokens=3000, seconds=1.3, replica_tokens_per_s=3000.0)
    costs.pull(num_bytes=10**6, seconds=0.002)
    rates = costs.rates()
    assert (rates.remote_tokens_per_s, rates.link_bytes_per_s) == (3000.0, 5e8)
    assert rates.remote_wait_s == pytest.approx(0.3)
    costs.remote_prefill(num_tokens=300, seconds=0.05, replica_tokens_per_s=None)  # faster than computing it
    assert costs.rates().remote_wait_s == pytest.approx(0.15)  # a wait of 0 (never below), averaged in


def test_samples_without_information_are_skipped():
    costs = CostModel()
    before = costs.rates()
    costs.step(0, 0, 0.5)  # nothing ran
    costs.step(3, 0, 0.0)
    costs.remote_prefill(0, 1.0, None)
    costs.pull(0, 1.0)
    costs.pull(100, 0.0)
    assert costs.rates() == before
    costs.step(3, 8, 0.015)  # a few prompt tokens in a step shorter than a decode step: noise
    assert costs.rates() == before
    costs.step(0, 10, 0.02)  # prefill alone: all of the step is the prompt's
    assert costs.rates().prefill_token_s == pytest.approx(2e-3)


def test_margins_move_each_paths_prediction_to_the_targets_percentile():
    # 4 s of target; the mean remote prediction 3.4314 s meets it, but remote first tokens have come
    # up to 0.8 s later than predicted: at the percentile it misses, and local (1.62 s) meets it.
    p = place(load(remote_queued=2000), RATES, TARGET)
    assert p.where == "remote" and p.expected_ttft_s == pytest.approx(p.remote_ttft_s)
    margined = replace(RATES, remote_margin_s=0.8, local_margin_s=0.3)
    p = place(load(remote_queued=2000), margined, TARGET)
    assert p.remote_ttft_s == pytest.approx(3.4314 + 0.8) and p.local_ttft_s == pytest.approx(1.62 + 0.3)
    assert p.where == "local" and p.reason == "only local meets the TTFT target"
    # The slack it pauses for shrinks by the margin; the error is measured against the mean and the pause.
    assert p.pause_s == pytest.approx(4.0 - 1.92 - 0.15)
    assert p.expected_ttft_s == pytest.approx(1.62 + p.pause_s)


def test_margins_are_the_percentile_of_recent_errors_once_there_are_enough():
    now = [0.0]
    costs = CostModel(percentile=90, clock=lambda: now[0])
    for i in range(MIN_ERROR_SAMPLES - 1):
        costs.first_token("remote", predicted_s=1.0, seconds=1.0 + i / 100)
    assert costs.rates().remote_margin_s == 0.0  # too few to say anything of a tail
    costs.first_token("remote", 1.0, 1.19)
    # 20 errors 0.00 .. 0.19 s: the 90th percentile is the 18th smallest.
    assert costs.rates().remote_margin_s == pytest.approx(0.17)
    assert costs.rates().local_margin_s == 0.0  # each path its own
    for _ in range(MIN_ERROR_SAMPLES):
        costs.first_token("local", 2.0, 1.5)  # predictions that were pessimistic: a negative margin
    assert costs.rates().local_margin_s == pytest.approx(-0.5)
    # A minute later the errors are forgotten: a path a past load made look slow is tried again at
    # its mean (else, left unused, it would never measure anything to correct the margin).
    now[0] = ERROR_HORIZON_S + 1
    assert (costs.rates().remote_margin_s, costs.rates().local_margin_s) == (0.0, 0.0)
