"""Peak memory per device of a training configuration, predicted without running the model.

From the repository root:

    python scripts/estimate_memory.py                       # the 8B/70B/405B presets on H100 layouts
    python scripts/estimate_memory.py --job.config_file train_configs/llama3_8b.toml --ngpu 8
    python scripts/estimate_memory.py --flavor 70B --seq_len 8192 --local_batch_size 8 --ngpu 64 --tp 8 --ac full
    python scripts/estimate_memory.py --validate             # estimate vs measured, small configs on this CPU

Any other argument is a trainer option (`--section.option value`, as torchtitan.train takes it); --flavor,
--seq_len, --local_batch_size, --tp, --pp, --cp, --dp_shard, --dp_replicate and --ac (none, full, op or an
integer N) are short forms of them. The vocabulary is the flavor's own (the trainer uses its tokenizer's).

Validation (--validate, tests/unit/test_estimate_memory.py): the real Trainer on this CPU, one process. The
measured figure is torch's own accounting of tensor memory: tensors alive at the start of the second step
(parameters, buffers, optimizer state) plus the highest running total of the CPU allocations and frees that the
profiler records during that step. Peak RSS is also shown, as its increase over the RSS before the Trainer is
built (measured in a step without the profiler): it adds what is not a tensor (the tokenizer and corpus, lazily
loaded libraries, gloo's buffers, memory glibc keeps after a free), 75-200 MiB over the tensor peak here, more
with bigger batches and more processes, so it is reported but not used for the check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Running `python scripts/estimate_memory.py` puts scripts/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from torchtitan.config import JobConfig, parse_args, parse_script_args  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.planner.hardware import GPU, Headroom, gpu_named, headroom  # noqa: E402
from torchtitan.planner.memory import Estimate, estimate  # noqa: E402
from torchtitan.tools.dry_run_report import read_report  # noqa: E402

GIB = 2**30
MIB = 2**20
# ------------------------------------------------------------------------------------------------------------------
# Measurement on this CPU


def measure(trainer_argv: list[str]) -> dict[str, float]:
    """Peak bytes of a training step of the real Trainer in this process (see the module docstring).

    Returns `tensor_peak` (torch's accounting, from the third step), `resident` (the part of it that was alive
    before that step: parameters, buffers, optimizer state) and `rss_increase` (peak RSS during the second step,
    which runs without the profiler and its event buffers, minus the RSS before the Trainer was built).
    """
    from torch.profiler import ProfilerActivity, profile

    from torchtitan.tools.device_info import memory_stats, reset_peak_memory
    from torchtitan.train import Trainer

    cpu = torch.device("cpu")
    gc.collect()
    baseline_rss = memory_stats(cpu)["rss_gib"] * GIB
    with tempfile.TemporaryDirectory(prefix="estimate-memory-") as dump_folder:
        # A configured peak skips the start-up matmul measurement, which is irrelevant here.
        config = parse_args([*trainer_argv, "--job.dump_folder", dump_folder, "--metrics.peak_flops", "1e12",
                             "--validation.no_enable", "--checkpoint.no_enable"])
        trainer = Trainer(config)
        try:
            data_iterator = iter(trainer.dataloader)
            trainer.train_step(trainer._next_batches(data_iterator))
            batches = trainer._next_batches(data_iterator)
            reset_peak_memory(cpu)
            trainer.train_step(batches)
            peak_rss = memory_stats(cpu)["max_rss_gib"] * GIB
            # Frees the gradients now, so that every free inside the profiled step is of a tensor the profiler
            # saw allocated.
            trainer.optimizers.zero_grad()
            gc.collect()
            resident = _resident_bytes(trainer)
            batches = trainer._next_batches(data_iterator)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
                trainer.train_step(batches)
        finally:
            trainer.metrics.close()
            trainer.close()
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = highest = 0
    for _, nbytes in events:
        running += nbytes
        highest = max(highest, running)
    return {"tensor_peak": resident + highest, "resident": resident, "rss_increase": peak_rss - baseline_rss}


def _resident_bytes(trainer) -> int:
    storages: dict[int, int] = {}

    def add(tensor: torch.Tensor) -> None:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for part in trainer.model_parts:
        for tensor in (*part.parameters(), *part.buffers()):
            add(tensor)
    # Optimizer state by its own count: torchao's quantized state is a tensor subclass whose data lies in inner
    # tensors (codes and scales), not in a storage of its own.
    return sum(storages.values()) + trainer.optimizers.state_bytes()


# ------------------------------------------------------------------------------------------------------------------
# Command line

# (name, TOML, devices, overrides): the published recipes, and variants that show what does not fit.
PRESETS = [
    ("8B FSDP 8, AC op", "llama3_8b.toml", 8, []),
    ("8B FSDP 8, AC none", "llama3_8b.toml", 8, ["--activation_checkpoint.mode", "none"]),
    ("8B FSDP 8, AC full, batch 4", "llama3_8b.toml", 8, ["--activation_checkpoint.mode", "full",
                                                          "--training.local_batch_size", "4"]),
    ("70B FSDP 8 x TP 8, AC full", "llama3_70b.toml", 64, []),
    ("70B FSDP 8, AC full, batch 1", "llama3_70b.toml", 8, ["--parallelism.tensor_parallel_degree", "1",
                                                            "--training.local_batch_size", "1"]),
    ("70B FSDP 8 x TP 8, AC none", "llama3_70b.toml", 64, ["--activation_checkpoint.mode", "none"]),
    ("405B FSDP 2 x TP 8 x PP 8, AC full", "llama3_405b.toml", 128, []),
    ("405B FSDP 4 x TP 8 x PP 8, AC full", "llama3_405b.toml", 256, []),
    ("405B FSDP 16 x TP 8, AC full, batch 1", "llama3_405b.toml", 128, [
        "--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "1"]),
]

def _debug(seq_len: int, batch: int, dtype: str, ac: str, *parallel: str) -> list[str]:
    mode, option = {"none": ("none", "2"), "full": ("full", "2"), "op": ("selective", "op")}.get(ac, ("selective", ac))
    return ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
            "--training.mixed_precision_param", dtype, "--activation_checkpoint.mode", mode,
            "--activation_checkpoint.selective_ac_option", option, *parallel]


# Small configs of the debug model measured on this CPU: (name, processes, trainer options).
VALIDATION = [
    ("seq 256 batch 4 fp32, AC none", 1, _debug(256, 4, "float32", "none")),
    ("seq 512 batch 2 fp32, AC full", 1, _debug(512, 2, "float32", "full")),
    ("seq 512 batch 4 bf16, AC none", 1, _debug(512, 4, "bfloat16", "none")),
    ("seq 256 batch 8 bf16, AC full", 1, _debug(256, 8, "bfloat16", "full")),
    ("seq 256 batch 8 bf16, AC op", 1, _debug(256, 8, "bfloat16", "op")),
    ("seq 512 batch 4 fp32, AC every 2", 1, _debug(512, 4, "float32", "2")),
    ("seq 512 batch 4 bf16, AC none, FSDP 2", 2, _debug(512, 4, "bfloat16", "none",
                                                         "--parallelism.data_parallel_shard_degree", "2")),
    ("seq 512 batch 4 fp32, AC full, FSDP 2", 2, _debug(512, 4, "float32", "full",
                                                         "--parallelism.data_parallel_shard_degree", "2")),
    ("seq 512 batch 4 bf16, AC none, TP 2", 2, _debug(512, 4, "bfloat16", "none",
                                                       "--parallelism.tensor_parallel_degree", "2")),
    ("seq 512 batch 4 bf16, AC op, TP 2", 2, _debug(512, 4, "bfloat16", "op",
                                                     "--parallelism.tensor_parallel_degree", "2")),
    ("seq 512 batch 4 bf16, AC none, PP 2", 2, _debug(512, 4, "bfloat16", "none",
                                                       "--parallelism.pipeline_parallel_degree", "2")),
]
CONFIGS = Path(__file__).resolve().parent.parent / "train_configs"
DEBUG_TOML = ["--job.config_file", str(CONFIGS / "debug_model.toml")]

_SHORTHANDS = {"flavor": "model.flavor", "seq_len": "training.seq_len", "local_batch_size": "training.local_batch_size",
               "tp": "parallelism.tensor_parallel_degree", "pp": "parallelism.pipeline_parallel_degree",
               "cp": "parallelism.context_parallel_degree", "dp_shard": "parallelism.data_parallel_shard_degree",
               "dp_replicate": "parallelism.data_parallel_replicate_degree"}


def _trainer_argv(args: argparse.Namespace, rest: list[str]) -> list[str]:
    argv = list(rest)
    for name, option in _SHORTHANDS.items():
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{option}", str(value)]
    if args.ac is not None:
        mode, option = {"none": ("none", None), "full": ("full", None), "op": ("selective", "op")}.get(
            args.ac, ("selective", args.ac))
        argv += ["--activation_checkpoint.mode", mode]
        if option is not None:
            argv += ["--activation_checkpoint.selective_ac_option", option]
    return argv


def device_headroom(config: JobConfig, ngpu: int, tensors_bytes: int, gpu: GPU | None) -> Headroom:
    """What a GPU holds beyond the tensors' peak for this configuration (hardware.headroom, the figure the planner
    and the dry run's out-of-memory verdict add); none on the CPU (`gpu` None), which has no caching allocator,
    CUDA context or NCCL."""
    if gpu is None:
        return Headroom(allocator_gib=0.0, cuda_context_gib=0.0, nccl_gib=0.0)
    dims = ParallelDims.from_config(config.parallelism, ngpu)
    return headroom(tensors_bytes / GIB, gpu, {name: getattr(dims, name)
                                               for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")})


def _row(name: str, e: Estimate, extra: Headroom, gpu: GPU | None) -> str:
    total = e.total / GIB + extra.total_gib
    flag = "" if gpu is None else ("EXCEEDS" if total > gpu.memory_gib else "fits")
    return (f"{name:<50} {e.parameters / GIB:7.1f} {e.optimizer / GIB:7.1f} {e.gradients / GIB:6.1f} "
            f"{e.activations / GIB:7.1f} {e.transient / GIB:7.1f} {e.buffers / GIB:6.1f} {extra.total_gib:6.1f} "
            f"{total:7.1f}  {flag:<7} {e.phase}")


def _header(gpu: GPU | None) -> str:
    return (f"{'GiB per device':<50} {'params':>7} {'optim':>7} {'grads':>6} {'activ':>7} {'transnt':>7} "
            f"{'buffer':>6} {'headrm':>6} {'total':>7}  {gpu.name if gpu else 'cpu':<7} peak at")


def presets_table(gpu: GPU) -> str:
    lines = [_header(gpu)]
    for name, toml, ngpu, overrides in PRESETS:
        config = parse_args(["--job.config_file", str(CONFIGS / toml), *overrides])
        result = estimate(config, ngpu)
        lines.append(_row(f"{name} ({ngpu} GPUs)", result, device_headroom(config, ngpu, result.total, gpu), gpu))
    return "\n".join(lines)


def validation_table() -> str:
    """Each config measured in fresh processes (one thread each), so that the RSS baseline is that of a new
    process; the dry run (traced) and the analytic estimate predict it."""
    lines = [f"{'debugmodel, CPU':<40} {'measured':>9} {'dry run':>9} {'error':>7} {'analytic':>9} {'error':>7} "
             f"{'RSS incr.':>10}"]
    for name, nproc, overrides in VALIDATION:
        argv = [*DEBUG_TOML, *overrides]
        predicted = estimate(parse_args(argv), nproc, device="cpu").total
        traced = traced_peak(argv, nproc, device="cpu")
        measured = _measure_in_new_processes(argv, nproc)
        peak = measured["tensor_peak"]
        lines.append(f"{name:<40} {peak / MIB:7.1f}Mi {traced / MIB:7.1f}Mi {100 * (traced / peak - 1):+6.1f}% "
                     f"{predicted / MIB:7.1f}Mi {100 * (predicted / peak - 1):+6.1f}% "
                     f"{measured['rss_increase'] / MIB:8.1f}Mi")
    return "\n".join(lines)


def traced_peak(trainer_argv: list[str], nproc: int, device: str = "cuda") -> float:
    """The dry run's peak bytes over the ranks that differ (both ends of a pipeline), in a new process."""
    with tempfile.TemporaryDirectory(prefix="estimate-memory-") as dump_folder:
        proc = subprocess.run([sys.executable, "-m", "torchtitan.train", *trainer_argv, "--comm.mode", "fake_backend",
                               "--comm.fake_world_size", str(nproc), "--comm.fake_device", device,
                               "--job.dump_folder", dump_folder, "--job.no_print_config"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        report = read_report(dump_folder)
        if report is None:
            raise RuntimeError(f"the dry run of {trainer_argv} failed:\n{proc.stdout[-4000:]}")
        return report["max_peak_memory_gib"] * GIB


def traced_table() -> str:
    """The analytic estimate against the dry run's trace on the presets' layouts (tensors only)."""
    lines = [f"{'GiB per device, tensors':<50} {'dry run':>8} {'analytic':>9} {'error':>7}"]
    for name, toml, ngpu, overrides in PRESETS:
        argv = ["--job.config_file", str(CONFIGS / toml), *overrides]
        traced = traced_peak(argv, ngpu)
        # The dry run runs the blocks eagerly: compare with the eager estimate.
        predicted = estimate(parse_args([*argv, "--compile.no_enable"]), ngpu).total
        lines.append(f"{name + f' ({ngpu} GPUs)':<50} {traced / GIB:8.2f} {predicted / GIB:9.2f} "
                     f"{100 * (predicted / traced - 1):+6.1f}%")
    return "\n".join(lines)


def _measure_in_new_processes(trainer_argv: list[str], nproc: int) -> dict[str, float]:
    """The largest figures over the ranks of `--measure` runs (torchrun for more than one process)."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                                                   "--rdzv-endpoint=localhost:0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="estimate-memory-ranks-") as results:
        script = [str(Path(__file__).resolve()), "--measure", "--measure_to", results, *trainer_argv]
        proc = subprocess.run([*launcher, *script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=600)
        rows = [json.loads(path.read_text()) for path in sorted(Path(results).glob("rank-*.json"))]
    if proc.returncode or len(rows) != nproc:
        raise RuntimeError(f"measuring {trainer_argv} failed:\n{proc.stdout[-4000:]}")
    return {key: max(row[key] for row in rows) for key in rows[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--ngpu", type=int, default=None, help="devices (world size); default: the presets table")
    parser.add_argument("--gpu", default="h100",
                        help="the GPU whose memory the peak must fit in, with the planner's headroom on it (the "
                             "allocator's reserve, the CUDA context, NCCL's buffers): h100 (default), h100_96gb, "
                             "h200, a100, b200")
    parser.add_argument("--cpu", action="store_true",
                        help="a CPU run: tensors only (no allocator reserve, CUDA context or NCCL buffers)")
    parser.add_argument("--validate", action="store_true", help="compare with measurements on this CPU")
    parser.add_argument("--traced", action="store_true",
                        help="compare the presets' estimates with the dry run's trace (minutes per preset)")
    parser.add_argument("--measure", action="store_true",
                        help="measure the trainer options given (one line of JSON per rank; used by --validate)")
    parser.add_argument("--measure_to", default=None,
                        help="with --measure: write each rank's JSON to <folder>/rank-<RANK>.json instead")
    for name in _SHORTHANDS:
        parser.add_argument(f"--{name}", default=None)
    parser.add_argument("--ac", default=None, help="activation checkpointing: none, full, op or N")
    args, rest = parse_script_args(parser, sys.argv[1:] if argv is None else argv)
    try:
        gpu = None if args.cpu else gpu_named(args.gpu, "--gpu")
        if args.validate:
            print(validation_table())
            return 0
        if args.traced:
            print(traced_table())
            return 0
        trainer_argv = _trainer_argv(args, rest)
        if args.measure:
            result = json.dumps(measure(trainer_argv))
            if args.measure_to:
                # A file per rank: ranks printing to one pipe can interleave with each other's warnings.
                Path(args.measure_to, f"rank-{os.environ.get('RANK', '0')}.json").write_text(result)
            else:
                print(result, flush=True)
            return 0
        if args.ngpu is None and not trainer_argv:
            print(presets_table(gpu or gpu_named(args.gpu, "--gpu")))
            return 0
        config = parse_args(trainer_argv)
        result = estimate(config, args.ngpu or 1, "cpu" if args.cpu else "cuda")
        extra = device_headroom(config, args.ngpu or 1, result.total, gpu)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_header(gpu))
    print(_row(f"{config.model.flavor} on {args.ngpu or 1} device(s)", result, extra, gpu))
    for field in dataclasses.fields(Estimate):
        value = getattr(result, field.name)
        print(f"  {field.name:<12} {value / GIB:10.3f} GiB" if isinstance(value, int) and field.name != "rank"
              else f"  {field.name:<12} {value}")
    for field in dataclasses.fields(Headroom):
        print(f"  {field.name:<17} {getattr(extra, field.name):5.3f} GiB")
    print(f"  {'device total':<17} {result.total / GIB + extra.total_gib:5.3f} GiB")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
