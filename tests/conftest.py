"""Shared fixtures: tiny checkpoints generated once per test session (nothing downloaded)."""

from __future__ import annotations

import os

import pytest

# Keep the suite's torch to the cores CI has and make runs repeatable.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
