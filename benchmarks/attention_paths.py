"""Forward + backward time of one causal attention layer on the CPU, per implementation, timed in turns in one
process: what the model's attention path chooses between, and what a compiler could do instead.

    python benchmarks/attention_paths.py --threads 2                     # the debug model's shape at seq 512
    python benchmarks/attention_paths.py --seq_len 1024 --head_dim 64 --heads 4 --kv_heads 2

Paths (bf16 inputs, grouped K/V heads as the model has them):
- `flash_fp32`: torch's CPU flash kernel on the inputs cast to fp32, autocast off (the model's choice for narrow heads
  and short sequences, `cpu_attention_in_fp32`);
- `flash_bf16`: the same kernel in bf16;
- `math_fp32` / `math_bf16`: the attention written out (scores, causal mask, softmax, weighted sum), eager;
- `compiled_math_fp32` / `compiled_math_bf16`: the same, through `torch.compile` (inductor fuses the mask and the
  softmax, the matmuls stay matmuls);
FlexAttention is not among them: torch 2.13 has no FlexAttention backward on the CPU.

Prints a table (median ms per forward + backward, and each output's largest difference from `flash_fp32`) on stderr
and one JSON line on stdout.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, enable_gqa=True)
    return out.to(q.dtype)


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Causal attention as matmuls and a softmax (in fp32), the query heads of each K/V head side by side."""
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads * seq, head_dim)
    scores = (grouped @ k.to(dtype).transpose(-1, -2)).float().view(batch, kv_heads, heads // kv_heads, seq, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    weights = (scores * head_dim ** -0.5).masked_fill(~causal, float("-inf")).softmax(-1).to(dtype)
    out = weights.view(batch, kv_heads, -1, seq) @ v.to(dtype)
    return out.view(batch, heads, seq, head_dim).to(q.dtype)


def paths(compiled: bool) -> dict:
    chosen = {
        "flash_fp32": lambda q, k, v: flash(q, k, v, torch.float32),
        "flash_bf16": lambda q, k, v: flash(q, k, v, torch.bfloat16),
        "math_fp32": lambda q, k, v: written_out(q, k, v, torch.float32),
        "math_bf16": lambda q, k, v: written_out(q, k, v, torch.bfloat16),
    }
    if compiled:
        fused = torch.compile(written_out)
        chosen["compiled_math_fp32"] = lambda q, k, v: fused(q, k, v, torch.float32)
        chosen["compiled_math_bf16"] = lambda q, k, v: fused(q, k, v, torch.bfloat16)
    return chosen


def measure(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, repeats: int,
            compiled: bool = True) -> dict:
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, n, seq_len, head_dim, generator=generator, dtype=torch.bfloat16)
              for n in (heads, kv_heads, kv_heads)]
    grad = torch.randn(batch, heads, seq_len, head_dim, generator=generator, dtype=torch.bfloat16)

    def step(path):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = path(q, k, v)
        out.backward(grad)
        return out.detach(), q.grad

    chosen = paths(compiled)
    reference = step(chosen["flash_fp32"])
    results = {}
    for name, path in chosen.items():
        out, q_grad = step(path)  # warm-up (compiles)
        results[name] = {"max_abs_diff_out": (out.float() - reference[0].float()).abs().max().item(),
                         "max_abs_diff_q_grad": (q_grad.float() - reference[1].float()).abs().max().item(),
                         "ms": []}
    for _ in range(repeats):
        for name, path in chosen.items():
            started = time.perf_counter()
            step(path)
            results[name]["ms"].append(1000 * (time.perf_counter() - started))
    for entry in results.values():
        entry["median_ms"] = statistics.median(entry.pop("ms"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--head_dim", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=8, help="timed rounds, the paths in turn in each")
    parser.add_argument("--no_compile", action="store_true", help="leave the compiled paths out")
    args = parser.parse_args(argv)
    sizes = {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "seq_len": args.seq_len,
             "head_dim": args.head_dim, "repeats": args.repeats}
    if min(sizes.values()) < 1 or args.heads % args.kv_heads:
        print(f"error: sizes must be positive and --kv_heads must divide --heads; got {sizes}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(**sizes, compiled=not args.no_compile)
    print(f"{'path':<20} {'ms':>8} {'max |out - flash_fp32|':>24}", file=sys.stderr)
    for name, entry in results.items():
        print(f"{name:<20} {entry['median_ms']:8.1f} {entry['max_abs_diff_out']:24.4f}", file=sys.stderr)
    print(json.dumps({"shape": sizes, "threads": torch.get_num_threads(), "paths": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
