"""Shared fixtures: tiny checkpoints generated once per test session (nothing downloaded)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

# Keep the suite's torch to the cores CI has and make runs repeatable.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its interpreter; the mode is read when Triton is imported
# (its own library's jit functions are made then), so it is set here, before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-mixtral")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """preset name -> directory of a freshly generated checkpoint (seed 0)."""
    from pdserve.engine.checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {p: str(make_checkpoint(p, root / p, seed=0)) for p in TINY_PRESETS}


@pytest.fixture(scope="session")
def tiny_llama(checkpoints) -> str:
    return checkpoints["tiny-llama"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session (2 cores: starting Ray is the expensive part).
    Logical CPUs are oversubscribed on purpose: replicas mostly wait, and engines use one thread."""
    import ray

    # Metrics: Ray's Prometheus export on a free port, reported every half second (tests/e2e/test_telemetry.py).
    # address="local": a new instance even where a `ray start` cluster runs on this machine (another
    # session's netns lab), which ray.init() would otherwise join.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, _metrics_export_port=free_port(),
             _system_config={"metrics_report_interval_ms": 500},
             runtime_env={"env_vars": {"UCX_TLS": "tcp", "TOKENIZERS_PARALLELISM": "false",
                                       # Autoscaling tests: replicas report load every half second.
                                       "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                                       "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}})
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port, stopped after the test."""
    from pdserve.router.redis_server import LocalRedis

    with LocalRedis() as server:
        yield server
