"""The moving averages and windows replicas decide on."""

import pytest

from pdserve.telemetry.averages import EMA_WEIGHT, Average, Tail, Window


def test_an_average_starts_at_its_prior_and_follows_its_samples():
    a = Average(5.0)
    assert (a.value, a.num_samples) == (5.0, 0)
    a.add(1.0)
    a.add(3.0)
    assert a.value == 2.0  # weights 1, then 1/2: the mean of the first samples
    for _ in range(100):
        a.add(10.0)
    assert a.value == pytest.approx(10.0, abs=1e-3)  # at EMA_WEIGHT a sample, the prior long gone
    a.add(0.0)
    assert a.value == pytest.approx(10.0 * (1 - EMA_WEIGHT), abs=1e-3)


def test_a_window_shares_weight_over_its_last_seconds():
    w = Window(10.0)
    assert w.share(0.0) is None
    w.add(0.0, True, 3)
    w.add(5.0, False, 1)
    assert w.share(5.0) == 0.75
    assert w.share(12.0) == 0.0  # the first sample left the window; the second remains
    assert w.share(30.0) is None  # idle past the window: nothing to say


def test_a_window_gives_the_weighted_mean_of_its_last_seconds():
    w = Window(10.0)
    assert w.mean(0.0) is None
    w.add(0.0, 4.0)
    w.add(5.0, 1.0, 2)
    assert w.mean(5.0) == 2.0
    assert w.mean(12.0) == 1.0


def test_a_window_of_counter_readings_gives_its_rate():
    w = Window(10.0)
    w.add(0.0, 100)
    assert w.rate(0.0) is None  # one reading
    w.add(2.0, 300)
    w.add(4.0, 400)
    assert w.rate(4.0) == 75.0
    w.add(12.0, 400)  # the reading at 0 s left: 400 - 300 over 10 s
    assert w.rate(12.0) == 10.0


def test_a_tail_gives_nearest_rank_percentiles_of_its_last_samples():
    t = Tail(4, horizon_s=60.0)
    for i, sample in enumerate((3.0, 1.0, 4.0, 2.0)):
        t.add(float(i), sample)
    assert (t.percentile(50), t.percentile(75), t.percentile(99), t.percentile(1)) == (2.0, 3.0, 4.0, 1.0)
    t.add(4.0, 0.5)  # the oldest (3.0) leaves; the order holds
    assert len(t) == 4 and t.ordered == [0.5, 1.0, 2.0, 4.0]
    for i in range(4):
        t.add(5.0 + i, 7.0)
    assert t.ordered == [7.0] * 4


def test_a_tails_samples_age_out_past_its_horizon():
    t = Tail(100, horizon_s=10.0)
    t.add(0.0, 5.0)
    t.add(8.0, 1.0)
    t.expire(9.0)
    assert t.ordered == [1.0, 5.0]
    t.expire(10.5)  # the sample of 0 s is over 10 s old
    assert len(t) == 1 and t.ordered == [1.0]
    t.expire(100.0)
    assert len(t) == 0 and t.ordered == []
