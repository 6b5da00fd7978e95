"""Builds the Ray Serve application from a `ServeConfig` (DESIGN sections 2, 3 and 6).

Disaggregated: Gateway -> Decode -> Prefill (decode calls prefill for long uncached prompts and
pulls the KV). Colocated: Gateway -> Unified. `build_app` is the `import_path` target of
`serve run` / `serve deploy` and of the Helm chart; `serve_config` writes the YAML they take.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from pdserve.config import PoolConfig, ServeConfig


def resolve_model(config: ServeConfig) -> ServeConfig:
    """Fill in the default checkpoint (generated on first use) when no model is configured."""
    if config.model is not None:
        return config
    from pdserve.engine.checkpoint import default_model

    return config.model_copy(update={"model": str(default_model())})


def _pool_options(pool: PoolConfig) -> dict[str, Any]:
    return {"num_replicas": pool.num_replicas, "ray_actor_options": dict(pool.ray_actor_options),
            "max_ongoing_requests": pool.max_ongoing_requests, "max_queued_requests": pool.max_queued_requests}


def build(config: ServeConfig) -> Application:
    from pdserve.decode.deployment import Decode
    from pdserve.gateway.deployment import Gateway
    from pdserve.prefill.deployment import Prefill

    config = resolve_model(config)
    args = config.model_dump(mode="json")
    prefill = None
    if config.mode == "disaggregated":
        prefill = Prefill.options(**_pool_options(config.prefill)).bind(args)
        decode = Decode.options(name="Decode", **_pool_options(config.decode)).bind(args, prefill)
    else:
        decode = Decode.options(name="Unified", **_pool_options(config.decode)).bind(args)
    gw = config.gateway
    return Gateway.options(num_replicas=gw.num_replicas, ray_actor_options=dict(gw.ray_actor_options),
                           max_ongoing_requests=1000).bind(args, decode, prefill)


def build_app(args: dict[str, Any]) -> Application:
    """`serve run pdserve.app:build_app model=... mode=colocated` or the `args` of a Serve config."""
    return build(ServeConfig.model_validate(args))


def serve_config(config: ServeConfig) -> dict[str, Any]:
    """The Ray Serve config (what `serve deploy` and KubeRay's serveConfigV2 take) for this deployment."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": config.gateway.host, "port": config.gateway.port},
        "applications": [{"name": config.name, "route_prefix": "/", "import_path": "pdserve.app:build_app",
                          "args": config.model_dump(mode="json", exclude_defaults=True)}],
    }
