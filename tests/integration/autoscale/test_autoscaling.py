"""The prefill pool follows its queue: bursts from `pdserve bench` scale it from 1 replica to 2
and, once they are over, back to 1, with no request failing and no KV lease left behind. The
decode pool follows KV occupancy; an application-level policy holds the pools' ratio."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.config import ServeConfig
from tests.conftest import free_port
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol import GenerateRequest
from tests.harness.fixed_costs import REMOTE_PREFILL_SLO

ENGINE = {"num_threads": 1, "num_kv_blocks": 256, "block_size": 16, "max_model_len": 512, "max_num_seqs": 32,
          "max_num_batched_tokens": 256}


def running_replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def load_until(call, concurrency: int, cond, timeout_s: float, settle_s: float = 0.0) -> bool:
    """Keep `concurrency` of `call(i)` in flight until `cond()` holds (then `settle_s` more) or the
    timeout passes; True when it held. Returns once the last wave has finished."""
    stop = threading.Event()

    def load() -> None:
        with ThreadPoolExecutor(concurrency) as pool:
            i = 0
            while not stop.is_set():
                list(pool.map(call, range(i, i + concurrency)))
                i += concurrency

    loader = threading.Thread(target=load)
    loader.start()
    try:
        held = wait_for(cond, timeout_s)
        if held:
            time.sleep(settle_s)
    finally:
        stop.set()
        loader.join(180)
    return held


def held_for(cond, seconds: float):
    """A condition that holds once `cond()` has held at every poll for `seconds`."""
    since: list[float] = []

    def check() -> bool:
        if not cond():
            since.clear()
            return False
        since[:] = since or [time.monotonic()]
        return time.monotonic() - since[0] >= seconds
    return check


@contextlib.contextmanager
def deployed(cfg: ServeConfig):
    """The app on Serve's HTTP proxy; yields its base URL."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from pdserve.app import build

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # a no-op when Serve runs already
    serve.run(build(cfg), name=cfg.name, route_prefix=f"/{cfg.name}")
    try:
        yield f"http://127.0.0.1:{_get_global_client().http_config.port}/{cfg.name}"
    finally:
        serve.delete(cfg.name)


@pytest.fixture(scope="module")
def scaling_app(ray_session, tiny_llama):
    small = {"ray_actor_options": {"num_cpus": 0.2}}
    cfg = ServeConfig(
        name="scaling", model=tiny_llama, engine=ENGINE, slo=REMOTE_PREFILL_SLO, transfer={"host": "127.0.0.1"},
        prefill={**small, "autoscaling": {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0,
                                          "downscale_delay_s": 3, "look_back_period_s": 1,
                                          "target_queued_prefill_tokens": 256, "target_ongoing_requests": 2}},
        decode={**small, "max_ongoing_requests": 256})
    with deployed(cfg) as base_url:
        yield base_url


def test_burst_scales_prefill_up_and_back_down_without_failures(scaling_app, tiny_llama):
    from ray import serve

    from pdserve.bench.runner import RunSettings, run_benchmark
    from pdserve.bench.workloads import PromptBuilder, random_workload

    assert running_replicas("scaling", "Prefill") == 1
    builder = PromptBuilder(tiny_llama)
    results = []

    def burst(i: int) -> None:  # what `pdserve bench --workload random --input-len 300 --output-len 4
        # --num-requests 24 --concurrency 24` sends
        requests = random_workload(builder, 24, "300", "4", seed=i)
        results.append(run_benchmark(requests, RunSettings(base_url=scaling_app, concurrency=24, timeout_s=120),
                                     builder, "random", progress=False))

    # Bursts until the second replica runs, and 2 s more so both serve them.
    scaled_up = load_until(burst, 1, lambda: running_replicas("scaling", "Prefill") >= 2, 90, settle_s=2)
    assert scaled_up, "the prefill pool never reached 2 replicas under the bursts"
    assert wait_for(lambda: running_replicas("scaling", "Prefill") == 1, 90), "the prefill pool did not scale back"
    # No request failed. (bench also counts as failed a stream whose few random tokens decoded to no
    # text at all; those ended normally, with no error.)
    assert not any(r["error_examples"] for r in results), [r["error_examples"] for r in results]
    assert sum(r["completed"] for r in results) >= 24
    decode_stats = serve.get_deployment_handle("Decode", "scaling").stats.remote().result(timeout_s=30)
    assert decode_stats["num_failed_pulls"] == 0  # no request lost its KV to the replica that left

    def prefill_idle() -> bool:  # every lease released (by its ack, at the latest by expiry: 30 s)
        stats = serve.get_deployment_handle("Prefill", "scaling").stats.remote().result(timeout_s=30)
        return stats["num_kv_leases"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]

    assert wait_for(prefill_idle, 40), "KV blocks of the surviving prefill replica stayed leased"


@pytest.fixture(scope="module")
def decode_scaling_app(ray_session, tiny_llama):
    small = {"ray_actor_options": {"num_cpus": 0.2}}
    engine = {**ENGINE, "num_kv_blocks": 64}  # 1,024 tokens: a few long sequences fill it
    cfg = ServeConfig(
        name="decode-scaling", model=tiny_llama, engine=engine,
        transfer={"host": "127.0.0.1"}, prefill=small,
        decode={**small, "max_ongoing_requests": 64,
                "autoscaling": {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 3,
                                "look_back_period_s": 1, "target_running_sequences": 64, "target_kv_usage": 0.5}})
    with deployed(cfg):
        yield


def test_long_sequences_scale_decode_on_kv_occupancy(decode_scaling_app):
    from ray import serve

    decode = serve.get_deployment_handle("Decode", "decode-scaling").options(stream=True)
    assert running_replicas("decode-scaling", "Decode") == 1
    failures = []

    def one(i: int) -> None:
        req = GenerateRequest(f"long-{i}", list(range(10, 110)),
                              SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        try:
            assert sum(len(out.new_token_ids) for out in decode.generate.remote(req)) == 300
        except Exception as e:  # noqa: BLE001
            failures.append(repr(e))

    # 6 long sequences (~25 blocks each) at a time: the cache stays nearly full.
    scaled_up = load_until(one, 6, lambda: running_replicas("decode-scaling", "Decode") >= 2, 90)
    assert scaled_up, "the decode pool never reached 2 replicas while its KV cache was full"
    assert wait_for(lambda: running_replicas("decode-scaling", "Decode") == 1, 90), "the decode pool did not scale back"
    assert not failures, failures[:3]


def test_pool_ratio_policy_runs_at_application_level(ray_session, tiny_llama):
    """Deployed through Serve's config path (as `pdserve serve` and KubeRay do), the app-level
    policy keeps at least 2 prefill replicas per decode replica, even with no load."""
    from ray import serve

    from pdserve.launch import deploy

    auto = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 600,
            "look_back_period_s": 1}
    small = {"ray_actor_options": {"num_cpus": 0.2}, "autoscaling": auto}
    cfg = ServeConfig(name="ratio", model=tiny_llama, engine=ENGINE, transfer={"host": "127.0.0.1"},
                      prefill=small, decode=small, gateway={"port": 0},
                      pool_ratio={"min_prefill_per_decode": 2, "max_prefill_per_decode": 4})
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    deploy(cfg)
    try:
        assert wait_for(lambda: running_replicas("ratio", "Prefill") == 2, 90), "the ratio policy did not act"
        assert running_replicas("ratio", "Decode") == 1
    finally:
        serve.delete("ratio")


def test_joint_policy_grows_both_pools_when_the_latency_target_is_missed(ray_session, tiny_llama):
    """Deployed through Serve's config path, with a latency target no replica meets (1 µs to the
    first token and between tokens: a tiny model's step can take under 1 ms), the decode replica
    reports its attainment (0) through Serve's autoscaling stats, and the joint policy grows both
    pools to their ceilings and keeps them there: 2 + 2 of the budget's 4, not a proportional
    3 + 1 that the prefill pool's ceiling cut to 2 + 1 (decode then went 2, 1, 2, 1, ...)."""
    from ray import serve

    from pdserve.launch import deploy

    auto = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 600,
            "look_back_period_s": 1}
    small = {"ray_actor_options": {"num_cpus": 0.2}, "autoscaling": auto}
    cfg = ServeConfig(name="joint", model=tiny_llama, engine=ENGINE, transfer={"host": "127.0.0.1"},
                      prefill=small, decode=small, gateway={"port": 0}, slo={"ttft_ms": 0.001, "itl_ms": 0.001},
                      max_total_replicas=4)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    deploy(cfg)
    decode = serve.get_deployment_handle("Decode", "joint").options(stream=True)

    def one(i: int) -> None:
        req = GenerateRequest(f"joint-{i}-{time.monotonic_ns()}", list(range(10, 60)),
                              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len([o for o in decode.generate.remote(req)]) >= 1

    try:
        grown = load_until(one, 2, held_for(lambda: running_replicas("joint", "Prefill") == 2
                                            and running_replicas("joint", "Decode") == 2, 15), 150)
        stats = serve.get_deployment_handle("Decode", "joint").stats.remote().result(timeout_s=30)
        assert grown, ("the joint policy did not grow both pools and keep them (decode attainment: "
                       f"{stats['ttft_attainment']}, {stats['itl_attainment']})")
        assert stats["num_remote_prefills"] + stats["num_local_prefills"] >= 2
    finally:
        serve.delete("joint")


def test_joint_policy_shrinks_idle_pools_after_its_delay(ray_session, tiny_llama):
    """Two replicas a pool and no load: both shrink to one once the policy's downscale delay has
    passed. (Serve applies each deployment's delays to an application policy's decisions: with
    the pools' own delay as well, Serve's wait restarted on every tick the policy held between its
    steps, and no pool ever shrank.)"""
    from ray import serve

    from pdserve.launch import deploy

    auto = {"min_replicas": 1, "max_replicas": 2, "downscale_delay_s": 3, "look_back_period_s": 1}
    two = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.2}, "autoscaling": auto}
    cfg = ServeConfig(name="joint-idle", model=tiny_llama, engine=ENGINE, transfer={"host": "127.0.0.1"},
                      prefill=two, decode=two, gateway={"port": 0}, slo={"ttft_ms": 1000, "itl_ms": 100},
                      max_total_replicas=4)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    deploy(cfg)
    try:
        shrunk = wait_for(lambda: running_replicas("joint-idle", "Prefill") == 1
                          and running_replicas("joint-idle", "Decode") == 1, 90)
        assert shrunk, (f"idle pools did not shrink: {running_replicas('joint-idle', 'Prefill')} prefill, "
                        f"{running_replicas('joint-idle', 'Decode')} decode replicas")
    finally:
        serve.delete("joint-idle")
