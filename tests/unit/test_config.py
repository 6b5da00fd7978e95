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
    with pytest.raises(ValidationError, match="set that and remote_prefill_max_queued_tokens"):
        ServeConfig(remote_prefill_max_queued_tokens=1536, remote_prefill_max_queued_tokens_long=3072)


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
