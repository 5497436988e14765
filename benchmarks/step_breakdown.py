"""Where a training step's time goes, per category, for ours and for the peers of `benchmarks/benchmark.py`.

    python benchmarks/step_breakdown.py --job.config_file train_configs/debug_model.toml --threads 2 --plain --hf

Trainer options and --warmup/--steps/--threads/--hf/--plain as in `benchmarks/benchmark.py`. Each system warms up,
then --steps steps of each, in turn, run under `torch.profiler` (CPU activity, no shapes or stacks), and
`torchtitan/tools/step_breakdown.py` sorts every op's self time into matmul, attention, compiled kernels, norms and
elementwise work, optimizer, gradient clipping, communication and host syncs, data, logging and metrics, and the
Python and dispatch time between ops. Ours runs the trainer's loop (batch fetch, `train_step`, and the metrics
`_log_step` every `metrics.log_freq` steps); peers have no data or logging parts (they step on the batches ours
fetched). The profiler adds its own cost per op (a few percent at the debug shape), to every system alike.
Prints one JSON line: {system: {category: ms per step}}, and the tables on stderr.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.benchmark import (benchmark_config, default_threads, json_main, parse_benchmark_args,  # noqa: E402
                               peer_names)
from benchmarks.benchmark_peers import PeerTraining, initial_state_dict  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402
from torchtitan.tools.step_breakdown import CATEGORIES, breakdown, format_breakdown  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402


def profile_step(step) -> dict[str, float]:
    """Seconds per category of one call of `step`, under a profiler of its own."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        step()
        wall_s = time.perf_counter() - start
    return breakdown(profiler.events(), wall_s)


def ours_loop(trainer: Trainer, batches: list):
    """One step of the trainer's loop: fetch, train_step, and the metrics line every log_freq steps."""
    data_iterator = iter(trainer.dataloader)
    config = trainer.config
    batch_tokens = config.training.local_batch_size * config.training.seq_len * trainer.grad_accumulation_steps
    window = {"time": time.perf_counter(), "steps": 0, "data_time": 0.0}

    def step() -> None:
        with torch.profiler.record_function("data"):
            batches.append(trainer._next_batches(data_iterator))
        loss, grad_norm, lr = trainer.train_step(batches[-1])
        trainer.train_state.step += 1
        window["steps"] += 1
        if trainer.train_state.step % config.metrics.log_freq == 0:
            trainer._log_step(trainer.train_state.step, loss, grad_norm, lr, batch_tokens, window)

    return step


def run(argv: list[str]) -> dict:
    args, trainer_argv = parse_benchmark_args(argv, "step_breakdown.py", __doc__)
    if args.vs_eager or args.turns:
        raise UserError("--vs_eager and --turns time steps in benchmarks/benchmark.py; step_breakdown.py profiles ours "
                        "and the peers of --hf/--plain")
    torch.set_num_threads(args.threads or default_threads())
    peers = peer_names(args)
    with tempfile.TemporaryDirectory(prefix="step-breakdown-") as dump_folder:
        trainer = Trainer(benchmark_config(trainer_argv, 2 * (args.warmup + args.steps), dump_folder))
        try:
            state = initial_state_dict(trainer) if peers else None
            batches: list = []
            ours = ours_loop(trainer, batches)
            gc.disable()
            for _ in range(args.warmup):
                ours()
            systems = {"ours": ours}
            for name in peers:
                peer = PeerTraining(name, trainer, state)
                for i in range(args.warmup):
                    peer.step(batches[i])
                systems[name] = lambda peer=peer: peer.step(batches[-1])
            # One step of each system in turn (peers on the batch ours just fetched), so that load from other
            # processes falls on all alike.
            results = {name: dict.fromkeys(CATEGORIES, 0.0) for name in systems}
            for _ in range(args.steps):
                for name, step in systems.items():
                    gc.collect()
                    for category, seconds in profile_step(step).items():
                        results[name][category] += seconds
            gc.enable()
        finally:
            trainer.metrics.close()
            trainer.close()
    for name, seconds in results.items():
        logger.info(f"{name}, {args.steps} profiled steps:\n{format_breakdown(seconds, args.steps)}")
    return {name: {category: 1e3 * value / args.steps for category, value in seconds.items()}
            for name, seconds in results.items()}


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(json_main(run, None))
