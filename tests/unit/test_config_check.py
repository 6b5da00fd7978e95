"""`pdserve config validate`: every shipped config passes with a summary; each kind of mistake is
reported at its own field path with what the field is for. (The command's exit status, in a
process of its own: tests/integration/test_config_check.py.)"""

from __future__ import annotations

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
prefill:
  num_replicas: 0
  autoscaling: {min_replicas: 3, max_replicas: 2}
  engine: {blok_size: 3, model: /x}
decode:
  engine: {max_num_seqs: 600, max_num_batched_tokens: 512}
gateway: {port: abc}
""")
    assert set(problems) == {"mode", "prefil", "prefill.num_replicas", "prefill.autoscaling", "prefill.engine.blok_size",
                             "prefill.engine.model", "decode.engine", "gateway.port"}
    assert problems["prefil"].startswith("unknown field 'prefil' (did you mean 'prefill'?)")
    assert problems["prefill.engine.blok_size"].startswith("unknown field 'blok_size' (did you mean 'block_size'?)")
    assert problems["prefill.engine.model"].startswith("unknown field 'model' (did you mean the top-level 'model'?) "
                                                       "| Local Hugging Face checkpoint directory")
    # a field written in the wrong place: where it belongs (below this place first), and what it is for
    assert _problems("max_num_seqs: 8\ndecode: {min_replicas: 2}") == {
        "max_num_seqs": "unknown field 'max_num_seqs' (did you mean 'engine.max_num_seqs'?) | Most sequences in one "
                        "batch.",
        "decode.min_replicas": "unknown field 'min_replicas' (did you mean 'decode.autoscaling.min_replicas'?) | "
                               "Fewest replicas; 0 only with scale_to_zero."}
    assert "max_num_batched_tokens (512) must be at least max_num_seqs (600)" in problems["decode.engine"]
    assert problems["prefill.num_replicas"].endswith("| Replicas in this pool.")
    assert problems["prefill.autoscaling"].startswith("min_replicas 3 exceeds max_replicas 2")
    assert "(got 'abc') | HTTP port." in problems["gateway.port"]


def test_engine_overrides_are_checked_field_by_field_and_merged():
    """The top-level engine and each pool's are EngineConfig's fields with its bounds and
    descriptions; each pool's merge must pass EngineConfig's checks across fields."""
    assert _problems("engine: {max_num_seqs: 0, dtype: fp8}\ndecode: {engine: {block_size: 0}}") == {
        "engine.max_num_seqs": "Input should be greater than or equal to 1 (got 0) | Most sequences in one batch.",
        "engine.dtype": "Input should be 'auto', 'float32', 'bfloat16' or 'float16' (got 'fp8') | Weight and "
                        "activation dtype; 'auto' takes the checkpoint's dtype.",
        "decode.engine.block_size": "Input should be greater than or equal to 1 (got 0) | Tokens per KV-cache block."}
    # The top-level engine's fields reach both pools; a pool that raises the budget is fine.
    problems = _problems("engine: {max_num_seqs: 4096}\nprefill: {engine: {max_num_batched_tokens: 8192}}")
    assert set(problems) == {"decode.engine"} and "must be at least max_num_seqs (4096)" in problems["decode.engine"]
    assert _problems("engine: {max_num_seqs: 4096, max_num_batched_tokens: 4096}") == {}


def test_engine_overrides_follow_engine_config():
    """EngineOverrides is derived from EngineConfig: the same fields (less model), types, bounds and
    descriptions. Only the fields written count, a null among them (it resets a top-level value)."""
    from pdserve.config import EngineConfig, EngineOverrides, ServeConfig

    assert list(EngineOverrides.model_fields) == [f for f in EngineConfig.model_fields if f != "model"]
    for name, field in EngineOverrides.model_fields.items():
        original = EngineConfig.model_fields[name]
        assert (field.annotation, field.metadata, field.description) == \
               (original.annotation, original.metadata, original.description), name
    config = ServeConfig(model="/m", engine={"num_kv_blocks": 64, "block_size": 8},
                         decode={"engine": {"num_kv_blocks": None}})
    assert config.engine.model_dump() == {"block_size": 8, "num_kv_blocks": 64}
    args = config.model_dump(mode="json", exclude_defaults=True)  # what serve_config hands to build_app
    assert args["decode"] == {"engine": {"num_kv_blocks": None}} and args["engine"] == config.engine.model_dump()
    again = ServeConfig.model_validate(args)
    assert again.engine_config(again.decode).num_kv_blocks is None
    assert again.engine_config(again.prefill) == EngineConfig(model="/m", num_kv_blocks=64, block_size=8)


BROKEN = "engine:\n  max_num_seqs: 0\nprefill:\n  num_replicas: 0\nmode: split\n"


def test_every_entry_point_explains_every_problem(tmp_path, capsys):
    """`pdserve serve` and `serve-config` report a config's problems as `pdserve config validate`
    does: all of them, each where it is, and no traceback. (`build_app` under Ray Serve:
    tests/integration/test_config_errors.py.)"""
    from pdserve.app import _undotted, load_config
    from pdserve.cli import main
    from pdserve.config_check import load
    from pdserve.errors import ConfigError

    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    for command in (["serve-config", str(path)], ["serve", str(path)]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert "3 problems" in err and "Traceback" not in err
        for where in ("engine.max_num_seqs", "prefill.num_replicas", "mode"):
            assert where in err, (command, err)
    # build_app's args: `serve run` passes flat strings, a dotted key names a nested field
    args = _undotted({"engine.max_num_seqs": "0", "prefill.num_replicas": "0", "mode": "split", "x.y": 1})
    assert args == {"engine": {"max_num_seqs": "0"}, "prefill": {"num_replicas": "0"}, "mode": "split",
                    "x": {"y": 1}}
    assert _undotted({"engine": {"block_size": 8}, "engine.seed": "1", "mode": "colocated", "mode.x": 1}) == {
        "engine": {"block_size": 8, "seed": "1"}, "mode": "colocated", "mode.x": 1}
    with pytest.raises(ConfigError, match="(?s)4 problems.*engine.max_num_seqs.*prefill.num_replicas"):
        load(args, "the application's args")
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
    assert all(check({"transfer": {"backend": b}})[0] is not None for b in ("tcp", "ucx"))
