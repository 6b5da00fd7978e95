"""The disaggregated app on a namespace lab (tests/harness/netns.py, ray_lab.py), as the fault
tests run it: the tiny model, a prefill node and a decode node, KV over the link (no shared
memory), and the helpers that ask it for completions and for what its replicas still hold."""

from __future__ import annotations

import time

import requests

from tests.harness.fixed_costs import REMOTE_PREFILL_SLO
from tests.harness.netns import Lab
from tests.harness.ray_lab import RayLab

ENGINE = {"num_threads": 1, "num_kv_blocks": 192, "block_size": 8, "max_model_len": 384, "max_num_seqs": 16,
          "max_num_batched_tokens": 512}
REQUEST_TIMEOUT_S = 20.0
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # prefilled remotely




def start_app(lab: Lab, model: str, env: dict[str, str] | None = None, **config) -> tuple[RayLab, object, str]:
    """Ray on the lab (a prefill and a decode node), the app deployed and serving: (cluster,
    driver, base URL). `config` adds to the app's config; `env` to every Ray process's."""
    cluster = RayLab(lab, {"prefill": {"pdserve_prefill": 1}, "decode": {"pdserve_decode": 1}}, env=env)
    try:
        driver = cluster.driver()
        http_port = 18000 + int(lab.tag) % 1000
        config = {"name": "lab", "model": model, "engine": ENGINE, "slo": REMOTE_PREFILL_SLO,
                  "prefill": {"ray_actor_options": {"num_cpus": 1, "resources": {"pdserve_prefill": 0.001}}},
                  "decode": {"ray_actor_options": {"num_cpus": 1, "resources": {"pdserve_decode": 0.001}}},
                  "transfer": {"shared_memory": False, "lease_s": 10},
                  "gateway": {"request_timeout_s": REQUEST_TIMEOUT_S}, **config}
        driver.call("deploy", config=config, http_port=http_port)
        base = f"http://{lab.head_ip}:{http_port}"
        wait_until_serving(base, 240)
        return cluster, driver, base
    except BaseException:
        cluster.close()
        raise


def complete(base: str, prompt: str, max_tokens: int = 8, timeout: float = REQUEST_TIMEOUT_S + 15, **extra):
    return requests.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0, **extra}, timeout=timeout)


def wait_until_serving(base: str, timeout_s: float) -> float:
    start = time.monotonic()
    while True:
        try:
            if complete(base, LONG_PROMPT, 2, timeout=30).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        assert time.monotonic() - start < timeout_s, f"not serving after {timeout_s} s"
        time.sleep(0.5)


def idle(driver, timeout_s: float = 40) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {pool: driver.call("stats", app="lab", pool=pool) for pool in ("Prefill", "Decode")}
        if all(holds_nothing(s) for s in stats.values()) or time.monotonic() > deadline:
            return stats


def holds_nothing(s: dict) -> bool:
    """A replica's accounting after its requests ended: no blocks, leases, reads, pulls, calls."""
    return (s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_unfinished_requests"] == 0
            and not s.get("num_kv_leases") and not s.get("num_open_kv_reads") and not s.get("num_open_kv_pulls")
            and not s.get("num_in_flight_requests"))
