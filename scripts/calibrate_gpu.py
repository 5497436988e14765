"""Measure on one GPU what the planner's performance model takes from datasheets and published benchmarks, in one
command (a few minutes; under 8 on an H100), and write it to a file that `scripts/plan.py --calibrate FILE` reads:

- bf16 GEMM speed by shape: the linear layers of a Llama 3 8B block (wq/wo, wk/wv, w1/w3, w2) on 8,192 tokens, whole
  and as a TP 8 shard; the planner times each of these shapes as measured, and sets the level of its shape model
  (planner/hardware.py, gemm_seconds) so that the model takes as long over all of them as they took;
- the Float8 speed-up: the same whole-block GEMMs through torch._scaled_mm with tensorwise scales (what torchao's
  Float8 training runs), against bf16;
- GEMM speed over a grid of shapes: every linear layer of the 8B, 70B and 405B blocks, whole and split 2, 4 and 8
  ways as TP splits them, on 2,048 and 8,192 tokens (what a shape-dependent GEMM model is checked against);
- attention by sequence length and mask: SDPA forward and backward (flash kernel on CUDA), causal and without mask,
  head dim 128, 16,384 tokens per call as in FlashAttention's benchmarks, 512 to 32,768 tokens;
- block-causal attention as the trainer runs it on GPUs (compiled FlexAttention with a document BlockMask, grouped
  K/V): its FLOP/s over the visible pairs, forward and backward, for documents of one length packed into windows,
  as a fraction of the flash kernel's causal speed at the document's length;
- the allocator's reserve: three training steps of a 4-block Llama-shaped model at 8,192 tokens under the trainer's
  allocator settings (expandable segments): the peak reserved over the peak allocated, less one.

    python scripts/calibrate_gpu.py --output h100.json
    python scripts/plan.py --calibrate h100.json --gpu h100 --flavor 8B --gpus 64

Without a GPU it stops with one error line; `--device cpu --quick` runs tiny shapes on the CPU, only to check the
file's format and that plan.py reads it (its figures describe no GPU).
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

# The trainer's allocator settings (torchtitan/train.py), set before torch initialises CUDA.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.planner.hardware import ATTENTION_CURVES, CALIBRATION_FORMAT  # noqa: E402
from torchtitan.tools.device_info import device_name  # noqa: E402

# (dim, kv width, FFN width, tokens, heads, attention lengths, attention tokens per call, model blocks, vocabulary,
# the block's layers timed in Float8: the CPU's float8 matmul is a slow reference kernel, so --quick times one)
FULL = dict(dim=4096, kv=1024, ffn=14336, tokens=8192, heads=32, seq_lens=(512, 1024, 2048, 4096, 8192, 16384, 32768),
            attention_tokens=16384, blocks=4, vocab=32768, float8_layers=7)
QUICK = dict(dim=64, kv=16, ffn=192, tokens=64, heads=2, seq_lens=(64, 128, 256), attention_tokens=256, blocks=1,
             vocab=256, float8_layers=1)
HEAD_DIM = 128
TP = 8
# (dim, kv width, FFN width) of the Llama 3.1 8B, 70B and 405B blocks; the grid's TP degrees and token counts.
GRID_MODELS = {"8B": (4096, 1024, 14336), "70B": (8192, 1024, 28672), "405B": (16384, 1024, 53248)}
GRID_TP = (1, 2, 4, 8)
GRID_TOKENS = (2048, 8192)
# (window, document length) pairs of the block-causal measurement: one window length per compile.
FLEX_CASES = ((16384, 1024), (16384, 4096), (16384, 16384), (65536, 4096), (65536, 16384), (65536, 65536))
QUICK_FLEX_CASES = ((256, 64), (256, 256))


def _timed(fn, device: torch.device, iterations: int) -> float:
    """Seconds per call of `fn`, after two warm-up calls, the device synchronised around the timed ones."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iterations


def _block_shapes(s: dict, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, tokens, in, out) of a block's linear layers, each weight split `tp` ways as TP splits it."""
    d, kv, f, m = s["dim"], s["kv"], s["ffn"], s["tokens"]
    return [("wq", m, d, d // tp), ("wk", m, d, kv // tp), ("wv", m, d, kv // tp), ("wo", m, d // tp, d),
            ("w1", m, d, f // tp), ("w3", m, d, f // tp), ("w2", m, f // tp, d)]


def gemms(s: dict, device: torch.device, iterations: int) -> tuple[list[dict], float]:
    """bf16 GEMM speed per shape, whole and as a TP shard; and the whole block's rate (FLOPs over time)."""
    entries, block_flops, block_seconds = [], 0.0, 0.0
    for tp in (1, TP):
        for name, m, k, n in _block_shapes(s, tp):
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            seconds = _timed(lambda: a @ b.t(), device, iterations)
            flops = 2 * m * k * n
            entries.append({"layer": name, "tp": tp, "m": m, "k": k, "n": n, "flops_per_s": flops / seconds})
            if tp == 1:
                block_flops, block_seconds = block_flops + flops, block_seconds + seconds
    return entries, block_flops / block_seconds


def gemm_grid(device: torch.device, iterations: int, quick: bool) -> list[dict]:
    """bf16 FLOP/s of every linear layer of the 8B, 70B and 405B blocks, whole and TP-split, on two token counts."""
    models = {"tiny": (64, 16, 192)} if quick else GRID_MODELS
    entries = []
    for model, (dim, kv, ffn) in models.items():
        for tokens in (64,) if quick else GRID_TOKENS:
            for tp in GRID_TP:
                s = dict(dim=dim, kv=kv, ffn=ffn, tokens=tokens)
                for name, m, k, n in _block_shapes(s, tp):
                    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
                    seconds = _timed(lambda: a @ b.t(), device, iterations)
                    entries.append({"model": model, "layer": name, "tp": tp, "m": m, "k": k, "n": n,
                                    "flops_per_s": 2 * m * k * n / seconds})
    return entries


def float8_speedup(s: dict, device: torch.device, iterations: int) -> tuple[float | None, str]:
    """bf16 time over float8 time of the whole block's GEMMs (torch._scaled_mm, tensorwise scales)."""
    bf16 = fp8 = 0.0
    try:
        for _, m, k, n in _block_shapes(s, 1)[:s["float8_layers"]]:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            bf16 += _timed(lambda: a @ b.t(), device, iterations)
            fp8 += _timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                          device, iterations)
    except (RuntimeError, NotImplementedError) as e:
        return None, f"torch._scaled_mm failed on {device.type}: {str(e).splitlines()[0]}"
    return bf16 / fp8, ""


def attention(s: dict, device: torch.device, iterations: int) -> dict:
    """SDPA's FLOP/s forward and backward by length, causal and without mask (FlashAttention's FLOP convention:
    forward 4 x pairs x head_dim x heads, backward 2.5 x that; causal counts half the pairs)."""
    curves = {f"{direction}_{mask}_flops": [] for direction, mask in ATTENTION_CURVES}
    # On CUDA the flash kernel, which SDPA picks for causal bf16 attention in training; the CPU's own otherwise.
    kernel = (lambda: torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION])) \
        if device.type == "cuda" else contextlib.nullcontext
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for seq_len in s["seq_lens"]:
        batch = max(1, s["attention_tokens"] // seq_len)
        shape = (batch, s["heads"], seq_len, HEAD_DIM)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device=device, dtype=dtype)
        for mask in ("causal", "full"):
            causal = mask == "causal"
            pairs = batch * seq_len * seq_len * (0.5 if causal else 1.0)
            flops = 4 * pairs * HEAD_DIM * s["heads"]
            with kernel():
                forward = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), device,
                                 iterations)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                both = _timed(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad), device, iterations)
            del out
            curves[f"forward_{mask}_flops"].append(flops / forward)
            curves[f"backward_{mask}_flops"].append(2.5 * flops / max(both - forward, 1e-9))
    return {"head_dim": HEAD_DIM, "heads": s["heads"], "tokens_per_call": s["attention_tokens"],
            "seq_lens": list(s["seq_lens"]), **curves}


def block_causal_attention_rates(s: dict, device: torch.device, iterations: int, quick: bool) -> list[dict]:
    """Compiled FlexAttention under a document BlockMask (the trainer's GPU path, torchtitan/models/llama3/model.py),
    grouped K/V (kv heads = heads / 4, as in Llama 3 8B): FLOP/s over the visible pairs, forward and backward, and the same as a
    fraction of SDPA's causal flash kernel on one document of that length (the planner's block-causal term)."""
    from torchtitan.nn.attention import block_causal_attention, document_mask

    rows = []
    heads = s["heads"]
    for seq_len, doc_len in QUICK_FLEX_CASES if quick else FLEX_CASES:
        ids = (torch.arange(seq_len, device=device) // doc_len).unsqueeze(0)
        mask = document_mask(ids, flex=device.type == "cuda")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        q = torch.randn(1, heads, seq_len, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, max(1, heads // 4), seq_len, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        grad = torch.randn_like(q)
        pairs = (seq_len // doc_len) * doc_len * (doc_len + 1) / 2
        flops = 4 * pairs * HEAD_DIM * heads

        def run():
            return block_causal_attention(q, k, v, mask, device.type)

        forward = _timed(run, device, iterations)
        both = _timed(lambda: torch.autograd.grad(run(), (q, k, v), grad), device, iterations)
        forward_rate, backward_rate = flops / forward, 2.5 * flops / max(both - forward, 1e-9)
        row = {"seq_len": seq_len, "document_length": doc_len, "forward_flops": forward_rate,
               "backward_flops": backward_rate}
        if device.type == "cuda":
            # The flash kernel's causal speed on one document of that length, expanded heads as causal_attention.
            batch = max(1, s["attention_tokens"] // doc_len)
            shape = (batch, heads, doc_len, HEAD_DIM)
            fq, fk, fv = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            fgrad = torch.randn(shape, device=device, dtype=dtype)
            flash_flops = 4 * batch * doc_len * (doc_len + 1) / 2 * HEAD_DIM * heads
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
                flash_forward = _timed(lambda: F.scaled_dot_product_attention(fq, fk, fv, is_causal=True), device,
                                       iterations)
                flash_both = _timed(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(fq, fk, fv, is_causal=True), (fq, fk, fv), fgrad), device,
                    iterations)
            row["forward_fraction_of_flash"] = forward_rate / (flash_flops / flash_forward)
            row["backward_fraction_of_flash"] = backward_rate / (2.5 * flash_flops / max(flash_both - flash_forward,
                                                                                        1e-9))
        rows.append(row)
    return rows


def allocator_fraction(s: dict, device: torch.device) -> float | None:
    """Peak reserved over peak allocated, less one, over three training steps of a small Llama-shaped model
    (none on the CPU, which has no caching allocator)."""
    if device.type != "cuda":
        return None
    args = TransformerModelArgs(dim=s["dim"], n_layers=s["blocks"], n_heads=s["heads"],
                                n_kv_heads=s["heads"] * s["kv"] // s["dim"], vocab_size=s["vocab"],
                                rope_len=s["tokens"], max_seq_len=s["tokens"])
    with torch.device(device):
        model = Transformer(args)
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, s["vocab"], (1, s["tokens"]), device=device)
    for step in range(3):
        if step == 1:  # the first step allocates the optimizer state: what a run's steady state starts from
            torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats = torch.cuda.memory_stats(device)
    return stats["reserved_bytes.all.peak"] / stats["allocated_bytes.all.peak"] - 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): this machine's first GPU; cpu: only with --quick, a format check")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds): checks the file, measures nothing")
    parser.add_argument("--iterations", type=int, default=10, help="timed calls per measurement")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.device == "cpu" and not args.quick:
            raise UserError("option --device: cpu measures no GPU; it runs only with --quick (tiny shapes: a check "
                            "of the file's format)")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise UserError("option --device: cuda, but this machine has no GPU (CUDA is not available); run on the "
                            "GPU to calibrate, or --device cpu --quick to check the file's format")
        if args.iterations < 1:
            raise UserError(f"option --iterations: {args.iterations} must be a positive integer")
        device = torch.device(args.device)
        shapes = QUICK if args.quick else FULL
        iterations = 1 if args.quick else args.iterations
        record = {"format": CALIBRATION_FORMAT, "device_type": device.type, "device_name": device_name(device),
                  "quick": args.quick, "torch": torch.__version__, "complete": False}
        # Each measurement is written as soon as it is made, so that a run cut short (a GPU lent for minutes)
        # keeps what it measured; plan.py needs the first four (it says which is missing).
        measurements = [
            ("gemm", lambda: dict(zip(("gemm", "gemm_bf16_flops"), gemms(shapes, device, iterations)))),
            ("float8", lambda: dict(zip(("float8_speedup", "float8_note"),
                                        float8_speedup(shapes, device, iterations)))),
            ("attention", lambda: {"attention": attention(shapes, device, iterations)}),
            ("allocator", lambda: {"allocator_fraction": allocator_fraction(shapes, device)}),
            ("gemm grid", lambda: {"gemm_grid": gemm_grid(device, iterations, args.quick)}),
            ("block-causal attention", lambda: {
                "attention_block_causal": block_causal_attention_rates(shapes, device, iterations, args.quick)}),
        ]
        for name, measure in measurements:
            record.update(measure())
            record["seconds"] = time.perf_counter() - start
            record["complete"] = name == measurements[-1][0]
            Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
            print(f"{name}: measured ({record['seconds']:.0f} s)", flush=True)
        gemm_flops, speedup = record["gemm_bf16_flops"], record["float8_speedup"]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reserve = record["allocator_fraction"]
    print(f"{record['device_name']}: bf16 GEMM {gemm_flops / 1e12:.1f} TFLOP/s (8B block), Float8 speed-up "
          f"{'n/a' if speedup is None else f'{speedup:.2f}x'}, attention causal forward "
          f"{record['attention']['forward_causal_flops'][-1] / 1e12:.1f} TFLOP/s at {shapes['seq_lens'][-1]}, "
          f"allocator reserve {'n/a' if reserve is None else f'{reserve:.1%}'}; {record['seconds']:.0f} s; "
          f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
