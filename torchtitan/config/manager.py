"""Builds a `JobConfig` from defaults, a TOML file and command-line flags (in rising precedence).

Flags are `--section.option value` or `--section.option=value`; booleans are flags (`--compile.enable`,
`--compile.no_enable`, or an explicit `=true/false`); lists are comma separated. Every mistake (an unknown or
misspelt option, a value of the wrong type, a TorchTitan option this project does not implement) raises a
`UserError` that names the option, the value and what would be valid.
"""

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from torchtitan.config import job_config as job_config_module
from torchtitan.config.compatibility import check_options
from torchtitan.config.job_config import METHOD_REGISTRIES, JobConfig, MethodTables, method_options
from torchtitan.errors import UserError
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import warn_once

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# TorchTitan options that this project does not implement, with the value that changes nothing here (TorchTitan's
# default, or the value that leaves the feature off; a tuple lists several such values). Setting one to such a value
# is accepted; any other value is an error naming it.
UNSUPPORTED_TORCHTITAN_OPTIONS: dict[str, Any] = {
    "job.use_for_integration_test": False,
    "job.custom_config_module": "",
    # The resolved config is always saved, as <dump_folder>/config.toml.
    "job.save_config_file": None,
    # The profiler schedule here is TorchTitan's default: 3 warmup steps, 1 active step.
    "profiling.profiler_warmup": 3,
    "profiling.profiler_active": 1,
    # The schedule always spans training.steps.
    "lr_scheduler.total_steps": None,
    # Parameters and optimizer state are kept in float32; training.mixed_precision_param sets the compute dtype.
    "training.dtype": "float32",
    "training.debug_moe_force_load_balance": False,  # TorchTitan v0.2.0; debug.moe_force_load_balance in v0.2.2
    # The loader's own workers would each read the whole stream to keep the one global window order: tokenizer
    # processes and shard reader threads (training.num_workers) run inside the dataset instead.
    "training.dataloader.num_workers": 0,
    "training.dataloader.persistent_workers": False,
    "training.dataloader.pin_memory": False,
    "training.dataloader.prefetch_factor": None,
    "validation.dataloader.num_workers": 0,
    "validation.dataloader.persistent_workers": False,
    "validation.dataloader.pin_memory": False,
    "validation.dataloader.prefetch_factor": None,
    "optimizer.early_step_in_backward": False,
    "parallelism.enable_compiled_autograd": False,
    "parallelism.expert_parallel_degree": 1,
    "parallelism.expert_tensor_parallel_degree": 1,
    "parallelism.module_fqns_per_model_part": [],
    "parallelism.pipeline_parallel_first_stage_less_layers": 1,
    "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "parallelism.pipeline_parallel_expert_parallel_overlap": True,
    "parallelism.expert_parallel_comm_backend": "standard",
    # Context parallelism here balances the load head-tail, as TorchTitan's default does.
    "parallelism.context_parallel_load_balancer": "headtail",
    # Only used with fault tolerance, which is off.
    "checkpoint.enable_ft_dataloader_checkpoints": (True, False),
    "checkpoint.initial_load_in_hf_quantized": False,
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": ["moe.router.gate"],
    "activation_checkpoint.early_stop": False,
    "activation_checkpoint.memory_budget": 0.5,
    "activation_checkpoint.visualize_memory_budget_pareto": False,
    # The model draws no random numbers (no dropout): the recomputed forward is the same either way.
    "activation_checkpoint.preserve_rng_state": (False, True),
    "activation_checkpoint.determinism_check": "default",
    "activation_checkpoint.debug": False,
    "comm.save_traces_folder": "comm_traces",
    "comm.save_traces_file_prefix": "rank_",
    "debug.moe_force_load_balance": False,
    # torchft's Streaming DiLoCo (model fragments synced in turn, quantized pseudo-gradients) is not implemented:
    # DiLoCo syncs the whole model at once, its pseudo-gradients in full precision.
    "fault_tolerance.should_quantize": False,
    "fault_tolerance.fragment_sync_delay": 0,
    "fault_tolerance.fragment_update_alpha": 0.0,
    "memory_estimation.enabled": False,
    "memory_estimation.disable_fake_mode": False,
    "experimental.custom_import": "",
    "experimental.custom_args_module": "",
}
UNSUPPORTED_TORCHTITAN_SECTIONS = ("memory_estimation", "experimental", "quantize.linear.mx", "quantize.grouped_mm")

# Names from earlier TorchTitan releases and where the option lives now.
RENAMED_OPTIONS = {
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "training.compile": "compile.enable",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.batch_size": "training.local_batch_size",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "float8.enable_fsdp_float8_all_gather": "quantize.linear.float8.enable_fsdp_float8_all_gather",
    "float8.precompute_float8_dynamic_scale_for_fsdp": "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "float8.recipe_name": "quantize.linear.float8.recipe_name",
    "float8.filter_fqns": "quantize.linear.float8.filter_fqns",
    "float8.emulate": "quantize.linear.float8.emulate",
}

# Earlier names that are still accepted: they set the option they name now, with a warning.
DEPRECATED_ALIASES = {
    "job.print_args": "job.print_config",
}


@functools.cache
def deprecated_aliases() -> dict[str, tuple[str, str]]:
    """Every earlier name still accepted: {old key: (new key, why it changed)}. Besides DEPRECATED_ALIASES, each
    method's options, once flat in their section (optimizer.muon_ns_steps), are accepted for one release beside
    their table (optimizer.muon.ns_steps): a method table's OLD_PREFIX names them, and its OLD_OPTIONS, where a table
    has options that were never flat, which of its options were."""
    aliases = {old: (new, "TorchTitan v0.2 naming") for old, new in DEPRECATED_ALIASES.items()}
    for section in METHOD_REGISTRIES:
        for table, options in method_options(section).items():
            prefix = getattr(options, "OLD_PREFIX", None)
            flat = getattr(options, "OLD_OPTIONS", None)
            for option in dataclasses.fields(options) if prefix else ():
                if flat is not None and option.name not in flat:
                    continue
                aliases[f"{section}.{prefix}{option.name}"] = (
                    f"{section}.{table}.{option.name}",
                    f"each method's options are in its own table, [{section}.{table}]; the old name goes in the "
                    f"next release")
    return aliases

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


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


def _closest(key: str, specs: dict[str, OptionSpec]) -> str:
    """`; did you mean ...?` for an unknown `section.option`, searching every section: first an option of exactly
    that name elsewhere (training.lr -> optimizer.lr), else the option most alike, the option's name weighing more
    than its section (training.warmup_step -> lr_scheduler.warmup_steps, trainng.steps -> training.steps)."""
    section, _, name = key.rpartition(".")

    def section_likeness(candidate: str) -> float:
        return difflib.SequenceMatcher(None, section, candidate.rpartition(".")[0]).ratio()

    same_name = sorted((k for k in specs if k.rpartition(".")[2] == name), key=section_likeness, reverse=True)
    if same_name:
        # A misspelt section (trainng.steps) means that one; a wrong section (training.lr) may mean any of them.
        if section_likeness(same_name[0]) >= 0.75:
            same_name = same_name[:1]
        else:  # the top-level option, not the same name in nested tables (optimizer.groups.<group>.weight_decay)
            depth = min(k.count(".") for k in same_name)
            same_name = [k for k in same_name if k.count(".") == depth]
        return f"; did you mean {' or '.join(same_name)}?"

    def likeness(candidate: str) -> float:
        name_likeness = difflib.SequenceMatcher(None, name, candidate.rpartition(".")[2]).ratio()
        return 0.7 * name_likeness + 0.3 * section_likeness(candidate)

    best = max(specs, key=likeness)
    if likeness(best) < 0.5:
        # Nothing alike anywhere: the closest option of the section named, if it exists, still shows what it holds.
        in_section = [k for k in specs if k.startswith(section + ".")]
        if not in_section:
            return ""
        best = max(in_section, key=likeness)
    return f"; did you mean {best}?"


def _closest_section(name: str, specs: dict[str, OptionSpec]) -> str:
    """`; did you mean [section]?` for the section (or enclosing table, e.g. quantize) most like `name`."""
    tables = {".".join(parts[:i]) for parts in (section.split(".") for section in _sections(specs))
              for i in range(1, len(parts) + 1)}
    matches = difflib.get_close_matches(name, sorted(tables), n=1, cutoff=0.5)
    return f"; did you mean [{matches[0]}]?" if matches else ""


def _unsupported_section(key: str) -> str | None:
    """The unsupported TorchTitan section that holds `key` (also in a table nested in it), if any."""
    return next((s for s in UNSUPPORTED_TORCHTITAN_SECTIONS if key == s or key.startswith(s + ".")), None)


def _changes_nothing(key: str, value: Any, allowed: Any, from_cli: bool) -> bool:
    """Whether `value` of the unsupported option `key` is one of its `allowed` values (a value or a tuple of them)."""
    for off in allowed if isinstance(allowed, tuple) else (allowed,):
        if off is None:
            if value is None or (from_cli and str(value).lower() in ("none", "null")):
                return True
            continue
        try:
            if _convert(key, value, list[str] if isinstance(off, list) else type(off), from_cli) == off:
                return True
        except UserError:
            pass
    return False


def _alias(key: str, where: str) -> str:
    """The option that `key` names: itself, or what a deprecated alias stands for now (with a warning)."""
    if key not in deprecated_aliases():
        return key
    new, why = deprecated_aliases()[key]
    warn_once(f"{where}: option {key} is deprecated; it is now {new} ({why})")
    return new


def _check_key(key: str, value: Any, specs: dict[str, OptionSpec], where: str, from_cli: bool = False) -> bool:
    """True if `key` is an option of this project; False if it is a TorchTitan option left off; else an error."""
    if key in specs:
        return True
    if key in RENAMED_OPTIONS:
        raise UserError(f"{where}: option {key} is now {RENAMED_OPTIONS[key]} (TorchTitan v0.2 naming); rename it")
    if key in UNSUPPORTED_TORCHTITAN_OPTIONS:
        allowed = UNSUPPORTED_TORCHTITAN_OPTIONS[key]
        if _changes_nothing(key, value, allowed, from_cli):
            return False
        only = " or ".join("none" if v is None else repr(v) for v in (allowed if isinstance(allowed, tuple)
                                                                     else (allowed,)))
        raise UserError(f"{where}: TorchTitan option {key} = {value!r} is not supported by this project (only {only}, "
                        f"which changes nothing here)")
    section = _unsupported_section(key)
    if section is not None:
        raise UserError(f"{where}: TorchTitan option {key} = {value!r} is not supported by this project (it does not "
                        f"implement [{section}])")
    raise UserError(f"{where}: unknown option {key}{_closest(key, specs)}")


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


def validation_shape(config: JobConfig) -> tuple[int, int]:
    """(local batch size, sequence length) of validation batches: training's, where [validation] leaves them unset,
    so that overriding training.seq_len alone keeps validation valid."""
    validation, training = config.validation, config.training
    return (training.local_batch_size if validation.local_batch_size is None else validation.local_batch_size,
            training.seq_len if validation.seq_len is None else validation.seq_len)


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


def validate(config: JobConfig) -> None:
    """Checks of single options' values that need no model or devices (pairs of features that do not compose:
    config/compatibility.py, checked when the run starts)."""
    positive = ["training.local_batch_size", "training.seq_len", "training.steps", "metrics.log_freq",
                "training.gc_freq", "checkpoint.interval", "validation.local_batch_size", "validation.seq_len",
                "validation.freq", "profiling.profile_freq", "comm.init_timeout_seconds",
                "comm.train_timeout_seconds", "parallelism.data_parallel_replicate_degree",
                "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.context_parallel_degree", "parallelism.pipeline_parallel_microbatch_size",
                "health.spike_window", "health.straggler_patience"]
    for key in positive:
        value = get_option(config, key)
        if value is not None and value <= 0:
            raise UserError(f"option {key}: {value} must be a positive integer")
    shard = config.parallelism.data_parallel_shard_degree
    if shard == 0 or shard < -1:
        raise UserError(f"option parallelism.data_parallel_shard_degree: {shard} must be -1 (use the ranks left) "
                        f"or a positive integer")
    gbs = config.training.global_batch_size
    if gbs != -1 and gbs <= 0:
        raise UserError(f"option training.global_batch_size: {gbs} must be -1 (no accumulation) or positive")
    for key in ("optimizer.lr", "optimizer.eps"):
        if get_option(config, key) <= 0:
            raise UserError(f"option {key}: {get_option(config, key)} must be positive")
    for key in ("optimizer.weight_decay", "training.max_norm", "lr_scheduler.warmup_steps", "metrics.peak_flops",
                "health.spike_sigma", "health.spike_warmup", "health.max_skipped_in_a_row",
                "health.straggler_interval"):
        if get_option(config, key) < 0:
            raise UserError(f"option {key}: {get_option(config, key)} must not be negative")
    for group in dataclasses.fields(config.optimizer.groups):
        rules = getattr(config.optimizer.groups, group.name)
        for name in ("lr_scale", "weight_decay"):
            value = getattr(rules, name)
            if value is not None and value < 0:
                raise UserError(f"option optimizer.groups.{group.name}.{name}: {value} must not be negative")
    for key in ("optimizer.beta1", "optimizer.beta2"):
        if not 0 <= get_option(config, key) < 1:
            raise UserError(f"option {key}: {get_option(config, key)} must be in [0, 1)")
    if not 0 <= config.lr_scheduler.min_lr_factor <= 1:
        raise UserError(f"option lr_scheduler.min_lr_factor: {config.lr_scheduler.min_lr_factor} must be in [0, 1]")
    ratio = config.lr_scheduler.decay_ratio
    if ratio is not None and not 0 <= ratio <= 1:
        raise UserError(f"option lr_scheduler.decay_ratio: {ratio} must be in [0, 1] (or unset)")
    if config.validation.enable and validation_shape(config)[1] > config.training.seq_len:
        # The model's RoPE table is built for training.seq_len: longer validation sequences have no angles.
        raise UserError(f"option validation.seq_len: {config.validation.seq_len} is longer than training.seq_len = "
                        f"{config.training.seq_len}; set validation.seq_len <= training.seq_len (or leave it unset "
                        f"to follow training.seq_len)")
    option = config.activation_checkpoint.selective_ac_option
    if config.activation_checkpoint.mode == "selective" and option != "op" and not (option.isdigit() and
                                                                                  int(option) > 0):
        raise UserError(f"option activation_checkpoint.selective_ac_option: {option!r} must be 'op' or a positive "
                        f"integer N (checkpoint every N-th block)")
    for component in config.compile.components:
        if component not in ("model", "loss"):
            raise UserError(f"option compile.components: {component!r} is not one of 'model', 'loss'")
    for part in config.checkpoint.exclude_from_loading:
        if part not in ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "diloco"):
            raise UserError(f"option checkpoint.exclude_from_loading: {part!r} is not one of model, optimizer, "
                            f"lr_scheduler, dataloader, train_state, rng, diloco")
    valid_converters = ("quantize.linear.float8", "float8")
    for converter in config.model.converters:
        if converter not in valid_converters:
            raise UserError(f"option model.converters: {converter!r} is not a known converter; valid: "
                            f"{', '.join(valid_converters)}")
    if config.training.stream_max_attempts < 1:
        raise UserError(f"option training.stream_max_attempts: {config.training.stream_max_attempts} must be at least 1")
    if config.training.stream_backoff_seconds < 0:
        raise UserError(f"option training.stream_backoff_seconds: {config.training.stream_backoff_seconds} must not be "
                        f"negative")
    if config.training.max_open_shards < 1:
        raise UserError(f"option training.max_open_shards: {config.training.max_open_shards} must be at least 1")
    if config.training.num_workers < 0:
        raise UserError(f"option training.num_workers: {config.training.num_workers} must be 0 (tokenize and read in "
                        f"the training process) or positive")
    if config.model.document_positions and config.model.attention_mask != "block_causal":
        raise UserError("option model.document_positions: true needs model.attention_mask = 'block_causal' (with "
                        "causal attention a document sees the ones before it, so its positions continue)")
    if config.health.straggler_factor <= 1:
        raise UserError(f"option health.straggler_factor: {config.health.straggler_factor} must be above 1 (a "
                        f"straggler is slower than the median by this factor)")
    if config.checkpoint.keep_latest_k < 0:
        raise UserError(f"option checkpoint.keep_latest_k: {config.checkpoint.keep_latest_k} must be 0 (keep all) "
                        f"or positive")
    if config.fault_tolerance.enable:
        _validate_fault_tolerance(config)
    check_options(config)


def _validate_fault_tolerance(config: JobConfig) -> None:
    ft = config.fault_tolerance
    if ft.group_size < 1:
        raise UserError(f"option fault_tolerance.group_size: {ft.group_size} must be the number of replica groups "
                        f"(1 or more) when fault_tolerance.enable is set")
    if not 0 <= ft.replica_id < ft.group_size:
        raise UserError(f"option fault_tolerance.replica_id: {ft.replica_id} is not a group of group_size = "
                        f"{ft.group_size}; valid: 0 to {ft.group_size - 1}")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise UserError(f"option fault_tolerance.min_replica_size: {ft.min_replica_size} must be in [1, group_size = "
                        f"{ft.group_size}]")
    for key in ("fault_tolerance.process_group_timeout_ms", "fault_tolerance.connect_timeout_seconds",
                "fault_tolerance.quorum_timeout_seconds", "fault_tolerance.sync_steps",
                "fault_tolerance.join_timeout_seconds", "fault_tolerance.heartbeat_timeout_seconds"):
        if get_option(config, key) <= 0:
            raise UserError(f"option {key}: {get_option(config, key)} must be positive")
    if ft.semi_sync_method == "diloco":
        if ft.outer_lr <= 0:
            raise UserError(f"option fault_tolerance.outer_lr: {ft.outer_lr} must be positive (the DiLoCo outer "
                            f"step's learning rate; the DiLoCo paper's is 0.7)")
        if not 0 <= ft.outer_momentum < 1:
            raise UserError(f"option fault_tolerance.outer_momentum: {ft.outer_momentum} must be in [0, 1) (the "
                            f"DiLoCo outer step's Nesterov momentum; the DiLoCo paper's is 0.9)")


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
