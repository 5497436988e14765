"""Writing a config as TOML, which `--job.config_file` reads back to the same config."""

from pathlib import Path
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.config.options import get_option, option_specs
from torchtitan.tools.files import atomic_write


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(config: JobConfig) -> str:
    """The config as TOML that `--job.config_file` reads back to the same config (unset options are omitted)."""
    out: list[str] = []
    section = None
    for key, spec in option_specs().items():
        value = get_option(config, key)
        this_section, name = key.rsplit(".", 1)
        if this_section != section:
            section = this_section
            out.append(f"\n[{section}]")
        if value is not None:
            out.append(f"{name} = {_toml_value(value)}")
    return "\n".join(out).lstrip() + "\n"


def save_config(config: JobConfig, folder: str) -> Path:
    """Write the resolved config to <folder>/config.toml atomically."""
    path = Path(folder) / "config.toml"
    with atomic_write(path) as f:
        f.write(to_toml(config))
    return path
