"""Run by test_multinode.py in a process of its own (the test session already holds a Ray
instance): a Ray test cluster with a prefill node type and a decode node type, marked by custom
resources, pdserve deployed across it, one long request; then the prefill replica is killed and
another long request sent. Prints one "REPORT <json>" line."""

from __future__ import annotations

import json
import sys

import ray
import requests
from ray import serve
from ray.cluster_utils import Cluster

from pdserve.app import build
from pdserve.config import ServeConfig
from tests.harness.fixed_costs import REMOTE_PREFILL_SLO


def main(model: str, port: int, backend: str) -> None:
    env = {"env_vars": {"UCX_TLS": "tcp", "TOKENIZERS_PARALLELISM": "false"}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    prefill_node = cluster.add_node(num_cpus=1, resources={"prefill_node": 1})
    decode_node = cluster.add_node(num_cpus=1, resources={"decode_node": 1})
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    try:
        engine = {"num_threads": 1, "num_kv_blocks": 64, "block_size": 8, "max_model_len": 256}
        config = ServeConfig(
            # Blocks over the backend, as between hosts (these nodes share one, where the decode
            # replica would otherwise copy them out of the prefill replica's shared memory).
            model=model, engine=engine, slo=REMOTE_PREFILL_SLO,
            transfer={"backend": backend, "host": "127.0.0.1", "shared_memory": False},
            prefill={"ray_actor_options": {"num_cpus": 0.5, "resources": {"prefill_node": 0.5}}},
            decode={"ray_actor_options": {"num_cpus": 0.5, "resources": {"decode_node": 0.5}}},
            gateway={"port": port})
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(config), name="multinode", route_prefix="/")
        prompt = "the decode node pulls these blocks from the prefill node over the link " * 3
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        stats = {name: serve.get_deployment_handle(name, "multinode").stats.remote().result(timeout_s=30)
                 for name in ("Prefill", "Decode")}
        # The prefill replica dies; the next long request must still complete (decode prefills it
        # itself, or Serve's replacement does).
        [replica] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("SERVE_REPLICA::multinode#Prefill")]
        ray.kill(ray.get_actor(replica, namespace="serve"))
        after_kill = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                   json={"prompt": "a different long prompt after the prefill replica died " * 3,
                                         "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        decode = serve.get_deployment_handle("Decode", "multinode").stats.remote().result(timeout_s=30)
        print("REPORT", json.dumps({"prefill_node": prefill_node.node_id, "decode_node": decode_node.node_id,
                                    "stats": stats, "completion": r.json(), "after_kill_status": after_kill.status_code,
                                    "after_kill": after_kill.json(), "decode_after_kill": decode}))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
