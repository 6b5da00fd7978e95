"""A Ray cluster across a network-namespace lab (tests/harness/netns.py): the head in the root
namespace, on the bridge's address, and one worker node per name in its own namespace, started
with `ray start --node-ip-address` there (ray.cluster_utils cannot put nodes on other links).
Every call between pools then crosses the lab's links. The cluster is driven from a separate
process (`Driver`, tests/harness/ray_driver.py): a test process may already hold another Ray.

Teardown kills the head's whole process group and everything in the lab's namespaces; it never
calls `ray stop`, which would stop every Ray on the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.harness.netns import Lab, Node

REPO = Path(__file__).parents[2]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayLab:
    def __init__(self, lab: Lab, workers: dict[str, dict], head_cpus: int = 1, worker_cpus: int = 2,
                 env: dict[str, str] | None = None):
        self.lab = lab
        # Namespaces share the host's identity: without these, KV would go through shared memory.
        # Ray's token auth, as the Helm chart runs it (and `ray start` turns it on when a token file exists).
        self.env = {**os.environ, "UCX_TLS": "tcp", "TOKENIZERS_PARALLELISM": "false", "RAY_worker_niceness": "0",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex, **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.temp_dir = tempfile.mkdtemp(prefix=f"pdlab{lab.tag}-")
        self.gcs_port = _free_port(lab.head_ip)
        self.address = f"{lab.head_ip}:{self.gcs_port}"
        # Serve's HTTP port, one for the cluster's life (its proxies outlive an app). From the kernel's
        # ephemeral range: a fixed port under 20000 can be held by one of Ray's workers (10002-19999).
        self.http_port = _free_port(lab.head_ip)
        ports = {flag: str(_free_port(lab.head_ip)) for flag in (
            "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
            "--runtime-env-agent-port", "--ray-client-server-port")}
        self.head = subprocess.Popen(
            ["ray", "start", "--head", "--block", "--node-ip-address", lab.head_ip, "--port", str(self.gcs_port),
             "--num-cpus", str(head_cpus), "--include-dashboard", "false", "--disable-usage-stats",
             "--temp-dir", self.temp_dir, *[x for kv in ports.items() for x in kv]],
            env=self.env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.nodes: dict[str, Node] = {}
        self._wait_for_gcs()
        for name, resources in workers.items():
            # One at a time: nodes of one machine share the session directory, and two raylets
            # starting at once race for its socket names. `ray start` returns once its node is up;
            # the node's processes stay in its namespace until the lab closes.
            node = self.nodes[name] = lab.add_node(name)
            subprocess.run(node.command(
                ["ray", "start", "--address", self.address, "--node-ip-address", node.ip, "--num-cpus",
                 str(worker_cpus), "--resources", json.dumps(resources), "--disable-usage-stats"]),
                env=self.env, check=True, capture_output=True, timeout=120)

    def _wait_for_gcs(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.lab.head_ip, self.gcs_port), timeout=1).close()
                return
            except OSError:
                if self.head.poll() is not None:
                    raise RuntimeError(f"the Ray head exited: {self.head.stderr.read().decode()[-2000:]}")
                time.sleep(0.3)
        raise TimeoutError("the Ray head's GCS never listened")

    def driver(self) -> "Driver":
        return Driver(self.address, self.env)

    def close(self) -> None:
        self.lab.close()  # the worker nodes and what runs in their namespaces
        try:
            os.killpg(self.head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.head.wait(30)
        # Ray's daemons of this cluster that left the head's process group: by their temp dir.
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if self.temp_dir.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(int(pid), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
        # Its session logs and sockets: every process that wrote them is gone now.
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class Driver:
    """A Ray driver in its own process, connected to the lab's cluster: one JSON command per line
    on its stdin, one JSON reply per line on its stdout (tests/harness/ray_driver.py)."""

    def __init__(self, address: str, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.harness.ray_driver", address], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, op: str, **args):
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the driver exited (rc {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
