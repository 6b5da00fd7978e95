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


def test_slo_with_both_pools_autoscaling_deploys_the_joint_policy():
    from pdserve.autoscale.policies import JointSloPolicy

    auto = {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 20}
    both = {"prefill": {"autoscaling": auto}, "decode": {"autoscaling": {**auto, "downscale_delay_s": 40}}}
    cfg = ServeConfig(model="m", slo={"ttft_ms": 800, "itl_ms": 40}, **both)  # (max_num_seqs: the default 64)
    policy = serve_config(cfg)["applications"][0]["autoscaling_policy"]
    assert policy["policy_function"] == "pdserve.autoscale.policies:JointSloPolicy"
    # The budget defaults to both pools' max_replicas; the slower of their scale-downs.
    assert policy["policy_kwargs"] == {"ttft_ms": 800, "itl_ms": 40, "percentile": 99.0, "max_total_replicas": 6,
                                       "downscale_delay_s": 40, "max_num_seqs": 64}
    JointSloPolicy(**policy["policy_kwargs"])  # what Ray Serve will construct
    budget = ServeConfig(slo={}, max_total_replicas=4, **both)  # (the model not resolved yet: serve-config)
    assert serve_config(budget)["applications"][0]["autoscaling_policy"]["policy_kwargs"]["max_total_replicas"] == 4
    # Without slo, or with a pool of fixed size, the pools keep their own policies.
    assert "autoscaling_policy" not in serve_config(ServeConfig(model="m", **both))["applications"][0]
    assert "autoscaling_policy" not in serve_config(
        ServeConfig(model="m", slo={}, prefill={"autoscaling": auto}))["applications"][0]


def test_the_joint_policys_budget_and_pool_ratio_are_checked():
    auto = {"min_replicas": 2, "max_replicas": 3}
    both = {"prefill": {"autoscaling": auto}, "decode": {"autoscaling": auto}}
    with pytest.raises(ValidationError, match="drop pool_ratio"):
        ServeConfig(model="m", slo={}, pool_ratio={}, **both)
    with pytest.raises(ValidationError, match=r"below the pools' min_replicas together \(4\)"):
        ServeConfig(model="m", slo={}, max_total_replicas=3, **both)
    with pytest.raises(ValidationError, match="budget of the joint autoscaling policy"):
        ServeConfig(model="m", max_total_replicas=8, **both)
