"""Heterogeneous pools on a Ray multi-node test cluster: prefill replicas only on the prefill
node type, decode only on the decode node type, KV crosses between the two raylets, and a
killed prefill replica fails no request. Over tcp, the default backend: what this cluster adds is
placement and the pools' wiring, whatever carries the blocks; ucx's blocks between two processes
are tests/integration/kvtransfer/test_network_transfer.py's, and its run in Ray Serve replicas
built from the config test_model_families_serving.py's (one family there pulls over ucx), where a
second cluster cost a minute."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port as _free_port


def test_pools_land_on_their_node_types_and_kv_crosses_raylets(tiny_llama):
    script = Path(__file__).with_name("multinode_app.py")
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, str(script), tiny_llama, str(_free_port()), "tcp"], cwd=root,
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    report = json.loads(line.removeprefix("REPORT "))
    prefill, decode = report["stats"]["Prefill"], report["stats"]["Decode"]
    assert prefill["node_id"] == report["prefill_node"]
    assert decode["node_id"] == report["decode_node"]
    assert decode["num_remote_prefills"] == 1 and decode["num_pulled_blocks"] > 0
    assert decode["num_shared_memory_pulls"] == 0
    assert report["completion"]["usage"]["completion_tokens"] == 8
    # A dead prefill replica costs no request: the next one still completes on the same decode replica.
    assert report["after_kill_status"] == 200, report["after_kill"]
    assert report["after_kill"]["usage"]["completion_tokens"] == 8
    assert report["decode_after_kill"]["node_id"] == report["decode_node"]
