"""The README's main command: `pdserve serve CONFIG` starts its own Ray, deploys through Ray
Serve's config path (as `serve deploy` and KubeRay do), answers the OpenAI API, and stops cleanly
on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import yaml

from ..conftest import free_port


def _descendants(pid: int) -> list[tuple[str, int]]:
    """(command name, nice value) of every process under `pid`, from /proc."""
    children: dict[int, list[tuple[int, str, int]]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read() if entry.isdigit() else ""
        except OSError:  # gone meanwhile
            continue
        if stat:
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ... priority, nice
            children.setdefault(int(fields[1]), []).append(
                (int(entry), stat[stat.index("(") + 1:stat.rindex(")")], int(fields[16])))
    found, todo = [], [pid]
    while todo:
        for child, comm, nice in children.get(todo.pop(), []):
            found.append((comm, nice))
            todo.append(child)
    return found


def test_pdserve_serve_answers_and_stops(tiny_llama, tmp_path):
    port = free_port()
    config = {"model": tiny_llama, "mode": "colocated",
              "engine": {"num_threads": 1, "num_kv_blocks": 64, "max_model_len": 256},
              "decode": {"ray_actor_options": {"num_cpus": 1}}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own Ray, not the test session's
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", str(path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops it" in line for line in lines):  # the end of the banner
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "pdserve serve exited:\n" + "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "pdserve serve did not come up:\n" + "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = client.models.list().data
        r = client.completions.create(model=model.id, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        # Its Ray runs the replicas at nice 0, as its daemons, not at Ray's default of 15.
        replicas = [(comm, nice) for comm, nice in _descendants(proc.pid) if comm.startswith("ray::ServeRepl")]
        assert replicas and all(nice == 0 for _, nice in replicas), replicas
        # The banner's metrics line points at Ray's Prometheus export, where the request shows up.
        [metrics_url] = re.findall(r"metrics: +(http://\S+/metrics)", "".join(lines))
        deadline = time.monotonic() + 90
        while 'outcome="ok"' not in "".join(
                line for line in urllib.request.urlopen(metrics_url, timeout=10).read().decode().splitlines()
                if line.startswith("ray_pdserve_requests_total")):
            assert time.monotonic() < deadline, "the request never showed in the metrics export"
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + out
        assert "shutting down" in out
    finally:
        if proc.poll() is None:  # a failed check: stop it as a user would, so its Ray and HAProxy go too
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
