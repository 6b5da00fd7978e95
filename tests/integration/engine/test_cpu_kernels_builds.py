"""The CPU kernels built for older CPUs: the AVX2 and the plain C code paths, on a machine that may
have AVX-512. Each build compiles the whole library (~10 s on 2 cores), so they live here rather
than in the unit tier, which runs tests/unit/engine/test_cpu_kernels.py on this machine's build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.kernels import cpu_kernels

UNIT_TESTS = Path(__file__).resolve().parents[2] / "unit" / "engine" / "test_cpu_kernels.py"


@pytest.mark.slow
@pytest.mark.parametrize("cflags", ["-mno-avx512f", "-mno-avx512f -mno-avx2 -mno-fma"])
def test_the_kernels_for_older_cpus(cflags, tmp_path):
    # The unit file's build, attention and linear tests, in a process of their own with these
    # flags (the library is loaded once per process) and a cache of their own.
    env = {**os.environ, cpu_kernels.CFLAGS_ENV: cflags, "PDSERVE_CACHE_DIR": str(tmp_path)}
    tests = ("builds_on_this_machine or kernel_matches_torch or linear_matches_torch or same_result_in_any_batch"
             " or large_scores")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(UNIT_TESTS),
                             "-k", tests], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
    assert list((tmp_path / "kernels").glob("cpu_kernels-*.so")), "the build did not land in the cache"
