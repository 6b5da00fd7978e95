"""values.schema.json: bad values fail `helm install` before anything renders, with a message that
names the field; its `config` part agrees with ServeConfig, and the file is what its generator
writes from platform/config.py."""

from __future__ import annotations

import itertools
import json
import runpy

import pytest
import yaml
from pydantic import ValidationError

from pdserve.config import ServeConfig
from tests.helm.conftest import CHART, CONFIGS, EXAMPLES

GENERATOR = CHART.parent / "gen_values_schema.py"


def _schema_error(helm, chart, values) -> str | None:
    try:
        chart.validate_schema(values)
    except helm.HelmValuesError as e:
        return str(e)
    return None


def test_the_schema_is_up_to_date():
    generator = runpy.run_path(str(GENERATOR))
    written = (CHART / "values.schema.json").read_text()
    assert written == generator["render"](generator["values_schema"]()), \
        "values.schema.json is stale: run python deploy/helm/gen_values_schema.py"


def test_defaults_and_examples_pass(helm, chart):
    assert _schema_error(helm, chart, yaml.safe_load((CHART / "values.yaml").read_text())) is None
    for name in EXAMPLES:
        config = yaml.safe_load((CONFIGS / name).read_text())
        assert _schema_error(helm, chart, {"config": config}) is None, name


@pytest.mark.parametrize("values, message", [
    ({"pools": {"prefill": {"replicas": -1}}}, "at '/pools/prefill/replicas': minimum: got -1, want 0"),
    ({"extraWorkerGroups": [{"name": "d2", "pool": "decode", "maxReplicas": -2}]},
     "at '/extraWorkerGroups/0/maxReplicas': minimum: got -2, want 0"),
    ({"config": {"decode": {"num_replicas": -1}}}, "at '/config/decode/num_replicas': minimum: got -1, want 1"),
    ({"pools": {"prefil": {}}}, "at '/pools': additional properties 'prefil' not allowed"),
    ({"extraWorkerGroups": [{"name": "x", "pool": "unified"}]},
     "at '/extraWorkerGroups/0/pool': value must be one of 'prefill', 'decode'"),
    ({"config": {"prefil": {"num_replicas": 2}}}, "at '/config': additional properties 'prefil' not allowed"),
    ({"config": {"prefill": {"engine": {"tensor_parallel_size": 4}}, "decode": {"engine": {"tensor_parallel_size": 2}}}},
     "at '/config/decode/engine/tensor_parallel_size': value must be one of 4, 8, 16"),
    ({"config": {"engine": {"tensor_parallel_size": 2}, "prefill": {"engine": {"tensor_parallel_size": 4}}}},
     "at '/config/engine/tensor_parallel_size': value must be one of 4, 8, 16"),
    ({"config": {"engine": {"tensor_parallel_size": 3}}}, "at '/config/engine/tensor_parallel_size': value must be one of 1, 2, 4, 8, 16"),
    ({"pools": {"decode": {"rayStartParams": {"num-gpus": 2}}}}, "at '/pools/decode/rayStartParams/num-gpus': got number, want string"),
    ({"upgradeStrategy": {"type": "Recreate"}}, "at '/upgradeStrategy/type': value must be one of 'NewCluster'"),
    ({"fullnameOverride": "x" * 48}, "at '/fullnameOverride': maxLength"),
])
def test_bad_values_are_rejected_naming_the_field(helm, chart, values, message):
    error = _schema_error(helm, chart, values)
    assert error is not None and message in error, error


def test_tensor_parallel_rule_agrees_with_serve_config(helm, chart):
    """Every combination of the three places a degree can be set, in both modes: the schema accepts
    exactly what ServeConfig accepts."""
    degrees = [None, 1, 2, 4]
    for mode, prefill, decode, top in itertools.product(["disaggregated", "colocated"], degrees, degrees, degrees):
        config: dict = {"mode": mode}
        for key, degree in (("prefill", prefill), ("decode", decode)):
            if degree:
                config[key] = {"engine": {"tensor_parallel_size": degree}}
        if top:
            config["engine"] = {"tensor_parallel_size": top}
        try:
            ServeConfig.model_validate(config)
            valid = True
        except ValidationError:
            valid = False
        assert (_schema_error(helm, chart, {"config": config}) is None) == valid, json.dumps(config)


def test_config_fields_follow_the_pydantic_models():
    """The generated part names exactly ServeConfig's fields (a typo in `config` fails at install)."""
    from pdserve.config import EngineConfig, EngineOverrides, PoolConfig

    definitions = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    assert set(definitions["ServeConfig"]["properties"]) == set(ServeConfig.model_fields)
    assert set(definitions["PoolConfig"]["properties"]) == set(PoolConfig.model_fields)
    assert set(definitions["EngineOverrides"]["properties"]) == set(EngineOverrides.model_fields)
    assert set(EngineOverrides.model_fields) == set(EngineConfig.model_fields) - {"model"}
