"""Context parallelism over packed documents measured on this machine: causal against block-causal attention, per
sequence length and CP degree, in real processes (gloo).

From the repository root:

    python benchmarks/cp_scaling.py --flavor tiny --seq_len 8192 16384 32768 --cp 1 2 4

For each CP degree it forks that many ranks (one torch thread each) once; they run every sequence length, and at
each length the two masks one after the other on the same batch, so that causal and block-causal are timed side by
side. A step is what the trainer's step does to the model (`Trainer.forward_backward`): the batch sharded as the
trainer shards it (causal: torch's ring attention with head-tail balancing, the trainer's
parallelism.context_parallel_method = ring; block-causal: chunks balanced by the
mask's work, keys and values all-gathered), forward, cross-entropy, backward; no optimizer step (the same for every
configuration, and not what CP changes). The batch is one window of a stream of packed documents of `--mix` lengths
(`benchmarks/cp_balance.py`'s mixes) with random tokens, BOS at each document start.

Per configuration it prints one row:
- mask / causal FLOPs: attention FLOPs of the mask's visible (query, key) pairs over causal attention's; 1 minus it
  is what a kernel that skips invisible pairs (FlexAttention on GPUs) saves. What the CPU kernels execute differs:
  causal attention's flash kernel skips the blocks above the diagonal, one process's block-causal path attends
  document by document, and block-causal under CP runs SDPA with a boolean mask over the rank's queries and every
  key (the dense rectangle).
- tokens/s: the window's tokens over the median step time (wall clock, all ranks; on a machine with fewer cores than
  ranks, ranks share cores).
- balance, counted: the busiest rank's visible pairs over the mean, head-tail (before) and by the mask's work
  (after: what the trainer does); measured: the busiest rank's CPU time per step over the mean.
- peak memory per rank: the largest rise of the resident set (VmHWM, reset before each configuration) over the
  resident set before it, over the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Running `python benchmarks/cp_scaling.py` puts benchmarks/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.cp_balance import MIXES, document_lengths, window_document_ids  # noqa: E402
from torchtitan.distributed import context_parallel as cp  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import model_args_for  # noqa: E402
from torchtitan.models.llama3.model import Transformer, document_ids, document_positions  # noqa: E402

BOS = 1
MASKS = ("causal", "block_causal")


def window(mix: str, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """(1, seq_len + 1) tokens of packed documents: random ids, BOS at every document start."""
    generator = torch.Generator().manual_seed(seed)
    ids = window_document_ids(document_lengths(mix, seq_len + 1, seq_len + 1, generator), seq_len + 1, 1)
    tokens = torch.randint(BOS + 1, vocab_size, ids.shape, generator=generator)
    # The stream starts with a document: its first token is BOS too.
    starts = torch.diff(ids, dim=1, prepend=ids[:, :1] - 1) != 0
    return torch.where(starts, BOS, tokens)


def model_args(options: argparse.Namespace, seq_len: int):
    args = model_args_for(options.flavor, seq_len)
    return args if options.n_layers is None else dataclasses.replace(args, n_layers=options.n_layers)


def resident_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_resident() -> None:
    # Writing 5 to clear_refs resets the process's peak resident set (VmHWM) to its current one (Linux).
    Path("/proc/self/clear_refs").write_text("5")


def step(model: Transformer, mesh, inputs: torch.Tensor, labels: torch.Tensor, mask: str) -> None:
    """Forward, loss and backward of one window, sharded over `mesh` (None: one process) as the trainer does."""
    with contextlib.ExitStack() as stack:
        masking = {}
        if mask == "block_causal":
            ids = document_ids(inputs, BOS)
            masking = {"document_ids": ids, "positions": document_positions(ids)}
            if mesh is not None:
                inputs, labels, *sharded = cp.shard_documents(mesh, ids, [inputs, labels, *masking.values()])
                masking = dict(zip(masking, sharded))
        elif mesh is not None:
            stack.enter_context(cp.context_parallel_context(mesh, [inputs, labels, model.rope], [1, 1, 0],
                                                            {inputs, labels}, "allgather"))
        logits = model(inputs, **masking)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)).backward()


def worker(rank: int, degree: int, options: argparse.Namespace, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    mesh = None
    if degree > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, degree), rank=rank, world_size=degree,
                                timeout=datetime.timedelta(minutes=30))
        mesh = dist.device_mesh.DeviceMesh("cpu", list(range(degree)), mesh_dim_names=("cp",))
    try:
        results = {}
        for seq_len in options.seq_len:
            args = model_args(options, seq_len)
            tokens = window(options.mix, seq_len, args.vocab_size, options.seed)
            for mask in MASKS:
                model = Transformer(args)
                model.init_weights(seed=0)
                if mesh is not None and mask == "block_causal":
                    cp.apply_document_cp(model, mesh)
                reset_peak_resident()
                before = resident_gib("VmRSS")
                walls, cpus = [], []
                for index in range(options.warmup + options.steps):
                    # Clones: causal CP shards the batch's tensors in place.
                    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
                    model.zero_grad(set_to_none=True)
                    if mesh is not None:
                        dist.barrier()
                    wall, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
                    step(model, mesh, inputs, labels, mask)
                    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu
                    if mesh is not None:
                        dist.barrier()
                    if index >= options.warmup:
                        walls.append(time.perf_counter() - wall)
                        cpus.append(cpu)
                results[seq_len, mask] = {"step_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                                          "peak_gib": resident_gib("VmHWM") - before}
                del model
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        if mesh is not None:
            dist.destroy_process_group()


def balance(tokens: torch.Tensor, degree: int) -> tuple[float, float]:
    """Busiest rank's visible pairs over the mean: head-tail, and by the mask's work (the trainer's assignment)."""
    ids = document_ids(tokens[:, :-1], BOS)
    ratios = []
    for chunks_per_rank, order in ((2, cp.head_tail_order(degree, 2)), (cp.CHUNKS_PER_RANK, None)):
        work = cp.chunk_work(ids, chunks_per_rank * degree)
        loads = cp.rank_loads(work, order or cp.balanced_chunk_order(work, degree), degree).double()
        ratios.append((loads.max() / loads.mean()).item())
    return ratios[0], ratios[1]


def measure(options: argparse.Namespace) -> str:
    for degree in options.cp:
        for seq_len in options.seq_len:
            if degree < 1 or seq_len % (cp.CHUNKS_PER_RANK * degree):
                raise UserError(f"--cp: {degree} must be at least 1 and {cp.CHUNKS_PER_RANK} x cp must divide "
                                f"--seq_len {seq_len}")
    by_degree = {}
    for degree in options.cp:
        with tempfile.TemporaryDirectory() as tmp:
            processes = mp.start_processes(worker, args=(degree, options, str(Path(tmp) / "store"), tmp),
                                           nprocs=degree, start_method="fork")
            del processes
            by_degree[degree] = [torch.load(Path(tmp) / f"rank{rank}.pt", weights_only=True) for rank in range(degree)]
    layers = "" if options.n_layers is None else f" with {options.n_layers} layers"
    lines = [f"{options.flavor}{layers}, batch 1, fp32, {options.mix} documents (seed {options.seed}), one torch thread per "
             f"rank, median of {options.steps} steps after {options.warmup}", "",
             "| seq | documents | mask / causal FLOPs | CP | causal tokens/s | block_causal tokens/s | block / causal speed "
             "| balance counted: head-tail, by work | balance measured (CPU time max / mean): causal, block_causal "
             "| causal peak GiB per rank | block_causal peak GiB per rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for seq_len in options.seq_len:
        args = model_args(options, seq_len)
        tokens = window(options.mix, seq_len, args.vocab_size, options.seed)
        ids = document_ids(tokens[:, :-1], BOS)
        pairs = cp.chunk_work(ids, 1).item()
        for degree in options.cp:
            ranks = by_degree[degree]
            cells = {}
            for mask in MASKS:
                rows = [results[seq_len, mask] for results in ranks]
                cpus = [row["cpu_s"] for row in rows]
                cells[mask] = {"tokens_s": seq_len / max(row["step_s"] for row in rows),
                               "cpu_balance": max(cpus) / statistics.mean(cpus),
                               "peak_gib": max(row["peak_gib"] for row in rows)}
            counted = "-" if degree == 1 else "{:.2f}, {:.2f}".format(*balance(tokens, degree))
            lines.append(
                f"| {seq_len:,} | {ids[0, -1].item()} | {pairs / (seq_len * (seq_len + 1) // 2):.3f} | {degree} | "
                f"{cells['causal']['tokens_s']:,.0f} | {cells['block_causal']['tokens_s']:,.0f} | "
                f"{cells['block_causal']['tokens_s'] / cells['causal']['tokens_s']:.2f} | {counted} | "
                f"{cells['causal']['cpu_balance']:.2f}, {cells['block_causal']['cpu_balance']:.2f} | "
                f"{cells['causal']['peak_gib']:.2f} | {cells['block_causal']['peak_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="tiny", help="model flavor")
    parser.add_argument("--n_layers", type=int, default=None,
                        help="layers instead of the flavor's (fewer: a shorter run, the same attention per layer)")
    parser.add_argument("--seq_len", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel degrees")
    parser.add_argument("--mix", choices=MIXES, default="few long", help="document lengths (benchmarks/cp_balance.py)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    try:
        print(measure(options))
    except UserError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
