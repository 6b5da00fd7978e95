"""The console script: make-model then generate --json, as a user would run them."""

import json
import subprocess
import sys


def _pdserve(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, env=env)


def test_help_on_every_command():
    for cmd in ([], ["make-model"], ["generate"]):
        out = _pdserve(*cmd, "--help")
        assert out.returncode == 0 and "usage: pdserve" in out.stdout


def test_make_model_then_generate_json(tmp_path):
    model = tmp_path / "m"
    assert _pdserve("make-model", "--preset", "tiny-qwen2", "--out", str(model), "--seed", "1").returncode == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nparis is a city\n")
    out = _pdserve("generate", "--model", str(model), "--prompts-file", str(prompts), "--max-tokens", "5",
                   "--json")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["hello world", "paris is a city"]
    for r in records:
        assert set(r) >= {"prompt", "text", "token_ids", "finish_reason"}
        assert r["finish_reason"] in {"length", "stop"} and 1 <= len(r["token_ids"]) <= 5


def test_default_model_is_generated_on_first_use(tmp_path):
    import os

    env = dict(os.environ, PDSERVE_CACHE_DIR=str(tmp_path))
    out = _pdserve("generate", "--prompt", "hi", "--max-tokens", "3", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "models" / "tiny-llama-seed0" / "model.safetensors").is_file()


def test_bad_input_is_a_clear_error(tmp_path):
    out = _pdserve("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert out.returncode == 2 and "not a directory" in out.stderr
    out = _pdserve("generate", "--prompt", "x", "--top-p", "0")
    assert out.returncode == 2 and "top_p" in out.stderr
