"""GaLore's costs for a model flavor: optimizer-state bytes of the projected matrices against AdamW's, and the time of
one subspace refresh per matrix shape, exact SVD against the randomized range finder (GaLore 2).

    python benchmarks/galore_costs.py --flavor debugmodel
    python benchmarks/galore_costs.py --flavor debugmodel --dim 2048   # the flavor with another model dimension
    python benchmarks/galore_costs.py --flavor 8B --device cuda --repeats 3

The state bytes come from the optimizers' registered `state_bytes` (what the memory planner uses; a unit test checks
them against the state a step creates). The refresh is timed on a random matrix of each shape with a decaying
spectrum, in fp32, without the all-gather that precedes it under FSDP/TP (one whole gradient per matrix).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan.components.optimizer_groups import classify  # noqa: E402
from torchtitan.components.optimizers import optimizer_spec  # noqa: E402
from torchtitan.components.optimizers.galore import default_rank, projected_dim, top_subspace  # noqa: E402
from torchtitan.config.job_config import Optimizer as OptimizerConfig  # noqa: E402
from torchtitan.models.llama3.args import model_args_for  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402


def matrix_shapes(flavor: str, dim: int | None) -> tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], int]]:
    """(shape -> count) of the hidden matrices (GaLore projects them) and of every other parameter."""
    with torch.device("meta"):
        model = Transformer(model_args_for(flavor, 2048, overrides={"dim": dim} if dim else None))
    groups = classify(model)
    hidden: dict[tuple[int, ...], int] = {}
    other: dict[tuple[int, ...], int] = {}
    for name, param in model.named_parameters():
        target = hidden if groups[name] == "hidden_matrices" else other
        target[tuple(param.shape)] = target.get(tuple(param.shape), 0) + 1
    return hidden, other


def refresh_seconds(shape: tuple[int, ...], rank: int, method: str, device: str, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    side = min(shape)
    spectrum = 0.97 ** torch.arange(side, dtype=torch.float32)
    left = torch.linalg.qr(torch.randn(shape[0], side, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(shape[1], side, generator=generator)).Q
    gradient = (left * spectrum) @ right.T
    gradient = (gradient if projected_dim(shape) == 0 else gradient.T).to(device)
    times = []
    for _ in range(repeats + 1):  # the first call warms up (kernels, workspace)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        top_subspace(gradient, rank, method, torch.Generator().manual_seed(1))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--dim", type=int, default=None, help="model dimension instead of the flavor's")
    parser.add_argument("--rank", type=int, default=None, help="projection rank (default: a quarter of each "
                                                               "matrix's smaller side)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    galore = OptimizerConfig(name="GaLore-AdamW")
    galore.galore.rank = args.rank
    galore_bytes, adamw_bytes = optimizer_spec("GaLore-AdamW").state_bytes, optimizer_spec("AdamW").state_bytes
    hidden, other = matrix_shapes(args.flavor, args.dim)
    print(f"flavor {args.flavor}{f' with dim {args.dim}' if args.dim else ''}, device {args.device} ({torch.get_num_threads()} threads), "
          f"median of {args.repeats}\n")
    print("| matrix shape | count | rank | GaLore state / AdamW state | exact SVD s | randomized s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    totals = {"galore": 0.0, "adamw": 0.0}
    for shape, count in hidden.items():
        rank = args.rank or default_rank(shape)
        ours, theirs = galore_bytes(shape, shape, galore, True), adamw_bytes(shape, shape, galore, False)
        totals["galore"] += count * ours
        totals["adamw"] += count * theirs
        exact = refresh_seconds(shape, rank, "exact", args.device, args.repeats)
        randomized = refresh_seconds(shape, rank, "randomized", args.device, args.repeats)
        print(f"| {shape[0]} x {shape[1]} | {count} | {rank} | {ours / theirs:.1%} | {exact:.4f} | "
              f"{randomized:.4f} | {exact / randomized:.1f}x |")
    rest = sum(count * adamw_bytes(shape, shape, galore, False) for shape, count in other.items())
    print(f"\nprojected matrices: GaLore state {totals['galore'] / 2**20:.2f} MiB = "
          f"{totals['galore'] / totals['adamw']:.1%} of AdamW's {totals['adamw'] / 2**20:.2f} MiB "
          f"(moments and projectors, fp32)")
    print(f"whole model (embeddings, output and norms keep AdamW's state, {rest / 2**20:.2f} MiB): "
          f"{(totals['galore'] + rest) / (totals['adamw'] + rest):.1%} of AdamW's "
          f"{(totals['adamw'] + rest) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
