"""Builds the Ray Serve application from a `ServeConfig` (DESIGN sections 2, 3 and 6): the builder.

Disaggregated: Gateway -> Decode -> Prefill (decode calls prefill for long uncached prompts and
pulls the KV). Colocated: Gateway -> Unified. `build_app` is the `import_path` target of
`serve run` / `serve deploy` and of the Helm chart; `serve_config` writes the YAML they take.
Starting Ray and serving from the command line is `pdserve.launch`'s.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any


from pdserve.config import AutoscalingSpec, PoolConfig, ServeConfig
from pdserve.errors import ConfigError

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
# that a 2-core machine takes from the engine. The first two keep a replica's user code and its
# handles' router on Serve's own loop (measured: about a fifth less gateway CPU per token).
# And glibc's malloc keeps at most two arenas (its default: up to 8 per core, one for each thread that
# contends): a replica's threads (Ray's, the engine loop's, the event loop's, the gateway's
# tokenizer pool's) allocate and free by turns, and with an arena each the freed memory stayed
# scattered over them. Measured by benchmarks/soak.py on the tiny app (RESULTS.md, #42), with
# no Python object and nothing in the replicas' accounting growing (tracemalloc, replica stats):
# the decode replica's RSS grew 12-13 MiB per 10,000 requests, 2.2-2.8 with two arenas; the
# gateway's, with a decode replica killed every 2,000 requests, 13 MiB per 10,000 (malloc's free
# memory 21 -> 47 MiB, what it had in use flat at 138), 0.8 with two arenas over 40,000 requests.
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "MALLOC_ARENA_MAX": "2"}
# Engine replicas let an idle OpenMP thread spin for 2,000 rounds (tens of microseconds) before it
# sleeps, instead of libgomp's default 300,000: long enough to bridge the gaps between a prefill
# step's parallel regions (one per kernel), short enough that between steps the core goes back to
# the gateway and Serve. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) made every region a futex
# wake-up: when decode steps were OpenMP regions too, the engine alone took 9.2 ms against 6.0 ms
# per batch-1 step. (Decode steps now run on the decoder's own threads: cpu_decoder_threads.c.)
ENGINE_ENV = {**SERVE_ENV, "GOMP_SPINCOUNT": "2000"}


def with_env(ray_actor_options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """`ray_actor_options` with `env` under the env_vars it sets itself (those win)."""
    runtime_env = dict(ray_actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    return {**ray_actor_options, "runtime_env": runtime_env}


PREFIX_AWARE_ROUTER = "pdserve.router.request_router:PrefixAwareRouter"
KV_HEADROOM_ROUTER = "pdserve.router.request_router:KVHeadroomRouter"


def _pool_options(config: ServeConfig, pool: PoolConfig, deployment: str, default_router: str) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    from pdserve.router.kv_events import stream_name

    router = config.router
    kwargs = {"redis_url": router.redis_url, "redis_password_env": router.redis_password_env,
              "stream": stream_name(config.name, deployment),
              "block_size": config.engine_config(pool).block_size, "queue_weight": router.queue_weight,
              "approx_ttl_s": router.approx_ttl_s, "pool": deployment.lower(), "model": config.served_model_name}
    # Under an SLO the pools clients wait on take requests past its TTFT target last. Not the
    # prefill pool: a prompt waiting there holds its request's place on a decode replica, and in
    # the simulator prefill replicas taking their queued prompts that way lowered attainment
    # (a 4x step at 100 replicas: 0.917, against 0.926 without).
    if config.slo is not None and deployment != "Prefill":
        kwargs["ttft_s"] = config.slo.ttft_ms / 1000
    options = {}
    ranks = config.engine_config(pool).tensor_parallel_size
    if ranks > 1:  # the replica and its rank workers: one bundle each, packed (DESIGN section 3)
        from pdserve.replica.rank_workers import rank_bundles

        options = {"placement_group_bundles": rank_bundles(pool.ray_actor_options, ranks),
                   "placement_group_strategy": "PACK"}
    if pool.autoscaling is not None:
        spec = pool.autoscaling
        if config.joint_autoscaling:
            # JointSloPolicy waits downscale_delay_s itself, then steps down one decision and holds
            # again: Serve waiting too (it applies each deployment's delays to an application
            # policy's decisions) would restart its wait on every held tick, and never shrink a pool.
            spec = spec.model_copy(update={"downscale_delay_s": 0.0})
        options["autoscaling_config"] = _autoscaling_config(spec, pool.num_replicas, deployment)
    else:
        options["num_replicas"] = pool.num_replicas
    return {**options, "name": deployment,
            "ray_actor_options": with_env(pool.ray_actor_options, ENGINE_ENV),
            "max_ongoing_requests": config.max_ongoing_requests(pool), "max_queued_requests": pool.max_queued_requests,
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
        decode_options = _pool_options(config, config.decode, "Decode", KV_HEADROOM_ROUTER)
        decode = Decode.options(**decode_options).bind(args, prefill)
    else:
        decode = Decode.options(**_pool_options(config, config.decode, "Unified", PREFIX_AWARE_ROUTER)).bind(args)
    gw = config.gateway
    return Gateway.options(num_replicas=gw.num_replicas, max_ongoing_requests=1000,
                           ray_actor_options=with_env(gw.ray_actor_options, SERVE_ENV)).bind(args, decode, prefill)


def build_app(args: dict[str, Any]) -> "Application":
    """`serve run pdserve.app:build_app model=... mode=colocated engine.max_num_seqs=8` (a dotted
    key names a nested field) or the `args` of a Serve config. A config with problems raises a
    `ConfigError` explaining each, which Ray Serve shows as it is."""
    from pdserve.config_check import load

    try:
        config = load(_undotted(args), "the application's args")
    except ConfigError as e:
        raise serve_config_error()(str(e)) from None
    return build(config)


def _undotted(args: Any) -> Any:
    """`{"engine.max_num_seqs": "8"}` as `{"engine": {"max_num_seqs": "8"}}` (`serve run` passes
    flat key=value strings); a dotted key whose parent is not a mapping stays as it is (and is
    reported as an unknown field)."""
    if not isinstance(args, dict):
        return args
    nested = copy.deepcopy({k: v for k, v in args.items() if not (isinstance(k, str) and "." in k)})
    for key, value in args.items():
        if not (isinstance(key, str) and "." in key):
            continue
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                nested[key] = value
                break
        else:
            node[leaf] = value
    return nested


@functools.cache
def serve_config_error() -> type[ConfigError]:
    """A ConfigError that Ray Serve prints as its message alone, without a traceback: `serve run`
    (a click command) prints a ClickException as `Error: <message>`, and a deploy from a Serve
    config (`serve deploy`, KubeRay, `pdserve serve`) makes a RayServeException the application's
    status message as it is, where any other error becomes its traceback. Made on first use, so
    importing this module imports no Ray."""
    import click
    from ray.serve.exceptions import RayServeException

    return type("ServeConfigError", (ConfigError, RayServeException, click.ClickException),
                {"__module__": __name__, "__doc__": ConfigError.__doc__})


def serve_config(config: ServeConfig) -> dict[str, Any]:
    """The Ray Serve config (what `serve deploy` and KubeRay's serveConfigV2 take) for this deployment."""
    app = {"name": config.name, "route_prefix": "/", "import_path": "pdserve.app:build_app",
           "args": config.model_dump(mode="json", exclude_defaults=True)}
    if config.joint_autoscaling:  # an application-level policy: only a config can set one
        prefill, decode = config.prefill.autoscaling, config.decode.autoscaling
        app["autoscaling_policy"] = {
            "policy_function": "pdserve.autoscale.policies:JointSloPolicy",
            "policy_kwargs": {"ttft_ms": config.slo.ttft_ms, "itl_ms": config.slo.itl_ms,
                              "percentile": config.slo.percentile,
                              "max_total_replicas": config.max_total_replicas or prefill.max_replicas + decode.max_replicas,
                              "downscale_delay_s": max(prefill.downscale_delay_s, decode.downscale_delay_s),
                              # (its sequence slots: the decode pool's occupancy)
                              "max_num_seqs": config.engine_config(config.decode, unresolved_ok=True).max_num_seqs}}
    elif config.pool_ratio is not None:
        ratio = config.pool_ratio
        app["autoscaling_policy"] = {
            "policy_function": "pdserve.autoscale.policies:PoolRatioPolicy",
            "policy_kwargs": {"prefill": _policy_kwargs(config.prefill.autoscaling, "Prefill"),
                              "decode": _policy_kwargs(config.decode.autoscaling, "Decode"),
                              "min_ratio": ratio.min_prefill_per_decode, "max_ratio": ratio.max_prefill_per_decode}}
    return {"proxy_location": "EveryNode", "http_options": {"host": config.gateway.host, "port": config.gateway.port},
            "applications": [app]}


def load_config(path: str | None, **overrides: Any) -> ServeConfig:
    """A YAML file (or the embedded default) with `gateway` fields overridden, e.g. host and port;
    `ConfigError` explaining every problem (as `pdserve config validate`) when it has any."""
    from pdserve.config_check import load, parse

    try:
        text = Path(path).read_text(encoding="utf-8") if path else ""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    data, problems = parse(text)
    data = {} if data is None else data  # an empty file: the embedded default
    if problems:
        raise ConfigError("\n".join(f"{path}: {p}" for p in problems))
    if isinstance(data, dict) and isinstance(data.get("gateway", {}), dict):
        gateway = {**data.get("gateway", {}), **{k: v for k, v in overrides.items() if v is not None}}
        data = {**data, "gateway": gateway}
    return load(data, path or "the default config")


def grpc_options(port: int) -> dict[str, Any]:
    """What `serve.start(grpc_options=...)` takes to serve pdserve.proto's `Generation` on `port`."""
    return {"port": port,
            "grpc_servicer_functions": ["pdserve.gateway.pdserve_pb2_grpc.add_GenerationServicer_to_server"]}
