"""Which features compose: one table, checked once at start-up, and the pairs it refuses.

Every feature of a run is a named predicate over what the run is (`Setup`: the config, the parallel degrees, the
device). `REFUSALS` lists the pairs of features that do not compose, each with why and what to use instead; any
pair not listed composes, and tests/integration/test_composition.py walks a pairwise covering array of the feature
space to hold that claim (each cell trains with finite losses, or this table refuses it). The trainer calls
`check_composition` before it builds anything, so a refused pair costs one error line and no compute:

    error: option comm.gradient_compression (loco, error_feedback, qsdp): does not compose with
    data_parallel_replicate_degree > 1 (HSDP or DDP: ...) (FSDP2's replica all-reduce cannot be replaced ...); shard
    over all data-parallel ranks (data_parallel_replicate_degree = 1), or exchange across replicas with FlexDeMo

What a single option's value must be (a positive degree, a divisible sequence) is checked where the option is read
(config/validation.py, the parallelize and pipeline plans); only pairs live here. A method registered in a registry
(an optimizer, a gradient compression) declares its own refusals beside its implementation (`MethodRefusal`), and
`refusals()` collects them, so adding a method edits nothing here.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.errors import UserError


@dataclass(frozen=True)
class Setup:
    """What a run is, as far as composition goes."""

    config: Any
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    device_type: str
    split_backward_schedule: bool = False
    """The pipeline schedule runs input- and weight-gradient passes apart (InterleavedZeroBubble, ZBV, DualPipeV)."""

    @property
    def fsdp(self) -> bool:
        return self.dp_shard * self.cp > 1


@dataclass(frozen=True)
class Feature:
    option: str
    """How a user turns it on, as written in an error line."""
    on: Callable[[Setup], bool]
    layout: bool = False
    """It depends on the parallel degrees or the device, known when the run starts, not when its options are read."""


def _ac(mode: str, option: str | None = None) -> Callable[[Setup], bool]:
    def on(setup: Setup) -> bool:
        ac = setup.config.activation_checkpoint
        if ac.mode != mode:
            return False
        return option is None or (ac.selective_ac_option == "op") == (option == "op")
    return on


def _compile_model(setup: Setup) -> bool:
    return setup.config.compile.enable and "model" in setup.config.compile.components


def _float8(setup: Setup) -> bool:
    return any(converter in ("float8", "quantize.linear.float8") for converter in setup.config.model.converters)


FEATURES: dict[str, Feature] = {
    # Layouts
    "no_fsdp": Feature("data_parallel_shard_degree x context_parallel_degree = 1 (no FSDP)", lambda s: not s.fsdp,
                       layout=True),
    "replica_all_reduce": Feature(
        "data_parallel_replicate_degree > 1 (HSDP or DDP: gradients all-reduced across replicas)",
        lambda s: s.dp_replicate > 1 and s.config.optimizer.name != "FlexDeMo", layout=True),
    "one_replica": Feature("data_parallel_replicate_degree = 1", lambda s: s.dp_replicate == 1, layout=True),
    "tp_on_cpu": Feature("tensor_parallel_degree > 1 on the CPU", lambda s: s.tp > 1 and s.device_type == "cpu",
                         layout=True),
    "split_backward_pp": Feature("a split-backward pipeline schedule (InterleavedZeroBubble, ZBVZeroBubble, "
                                 "DualPipeV)", lambda s: s.pp > 1 and s.split_backward_schedule, layout=True),
    "rotated": Feature("parallelism.data_parallel_shard_method = 'rotated'",
                       lambda s: s.config.parallelism.data_parallel_shard_method == "rotated"),
    "tp": Feature("tensor_parallel_degree > 1", lambda s: s.tp > 1, layout=True),
    "cp_block_causal": Feature("context_parallel_degree > 1 with model.attention_mask = 'block_causal'",
                               lambda s: s.cp > 1 and s.config.model.attention_mask == "block_causal"),
    "cp_alltoall": Feature("parallelism.context_parallel_rotate_method = 'alltoall'",
                           lambda s: s.cp > 1 and s.config.parallelism.context_parallel_rotate_method == "alltoall"),
    "cp_ring": Feature("parallelism.context_parallel_method = 'ring'",
                       lambda s: s.cp > 1 and s.config.parallelism.context_parallel_method == "ring"),
    "cp_gathered_kv": Feature(
        "context parallelism over gathered keys and values (parallelism.context_parallel_method = 'allgather_kv', "
        "the default, or model.attention_mask = 'block_causal')",
        lambda s: s.cp > 1 and (s.config.parallelism.context_parallel_method == "allgather_kv"
                                or s.config.model.attention_mask == "block_causal")),
    # Performance
    "compile_model": Feature("compile.enable with 'model' in compile.components", _compile_model),
    "no_compile_model": Feature("compile.enable = false (or 'model' not in compile.components)",
                                lambda s: not _compile_model(s)),
    "per_op_ac": Feature("activation_checkpoint.selective_ac_option = 'op'", _ac("selective", "op")),
    "float8": Feature("model.converters = quantize.linear.float8", _float8),
    "fsdp_reshard_policy": Feature("parallelism.fsdp_reshard_after_forward = 'always' or 'never'",
                                   lambda s: s.config.parallelism.fsdp_reshard_after_forward != "default"),
    "float8_scale_precompute": Feature(
        "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
        lambda s: _float8(s) and s.config.quantize.linear.float8.enable_fsdp_float8_all_gather
        and s.config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp),
    "float8_all_gather": Feature(
        "quantize.linear.float8.enable_fsdp_float8_all_gather",
        lambda s: _float8(s) and s.config.quantize.linear.float8.enable_fsdp_float8_all_gather),
    "async_tp": Feature("parallelism.enable_async_tensor_parallel",
                        lambda s: s.config.parallelism.enable_async_tensor_parallel),
    "cpu_offload": Feature("training.enable_cpu_offload", lambda s: s.config.training.enable_cpu_offload),
    "on_cpu": Feature("a run on the CPU", lambda s: s.device_type == "cpu", layout=True),
    # Communication
    "gradient_compression": Feature("comm.gradient_compression (loco, error_feedback, qsdp)",
                                    lambda s: s.config.comm.gradient_compression != "none"),
    "qsdp_weights": Feature("comm.weight_quantization = 'qsdp'",
                            lambda s: s.config.comm.weight_quantization != "none"),
    # Health and resilience
    "rerun_bad_steps": Feature("health.rerun_bad_steps", lambda s: s.config.health.rerun_bad_steps),
    "spike_guard": Feature("health.spike_sigma > 0", lambda s: s.config.health.spike_sigma > 0),
    "fault_tolerance": Feature("fault_tolerance.enable", lambda s: s.config.fault_tolerance.enable),
    "dry_run": Feature("comm.mode = 'fake_backend' (the dry run)", lambda s: s.config.comm.mode == "fake_backend"),
    "dry_run_on_fake_tensors": Feature("comm.mode = 'fake_backend' on fake tensors (the dry run's default)",
                                       lambda s: s.config.comm.mode == "fake_backend" and s.config.comm.fake_tensors),
}


@dataclass(frozen=True)
class Refusal:
    first: str
    second: str
    why: str
    instead: str


REFUSALS: list[Refusal] = [
    Refusal("gradient_compression", "no_fsdp", "gradient compression replaces FSDP's reduce-scatter, which this "
            "layout does not run", "shard over 2 or more ranks (data_parallel_shard_degree)"),
    Refusal("qsdp_weights", "no_fsdp", "weight quantization replaces FSDP's all-gather, which this layout does not "
            "run", "shard over 2 or more ranks (data_parallel_shard_degree)"),
    Refusal("gradient_compression", "replica_all_reduce", "FSDP2's replica all-reduce cannot be replaced through its "
            "hooks (set_requires_all_reduce(False) holds the gradients back for a later backward, "
            "set_all_reduce_hook runs after the full-precision all-reduce)", "shard over all data-parallel ranks "
            "(data_parallel_replicate_degree = 1), or exchange across replicas with optimizer.name = FlexDeMo"),
    Refusal("qsdp_weights", "replica_all_reduce", "FSDP2's replica all-reduce cannot be replaced through its hooks",
            "shard over all data-parallel ranks (data_parallel_replicate_degree = 1)"),
    Refusal("qsdp_weights", "float8_all_gather", "the float8 all-gather already quantizes the weights FSDP "
            "gathers", "choose one of them"),
    Refusal("cp_block_causal", "cp_ring", "torch's ring attention is causal only; block-causal context parallelism "
            "all-gathers the grouped keys and values", "use parallelism.context_parallel_method = 'allgather_kv'"),
    Refusal("cp_alltoall", "cp_gathered_kv", "the rotate method is the ring's: it passes keys and values from rank "
            "to rank, and this context parallelism all-gathers them once per layer", "leave "
            "parallelism.context_parallel_rotate_method at 'allgather' (or, for causal attention without documents, "
            "set parallelism.context_parallel_method = 'ring' to rotate them)"),
    Refusal("async_tp", "on_cpu", "async TP fuses collectives into matmuls through CUDA symmetric memory",
            "turn it off, or run on CUDA GPUs"),
    Refusal("async_tp", "no_compile_model", "async TP is a compiler pass over the model's blocks",
            "set compile.enable = true with 'model' in compile.components"),
    Refusal("compile_model", "tp_on_cpu", "torch's compiled backward of a sequence-parallel block fails inside "
            "DTensor on the CPU", "leave 'model' out of compile.components under TP on the CPU (TP blocks compile "
            "on CUDA GPUs)"),
    Refusal("compile_model", "split_backward_pp", "a compiled block's backward is one graph and cannot run its "
            "input and weight gradients apart", "use a whole-backward schedule (GPipe, 1F1B, Interleaved1F1B, "
            "LoopedBFS), or leave 'model' out of compile.components"),
    Refusal("per_op_ac", "split_backward_pp", "per-op checkpointing lets a block run backward once, and the schedule "
            "runs it twice (input, then weight gradients)", "use activation_checkpoint.mode full or none, a "
            "per-block option (selective_ac_option = N), or a whole-backward schedule"),
    Refusal("dry_run", "split_backward_pp", "torch's memory tracker cannot follow the split backward's "
            "torch.autograd.grad passes", "dry-run the same stages with a whole-backward schedule, or predict "
            "the layout with scripts/plan.py --predict"),
    Refusal("cpu_offload", "on_cpu", "it keeps FSDP's shards in host memory, where a CPU run keeps them already",
            "turn it off, or run on GPUs"),
    Refusal("cpu_offload", "no_fsdp", "it offloads FSDP's shards, and this layout has none",
            "turn it off, or shard over more ranks"),
    Refusal("cpu_offload", "float8_scale_precompute", "the scales' all-reduce runs over NCCL, which cannot reach the "
            "offloaded shards in host memory", "turn one of the two off"),
    Refusal("rotated", "tp", "it splits whole nn.Linear weights by rows, and tensor parallelism has split them "
            "already", "use data_parallel_shard_method = 'fsdp' with TP, or rotate without TP "
            "(tensor_parallel_degree = 1)"),
    Refusal("rotated", "no_fsdp", "it rotates the weight shards over the data_parallel_shard_degree x "
            "context_parallel_degree ranks, and this layout has one", "set data_parallel_shard_degree to 2 or more"),
    Refusal("rotated", "replica_all_reduce", "its ring spans the shard ranks of one replica, and the gradients of "
            "its shards are not all-reduced across replicas", "rotate over all data-parallel ranks "
            "(data_parallel_replicate_degree = 1), or use data_parallel_shard_method = 'fsdp' for HSDP or DDP"),
    Refusal("rotated", "float8", "it rotates the weights of plain nn.Linear layers, and Float8 replaces them",
            "use data_parallel_shard_method = 'fsdp' with Float8, or leave model.converters empty"),
    Refusal("rotated", "gradient_compression", "compression replaces FSDP's reduce-scatter, and rotated tensor "
            "parallelism reduces the gradients in its own rotation", "use data_parallel_shard_method = 'fsdp' "
            "with compression"),
    Refusal("rotated", "qsdp_weights", "weight quantization replaces FSDP's all-gather, which rotated tensor "
            "parallelism does not run", "use data_parallel_shard_method = 'fsdp' with weight quantization"),
    Refusal("rotated", "cpu_offload", "it offloads FSDP's shards, and rotated tensor parallelism computes on "
            "its own shard in device memory", "turn it off, or use data_parallel_shard_method = 'fsdp'"),
    Refusal("rotated", "fsdp_reshard_policy", "rotated tensor parallelism never gathers a weight, so there is "
            "nothing to free after forward", "leave parallelism.fsdp_reshard_after_forward = 'default'"),
    Refusal("rerun_bad_steps", "fault_tolerance", "a re-run would need the other replica groups' gradients of that "
            "step again, and they have moved on", "set health.no_rerun_bad_steps"),
    Refusal("spike_guard", "fault_tolerance", "each replica group judges its own loss, and groups that decided "
            "differently would hold different weights", "set health.spike_sigma = 0"),
    Refusal("fault_tolerance", "dry_run", "a dry run plays one rank of one job", "dry-run without fault tolerance"),
]


@dataclass(frozen=True)
class MethodRefusal:
    """A refusal a registered method (an optimizer, a gradient compression) declares beside its implementation:
    the method, with the FEATURES key it does not compose with."""

    feature: str
    why: str
    instead: str


def _method_refusals() -> list[Refusal]:
    """The refusals the registries declare, as pairs: (method feature, other feature)."""
    from torchtitan.components.optimizers import optimizer_names, optimizer_spec

    found = []
    for name in optimizer_names():
        for refusal in optimizer_spec(name).refuses:
            found.append(Refusal(f"optimizer:{name}", refusal.feature, refusal.why, refusal.instead))
    return found


def method_features() -> dict[str, Feature]:
    """One feature per registered optimizer: optimizer.name = '<name>'."""
    from torchtitan.components.optimizers import optimizer_names

    def named(name: str) -> Callable[[Setup], bool]:
        return lambda setup: setup.config.optimizer.name == name
    return {f"optimizer:{name}": Feature(f"optimizer.name = '{name}'", named(name)) for name in optimizer_names()}


def features() -> dict[str, Feature]:
    return {**FEATURES, **method_features()}


def refusals() -> list[Refusal]:
    return [*REFUSALS, *_method_refusals()]


def active_features(setup: Setup) -> set[str]:
    return {name for name, feature in features().items() if feature.on(setup)}


def refusal_message(refusal: Refusal) -> str:
    every = features()
    return (f"option {every[refusal.first].option}: does not compose with {every[refusal.second].option} "
            f"({refusal.why}); {refusal.instead}")


def refused_pairs(setup: Setup) -> list[Refusal]:
    """The refusals whose two features are both on."""
    active = active_features(setup)
    return [refusal for refusal in refusals() if refusal.first in active and refusal.second in active]


def check_composition(setup: Setup) -> None:
    """Refuse, in one line, the first pair of features of this run that does not compose."""
    if refused := refused_pairs(setup):
        raise UserError(refusal_message(refused[0]))


def check_options(config: Any) -> None:
    """The refusals that the options alone decide (neither feature depends on the layout or the device), when the
    options are read: a mistake in a config file fails before any process starts."""
    every = features()
    degrees = config.parallelism
    # A degree of -1 (the ranks left over) is known only at start-up; the features that read it are layout ones.
    setup = Setup(config, degrees.data_parallel_replicate_degree, max(degrees.data_parallel_shard_degree, 1),
                  degrees.context_parallel_degree, degrees.tensor_parallel_degree,
                  degrees.pipeline_parallel_degree, device_type="")
    active = {name for name, feature in every.items() if not feature.layout and feature.on(setup)}
    for refusal in refusals():
        if refusal.first in active and refusal.second in active:
            raise UserError(refusal_message(refusal))


def setup_of(config: Any, parallel_dims: Any, device_type: str) -> Setup:
    from torchtitan.distributed.pipeline_parallel import is_split_backward

    return Setup(config, parallel_dims.dp_replicate, parallel_dims.dp_shard, parallel_dims.cp, parallel_dims.tp,
                 parallel_dims.pp, device_type,
                 split_backward_schedule=parallel_dims.pp > 1 and is_split_backward(
                     config.parallelism.pipeline_parallel_schedule))


def matrix_markdown() -> str:
    """The table of refused pairs (docs/compatibility.md): every pair not listed composes."""
    every = features()
    rows = ["| feature | does not compose with | why | use instead |", "|---|---|---|---|"]
    for refusal in refusals():
        rows.append(f"| {every[refusal.first].option} | {every[refusal.second].option} | {refusal.why} | "
                    f"{refusal.instead} |")
    return "\n".join(rows)
