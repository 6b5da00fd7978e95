"""`pdserve plan`'s search: the splits it tries, the rule it recommends by, the config it prints."""

from pdserve.config import ServeConfig
from pdserve.simulate import plan
from pdserve.simulate.workload import WorkloadSpec, bench_requests
from tests.unit.simulate.fixtures import ACCELERATOR, config


def test_every_split_within_the_budget_is_tried():
    pool = plan.candidates(config(), [ACCELERATOR], [1], max_gpus=4)
    # colocated 1-4, and prefill + decode replicas adding up to at most 4: (1,1..3), (2,1..2), (3,1).
    assert sorted(c.num_gpus for c in pool) == [1, 2, 2, 3, 3, 3, 4, 4, 4, 4]
    with_tp = plan.candidates(config(), [ACCELERATOR], [1, 2], max_gpus=4, colocated=False)
    assert all(c.num_gpus <= 4 for c in with_tp) and any(c.decode.tp == 2 for c in with_tp)


def test_it_recommends_the_fewest_gpus_that_meet_the_slo():
    base = config(ttft_s=2.0, itl_s=0.05)
    requests = list(bench_requests(WorkloadSpec("random", "64:512", "8:64"), 0, num_requests=150, rate=30))
    rows, best = plan.search(base, plan.candidates(base, [ACCELERATOR], [1], max_gpus=3), requests)
    assert best is not None and plan.meets(best, base.slo)
    assert not any(plan.meets(r, base.slo) for r in rows if r["num_gpus"] < best["num_gpus"])
    front = plan.frontier(rows, base.slo)
    assert [r["num_gpus"] for r in front] == [1, 2, 3]


def test_the_smallest_search_stops_at_the_first_gpu_count_that_meets_the_slo():
    base = config(ttft_s=2.0, itl_s=0.05)
    requests = list(bench_requests(WorkloadSpec("random", "64:512", "8:64"), 0, num_requests=150, rate=30))
    pool = plan.candidates(base, [ACCELERATOR], [1], max_gpus=3)
    _, best = plan.search(base, pool, requests)
    smallest, tried = plan.smallest(base, pool, requests)
    assert smallest["candidate"] == best["candidate"]
    assert tried == sum(c.num_gpus <= best["num_gpus"] for c in pool) < len(pool)
    impossible = config(ttft_s=1e-6, itl_s=1e-6)
    assert plan.smallest(impossible, pool, requests) == (None, len(pool))


def test_the_recommended_config_is_a_valid_pdserve_config():
    base = config()
    candidate = plan.candidates(base, [ACCELERATOR], [2], max_gpus=4, colocated=False)[0]
    cfg = plan.pdserve_config(candidate, "/models/m", base.slo)
    parsed = ServeConfig.model_validate(cfg)
    assert parsed.mode == "disaggregated" and parsed.slo.itl_ms == 50
    assert parsed.prefill.ray_actor_options == {"num_gpus": 2} and parsed.decode.engine.tensor_parallel_size == 2
