"""The serve config: shipped YAMLs validate, typos fail at load time, and the app and the Ray
Serve config are built from it (no Ray started)."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pdserve.app import build, load_config, serve_config
from pdserve.cli import main
from pdserve.config import ServeConfig

CONFIGS = Path(__file__).parents[3] / "configs"


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


def test_apps_and_serve_config(tiny_llama, capsys):
    from ray.serve import Application

    for mode in ("disaggregated", "colocated"):
        router = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # the hook #6 uses
        cfg = ServeConfig(model=tiny_llama, mode=mode, prefill={"request_router_class": router})
        assert isinstance(build(cfg), Application)

    out = serve_config(ServeConfig(model=tiny_llama, gateway={"port": 8100}))
    [app] = out["applications"]
    assert app["import_path"] == "pdserve.app:build_app" and out["http_options"]["port"] == 8100
    assert ServeConfig.model_validate(app["args"]).model == tiny_llama  # the args round-trip

    assert main(["serve-config", str(CONFIGS / "tiny-cpu.yaml")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["applications"][0]["args"]["engine"]["num_threads"] == 1

