"""The options: every leaf of the config dataclasses as a `section.option` key with its type, default and the
docstring written under it, and a config's value by key."""

import ast
import dataclasses
import functools
import inspect
import sys
import types
import typing
from typing import Any, Literal

from torchtitan.config import job_config as job_config_module
from torchtitan.config.job_config import METHOD_REGISTRIES, JobConfig, MethodTables, method_options


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One leaf option: its dotted key, type, default and help text."""

    key: str
    type: Any
    default: Any
    doc: str


@functools.cache
def _field_docs() -> dict[str, dict[str, str]]:
    """Map class name -> option -> the docstring written under it in job_config.py, and in the modules that declare
    the methods' tables."""
    sources = {job_config_module.__name__: inspect.getsource(job_config_module)}
    for section in METHOD_REGISTRIES:
        for options in method_options(section).values():
            module = sys.modules[options.__module__]
            sources.setdefault(module.__name__, inspect.getsource(module))
    docs: dict[str, dict[str, str]] = {}
    for node in (node for source in sources.values() for node in ast.parse(source).body):
        if not isinstance(node, ast.ClassDef):
            continue
        class_docs = docs.setdefault(node.name, {})
        for prev, cur in zip(node.body, node.body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(cur, ast.Expr) and isinstance(cur.value, ast.Constant)
                    and isinstance(cur.value.value, str)):
                class_docs[prev.target.id] = inspect.cleandoc(cur.value.value)
    return docs


def option_specs(config_class: type = JobConfig) -> dict[str, OptionSpec]:
    """Every leaf option of the config, keyed `section.option` (nested sections joined with dots)."""
    return dict(_option_specs(config_class))


@functools.cache
def _option_specs(config_class: type) -> dict[str, OptionSpec]:
    # Read once per process: the planner builds thousands of configs.
    docs = _field_docs()
    specs: dict[str, OptionSpec] = {}

    # Defaults are read from a default instance: a section used twice (the optimizer's groups) can default
    # differently in each place.
    def walk(defaults: Any, prefix: str) -> None:
        cls = type(defaults)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            ftype = hints[f.name]
            default = getattr(defaults, f.name)
            if ftype is MethodTables:  # the methods' own tables, [section.<table>]
                for table, options in default.tables().items():
                    walk(options, f"{prefix}{table}.")
                continue
            if dataclasses.is_dataclass(ftype):
                walk(default, key + ".")
                continue
            specs[key] = OptionSpec(key, ftype, default, docs.get(cls.__name__, {}).get(f.name, ""))

    walk(config_class(), "")
    return specs


def _sections(specs: dict[str, OptionSpec]) -> set[str]:
    return {key.rsplit(".", 1)[0] for key in specs}


def type_name(tp: Any) -> str:
    """A readable name of an option's type, as shown in errors and --help."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}] (comma separated)"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _set(config: Any, key: str, value: Any) -> None:
    *path, name = key.split(".")
    for part in path:
        config = getattr(config, part)
    setattr(config, name, value)


def get_option(config: Any, key: str) -> Any:
    """The value of `section.option` in `config`."""
    for part in key.split("."):
        config = getattr(config, part)
    return config
