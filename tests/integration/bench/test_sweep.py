"""`pdserve bench sweep` and `--compare` end to end against a scripted server: the sweep's JSON
and its two plots (matplotlib, seconds to import and render: why this is not in the unit tier),
the comparison's ratios and its exit statuses, and a rate sweep naming its max goodput."""

import json

from tests.fakes.openai_stub import OpenAIStub


def test_sweep_and_compare_commands(tmp_path, capsys):
    from pdserve.cli import main

    with OpenAIStub(ttft_s=0.01, itl_s=0.005) as stub:
        assert main(["bench", "sweep", "--base-url", stub.base_url, "--concurrencies", "1,4", "--num-requests", "6",
                     "--output-len", "4", "--slo", "ttft=1s", "--out-dir", str(tmp_path), "--no-progress"]) == 0
        assert main(["bench", "--base-url", stub.base_url, "--num-requests", "3", "--output-len", "3",
                     "--result-file", str(tmp_path / "a.json"), "--no-progress"]) == 0
    results = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["concurrency"] for r in results] == [1, 4] and all(r["completed"] == 6 for r in results)
    for png in ("sweep_load.png", "sweep_latency_cdf.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert "1.00x" in capsys.readouterr().out
    assert main(["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "missing.json")]) == 2

    with OpenAIStub(ttft_s=0.01, itl_s=0.005) as stub:  # a rate sweep with an SLO names its max goodput
        assert main(["bench", "sweep", "--base-url", stub.base_url, "--rates", "50,100", "--num-requests", "4",
                     "--output-len", "2", "--slo", "ttft=5s", "--out-dir", str(tmp_path / "r"), "--no-progress"]) == 0
    assert "max goodput: at least 100.00 req/s (90% of requests within SLO)" in capsys.readouterr().out
    assert main(["bench", "sweep", "--rates", "1", "--attainment", "1.5"]) == 2
