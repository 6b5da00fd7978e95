"""What `pdserve simulate --config FILE` takes from a pdserve config.

In: a pdserve config file (the YAML `pdserve serve` takes). Out: a `Deployment`: each pool's
replicas and TP degree (colocated: no prefill pool), the accelerator its `ray_actor_options`'
`accelerator_type` names (where a profile of that name exists), the decode engine's block size,
step budget and sequence limit, whether the prefilling engine splits prompts to fill its steps,
the SLO, and where one policy sizes both pools against it (`ServeConfig.joint_autoscaling`) its
replica budget, each pool's bounds and the delay before a pool shrinks (the longer of the two,
as `app.serve_config` gives the policy). It does not load the model or start anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.simulate.hardware import PROFILES

# Ray's accelerator_type names back to the profiles (see plan.RAY_ACCELERATOR_TYPES).
_PROFILE_OF = {**{name: name for name in PROFILES}, "A100-80G": "A100", "A100-40G": "A100"}
# Engines need a model to build their config from; the simulator reads the model on its own.
_NO_MODEL = "unresolved"


@dataclass(frozen=True)
class Deployment:
    model: str | None
    prefill_replicas: int  # 0: colocated
    decode_replicas: int
    prefill_tp: int
    decode_tp: int
    prefill_accelerator: str | None  # None: the accelerator_type names no profile
    decode_accelerator: str | None
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_ongoing_requests: int  # the decode pool's
    split_prompts_to_fill_steps: bool  # the prefill pool's
    slo: tuple[float, float, float] | None  # (ttft_ms, itl_ms, percentile)
    # The joint autoscaling policy's (all None: the config has none)
    max_total_replicas: int | None
    prefill_bounds: tuple[int, int] | None = None  # (min_replicas, max_replicas)
    decode_bounds: tuple[int, int] | None = None
    downscale_delay_s: float | None = None


def read(path: str) -> Deployment:
    """`ValueError` naming every problem when the file is not a valid pdserve config."""
    from pdserve.config_check import load, parse
    from pdserve.errors import ConfigError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    data, problems = parse(text)
    if problems:
        raise ValueError("\n".join(f"{path}: {p}" for p in problems))
    try:
        config = load(data or {}, path)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    resolved = config if config.model else config.model_copy(update={"model": _NO_MODEL})
    prefill, decode = resolved.engine_config(config.prefill), resolved.engine_config(config.decode)
    colocated = config.mode == "colocated"

    def accelerator(pool) -> str | None:
        return _PROFILE_OF.get(str(pool.ray_actor_options.get("accelerator_type", "")))

    slo = None if config.slo is None else (config.slo.ttft_ms, config.slo.itl_ms, config.slo.percentile)
    joint = {"max_total_replicas": None}
    if config.joint_autoscaling:
        p, d = config.prefill.autoscaling, config.decode.autoscaling
        joint = {"max_total_replicas": config.max_total_replicas or p.max_replicas + d.max_replicas,
                 "prefill_bounds": (p.min_replicas, p.max_replicas), "decode_bounds": (d.min_replicas, d.max_replicas),
                 "downscale_delay_s": max(p.downscale_delay_s, d.downscale_delay_s)}
    return Deployment(model=config.model, prefill_replicas=0 if colocated else config.prefill.num_replicas,
                      decode_replicas=config.decode.num_replicas, prefill_tp=prefill.tensor_parallel_size,
                      decode_tp=decode.tensor_parallel_size, prefill_accelerator=accelerator(config.prefill),
                      decode_accelerator=accelerator(config.decode), block_size=decode.block_size,
                      max_num_batched_tokens=decode.max_num_batched_tokens, max_num_seqs=decode.max_num_seqs,
                      max_ongoing_requests=resolved.max_ongoing_requests(config.decode),
                      split_prompts_to_fill_steps=(decode if colocated else prefill).split_prompts_to_fill_steps,
                      slo=slo, **joint)
