"""`pdserve config validate`: every shipped config passes with a summary; each kind of mistake is
reported at its own field path with what the field is for, and the exit status says which."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config_check import check, parse, validate_text

CONFIGS = Path(__file__).parents[2] / "configs"


def _problems(text: str) -> dict[str, str]:
    data, problems = parse(text)
    if not problems:
        _, problems = check(data)
    return {p.path: f"{p.message} | {p.hint}" for p in problems}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    is_valid, report = validate_text(path.read_text(), path.name)
    assert is_valid, report
    assert report.startswith(f"{path.name}: valid")


def test_summary_names_pools_replicas_parallelism_and_resources():
    _, report = validate_text((CONFIGS / "mixtral-8x7b-ep.yaml").read_text())
    assert "prefill   1 replica(s) (autoscaling 1-2), TP 4 + EP, per replica: 8 CPU, 4 GPU, H100" in report
    _, report = validate_text((CONFIGS / "qwen2-7b-colocated.yaml").read_text())
    assert "unified   2 replica(s)" in report and "prefill" not in report


def test_every_mistake_is_reported_where_it_is():
    problems = _problems("""
mode: split
prefil: {}
engine: {max_num_seqs: 0}
prefill:
  num_replicas: 0
  autoscaling: {min_replicas: 3, max_replicas: 2}
decode:
  engine: {blok_size: 3, max_num_seqs: 600, max_num_batched_tokens: 512}
gateway: {port: abc}
""")
    assert set(problems) == {"mode", "prefil", "engine.max_num_seqs", "prefill.num_replicas", "prefill.autoscaling",
                             "decode.engine.blok_size", "decode.engine", "gateway.port"}
    assert problems["prefil"].startswith("unknown field 'prefil' (did you mean 'prefill'?)")
    assert problems["decode.engine.blok_size"].startswith("unknown field 'blok_size' (did you mean 'block_size'?)")
    assert problems["engine.max_num_seqs"] == "Input should be greater than or equal to 1 (got 0) | Most sequences in one batch."
    assert "max_num_batched_tokens (512) must be at least max_num_seqs (600)" in problems["decode.engine"]
    assert problems["prefill.num_replicas"].endswith("| Replicas in this pool.")
    assert problems["prefill.autoscaling"].startswith("min_replicas 3 exceeds max_replicas 2")
    assert "(got 'abc') | HTTP port." in problems["gateway.port"]


def test_checks_across_fields_and_broken_files():
    problems = _problems("prefill: {engine: {tensor_parallel_size: 2}}")
    assert "multiple of the prefill degree" in problems[""]
    assert _problems("engine: {model: /x}") == {
        "engine.model": "model is not an engine field here | set the checkpoint with the top-level `model:` "
                        "(all pools serve one model)"}
    assert _problems("a: [").keys() == {""} and "not valid YAML" in _problems("a: [")[""]
    assert "expected a mapping" in _problems("- 1")[""]
    assert _problems("") == {}  # an empty file is the embedded default


def test_the_command_exit_status(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: {num_replicas: -1}\n")
    run = lambda *files: subprocess.run([sys.executable, "-m", "pdserve.cli", "config", "validate", *files],
                                        capture_output=True, text=True)
    ok = run(str(CONFIGS / "tiny-cpu.yaml"))
    assert ok.returncode == 0 and "tiny-cpu.yaml: valid" in ok.stdout
    failed = run(str(CONFIGS / "tiny-cpu.yaml"), str(bad), str(tmp_path / "missing.yaml"))
    assert failed.returncode == 1
    assert "bad.yaml: 1 problem\n  decode.num_replicas: Input should be greater than or equal to 1 (got -1)" in failed.stderr
    assert "missing.yaml: cannot read it" in failed.stderr


BROKEN = "engine:\n  max_num_seqs: 0\nprefill:\n  num_replicas: 0\nmode: split\n"


def test_every_entry_point_explains_every_problem(tmp_path, capsys):
    """`pdserve serve`, `serve-config` and `build_app` report a config's problems as `pdserve config
    validate` does: all of them, each where it is, and no traceback."""
    from pdserve.app import build_app, load_config
    from pdserve.cli import main
    from pdserve.errors import ConfigError

    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    for command in (["serve-config", str(path)], ["serve", str(path)]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert "3 problems" in err and "Traceback" not in err
        for where in ("engine.max_num_seqs", "prefill.num_replicas", "mode"):
            assert where in err, (command, err)
    with pytest.raises(ConfigError, match="(?s)3 problems.*engine.max_num_seqs.*prefill.num_replicas"):
        build_app({"engine": {"max_num_seqs": 0}, "prefill": {"num_replicas": 0}, "mode": "split"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))
    path.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_only_the_backend_pools_can_use_is_accepted():
    """`local` moves KV within one process (tests): in a deployment it crashed the Decode replica."""
    for backend in ("local", "ray"):
        config, problems = check({"transfer": {"backend": backend}})
        assert config is None and [p.path for p in problems] == ["transfer.backend"]
    assert check({"transfer": {"backend": "ucx"}})[0] is not None
