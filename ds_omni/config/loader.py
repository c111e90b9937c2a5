"""The strict file loader: JSON into the typed config, "a.b.c=value" overrides on top.

Unknown keys are an error that lists them and the valid ones, a value of the wrong type an error
that names the field, a missing required key an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from ds_omni.config.omni import OmniConfig
from ds_omni.errors import ConfigError


def load_config(path: str | Path, overrides: list[str] | None = None) -> OmniConfig:
    """Read an `OmniConfig` from a JSON file; `overrides` are "a.b.c=value" strings (JSON values)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass --config with a JSON file "
                          "such as examples/tiny_llava.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    for item in overrides or []:
        _apply_override(data, item)
    return from_dict(OmniConfig, data)


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass `cls` from plain data, rejecting unknown keys and wrongly typed values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'config'}; "
                          f"valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"{where or 'config'} is missing required key(s) {missing}") from e


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _coerce(tp: Any, value: Any, where: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(typing.get_args(tp), value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be an object, got {value!r}")
        return value
    if tp is Any:
        return value
    return _coerce_scalar(tp, value, where)


def _coerce_union(options: tuple, value: Any, where: str):
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where} must not be null")
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce(option, value, where)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(" or ".join(errors))


def _coerce_scalar(tp: type, value: Any, where: str):
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{where} must be {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value
