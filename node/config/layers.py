"""Building a config tree from layers: defaults < TOML file < environment < flags.

Generic over the root model (config.NodeConfig for the daemon, sections.ClientConfig for the
CLI's client commands). Values from the environment (``WANSWARM__SECTION__KEY``, ``__``
separating nesting levels) and from ``--set section.key=value`` are strings: for string and
path fields they are taken as they are, for list fields either a TOML array or a
comma-separated list, otherwise they are read as TOML literals (``70000``, ``true``, ``2.5``).

Every error becomes one :class:`~wanswarm.node.errors.ConfigError` line naming the field, what
is allowed and where the bad value came from, e.g.
``dht.port: must be ≤ 65535 (got 70000) [from WANSWARM__DHT__PORT]``.
"""

from __future__ import annotations

import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError

ENV_PREFIX = "WANSWARM__"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Override:
    """One value set above the file: ``path`` is dotted (``dht.port``), ``source`` is for errors.

    ``raw`` values are strings typed by the user (environment, ``--set``) and are converted by
    the target field's type; other values (from typed CLI flags) are used as they are.
    """

    path: str
    value: Any
    source: str
    raw: bool = True


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """$STATE_DIRECTORY (first entry), else $XDG_DATA_HOME/wanswarm, else
    ~/.local/share/wanswarm."""
    if environ.get("STATE_DIRECTORY"):
        # systemd passes a colon-separated list when the unit names several directories
        return Path(environ["STATE_DIRECTORY"].split(":")[0])
    if environ.get("XDG_DATA_HOME"):
        return Path(environ["XDG_DATA_HOME"]) / "wanswarm"
    home = environ.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "wanswarm"


def env_overrides(environ: Mapping[str, str]) -> list[Override]:
    """``WANSWARM__SECTION__KEY=value`` variables as overrides, in a stable order."""
    out = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            path = ".".join(part.lower() for part in name[len(ENV_PREFIX) :].split("__"))
            out.append(Override(path, environ[name], name))
    return out


def parse_assignment(text: str, source: str = "--set") -> Override:
    """``section.key=value`` (from ``--set``) as an override."""
    path, sep, value = text.partition("=")
    path = path.strip()
    if not sep or not path or not all(path.split(".")):
        raise ConfigError(f"{source} {text!r}: expected section.key=value, e.g. dht.port=31337")
    return Override(path, value, f"{source} {path}")


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{file}: cannot read config file: {reason}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: invalid TOML: {exc}") from None


def _merge(
    into: dict[str, Any],
    new: Mapping[str, Any],
    provenance: dict[str, str],
    source: str,
    prefix: tuple[str, ...],
) -> None:
    for key, value in new.items():
        path = (*prefix, key)
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value, provenance, source, path)
        elif isinstance(value, Mapping):
            into[key] = {}
            _merge(into[key], value, provenance, source, path)
        else:
            into[key] = value
            provenance[".".join(path)] = source


def _set_path(tree: dict[str, Any], parts: list[str], value: Any, source: str) -> None:
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"{'.'.join(parts[: depth + 1])}: is a value, not a section, so {'.'.join(parts)} "
                f"cannot be set [from {source}]"
            )
        node = child
    node[parts[-1]] = value


def _field_annotation(root: type[BaseModel], parts: list[str]) -> Any:
    """The annotation of the field at ``parts`` in ``root``, or None when there is none."""
    model: Any = root
    annotation: Any = None
    for part in parts:
        if (
            not (isinstance(model, type) and issubclass(model, BaseModel))
            or part not in model.model_fields
        ):
            return None
        annotation = model.model_fields[part].annotation
        model = annotation
    return annotation


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _coerce(root: type[BaseModel], raw: str, parts: list[str]) -> Any:
    """Turn a user-typed string into a value for the field at ``parts`` (see module docstring)."""
    annotation, optional = _strip_optional(_field_annotation(root, parts))
    if optional and raw.strip() in ("", "none", "null"):
        return None
    if annotation in (str, Path):
        return raw
    if typing.get_origin(annotation) in (list, tuple) and not raw.lstrip().startswith("["):
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _allowed_keys(root: type[BaseModel], parts: Sequence[str | int]) -> list[str]:
    model: Any = root
    for part in parts:
        is_model = isinstance(model, type) and issubclass(model, BaseModel)
        field = model.model_fields.get(str(part)) if is_model else None
        if field is None:
            return []
        model = field.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _describe_one(root: type[BaseModel], error: Mapping[str, Any]) -> tuple[str, str]:
    loc = [p for p in error["loc"] if isinstance(p, str | int)]
    # list items show up as tuple indices; keep the field name only
    field_parts = [p for p in loc if isinstance(p, str)]
    field = ".".join(field_parts) or "config"
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(root, field_parts[:-1])
        what = "section" if len(field_parts) == 1 else "key"
        return field, f"unknown {what}; allowed: {', '.join(allowed)}"
    bounds = {
        "less_than_equal": ("≤", "le"),
        "less_than": ("<", "lt"),
        "greater_than_equal": ("≥", "ge"),
        "greater_than": (">", "gt"),
    }
    if kind in bounds:
        symbol, key = bounds[kind]
        text = f"must be {symbol} {ctx.get(key)}"
    elif kind == "literal_error":
        text = f"must be one of {ctx.get('expected')}"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        text = "must be an integer"
    elif kind in ("float_type", "float_parsing", "finite_number"):
        text = "must be a finite number"
    elif kind in ("bool_type", "bool_parsing"):
        text = "must be true or false"
    elif kind == "string_type":
        text = "must be a string"
    elif kind in ("list_type", "tuple_type"):
        text = "must be a list"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        text = "must be a table (a [section])"
    elif kind == "string_pattern_mismatch":
        text = f"must match {ctx.get('pattern')}"
    elif kind == "value_error":
        # our validators write complete sentences (they already quote the bad value)
        return field, str(error["msg"]).removeprefix("Value error, ")
    else:
        text = str(error["msg"])
        text = text[:1].lower() + text[1:]
    return field, f"{text} (got {got!r})"


def describe_validation_error(
    exc: ValidationError,
    provenance: Mapping[str, str] | None = None,
    root: type[BaseModel] | None = None,
) -> str:
    """One line for all errors of ``exc``: ``field: problem [from source]; ...``."""
    provenance = provenance or {}
    parts = []
    for error in exc.errors():
        field, text = _describe_one(root if root is not None else BaseModel, error)
        source = provenance.get(field)
        parts.append(f"{field}: {text}" + (f" [from {source}]" if source else ""))
    return "; ".join(parts)




def build(
    model: type[M],
    *,
    file: Path | None,
    environ: Mapping[str, str],
    overrides: Sequence[Override] = (),
) -> M:
    """Validate ``model`` from the file, then the environment, then the overrides (see the
    module docstring)."""
    tree: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    if file is not None:
        _merge(tree, _read_toml(file), provenance, str(file), ())
    for override in [*env_overrides(environ), *overrides]:
        parts = override.path.split(".")
        raw = override.raw and isinstance(override.value, str)
        value = _coerce(model, override.value, parts) if raw else override.value
        _set_path(tree, parts, value, override.source)
        provenance[override.path] = override.source
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, provenance, model)) from None
