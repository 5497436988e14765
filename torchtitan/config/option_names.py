"""Which option a name means: one of this project's, an earlier name still accepted (with a warning), a TorchTitan
option renamed or not implemented here (refused unless its value changes nothing), or a misspelling (refused, with
the closest name)."""

import dataclasses
import difflib
import functools
from typing import Any

from torchtitan.config.job_config import METHOD_REGISTRIES, method_options
from torchtitan.config.options import OptionSpec, _sections
from torchtitan.config.values import _convert
from torchtitan.errors import UserError
from torchtitan.tools.logging import warn_once

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
