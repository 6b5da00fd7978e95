"""The unit tier (docs/testing.md): pure logic in one process, without Ray.

Two things hold for every test under tests/unit:
- torch runs one thread. The models are tiny, so a second thread buys nothing, and on a shared
  2-core machine each parallel region waits on whichever thread is descheduled: the same tests
  took about three times the CPU time with two. Tests about threading set their own count.
- a test that leaves Ray imported fails: it belongs in tests/integration. This catches the
  imports made while a test runs (a builder that imports Ray Serve inside a function);
  test_ray_free.py checks what the tier's modules import.
"""

from __future__ import annotations

import sys

import pytest
import torch

# Unit-tier files that still import Ray, each to move to tests/integration; test_ray_free.py fails
# once one no longer does, so that the exception goes with it.
WAITING_TO_MOVE = ("tests/unit/test_launch.py",)  # a test patches ray.init (the config work moves it)


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_ray(request):
    """Fails the test that imported Ray (the first one: once loaded, Ray stays for the session, and
    a session that ran integration tests first has it already)."""
    had_ray = "ray" in sys.modules or request.node.nodeid.startswith(WAITING_TO_MOVE)
    yield
    if not had_ray and "ray" in sys.modules:
        pytest.fail("this test imported Ray; the unit tier runs without it (tests/integration has Ray)")
