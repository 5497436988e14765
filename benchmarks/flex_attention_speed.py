"""FlexAttention's speed on one GPU under the masks the trainer builds, 8,192 to 131,072 tokens, against SDPA's
flash kernel, and where the time of a first call goes. It measures what the planner takes from a published figure
(`FLEX_FRACTION` in torchtitan/planner/attention.py: FlexAttention at 90% / 85% of FlashAttention-2, forward /
backward), and what stopped scripts/calibrate_gpu.py's block-causal step at its time limit on an H100.

    python benchmarks/flex_attention_speed.py --output flex_attention_speed.json

Masks, each built as the trainer builds it (a BlockMask from `build_block_mask`, compiled on GPUs) and run through
`model.block_causal_attention` (compiled FlexAttention, grouped K/V):
- causal: one sequence, a query sees the keys at positions not later than its own (`visible_keys` without document
  ids: what causal attention under context parallelism over gathered keys runs, here with CP 1);
- block_causal: packed documents of `--document_length` tokens (`document_mask`);
- causal_index: the causal mask by index (q >= kv, no positions read): tells a cost of reading positions in the
  mask from the kernel's.
Shape: Llama 3.1 8B's attention, 32 query heads and 8 KV heads of 128, bf16, one sequence. FLOPs in
FlashAttention's convention (forward 4 x visible pairs x head dim x heads, backward 2.5 x that); the flash kernel
runs the same visible pairs: causal over the whole sequence, or causal over one document, as many documents as the
window holds, its K/V expanded to the query heads as `model.causal_attention` passes them.

Each case starts from an empty compile cache (`torch.compiler.reset()`), as a training run that compiles for its one
sequence length, and reports apart: the first mask build, the first forward, the first forward and backward (each
with its compile), the steady-state times, the graphs compiled and the peak memory. The last row runs the first
length's block-causal case again after all others without a reset (what the calibration did: one compiled function
for lengths one after another, which torch recompiles with dynamic shapes), its compile and speed to set against
the static row. Each row is written to `--output` as soon as it is measured; `--time_limit` stops before a case
that would start after it (a lent GPU runs one command for at most 10 minutes).

`--device cpu` runs tiny shapes, forward only, FlexAttention eager (inductor's CPU template fails for these shapes
and FlexAttention has no CPU backward in torch 2.13): a check of this script, not of any GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from torchtitan.distributed.context_parallel import visible_keys  # noqa: E402
from torchtitan.models.llama3 import model as llama3_model  # noqa: E402
from torchtitan.models.llama3.model import block_causal_attention, build_block_mask, document_mask  # noqa: E402
from torchtitan.tools.device_info import device_name  # noqa: E402

MASKS = ("causal", "block_causal", "causal_index")
# The longest lengths early: a run cut by its time limit keeps 8k, 32k and 128k.
SEQ_LENS = (8192, 32768, 131072, 16384, 65536)
GPU_SHAPE = dict(heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CPU_SHAPE = dict(heads=2, kv_heads=1, head_dim=64, dtype=torch.float32)
CPU_SEQ_LENS = (256, 512)
BACKWARD_FLOPS_RATIO = 2.5


def synchronized(device: torch.device, fn):
    """(seconds, result) of `fn`, the device synchronised around it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def steady_seconds(device: torch.device, fn, iterations: int) -> float:
    """Median seconds per call of `fn` after one warm-up call."""
    fn()
    return statistics.median(synchronized(device, fn)[0] for _ in range(iterations))


def build_mask(mask: str, seq_len: int, document_length: int, device: torch.device):
    positions = torch.arange(seq_len, device=device)[None]
    if mask == "causal":
        return visible_keys(None, positions, None, positions, flex=True)
    if mask == "block_causal":
        return document_mask(positions // document_length, flex=True)
    return build_block_mask(lambda b, h, q, kv: q >= kv, 1, seq_len, seq_len, device)


def visible_pairs(mask: str, seq_len: int, document_length: int) -> int:
    """The (query, key) pairs the mask leaves: causal over each document (seq_len a multiple of its length)."""
    length = document_length if mask == "block_causal" else seq_len
    return seq_len // length * length * (length + 1) // 2


def inputs(shape: dict, batch: int, seq_len: int, kv_heads: int, device: torch.device, backward: bool):
    q = torch.randn(batch, shape["heads"], seq_len, shape["head_dim"], device=device, dtype=shape["dtype"])
    k, v = (torch.randn(batch, kv_heads, seq_len, shape["head_dim"], device=device, dtype=shape["dtype"])
            for _ in range(2))
    return [t.requires_grad_(backward) for t in (q, k, v)]


def flex_row(mask: str, seq_len: int, args, shape: dict, device: torch.device, reset: bool) -> dict:
    backward = device.type == "cuda"
    if reset and device.type == "cuda":  # the CPU form's FlexAttention runs eager: nothing to drop
        torch.compiler.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row = {"mask": mask, "seq_len": seq_len, "compile_cache": "reset" if reset else "kept"}
    if mask == "block_causal":
        row["document_length"] = args.document_length
    row["first_mask_build_s"], block_mask = synchronized(device, lambda: build_mask(mask, seq_len,
                                                                                   args.document_length, device))
    row["mask_build_s"] = steady_seconds(device, lambda: build_mask(mask, seq_len, args.document_length, device),
                                         args.iterations)
    q, k, v = inputs(shape, 1, seq_len, shape["kv_heads"], device, backward)
    grad = torch.randn_like(q)

    def forward():
        return block_causal_attention(q, k, v, block_mask, device.type)

    def forward_backward():
        return torch.autograd.grad(forward(), (q, k, v), grad)

    row["first_forward_s"] = synchronized(device, forward)[0]
    if backward:
        row["first_forward_backward_s"] = synchronized(device, forward_backward)[0]
    row["forward_s"] = steady_seconds(device, forward, args.iterations)
    flops = 4 * visible_pairs(mask, seq_len, args.document_length) * shape["head_dim"] * shape["heads"]
    row["forward_tflops"] = flops / row["forward_s"] / 1e12
    if backward:
        row["forward_backward_s"] = steady_seconds(device, forward_backward, args.iterations)
        row["backward_tflops"] = BACKWARD_FLOPS_RATIO * flops / (row["forward_backward_s"] - row["forward_s"]) / 1e12
    row["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs_before
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def flash_rates(mask: str, seq_len: int, args, shape: dict, device: torch.device) -> dict:
    """SDPA's flash kernel (the CPU's on the CPU) on the same visible pairs, K/V expanded to the query heads."""
    length = args.document_length if mask == "block_causal" else seq_len
    backward = device.type == "cuda"
    q, k, v = inputs(shape, seq_len // length, length, shape["heads"], device, backward)
    grad = torch.randn_like(q)

    def forward():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    flops = 4 * visible_pairs(mask, seq_len, args.document_length) * shape["head_dim"] * shape["heads"]
    forward_s = steady_seconds(device, forward, args.iterations)
    rates = {"flash_forward_tflops": flops / forward_s / 1e12}
    if backward:
        both = steady_seconds(device, lambda: torch.autograd.grad(forward(), (q, k, v), grad), args.iterations)
        rates["flash_backward_tflops"] = BACKWARD_FLOPS_RATIO * flops / (both - forward_s) / 1e12
    return rates


def measure(mask: str, seq_len: int, args, shape: dict, device: torch.device, reset: bool = True) -> dict:
    row = flex_row(mask, seq_len, args, shape, device, reset)
    row.update(flash_rates(mask, seq_len, args, shape, device))
    row["forward_fraction_of_flash"] = row["forward_tflops"] / row["flash_forward_tflops"]
    if "backward_tflops" in row:
        row["backward_fraction_of_flash"] = row["backward_tflops"] / row["flash_backward_tflops"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSON file to write (rewritten after every row)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu: tiny shapes, forward only (a check of this script)")
    parser.add_argument("--seq_lens", type=int, nargs="+", default=None,
                        help=f"sequence lengths, in the order measured (default: {' '.join(map(str, SEQ_LENS))}; "
                             f"on the CPU {' '.join(map(str, CPU_SEQ_LENS))})")
    parser.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS), help="the masks, in order")
    parser.add_argument("--document_length", type=int, default=4096,
                        help="block_causal: the packed documents' length in tokens, a divisor of every sequence "
                             "length (on the CPU, capped at 64)")
    parser.add_argument("--iterations", type=int, default=3, help="timed calls per measurement (their median)")
    parser.add_argument("--time_limit", type=float, default=480.0,
                        help="seconds after which no new case starts (what was measured is in --output)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: option --device: cuda, but this machine has no GPU; use --device cpu to check the script",
              file=sys.stderr)
        return 2
    if args.iterations < 1 or args.document_length < 1:
        print("error: option --iterations and --document_length must be positive integers", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    shape, seq_lens = (GPU_SHAPE, SEQ_LENS) if device.type == "cuda" else (CPU_SHAPE, CPU_SEQ_LENS)
    seq_lens = args.seq_lens or seq_lens
    if device.type == "cpu":
        args.document_length = min(args.document_length, 64)
    if "block_causal" in args.masks and any(seq_len % args.document_length for seq_len in seq_lens):
        print(f"error: option --document_length: {args.document_length} must divide every sequence length "
              f"({' '.join(map(str, seq_lens))}): the windows hold whole documents", file=sys.stderr)
        return 2
    if device.type == "cuda":
        run_cases(args, shape, seq_lens, device)
        return 0
    compiled = llama3_model._compiled_flex_attention
    llama3_model._compiled_flex_attention = flex_attention
    try:
        run_cases(args, shape, seq_lens, device)
    finally:
        llama3_model._compiled_flex_attention = compiled
    return 0


def run_cases(args, shape: dict, seq_lens: list[int], device: torch.device) -> None:
    start = time.perf_counter()
    record = {"device": device_name(device), "torch": torch.__version__, "shape": {**shape, "dtype": str(
        shape["dtype"]).removeprefix("torch.")}, "iterations": args.iterations, "complete": False, "rows": []}
    cases = [(mask, seq_len, True) for seq_len in seq_lens for mask in args.masks]
    if "block_causal" in args.masks and len(seq_lens) > 1:
        cases.append(("block_causal", seq_lens[0], False))
    for mask, seq_len, reset in cases:
        if time.perf_counter() - start > args.time_limit:
            print(f"stopped at the time limit ({args.time_limit:.0f} s) before {mask} at {seq_len}", flush=True)
            break
        row = measure(mask, seq_len, args, shape, device, reset)
        record["rows"].append(row)
        record["seconds"] = time.perf_counter() - start
        record["complete"] = len(record["rows"]) == len(cases)
        Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
        print(" ".join(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                       for key, value in row.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
