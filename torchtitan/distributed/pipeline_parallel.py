"""Pipeline parallelism: split the model into stages, parallelise each stage, and build the schedule.

Gradients: the trainer's loss is a sum of token cross-entropies divided by the global count of valid tokens, so the
gradients summed over micro-batches already equal the non-pipelined gradients. The schedules' default
(`scale_grads=True`) divides them once more by the number of micro-batches; it is turned off here.

FSDP: the schedules switch gradient synchronisation and resharding after backward off for every micro-batch but
the last and reduce-scatter once per step (`PipelineStage.perform_reduce_grad`); with FSDP's
`reshard_after_forward=False` under PP (the default) the parameters stay gathered across micro-batches.

Stage shapes are not given to `PipelineStage`: at the first step (and when switching between training and
evaluation) it runs the first micro-batch once to learn them. That holds whatever the layout does to the hidden
states between stages: (micro-batch, seq / cp / tp, dim) plain tensors under sequence-parallel TP, whose blocks
return local shards, and a different dtype under mixed precision or a different length in validation.
"""

import inspect
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (FORWARD, PipelineScheduleMulti, PipelineScheduleSingle,
                                                    ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                                    ScheduleZBVZeroBubble, get_schedule_class)
from torch.distributed.tensor import DTensor, Shard

from torchtitan.config import JobConfig, validation_shape
from torchtitan.distributed import torch_compat
from torchtitan.distributed.context_parallel import gathers_keys_and_values
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.errors import UserError
from torchtitan.models.llama3.model import DocumentMask, document_mask
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.pipeline import (LAYERS_PER_STAGE_OPTION, SPLIT_POINTS_OPTION, build_stage_module,
                                               requested_stage_count, split_into_stages, stage_ids_for_rank)
from torchtitan.tools.logging import logger

Schedule = PipelineScheduleSingle | PipelineScheduleMulti

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULE_OPTION = "parallelism.pipeline_parallel_schedule"
CSV_OPTION = "parallelism.pipeline_parallel_schedule_csv"
MICROBATCH_OPTION = "parallelism.pipeline_parallel_microbatch_size"
ROUNDS_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
V_SHAPED = (ScheduleZBVZeroBubble, ScheduleDualPipeV)
# These split each backward into an input-gradient and a later weight-gradient pass.
SPLIT_BACKWARD = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)


@dataclass(frozen=True)
class PipelinePlan:
    schedule_name: str
    schedule_class: type[Schedule]
    n_microbatches: int
    stage_names: list[list[str]]
    """The module names each stage keeps, by stage index."""
    v_shaped: bool

    @property
    def num_stages(self) -> int:
        return len(self.stage_names)

    @property
    def multi_stage(self) -> bool:
        return issubclass(self.schedule_class, PipelineScheduleMulti)


def plan_pipeline(model: nn.Module, pp_degree: int, config: JobConfig) -> PipelinePlan:
    """Check the pipeline options against the model and each other; no process group is needed."""
    parallelism = config.parallelism
    name, schedule_class = resolve_schedule(parallelism.pipeline_parallel_schedule)
    multi_stage = issubclass(schedule_class, PipelineScheduleMulti)
    csv_path = parallelism.pipeline_parallel_schedule_csv
    if csv_path:
        if not multi_stage:
            raise UserError(f"option {CSV_OPTION}: a custom schedule runs on the multi-stage runtime, but "
                            f"{SCHEDULE_OPTION} = {name} is a single-stage schedule; name the multi-stage schedule "
                            f"whose stage placement the CSV uses: {', '.join(_multi_stage_schedules())}")
        if not os.path.isfile(csv_path):
            raise UserError(f"option {CSV_OPTION}: {csv_path!r} is not a file")
    n_microbatches = microbatch_count(config.training.local_batch_size, parallelism.pipeline_parallel_microbatch_size)
    n_layers = len(model.layers)
    split_points = parallelism.pipeline_parallel_split_points
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    num_stages = requested_stage_count(n_layers, pp_degree * (2 if multi_stage else 1), split_points,
                                       layers_per_stage)
    v_shaped = issubclass(schedule_class, V_SHAPED)
    _check_stage_count(num_stages, n_layers, pp_degree, name, schedule_class, split_points, layers_per_stage)
    if not csv_path:
        _check_microbatches(n_microbatches, name, pp_degree, num_stages)
    validation_batch_size, validation_seq_len = validation_shape(config)
    if config.validation.enable and not torch_compat.pipeline_shapes_per_mode() and \
            (validation_batch_size, validation_seq_len) != (config.training.local_batch_size, config.training.seq_len):
        raise UserError(f"options validation.local_batch_size / validation.seq_len: under pipeline parallelism torch "
                        f"{torch.__version__} learns the stages' shapes once (2.13 and later learn them again for "
                        f"evaluation), so validation must use training's ({config.training.local_batch_size} x "
                        f"{config.training.seq_len}), not {validation_batch_size} x {validation_seq_len}; leave "
                        f"[validation]'s shape unset, or use torch 2.13 or newer")
    if config.validation.enable and validation_batch_size % n_microbatches:
        raise UserError(f"option validation.local_batch_size: under pipeline parallelism a validation batch is "
                        f"split into the {n_microbatches} training micro-batches, so "
                        f"{validation_batch_size} must be a multiple of {n_microbatches}")
    stage_names = split_into_stages(model, num_stages, split_points=split_points, layers_per_stage=layers_per_stage)
    return PipelinePlan(name, schedule_class, n_microbatches, stage_names, v_shaped)


def is_multi_stage(name: str) -> bool:
    """Whether schedule `name` runs several stages per rank (an unknown name is refused by plan_pipeline)."""
    try:
        return issubclass(resolve_schedule(name)[1], PipelineScheduleMulti)
    except UserError:
        return False


def is_split_backward(name: str) -> bool:
    """Whether schedule `name` runs each backward as an input- and a later weight-gradient pass."""
    try:
        return issubclass(resolve_schedule(name)[1], SPLIT_BACKWARD)
    except UserError:
        return False


def resolve_schedule(name: str) -> tuple[str, type[Schedule]]:
    """The canonical name (matched case-insensitively, as torch does) and torch's schedule class."""
    canonical = {schedule.lower(): schedule for schedule in SCHEDULES}.get(name.lower())
    if canonical is None:
        raise UserError(f"option {SCHEDULE_OPTION}: unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return canonical, get_schedule_class(canonical)


def _multi_stage_schedules() -> list[str]:
    return [name for name in SCHEDULES if issubclass(get_schedule_class(name), PipelineScheduleMulti)]


def microbatch_count(local_batch_size: int, microbatch_size: int) -> int:
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        divisors = [d for d in range(1, local_batch_size + 1) if local_batch_size % d == 0]
        raise UserError(f"option {MICROBATCH_OPTION}: {microbatch_size} does not divide training.local_batch_size "
                        f"({local_batch_size}) into whole micro-batches; valid: "
                        f"{', '.join(map(str, divisors))} (or change training.local_batch_size)")
    return local_batch_size // microbatch_size


def _check_stage_count(num_stages: int, n_layers: int, pp_degree: int, name: str,
                       schedule_class: type[Schedule], split_points: list[str],
                       layers_per_stage: int | None) -> None:
    fits, needed = _stage_count_rule(schedule_class, pp_degree)
    if fits(num_stages):
        return
    requirement = f"schedule {name} on pipeline_parallel_degree {pp_degree} needs {needed}"
    if split_points:
        raise UserError(f"option {SPLIT_POINTS_OPTION}: {','.join(split_points)} makes {num_stages} stages, but "
                        f"{requirement}; give one split point fewer than that many stages")
    valid = [k for k in range(1, n_layers + 3) if fits(math.ceil((n_layers + 2) / k))]
    raise UserError(f"option {LAYERS_PER_STAGE_OPTION}: {layers_per_stage} units per stage make {num_stages} stages "
                    f"of the {n_layers} blocks + embedding + output, but {requirement}; valid: "
                    f"{', '.join(map(str, valid)) or 'none (choose another schedule or degree)'}")


def _stage_count_rule(schedule_class: type[Schedule], pp_degree: int) -> tuple[Callable[[int], bool], str]:
    """Which stage counts the schedule can run, and that rule in words."""
    if issubclass(schedule_class, PipelineScheduleSingle):
        return (lambda count: count == pp_degree), f"exactly {pp_degree} stages (one per rank)"
    if issubclass(schedule_class, V_SHAPED):
        return (lambda count: count == 2 * pp_degree), f"exactly {2 * pp_degree} stages (two per rank)"
    return ((lambda count: count % pp_degree == 0 and count >= 2 * pp_degree),
            f"a multiple of {pp_degree} stages, at least {2 * pp_degree} (two or more per rank)")


def _check_microbatches(n_microbatches: int, name: str, pp_degree: int, num_stages: int) -> None:
    """The micro-batch counts torch's schedules accept (GPipe, LoopedBFS and ZBVZeroBubble take any)."""
    hint = f"set training.local_batch_size / {MICROBATCH_OPTION} accordingly"
    if name == "1F1B" and n_microbatches < pp_degree:
        raise UserError(f"option {MICROBATCH_OPTION}: schedule 1F1B needs at least as many micro-batches as stages "
                        f"({pp_degree}), but training.local_batch_size / {MICROBATCH_OPTION} gives "
                        f"{n_microbatches}; {hint}, or use GPipe")
    if name == "DualPipeV" and n_microbatches < num_stages:
        raise UserError(f"option {MICROBATCH_OPTION}: schedule DualPipeV needs at least as many micro-batches as "
                        f"stages ({num_stages}), but training.local_batch_size / {MICROBATCH_OPTION} gives "
                        f"{n_microbatches}; {hint}, or use ZBVZeroBubble")
    if name in ROUNDS_SCHEDULES and n_microbatches % _rounds(n_microbatches, pp_degree):
        valid = [count for count in range(1, 2 * n_microbatches + 1) if count % _rounds(count, pp_degree) == 0]
        nearest = sorted(valid, key=lambda count: abs(count - n_microbatches))[:3]
        raise UserError(f"option {MICROBATCH_OPTION}: schedule {name} runs the micro-batches in "
                        f"{_rounds(n_microbatches, pp_degree)} rounds (micro-batches // pipeline_parallel_degree "
                        f"{pp_degree}), which must divide them, but training.local_batch_size / {MICROBATCH_OPTION} "
                        f"gives {n_microbatches}; valid counts nearby: {', '.join(map(str, sorted(nearest)))}; {hint}")


def _rounds(n_microbatches: int, pp_degree: int) -> int:
    return max(1, n_microbatches // pp_degree)


def pipeline_llama(model: nn.Module, world_mesh: DeviceMesh, parallel_dims: ParallelDims, config: JobConfig,
                   device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   ) -> tuple[Schedule, list[nn.Module], bool, bool]:
    """Split the meta `model`, parallelise this rank's stages, and build the schedule.

    Returns (schedule, this rank's stage modules in stage order, whether it runs the first stage, whether it runs
    the last). `loss_fn(logits, labels)` must already be normalised by the global count of valid tokens.
    """
    pp_mesh = world_mesh["pp"]
    pp_rank, pp_degree = pp_mesh.get_local_rank(), pp_mesh.size()
    plan = plan_pipeline(model, pp_degree, config)
    if plan.v_shaped and torch_compat.release() < (2, 13) and dist.get_backend(pp_mesh.get_group()) == "gloo":
        # Measured on torch 2.11: "Pair is not connected" at the first step, for ZBVZeroBubble and DualPipeV alike.
        raise UserError(f"option {SCHEDULE_OPTION}: {plan.schedule_name} runs two stages per rank that exchange with "
                        f"the same neighbour both ways, which gloo's point-to-point set-up fails on torch "
                        f"{torch.__version__} (2.13 and later set the pairs up first); use a looped schedule "
                        f"(Interleaved1F1B, InterleavedZeroBubble), or torch 2.13 or newer")
    stages, parts = [], []
    for stage_id in stage_ids_for_rank(pp_rank, pp_degree, plan.num_stages, plan.v_shaped):
        part = parallelize_llama(build_stage_module(model, plan.stage_names[stage_id]), world_mesh,
                                 parallel_dims, config)
        shapes = (static_stage_shapes(part, config, parallel_dims, world_mesh)
                  if config.comm.mode == "fake_backend" else {})
        # torch before 2.13 takes no gradient shapes (it derives them from the outputs).
        shapes = {name: value for name, value in shapes.items() if name in _STAGE_PARAMETERS}
        stages.append(PipelineStage(part, stage_id, plan.num_stages, device, group=pp_mesh.get_group(), **shapes))
        parts.append(part)
        logger.info(f"pipeline stage {stage_id} of {plan.num_stages} on pp rank {pp_rank}: "
                    f"{_describe(plan.stage_names[stage_id])}")
    if (config.model.attention_mask == "block_causal" or gathers_keys_and_values(config)) and len(parts) > 1:
        shared = SharedDocumentMasks(parts[0].build_document_mask, plan.n_microbatches)
        for part in parts:
            part.build_document_mask = shared
    schedule = _build_schedule(plan, stages, _plain_loss(loss_fn), config.parallelism.pipeline_parallel_schedule_csv)
    logger.info(f"pipeline schedule {plan.schedule_name}: {plan.num_stages} stages on {pp_degree} ranks, "
                f"{plan.n_microbatches} micro-batches of {config.parallelism.pipeline_parallel_microbatch_size}")
    return schedule, parts, any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)


class SharedDocumentMasks:
    """The block-causal mask of each micro-batch (under context parallelism over gathered keys, block-causal or
    causal), built once for all the pipeline stages of this rank (`Transformer.build_document_mask`).

    A looped, interleaved or V-shaped schedule runs every micro-batch through two or more stages on one rank, and
    hands each of them the same document-id and position tensors (the schedule splits the step's keyword inputs once
    and passes micro-batch i's to every stage): a later stage finds the mask, which the first one built from those
    very tensors, here instead of building it again (on GPUs a compiled `create_block_mask`; under context
    parallelism an all-gather over the CP group as well). Masks are matched by the identity of their inputs, never
    by value, and the entries hold those inputs, so an identity cannot be reused by another tensor while its entry
    lives. At most `size` entries (one step's micro-batches): a mask stays until a later micro-batch's replaces it.
    Stages on other pipeline ranks build their own: they have their own memory (and under CP their own CP group).
    Micro-batches hold different sequences, so each has its own mask."""

    def __init__(self, build: Callable[[torch.Tensor, torch.Tensor | None], DocumentMask] | None, size: int):
        self.build = build
        self.masks: deque[tuple[torch.Tensor | None, torch.Tensor | None, DocumentMask]] = deque(maxlen=size)

    def __call__(self, document_ids: torch.Tensor | None, positions: torch.Tensor | None) -> DocumentMask:
        for ids, known_positions, mask in self.masks:
            if ids is document_ids and known_positions is positions:
                return mask
        mask = document_mask(document_ids) if self.build is None else self.build(document_ids, positions)
        self.masks.append((document_ids, positions, mask))
        return mask


_STAGE_PARAMETERS = inspect.signature(PipelineStage.__init__).parameters


def static_stage_shapes(stage: nn.Module, config: JobConfig, parallel_dims: ParallelDims,
                        world_mesh: DeviceMesh) -> dict[str, tuple[torch.Tensor, ...]]:
    """A stage's inputs, outputs and their gradients as meta tensors, for a run that cannot learn them from its
    neighbours at the first step: a dry run, whose fake backend carries no data.

    Between stages travel plain hidden states (micro-batch, seq / cp / tp, dim): sequence-parallel blocks return
    local shards; their dtype is FSDP/DDP's param_dtype, or fp32 under autocast (the embedding's output starts the
    residual stream in fp32). The last stage returns logits, vocabulary-sharded DTensors under loss parallelism.
    """
    from torchtitan.distributed.fsdp import TORCH_DTYPES

    args, training = stage.args, config.training
    micro_batch = config.parallelism.pipeline_parallel_microbatch_size
    tokens = training.seq_len // parallel_dims.cp
    wrapped = parallel_dims.fsdp_enabled or parallel_dims.ddp_enabled
    dtype = TORCH_DTYPES[training.mixed_precision_param] if wrapped else torch.float32
    hidden = torch.empty(micro_batch, tokens // parallel_dims.tp, args.dim, dtype=dtype, device="meta",
                         requires_grad=True)
    if stage.tok_embeddings is not None:
        inputs = torch.empty(micro_batch, tokens, dtype=torch.int64, device="meta")
    else:
        inputs = hidden
    if stage.output is None:
        outputs = hidden
    else:
        logits_dtype = dtype if wrapped or training.mixed_precision_param == "float32" else \
            TORCH_DTYPES[training.mixed_precision_param]
        if parallel_dims.tp_enabled and not config.parallelism.disable_loss_parallel:
            local = torch.empty(micro_batch, tokens, args.vocab_size // parallel_dims.tp, dtype=logits_dtype,
                                device="meta", requires_grad=True)
            outputs = DTensor.from_local(local, world_mesh["tp"], [Shard(2)], run_check=False)
        else:
            outputs = torch.empty(micro_batch, tokens, args.vocab_size, dtype=logits_dtype, device="meta",
                                  requires_grad=True)
    return {"input_args": (inputs,), "output_args": (outputs,),
            "input_grads": (None if stage.tok_embeddings is not None else hidden,), "output_grads": (outputs,)}


def _plain_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Under loss parallelism the loss is a replicated DTensor; the trainer reduces the schedule's per-micro-batch
    losses with plain collectives, so hand them over as plain tensors (the backward still reaches the logits)."""
    def loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        value = loss_fn(pred, labels)
        return value.full_tensor() if isinstance(value, DTensor) else value
    return loss


class _ForwardOnlyEval:
    """Evaluation for the multi-stage schedules: forwards only.

    torch's multi-stage runtime replays the training action list in `eval()`, backward actions included; with no
    backward, the V-shaped schedules then fail handing a gradient between their two stages on one rank. Here eval
    runs the schedule's own forward order, lowered again with its communication and FSDP unshard/reshard actions.
    """

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        training_order = self.pipeline_order_with_comms
        self.pipeline_order_with_comms = self._forward_only_order()
        try:
            return super().eval(*args, target=target, losses=losses, **kwargs)
        finally:
            self.pipeline_order_with_comms = training_order

    def _forward_only_order(self) -> dict[int, list]:
        add_unshard_reshard = torch_compat.get("add_unshard_reshard")
        forwards = {rank: add_unshard_reshard([forward for action in actions if action is not None
                                               for forward in _forwards_of(action)])
                    for rank, actions in self.pipeline_order.items()}
        return torch_compat.get("add_send_recv")(
            forwards, stage_to_rank=lambda stage: self.stage_index_to_group_rank[stage], num_stages=self._num_stages)


def _forwards_of(action) -> list:
    """The forward part of an action (DualPipeV overlaps a forward with a backward in one action)."""
    parts = action.sub_actions if action.sub_actions is not None else (action,)
    return [part for part in parts if part.computation_type == FORWARD]


def _with_forward_only_eval(schedule_class: type[Schedule]) -> type[Schedule]:
    return type(schedule_class.__name__, (_ForwardOnlyEval, schedule_class), {"__module__": __name__})


def _build_schedule(plan: PipelinePlan, stages: list[PipelineStage], loss_fn: Callable,
                    csv_path: str | None) -> Schedule:
    if not plan.multi_stage:
        return plan.schedule_class(stages[0], plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if not csv_path:
        return _with_forward_only_eval(plan.schedule_class)(stages, plan.n_microbatches, loss_fn=loss_fn,
                                                            scale_grads=False)
    schedule = _with_forward_only_eval(torch_compat.get("PipelineScheduleRuntime"))(
        stages, plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    try:
        schedule._load_csv(csv_path)
    except (AssertionError, KeyError, RuntimeError, ValueError) as e:
        raise UserError(f"option {CSV_OPTION}: {csv_path!r} is not a valid schedule for {plan.num_stages} stages on "
                        f"{stages[0].group_size} ranks and {plan.n_microbatches} micro-batches: {e}") from None
    pp_rank = stages[0].group_rank
    for stage in stages:
        csv_rank = schedule.stage_index_to_group_rank[stage.stage_index]
        if csv_rank != pp_rank:
            raise UserError(f"option {CSV_OPTION}: {csv_path!r} runs stage {stage.stage_index} on rank {csv_rank}, "
                            f"but schedule {plan.schedule_name} places it on rank {pp_rank}; set "
                            f"{SCHEDULE_OPTION} to the schedule whose placement the CSV follows "
                            f"(looped: Interleaved1F1B; V-shaped: ZBVZeroBubble)")
    return schedule


def _describe(names: list[str]) -> str:
    blocks = [name for name in names if name.startswith("layers.")]
    parts = [name for name in names if not name.startswith("layers.")]
    if blocks:
        first, last = blocks[0].split(".")[1], blocks[-1].split(".")[1]
        parts.insert(1 if "tok_embeddings" in names else 0, f"layers {first}-{last}" if first != last
                     else f"layer {first}")
    return ", ".join(parts)
