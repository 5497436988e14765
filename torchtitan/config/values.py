"""One option's value checked against the option's type, and parsed where it comes from the command line."""

import math
import types
import typing
from typing import Any, Literal

from torchtitan.config.options import type_name
from torchtitan.errors import UserError

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class _NotFinite(UserError):
    """nan or inf for a float option: the right type, so a union's other members are not tried."""


def _convert(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check (and, for command-line strings, parse) one value against the option's type."""

    def bad() -> UserError:
        return UserError(f"option {key}: {value!r} is not a valid value; expected {type_name(tp)}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(key, value, arg, from_cli)
            except _NotFinite:
                raise
            except UserError:
                continue
        raise bad()
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise UserError(f"option {key}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if key == "training.sources" and isinstance(value, list):
            value = [_source_entry(entry) if isinstance(entry, dict) else entry for entry in value]
        if from_cli or isinstance(value, str):
            value = [v.strip() for v in str(value).split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad()
        return [_convert(key, v, item_type, from_cli or isinstance(v, str) and item_type is not str) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE + _FALSE:
            return str(value).lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(str(value))
            except ValueError:
                pass
        raise bad()
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif from_cli:
            try:
                number = float(str(value))
            except ValueError:
                pass
        if number is None:
            raise bad()
        if not math.isfinite(number):
            # No option gives nan or inf a meaning (0 disables clipping), and they would fail far from the flag.
            raise _NotFinite(f"option {key}: {value!r} is not a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"option {key}: unhandled type {tp}")


def _source_entry(table: dict) -> str:
    """A [[training.sources]] table as the command line's `path:weight` entry."""
    if set(table) != {"path", "weight"} or not isinstance(table["path"], str) or isinstance(table["weight"], bool) \
            or not isinstance(table["weight"], (int, float)):
        raise UserError(f"option training.sources: {table!r} is not a table with a path (string) and a weight "
                        f"(number), e.g. [[training.sources]] path = \"a.jsonl\" weight = 0.7")
    return f"{table['path']}:{table['weight']}"
