"""The unit tier (docs/testing.md): pure logic in one process, without Ray.

For every test under tests/unit:
- torch runs one thread. The models are tiny, so a second thread buys nothing, and on a shared
  2-core machine each parallel region waits on whichever thread is descheduled: the same tests
  took about three times the CPU time with two. Tests about threading set their own count.
- in the folders (tests/unit/<folder>/, where the engines run), an engine whose config sets no KV
  cache size gets 32 MiB, not the documented 512 MiB: a KV cache's pages are taken when it is
  allocated, ~130,000 page faults and 0.3-0.8 s of kernel time per engine at 512 MiB, about a
  third of the tier's time. The tests at the top level (the config, its docs) see the default.
- a test that leaves Ray imported fails: it belongs in tests/integration. This catches the
  imports made while a test runs (a builder that imports Ray Serve inside a function);
  test_ray_free.py checks what the tier's modules import.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig

UNIT = Path(__file__).parent
KV_CACHE_BYTES = 32 * 2**20  # tiny-llama: 4,096 blocks of 16 tokens
DOCUMENTED_KV_CACHE_BYTES = EngineConfig.model_fields["kv_cache_memory_bytes"].default


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kv_cache_default(nbytes: int) -> None:
    field = EngineConfig.model_fields["kv_cache_memory_bytes"]
    if field.default != nbytes:
        field.default = nbytes
        EngineConfig.model_rebuild(force=True)


@pytest.fixture(scope="package", autouse=True)
def documented_kv_cache_default_after():
    yield
    _kv_cache_default(DOCUMENTED_KV_CACHE_BYTES)


@pytest.fixture(scope="module", autouse=True)
def small_kv_caches(request, documented_kv_cache_default_after):
    """Module-scoped, so that it comes before the module's own fixtures that build engines."""
    _kv_cache_default(KV_CACHE_BYTES if request.path.parent != UNIT else DOCUMENTED_KV_CACHE_BYTES)


@pytest.fixture(autouse=True)
def no_ray():
    """Fails the test that imported Ray (the first one: once loaded, Ray stays for the session, and
    a session that ran integration tests first has it already)."""
    had_ray = "ray" in sys.modules
    yield
    if not had_ray and "ray" in sys.modules:
        pytest.fail("this test imported Ray; the unit tier runs without it (tests/integration has Ray)")
