"""Load balance of context parallelism over packed documents: attention FLOPs of the block-causal mask per CP rank.

From the repository root:

    python benchmarks/cp_balance.py --flavor 8B --seq_len 131072 --cp 2 4 8

For each mix of document lengths it packs a stream of documents into windows of `seq_len` tokens (as the data
pipeline does: documents run on across windows), and reports the attention FLOPs of the mask (forward + backward,
all layers: 12 x layers x heads x head_dim per visible (query, key) pair, as `flops_per_token` counts the full square)
of the busiest rank against the mean over ranks, averaged over the windows (and the worst window), for four
assignments of chunks to ranks: contiguous (rank r holds the r-th slice of the window), head-tail (the window in
2 x cp chunks, rank r holding r and 2cp-1-r: torch's balancing of one causal document, and this trainer's for causal
attention), and by the mask's work (`torchtitan/distributed/context_parallel.py`) with 2 and with 8 chunks per rank
(8: what the trainer does). The step waits for the busiest rank, so max/mean is the attention time lost to
imbalance. It needs no GPU and runs in seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Running `python benchmarks/cp_balance.py` puts benchmarks/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan.distributed.context_parallel import (CHUNKS_PER_RANK, balanced_chunk_order, chunk_work,  # noqa: E402
                                                     head_tail_order, rank_loads)
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import model_args_for  # noqa: E402


def document_lengths(mix: str, seq_len: int, total: int, generator: torch.Generator) -> list[int]:
    """Lengths of a stream of documents of at least `total` tokens for one mix."""
    lengths: list[int] = []
    while sum(lengths) < total:
        if mix == "few long":
            # 2-8 documents per window.
            length = int(torch.randint(seq_len // 8, seq_len // 2 + 1, (1,), generator=generator))
        elif mix == "many short":
            # Web-page-like: exponential lengths, mean 1,000 tokens.
            length = 1 + int(torch.empty(1).exponential_(1 / 1000, generator=generator))
        elif mix == "lognormal":
            # Heavy-tailed: median 1,000 tokens, one in a few hundred documents longer than 64k.
            length = 1 + int(torch.empty(1).log_normal_(6.9, 1.6, generator=generator))
        else:  # "one longer than the sequence": no document starts inside any window.
            length = total
        lengths.append(length)
    return lengths


def window_document_ids(lengths: list[int], seq_len: int, windows: int) -> torch.Tensor:
    """(windows, seq_len) document index of each token, the stream cut into consecutive windows."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:windows * seq_len]
    ids = ids.reshape(windows, seq_len)
    return ids - ids[:, :1]


MIXES = ("few long", "many short", "lognormal", "one longer than the sequence")


def report(flavor: str, seq_len: int, degrees: list[int], windows: int, seed: int) -> str:
    for degree in degrees:
        if degree < 2 or seq_len % (CHUNKS_PER_RANK * degree):
            raise UserError(f"--cp: {degree} must be at least 2 and {CHUNKS_PER_RANK} x cp must divide --seq_len "
                            f"{seq_len}")
    args = model_args_for(flavor, seq_len)
    flops_per_pair = 12 * args.n_layers * args.n_heads * args.head_dim
    lines = [f"{flavor} at seq {seq_len:,}, {windows} windows per mix (seed {seed}); attention FLOPs of the mask per "
             f"rank, busiest / mean over ranks, mean over windows (worst window)", "",
             "| mix | documents per window | mask / causal FLOPs | CP | mean TFLOP per rank and window | contiguous | head-tail "
             f"| by work, 2 chunks per rank | by work, {CHUNKS_PER_RANK} chunks per rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mix in MIXES:
        generator = torch.Generator().manual_seed(seed)
        ids = window_document_ids(document_lengths(mix, seq_len, windows * seq_len, generator), seq_len, windows)
        documents = (ids[:, -1] + 1).float().mean().item()
        pairs = chunk_work(ids, 1).item()
        causal_pairs = windows * seq_len * (seq_len + 1) // 2
        for degree in degrees:
            ratios: dict[str, list[float]] = {}
            for window in ids:
                two, fine = chunk_work(window[None], 2 * degree), chunk_work(window[None], CHUNKS_PER_RANK * degree)
                assignments = {"contiguous": (two, list(range(2 * degree))),
                               "head-tail": (two, head_tail_order(degree, 2)),
                               "by work 2": (two, balanced_chunk_order(two, degree)),
                               "by work": (fine, balanced_chunk_order(fine, degree))}
                for name, (work, order) in assignments.items():
                    loads = rank_loads(work, order, degree).double()
                    ratios.setdefault(name, []).append((loads.max() / loads.mean()).item())
            mean_tflops = flops_per_pair * pairs / windows / degree / 1e12
            cells = " | ".join(f"{sum(r) / len(r):.2f} ({max(r):.2f})" for r in ratios.values())
            lines.append(f"| {mix} | {documents:.1f} | {pairs / causal_pairs:.3f} | {degree} | {mean_tflops:,.1f} | "
                         f"{cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="8B", help="model flavor whose heads and layers price a visible pair")
    parser.add_argument("--seq_len", type=int, default=131072)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="context-parallel degrees")
    parser.add_argument("--windows", type=int, default=16, help="windows per mix")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    try:
        print(report(options.flavor, options.seq_len, options.cp, options.windows, options.seed))
    except UserError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
