"""The gateway's inter-token gaps reach the histogram in batches: all of them, in order, within
ITL_BATCH_S on an event loop (at once without one), and sooner when a batch is full."""

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.telemetry import metrics
from pdserve.telemetry.metrics import ITL_BATCH_MAX, ITL_BATCH_S, GatewayMetrics
from tests.harness.waiting import until


class Histogram:
    def __init__(self):
        self.values, self.tags = [], set()

    def observe(self, value, tags=None):
        self.values.append(value)
        self.tags.add(tuple(sorted(tags.items())))


@pytest.fixture
def itl(monkeypatch):
    h = Histogram()
    monkeypatch.setattr(metrics, "series", lambda: SimpleNamespace(itl=h))
    return h


def test_gaps_are_recorded_in_order_within_the_batch_period(itl):
    m = GatewayMetrics("r1", "tiny")

    async def run():
        for i in range(5):
            m.inter_token(i / 1000)
        assert itl.values == []  # kept for the batch
        await until(lambda: itl.values, 4 * ITL_BATCH_S, "the batch recorded")
        assert itl.values == [0.0, 0.001, 0.002, 0.003, 0.004]
        m.inter_token(0.5)  # the next batch starts its own period
        assert len(itl.values) == 5
        await until(lambda: len(itl.values) == 6, 4 * ITL_BATCH_S, "the next batch recorded")

    asyncio.run(run())
    assert itl.values[-1] == 0.5 and len(itl.values) == 6
    assert itl.tags == {(("model", "tiny"), ("pool", "gateway"), ("replica", "r1"))}


def test_a_full_batch_is_recorded_at_once(itl):
    m = GatewayMetrics("r1", "tiny")

    async def run():
        for _ in range(ITL_BATCH_MAX):
            m.inter_token(0.01)
        assert len(itl.values) == ITL_BATCH_MAX

    asyncio.run(run())


def test_without_an_event_loop_gaps_are_recorded_at_once(itl):
    m = GatewayMetrics("r1", "tiny")
    m.inter_token(0.02)
    m.inter_token(0.03)
    assert itl.values == [0.02, 0.03]
