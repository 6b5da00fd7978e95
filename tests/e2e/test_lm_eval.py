"""lm-eval's `local-completions` model against pdserve: a loglikelihood task (token-id prompts,
`echo` + `logprobs`) and a generation task run to completion, with the server itself as the
tokenizer (`tokenizer_backend=remote`: /tokenize, /detokenize, /tokenizer_info). No network:
the tasks and their data ship in tests/e2e/lm_eval_tasks."""

from pathlib import Path

import pytest

TASKS = Path(__file__).with_name("lm_eval_tasks")


def test_lm_eval_runs_loglikelihood_and_generation_tasks(serve_apps, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    for name in ("pdserve_tiny_mc.yaml", "pdserve_tiny_gen.yaml"):
        text = (TASKS / name).read_text().replace("DATA_DIR", str(TASKS.resolve()))
        (tmp_path / name).write_text(text)

    app = serve_apps["disagg"]
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{app.base}/v1/completions", "model": app.model, "tokenizer_backend": "remote",
                    "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1, "max_length": 384},
        tasks=["pdserve_tiny_mc", "pdserve_tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        limit=8, log_samples=False)
    mc, gen = results["results"]["pdserve_tiny_mc"], results["results"]["pdserve_tiny_gen"]
    assert 0.0 <= mc["acc,none"] <= 1.0
    assert 0.0 <= gen["exact_match,none"] <= 1.0
    assert results["n-samples"]["pdserve_tiny_mc"]["effective"] == 8
