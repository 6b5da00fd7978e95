"""The simulator's workloads: the bench's own draws (same seed, same lengths and tenants, same
arrivals), traces, and rates that change over time."""

import json

import numpy as np
import pytest

from pdserve.bench import workloads as bench
from pdserve.bench.arrivals import arrival_offsets
from pdserve.simulate.workload import (CountingBuilder, SimRequest, WorkloadSpec, alternating_steps, arrival_times,
                                       bench_requests, mean_rate, parse_rate_steps, trace_requests)

SPECS = [WorkloadSpec("random", "16:256", "8:64"), WorkloadSpec("shared-prefix", output_len="4:32"),
         WorkloadSpec("long-prompt-mix", "64:128", "48", long_len="1024:1536", long_fraction=0.2)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_a_seed_draws_what_pdserve_bench_draws(spec):
    real = spec.draw(300, 7, bench.PromptBuilder(None))
    counted = spec.draw(300, 7, CountingBuilder())
    assert [(r.prompt_tokens, r.max_tokens, r.tenant) for r in real] == \
           [(r.prompt_tokens, r.max_tokens, r.tenant) for r in counted]
    sim = list(bench_requests(spec, 7, num_requests=300, rate=3.0))
    assert [r.arrival_s for r in sim] == arrival_offsets(300, 3.0, "poisson", 7)
    assert [r.prompt_tokens for r in sim] == [r.prompt_tokens for r in real]
    if spec.kind == "shared-prefix":
        assert {r.prefix_tokens for r in sim} == {1000} and {r.prefix_id for r in sim} <= set(range(8))


def test_a_stream_keeps_to_its_rate_steps():
    steps = parse_rate_steps("0:100,10:400,20:100")
    times = np.array([r.arrival_s for r in bench_requests(SPECS[0], 1, rate_steps=steps, duration_s=30)])
    assert np.all(np.diff(times) >= 0) and times[-1] < 30
    counts = [np.sum((times >= a) & (times < a + 10)) for a in (0, 10, 20)]
    assert 800 < counts[0] < 1200 and 3600 < counts[1] < 4400 and 800 < counts[2] < 1200


@pytest.mark.parametrize("text", ["10:100", "0:100,0:200", "0:-1", "0:x"])
def test_bad_rate_steps_are_refused(text):
    with pytest.raises(ValueError):
        parse_rate_steps(text)


def test_a_trace_is_read_in_arrival_order(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 2.0, "prompt_tokens": 50, "output_tokens": 5, "prefix_id": "sys-a", "prefix_tokens": 32},
            {"offset_s": 1.0, "prompt_tokens": 10, "output_tokens": 1},
            {"arrival_s": 3.0, "prompt_tokens": 60, "output_tokens": 2, "prefix_id": "sys-a", "prefix_tokens": 32}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert list(trace_requests(str(path))) == [SimRequest(1.0, 10, 1), SimRequest(2.0, 50, 5, 0, 32),
                                               SimRequest(3.0, 60, 2, 0, 32)]
    path.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "prefix_id": 1}))
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        list(trace_requests(str(path)))


def test_a_bursty_load_alternates_its_rates_and_replays_the_simulators_times():
    steps = alternating_steps(50, 200, 10, 35)
    assert steps == [(0, 50), (10, 200), (20, 50), (30, 200)]
    assert mean_rate(steps, 35) == pytest.approx((10 * 50 + 10 * 200 + 10 * 50 + 5 * 200) / 35)
    times = arrival_times(steps, 35, seed=4)
    assert times == [r.arrival_s for r in bench_requests(SPECS[0], 4, rate_steps=steps, duration_s=35)]
    with pytest.raises(ValueError):
        alternating_steps(0, 200, 10, 35)
