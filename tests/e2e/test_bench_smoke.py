"""`pdserve bench` against the real pdserve app (the smoke run #4 asks for): every request
completes and the vLLM-named metrics come out."""

import json

from pdserve.cli import main


def test_pdserve_bench_against_the_disaggregated_app(serve_apps, tiny_llama, tmp_path):
    app = serve_apps["disagg"]
    out = tmp_path / "run.json"
    assert main(["bench", "--base-url", app.base, "--tokenizer", tiny_llama, "--workload", "random",
                 "--num-requests", "12", "--input-len", "8:60",
                 "--output-len", "6", "--concurrency", "4", "--no-progress", "--slo", "ttft=60s",
                 "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0, result["error_examples"]
    assert result["total_output_tokens"] == 12 * 6 and result["output_tokens_counted_by"] == "usage"
    for key in ("mean_ttft_ms", "p99_itl_ms", "median_tpot_ms", "output_throughput", "request_goodput"):
        assert result[key] > 0, key
