"""How long each checkpoint save stalls the training loop, per checkpoint.async_mode, as one JSON line on stdout.

From the repository root:

    python benchmarks/checkpoint_stall.py                                  # the debug model, 6 steps, a save per step
    python benchmarks/checkpoint_stall.py --steps 20 --interval 5 --repeats 3
    python benchmarks/checkpoint_stall.py --model.flavor tiny --training.seq_len 32 --steps 3
    python benchmarks/checkpoint_stall.py --processes 4                    # 4 training processes (FSDP 4 by default)

Every argument other than --steps/--interval/--repeats/--threads/--processes is a trainer option, exactly as
`torchtitan.train` takes it; without --job.config_file, train_configs/debug_model.toml is used. For each of the
three modes (disabled, async, async_with_pinned_mem) the real Trainer is built in this process and runs its
training loop (`Trainer.train`) for --steps steps, saving a full checkpoint (never model-only, also at the last
step) after every --interval steps into a fresh dump folder, a temporary one (or one under --job.dump_folder);
validation is off. The stall of a save is the time `CheckpointManager.save` kept the loop waiting
(`CheckpointManager.blocked_s`): for the async modes, building the state dict, waiting for the previous background
save, and the wait of the next optimizer step for the copy of the state, which runs beside that step's forward
and backward. The modes run one after the other, --repeats
times in turn, so that load from other processes falls on all of them alike.

What the line reports, per mode under `modes`: `stall_median_s` (the median over every save of every repeat; a
median, so that one slow save on a shared machine does not move it), `stall_s` (every save, in order, repeats one
after the other), `step_median_s` (the median time of `Trainer.train_step`, saves not included, each run's first
step left out: a background save that competes with the steps for the cores shows here, not in the stall),
`train_s` (each repeat's wall time of `Trainer.train`, which includes the wait for the last background save at its
end), `save_median_s` (from the start of a save until DCP's save returned, every rank having written: in the
background for the async modes); what rank 0 alone does after that (`CheckpointManager.publish_cost`, the
checksum manifest, the publishing rename and the pruning of old checkpoints) as `publish_s` and `publish_median_s`
(wall time) and `publish_cpu_s` and `publish_cpu_median_s` (the CPU time of the thread that did it), and before it
DCP's own `.metadata` as `metadata_median_s` and `metadata_cpu_median_s` (null for async_with_pinned_mem, whose
checkpoint process writes `.metadata` and the manifest); at the top level `ratio_async_to_sync` and
`ratio_pinned_to_sync`, the medians over the `disabled` one, and `checkpoint_mib`, the size of one checkpoint.

With --processes N the script starts N training processes on this machine (gloo, one process group per run), which
share each run's dump folder; the figures are rank 0's. Comparing --processes 1, 2 and 4 on one model shows how
rank 0's publish cost depends on the number of ranks. Where the processes outnumber the cores, a wall time also
counts the time a thread waited for a core; the CPU time is rank 0's work alone.

async_with_pinned_mem saves from a checkpoint process that torch starts at the first save and keeps for the life of
this process (the later repeats reuse it). It is spawned, so it imports this script as its `__main__`: the entry
point below is guarded with `if __name__ == "__main__":`, as any training script that uses that mode must be.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Running `python benchmarks/checkpoint_stall.py` puts benchmarks/ first on sys.path, not the checkout that holds
# torchtitan (nor the benchmarks package that benchmark.py is imported from).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.benchmark import default_threads, describe_config, json_main  # noqa: E402
from torchtitan.components.checkpoint import ASYNC_MODES, complete_steps  # noqa: E402
from torchtitan.config import JobConfig, parse_args, parse_script_args  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parent.parent / "train_configs" / "debug_model.toml"
SYNC, ASYNC, PINNED = ASYNC_MODES


def parse_stall_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False,
                                     usage="checkpoint_stall.py [trainer options...] [--steps N] [--interval N] "
                                           "[--repeats N] [--threads N]")
    parser.add_argument("--steps", type=int, default=6, help="training steps per mode and repeat")
    parser.add_argument("--interval", type=int, default=1, help="save a checkpoint after every this many steps")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, the modes taking turns")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the usable cores / processes on this node)")
    parser.add_argument("--processes", type=int, default=1,
                        help="training processes on this machine (gloo; the default layout shards the model over "
                             "them); the figures are rank 0's")
    args, trainer_argv = parse_script_args(parser, argv)
    for flag in ("steps", "interval", "repeats", "processes"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag}: {getattr(args, flag)} must be at least 1")
    if args.interval > args.steps:
        raise UserError(f"--interval: {args.interval} exceeds --steps {args.steps}, so only the last step would "
                        f"save; use an interval of at most the number of steps")
    if not any(arg.split("=")[0] == "--job.config_file" for arg in trainer_argv):
        trainer_argv = ["--job.config_file", str(DEFAULT_CONFIG_FILE), *trainer_argv]
    # Off before the options are checked: validation's own settings (its seq_len, ...) then do not matter.
    return args, [*trainer_argv, "--validation.no_enable"]


def stall_config(trainer_argv: list[str], args: argparse.Namespace, mode: str, dump_folder: str) -> JobConfig:
    config = parse_args(trainer_argv)
    config.training.steps = args.steps
    config.validation.enable = False
    config.job.dump_folder = dump_folder
    checkpoint = config.checkpoint
    checkpoint.enable = True
    checkpoint.load_only = False
    checkpoint.create_seed_checkpoint = False
    checkpoint.interval = args.interval
    checkpoint.async_mode = mode
    # Every save the same full checkpoint, the last one too, so that the saves compare.
    checkpoint.last_save_model_only = False
    checkpoint.last_save_in_hf = False
    checkpoint.initial_load_path = None
    return config


def folder_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 2**20


@dataclass
class Run:
    stalls_s: list[float]
    saves_s: list[float]
    publish_s: list[float]
    publish_cpu_s: list[float]
    metadata_s: list[float | None]
    metadata_cpu_s: list[float | None]
    steps_s: list[float]
    train_s: float
    checkpoint_mib: float
    described: dict


def train_once(config: JobConfig, threads: int) -> Run:
    """Train in the fresh dump folder of `config`, with a checkpoint every interval steps."""
    trainer = Trainer(config)
    steps_s: list[float] = []
    train_step = trainer.train_step

    def timed_train_step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, float]:
        # A background save competes with the steps for the cores (and, on a GPU, for memory bandwidth): the step
        # times show what the stall alone does not. train_step returns Python floats, so the device has finished.
        begin = time.perf_counter()
        result = train_step(batches)
        steps_s.append(time.perf_counter() - begin)
        return result

    trainer.train_step = timed_train_step
    try:
        begin = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - begin
        folder = Path(config.job.dump_folder) / config.checkpoint.folder
        steps = complete_steps(folder)
        size = folder_mib(folder / f"step-{steps[-1]}") if steps else 0.0
        checkpointer = trainer.checkpointer
        publish, metadata = checkpointer.publish_cost, checkpointer.metadata_cost
        return Run(list(checkpointer.blocked_s), list(checkpointer.save_s), [cost.wall_s for cost in publish],
                   [cost.cpu_s for cost in publish], [cost and cost.wall_s for cost in metadata],
                   [cost and cost.cpu_s for cost in metadata], steps_s, train_s, size,
                   describe_config(config, trainer, threads))
    finally:
        trainer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_as_rank(rank: int, world_size: int, configs: list[JobConfig], ports: list[int], threads: int,
                  results: str) -> None:
    """One of --processes training processes: every run in turn, on a process group of its own (a fresh port);
    rank 0 leaves its figures in `results`."""
    torch.set_num_threads(threads)
    runs = []
    for config, port in zip(configs, ports):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world_size))
        runs.append(train_once(config, threads))
        gc.collect()
    if rank == 0:
        Path(results).write_text(json.dumps([dataclasses.asdict(run) for run in runs]))


def run(argv: list[str]) -> dict:
    args, trainer_argv = parse_stall_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Each rank would make a temporary dump folder of its own, where the checkpoint folder must be shared.
        raise UserError("checkpoint_stall.py starts its processes itself (--processes): run it without torchrun")
    threads = args.threads or max(1, default_threads() // args.processes)
    torch.set_num_threads(threads)
    # Parsed once up front, so that a bad trainer option fails before any training; a dump folder given on the
    # command line holds the runs' folders, else a temporary folder does.
    parent = parse_args(trainer_argv).job.dump_folder if any(
        arg.split("=")[0] == "--job.dump_folder" for arg in trainer_argv) else None
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    runs: dict[str, list[Run]] = {mode: [] for mode in ASYNC_MODES}
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-", dir=parent) as scratch:
        # A fresh folder per run: one that held checkpoints would be resumed from, not trained. The modes run one
        # after the other, --repeats times in turn.
        order = [mode for _ in range(args.repeats) for mode in ASYNC_MODES]
        configs = [stall_config(trainer_argv, args, mode, tempfile.mkdtemp(prefix=f"{mode}-{index}-", dir=scratch))
                   for index, mode in enumerate(order)]
        if args.processes == 1:
            results = []
            for config in configs:
                results.append(train_once(config, threads))
                # The trainer left the collector disabled; the next run starts without this one's garbage.
                gc.collect()
        else:
            rank0_results = Path(scratch) / "rank0.json"
            mp.start_processes(train_as_rank, args=(args.processes, configs, [free_port() for _ in configs],
                                                    threads, str(rank0_results)),
                               nprocs=args.processes, start_method="spawn")
            results = [Run(**fields) for fields in json.loads(rank0_results.read_text())]
        for index, (mode, result) in enumerate(zip(order, results)):
            stalls = ", ".join(f"{s:.3f}" for s in result.stalls_s)
            logger.info(f"async_mode {mode}, run {index // len(ASYNC_MODES) + 1}/{args.repeats}: "
                        f"{len(result.stalls_s)} saves blocked the loop {stalls} s, published in "
                        f"{', '.join(f'{s:.4f}' for s in result.publish_s)} s")
            runs[mode].append(result)
    stalls = {mode: [s for result in results for s in result.stalls_s] for mode, results in runs.items()}
    medians = {mode: statistics.median(values) for mode, values in stalls.items()}
    # The first step of a run allocates and warms up: left out of the step times.
    step_medians = {mode: statistics.median([s for result in results for s in result.steps_s[1:] or result.steps_s])
                    for mode, results in runs.items()}

    def every(field: str) -> dict[str, list]:
        return {mode: [s for result in results for s in getattr(result, field)] for mode, results in runs.items()}

    def median_if_timed(values: list[float | None]) -> float | None:
        # None: the checkpoint process wrote `.metadata`, where this process cannot time it.
        return None if None in values else statistics.median(values)

    publish, publish_cpu, saves = every("publish_s"), every("publish_cpu_s"), every("saves_s")
    metadata, metadata_cpu = every("metadata_s"), every("metadata_cpu_s")
    return {
        "config": runs[SYNC][0].described,
        "processes": args.processes,
        "steps": args.steps, "interval": args.interval, "repeats": args.repeats,
        "saves_per_run": len(runs[SYNC][0].stalls_s),
        "checkpoint_mib": runs[SYNC][0].checkpoint_mib,
        "modes": {mode: {"stall_median_s": medians[mode], "stall_s": stalls[mode], "step_median_s": step_medians[mode],
                         "save_median_s": statistics.median(saves[mode]),
                         "publish_median_s": statistics.median(publish[mode]), "publish_s": publish[mode],
                         "publish_cpu_median_s": statistics.median(publish_cpu[mode]),
                         "publish_cpu_s": publish_cpu[mode], "metadata_median_s": median_if_timed(metadata[mode]),
                         "metadata_cpu_median_s": median_if_timed(metadata_cpu[mode]),
                         "train_s": [result.train_s for result in runs[mode]]} for mode in ASYNC_MODES},
        "ratio_async_to_sync": medians[ASYNC] / medians[SYNC],
        "ratio_pinned_to_sync": medians[PINNED] / medians[SYNC],
    }


def main(argv: list[str] | None = None) -> int:
    return json_main(run, argv)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
