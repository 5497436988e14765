"""A full-scale dry run: one process plays one rank of a world of any size, on fake tensors and the fake backend.

    NGPU=512 COMM_MODE=fake_backend CONFIG_FILE=train_configs/llama3_405b.toml ./run_train.sh
    python -m torchtitan.train --job.config_file ... --comm.mode fake_backend --comm.fake_world_size 512 \
        --comm.fake_rank 0

The real `Trainer` is built (mesh, model on meta, Float8, the pipeline split, TP, AC, FSDP, optimizer) inside
`FakeTensorMode`: tensors have shapes and dtypes but no storage, and every collective returns at once. Two
training steps run on fake batches of the configured shape; the second one is measured (the first creates the
optimizer state): this rank's peak memory by category from torch's own trackers, and every collective of the step.
The report goes to `<dump_folder>/dry_run.json` (its fields: torchtitan/tools/dry_run_report.py) and the log. No
tokenizer, data or checkpoint is read or written.

With `--comm.no_fake_tensors` the same rank runs on real tensors on this machine's device instead (its GPU if it has
one), the collectives still fake: comm.fake_steps steps, compile included, each timed, and the allocator's peak
memory. That is the rank's compute without communication, at full size on one GPU; the rank's share of the model
must fit it.

What a dry run on fake tensors does not execute: `torch.compile` (the blocks and the loss run eagerly: the traced
memory is eager's, an upper bound for compile; with compile on, the report adds the analytic model's compiled peak,
`compiled_estimate_gib`, which decides whether the run fits), and the numerics (fake tensors have no values: the
loss and gradient norm read as zero).
"""

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchtitan.config import JobConfig, to_toml
from torchtitan.config.compatibility import check_composition, setup_of
from torchtitan.config.model_shape import shape_overrides
from torchtitan.distributed import torch_compat
from torchtitan.distributed.fake import GIB, CollectiveCounter, StepMemoryTracker, dry_run_patches
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.errors import UserError
from torchtitan.models import spec_of
from torchtitan.planner.hardware import gpu_named, headroom
from torchtitan.planner.memory import estimate, require_planned_model
from torchtitan.tools.device_info import device_name, memory_stats
from torchtitan.tools.dry_run_report import read_report, write_report
from torchtitan.tools.logging import logger

def resolve_world(config: JobConfig) -> tuple[int, int]:
    """(rank, world size) of the dry run, from comm.fake_rank and comm.fake_world_size (or NGPU)."""
    world_size = config.comm.fake_world_size
    if world_size == 0:
        ngpu = os.environ.get("NGPU", "")
        if not ngpu.isdigit() or int(ngpu) < 1:
            raise UserError(f"option comm.fake_world_size: not set, and NGPU = {ngpu!r} is not a positive integer; "
                            f"give the number of GPUs to dry-run, e.g. --comm.fake_world_size 512 or NGPU=512")
        world_size = int(ngpu)
    if world_size < 1:
        raise UserError(f"option comm.fake_world_size: {world_size} must be a positive integer (or 0 for NGPU)")
    rank = config.comm.fake_rank
    if not 0 <= rank < world_size:
        raise UserError(f"option comm.fake_rank: {rank} is not a rank of a world of {world_size} (valid: 0 to "
                        f"{world_size - 1})")
    return rank, world_size


def _without_files(config: JobConfig, world_size: int) -> JobConfig:
    """The run's config with what a rank alone cannot do turned off: everything that reads or writes files, and
    async TP (its symmetric memory needs the peers' GPUs; the collectives it decomposes are the same)."""
    return dataclasses.replace(
        config,
        comm=dataclasses.replace(config.comm, fake_world_size=world_size),
        parallelism=dataclasses.replace(config.parallelism, enable_async_tensor_parallel=False),
        checkpoint=dataclasses.replace(config.checkpoint, enable=False),
        validation=dataclasses.replace(config.validation, enable=False),
        profiling=dataclasses.replace(config.profiling, enable_profiling=False, enable_memory_snapshot=False),
        metrics=dataclasses.replace(config.metrics, enable_tensorboard=False, enable_wandb=False),
    )


def dry_run_config(config: JobConfig, world_size: int) -> JobConfig:
    """The run's config, checked as the real run would check it, then with what a dry run on fake tensors does not
    execute turned off: files, async TP and torch.compile (the blocks run eagerly, whose memory bounds the compiled
    blocks' from above; the collectives are the same)."""
    dims = ParallelDims.from_config(config.parallelism, world_size)
    spec = spec_of(config)
    if config.compile.enable:
        require_planned_model(config, "a compiled dry run reports it (the blocks are traced eagerly); set "
                                      "compile.enable = false")
    spec.validate_parallelism(spec.build_args(config.model.flavor, config.training.seq_len, None,
                                              shape_overrides(config.model)), dims, config, config.comm.fake_device)
    check_composition(setup_of(config, dims, config.comm.fake_device))
    peak_flops = config.metrics.peak_flops
    if config.comm.fake_device == "cuda" and not peak_flops:
        peak_flops = gpu_named(config.comm.fake_gpu, "comm.fake_gpu").bf16_flops
    config = _without_files(config, world_size)
    return dataclasses.replace(config, compile=dataclasses.replace(config.compile, enable=False),
                               metrics=dataclasses.replace(config.metrics, peak_flops=peak_flops or 1.0))


# A dry run has no tokenizer: its random batches carry no documents. For model.attention_mask = block_causal every
# sequence is then one document (this id is never drawn), which traces the block-causal path's buffers (under CP the
# gathered keys and values, the mask of each rank's queries) at the mask's largest work.
FAKE_BOS_ID = -1


def fake_batches(trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token ids of the configured shape, one batch per accumulation step."""
    training = trainer.config.training
    shape = (training.local_batch_size, training.seq_len)
    vocab = trainer.model_args.vocab_size
    device = trainer.device
    return [(torch.randint(0, vocab, shape, device=device), torch.randint(0, vocab, shape, device=device))
            for _ in range(trainer.grad_accumulation_steps)]


def run(config: JobConfig, trainer_class: type) -> dict:
    """Dry-run one rank with `trainer_class` (torchtitan.train.Trainer); returns the report (also written to
    <dump_folder>/dry_run.json).

    Under pipeline parallelism the first and the last stage hold different modules (the embedding; the norm,
    output layer and loss) and activations: unless comm.fake_other_end is off, the rank of the other end of the
    pipeline is dry-run too, and both peaks are reported.
    """
    start = time.perf_counter()
    torch_compat.require("dry_run")
    rank, world_size = resolve_world(config)
    if not config.comm.fake_tensors:
        return _measure_rank(_without_files(config, world_size), trainer_class, rank, world_size, start)
    if torch_compat.release() < (2, 13):
        # Measured: 8B on 8 GPUs (FSDP 8) traced 111.5 GiB of optimizer state on torch 2.11, 7.5 GiB (two fp32 moments
        # of a 3.74 GiB shard) on 2.13 and 2.14, and an out-of-memory verdict that a real run would not meet.
        raise UserError(f"option comm.fake_tensors: the dry run's memory accounting on fake tensors needs torch 2.13 "
                        f"or newer (torch {torch.__version__}'s memory tracker counts the optimizer's step about 15x "
                        f"too high); use torch 2.13+, or time the rank on real tensors (--comm.no_fake_tensors)")
    traced_config = dry_run_config(config, world_size)
    gpu = gpu_named(config.comm.fake_gpu, "comm.fake_gpu") if config.comm.fake_device == "cuda" else None
    logger.info(f"Dry run: rank {rank} of {world_size} on the fake backend, fake tensors, "
                f"{config.comm.fake_device} code paths" + (f", {gpu.description}" if gpu else ""))
    report = _dry_run_rank(traced_config, trainer_class, rank, world_size, gpu)
    report.update(compile=config.compile.enable, async_tp=config.parallelism.enable_async_tensor_parallel)
    if config.compile.enable:
        # Compiled blocks and loss save less than the eager ones traced here (planner/memory.py, measured on CPU).
        compiled = estimate(config, world_size, device=config.comm.fake_device)
        on_host = compiled.parameters + compiled.optimizer + compiled.gradients \
            if config.training.enable_cpu_offload else 0
        report["compiled_estimate_gib"] = (compiled.total - on_host) / GIB
    if report["layout"]["pp"] > 1:
        stage_peaks = {report["pipeline_rank"]: report["peak_memory_gib"]}
        other = _other_end_of_pipeline(rank, world_size, report) if config.comm.fake_other_end else None
        if other is not None:
            other_report = _dry_run_rank_in_new_process(traced_config, other)
            stage_peaks[other_report["pipeline_rank"]] = other_report["peak_memory_gib"]
            report["other_end_of_pipeline"] = {key: other_report[key] for key in (
                "rank", "pipeline_rank", "pipeline_stages", "peak_memory_gib", "device_peak_memory_gib",
                "memory_gib_by_category", "phase_peak_memory_gib")}
        first, last = stage_peaks.get(0, report["peak_memory_gib"]), stage_peaks.get(max(stage_peaks))
        report["pipeline_stage_memory_gib"] = {"first": first, "last": last}
        report["max_peak_memory_gib"] = max(stage_peaks.values())
        report["max_device_peak_memory_gib"] = max(
            report["device_peak_memory_gib"], report.get("other_end_of_pipeline", {}).get("device_peak_memory_gib", 0))
    else:
        report["max_peak_memory_gib"] = report["peak_memory_gib"]
        report["max_device_peak_memory_gib"] = report["device_peak_memory_gib"]
    path = _write_report(report, config, start)
    _log_summary(report, path)
    check_fits(report, gpu)
    return report


def check_fits(report: dict, gpu) -> None:
    """The out-of-memory verdict on a dry run's report for `gpu` (none: no verdict): what the GPU holds at the
    peak of the fullest pipeline end, the categories in host memory under CPU offload (the parameter and gradient
    shards, the optimizer state) left out, plus the headroom the planner counts too (hardware.headroom: the
    allocator's reserve, the CUDA context, NCCL's buffers per communicator)."""
    if gpu is None:
        return
    layout = report.get("layout", {})
    tensors, compiled_tensors = report["max_device_peak_memory_gib"], report.get("compiled_estimate_gib")
    needed = tensors + headroom(tensors, gpu, layout).total_gib
    if needed <= gpu.memory_gib:
        return
    extra = headroom(tensors, gpu, layout)
    what = (f"{needed:.1f} GiB of GPU memory at its peak ({tensors:.1f} GiB of tensors + {extra.allocator_gib:.1f} "
            f"allocator reserve + {extra.cuda_context_gib:.1f} CUDA context + {extra.nccl_gib:.1f} NCCL buffers)")
    compiled = None if compiled_tensors is None else \
        compiled_tensors + headroom(compiled_tensors, gpu, layout).total_gib
    if compiled is not None and compiled <= gpu.memory_gib:
        logger.warning(f"dry run: eager blocks need {what}, more than the {gpu.memory_gib} GiB of one {gpu.name}; "
                       f"compiled, the analytic model gives {compiled:.1f} GiB, which fits")
        return
    raise UserError(f"dry run: a rank needs {what}"
                    + (f"; {compiled:.1f} GiB compiled, by the analytic model" if compiled is not None else "")
                    + f", more than the {gpu.memory_gib} GiB of one {gpu.name} (comm.fake_gpu): the run "
                    f"would fail with CUDA out of memory. Shard more (FSDP/TP/PP), checkpoint activations "
                    f"(activation_checkpoint.mode), or lower training.local_batch_size")


def _write_report(report: dict, config: JobConfig, start: float) -> Path:
    report["seconds"] = time.perf_counter() - start
    return write_report(config.job.dump_folder, report)


def _measure_rank(config: JobConfig, trainer_class: type, rank: int, world_size: int, start: float) -> dict:
    """The rank on real tensors on this machine's device: comm.fake_steps steps on random batches, each timed (the
    device synchronised around it), and the allocator's peak over the run. The collectives return at once, so the
    time is the rank's compute and memory traffic alone: what the performance model calls compute plus parameter
    traffic, with no communication and no pipeline bubble (a stage's receives return at once)."""
    steps = config.comm.fake_steps
    if steps < 1:
        raise UserError(f"option comm.fake_steps: {steps} must be a positive integer (the steps the dry run on real "
                        f"tensors times; 3 or more give a median past compilation)")
    with dry_run_patches(config.comm.fake_device, fake_tensors=False):
        trainer = trainer_class(config)
        try:
            logger.info(f"Dry run: rank {rank} of {world_size} on the fake backend, real tensors on "
                        f"{device_name(trainer.device)}, {steps} timed steps")
            step_seconds = []
            for step in range(1, steps + 1):
                batches = fake_batches(trainer)
                _synchronize(trainer.device)
                step_start = time.perf_counter()
                trainer.train_step(batches)
                _synchronize(trainer.device)
                step_seconds.append(time.perf_counter() - step_start)
                logger.info(f"step {step}: {step_seconds[-1]:.3f} s")
            report = _rank_fields(trainer, rank, world_size)
        finally:
            trainer.close()
    # The first steps compile, build the optimizer state and (pipelines) settle their buffers.
    steady = step_seconds[2:] or step_seconds[-1:]
    median = statistics.median(steady)
    tokens_per_gpu = (config.training.local_batch_size * config.training.seq_len * trainer.grad_accumulation_steps
                      / (report["layout"]["tp"] * report["layout"]["cp"] * report["layout"]["pp"]))
    report.update(
        device=device_name(trainer.device),
        compile=config.compile.enable,
        step_seconds=step_seconds,
        median_step_seconds=median,
        tokens_per_second_per_gpu=tokens_per_gpu / median,
        mfu_pct=100 * trainer.flops_per_token * tokens_per_gpu / median / trainer.peak_flops,
        memory=memory_stats(trainer.device),
    )
    path = _write_report(report, config, start)
    memory = ", ".join(f"{name} {value:.2f}" for name, value in report["memory"].items() if name.endswith("gib"))
    logger.info(f"Dry run of rank {rank} of {world_size} on {report['device']} (real tensors, no communication): "
                f"median step {median:.3f} s over {len(steady)} step(s), {report['tokens_per_second_per_gpu']:,.0f} "
                f"tokens/s per GPU, MFU {report['mfu_pct']:.1f}%; peak memory: {memory}\nWritten to {path}")
    return report


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _other_end_of_pipeline(rank: int, world_size: int, report: dict) -> int | None:
    """The rank that holds the last stage if `rank` holds the first, and the reverse (same coordinates on the
    other mesh dimensions); None when one pipeline rank holds both (V-shaped schedules)."""
    pp = report["layout"]["pp"]
    stages = report["pipeline_stages"]
    num_stages = report["pipeline_num_stages"]
    if 0 in stages and num_stages - 1 in stages:
        return None
    ranks_per_stage = world_size // pp
    holder_of_last = (num_stages - 1) % pp
    other_pp_rank = holder_of_last if 0 in stages else 0
    return other_pp_rank * ranks_per_stage + rank % ranks_per_stage


def _dry_run_rank_in_new_process(config: JobConfig, rank: int) -> dict:
    """A second rank in a process of its own (the trainer's command line): torch keeps per-world state
    (process-group names in its caches) that a second fake world in this process would trip over."""
    with tempfile.TemporaryDirectory(prefix="dry-run-") as folder:
        config_file = Path(folder) / "config.toml"
        config_file.write_text(to_toml(config))
        # Exit code 2 is a peak above the GPU's memory, reported after the report is written.
        proc = subprocess.run([sys.executable, "-m", "torchtitan.train", "--job.config_file", str(config_file),
                               "--comm.fake_rank", str(rank), "--comm.no_fake_other_end", "--job.dump_folder",
                               folder, "--job.no_print_config"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        report = read_report(folder)
        if proc.returncode not in (0, 2) or report is None:
            raise RuntimeError(f"the dry run of rank {rank} failed:\n{proc.stdout[-4000:]}")
        return report


def _dry_run_rank(config: JobConfig, trainer_class: type, rank: int, world_size: int, gpu) -> dict:
    with dry_run_patches(config.comm.fake_device):
        trainer = trainer_class(config)
        try:
            return _run_steps(trainer, rank, world_size, gpu)
        finally:
            # A second rank of the same run (the other end of the pipeline) joins a new fake world.
            trainer.close()


def _run_steps(trainer, rank: int, world_size: int, gpu) -> dict:
    """Two training steps on fake batches; the second is measured (the first creates the optimizer state and
    lets a pipeline learn its stage shapes). Each step gets batches of its own, as in training: context
    parallelism shards a step's batch in place."""
    with trainer.fake_mode:
        trainer.train_step(fake_batches(trainer))
        counter = CollectiveCounter(trainer.parallel_dims)
        with StepMemoryTracker(trainer.model_parts, trainer.optimizers.optimizers,
                               host_categories=_offloaded(trainer.config),
                               state=trainer.optimizers.compression.tensors()) as memory, counter:
            trainer.train_step(fake_batches(trainer))
    return _report(trainer, rank, world_size, memory.peak_by_category(), memory.device_peak_by_category(),
                   memory.peak_by_phase(), counter, gpu)


def _offloaded(config: JobConfig) -> tuple[str, ...]:
    """The memory categories FSDP's CPU offload keeps in host memory (the shards, and the optimizer state of them)."""
    return ("parameters", "gradients", "optimizer_state") if config.training.enable_cpu_offload else ()


def _report(trainer, rank: int, world_size: int, by_category: dict[str, int], device_by_category: dict[str, int],
            by_phase: dict[str, dict[str, int]], counter: CollectiveCounter, gpu) -> dict:
    peak = sum(by_category.values())
    return _rank_fields(trainer, rank, world_size) | {
        "target_device": trainer.config.comm.fake_device,
        # Under CPU offload these live in host memory; the other categories on the device.
        "offloaded_to_host": list(_offloaded(trainer.config)),
        "gpu": gpu.name if gpu else None,
        "gpu_memory_gib": gpu.memory_gib if gpu else None,
        "peak_memory_gib": peak / GIB,
        "memory_gib_by_category": {name: value / GIB for name, value in sorted(by_category.items())},
        # Each phase's own peak (forward, backward, optimizer step), and what it held then.
        "phase_peak_memory_gib": {phase: sum(snap.values()) / GIB for phase, snap in by_phase.items()},
        "memory_gib_by_phase": {phase: {name: value / GIB for name, value in sorted(snap.items()) if value}
                                for phase, snap in by_phase.items()},
        # The device's own peak: the host categories left out, at the moment the rest peaked.
        "device_peak_memory_gib": sum(device_by_category.values()) / GIB,
        "collectives": counter.summary(),
    }


def _rank_fields(trainer, rank: int, world_size: int) -> dict:
    """What the run is: the rank, the layout and the model."""
    config, dims = trainer.config, trainer.parallel_dims
    pp_rank = dims.get_mesh("pp").get_local_rank()
    return {
        "world_size": world_size,
        "rank": rank,
        "flavor": config.model.flavor,
        "layout": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                   "tp": dims.tp},
        "pipeline_rank": pp_rank,
        "pipeline_stages": _stage_ids(trainer),
        "pipeline_num_stages": _num_stages(trainer),
        "pipeline_schedule": config.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None,
        "first_stage": trainer.has_first_stage,
        "last_stage": trainer.has_last_stage,
        "local_batch_size": config.training.local_batch_size,
        "seq_len": config.training.seq_len,
        "activation_checkpoint": config.activation_checkpoint.mode,
        "float8": bool(trainer.float8_layers),
        "parameters": trainer.num_params,
        "flops_per_token": trainer.flops_per_token,
    }


def _stage_ids(trainer) -> list[int]:
    schedule = trainer.pp_schedule
    if schedule is None:
        return [0]
    return [stage.stage_index for stage in torch_compat.schedule_stages(schedule)]


def _num_stages(trainer) -> int:
    schedule = trainer.pp_schedule
    return 1 if schedule is None else torch_compat.schedule_stages(schedule)[0].num_stages


def _log_summary(report: dict, path: Path) -> None:
    lines = [f"Dry run of rank {report['rank']} of {report['world_size']} (pipeline rank {report['pipeline_rank']}, "
             f"stages {report['pipeline_stages']}): peak {report['peak_memory_gib']:.2f} GiB"
             + (f", {report['device_peak_memory_gib']:.2f} GiB on the device (host memory holds the "
                f"{', '.join(report['offloaded_to_host'])})" if report["offloaded_to_host"] else "")
             + (f" of {report['gpu_memory_gib']} GiB ({report['gpu']})" if report["gpu"] else "")]
    lines += [f"  {name:<24} {gib:9.3f} GiB" for name, gib in report["memory_gib_by_category"].items() if gib]
    lines.append("Peak of each phase: " + ", ".join(f"{phase} {gib:.3f} GiB"
                                                   for phase, gib in report["phase_peak_memory_gib"].items()))
    if "other_end_of_pipeline" in report:
        other = report["other_end_of_pipeline"]
        lines.append(f"Other end of the pipeline, rank {other['rank']} (pipeline rank {other['pipeline_rank']}, "
                     f"stages {other['pipeline_stages']}): peak {other['peak_memory_gib']:.2f} GiB")
    lines.append("Collectives of one step:")
    lines += [f"  {c['kind']:<15} over {c['mesh_dim']:<14} {c['count']:6d} calls {c['bytes'] / GIB:10.3f} GiB"
              for c in report["collectives"]]
    if "compiled_estimate_gib" in report:
        lines.append(f"Compiled (the analytic model; the trace runs eagerly): peak {report['compiled_estimate_gib']:.2f}"
                     f" GiB")
    lines.append(f"Written to {path} ({report['seconds']:.1f} s)")
    logger.info("\n".join(lines))

