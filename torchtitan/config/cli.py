"""The command line: flags into raw values, the trainer's `--help`, and a script's own options beside the
trainer's."""

import argparse
from typing import Any

from torchtitan.config.option_names import _alias, _check_key, deprecated_aliases
from torchtitan.config.options import OptionSpec, option_specs, type_name
from torchtitan.config.values import _FALSE, _TRUE
from torchtitan.errors import UserError


def _parse_cli(argv: list[str], specs: dict[str, OptionSpec]) -> dict[str, Any]:
    """Turn flags into {key: raw string or bool}, in order (a later flag wins)."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(f"command line: unexpected argument {arg!r}; options look like --section.option value")
        key, has_value, raw = arg[2:].partition("=")
        section, _, name = key.rpartition(".")
        if name.startswith("no_") and f"{section}.{name[3:]}" in deprecated_aliases():  # e.g. --job.no_print_args
            section, _, name = _alias(f"{section}.{name[3:]}", "command line").rpartition(".")
            key, name = f"{section}.no_{name}", f"no_{name}"
        elif key in deprecated_aliases():
            key = _alias(key, "command line")
            section, _, name = key.rpartition(".")
        if key not in specs and name.startswith("no_") and f"{section}.{name[3:]}" in specs \
                and specs[f"{section}.{name[3:]}"].type is bool:
            if has_value:
                raise UserError(f"command line: {arg} takes no value; use --{key} or --{section}.{name[3:]}=false")
            values[f"{section}.{name[3:]}"] = False
            i += 1
            continue
        spec = specs.get(key)
        if spec is None:
            if not has_value:
                takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                raw, i = (argv[i + 1], i + 1) if takes_value else ("true", i)
            _check_key(key, raw, specs, "command line", from_cli=True)
            i += 1
            continue
        if spec.type is bool and not has_value:
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            if following.lower() in _TRUE + _FALSE:
                raw, i = following, i + 1
            elif not following.startswith("--"):
                # No positional arguments exist: a word after a flag was meant as its value.
                raise UserError(f"command line: option {key}: {following!r} is not a valid value; expected bool "
                                f"(--{key}, --{section}.no_{name}, or --{key}=true/false)")
            else:
                raw = "true"
        elif not has_value:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and len(argv[i + 1]) > 2):
                raise UserError(f"command line: option {key} needs a value"
                                + (f" ({type_name(spec.type)})" if spec else ""))
            raw, i = argv[i + 1], i + 1
        values[key] = raw
        i += 1
    return values


def parse_script_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """A script's own options (`parser`, built with `add_help=False`), and the rest of `argv`: the trainer options it
    passes on. `-h`/`--help` prints the script's options and where the trainer's are listed, then exits."""
    if "-h" in argv or "--help" in argv:
        print(parser.format_help().rstrip())
        print("\nEvery other --section.option is the trainer's: `python -m torchtitan.train --help` lists them.")
        raise SystemExit(0)
    return parser.parse_known_args(argv)


def help_text(specs: dict[str, OptionSpec] | None = None) -> str:
    """Every option, grouped by section, with its type, default and description."""
    specs = specs or option_specs()
    lines = ["usage: python -m torchtitan.train [--job.config_file FILE] [--section.option VALUE ...]",
             "", "Precedence: command line > TOML file > defaults. Booleans: --x.y / --x.no_y. Lists: a,b,c.", ""]
    section = None
    for key, spec in specs.items():
        this_section = key.rsplit(".", 1)[0]
        if this_section != section:
            section = this_section
            lines.append(f"[{section}]")
        doc = " ".join(spec.doc.split())
        lines.append(f"  --{key} ({type_name(spec.type)}, default: {spec.default!r})")
        lines.append(f"      {doc}")
    return "\n".join(lines)
