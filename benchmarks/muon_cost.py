"""Muon's Newton-Schulz cost: measured on this machine (1, 2, 4 processes, gloo, FSDP over the debug model) and
modelled at 8B, 70B and 405B (FLOPs per rank per step and seconds at an H100's peak; bytes each rank sends per step
to spread the work).

    python benchmarks/muon_cost.py                      # the three tables (docs/recipes.md, "Muon at scale")
    python benchmarks/muon_cost.py --processes 1,2 --steps 3

Measured: each process runs one thread, its model part sharded by FSDP2 (`fully_shard` per block), random gradients;
the time of `optimizer.step()` (median over `--steps` after one warm-up, barrier before and after), the
Newton-Schulz FLOPs each rank ran (counted at its calls) and the bytes its exchanges sent per step (the optimizer's
`exchange_sent_bytes`, fp32 stacks on the CPU). Modelled: the hidden matrices of each flavor (the `hidden_matrices`
group, Muon's by default) spread over `--ranks` ranks as the optimizer spreads them (`spread`); the busiest rank's
FLOPs, and its seconds at an H100's dense bf16 peak (989 TFLOP/s) and, for the fp32 iterations that ran on every
rank before the spreading, at its fp32 peak (67 TFLOP/s, no tensor cores). Bytes: per rank and step, the bf16
stacks' all-to-alls within a replica of `--shard` FSDP ranks (the default), and with
`optimizer.muon.spread_over_replicas` over `--replicas` HSDP replicas, whose all-gather of the updates crosses
between replicas, by the ring arithmetic the optimizer counts with.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

H100_BF16_FLOPS = 989e12
H100_FP32_FLOPS = 67e12
NS_STEPS = 5


def hidden_matrices(flavor: str) -> list[tuple[int, ...]]:
    """The shapes of the flavor's hidden matrices (attention and feed-forward weights of every block)."""
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(model_args_for(flavor, 2048))
    return [tuple(p.shape) for name, p in model.named_parameters() if name.startswith("layers.") and p.dim() == 2]


def modelled(flavors: list[str], rank_counts: list[int]) -> str:
    from torchtitan.components.optimizers.muon import newton_schulz_flops, spread

    lines = ["| flavor | matrices | every rank, all matrices (before) | fp32 s at 67 TFLOP/s | "
             "bf16 s at 989 TFLOP/s | " + " | ".join(f"{r} ranks: busiest rank | bf16 s" for r in rank_counts) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(rank_counts)]
    for flavor in flavors:
        shapes = hidden_matrices(flavor)
        flops = [newton_schulz_flops(shape, NS_STEPS) for shape in shapes]
        total = sum(flops)
        row = (f"| {flavor} | {len(shapes)} | {total:.3g} | {total / H100_FP32_FLOPS:.2f} | "
               f"{total / H100_BF16_FLOPS:.3f} |")
        for ranks in rank_counts:
            loads = [0.0] * ranks
            for slots in spread(shapes, flops, ranks):
                width = len(slots) // ranks
                for r in range(ranks):
                    loads[r] += sum(flops[i] for i in slots[r * width:(r + 1) * width] if i is not None)
            busiest = max(loads)
            row += f" {busiest:.3g} ({total / busiest:.0f}x less) | {busiest / H100_BF16_FLOPS:.4f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def exchanged_bytes(shapes: list[tuple[int, ...]], shard: int, replicas: int, over_replicas: bool,
                    element: int = 2) -> tuple[float, float]:
    """Bytes one rank sends per step to spread the matrices (Muon._exchange's order: the replicated dimension
    sliced first and gathered last), and their part across replicas, for FSDP `Shard(0)` over `shard` ranks within
    each of `replicas` HSDP replicas, stacks of `element`-byte values. Per kind of n matrices, each rank takes
    width = ceil(n / R) of them (R the ranks spread over) and holds `width` of them whole, or its shards of R x width
    slots, at each exchange: an all-to-all over the shard dimension sends (shard - 1) / shard of that each way; the
    replicas' all-gather, (replicas - 1) times the rank's part."""
    counts: dict[tuple[int, ...], int] = {}
    for shape in shapes:
        counts[shape] = counts.get(shape, 0) + 1
    ranks = shard * (replicas if over_replicas else 1)
    total = across = 0.0
    for shape, n in counts.items():
        share = element * -(-n // ranks) * math.prod(shape)  # `width` whole matrices
        total += 2 * share * (shard - 1) / shard
        if over_replicas:
            across += share * (replicas - 1)
    return total + across, across


def exchanged(flavors: list[str], shard: int, replicas: int) -> str:
    lines = [f"| flavor | bf16 matrices (GB) | within each replica of {shard} FSDP ranks (default): GB per rank and "
             f"step | across replicas | spread over {replicas} replicas too (`spread_over_replicas`): GB per rank and "
             f"step | across replicas |", "|---|---|---|---|---|---|"]
    for flavor in flavors:
        shapes = hidden_matrices(flavor)
        within, _ = exchanged_bytes(shapes, shard, replicas, over_replicas=False)
        spread_all, across = exchanged_bytes(shapes, shard, replicas, over_replicas=True)
        matrices = 2 * sum(math.prod(shape) for shape in shapes)
        lines.append(f"| {flavor} | {matrices / 1e9:.1f} | {within / 1e9:.2f} | 0 | {spread_all / 1e9:.2f} | "
                     f"{across / 1e9:.2f} |")
    return "\n".join(lines) + "\n"


def worker(rank: int, world: int, store_path: str, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan.components.optimizers import muon
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.models.llama3.model import Transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Transformer(model_args_for("debugmodel", 256))
    model.init_weights(seed=0)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    matrices = [p for name, p in model.named_parameters() if name.startswith("layers.") and p.dim() == 2]
    others = [p for name, p in model.named_parameters() if not (name.startswith("layers.") and p.dim() == 2)]
    optimizer = muon.Muon([{"params": matrices, "matrix_method": True}, {"params": others}], lr=1e-3,
                          ns_steps=NS_STEPS)
    counted = []
    newton_schulz = muon.newton_schulz
    muon.newton_schulz = lambda matrix, steps, *dtype: (counted.append(
        muon.newton_schulz_flops(matrix.shape, steps) * matrix[..., 0, 0].numel()),
        newton_schulz(matrix, steps, *dtype))[1]
    generator = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(steps + 1):
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=generator)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
        counted.clear()
        dist.barrier()
        began = time.perf_counter()
        optimizer.step()
        dist.barrier()
        if step:
            times.append(time.perf_counter() - began)
    figures = torch.tensor([sum(counted), optimizer.exchange_sent_bytes / (steps + 1)], dtype=torch.float64)
    per_rank = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(per_rank, figures)
    if rank == 0:
        Path(out).write_text(f"{statistics.median(times)}\n" + " ".join(f"{f[0].item()}" for f in per_rank) + "\n"
                             + " ".join(f"{f[1].item()}" for f in per_rank))
    dist.destroy_process_group()


def measured(process_counts: list[int], steps: int) -> str:
    import torch.multiprocessing as mp

    lines = ["| processes | optimizer step (s, median) | Newton-Schulz FLOPs per rank (each rank) | total | "
             "MB sent per rank and step (each rank) |", "|---|---|---|---|---|"]
    for world in process_counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            mp.spawn(worker, args=(world, os.path.join(tmp, "store"), steps, out), nprocs=world)
            seconds, flops, sent = Path(out).read_text().split("\n")
            flops, sent = [float(v) for v in flops.split()], [float(v) for v in sent.split()]
        lines.append(f"| {world} | {float(seconds):.3f} | {', '.join(f'{f:.3g}' for f in flops)} | {sum(flops):.3g} "
                     f"| {', '.join(f'{b / 1e6:.2f}' for b in sent)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--flavors", default="8B,70B,405B")
    parser.add_argument("--ranks", default="8,64,512", help="ranks of the parameters' mesh in the modelled table")
    parser.add_argument("--shard", type=int, default=8, help="FSDP ranks per replica in the bytes table")
    parser.add_argument("--replicas", type=int, default=8, help="HSDP replicas in the bytes table")
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_measured:
        print("Measured (debug model, FSDP over the processes, one thread each, gloo):\n")
        print(measured([int(n) for n in args.processes.split(",")], args.steps))
    print(f"Modelled ({NS_STEPS} iterations per matrix and step):\n")
    print(modelled(args.flavors.split(","), [int(n) for n in args.ranks.split(",")]))
    print(f"Modelled bytes on the wire (bf16 stacks, HSDP {args.replicas} replicas x {args.shard} FSDP ranks):\n")
    print(exchanged(args.flavors.split(","), args.shard, args.replicas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
