"""The serve config: shipped YAMLs validate, typos fail at load time, and the app and the Ray
Serve config are built from it (no Ray started)."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pdserve.app import build, load_config, serve_config
from pdserve.cli import main
from pdserve.config import ServeConfig

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "tiny-cpu-colocated.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(str(CONFIGS / name), port=9000)
    assert cfg.gateway.port == 9000 and cfg.gateway.host == "127.0.0.1"
    assert cfg.mode == ("colocated" if "colocated" in name else "disaggregated")


def test_mistakes_fail_at_load_time_naming_the_field():
    with pytest.raises(ValidationError, match="max_num_seqs"):
        ServeConfig(engine={"max_num_seqs": 0})
    with pytest.raises(ValidationError, match="num_replicas"):
        ServeConfig(prefill={"num_replicas": 0})
    with pytest.raises(ValidationError, match="mode"):
        ServeConfig(mode="split")
    with pytest.raises(ValidationError, match="unknown_field"):
        ServeConfig(unknown_field=1)
    with pytest.raises(ValidationError, match="set that and remote_prefill_max_queued_tokens"):
        ServeConfig(remote_prefill_max_queued_tokens=1536, remote_prefill_max_queued_tokens_long=3072)


def test_apps_and_serve_config(tiny_llama, capsys):
    from ray.serve import Application

    for mode in ("disaggregated", "colocated"):
        router = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
        cfg = ServeConfig(model=tiny_llama, mode=mode, prefill={"request_router_class": router})
        assert isinstance(build(cfg), Application)

    out = serve_config(ServeConfig(model=tiny_llama, gateway={"port": 8100}))
    [app] = out["applications"]
    assert app["import_path"] == "pdserve.app:build_app" and out["http_options"]["port"] == 8100
    assert ServeConfig.model_validate(app["args"]).model == tiny_llama  # the args round-trip

    assert main(["serve-config", str(CONFIGS / "tiny-cpu.yaml")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["applications"][0]["args"]["engine"]["num_threads"] == 1


def test_pools_get_pdserve_routers_unless_configured(tiny_llama):
    from pdserve.app import KV_HEADROOM_ROUTER, PREFIX_AWARE_ROUTER, _pool_options

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


def test_prefill_degree_above_decode_degree_is_rejected():
    with pytest.raises(ValidationError, match="multiple of the prefill degree"):
        ServeConfig(prefill={"engine": {"tensor_parallel_size": 2}}, decode={"engine": {"tensor_parallel_size": 1}})
    with pytest.raises(ValidationError, match="multiple of the prefill degree"):
        ServeConfig(prefill={"engine": {"tensor_parallel_size": 2}}, decode={"engine": {"tensor_parallel_size": 3}})
    ServeConfig(prefill={"engine": {"tensor_parallel_size": 1}}, decode={"engine": {"tensor_parallel_size": 2}})
    ServeConfig(mode="colocated", decode={"engine": {"tensor_parallel_size": 2}})


def test_api_keys_from_the_environment_add_to_the_configured_ones(monkeypatch):
    from pdserve.config import GatewayConfig
    from pdserve.gateway.deployment import API_KEYS_ENV, with_env_api_keys

    gateway = GatewayConfig(api_keys=["sk-a"])
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert with_env_api_keys(gateway).api_keys == ["sk-a"]
    monkeypatch.setenv(API_KEYS_ENV, " sk-b, ,sk-a,sk-c ")
    assert with_env_api_keys(gateway).api_keys == ["sk-a", "sk-b", "sk-c"]
    monkeypatch.delenv(API_KEYS_ENV)
    assert with_env_api_keys(GatewayConfig()).api_keys == []  # no keys configured or set: no auth


def test_replicas_run_on_serves_own_loop_and_engines_spin_briefly_unless_configured(tiny_llama):
    from pdserve.app import ENGINE_ENV, PREFIX_AWARE_ROUTER, SERVE_ENV, _pool_options, with_env

    cfg = ServeConfig(model=tiny_llama, decode={"ray_actor_options": {
        "num_cpus": 2, "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}, "pip": ["x"]}}})
    prefill = _pool_options(cfg, cfg.prefill, "Prefill", PREFIX_AWARE_ROUTER)["ray_actor_options"]
    assert prefill == {"num_cpus": 1, "runtime_env": {"env_vars": ENGINE_ENV}}
    assert ENGINE_ENV["GOMP_SPINCOUNT"] == "2000" and ENGINE_ENV["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    decode = _pool_options(cfg, cfg.decode, "Decode", PREFIX_AWARE_ROUTER)["ray_actor_options"]
    assert decode["runtime_env"] == {"env_vars": {**ENGINE_ENV, "OMP_WAIT_POLICY": "ACTIVE"}, "pip": ["x"]}
    assert cfg.decode.ray_actor_options["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "ACTIVE"}  # not mutated
    assert with_env({"num_cpus": 0}, SERVE_ENV) == {"num_cpus": 0, "runtime_env": {"env_vars": SERVE_ENV}}
    assert "GOMP_SPINCOUNT" not in SERVE_ENV  # the gateway runs no torch
