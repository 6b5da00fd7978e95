"""The serve config: typos and impossible combinations fail at load time, naming the field."""

import pytest
from pydantic import ValidationError

from pdserve.config import ServeConfig


def test_mistakes_fail_at_load_time_naming_the_field():
    with pytest.raises(ValidationError, match="max_num_seqs"):
        ServeConfig(engine={"max_num_seqs": 0})
    with pytest.raises(ValidationError, match="num_replicas"):
        ServeConfig(prefill={"num_replicas": 0})
    with pytest.raises(ValidationError, match="mode"):
        ServeConfig(mode="split")
    with pytest.raises(ValidationError, match="unknown_field"):
        ServeConfig(unknown_field=1)
    with pytest.raises(ValidationError, match="percentile"):
        ServeConfig(slo={"ttft_ms": 500, "percentile": 120})
    with pytest.raises(ValidationError, match="percentile"):  # every prompt in time: no pool size is sure of it
        ServeConfig(slo={"ttft_ms": 500, "percentile": 100})


def test_a_removed_field_names_what_replaced_it():
    with pytest.raises(ValidationError) as e:
        ServeConfig.model_validate({"remote_prefill_min_tokens": 256, "early_first_token": True})
    assert [error["loc"] for error in e.value.errors()] == [("remote_prefill_min_tokens",), ("early_first_token",)]
    assert all("set slo: {ttft_ms, itl_ms} instead" in error["msg"] for error in e.value.errors())


def test_config_validate_reports_a_removed_field_beside_the_others():
    from pdserve.config_check import check

    config, problems = check({"overflow_prefill_pause_s": 2.0, "engine": {"max_num_seqs": 0},
                              "slo": {"ttft_ms": 1500}})
    assert config is None
    assert [p.path for p in problems] == ["overflow_prefill_pause_s", "engine.max_num_seqs"]
    assert problems[0].message.startswith("removed: where prompts are prefilled follows the latency target")


def test_prefill_degree_above_decode_degree_is_rejected():
    with pytest.raises(ValidationError, match="multiple of the prefill degree"):
        ServeConfig(prefill={"engine": {"tensor_parallel_size": 2}}, decode={"engine": {"tensor_parallel_size": 1}})
    with pytest.raises(ValidationError, match="multiple of the prefill degree"):
        ServeConfig(prefill={"engine": {"tensor_parallel_size": 2}}, decode={"engine": {"tensor_parallel_size": 3}})
    ServeConfig(prefill={"engine": {"tensor_parallel_size": 1}}, decode={"engine": {"tensor_parallel_size": 2}})
    ServeConfig(mode="colocated", decode={"engine": {"tensor_parallel_size": 2}})


def test_scale_to_zero_must_be_asked_for():
    with pytest.raises(ValidationError, match="scale_to_zero"):
        ServeConfig(prefill={"autoscaling": {"min_replicas": 0}})
    ServeConfig(prefill={"autoscaling": {"min_replicas": 0, "scale_to_zero": True}})
    with pytest.raises(ValidationError, match="exceeds max_replicas"):
        ServeConfig(decode={"autoscaling": {"min_replicas": 5, "max_replicas": 2}})


def test_a_replica_accepts_a_whole_batch_unless_told_otherwise():
    """The llama3-8b-h100-a100 example's decode pool (max_num_seqs 256) ran at most 64 sequences a
    replica when max_ongoing_requests was 64 whatever the batch."""
    cfg = ServeConfig(engine={"max_num_seqs": 8, "max_num_batched_tokens": 512},
                      decode={"engine": {"max_num_seqs": 256}}, prefill={"max_ongoing_requests": 4})
    assert cfg.max_ongoing_requests(cfg.decode) == 256
    assert cfg.max_ongoing_requests(cfg.prefill) == 4  # said: kept, below the batch too
    assert ServeConfig().max_ongoing_requests(ServeConfig().decode) == 64  # a small batch: at least 64
