"""benchmarks/gpu_suite.py --dry-run: the GPU suite's code at tiny shapes on the CPU, so that it
cannot rot between GPU lends (issue #47). Every section runs and reports finite figures; the
engine and `transformers` hold the same weights; the P/D section's pulls carry the exporter's
bytes, over UCX (TCP here), the tcp backend, pdserve's local read (shared memory here) under
either, and the IPC stand-in, and its greedy tokens equal the references'; without UCX the P/D
section still runs, on the other paths."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Looked up, not imported: the suite runs in a subprocess, and a Triton imported here before
# tests/unit/engine/test_triton_paged.py sets TRITON_INTERPRET would be in compiled mode for it.
MISSING = [m for m in ("ucxx", "transformers", "triton") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")]

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
SECTIONS = {"machine", "attention", "gemv", "dense", "moe", "pd"}


def _run(out: Path, *args: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(out), *args], capture_output=True,
                          text=True, timeout=240, env={**os.environ, **env})
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert (out / "gpu_suite.md").read_text().count("\n| ") >= 2
    return json.loads((out / "gpu_suite.json").read_text())


def _numbers(value):
    """Every number in a JSON value."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _row(report: dict, section: str, starts: str) -> dict:
    rows = [r for r in report["rows"] if r["section"] == section and r["metric"].startswith(starts)]
    assert len(rows) == 1, f"{starts!r}: {rows}"
    return rows[0]


def test_every_section_reports_finite_figures(tmp_path):
    report = _run(tmp_path)
    assert report["dry_run"] is True
    assert {"torch", "cuda", "driver", "device_name"} <= set(report["env"])
    assert {name: s["status"] for name, s in report["sections"].items()} == {name: "ok" for name in SECTIONS}
    assert {r["section"] for r in report["rows"]} == SECTIONS
    for name, s in report["sections"].items():
        assert s["figures"], name
        assert all(math.isfinite(x) for x in _numbers(s["figures"])), name
    for r in report["rows"]:
        assert all(math.isfinite(x) for x in _numbers(r)), r
        assert r["value"] > 0, r  # nothing failed
        if r["section"] != "machine":  # the machine's rows are the others' limits, measured in the same run
            assert r["limit"] and r["ratio"] > 0, r

    dense = report["sections"]["dense"]["figures"]
    for b in report["shapes"]["throughput_batches"]:
        assert _row(report, "dense", f"8B-shaped output throughput, batch {b},")["limit_name"] == "transformers generate"
        assert dense[f"batch{b}_tokens_equal_transformers"] == 1.0  # fp32 on a CPU: the same weights, the same tokens
    assert _row(report, "dense", "8B-shaped decode, batch 1, one-token steps op by op")["value"] > 0
    assert dense["batch1_tokens_equal_op_by_op"] == 1.0

    # The layer on Triton GEMVs (norms, SwiGLU and residual adds read in) is the engine's layer.
    assert _row(report, "gemv", "batch-1 decoder layer at context")["value"] > 0
    assert report["sections"]["gemv"]["figures"]["layer_relative_error"] < 1e-4  # fp32

    pd = report["sections"]["pd"]["figures"]
    assert pd["ucx"] is True and pd["decoded_from"] == ["local"] and not pd["pull_errors"]
    for path in ("UCX messages, blocks in one run", "UCX messages, scattered blocks", "torch.multiprocessing",
                 "pdserve's local read, READ and its answer over UCX", "the tcp backend's socket",
                 "pdserve's local read with the tcp backend"):
        assert _row(report, "pd", f"KV pull over {path}")["value"] > 0
    assert set(pd["checksums_equal"]) == {"ucx", "ucx_scattered", "cuda_ipc", "local_ucx", "tcp", "local"}
    assert all(pd["prefill_kv_equal_across_processes"])
    assert all(pd["kv_intact_before_decode"]) and all(pd["kv_intact_after_decode"])
    assert pd["first_differences"] == []
    assert pd["tcp_board_reads"] >= pd["prompts"]  # the default's local reads asked the board, not the exporter
    assert _row(report, "pd", "pulled KV bytes equal")["value"] == 1.0
    assert _row(report, "pd", "greedy tokens, disaggregated = the same engine")["value"] == 1.0
    assert _row(report, "pd", "greedy tokens, disaggregated = colocated")["value"] == 1.0  # fp32 on a CPU


def test_pd_without_ucx_pulls_over_the_other_paths(tmp_path):
    report = _run(tmp_path, "--sections", "pd", UCX_TLS="no-such-transport")
    pd = report["sections"]["pd"]
    assert pd["status"] == "ok"
    assert pd["figures"]["ucx"] is False and "UCX check" in pd["figures"]["ucx_error"]
    assert pd["figures"]["decoded_from"] == ["local"]  # the default backend needs no UCX
    for path in ("UCX messages, blocks in one run", "UCX messages, scattered blocks",
                 "pdserve's local read, READ and its answer over UCX"):
        row = _row(report, "pd", f"KV pull over {path}")  # shown as failed, with the reason
        assert row["value"] == 0 and row["note"].startswith("FAILED: the UCX check")
    for path in ("torch.multiprocessing", "the tcp backend's socket",
                 "pdserve's local read with the tcp backend"):
        assert _row(report, "pd", f"KV pull over {path}")["value"] > 0
    assert _row(report, "pd", "pulled KV bytes equal")["value"] == 1.0
    assert _row(report, "pd", "greedy tokens, disaggregated = the same engine")["value"] == 1.0
