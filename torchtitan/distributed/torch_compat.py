"""Every private torch name this project uses, in one place, and what happens on a torch that lacks one.

torch's private modules and attributes (a leading underscore) change between releases without deprecation: torch
2.14 renamed the context-parallel sharding-rule hook that 2.13 had, and an import of the old name at the top of a
module crashed every run, with or without context parallelism. So no module of the package imports a private torch
name itself (tests/unit/test_torch_compat.py checks); each one is listed here and looked up when first needed,
never at import. A torch that lacks one still imports every module, and then:

- where another torch version names the same thing differently, `PRIVATE_NAMES` lists both, first found wins;
- where the public API does the same job, the caller falls back to it (`lookup` returns None) and nothing refuses;
- otherwise the name belongs to one feature (`FEATURES`), and `require_torch_features` refuses that feature at
  start-up in one line that names the option, the missing name and this torch's version, leaving every other
  feature alone.

The tested range is `TESTED_TORCH` (README.md, pyproject.toml). The names used through public APIs instead (torch
has one) are not listed: `torch.compiler.set_stance` for dynamo's disable switch, `torch.distributed.pipelining`'s
exported action constants for its private enum, `torch.distributed.nn.functional.all_gather` where the functional
collectives are missing, `fully_shard` over a one-rank shard dimension where FSDP's replicate is missing.
"""

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.errors import UserError

TESTED_TORCH = ("2.11", "2.13", "2.14")
"""The torch releases the test suite runs on (CI: the full suite on the README's, a smoke set on the other)."""


def release() -> tuple[int, int]:
    """This torch's (major, minor) release."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def pipeline_shapes_per_mode() -> bool:
    """torch 2.13's pipeline schedules infer the stages' shapes again when switching between training and
    evaluation; earlier ones infer them once."""
    return release() >= (2, 13)


def untested_torch() -> str | None:
    """A warning line when this torch is not a tested release (None when it is)."""
    if ".".join(map(str, release())) in TESTED_TORCH:
        return None
    return (f"torch {torch.__version__} is not a tested release (tested: {', '.join(TESTED_TORCH)}): a feature whose "
            f"private torch names it lacks is refused at start-up; other differences are untested")


@dataclass(frozen=True)
class Feature:
    asked_by: str
    """The option (and value) that turns the feature on, as a user writes it."""
    instead: str
    """What to do on a torch that lacks what the feature needs."""


FEATURES: dict[str, Feature] = {
    "dry_run": Feature("comm.mode = 'fake_backend' (the dry run)", "run on real devices, or use a tested torch"),
    "cpu_ring_attention": Feature(
        "parallelism.context_parallel_method = 'ring' (context_parallel_degree > 1, causal attention) on the CPU",
        "use context_parallel_method = 'allgather_kv' (public collectives only), or run on GPUs"),
    "cp_rotate_method": Feature("parallelism.context_parallel_rotate_method = 'alltoall'", "use 'allgather'"),
    "activation_checkpointing": Feature("activation_checkpoint.mode = 'full' or 'selective'",
                                        "set activation_checkpoint.mode = 'none'"),
    "async_tp": Feature("parallelism.enable_async_tensor_parallel", "turn it off (plain tensor parallelism)"),
    "fsdp_hooks": Feature("comm.gradient_compression or comm.weight_quantization (FSDP's collective hooks)",
                          "set both to 'none'"),
    "pipeline_csv": Feature("parallelism.pipeline_parallel_schedule_csv",
                            "use a built-in parallelism.pipeline_parallel_schedule"),
    "pipeline_eval": Feature("validation.enable with a multi-stage pipeline schedule",
                             "validate with a single-stage schedule (1F1B, GPipe) or turn validation off"),
    "hf_sharded_checkpoint": Feature("Hugging Face import or export (checkpoint.initial_load_in_hf, "
                                     "checkpoint.last_save_in_hf, scripts/convert_checkpoint.py)",
                                     "convert on one process with a tested torch"),
    "memory_snapshot": Feature("profiling.enable_memory_snapshot", "turn it off (the profiler trace still works)"),
    "low_precision_optimizers": Feature("optimizer.name = 'AdamW-8bit' or 'AdamW-4bit'",
                                        "use 'AdamW' or 'AdamW-bf16'"),
}


@dataclass(frozen=True)
class PrivateName:
    paths: tuple[str, ...]
    """'module:attribute.attribute' (or 'module' alone), in order of preference: each torch version's name."""
    feature: str | None
    """The key of FEATURES that needs it; None: the callers fall back to a public API when it is missing."""


_CP = "torch.distributed.tensor.experimental._context_parallel"
_FSDP = "torch.distributed.fsdp._fully_shard"
PRIVATE_NAMES: dict[str, PrivateName] = {
    # The dry run: fake tensors, the fake backend and torch's own memory and collective trackers.
    "FakeTensorMode": PrivateName(("torch._subclasses.fake_tensor:FakeTensorMode",), "dry_run"),
    "unset_fake_temporarily": PrivateName(("torch._subclasses.fake_tensor:unset_fake_temporarily",), "dry_run"),
    "is_fake": PrivateName(("torch._subclasses.fake_tensor:is_fake",), "dry_run"),
    "FakeStore": PrivateName(("torch.distributed:FakeStore", "torch.testing._internal.distributed.fake_pg:FakeStore"),
                             "dry_run"),
    "fake_collectives": PrivateName(("torch.distributed._tools.fake_collectives",), "dry_run"),
    "FSDPMemTracker": PrivateName(("torch.distributed._tools.fsdp2_mem_tracker:FSDPMemTracker",), "dry_run"),
    # The tracker's own records (fake.py hooks an FSDP group as FSDP itself does, not module by module).
    "FSDPSavedMethods": PrivateName(("torch.distributed._tools.fsdp2_mem_tracker:_SavedFSDPMethods",), "dry_run"),
    "FSDPRefType": PrivateName(("torch.distributed._tools.fsdp2_mem_tracker:_FSDPRefType",), "dry_run"),
    "register_group_forward_hooks": PrivateName(
        ("torch.distributed.fsdp._fully_shard._fsdp_state:_register_group_forward_hooks",), "dry_run"),
    "MemTracker": PrivateName(("torch.distributed._tools.mem_tracker:MemTracker",), "dry_run"),
    "TorchDispatchMode": PrivateName(("torch.utils._python_dispatch:TorchDispatchMode",), "dry_run"),
    "ShardingPropagator": PrivateName(("torch.distributed.tensor._sharding_prop:ShardingPropagator",), "dry_run"),
    "PipelineSchedule": PrivateName(("torch.distributed.pipelining.schedules:_PipelineSchedule",), "dry_run"),
    # Only a torch whose schedules vote on static shapes (2.13 on) has it, and only that vote needs it.
    "PipelineInferenceMode": PrivateName(("torch.distributed.pipelining._utils:InferenceMode",), None),
    # A GPU-target dry run issues the GPUs' all-to-all for a shard move (fake.py); a torch without these names (2.11)
    # traces the CPU mesh's all-gather instead.
    "resolve_group": PrivateName(("torch.distributed._functional_collectives:_resolve_group",), None),
    "group_or_group_name": PrivateName(("torch.distributed._functional_collectives:_group_or_group_name",), None),
    # Context parallelism: torch's ring attention, driven for the CPU's SDPA op (context_parallel.py).
    "ring_attention": PrivateName((f"{_CP}._attention:_templated_ring_attention",), "cpu_ring_attention"),
    "ring_attention_backward": PrivateName((f"{_CP}._attention:_templated_ring_attention_backward",),
                                           "cpu_ring_attention"),
    "cp_custom_ops": PrivateName((f"{_CP}._attention:custom_ops",), "cpu_ring_attention"),
    "dtensor_dispatcher": PrivateName(("torch.distributed.tensor:DTensor._op_dispatcher",), "cpu_ring_attention"),
    # torch <= 2.13 installs a temporary op strategy; 2.14 a temporary single-dimension strategy.
    "cp_strategy_context": PrivateName((f"{_CP}._sharding_rules:_single_dim_strategy_context",
                                        f"{_CP}._sharding_rules:_op_strategy_context"), "cpu_ring_attention"),
    "sharding_placeholder": PrivateName(("torch.distributed.tensor._ops.single_dim_strategy:_ShardingPlaceholder",),
                                        None),
    "expand_to_full_mesh_op_strategy": PrivateName(
        ("torch.distributed.tensor._ops.utils:expand_to_full_mesh_op_strategy",), None),
    "set_rotate_method": PrivateName(("torch.distributed.tensor.experimental:set_rotate_method",
                                      f"{_CP}._attention:set_rotate_method"), "cp_rotate_method"),
    # Block-causal CP's key/value exchange: the functional collectives (traceable by torch.compile; torch 2.13 renamed
    # them), else torch.distributed.nn's.
    "all_gather_autograd": PrivateName(("torch.distributed._functional_collectives:all_gather_single_autograd",
                                        "torch.distributed._functional_collectives:all_gather_tensor_autograd"), None),
    "all_gather_tensor": PrivateName(("torch.distributed._functional_collectives:all_gather_single",
                                      "torch.distributed._functional_collectives:all_gather_tensor"), None),
    "wait_tensor": PrivateName(("torch.distributed._functional_collectives:wait_tensor",), None),
    # Data parallelism: FSDP2's replicate (DDP), else fully_shard over a one-rank shard dimension.
    "replicate": PrivateName(("torch.distributed.fsdp:replicate",
                              "torch.distributed._composable.replicate_with_fsdp:replicate"), None),
    "DeviceMesh._flatten": PrivateName(("torch.distributed.device_mesh:DeviceMesh._flatten",), None),
    "DeviceMesh._concatenate": PrivateName(("torch.distributed.device_mesh:DeviceMesh._concatenate",), None),
    "checkpoint_wrapper": PrivateName(
        ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper",),
        "activation_checkpointing"),
    "enable_symm_mem_for_group": PrivateName(("torch.distributed._symmetric_memory:enable_symm_mem_for_group",),
                                             "async_tp"),
    # FSDP2's collective hooks (compression/): the base classes and the parameter groups they are installed on.
    "FSDPReduceScatter": PrivateName((f"{_FSDP}._fsdp_api:ReduceScatter",), "fsdp_hooks"),
    "FSDPAllGather": PrivateName((f"{_FSDP}._fsdp_api:AllGather",), "fsdp_hooks"),
    "FSDPShardedState": PrivateName((f"{_FSDP}._fsdp_param:ShardedState",), "fsdp_hooks"),
    "FSDPModule._get_fsdp_state": PrivateName(("torch.distributed.fsdp:FSDPModule._get_fsdp_state",), "fsdp_hooks"),
    # Pipelining: the runtime that reads a CSV schedule, and the lowering of an action list (forward-only eval).
    "PipelineScheduleRuntime": PrivateName(("torch.distributed.pipelining.schedules:_PipelineScheduleRuntime",),
                                           "pipeline_csv"),
    "add_send_recv": PrivateName(("torch.distributed.pipelining.schedules:_add_send_recv",), "pipeline_eval"),
    "add_unshard_reshard": PrivateName(("torch.distributed.pipelining.schedules:_add_unshard_reshard",),
                                       "pipeline_eval"),
    # Hugging Face import: where this rank's block of a sharded tensor lies.
    "StridedShard": PrivateName(("torch.distributed.tensor.placement_types:_StridedShard",),
                                "hf_sharded_checkpoint"),
    "compute_local_shape_and_global_offset": PrivateName(
        ("torch.distributed.tensor._utils:compute_local_shape_and_global_offset",), "hf_sharded_checkpoint"),
    # Checkpoint writing without FileSystemWriter's own staging (async saves stage with their own stager).
    "FileSystemWriterBase": PrivateName(("torch.distributed.checkpoint.filesystem:_FileSystemWriter",), None),
    # A process group's timeout, shortened after the first step (comm.train_timeout_seconds): public from torch 2.14.
    "set_pg_timeout": PrivateName(("torch.distributed:set_timeout",
                                   "torch.distributed.distributed_c10d:_set_pg_timeout"), None),
    "process_groups": PrivateName(("torch.distributed.distributed_c10d:_world.pg_map",), None),
    "record_memory_history": PrivateName(("torch.cuda.memory:_record_memory_history",), "memory_snapshot"),
    "memory_snapshot": PrivateName(("torch.cuda.memory:_snapshot",), "memory_snapshot"),
    "functorch_config": PrivateName(("torch._functorch.config",), "low_precision_optimizers"),
    "inductor_config": PrivateName(("torch._inductor.config",), "async_tp"),
    "async_checkpoint_executor": PrivateName(("torch.distributed.checkpoint._async_process_executor",), None),
}


def _resolve(path: str) -> Any:
    module_name, _, attributes = path.partition(":")
    value = importlib.import_module(module_name)
    for attribute in filter(None, attributes.split(".")):
        value = getattr(value, attribute)
    return value


@functools.cache
def lookup(key: str) -> Any | None:
    """The object `PRIVATE_NAMES[key]` names in this torch (the first of its paths found), or None."""
    for path in PRIVATE_NAMES[key].paths:
        try:
            return _resolve(path)
        except (ImportError, AttributeError):
            continue
    return None


def found_path(key: str) -> str | None:
    """Which of the entry's paths this torch has (the first found), or None."""
    for path in PRIVATE_NAMES[key].paths:
        try:
            _resolve(path)
            return path
        except (ImportError, AttributeError):
            continue
    return None


class TorchLacks(UserError):
    """A feature was asked for that needs a private torch name this torch does not have."""


def _refusal(feature: str, missing: str) -> str:
    return (f"option {FEATURES[feature].asked_by} needs torch's {missing}, which torch {torch.__version__} lacks "
            f"(tested: torch {', '.join(TESTED_TORCH)}); {FEATURES[feature].instead}")


def get(key: str) -> Any:
    """`lookup(key)` for a name that has no public fallback: a missing one raises the feature's one-line refusal."""
    value = lookup(key)
    if value is None:
        entry = PRIVATE_NAMES[key]
        raise TorchLacks(_refusal(entry.feature, entry.paths[0]) if entry.feature else
                         f"torch {torch.__version__} lacks {entry.paths[0]} (tested: torch {', '.join(TESTED_TORCH)})")
    return value


def missing_names(feature: str) -> list[str]:
    """The private names `feature` needs that this torch lacks (empty: the feature works)."""
    return [entry.paths[0] for key, entry in PRIVATE_NAMES.items() if entry.feature == feature and lookup(key) is None]


def require(feature: str) -> None:
    """Refuse `feature` in one line if this torch lacks a private name it needs."""
    if missing := missing_names(feature):
        raise TorchLacks(_refusal(feature, missing[0]))


def requested_features(config: Any, device_type: str, multi_stage_pipeline: bool = False) -> list[str]:
    """The FEATURES that `config` turns on for a run on `device_type` (`multi_stage_pipeline`: its pipeline
    schedule holds several stages per rank)."""
    parallelism = config.parallelism
    # torch's ring attention runs for causal attention under CP with context_parallel_method = ring; the other CP
    # paths gather keys and values with public collectives.
    ring_attention = parallelism.context_parallel_degree > 1 and config.model.attention_mask == "causal" and \
        parallelism.context_parallel_method == "ring"
    requested = {
        "dry_run": config.comm.mode == "fake_backend",
        "cpu_ring_attention": ring_attention and device_type == "cpu",
        "cp_rotate_method": ring_attention and parallelism.context_parallel_rotate_method != "allgather",
        "activation_checkpointing": config.activation_checkpoint.mode != "none",
        "async_tp": parallelism.enable_async_tensor_parallel,
        "fsdp_hooks": config.comm.gradient_compression != "none" or config.comm.weight_quantization != "none",
        "pipeline_csv": parallelism.pipeline_parallel_degree > 1 and bool(parallelism.pipeline_parallel_schedule_csv),
        "pipeline_eval": multi_stage_pipeline and config.validation.enable,
        "hf_sharded_checkpoint": config.checkpoint.initial_load_in_hf or config.checkpoint.last_save_in_hf,
        "memory_snapshot": config.profiling.enable_memory_snapshot,
        "low_precision_optimizers": config.optimizer.name in ("AdamW-8bit", "AdamW-4bit"),
    }
    return [feature for feature, on in requested.items() if on]


def require_torch_features(config: Any, device_type: str, multi_stage_pipeline: bool = False) -> None:
    """At start-up: refuse, in one line, the first feature `config` asks for that this torch cannot run."""
    for feature in requested_features(config, device_type, multi_stage_pipeline):
        require(feature)


# ----------------------------------------------------------------------------------------------------------------
# Version-aware helpers: one behaviour over the names each torch version has


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor (a dry run's); without torch's fake tensors there are none."""
    check = lookup("is_fake")
    return check is not None and check(tensor)


def schedule_stages(schedule: Any) -> list[Any]:
    """The PipelineStage objects a pipeline schedule runs on this rank (its private attributes: a single-stage
    schedule holds one, a multi-stage one a list)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if stages[0] is None:
        raise TorchLacks(f"torch {torch.__version__}'s pipeline schedule {type(schedule).__name__} holds its stages "
                         f"under another name than _stages / _stage: the dry run cannot report them (tested: torch "
                         f"{', '.join(TESTED_TORCH)})")
    return stages


def private_base(key: str) -> type:
    """A class to subclass at import time: torch's, or, where this torch lacks it, a stand-in whose instantiation
    raises the feature's refusal (start-up checks refuse the feature before anything is built)."""
    base = lookup(key)
    if base is not None:
        return base

    class Missing:
        def __init__(self, *args, **kwargs):
            get(key)
    Missing.__name__ = key.rsplit(".", 1)[-1]
    return Missing


def sequence_sharded_strategy(op: "torch._ops.OpOverload", tensors: int, input_index: int
                              ) -> contextlib.AbstractContextManager:
    """A context in which DTensor shards `op`'s `tensors` tensors (its outputs, then its tensor inputs from
    `input_index` on) on the sequence dimension (2) together: context parallelism's rule for an SDPA op, installed
    only while CP is on, as torch does for the CUDA SDPA ops. torch 2.14 takes single-dimension strategies; earlier
    torch op strategies over the whole mesh."""
    from torch.distributed.tensor import Shard

    strategy_context = get("cp_strategy_context")
    if found_path("cp_strategy_context").endswith("_single_dim_strategy_context"):
        placeholder = get("sharding_placeholder")

        def single_dim_strategy(op_overload, args_schema, kwargs_schema) -> list[list[Any]]:
            return [[placeholder(2)] * tensors]
        return strategy_context(op, single_dim_strategy)

    expand = get("expand_to_full_mesh_op_strategy")

    def op_strategy(op_schema):
        return expand(op_schema.get_mesh_from_args(validate=False), op_schema, [[Shard(2)] * tensors],
                      input_index=input_index)
    return strategy_context(op, op_strategy)


def flatten_mesh(root: Any, dims: tuple[str, ...], name: str, leading: str | None = None) -> Any:
    """`root`'s adjacent dimensions `dims` as one dimension called `name`; with `leading`, the 2-D mesh (leading,
    name). torch's DeviceMesh._flatten and _concatenate reuse the root's process groups; without them, a new mesh
    over the same ranks from the public constructor (which makes groups of its own)."""
    flatten, concatenate = lookup("DeviceMesh._flatten"), lookup("DeviceMesh._concatenate")
    if flatten is not None and (leading is None or concatenate is not None):
        flat = flatten(root[dims], mesh_dim_name=name)
        return flat if leading is None else concatenate([root[leading], flat])
    from torch.distributed.device_mesh import DeviceMesh

    names = root.mesh_dim_names
    first = names.index(dims[0])
    last = first + len(dims)
    if names[first:last] != tuple(dims):
        raise ValueError(f"mesh dimensions {dims} are not adjacent in {names}")
    shape = tuple(root.mesh.shape)
    merged = DeviceMesh(root.device_type, root.mesh.reshape(*shape[:first], -1, *shape[last:]),
                        mesh_dim_names=(*names[:first], name, *names[last:]))
    return merged[name] if leading is None else merged[leading, name]


def all_gather_autograd_function() -> Callable[[torch.Tensor, int, Any], torch.Tensor]:
    """(tensor, dim, group) -> the group's tensors concatenated along `dim`, rank after rank; backward: the
    gradient's slice of each rank, summed over the group (a reduce-scatter). The functional collectives (traceable by
    torch.compile), else torch.distributed.nn's autograd all-gather. Looked up when called: code that torch.compile
    traces gets the function from outside the traced region (dynamo cannot follow the lookup's imports)."""
    gather = lookup("all_gather_autograd")
    if gather is not None:
        return lambda tensor, dim, group: gather(tensor.contiguous(), dim, group)
    from torch.distributed.nn.functional import all_gather as autograd_all_gather

    return lambda tensor, dim, group: torch.cat(autograd_all_gather(tensor.contiguous(), group=group), dim=dim)


def all_gather(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The group's tensors concatenated along `dim` (no autograd)."""
    gather, wait = lookup("all_gather_tensor"), lookup("wait_tensor")
    if gather is not None and wait is not None:
        return wait(gather(tensor.contiguous(), dim, group))
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def patched_config(key: str, **values: Any) -> Iterator[None]:
    """torch's private config module `key` (functorch's, inductor's) with `values` for the duration."""
    with get(key).patch(**values):
        yield

