"""Builds a `JobConfig` from defaults, a TOML file and command-line flags (in rising precedence).

Flags are `--section.option value` or `--section.option=value`; booleans are flags (`--compile.enable`,
`--compile.no_enable`, or an explicit `=true/false`); lists are comma separated. Every mistake (an unknown or
misspelt option, a value of the wrong type, a TorchTitan option this project does not implement) raises a
`UserError` that names the option, the value and what would be valid.
"""

import sys

from torchtitan.config.cli import _parse_cli, help_text
from torchtitan.config.job_config import JobConfig
from torchtitan.config.option_names import _alias, _check_key
from torchtitan.config.options import _set, option_specs
from torchtitan.config.toml_read import _config_file_options
from torchtitan.config.validation import validate
from torchtitan.config.values import _convert


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Defaults <- TOML (job.config_file) <- command-line flags, then validated. `--help` prints every option."""
    argv = list(sys.argv[1:] if argv is None else argv)
    specs = option_specs()
    if "-h" in argv or "--help" in argv:
        print(help_text(specs))
        raise SystemExit(0)
    cli = _parse_cli(argv, specs)
    config = JobConfig()
    config_file = cli.get("job.config_file")
    if config_file:
        where = f"config file {config_file}"
        for key, value in _config_file_options(config_file, where).items():
            key = _alias(key, where)
            if _check_key(key, value, specs, where):
                _set(config, key, _convert(key, value, specs[key].type, from_cli=False))
    for key, raw in cli.items():
        _set(config, key, _convert(key, raw, specs[key].type, from_cli=True))
    validate(config)
    return config
