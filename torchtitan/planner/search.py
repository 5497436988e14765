"""Which layouts of a model fit a cluster, and how fast each is predicted to run.

A layout becomes trainer options (`overrides`) on top of the flavor's shipped TOML; its memory comes from the
analytic model (torchtitan/planner/memory.py, checked against the dry run) plus what the CUDA caching allocator
reserves on top, and its speed from torchtitan/planner/cost.py, with a range from the published runs like it
(torchtitan/planner/validation.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from torchtitan.config import JobConfig, parse_args
from torchtitan.config.model_shape import shape_overrides
from torchtitan.distributed.pipeline_parallel import is_multi_stage, resolve_schedule
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import llama3_flavors, model_args_for
from torchtitan.models.llama3.pipeline import requested_stage_count
from torchtitan.planner.cost import Layout, float8_gathered, step_time
from torchtitan.planner.hardware import GPU, headroom
from torchtitan.planner.memory import estimate
from torchtitan.planner.validation import envelope

GIB = 2**30
CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
PRESET_TOML = {"8B": "llama3_8b.toml", "70B": "llama3_70b.toml", "405B": "llama3_405b.toml",
               "debugmodel": "debug_model.toml"}
SCHEDULES = ("1F1B", "Interleaved1F1B")
# Causal context parallelism's methods (parallelism.context_parallel_method), searched both: the ring's exchange
# hides behind attention on NVLink and its kernel is FlashAttention's, where FlexAttention over gathered keys runs at
# its published fraction of it; the gathered keys and values are n_heads / n_kv_heads times fewer bytes, which wins
# where CP crosses hosts (docs/parallelism.md).
CP_METHODS = ("allgather_kv", "ring")


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    tps_per_gpu: float
    tps_without_overlap: float
    """Tokens/s per GPU if no communication overlapped compute (StepTime.seconds_without_overlap)."""
    tps_alone: float
    """Tokens/s of one rank with no communication at all (StepTime.seconds_alone): what a dry run on real tensors
    measures on one GPU."""
    peak_memory_gib: float
    """What the caching allocator reserves at the peak (the published runs' figure)."""
    tensor_peak_gib: float
    step_seconds: float
    overrides: list[str]
    tps_conservative: float = 0.0
    """The conservative end of the predicted range: tokens/s per GPU if no more communication hides behind compute
    than the validated rows hid (Envelope.max_overlap_ratio), the rest exposed, less the model's largest
    overprediction on the published rows like the layout (Envelope.error_band: the held-out rows, and where the
    layout lies outside the envelope, the rows that checked the same excess)."""
    tps_optimistic: float = 0.0
    """The optimistic end: the prediction plus the model's largest underprediction on the rows like the layout."""
    overlap_ratio: float = 0.0
    """Seconds of communication the prediction hides per second of compute."""
    outside_envelope: tuple[str, ...] = ()
    """What about the layout lies outside what the validated rows covered (validation.Envelope), each with its
    validated range; empty inside."""
    device_memory_gib: float = 0.0
    """What the GPU must hold: the reserved peak plus the CUDA context and NCCL's buffers (hardware.headroom), the
    figure the search compares with the GPU's memory, as the dry run's out-of-memory verdict does."""

    def as_json(self) -> dict:
        layout = asdict(self.layout)
        for name in ("row_split_embedding", "compiled_loss", "kept_pipeline_outputs"):  # of the published runs
            del layout[name]
        return {**layout, "tps_per_gpu": round(self.tps_per_gpu, 1),
                "tps_per_gpu_conservative": round(self.tps_conservative, 1),
                "tps_per_gpu_optimistic": round(self.tps_optimistic, 1),
                "tps_per_gpu_without_overlap": round(self.tps_without_overlap, 1),
                "overlap_ratio": round(self.overlap_ratio, 3),
                "outside_validated_envelope": list(self.outside_envelope),
                "tps_per_gpu_alone": round(self.tps_alone, 1),
                "peak_memory_gib": round(self.peak_memory_gib, 2),
                "device_memory_gib": round(self.device_memory_gib, 2),
                "step_seconds": round(self.step_seconds, 3), "overrides": self.overrides}


def reserved_gib(tensor_peak_bytes: float, gpu: GPU | None = None) -> float:
    """The caching allocator's reserved peak for a peak of live tensors (hardware.ALLOCATOR_FRAGMENTATION, or the
    fraction measured on a calibrated GPU)."""
    return tensor_peak_bytes / GIB + headroom(tensor_peak_bytes / GIB, gpu, {}).allocator_gib


def layout_overrides(layout: Layout, seq_len: int, n_layers: int) -> list[str]:
    """The trainer options that run `layout` on top of the flavor's TOML."""
    ac_mode, ac_option = {"none": ("none", "op"), "full": ("full", "op"), "op": ("selective", "op"),
                          "layer": ("selective", str(layout.ac_every))}[layout.ac]
    # Without PP the micro-batch is the trainer's local batch, accumulated up to the global batch.
    options = [
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(layout.local_batch if layout.pp > 1 else layout.microbatch),
        "--training.global_batch_size", str(layout.local_batch * layout.dp),
        "--parallelism.data_parallel_replicate_degree", str(layout.dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(layout.dp_shard),
        "--parallelism.tensor_parallel_degree", str(layout.tp),
        "--parallelism.pipeline_parallel_degree", str(layout.pp),
        "--parallelism.context_parallel_degree", str(layout.cp),
        "--activation_checkpoint.mode", ac_mode, "--activation_checkpoint.selective_ac_option", ac_option,
        "--model.converters", "quantize.linear.float8" if layout.float8 else "",
        "--compile.enable" if layout.compile else "--compile.no_enable",
        "--parallelism.enable_async_tensor_parallel" if layout.async_tp else
        "--parallelism.no_enable_async_tensor_parallel",
    ]
    if layout.compile:
        options += ["--compile.components", "model,loss" if layout.compiled_loss else "model"]
    if layout.rotated:
        options += ["--parallelism.data_parallel_shard_method", "rotated"]
    if layout.document_length:
        options += ["--model.attention_mask", "block_causal"]
    if layout.cp > 1:
        options += ["--parallelism.context_parallel_method", layout.cp_method]
        if layout.cp_method == "ring":
            options += ["--parallelism.context_parallel_rotate_method", layout.cp_rotate]
    if float8_gathered(layout):
        # Float8 all-gathers under FSDP: half the bytes of bf16 (TorchTitan's 405B recipe; tensorwise scaling only).
        options += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    elif layout.float8 and layout.float8_recipe != "tensorwise":
        options += ["--quantize.linear.float8.recipe_name", layout.float8_recipe]
    if layout.pp > 1:
        options += ["--parallelism.pipeline_parallel_schedule", layout.schedule,
                    "--parallelism.pipeline_parallel_microbatch_size", str(layout.microbatch)]
        if layout.stages_per_rank > 2:
            options += ["--parallelism.pipeline_parallel_layers_per_stage",
                        str(math.ceil((n_layers + 2) / (layout.stages_per_rank * layout.pp)))]
    return options


def trainer_config(flavor: str, layout: Layout, seq_len: int) -> JobConfig:
    toml = CONFIGS / PRESET_TOML.get(flavor, "debug_model.toml")
    n_layers = model_args_for(flavor, seq_len).n_layers
    return parse_args(["--job.config_file", str(toml), "--model.flavor", flavor,
                       *layout_overrides(layout, seq_len, n_layers)])


def predict(flavor: str, layout: Layout, seq_len: int, gpu: GPU, config: JobConfig | None = None,
            pipeline_rank: int | None = None, **constants) -> Prediction:
    """Speed and memory of one layout; `config` (a trainer config) when the layout comes from one, whose [model]
    shape options then replace the flavor's. The memory is the worst pipeline rank's, or `pipeline_rank`'s (the
    rank a published run logged)."""
    args = model_args_for(flavor, seq_len, overrides=shape_overrides(config.model) if config else None)
    if config is None:
        tensors = _layout_memory(flavor, dataclasses.replace(layout, async_tp=False), seq_len, pipeline_rank)
    else:
        tensors = estimate(config, layout.world_size, pipeline_rank=pipeline_rank).total
    step = step_time(args, layout, seq_len, gpu, **constants)
    tokens = layout.tokens_per_gpu(seq_len)
    validated = envelope()
    extra = headroom(tensors / GIB, gpu, {name: getattr(layout, name)
                                          for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")})
    conservative, optimistic = validated.tps_range(step, tokens, layout, seq_len, gpu)
    return Prediction(layout=layout, tps_per_gpu=tokens / step.seconds,
                      tps_without_overlap=tokens / step.seconds_without_overlap, tps_alone=tokens / step.seconds_alone,
                      peak_memory_gib=reserved_gib(tensors, gpu),
                      device_memory_gib=tensors / GIB + extra.total_gib,
                      tensor_peak_gib=tensors / GIB, step_seconds=step.seconds,
                      overrides=layout_overrides(layout, seq_len, args.n_layers),
                      tps_conservative=conservative, tps_optimistic=optimistic,
                      overlap_ratio=step.overlap_ratio,
                      outside_envelope=validated.outside(layout, seq_len, gpu, step.overlap_ratio))


@functools.lru_cache(maxsize=4096)
def _layout_memory(flavor: str, layout: Layout, seq_len: int, pipeline_rank: int | None = None) -> int:
    """Tensor peak of a layout (async TP does not change it), of its worst pipeline rank or of `pipeline_rank`."""
    return estimate(trainer_config(flavor, layout, seq_len), layout.world_size,
                    row_split_embedding=layout.row_split_embedding,
                    kept_pipeline_outputs=layout.kept_pipeline_outputs, pipeline_rank=pipeline_rank).total


def layout_from_config(config: JobConfig, world_size: int, document_length: float = 0.0) -> Layout:
    """The layout a trainer config describes (as the trainer resolves it); `document_length`: with
    model.attention_mask = block_causal, the documents' E[len^2] / E[len] in tokens (Layout.document_length)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(config.parallelism, world_size)
    parallelism, ac = config.parallelism, config.activation_checkpoint
    float8, float8_config = any("float8" in c for c in config.model.converters), config.quantize.linear.float8
    per_op = ac.selective_ac_option == "op"
    if config.model.attention_mask == "block_causal" and not 0 < document_length <= config.training.seq_len:
        raise UserError(f"option --document_length: {document_length:g}, but model.attention_mask is block_causal: "
                        f"give the documents' E[len^2] / E[len] in tokens (their length, if all are alike), 1 to "
                        f"training.seq_len ({config.training.seq_len})")
    step_batch = config.training.global_batch_size // dims.dp if config.training.global_batch_size > 0 else \
        config.training.local_batch_size
    schedule, stages_per_rank = None, 1
    if dims.pp > 1:
        # As the trainer splits (pipeline_parallel.plan_pipeline): a single-stage schedule (GPipe, 1F1B) one stage
        # per rank, a multi-stage one two unless the split options say otherwise.
        schedule, _ = resolve_schedule(parallelism.pipeline_parallel_schedule)
        layers = model_args_for(config.model.flavor, config.training.seq_len,
                                overrides=shape_overrides(config.model)).n_layers
        stages_per_rank = requested_stage_count(
            layers, dims.pp * (2 if is_multi_stage(schedule) else 1),
            parallelism.pipeline_parallel_split_points, parallelism.pipeline_parallel_layers_per_stage) // dims.pp
    return Layout(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, cp=dims.cp,
                  schedule=schedule,
                  stages_per_rank=stages_per_rank, local_batch=step_batch,
                  microbatch=parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else
                  config.training.local_batch_size,
                  ac={"none": "none", "full": "full", "selective": "op" if per_op else "layer"}[ac.mode],
                  ac_every=int(ac.selective_ac_option) if ac.mode == "selective" and not per_op else 2,
                  float8=float8, float8_recipe=float8_config.recipe_name or "tensorwise",
                  # Meaningful with Float8 only; without it the planner's default, so that layouts compare equal.
                  float8_all_gather=float8_config.enable_fsdp_float8_all_gather if float8 else True,
                  compile=config.compile.enable,
                  async_tp=parallelism.enable_async_tensor_parallel,
                  compiled_loss="loss" in config.compile.components,
                  document_length=document_length if config.model.attention_mask == "block_causal" else 0.0,
                  cp_method=parallelism.context_parallel_method, cp_rotate=parallelism.context_parallel_rotate_method,
                  rotated=parallelism.data_parallel_shard_method == "rotated")


# The schedules searched, with their stages per rank. GPipe and LoopedBFS have 1F1B's and Interleaved1F1B's bubble
# and hold every micro-batch. The zero-bubble schedules are left to --predict: they cannot run compiled blocks, and
# under activation checkpointing, which every searched layout has, their weight passes run the blocks' forward
# again, a peak the memory model does not count (docs/scaling.md, "Pipeline schedules").
PIPELINE_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatches(local_batch: int, pp: int) -> list[int]:
    """Micro-batch sizes to try: powers of two that split the local batch into a multiple of pp micro-batches
    (every schedule here accepts those counts); without PP, gradient accumulation steps."""
    sizes = [2**i for i in range(local_batch.bit_length()) if local_batch % 2**i == 0] + [local_batch]
    return sorted({size for size in sizes if (local_batch // size) % pp == 0})


def candidate_layouts(flavor: str, gpus: int, seq_len: int, global_batch: int, gpu: GPU,
                      document_length: float = 0.0, cp_methods: tuple[str, ...] = CP_METHODS,
                      cp_rotate: str = "allgather") -> list[Layout]:
    """Every layout of `gpus` GPUs that the model's shapes and the global batch allow; causal attention unless
    `document_length` (Layout.document_length); causal CP run by each of `cp_methods` (the ring rotating by
    `cp_rotate`), block-causal CP by gathered keys and values (the ring is causal only)."""
    args = model_args_for(flavor, seq_len)
    candidates = []
    # CP up to 4, and for long sequences up to one 8,192-token shard per rank (at most 32): a 256k sequence is what
    # context parallelism is for.
    cp_degrees = [2**i for i in range(6) if 2**i <= max(4, seq_len // 8192)]
    for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), cp_degrees):
        if gpus % (tp * pp * cp) or tp > gpu.gpus_per_host:
            continue
        if args.n_heads % tp or args.kv_heads % tp or args.vocab_size % tp or seq_len % (tp * 2 * cp if cp > 1
                                                                                         else tp):
            continue
        if pp > 1 and args.n_layers < 2 * pp:
            continue
        dp = gpus // (tp * pp * cp)
        if global_batch % dp:
            continue
        local_batch = global_batch // dp
        for dp_replicate in _divisors(dp):
            dp_shard = dp // dp_replicate
            if dp_replicate > 1 and dp_shard * cp * tp < gpu.gpus_per_host:
                continue  # replicas only across hosts
            schedules = [(None, 1)] if pp == 1 else PIPELINE_SCHEDULES
            # Without CP the method does nothing: one layout, with the trainer's default.
            methods = cp_methods if cp > 1 and not document_length else (Layout.cp_method,)
            for (schedule, v), microbatch, ac, float8, compile_, async_tp, cp_method in itertools.product(
                    schedules, _microbatches(local_batch, pp), ("op", "full"), (False, True), (False, True),
                    (False, True), methods):
                if async_tp and (tp == 1 or not compile_):
                    continue
                if float8 and gpu.fp8_flops == 0:
                    continue
                layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp,
                                schedule=schedule, stages_per_rank=v, local_batch=local_batch,
                                microbatch=microbatch, ac=ac, float8=float8, compile=compile_,
                                async_tp=async_tp, document_length=document_length,
                                cp_method=cp_method, cp_rotate=cp_rotate)
                candidates.append(layout)
                # Rotated tensor parallelism where it composes (config/compatibility.py): the shard ranks of one
                # replica, without TP or Float8.
                if dp_shard * cp > 1 and dp_replicate == 1 and tp == 1 and not float8:
                    candidates.append(dataclasses.replace(layout, rotated=True))
    return candidates


def exclusions(gpu: GPU) -> list[str]:
    """The techniques the search leaves out on `gpu`, each with its reason (plan.py prints them with the table)."""
    return [] if gpu.fp8_flops else [f"float8 layouts left out: {gpu.name} has no float8 "
                                      f"tensor cores"]


RANKINGS = {"conservative": "tps_conservative", "predicted": "tps_per_gpu", "without_overlap": "tps_without_overlap"}


def plan(flavor: str, gpus: int, gpu: GPU, seq_len: int, global_batch: int,
         fixed: dict[str, bool] | None = None, constants: dict[str, float] | None = None,
         rank_by: str = "conservative", document_length: float = 0.0, cp_methods: tuple[str, ...] = CP_METHODS,
         cp_rotate: str = "allgather") -> list[Prediction]:
    """The layouts that fit, fastest first, each with its fastest micro-batch; `fixed` pins techniques (float8,
    compile, async_tp) on or off; `constants` replace the model's fitted ones (cost.step_time's keywords);
    `rank_by` (RANKINGS): the conservative end of each layout's range (default: no more overlap than the validated
    rows had), the prediction (the optimistic end), or the speed it keeps if no communication overlaps compute;
    `document_length`, `cp_methods` and `cp_rotate`: the attention mask and the CP methods searched
    (candidate_layouts)."""
    if flavor not in llama3_flavors:
        raise UserError(f"option --flavor: unknown flavor {flavor!r}; valid: {', '.join(llama3_flavors)}")
    if (fixed or {}).get("float8") and not gpu.fp8_flops:
        raise UserError(f"option --float8: on, but {gpu.name} has no float8 tensor cores; use "
                        f"--float8 off, or a GPU with them")
    if not 0 <= document_length <= seq_len:
        raise UserError(f"option --document_length: {document_length:g} is not 0 (causal) or a length of 1 to "
                        f"--seq_len ({seq_len}) tokens")
    candidates = [layout for layout in candidate_layouts(flavor, gpus, seq_len, global_batch, gpu, document_length,
                                                         cp_methods, cp_rotate)
                  if all(getattr(layout, name) == value for name, value in (fixed or {}).items())]
    if not candidates:
        raise UserError(f"no layout of {gpus} GPUs divides flavor {flavor} (heads, KV heads, vocabulary) and a "
                        f"global batch of {global_batch} sequences of {seq_len}; try a global batch that is a "
                        f"multiple of the data-parallel degree, or another GPU count")
    fitting = []
    for layout in candidates:
        prediction = predict(flavor, layout, seq_len, gpu, **(constants or {}))
        if prediction.device_memory_gib <= gpu.memory_gib:
            fitting.append(prediction)
    if not fitting:
        raise UserError(f"flavor {flavor} does not fit {gpus} x {gpu.name} ({gpu.memory_gib} GiB) in any of "
                        f"{len(candidates)} layouts at seq_len {seq_len} and global batch {global_batch}: use more "
                        f"GPUs, a GPU with more memory, or a smaller batch")
    # Among equally fast layouts, the simplest first: fewer parallel dimensions, then fewer techniques, then fewer
    # micro-batches. The micro-batch size is tuned per layout: each layout is listed once, with its fastest one.
    figure = RANKINGS[rank_by]
    ranked = sorted(fitting, key=lambda p: (-round(getattr(p, figure), 1), _complexity(p.layout),
                                            -p.layout.microbatch))
    listed = {}
    for prediction in ranked:
        listed.setdefault(dataclasses.replace(prediction.layout, microbatch=0), prediction)
    return list(listed.values())


def _complexity(layout: Layout) -> int:
    return (sum(degree > 1 for degree in (layout.dp_replicate, layout.tp, layout.pp, layout.cp))
            + layout.float8 + layout.compile + layout.async_tp + (layout.ac != "op") + layout.rotated)
