"""How many threads an engine runs when its config does not say: no more than the CPUs its
process may run on, whatever the machine's core count or torch's default."""

import os

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel import torch_threads_per_rank, usable_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity masks (Linux)")


@pytest.fixture
def pinned_to_one_cpu():
    """This thread on one CPU with torch asking for two threads, as a process that taskset or a
    container's parent pinned to one of two cores; both restored afterwards."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {min(affinity)})
    torch.set_num_threads(2)
    yield
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


def test_default_threads_are_held_to_the_cpus_the_process_may_use(pinned_to_one_cpu):
    assert usable_cpus() == 1
    assert torch_threads_per_rank(EngineConfig(model="m")) == 1
    assert torch_threads_per_rank(EngineConfig(model="m", tensor_parallel_size=2)) == 1


def test_configured_threads_win(pinned_to_one_cpu):
    assert torch_threads_per_rank(EngineConfig(model="m", num_threads=3)) == 3


def test_an_engine_started_on_one_cpu_runs_one_thread(pinned_to_one_cpu, tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8))
    try:
        assert torch.get_num_threads() == 1
    finally:
        engine.shutdown()
