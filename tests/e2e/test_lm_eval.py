"""lm-eval's `local-completions` model against pdserve's disaggregated app: a loglikelihood task
(token-id prompts, `echo` + `logprobs`) and a generation task, with the server itself as the
tokenizer (`tokenizer_backend=remote`: /tokenize, /detokenize, /tokenizer_info). What lm-eval
reads back must be what the offline engine computes on the same items: each choice's
loglikelihood, so the chosen answers and the accuracy, and each greedy generation. No network:
the tasks and their data ship in tests/e2e/lm_eval_tasks."""

from pathlib import Path

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.e2e.conftest import ENGINE

TASKS = Path(__file__).with_name("lm_eval_tasks")
NUM_ITEMS = 8  # each task's whole file


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _loglikelihood(offline: LLM, context: str, continuation: str) -> float:
    """The continuation's log-probability after the context, on the offline engine, tokenized as
    lm-eval does for a causal model (`TemplateLM._encode_pair`): the context's trailing spaces join
    the continuation, and the continuation's tokens are those of the whole past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = offline.tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(offline.tokenizer.encode(context, add_special_tokens=False))
    [out] = offline.generate([whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    return sum(lp.logprob for lp in out.prompt_logprobs[num_context:])


def test_lm_eval_reads_what_the_offline_engine_computes(serve_apps, tiny_llama, tmp_path, monkeypatch):
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
        limit=NUM_ITEMS, log_samples=True)
    offline = LLM(tiny_llama, block_size=ENGINE["block_size"], num_kv_blocks=256)

    mc = results["samples"]["pdserve_tiny_mc"]
    assert len(mc) == NUM_ITEMS and results["n-samples"]["pdserve_tiny_mc"]["effective"] == NUM_ITEMS
    served, expected = [], []
    for sample in mc:
        served.append([loglikelihood for loglikelihood, _ in sample["filtered_resps"]])
        expected.append([_loglikelihood(offline, *request) for request in sample["arguments"]])
        assert served[-1] == pytest.approx(expected[-1], abs=1e-3), sample["doc"]
    chosen = [_argmax(e) for e in expected]
    assert [_argmax(s) for s in served] == chosen
    accuracy = sum(c == sample["doc"]["answer"] for c, sample in zip(chosen, mc)) / NUM_ITEMS
    assert results["results"]["pdserve_tiny_mc"]["acc,none"] == pytest.approx(accuracy)

    gen = results["samples"]["pdserve_tiny_gen"]
    assert len(gen) == NUM_ITEMS
    greedy = SamplingParams(max_tokens=8, temperature=0, stop=["\n"])  # the task's generation_kwargs
    for sample in gen:
        [(context, _)] = sample["arguments"]
        [text] = sample["filtered_resps"]
        ids = offline.tokenizer.encode(context, add_special_tokens=False)
        assert text == offline.generate([ids], greedy)[0].text, sample["doc"]
