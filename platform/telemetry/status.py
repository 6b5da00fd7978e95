"""What `pdserve status` shows: each engine replica publishes a status line (where it runs, queue,
KV usage, prefix hit rate, transfer rate) to Ray's internal key-value store, alongside its
metrics; the command reads those lines and Ray Serve's own deployment states.

`ReplicaReporter` is the replica's side: one daemon thread that, every period, takes the
replica's stats, publishes its metrics and rewrites its status line; `close` removes the line.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

import ray
from ray.experimental import internal_kv

from pdserve.telemetry.metrics import ReplicaMetrics

log = logging.getLogger(__name__)

KV_NAMESPACE = "pdserve"
_PREFIX = "status/"
STALE_AFTER_PERIODS = 3  # a line older than this many periods belongs to a replica that is gone


def _key(app: str, deployment: str, replica: str) -> str:
    return f"{_PREFIX}{app}/{deployment}/{replica}"


class ReplicaReporter:
    def __init__(self, app: str, deployment: str, replica: str, stats: Callable[[], dict],
                 metrics: ReplicaMetrics, period_s: float):
        self.key = _key(app, deployment, replica)
        self.stats, self.metrics, self.period_s = stats, metrics, period_s
        ctx = ray.get_runtime_context()
        self.where = {"app": app, "deployment": deployment, "replica": replica, "node_id": ctx.get_node_id(),
                      "node_ip": ray.util.get_node_ip_address(), "accelerators": ctx.get_accelerator_ids()}
        self._last: tuple[float, int] | None = None  # (time, bytes pulled) for the transfer rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.report()
            except Exception:  # noqa: BLE001 - a reporting hiccup must not stop the replica
                log.exception("could not publish this replica's metrics and status")
            if self._stop.wait(self.period_s):
                return

    def report(self) -> None:
        stats = self.stats()
        self.metrics.publish(stats)
        now, pulled = time.time(), stats.get("num_pulled_bytes", 0)
        rate = (pulled - self._last[1]) / (now - self._last[0]) if self._last and now > self._last[0] else 0.0
        self._last = (now, pulled)
        line = {**self.where, "time": now, "period_s": self.period_s, "transfer_bytes_per_s": rate,
                **{k: stats.get(k) for k in ("healthy", "num_waiting", "queued_prefill_tokens", "num_running",
                                             "kv_usage", "prefix_hit_rate", "num_kv_leases", "num_pulled_bytes",
                                             "num_resumed_requests")}}
        internal_kv._internal_kv_put(self.key, json.dumps(line), overwrite=True, namespace=KV_NAMESPACE)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            internal_kv._internal_kv_del(self.key, namespace=KV_NAMESPACE)
        except Exception:  # noqa: BLE001 - Ray may be going away too; the line then goes stale
            pass


def read_replica_lines(app: str | None = None) -> list[dict[str, Any]]:
    """Every live replica's status line (stale ones, of replicas that died, are skipped)."""
    prefix = _PREFIX + (f"{app}/" if app else "")
    now, lines = time.time(), []
    for key in internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:
            continue
        line = json.loads(raw)
        if now - line["time"] <= STALE_AFTER_PERIODS * line["period_s"]:
            lines.append(line)
    return sorted(lines, key=lambda x: (x["app"], x["deployment"], x["replica"]))


def collect_status(app: str | None = None) -> dict[str, Any]:
    """Applications -> deployments (Serve's state, replica counts) -> replicas (their lines), from a
    connected driver."""
    from ray import serve

    nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    lines = read_replica_lines(app)
    apps = {}
    for name, app_status in serve.status().applications.items():
        if app is not None and name != app:
            continue
        deployments = {}
        for dep, d in app_status.deployments.items():
            replicas = []
            for line in lines:
                if line["app"] == name and line["deployment"] == dep:
                    node = nodes.get(line["node_id"], {})
                    replicas.append({**line, "accelerator_type": _accelerator_type(node.get("Resources", {}))})
            deployments[dep] = {"status": state_name(d.status),
                                "replica_states": {state_name(k): v for k, v in d.replica_states.items()},
                                "replicas": replicas}
        apps[name] = {"status": state_name(app_status.status), "deployments": deployments}
    return {"applications": apps}


def state_name(state) -> str:
    """A Ray Serve status enum (or its string) as its name, e.g. "RUNNING"."""
    return str(getattr(state, "value", state))


def _accelerator_type(resources: dict[str, float]) -> str | None:
    types = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
    return ",".join(types) if types else None


def format_status(status: dict[str, Any]) -> str:
    """The table `pdserve status` prints."""
    out = []
    if not status["applications"]:
        return "no Ray Serve applications are running"
    for name, app in status["applications"].items():
        out.append(f"application {name}: {app['status']}")
        for dep, d in app["deployments"].items():
            states = ", ".join(f"{n} {s.lower()}" for s, n in d["replica_states"].items() if n) or "no replicas"
            out.append(f"  {dep}: {d['status']} ({states})")
            if d["replicas"]:
                out.append(f"    {'replica':<10} {'node':<16} {'accel':<8} {'waiting':>7} {'queued tok':>10} "
                           f"{'running':>7} {'kv used':>7} {'prefix hit':>10} {'pull MB/s':>9}")
            for r in d["replicas"]:
                accel = r["accelerator_type"] or ("gpu" if r["accelerators"].get("GPU") else "cpu")
                out.append(f"    {r['replica'][:10]:<10} {r['node_ip']:<16} {accel[:8]:<8} {r['num_waiting']:>7} "
                           f"{r['queued_prefill_tokens']:>10} {r['num_running']:>7} {r['kv_usage']:>7.1%} "
                           f"{r['prefix_hit_rate']:>10.1%} {r['transfer_bytes_per_s'] / 1e6:>9.2f}"
                           + ("" if r["healthy"] else "  UNHEALTHY"))
    return "\n".join(out)
