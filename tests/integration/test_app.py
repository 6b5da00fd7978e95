"""The builder's Ray half (no Ray started, but Ray Serve's classes imported): both modes build a
Serve application, and each pool's deployment options carry its router, autoscaling policy,
bounds and replica environment."""

from ray.serve import Application

from pdserve.app import (ENGINE_ENV, KV_HEADROOM_ROUTER, PREFIX_AWARE_ROUTER, SERVE_ENV, _pool_options, build,
                         with_env)
from pdserve.config import SLOConfig, ServeConfig


def test_both_modes_build_an_application(tiny_llama):
    for mode in ("disaggregated", "colocated"):
        router = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
        cfg = ServeConfig(model=tiny_llama, mode=mode, prefill={"request_router_class": router})
        assert isinstance(build(cfg), Application)


def test_pools_get_pdserve_routers_unless_configured(tiny_llama):
    cfg = ServeConfig(model=tiny_llama, engine={"block_size": 8}, router={"redis_url": "redis://h:1/0"})
    prefill = _pool_options(cfg, cfg.prefill, "Prefill", PREFIX_AWARE_ROUTER)["request_router_config"]
    assert prefill.request_router_class == PREFIX_AWARE_ROUTER
    assert prefill.request_router_kwargs == {
        "redis_url": "redis://h:1/0", "redis_password_env": "PDSERVE_REDIS_PASSWORD",
        "stream": "pdserve:kv-events:pdserve:Prefill", "block_size": 8,
        "queue_weight": 3.0, "approx_ttl_s": 120.0,
        "pool": "prefill", "model": "tiny-llama"}
    pow2 = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
    cfg = cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"request_router_class": pow2})})
    decode = _pool_options(cfg, cfg.decode, "Decode", KV_HEADROOM_ROUTER)["request_router_config"]
    assert decode.request_router_class == pow2
    assert "ttft_s" not in decode.request_router_kwargs  # no SLO: first come, first served
    # With an SLO, the pools the gateway calls take requests past its TTFT target last.
    slo = cfg.model_copy(update={"slo": SLOConfig(ttft_ms=1500)})
    kwargs = {name: _pool_options(slo, pool, name, KV_HEADROOM_ROUTER)["request_router_config"].request_router_kwargs
              for name, pool in (("Prefill", slo.prefill), ("Decode", slo.decode), ("Unified", slo.decode))}
    assert [k.get("ttft_s") for k in kwargs.values()] == [None, 1.5, 1.5]


def test_pools_get_their_policy_and_bounds(tiny_llama):
    auto = {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 5, "target_queued_prefill_tokens": 512}
    cfg = ServeConfig(model=tiny_llama, prefill={"num_replicas": 2, "autoscaling": auto})
    options = _pool_options(cfg, cfg.prefill, "Prefill", PREFIX_AWARE_ROUTER)
    assert "num_replicas" not in options
    a = options["autoscaling_config"]
    assert (a["min_replicas"], a["max_replicas"], a["initial_replicas"], a["downscale_delay_s"]) == (1, 3, 2, 5)
    assert a["policy"] == {"policy_function": "pdserve.autoscale.policies:PrefillQueuePolicy",
                           "policy_kwargs": {"target_queued_tokens": 512, "target_ongoing_requests": 8}}
    assert _pool_options(cfg, cfg.decode, "Decode", KV_HEADROOM_ROUTER)["num_replicas"] == 1
    # With slo, the joint policy waits the delay itself: Serve waiting on top would never shrink a pool.
    joint = ServeConfig(model=tiny_llama, slo={}, prefill={"autoscaling": auto}, decode={"autoscaling": auto})
    for pool, name in ((joint.prefill, "Prefill"), (joint.decode, "Decode")):
        assert _pool_options(joint, pool, name, PREFIX_AWARE_ROUTER)["autoscaling_config"]["downscale_delay_s"] == 0


def test_replicas_run_on_serves_own_loop_and_engines_spin_briefly_unless_configured(tiny_llama):
    cfg = ServeConfig(model=tiny_llama, decode={"ray_actor_options": {
        "num_cpus": 2, "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}, "pip": ["x"]}}})
    prefill = _pool_options(cfg, cfg.prefill, "Prefill", PREFIX_AWARE_ROUTER)["ray_actor_options"]
    assert prefill == {"num_cpus": 1, "runtime_env": {"env_vars": ENGINE_ENV}}
    assert ENGINE_ENV["GOMP_SPINCOUNT"] == "2000" and ENGINE_ENV["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert SERVE_ENV["MALLOC_ARENA_MAX"] == "2"  # every replica's RSS stays flat over a soak (#42)
    decode = _pool_options(cfg, cfg.decode, "Decode", PREFIX_AWARE_ROUTER)["ray_actor_options"]
    assert decode["runtime_env"] == {"env_vars": {**ENGINE_ENV, "OMP_WAIT_POLICY": "ACTIVE"}, "pip": ["x"]}
    assert cfg.decode.ray_actor_options["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "ACTIVE"}  # not mutated
    assert with_env({"num_cpus": 0}, SERVE_ENV) == {"num_cpus": 0, "runtime_env": {"env_vars": SERVE_ENV}}
    assert "GOMP_SPINCOUNT" not in SERVE_ENV  # the gateway runs no torch
