"""The commented TOML template of a config model: every field, its default, description and limits.

``configs/node.toml`` is this function's output for the root config, committed; a test fails
when the two differ, so the file never drifts as sections grow. Fields whose default is unset
(None) appear commented out, since TOML has no null.
"""

from __future__ import annotations

import json
import textwrap
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

WIDTH = 92

HEADER = """\
# wanswarm node configuration: every setting, its default and what it does.
#
# Generated from the config models by `wanswarm config --defaults` (or
# `python -m wanswarm.node.config.node_config --dump-toml`); tests/unit/test_config.py fails
# when this file and the generator disagree, so edit the models' descriptions, not this file.
#
# Precedence, lowest first: defaults < this file (`wanswarm join --config FILE`)
#   < environment (WANSWARM__SECTION__KEY=value, e.g. WANSWARM__DHT__PORT=31337)
#   < flags (`--set section.key=value`, `--initial-peers`, `--state-dir`, `--dht-port`, ...).
# Copy the lines you change; everything left out keeps its default.
"""


def _as_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def toml_value(value: Any) -> str:
    """A TOML literal for the value types our configs use."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__} default {value!r}")


def _limits(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            parts.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"<= {item.le}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        parts.append("one of " + ", ".join(toml_value(a) for a in typing.get_args(annotation)))
    return f" [{', '.join(parts)}]" if parts else ""


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, WIDTH - 2)] or ["#"]


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _render(lines: list[str], path: list[str], model: type[BaseModel]) -> None:
    lines.append("")
    lines.extend(_comment(_first_paragraph(model.__doc__)))
    lines.append(f"[{'.'.join(path)}]")
    nested = []
    for name, field in model.model_fields.items():
        sub = _as_model(field.annotation)
        if sub is not None:
            nested.append((name, sub))
            continue
        lines.append("")
        lines.extend(_comment((field.description or "") + _limits(field)))
        default = field.get_default(call_default_factory=True)
        if default is None:
            lines.append(f"# {name} =   (unset)")
        else:
            lines.append(f"{name} = {toml_value(default)}")
    for name, sub in nested:
        _render(lines, [*path, name], sub)


def render_values(config: BaseModel) -> str:
    """The values of a config instance as plain TOML (``wanswarm config`` shows the effective
    one)."""
    lines: list[str] = []
    _render_values(lines, [], config)
    return "\n".join(lines).lstrip("\n") + "\n"


def _render_values(lines: list[str], path: list[str], model: BaseModel) -> None:
    nested = []
    if path:
        lines.extend(["", f"[{'.'.join(path)}]"])
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            nested.append((name, value))
        elif value is None:
            lines.append(f"# {name} =   (unset)")
        else:
            lines.append(f"{name} = {toml_value(value)}")
    for name, sub in nested:
        _render_values(lines, [*path, name], sub)


def render_template(root: type[BaseModel]) -> str:
    """The whole commented template: one [section] per sub-model, in declaration order."""
    lines = HEADER.rstrip("\n").split("\n")
    for name, field in root.model_fields.items():
        section = _as_model(field.annotation)
        if section is None:
            raise TypeError(f"root field {name} is not a section")
        _render(lines, [name], section)
    return "\n".join(lines) + "\n"
