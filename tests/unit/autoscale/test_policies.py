"""pdserve's autoscaling policies on a stand-in for Ray Serve's context, each decision counted (the
config that wires them: tests/unit/test_app.py and tests/integration/test_app.py)."""

import sys
from types import SimpleNamespace

import pytest

from pdserve.autoscale.policies import DecodeLoadPolicy, PrefillQueuePolicy, UnifiedPolicy


@pytest.fixture(autouse=True)
def decisions(monkeypatch):
    """What the policies count in Ray's metrics (telemetry/metrics.py, which imports Ray): kept here."""
    recorded = []
    metrics = SimpleNamespace(autoscaling_decision=lambda *decision: recorded.append(decision))
    monkeypatch.setitem(sys.modules, "pdserve.telemetry.metrics", metrics)
    return recorded


def ctx(current=1, requests=0.0, **metrics):
    return SimpleNamespace(deployment_name="Prefill", app_name="app", current_num_replicas=current,
                           total_num_requests=requests,
                           aggregated_metrics={k: dict(enumerate(v)) for k, v in metrics.items()})


def test_prefill_scales_on_queued_tokens_and_requests(decisions):
    policy = PrefillQueuePolicy(target_queued_tokens=1000, target_ongoing_requests=4)
    assert policy(ctx(current=2))[0] == 2  # no reports yet: hold
    assert decisions == [("prefill", "app", 2, 2)]
    assert policy(ctx(queued_prefill_tokens=[2500, 600]))[0] == 4  # 3100 tokens / 1000
    assert policy(ctx(requests=10, queued_prefill_tokens=[0]))[0] == 3  # 10 requests / 4
    assert policy(ctx(current=3, queued_prefill_tokens=[0, 0, 0]))[0] == 0  # Serve's min_replicas floors it


def test_decode_scales_on_running_sequences_and_kv_usage():
    policy = DecodeLoadPolicy(target_running_sequences=8, target_kv_usage=0.5)
    assert policy(ctx(num_running=[4, 4], kv_usage=[0.9, 0.8]))[0] == 4  # KV: 1.7 / 0.5
    assert policy(ctx(num_running=[20], kv_usage=[0.1]))[0] == 3  # sequences: 20 / 8
    assert policy(ctx(requests=30, num_running=[2], kv_usage=[0.1]))[0] == 4  # handles' queue counts too
    unified = UnifiedPolicy(1000, 4, 8, 0.5)
    assert unified(ctx(queued_prefill_tokens=[5000], num_running=[1], kv_usage=[0.1]))[0] == 5


def test_ratio_band_raises_the_pool_that_falls_behind():
    from pdserve.autoscale.policies import ratio_band

    assert ratio_band(1, 1, 0.5, 2) == (1, 1)  # within the band: as asked
    assert ratio_band(1, 4, 0.5, 2) == (2, 4)  # too few prefill for 4 decode replicas
    assert ratio_band(6, 1, 0.5, 2) == (6, 3)  # too few decode for 6 prefill replicas
    assert ratio_band(0, 0, 0.5, 2) == (0, 0)  # both scaled to zero stay there
    assert ratio_band(1, 0, 0.5, 2) == (1, 1)  # prefill woke up: decode follows


def test_pool_ratio_policy_decides_for_both_pools(decisions):
    from pdserve.autoscale.policies import PoolRatioPolicy

    policy = PoolRatioPolicy({"target_queued_tokens": 1000, "target_ongoing_requests": 4},
                             {"target_running_sequences": 8, "target_kv_usage": 0.5}, min_ratio=1, max_ratio=2)
    def pool(name, **metrics):
        c = ctx(**metrics)
        c.deployment_name, c.capacity_adjusted_min_replicas, c.capacity_adjusted_max_replicas = name, 1, 8
        return c

    prefill = pool("Prefill", queued_prefill_tokens=[5000])  # wants 5
    decode = pool("Decode", num_running=[1], kv_usage=[0.1])  # wants 1
    assert policy({"p": prefill, "d": decode})[0] == {"p": 5, "d": 3}
    assert decisions == [("prefill", "app", 1, 5), ("decode", "app", 1, 3)]  # each pool's, after the band
    # Idle, both pools want 0 and get their minimum, 1: the band holds between those.
    idle = PoolRatioPolicy({}, {}, min_ratio=2, max_ratio=4)
    prefill, decode = pool("Prefill", queued_prefill_tokens=[0]), pool("Decode", num_running=[0], kv_usage=[0.0])
    assert idle({"p": prefill, "d": decode})[0] == {"p": 2, "d": 1}
