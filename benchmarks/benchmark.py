"""Training throughput of one configuration on the real Trainer, printed as one JSON line on stdout.

From the repository root:

    python benchmarks/benchmark.py --job.config_file train_configs/debug_model.toml --warmup 3 --steps 10
    python benchmarks/benchmark.py --job.config_file train_configs/debug_model.toml --compile.enable --hf --plain
    torchrun --nproc_per_node=2 benchmarks/benchmark.py --job.config_file train_configs/debug_model.toml

Every argument other than --warmup/--steps/--hf/--plain/--threads/--turns is a trainer option, exactly as
`torchtitan.train` takes it. The Trainer is built in this process (under torchrun, one per rank); after
--warmup steps (compile and allocator warm-up happen there) it times --steps steps: fetching the next batch
and `Trainer.train_step`, as in training. The log, and anything else printed meanwhile, goes to stderr: stdout
holds only the JSON line.

What the line reports:
- tokens_per_s_per_device: tokens of one step divided by the world size and by the median step time (a median,
  not a mean, so that a moment of competing load on a shared machine does not move it much).
- step_cpu_time_s: the median CPU time of the process per step. With one thread it is the step time without the
  moments other processes held the core, the steadier figure for ratios on a shared machine.
- mfu_pct: model FLOPs (Trainer.flops_per_token) per second over the peak of one device: on NVIDIA GPUs the
  datasheet's dense figure, on CPU a matmul measured at start-up in the compute dtype
  (training.mixed_precision_param) with this process's threads; `peak` names which.
- peak_memory_gib: per rank, the maximum over ranks. On CPU the peak resident set size over the timed steps
  (libraries included), with `peak_memory_over_baseline_gib` the same minus the RSS before the Trainer was
  built; on CUDA the caching allocator's peak reserved and allocated bytes.

--hf and --plain (one process only; either or both) then train peers of the same shape on the same batches with
the same recipe (see `benchmarks/benchmark_peers.py`): Hugging Face `transformers.LlamaForCausalLM` and a Llama in
plain PyTorch written there, both from our initial weights, bf16 as autocast when we train in bf16, the whole
forward and loss under `torch.compile` when we compile. After their own warm-up, their steps alternate with
further steps of ours, one each in turn, so that load from other processes falls on all alike: `hf.ratio` and
`plain.ratio` say how many times faster ours is (the peer's median step time over ours, from those alternating
steps), `ratio_cpu_time` the same from CPU times. All run with the same torch thread count (--threads).

--vs_eager (with --compile.enable, one process) then times compile against eager in this one process: pairs of
steps of the compiled trainer alternate with pairs of steps of the same trainer under
`torch.compiler.set_stance("force_eager")`, which runs the compiled blocks and loss as plain eager code; the second
step of each pair is timed, so that every timed step follows one of its own kind, as in training (an eager step
right after a compiled one measured 4-6% slower than after an eager one, for reasons not found). `eager.ratio` is
the eager median step time over the compiled one (above 1: compile is faster), `ratio_cpu_time` the same from CPU
times. Two invocations, one eager and one compiled, cannot resolve this: on a 2-vCPU cloud machine the speed moves
between levels up to 20% apart, for tens of seconds at a time (the compiled step of one process went from 601 to
493 ms), which alternating steps of one process share.

--turns MINE:THEIRS (two FIFOs, `benchmarks/turns.py`) makes every step, warm-up included, wait for its turn and then
give the other process its own: how `benchmarks/benchmark_torchtitan.py` times TorchTitan, which cannot share this
process, step by step against ours.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Running `python benchmarks/benchmark.py` puts benchmarks/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torchtitan.components.float8 import float8_enabled  # noqa: E402
from torchtitan.config import JobConfig, parse_args, parse_script_args  # noqa: E402
from torchtitan.distributed.fsdp import TORCH_DTYPES  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.tools.device_info import memory_stats, peak_flops, reset_peak_memory  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402
from benchmarks.benchmark_peers import PeerTraining, initial_state_dict  # noqa: E402
from benchmarks.turns import Turns  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_benchmark_args(argv: list[str], script: str = "benchmark.py",
                         doc: str = __doc__) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, which `benchmarks/step_breakdown.py` (`script`, `doc`) shares, and the trainer's."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], add_help=False,
                                     usage=f"{script} [trainer options...] [--warmup N] [--steps N] [--hf] "
                                           f"[--plain] [--vs_eager] [--threads N] [--turns MINE:THEIRS]")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--hf", action="store_true", help="also train transformers' LlamaForCausalLM, same recipe")
    parser.add_argument("--plain", action="store_true", help="also train a plain PyTorch Llama, same recipe")
    parser.add_argument("--vs_eager", action="store_true",
                        help="with --compile.enable: also time the same trainer run eagerly, steps alternating")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: the usable cores / processes on this node)")
    parser.add_argument("--turns", metavar="MINE:THEIRS",
                        help="take turns with another process, one step each, over two FIFOs (benchmarks/turns.py)")
    args, trainer_argv = parse_script_args(parser, argv)
    if args.warmup < 1 or args.steps < 1:
        raise UserError("--warmup and --steps must be at least 1 (the first step compiles and allocates)")
    if args.turns and (args.hf or args.plain or args.vs_eager):
        raise UserError("--turns times ours against another process: run it without --hf/--plain/--vs_eager")
    return args, trainer_argv


def default_threads() -> int:
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // processes)


def benchmark_config(trainer_argv: list[str], total_steps: int, dump_folder: str) -> JobConfig:
    config = parse_args(trainer_argv)
    # The LR schedule must cover every step run; nothing is checkpointed or validated.
    config.training.steps = max(config.training.steps, total_steps)
    config.checkpoint.enable = False
    config.validation.enable = False
    if not any(arg.split("=")[0] == "--job.dump_folder" for arg in trainer_argv):
        config.job.dump_folder = dump_folder
    return config


def describe_config(config: JobConfig, trainer: Trainer, threads: int) -> dict:
    ac = config.activation_checkpoint
    cfg8 = config.quantize.linear.float8
    dims = trainer.parallel_dims
    return {
        "flavor": config.model.flavor,
        "seq_len": config.training.seq_len,
        "local_batch_size": config.training.local_batch_size,
        "grad_accumulation_steps": trainer.grad_accumulation_steps,
        "dtype": config.training.mixed_precision_param,
        "compile": ",".join(config.compile.components) if config.compile.enable else "none",
        "ac": ac.mode if ac.mode != "selective" else f"selective {ac.selective_ac_option}",
        "float8": (f"{cfg8.recipe_name or 'tensorwise'}{' emulated' if cfg8.emulate else ''}"
                   if float8_enabled(config) else "none"),
        "world_size": dims.world_size,
        "mesh": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                 "tp": dims.tp},
        "device": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
        "threads": threads,
    }


@dataclass
class Timing:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def run(self, step) -> None:
        """Time one call of `step`, which returns the loss as a float (and so waits for the device)."""
        wall, cpu = time.perf_counter(), time.process_time()
        loss = step()
        self.cpu_s.append(time.process_time() - cpu)
        self.wall_s.append(time.perf_counter() - wall)
        self.losses.append(loss)

    @property
    def step_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def step_cpu_s(self) -> float:
        return statistics.median(self.cpu_s)


def peak_memory(device: torch.device, baseline_rss_gib: float) -> dict:
    """This window's peak, as the maximum over ranks."""
    stats = memory_stats(device)
    if device.type == "cuda":
        values = {"peak_memory_gib": stats["max_reserved_gib"], "peak_allocated_gib": stats["max_allocated_gib"]}
        kind = "CUDA caching allocator: peak reserved (and allocated) bytes"
    else:
        values = {"peak_memory_gib": stats["max_rss_gib"],
                  "peak_memory_over_baseline_gib": stats["max_rss_gib"] - baseline_rss_gib}
        kind = "peak RSS of the process (over baseline: minus the RSS before the Trainer was built)"
    reduced = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return {**dict(zip(values, reduced.tolist())), "memory_kind": kind}


def run(argv: list[str]) -> dict:
    args, trainer_argv = parse_benchmark_args(argv)
    peers = peer_names(args)
    if (peers or args.turns or args.vs_eager) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--hf/--plain/--vs_eager/--turns compare one process with one process: run them without "
                        "torchrun")
    parent = os.getppid()
    try:
        turns = Turns(args.turns, other_alive=lambda: os.getppid() == parent)
    except ValueError as e:
        raise UserError(str(e)) from None
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    baseline_rss_gib = memory_stats(torch.device("cpu")).get("rss_gib", 0.0)
    total_steps = args.warmup + args.steps + (args.steps if peers else 0) + \
        (4 * args.steps + args.warmup if args.vs_eager else 0)
    with tempfile.TemporaryDirectory(prefix="benchmark-") as dump_folder:
        config = benchmark_config(trainer_argv, total_steps, dump_folder)
        if args.vs_eager and not config.compile.enable:
            raise UserError("--vs_eager times compile against eager, but compile.enable is off: add --compile.enable")
        trainer = Trainer(config)
        try:
            return measure(trainer, args, threads, baseline_rss_gib, turns)
        finally:
            trainer.metrics.close()
            trainer.close()


def measure(trainer: Trainer, args: argparse.Namespace, threads: int, baseline_rss_gib: float,
            turns: Turns) -> dict:
    config = trainer.config
    initial_state = initial_state_dict(trainer) if peer_names(args) else None
    data_iterator = iter(trainer.dataloader)
    batches: list[list[Batch]] = []

    def ours() -> float:
        batches.append(trainer._next_batches(data_iterator))
        return trainer.train_step(batches[-1])[0]

    # As in Trainer.train: the collector runs only when asked, so that it never lands inside a timed step.
    gc.disable()
    warmup_losses = []
    for _ in range(args.warmup):
        with turns.turn():
            warmup_losses.append(ours())
    gc.collect()
    reset_peak_memory(trainer.device)
    timing = Timing()
    for _ in range(args.steps):
        with turns.turn():
            timing.run(ours)
    turns.wait()  # the other process's last step runs without our shutdown beside it
    memory = peak_memory(trainer.device, baseline_rss_gib)

    dims = trainer.parallel_dims
    tokens_per_step = trainer.grad_accumulation_steps * config.training.local_batch_size * \
        config.training.seq_len * dims.dp
    tokens_per_s = tokens_per_step / dims.world_size / timing.step_s
    dtype = config.training.mixed_precision_param
    # The Trainer measured (or looked up) the same figure; asking again returns it with its description.
    _, peak_source = peak_flops(trainer.device, TORCH_DTYPES[dtype], config.metrics.peak_flops)
    result = {
        "config": describe_config(config, trainer, threads),
        "warmup": args.warmup, "steps": args.steps,
        "tokens_per_s_per_device": tokens_per_s,
        "step_time_s": timing.step_s, "step_time_mean_s": statistics.fmean(timing.wall_s),
        "step_cpu_time_s": timing.step_cpu_s,
        "mfu_pct": 100 * trainer.flops_per_token * tokens_per_s / trainer.peak_flops,
        "peak": {"tflops": trainer.peak_flops / 1e12, "dtype": dtype, "source": peak_source},
        **memory,
        "first_loss": warmup_losses[0], "last_loss": timing.losses[-1],
    }
    if initial_state is not None:
        result.update(compare_with_peers(trainer, initial_state, batches, ours, args, tokens_per_step))
    if args.vs_eager:
        result["eager"] = compare_with_eager(trainer, ours, args, tokens_per_step)
    gc.enable()
    return result


def peer_names(args: argparse.Namespace) -> list[str]:
    return [name for name, wanted in (("transformers", args.hf), ("plain", args.plain)) if wanted]


def compare_with_peers(trainer: Trainer, state_dict: dict, batches: list[list[Batch]], ours,
                       args: argparse.Namespace, tokens_per_step: int) -> dict:
    """{"hf": ..., "plain": ...}: each peer's figures and its ratio to ours, from alternating steps."""
    peers = [PeerTraining(name, trainer, state_dict) for name in peer_names(args)]
    # Same weights, same first batch: in fp32 the first losses agree, which shows the models are the same.
    first_losses = [peer.step(batches[0]) for peer in peers]
    for i in range(1, args.warmup):
        for peer in peers:
            peer.step(batches[i])
    gc.collect()
    ours_timing, peer_timings = Timing(), [Timing() for _ in peers]
    for i in range(args.steps):
        ours_timing.run(ours)
        for peer, timing in zip(peers, peer_timings):
            timing.run(lambda: peer.step(batches[args.warmup + i]))
    results = {}
    for peer, timing, first_loss in zip(peers, peer_timings, first_losses):
        tokens_per_s = tokens_per_step / timing.step_s
        results["hf" if peer.name == "transformers" else peer.name] = {
            "model": peer.name, "recipe": peer.recipe,
            "tokens_per_s_per_device": tokens_per_s, "step_time_s": timing.step_s,
            "step_cpu_time_s": timing.step_cpu_s,
            "ours_tokens_per_s_alternating": tokens_per_step / ours_timing.step_s,
            "ours_step_time_s_alternating": ours_timing.step_s,
            "ours_step_cpu_time_s_alternating": ours_timing.step_cpu_s,
            "ratio": timing.step_s / ours_timing.step_s,
            "ratio_cpu_time": timing.step_cpu_s / ours_timing.step_cpu_s,
            "mfu_pct": 100 * trainer.flops_per_token * tokens_per_s / trainer.peak_flops,
            "first_loss": first_loss,
        }
    return results


def compare_with_eager(trainer: Trainer, ours, args: argparse.Namespace, tokens_per_step: int) -> dict:
    """Pairs of the compiled trainer's steps alternating with pairs of its own steps run eagerly, the second of each
    pair timed: the eager figures and their ratio to the compiled ones."""
    def eager() -> float:
        with torch.compiler.set_stance("force_eager"):
            return ours()

    for _ in range(args.warmup):
        eager()
    gc.collect()
    compiled_timing, eager_timing = Timing(), Timing()
    for _ in range(args.steps):
        for step, timing in ((ours, compiled_timing), (eager, eager_timing)):
            step()
            timing.run(step)
    return {
        "tokens_per_s_per_device": tokens_per_step / eager_timing.step_s, "step_time_s": eager_timing.step_s,
        "step_cpu_time_s": eager_timing.step_cpu_s,
        "compiled_step_time_s_alternating": compiled_timing.step_s,
        "compiled_step_cpu_time_s_alternating": compiled_timing.step_cpu_s,
        "ratio": eager_timing.step_s / compiled_timing.step_s,
        "ratio_cpu_time": eager_timing.step_cpu_s / compiled_timing.step_cpu_s,
    }


def json_main(run_benchmark: Callable[[list[str]], dict], argv: list[str] | None) -> int:
    """Run a benchmark on the command line's arguments and print its result as one JSON line (rank 0); a user
    mistake is one error line and exit code 2."""
    init_logger()
    # stdout carries only the JSON line: whatever a library prints while the models run joins the log on stderr.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            result = run_benchmark(sys.argv[1:] if argv is None else argv)
        except UserError as e:
            logger.error(f"error: {e}")
            return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return json_main(run, argv)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
