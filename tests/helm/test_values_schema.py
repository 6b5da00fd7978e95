"""values.schema.json: bad values fail `helm install` before anything renders, with a message that
names the field; `config` is only typed there (the templates check it: test_config_check.py,
against files/config.schema.json). Both files are what their generator writes from
platform/config.py."""

from __future__ import annotations

import json
import runpy

import pytest
import yaml

from pdserve.config import ServeConfig
from tests.helm.conftest import CHART, CONFIGS, EXAMPLES

GENERATOR = CHART.parent / "gen_values_schema.py"


def _schema_error(helm, chart, values) -> str | None:
    try:
        chart.validate_schema(values)
    except helm.HelmValuesError as e:
        return str(e)
    return None


def test_the_schemas_are_up_to_date():
    generator = runpy.run_path(str(GENERATOR))
    for path, schema in (("values.schema.json", "values_schema"), ("files/config.schema.json", "config_schema")):
        assert (CHART / path).read_text() == generator["render"](generator[schema]()), \
            f"{path} is stale: run python deploy/helm/gen_values_schema.py"


def test_defaults_and_examples_pass(helm, chart):
    assert _schema_error(helm, chart, yaml.safe_load((CHART / "values.yaml").read_text())) is None
    for name in EXAMPLES:
        config = yaml.safe_load((CONFIGS / name).read_text())
        assert _schema_error(helm, chart, {"config": config}) is None, name


@pytest.mark.parametrize("values, message", [
    ({"pools": {"prefill": {"replicas": -1}}}, "at '/pools/prefill/replicas': minimum: got -1, want 0"),
    ({"extraWorkerGroups": [{"name": "d2", "pool": "decode", "maxReplicas": -2}]},
     "at '/extraWorkerGroups/0/maxReplicas': minimum: got -2, want 0"),
    ({"pools": {"prefil": {}}}, "at '/pools': additional properties 'prefil' not allowed"),
    ({"extraWorkerGroups": [{"name": "x", "pool": "unified"}]},
     "at '/extraWorkerGroups/0/pool': value must be one of 'prefill', 'decode'"),
    ({"pools": {"decode": {"rayStartParams": {"num-gpus": 2}}}}, "at '/pools/decode/rayStartParams/num-gpus': got number, want string"),
    ({"upgradeStrategy": {"type": "Recreate"}}, "at '/upgradeStrategy/type': value must be one of 'NewCluster'"),
    ({"fullnameOverride": "x" * 48}, "at '/fullnameOverride': maxLength"),
    ({"config": 3}, "at '/config': got number, want null or string or object"),
])
def test_bad_values_are_rejected_naming_the_field(helm, chart, values, message):
    error = _schema_error(helm, chart, values)
    assert error is not None and message in error, error


def test_config_fields_follow_the_pydantic_models():
    """The config schema names exactly ServeConfig's fields (a typo in `config` fails at install)."""
    from pdserve.config import EngineConfig, EngineOverrides, PoolConfig

    schema = json.loads((CHART / "files" / "config.schema.json").read_text())
    definitions = schema["definitions"]
    assert set(schema["properties"]) == set(ServeConfig.model_fields)
    assert set(definitions["PoolConfig"]["properties"]) == set(PoolConfig.model_fields)
    assert set(definitions["EngineOverrides"]["properties"]) == set(EngineOverrides.model_fields)
    assert set(EngineOverrides.model_fields) == set(EngineConfig.model_fields) - {"model"}
