"""What one torch release does with this project, as figures another release's run can be held against.

    python benchmarks/torch_versions.py --output torch_2.14.1.json            # in each venv
    python benchmarks/torch_versions.py --compare torch_2.13.0.json torch_2.14.1.json

For the running torch it records, on this CPU:
- numerics: the debug model's fp32 losses over 6 steps of the same seed and data, one process and FSDP 2 x TP 1
  (gloo, 2 processes), and the CPU ring attention's CP 2 losses (a kernel or collective whose numerics change moves
  them);
- the dry run of Llama 3.1 8B on 8 GPUs (FSDP 8, per-op AC): the traced peak memory by category and every
  collective's count and bytes (fake tensors: torch's own trackers and FSDP2's buffers);
- compile: graphs and graph breaks when one tiny transformer block is compiled with fullgraph=False, forward and
  backward, and the compiled loss's equality with eager;
- start-up: seconds to import torch and the trainer.
`--compare` prints the differences between two such files as a Markdown table (docs/torch_versions.md).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--training.mixed_precision_param", "float32", "--debug.seed", "0", "--training.steps", "6",
        "--metrics.log_freq", "1", "--validation.no_enable", "--metrics.peak_flops", "1e12",
        "--activation_checkpoint.mode", "none"]


def _train(nproc: int, args: list[str], folder: Path) -> list[float]:
    trainer = ["-m", "torchtitan.train", *TINY, *args, "--job.dump_folder", str(folder)]
    cmd = [sys.executable, *trainer] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0", *trainer]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        return [f"failed: {result.stdout[-400:]}{result.stderr[-400:]}"]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def _dry_run(folder: Path) -> dict:
    cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", "train_configs/llama3_8b.toml",
           "--comm.mode", "fake_backend", "--comm.fake_world_size", "8", "--training.steps", "2",
           "--job.dump_folder", str(folder)]
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=1200)
    if result.returncode != 0:
        return {"failed": result.stdout[-600:] + result.stderr[-600:]}
    report = json.loads((folder / "dry_run.json").read_text())
    return {"peak_memory_gib": report["peak_memory_gib"], "memory_gib": report["memory_gib_by_category"],
            "collectives": report.get("collectives")}


def _compile_counts() -> dict:
    import torch
    from torch._dynamo.utils import counters

    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.models.llama3.model import Transformer

    torch.manual_seed(0)
    model = Transformer(model_args_for("tiny", 32))
    model.init_weights(seed=0)
    tokens = torch.randint(0, model_args_for("tiny", 32).vocab_size, (2, 33))
    eager = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    counters.clear()
    for block in model.layers.values():
        block.compile(fullgraph=False)
    start = time.perf_counter()
    compiled = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    compiled.backward()
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "compile_s": round(time.perf_counter() - start, 1),
            "loss_difference": abs(compiled.item() - eager.item())}


def _import_seconds(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   check=True)
    return round(time.perf_counter() - start, 2)


def report() -> dict:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        return {
            "torch": torch.__version__,
            "import_torch_s": _import_seconds("import torch"),
            "import_trainer_s": _import_seconds("import torchtitan.train"),
            "losses_one_process": _train(1, [], tmp / "one"),
            "losses_fsdp2": _train(2, ["--parallelism.data_parallel_shard_degree", "2"], tmp / "fsdp"),
            "losses_cp2_ring": _train(2, ["--parallelism.context_parallel_degree", "2",
                                          "--parallelism.context_parallel_method", "ring"], tmp / "cp"),
            "compile": _compile_counts(),
            "dry_run_8b_on_8": _dry_run(tmp / "dry"),
        }


def compare(first: dict, second: dict) -> str:
    def losses(key: str) -> str:
        a, b = first[key], second[key]
        if any(isinstance(x, str) for x in a + b):
            return f"{a[:1]} / {b[:1]}"
        diff = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        return "bitwise equal" if a == b else f"max relative difference {diff:.1e}"

    rows = [("losses, one process (6 steps, fp32)", losses("losses_one_process")),
            ("losses, FSDP 2", losses("losses_fsdp2")),
            ("losses, CP 2 (CPU ring attention)", losses("losses_cp2_ring"))]
    for key in ("graphs", "graph_breaks", "compile_s", "loss_difference"):
        rows.append((f"compile of a block: {key}", f"{first['compile'][key]} / {second['compile'][key]}"))
    dry_a, dry_b = first["dry_run_8b_on_8"], second["dry_run_8b_on_8"]
    if "failed" in dry_a or "failed" in dry_b:
        rows.append(("dry run 8B on 8", f"{dry_a.get('failed', 'ok')[:80]} / {dry_b.get('failed', 'ok')[:80]}"))
    else:
        rows.append(("dry run 8B on 8: peak GiB", f"{dry_a['peak_memory_gib']:.3f} / {dry_b['peak_memory_gib']:.3f}"))
        for category in sorted(set(dry_a["memory_gib"]) | set(dry_b["memory_gib"])):
            a, b = dry_a["memory_gib"].get(category, 0.0), dry_b["memory_gib"].get(category, 0.0)
            if abs(a - b) > 1e-3:
                rows.append((f"dry run: {category} GiB", f"{a:.3f} / {b:.3f}"))
        index_a = {(c["kind"], c["mesh_dim"]): c for c in dry_a["collectives"]}
        index_b = {(c["kind"], c["mesh_dim"]): c for c in dry_b["collectives"]}
        for key in sorted(set(index_a) | set(index_b)):
            a, b = index_a.get(key, {"count": 0, "bytes": 0}), index_b.get(key, {"count": 0, "bytes": 0})
            same = a["count"] == b["count"] and a["bytes"] == b["bytes"]
            rows.append((f"dry run: {key[0]} over {key[1]}",
                         "the same" if same else f"{a['count']} x, {a['bytes'] / 2**30:.3f} GiB / "
                                                 f"{b['count']} x, {b['bytes'] / 2**30:.3f} GiB"))
    for key in ("import_torch_s", "import_trainer_s"):
        rows.append((key, f"{first[key]} / {second[key]}"))
    header = f"| figure | torch {first['torch']} / torch {second['torch']} |\n|---|---|\n"
    return header + "\n".join(f"| {name} | {value} |" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="write this torch's figures here (JSON)")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("FIRST", "SECOND"),
                        help="print the differences between two reports as a Markdown table")
    args = parser.parse_args(argv)
    if args.compare:
        first, second = (json.loads(path.read_text()) for path in args.compare)
        print(compare(first, second))
        return 0
    figures = report()
    text = json.dumps(figures, indent=1)
    if args.output:
        args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
