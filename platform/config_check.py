"""`pdserve config validate`: checks a pdserve config and explains every problem.

In: a config's YAML text (or the parsed mapping). Out: the validated `ServeConfig` and no problems,
or a `Problem` per error: the field's dotted path, what is wrong, and what the field is for (its
description in config.py) or what to do. `summary` says in a few lines what a valid config runs.
Knows nothing of Ray or Kubernetes; the Helm chart embeds the same config (deploy/helm).
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.config import REMOVED_FIELDS, PoolConfig, ServeConfig
from pdserve.errors import ConfigError


@dataclass(frozen=True)
class Problem:
    path: str  # dotted field path, e.g. "prefill.autoscaling.min_replicas"; "" for the whole config
    message: str  # what is wrong
    hint: str  # what the field is for, or what to do

    def __str__(self) -> str:
        where = self.path or "(config)"
        return f"{where}: {self.message}" + (f"\n    {self.hint}" if self.hint else "")


def parse(text: str) -> tuple[Any, list[Problem]]:
    """YAML text -> data, or a problem saying where the YAML is broken."""
    try:
        return yaml.safe_load(text), []
    except yaml.YAMLError as e:
        return None, [Problem("", f"not valid YAML: {e}", "fix the syntax first (indentation, quotes, colons)")]


def check(data: Any) -> tuple[ServeConfig | None, list[Problem]]:
    """Validate `data` as a ServeConfig: (config, []) when valid, else (None, every problem found)."""
    if data is None:
        data = {}  # an empty file is the embedded default, as for `pdserve serve`
    if not isinstance(data, dict):
        return None, [Problem("", f"expected a mapping of pdserve config fields, got {type(data).__name__}",
                              "start from configs/tiny-cpu.yaml; fields: " + ", ".join(ServeConfig.model_fields))]
    # A removed field stops pydantic before the other fields are read: report it beside them.
    removed = [Problem(name, REMOVED_FIELDS[name], "") for name in data if name in REMOVED_FIELDS]
    try:
        config = ServeConfig.model_validate({k: v for k, v in data.items() if k not in REMOVED_FIELDS})
    except ValidationError as e:
        problems = [_problem(error) for error in e.errors()]
        # As pydantic's: the checks across fields count once every field is fine, and a removed one is not.
        return None, removed + [p for p in problems if p.path or not removed]
    return (None, removed) if removed else (config, [])


def _problem(error: dict) -> Problem:
    loc = tuple(str(part) for part in error["loc"])
    path = ".".join(loc)
    owner, field = _walk(ServeConfig, loc)
    if error["type"] == "extra_forbidden":
        known = list(owner.model_fields) if owner else []
        # A field of that name below this place, else anywhere (e.g. `model` under an engine).
        elsewhere = owner and (_field_below(owner, loc[-1], ".".join(loc[:-1])) or _field_below(ServeConfig, loc[-1]))
        if elsewhere:
            where, field = elsewhere
            target = repr(where) if "." in where else f"the top-level {where!r}"
            return Problem(path, f"unknown field {loc[-1]!r} (did you mean {target}?)", field.description or "")
        close = difflib.get_close_matches(loc[-1], known, n=1)
        message = f"unknown field {loc[-1]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        return Problem(path, message, f"fields here: {', '.join(known)}" if known else "")
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    if error["type"] != "value_error" and isinstance(value, (str, int, float, bool)):
        message += f" (got {value!r})"
    if field is not None and field.description:
        hint = field.description
    elif field is not None and owner is not None and owner.__doc__:  # a field without a description
        hint = " ".join(owner.__doc__.split("\n\n")[0].split())
    else:
        hint = ""  # a check across fields: its message says what to change
    return Problem(path, message, hint)


def _walk(model: type[BaseModel], loc: tuple[str, ...]):
    """The model holding loc's last field, and that field's info (None where loc leaves the models)."""
    owner, field = model, None
    for i, key in enumerate(loc):
        if owner is None or key not in owner.model_fields:
            return (owner if i == len(loc) - 1 else None), None
        field = owner.model_fields[key]
        if i < len(loc) - 1:
            owner = _model_of(field.annotation)
    return owner, field


def _field_below(model: type[BaseModel], name: str, prefix: str = "") -> tuple[str, Any] | None:
    """The shallowest path of a field called `name` in `model` (at `prefix`) and its info: where a
    field written in the wrong place belongs."""
    todo = [(prefix, model)]
    while todo:
        at, model = todo.pop(0)
        for key, field in model.model_fields.items():
            if key == name:
                return ".".join(filter(None, (at, key))), field
            if (inner := _model_of(field.annotation)) is not None:
                todo.append((".".join(filter(None, (at, key))), inner))
    return None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `PoolConfig` or `AutoscalingSpec | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(filter(None, map(_model_of, typing.get_args(annotation))), None)
    return None


def summary(config: ServeConfig) -> list[str]:
    """What a valid config runs: model and mode, each pool's replicas and resources, gateway, router."""
    lines = [f"model     {config.model or 'tiny-llama (generated on first use)'}, {config.mode}"]
    pools = [("prefill", config.prefill), ("decode", config.decode)]
    if config.mode == "colocated":
        pools = [("unified", config.decode)]
    for name, pool in pools:
        lines.append(f"{name:<9} {_pool_line(config, pool)}")
    gw = config.gateway
    keys = f"{len(gw.api_keys)} API key(s)" if gw.api_keys else "no API keys"
    lines.append(f"gateway   {gw.host}:{gw.port}, {gw.num_replicas} replica(s), {keys}")
    events = config.router.redis_url or "no redis_url (`pdserve serve` starts a private redis-server if installed)"
    transfer = f"; KV transfer: {config.transfer.backend}" if config.mode == "disaggregated" else ""
    lines.append(f"router    KV events: {events}{transfer}")
    return lines


def _pool_line(config: ServeConfig, pool: PoolConfig) -> str:
    engine = config.model_copy(update={"model": config.model or "-"}).engine_config(pool)
    ranks = engine.tensor_parallel_size
    scaling = pool.autoscaling
    count = f"{pool.num_replicas} replica(s)"
    if scaling is not None:
        count += f" (autoscaling {scaling.min_replicas}-{scaling.max_replicas})"
    parallel = f"TP {ranks}" + (" + EP" if engine.enable_expert_parallel else "")
    options = pool.ray_actor_options
    need = [f"{options.get('num_cpus', 1) * ranks:g} CPU"]
    if options.get("num_gpus"):
        need.append(f"{options['num_gpus'] * ranks:g} GPU")
    if options.get("accelerator_type"):
        need.append(str(options["accelerator_type"]))
    need += [f"{amount:g} {name}" for name, amount in (options.get("resources") or {}).items()]
    return f"{count}, {parallel}, per replica: {', '.join(need)}"


def load(data: Any, source: str = "config") -> ServeConfig:
    """`data` as a ServeConfig, or `ConfigError` explaining every problem: what every entry point
    (`pdserve serve`, `serve-config`, `build_app` under `serve run` and KubeRay) raises."""
    config, problems = check(data)
    if problems:
        raise ConfigError(_report(source, problems))
    return config


def _report(source: str, problems: list[Problem]) -> str:
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return "\n".join([f"{source}: {count}", *(f"  {p}".replace("\n", "\n  ") for p in problems)])


def validate_text(text: str, source: str = "config") -> tuple[bool, str]:
    """The whole report `pdserve config validate` prints for one file: (is_valid, text)."""
    data, problems = parse(text)
    config = None
    if not problems:
        config, problems = check(data)
    if problems:
        return False, _report(source, problems)
    return True, "\n".join([f"{source}: valid", *(f"  {line}" for line in summary(config))])
