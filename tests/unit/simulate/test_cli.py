"""`pdserve simulate` and `pdserve plan` end to end in this process (small runs)."""

import json

from pdserve.cli import main

SMALL = ["--model", "llama-3.1-8b", "--workload", "random", "--input-len", "64:512", "--output-len", "8:64",
         "--rate", "20", "--ttft-ms", "1000", "--itl-ms", "50", "--no-progress"]


def test_simulate_prints_one_json_result(capsys):
    assert main(["simulate", "--accelerator", "H100", "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--num-requests", "50", "--json", *SMALL]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == result["num_requests"] == 50
    assert result["config"]["prefill_pool"] == {"accelerator": "H100", "replicas": 1, "tp": 1}


def test_simulate_refuses_what_it_cannot_run(capsys):
    assert main(["simulate", "--accelerator", "TPU", *SMALL, "--num-requests", "5"]) == 2
    assert "accelerator 'TPU'" in capsys.readouterr().err
    assert main(["simulate", "--accelerator", "H100", "--autoscale", *SMALL, "--num-requests", "5"]) == 2


def test_simulate_autoscales_a_config_that_does(tmp_path, capsys):
    """A config whose pools both autoscale against its slo runs under the joint policy, with
    the pools' bounds; one without autoscaling keeps its replicas."""
    path = tmp_path / "c.yaml"
    pools = ("prefill: {ray_actor_options: {accelerator_type: H100}, autoscaling: {max_replicas: 2}}\n"
             "decode: {ray_actor_options: {accelerator_type: H100}, autoscaling: {max_replicas: 3}}\n")
    path.write_text("slo: {ttft_ms: 1000, itl_ms: 50}\n" + pools)
    args = ["simulate", "--config", str(path), "--num-requests", "50", "--json", *SMALL]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["config"]["max_total_replicas"] == 5
    path.write_text(pools.replace("autoscaling: {max_replicas: 2}", "num_replicas: 1"))
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["config"]["max_total_replicas"] is None


def test_plan_writes_the_recommended_config(tmp_path, capsys, monkeypatch):
    import yaml

    from pdserve.simulate import plan

    monkeypatch.setattr(plan, "plot", lambda *args: None)  # matplotlib's import alone takes seconds

    assert main(["plan", "--accelerators", "H100", "--max-gpus", "2", "--duration", "5", "--out-dir", str(tmp_path),
                 *SMALL]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert yaml.safe_load((tmp_path / "values.yaml").read_text()) == {"config": config}
    assert config["slo"] == {"ttft_ms": 1000.0, "itl_ms": 50.0, "percentile": 99.0}
    assert len(json.loads((tmp_path / "plan.json").read_text())["candidates"]) == 3  # 1, 2 colocated; 1 + 1
