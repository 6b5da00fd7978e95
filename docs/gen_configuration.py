"""Writes docs/configuration.md: every field of a pdserve config (platform/config.py), section by
section, with its type, default, bounds and description, from the pydantic models themselves. A
test fails when the file is stale:

    python docs/gen_configuration.py
"""

from __future__ import annotations

import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pdserve.config import EngineConfig, EngineOverrides, ServeConfig

OUT = Path(__file__).with_name("configuration.md")
INTRO = """# Configuration reference

One file configures a deployment: `pdserve serve FILE`, `pdserve serve-config FILE` and the Helm
chart's `config` all take it (`configs/*.yaml` are examples). `pdserve config validate FILE`
explains every problem at once. Generated from `platform/config.py` by
`docs/gen_configuration.py`; do not edit by hand.
"""


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(f"`{a!r}`".replace("'", '"') for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if annotation is EngineOverrides:  # EngineConfig's fields, each optional: described once, there
        return "[EngineConfig](#engineconfig) fields"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, EngineOverrides):
        return "none"
    if isinstance(value, BaseModel):
        return "its defaults"
    return f"`{value!r}`".replace("'", '"') if value is not None else "null"


def _bounds(field: FieldInfo) -> str:
    names = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "pattern": "matches"}
    found = []
    for meta in field.metadata:
        for attr, sign in names.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} `{value}`")
    return ", ".join(found)


def _models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """root and every model its fields hold, in the order they first appear."""
    seen: list[type[BaseModel]] = []

    def visit(model):
        if model in seen:
            return
        seen.append(model)
        for field in model.model_fields.values():
            stack = [field.annotation]
            while stack:
                t = stack.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    visit(t)
                stack.extend(typing.get_args(t))

    visit(root)
    return seen


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    parts = [INTRO]
    models = [m for m in _models(ServeConfig) if m is not EngineOverrides] + [EngineConfig]
    for model in models:
        doc = " ".join((model.__doc__ or "").split())
        parts.append(f"\n## {model.__name__}\n\n{doc}\n" if doc else f"\n## {model.__name__}\n")
        if model is EngineConfig:
            parts.append("\nIn a config, every field but `model` (the config's own) may be set in the top-level "
                         "`engine`, for every pool, and in a pool's `prefill.engine` or `decode.engine`, over the "
                         "top-level's; a field set in neither takes the default below.\n")
        parts.append("\n| field | type | default | bounds | description |\n|---|---|---|---|---|\n")
        for name, field in model.model_fields.items():
            parts.append(f"| `{name}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} "
                         f"| {_cell(_bounds(field))} | {_cell(field.description or '')} |\n")
    return "".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
