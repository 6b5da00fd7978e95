"""The builder's Ray-free half: shipped YAMLs load, and the Ray Serve config (what `serve deploy`
and KubeRay take) is written from a `ServeConfig`. Building the Serve application itself imports
Ray: tests/integration/test_app.py."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pdserve.app import load_config, serve_config
from pdserve.cli import main
from pdserve.config import ServeConfig

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "tiny-cpu-colocated.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(str(CONFIGS / name), port=9000)
    assert cfg.gateway.port == 9000 and cfg.gateway.host == "127.0.0.1"
    assert cfg.mode == ("colocated" if "colocated" in name else "disaggregated")


def test_the_serve_config_round_trips_the_args(capsys):
    out = serve_config(ServeConfig(model="/models/m", gateway={"port": 8100}))
    [app] = out["applications"]
    assert app["import_path"] == "pdserve.app:build_app" and out["http_options"]["port"] == 8100
    assert ServeConfig.model_validate(app["args"]).model == "/models/m"

    assert main(["serve-config", str(CONFIGS / "tiny-cpu.yaml")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["applications"][0]["args"]["engine"]["num_threads"] == 1


def test_pool_ratio_needs_both_pools_autoscaling():
    auto = {"min_replicas": 1, "max_replicas": 3}
    with pytest.raises(ValidationError, match="autoscaling on both"):
        ServeConfig(model="m", prefill={"autoscaling": auto}, pool_ratio={})
    with pytest.raises(ValidationError, match="exceeds"):
        ServeConfig(model="m", prefill={"autoscaling": auto}, decode={"autoscaling": auto},
                    pool_ratio={"min_prefill_per_decode": 3, "max_prefill_per_decode": 2})
    cfg = ServeConfig(model="m", prefill={"autoscaling": auto}, decode={"autoscaling": auto}, pool_ratio={})
    policy = serve_config(cfg)["applications"][0]["autoscaling_policy"]
    assert policy["policy_function"] == "pdserve.autoscale.policies:PoolRatioPolicy"
    assert policy["policy_kwargs"]["min_ratio"] == 0.25 and "target_kv_usage" in policy["policy_kwargs"]["decode"]
