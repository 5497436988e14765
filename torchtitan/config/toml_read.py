"""Reading a TOML config file into the options it sets, flattened to `section.option` keys."""

import copy
import functools
import os
import sys
from pathlib import Path
from typing import Any

from torchtitan.config.option_names import (RENAMED_OPTIONS, UNSUPPORTED_TORCHTITAN_OPTIONS,
                                            UNSUPPORTED_TORCHTITAN_SECTIONS, _closest_section, _unsupported_section,
                                            deprecated_aliases)
from torchtitan.config.options import OptionSpec, _sections, option_specs
from torchtitan.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def _is_table(key: str, specs: dict[str, OptionSpec]) -> bool:
    """Whether `key` names a TOML table that holds options: a section of this project, one of TorchTitan's that this
    project does not implement (or a table inside it), or a table of renamed or unsupported options."""
    known = [*_sections(specs), *UNSUPPORTED_TORCHTITAN_SECTIONS, *UNSUPPORTED_TORCHTITAN_OPTIONS, *RENAMED_OPTIONS,
             *deprecated_aliases()]
    return (key in _sections(specs) or _unsupported_section(key) is not None
            or any(k.startswith(key + ".") for k in known))


def _flatten_toml(data: dict, specs: dict[str, OptionSpec], where: str = "config file",
                  prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        is_option = any(key in names for names in (specs, UNSUPPORTED_TORCHTITAN_OPTIONS, RENAMED_OPTIONS,
                                                    deprecated_aliases()))
        if isinstance(value, dict) and not is_option:
            if not _is_table(key, specs):
                raise UserError(f"{where}: unknown section [{key}]{_closest_section(key, specs)}")
            flat.update(_flatten_toml(value, specs, where, key + "."))
        else:
            flat[key] = value
    return flat


def load_toml(path: str) -> dict:
    """Read a TOML file, turning a missing file or a syntax error into a UserError naming the file."""
    if os.path.isdir(path):
        tomls = sorted(os.path.join(path, entry.name) for entry in Path(path).glob("*.toml") if entry.is_file())
        raise UserError(f"option job.config_file: {path!r} is a folder, not a TOML file; "
                        + (f"pass one of the files in it: {', '.join(tomls)}" if tomls else "it holds no .toml file"))
    if not os.path.isfile(path):
        raise UserError(f"option job.config_file: {path!r} does not exist (pass a TOML file, e.g. "
                        f"train_configs/debug_model.toml)")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"option job.config_file: {path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"option job.config_file: cannot read {path}: {e}") from None


def _config_file_options(path: str, where: str) -> dict[str, Any]:
    """The options a TOML file sets, flattened. A file is parsed once per version of it (its modification time and
    size): the planner builds a trainer config per candidate layout, thousands, from the same preset."""
    try:
        stat = os.stat(path)
    except OSError:
        stat = None
    if stat is None or not os.path.isfile(path):
        return _flatten_toml(load_toml(path), option_specs(), where)  # the error names what is wrong
    return copy.deepcopy(_parsed_config_file(path, stat.st_mtime_ns, stat.st_size, where))


@functools.lru_cache(maxsize=16)
def _parsed_config_file(path: str, mtime_ns: int, size: int, where: str) -> dict[str, Any]:
    return _flatten_toml(load_toml(path), option_specs(), where)
