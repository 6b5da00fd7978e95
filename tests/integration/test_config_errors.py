"""A config with problems under Ray Serve's own entry points shows the report `pdserve config
validate` prints (every problem, each at its field path) and no traceback: `serve run
pdserve.app:build_app ARGS` prints it after `Error:`, and a deploy from a Serve config (`serve
deploy`, KubeRay's serveConfigV2) makes it the application's status message."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.errors import ConfigError

ARGS = {"mode": "split", "engine": {"max_num_seqs": 0}, "prefill": {"min_replicas": 2}}


def _report(args: dict) -> str:
    from pdserve.config_check import load

    with pytest.raises(ConfigError) as e:
        load(args, "the application's args")
    return str(e.value)


def test_serve_run_prints_every_problem_and_no_traceback(tmp_path):
    serve_cli = "import sys; from ray.serve.scripts import cli; sys.exit(cli())"
    run = subprocess.run([sys.executable, "-c", serve_cli, "run", "pdserve.app:build_app", "mode=split",
                          "engine.max_num_seqs=0", "prefill.min_replicas=2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "RAY_ADDRESS": ""})  # it fails before it would start Ray
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout
    # serve run passes strings: the report is the checker's for them ("0" is no more valid than 0)
    report = _report({"mode": "split", "engine": {"max_num_seqs": "0"}, "prefill": {"min_replicas": "2"}})
    assert f"Error: {report}\n" in run.stderr, run.stderr
    assert "3 problems" in report and "did you mean 'prefill.autoscaling.min_replicas'?" in report


@pytest.mark.slow
def test_a_deploy_from_a_serve_config_reports_every_problem(ray_session):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from pdserve.telemetry.status import state_name
    from tests.conftest import free_port

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # a no-op when Serve runs already
    name = "broken-config"
    config = {"applications": [{"name": name, "route_prefix": f"/{name}", "import_path": "pdserve.app:build_app",
                                "args": ARGS}]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    try:
        deadline = time.monotonic() + 120
        while (app := serve.status().applications.get(name)) is None or state_name(app.status) != "DEPLOY_FAILED":
            assert time.monotonic() < deadline, f"{name} did not fail: {app}"
            time.sleep(0.5)
        assert app.message == f"Deploying app '{name}' failed with exception:\n{_report(ARGS)}"
    finally:
        serve.delete(name)
