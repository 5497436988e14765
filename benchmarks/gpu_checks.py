"""Check on one GPU the paths that only run there: block-causal attention through FlexAttention (one process, and a
context-parallel rank's queries against the gathered keys), causal attention under context parallelism over
gathered keys (a rank's head-tail chunks, the mask by positions), the compiled BlockMask build (time, memory, and that a
new batch does not recompile it). Prints a table and writes the figures to a JSON file.

    python benchmarks/gpu_checks.py --output gpu_checks.json

Each check compares the GPU result with a float64 reference (SDPA with the same boolean mask): ||out - ref|| / ||ref||
for the output and for the gradients of q, k and v. The bounds are those of the inputs' precision: bf16 inputs
round at u = 2^-8 (relative 3.9e-3 per element, ~1e-2 for a product's norm at most), fp32 inputs go through Triton's
float32 dot, which may use TF32 (u = 2^-11: 4.9e-4, 2e-3 allowed). Context parallelism is simulated in one process:
rank r's queries are the chunks `balanced_chunk_order` gives it, its keys and values those of every rank in rank
order (what the all-gather returns), and the gradients of k and v are summed over the ranks (what the all-gather's
backward, a reduce-scatter, does). Collectives themselves need two GPUs and are not exercised here.

`--device cpu` runs the forward checks on the CPU (FlexAttention has no CPU backward in torch 2.13): a check of
this script, not of any GPU.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from torchtitan.distributed.context_parallel import (  # noqa: E402
    CAUSAL_CHUNKS_PER_RANK, CHUNKS_PER_RANK, balanced_chunk_order, chunk_work, head_tail_order, visible_keys)
from torchtitan.models.llama3 import model as llama3_model  # noqa: E402
from torchtitan.models.llama3.model import (  # noqa: E402
    block_causal_attention, build_block_mask, document_mask, document_positions)
from torchtitan.tools.device_info import device_name  # noqa: E402

BOUND = {torch.bfloat16: 1e-2, torch.float32: 2e-3}


def packed_document_ids(batch: int, seq: int, lengths: list[int], generator: torch.Generator) -> torch.Tensor:
    """Documents of the given lengths (cycled, in shuffled order) packed into windows; the first and the last
    document of a window are cut by it, as the data pipeline cuts them."""
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        order = torch.randperm(len(lengths), generator=generator).tolist()
        offset = int(torch.randint(0, lengths[order[0]], (1,), generator=generator))
        while len(ids) < seq + offset:
            ids += [doc] * lengths[order[doc % len(order)]]
            doc += 1
        rows.append(ids[offset:offset + seq])
    return torch.tensor(rows)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """float64 SDPA of (batch, heads, queries, head_dim) with grouped K/V under a (batch, 1, queries, keys) mask."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def attention_and_grads(fn, q, k, v, grad_out, backward: bool) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out = fn(q, k, v)
    if not backward:
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]


def check_block_causal(device: torch.device, dtype: torch.dtype, backward: bool, seq: int, cp: int,
                       generator: torch.Generator, documents: bool = True) -> dict:
    """Block-causal attention (cp == 1) or a simulated CP group's ranks against the float64 reference; without
    `documents`, causal attention under CP over gathered keys (context_parallel_method = allgather_kv: head-tail
    chunks, the mask by global positions)."""
    batch, heads, kv_heads, head_dim = 2, 8, 2, 64
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if documents:
        ids = packed_document_ids(batch, seq, [seq // 16, seq // 5, seq // 3, 7, seq + seq // 2],
                                  generator).to(device)
        positions = document_positions(ids)
        allowed = ((ids[:, :, None] == ids[:, None, :]) & causal).unsqueeze(1)
    else:
        ids, positions = None, torch.arange(seq, device=device).expand(batch, seq)
        allowed = causal.expand(batch, 1, seq, seq)
    q = torch.randn(batch, heads, seq, head_dim, generator=generator).to(device, dtype)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=generator).to(device, dtype) for _ in range(2))
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=generator).to(device, dtype)
    expected = attention_and_grads(lambda q, k, v: reference(q, k, v, allowed), q, k, v, grad_out.double(), backward)
    if cp == 1:
        got = attention_and_grads(
            lambda q, k, v: block_causal_attention(q, k, v, document_mask(ids, flex=True), device.type),
            q, k, v, grad_out, backward)
    else:
        chunks_per_rank = CHUNKS_PER_RANK if documents else CAUSAL_CHUNKS_PER_RANK
        order = balanced_chunk_order(chunk_work(ids, chunks_per_rank * cp), cp) if documents else \
            head_tail_order(cp, chunks_per_rank)
        chunk = seq // (chunks_per_rank * cp)
        index = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in order]).to(device)
        per_rank = index.reshape(cp, -1)

        def ids_at(where: torch.Tensor) -> torch.Tensor | None:
            return None if ids is None else ids[:, where]

        def cp_ranks(q, k, v):
            # gathered keys: every rank's chunks, rank after rank; each rank's output lands at its queries' places
            out = torch.empty_like(q)
            for mine in per_rank:
                mask = visible_keys(ids_at(mine), positions[:, mine], ids_at(index), positions[:, index], flex=True)
                out[:, :, mine] = block_causal_attention(q[:, :, mine], k[:, :, index], v[:, :, index], mask,
                                                         device.type)
            return out

        got = attention_and_grads(cp_ranks, q, k, v, grad_out, backward)
    names = ["out", "grad_q", "grad_k", "grad_v"]
    errors = {name: relative_error(g, e) for name, g, e in zip(names, got, expected)}
    return {"check": f"{'block_causal' if documents else 'causal'} cp={cp}", "dtype": str(dtype).removeprefix("torch."), "seq": seq,
            "errors": errors, "bound": BOUND[dtype], "ok": max(errors.values()) <= BOUND[dtype]}


def check_mask_build(device: torch.device, seqs: list[int], generator: torch.Generator) -> list[dict]:
    """The BlockMask build as the trainer runs it (compiled on GPUs) against eager create_block_mask: seconds per
    batch after the first, peak memory above the inputs, and the graphs compiled for three batches of new documents
    (one expected: the ids are the graph's inputs)."""
    from torch._dynamo.utils import counters

    rows = []
    for seq in seqs:
        batches = [packed_document_ids(1, seq, [seq // 8, seq // 3, 900], generator).to(device) for _ in range(4)]
        row = {"check": "mask build", "seq": seq}
        for mode in ("compiled", "eager"):
            if mode == "eager" and seq > 32768:
                continue  # eager materialises seq^2 booleans: 4 GB at 64k per sequence, more than it is worth
            graphs_before = counters["stats"]["unique_graphs"]
            times = []
            for ids in batches:
                def same_document_causal(b, h, q, kv, ids=ids):
                    return (ids[b, q] == ids[b, kv]) & (q >= kv)

                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                start = time.perf_counter()
                if mode == "compiled":
                    mask = build_block_mask(same_document_causal, 1, seq, seq, device)
                else:
                    mask = create_block_mask(same_document_causal, 1, None, seq, seq, device=device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                del mask
            row[f"{mode}_seconds"] = sorted(times[1:])[len(times[1:]) // 2]
            if mode == "compiled":
                row["first_build_seconds"] = times[0]
                row["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs_before
            if device.type == "cuda":
                row[f"{mode}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu: forward checks only, small sizes (a check of this script)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: option --device: cuda, but this machine has no GPU; use --device cpu to check the script",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if not on_gpu:
        # Inductor's CPU FlexAttention template fails to build for these shapes (torch 2.13); eager runs forward.
        llama3_model._compiled_flex_attention = flex_attention
    generator = torch.Generator().manual_seed(0)
    results = []
    for dtype in (torch.float32, torch.bfloat16) if on_gpu else (torch.float32,):
        for cp in (1, 2, 4):
            results.append(check_block_causal(device, dtype, on_gpu, 2048 if on_gpu else 512, cp, generator))
        for cp in (2, 4):
            results.append(check_block_causal(device, dtype, on_gpu, 2048 if on_gpu else 512, cp, generator,
                                              documents=False))
    results += check_mask_build(device, [8192, 32768, 131072] if on_gpu else [1024], generator)
    record = {"device": device_name(device), "torch": torch.__version__, "results": results}
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['device']}, torch {record['torch']}")
    for r in results:
        if "errors" in r:
            errors = " ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
            print(f"{r['check']:<18} {r['dtype']:<9} seq {r['seq']:>6}: {errors} (bound {r['bound']:.0e}) "
                  f"{'ok' if r['ok'] else 'FAILED'}")
        else:
            print(f"{r['check']:<18} seq {r['seq']:>6}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in r.items() if k not in ("check", "seq")))
    return 0 if all(r.get("ok", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
