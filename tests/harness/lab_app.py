"""The disaggregated app on a namespace lab (tests/harness/netns.py, ray_lab.py), as the fault
tests run it: the tiny model, a prefill node and a decode node, KV over the link (no shared
memory), and the helpers that ask it for completions and for what its replicas still hold.

Building the lab and Ray on it takes 12 s on an idle 2-core machine (more under load), so the fault
tests' modules share one (`LabCluster`, tests/e2e/conftest.py) and deploy their apps on it in turn:
each app is deleted, its replicas gone, and the lab's faults undone before the next is deployed."""

from __future__ import annotations

import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests

from pdserve.router.redis_server import LocalRedis
from tests.harness.fixed_costs import REMOTE_PREFILL_SLO
from tests.harness.netns import Lab, Node
from tests.harness.ray_lab import Driver, RayLab
from tests.harness.waiting import wait_until

ENGINE = {"num_threads": 1, "num_kv_blocks": 192, "block_size": 8, "max_model_len": 384, "max_num_seqs": 16,
          "max_num_batched_tokens": 512}
REQUEST_TIMEOUT_S = 20.0
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # prefilled remotely
APP = "lab"


class LabCluster:
    """A lab with Ray on it (a prefill and a decode node) and the KV-event stream's Redis on the
    head's address (every node reaches it over the bridge). Off loopback Redis wants a password: it
    reaches every Ray process as the chart passes it (PDSERVE_REDIS_PASSWORD), and an app without
    `router.redis_url` never reads it."""

    def __init__(self):
        self.lab = Lab()
        self.redis = self.cluster = self.driver = None
        try:
            self.redis = LocalRedis(host=self.lab.head_ip, password=uuid.uuid4().hex).start()
            self.cluster = RayLab(self.lab, {"prefill": {"pdserve_prefill": 1}, "decode": {"pdserve_decode": 1}},
                                  env={"PDSERVE_REDIS_PASSWORD": self.redis.password})
            self.driver = self.cluster.driver()
        except BaseException:
            self.close()
            raise

    @contextmanager
    def app(self, model: str, **config) -> Iterator[tuple[RayLab, Driver, str]]:
        """The app deployed and serving for the block: (cluster, driver, base URL). After it, the app
        deleted, its replicas gone, the links without faults and Redis empty: the next app starts as
        on a new lab."""
        try:
            yield self.cluster, self.driver, deploy(self.cluster, self.driver, model, **config)
        finally:
            try:
                undeploy(self.cluster, self.driver)
            finally:
                self.lab.reset()
                self.redis.stop()  # a test may have stopped or restarted it
                self.redis.start()

    def close(self) -> None:
        """Everything it started, whatever got started (idempotent)."""
        if self.driver is not None:
            self.driver.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.redis is not None:
            self.redis.stop()
        self.lab.close()
        self.driver = self.cluster = self.redis = None


def deploy(cluster: RayLab, driver: Driver, model: str, **config) -> str:
    """The app deployed on the lab's cluster and serving: its base URL. `config` adds to the app's config."""
    config = {"name": APP, "model": model, "engine": ENGINE, "slo": REMOTE_PREFILL_SLO,
              "prefill": {"ray_actor_options": {"num_cpus": 1, "resources": {"pdserve_prefill": 0.001}}},
              "decode": {"ray_actor_options": {"num_cpus": 1, "resources": {"pdserve_decode": 0.001}}},
              "transfer": {"shared_memory": False, "lease_s": 10},
              "gateway": {"request_timeout_s": REQUEST_TIMEOUT_S}, **config}
    driver.call("deploy", config=config, http_port=cluster.http_port)
    base = f"http://{cluster.lab.head_ip}:{cluster.http_port}"
    wait_until_serving(base, 240)
    return base


def undeploy(cluster: RayLab, driver: Driver, timeout_s: float = 60) -> None:
    """Delete the app; return once its replicas' processes have exited too (tests find replicas by
    process: the next app's would be counted with a dying one)."""
    driver.call("delete", app=APP)
    wait_until(lambda: not any(replica_pids(node) for node in cluster.nodes.values()), timeout_s,
               "the deleted app's replicas exiting", poll_s=0.2)


def replica_pids(node: Node, deployment: str = "") -> list[int]:
    """PIDs of the app's Serve replicas (of `deployment` only, when given) running in `node`'s namespace."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split():
        try:
            if f"ServeReplica:{APP}:{deployment}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # it ended meanwhile
            continue
    return found


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
