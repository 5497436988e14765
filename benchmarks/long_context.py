"""Long context at 131,072 tokens: context parallelism's bytes per rank and the long-context recipes' memory, from
dry runs (one process plays one rank on fake tensors: no GPU, no data), beside the planner's figures.

From the repository root:

    python benchmarks/long_context.py bytes     # CP bytes per rank and step: K/V gathered against the ring, 8B/70B/405B
    python benchmarks/long_context.py recipes   # the 8B (8 GPUs) and 405B (TP 8 x CP 16 x PP 16) recipes, full size
    python benchmarks/long_context.py paper     # the planner on the Llama 3 paper's 405B layout, both CP methods
    python benchmarks/long_context.py methods   # the planner: which CP method is faster, over the layouts it searches

`bytes` dry-runs each flavor's shape with two blocks (context parallelism's collectives are per block; the
planner's count, which must equal the dry run's there, scales them to the whole depth) on a layout whose FSDP group
differs from its CP group (data_parallel_shard_degree 2: with one FSDP rank per CP group torch hands both the same
process group and the dry run cannot tell their collectives apart), once per parallelism.context_parallel_method.
Bytes are those of the buffers the collectives work on, as the dry run counts them (an all-gather's output, a
reduce-scatter's input, an all-to-all's buffer).

`recipes` dry-runs RECIPES at full size (minutes and a few GB of host memory each; both ends of the 405B pipeline)
and prints each rank's peak memory by category, its collectives over the CP group, and the analytic estimate and
prediction of the planner for the same configuration (H100 SXM).

`methods` is the planner alone: for every causal CP layout the search considers (scripts/plan.py, H100 SXM hosts of
8) on a few clusters, the predicted step with each method, and how many layouts each wins, by how much.

`paper` is the planner alone: the Llama 3 paper's (Dubey et al. 2024, arXiv:2407.21783, Table 4) 405B layout at
131,072 tokens, 16,384 H100s, TP 8 x CP 16 x PP 16 x DP 8, 16 sequences per data-parallel rank, bf16, reported at
380 TFLOP/s per GPU, predicted with each CP method, and its rank among the layouts the search considers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# `python benchmarks/long_context.py` puts benchmarks/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan.config import parse_args  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import model_args_for  # noqa: E402
from torchtitan.models.llama3.model import Transformer, count_parameters, flops_per_token  # noqa: E402
from torchtitan.planner.cost import Layout, sequence_collectives, step_time  # noqa: E402
from torchtitan.planner.hardware import GPUS  # noqa: E402
from torchtitan.planner.memory import estimate  # noqa: E402
from torchtitan.planner.search import candidate_layouts, layout_from_config, plan, predict  # noqa: E402

GIB = 2**30
SEQ_LEN = 131072
CONFIGS = Path(__file__).resolve().parent.parent / "train_configs"
METHODS = ("allgather_kv", "ring")

# The long-context recipes: a shipped TOML and the overrides that make it run 131,072-token sequences, on how many
# GPUs. 8B: one sequence per step on one host, CP 8 with FSDP over the same 8 ranks, full AC. 405B: the Llama 3
# paper's degrees (TP 8, CP 16, PP 16) and data-parallel degree (8: 16,384 GPUs), 16 sequences per data-parallel rank
# (16 pipeline micro-batches of one sequence), the preset's Float8 and compile.
RECIPES = {
    "8B": ("llama3_8b.toml", 8, ["--training.seq_len", str(SEQ_LEN), "--parallelism.context_parallel_degree", "8",
                                 "--activation_checkpoint.mode", "full"]),
    "405B": ("llama3_405b.toml", 16384, ["--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "16",
                                         "--parallelism.context_parallel_degree", "16",
                                         "--parallelism.pipeline_parallel_degree", "16"]),
}

# The shapes whose CP bytes `bytes` compares: (TP, CP) at 131,072 tokens, full AC.
BYTES_LAYOUTS = {"8B": (1, 8), "70B": (8, 8), "405B": (8, 16)}
BYTES_BLOCKS = 2


def dry_run(argv: list[str], world_size: int) -> dict:
    """The dry run's report of rank 0 (and of the other end of its pipeline), in a new process."""
    with tempfile.TemporaryDirectory(prefix="long-context-") as dump_folder:
        proc = subprocess.run([sys.executable, "-m", "torchtitan.train", *argv, "--comm.mode", "fake_backend",
                               "--comm.fake_world_size", str(world_size), "--job.dump_folder", dump_folder,
                               "--job.no_print_config"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        report = Path(dump_folder) / "dry_run.json"
        if not report.exists():
            raise RuntimeError(f"the dry run of {argv} failed:\n{proc.stdout[-4000:]}")
        return json.loads(report.read_text())


def cp_collectives(report: dict) -> dict[tuple[str, str], tuple[int, int]]:
    return {(c["kind"], c["mesh_dim"]): (c["count"], c["bytes"]) for c in report["collectives"] if c["mesh_dim"] == "cp"}


def bytes_table() -> str:
    lines = ["| model | TP x CP | method | CP collectives per rank and step (dry run, 2 blocks) | per block | whole "
             "model, per rank and step (planner) | one attention call's K/V all-gather | ring / gathered |",
             "|---|---|---|---|---|---|---|---|"]
    for flavor, (tp, cp) in BYTES_LAYOUTS.items():
        args = model_args_for(flavor, SEQ_LEN)
        per_block, per_call = {}, {}
        for method in METHODS:
            argv = ["--job.config_file", str(CONFIGS / "llama3_8b.toml"), "--model.flavor", flavor,
                    "--model.n_layers", str(BYTES_BLOCKS), "--training.seq_len", str(SEQ_LEN),
                    "--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2",
                    "--parallelism.tensor_parallel_degree", str(tp), "--parallelism.context_parallel_degree", str(cp),
                    "--parallelism.context_parallel_method", method, "--activation_checkpoint.mode", "full"]
            found = cp_collectives(dry_run(argv, 2 * tp * cp))
            layout = Layout(dp_replicate=1, dp_shard=2, tp=tp, pp=1, cp=cp, schedule=None, stages_per_rank=1,
                            local_batch=1, microbatch=1, ac="full", float8=False, compile=False, async_tp=False,
                            cp_method=method)
            shallow = dataclasses.replace(args, n_layers=BYTES_BLOCKS)
            predicted = {key: (calls, round(size)) for key, (calls, size) in
                         sequence_collectives(shallow, layout, SEQ_LEN).items() if key[1] == "cp"}
            if predicted != found:
                raise AssertionError(f"{flavor} {method}: the planner counts {predicted}, the dry run {found}")
            # Once per step, not per block: the positions' gather (gathered K/V).
            once = SEQ_LEN * 8 if method == "allgather_kv" else 0
            per_block[method] = (sum(size for _, size in found.values()) - once) / BYTES_BLOCKS
            whole = sum(size for (_, dim), (_, size) in sequence_collectives(args, layout, SEQ_LEN).items()
                        if dim == "cp")
            kv_heads = args.kv_heads if method == "allgather_kv" else args.n_heads
            per_call[method] = SEQ_LEN * 2 * kv_heads / tp * args.head_dim * 2
            described = ", ".join(f"{kind} {calls} calls {size / GIB:.3f} GiB"
                                  for (kind, _), (calls, size) in sorted(found.items()))
            lines.append(f"| {flavor} | {tp} x {cp} | {method} | {described} | {per_block[method] / GIB:.3f} GiB | "
                         f"{whole / GIB:,.1f} GiB | {per_call[method] / GIB:.3f} GiB | "
                         + (f"{per_block['ring'] / per_block['allgather_kv']:.2f} per block, "
                            f"{per_call['ring'] / per_call['allgather_kv']:.0f} per call "
                            f"(n_heads / n_kv_heads = {args.n_heads // args.kv_heads})" if method == "ring" else "")
                         + " |")
    return "\n".join(lines)


def recipe_argv(flavor: str, method: str) -> tuple[list[str], int]:
    toml, gpus, overrides = RECIPES[flavor]
    return (["--job.config_file", str(CONFIGS / toml), *overrides, "--parallelism.context_parallel_method", method],
            gpus)


def recipes_table(methods: list[str]) -> str:
    gpu = GPUS["h100"]
    lines = []
    for flavor in RECIPES:
        for method in methods:
            argv, gpus = recipe_argv(flavor, method)
            report = dry_run(argv, gpus)
            config = parse_args(argv)
            layout = layout_from_config(config, gpus)
            predicted = predict(config.model.flavor, layout, SEQ_LEN, gpu, config=config)
            analytic = estimate(dataclasses.replace(config, compile=dataclasses.replace(config.compile, enable=False)),
                                gpus).total / GIB
            lines.append(f"{flavor} on {gpus} GPUs, {method}: {' '.join(argv[2:])}")
            ends = [report] + ([report["other_end_of_pipeline"]] if "other_end_of_pipeline" in report else [])
            for end in ends:
                categories = ", ".join(f"{name} {gib:.2f}" for name, gib in end["memory_gib_by_category"].items()
                                       if gib >= 0.005)
                lines.append(f"  rank {end['rank']} (pipeline rank {end['pipeline_rank']}): peak "
                             f"{end['peak_memory_gib']:.2f} GiB of tensors ({categories})")
            if "compiled_estimate_gib" in report:
                lines.append(f"  compiled (the analytic model): {report['compiled_estimate_gib']:.2f} GiB")
            lines.append(f"  the planner's analytic peak (eager, worst pipeline rank): {analytic:.2f} GiB")
            for (kind, _), (calls, size) in sorted(cp_collectives(report).items()):
                lines.append(f"  {kind} over cp: {calls} calls, {size / GIB:,.2f} GiB per step")
            tflops = predicted.tps_optimistic * report["flops_per_token"] / 1e12
            lines.append(f"  predicted on H100 SXM: {predicted.tps_conservative:,.0f}-{predicted.tps_optimistic:,.0f} "
                         f"tokens/s per GPU ({tflops:.0f} TFLOP/s at the optimistic end), reserved peak "
                         f"{predicted.peak_memory_gib:.1f} GiB")
    return "\n".join(lines)


def model_flops_per_token(flavor: str) -> float:
    """Training FLOPs per token at SEQ_LEN, as the trainer counts them (model.flops_per_token)."""
    args = model_args_for(flavor, SEQ_LEN)
    with torch.device("meta"):
        model = Transformer(args)
    return flops_per_token(args, count_parameters(model, exclude_embeddings=True), SEQ_LEN)


# The Llama 3 paper's 405B long-context layout (Table 4): 16,384 H100s, bf16, 16 sequences per data-parallel rank.
PAPER = Layout(dp_replicate=1, dp_shard=8, tp=8, pp=16, cp=16, schedule="Interleaved1F1B", stages_per_rank=2,
               local_batch=16, microbatch=1, ac="full", float8=False, compile=True, async_tp=False)
PAPER_TFLOPS = 380


def paper_table() -> str:
    gpu = GPUS["h100"]
    per_token = model_flops_per_token("405B")
    lines = [f"The Llama 3 paper's 405B at 131,072 tokens: {PAPER_TFLOPS} TFLOP/s per GPU published, "
             f"{PAPER_TFLOPS * 1e12 / per_token:.1f} tokens/s per GPU at this framework's {per_token / 1e9:,.0f} GFLOPs "
             f"per token (attention counted unmasked; half that share if the paper counted the causal half)"]
    for method in METHODS:
        layout = dataclasses.replace(PAPER, cp_method=method)
        predicted = predict("405B", layout, SEQ_LEN, gpu)
        ranked = plan("405B", layout.world_size, gpu, SEQ_LEN, layout.local_batch * layout.dp,
                      fixed={"float8": False}, rank_by="predicted", cp_methods=(method,))
        degrees = ("dp_shard", "tp", "cp", "pp")
        same = [i for i, p in enumerate(ranked, 1)
                if all(getattr(p.layout, name) == getattr(layout, name) for name in degrees)]
        lines.append(f"  {method}: predicted {predicted.tps_per_gpu:.1f} tokens/s per GPU "
                     f"({predicted.tps_per_gpu * per_token / 1e12:.0f} TFLOP/s; range {predicted.tps_conservative:.1f}-"
                     f"{predicted.tps_optimistic:.1f}), step {predicted.step_seconds:.1f} s, reserved peak "
                     f"{predicted.peak_memory_gib:.1f} GiB; ranked {same[0] if same else 'not among'} of "
                     f"{len(ranked)} fitting layouts by prediction, the first with its degrees (best: {ranked[0].tps_per_gpu:.1f} tokens/s per "
                     f"GPU, TP {ranked[0].layout.tp} x CP {ranked[0].layout.cp} x PP {ranked[0].layout.pp})")
    return "\n".join(lines)


# (flavor, GPUs, global batch in sequences) at 32,768 and 131,072 tokens.
METHOD_CLUSTERS = (("8B", 8, 1), ("8B", 64, 8), ("70B", 256, 32), ("405B", 2048, 256))


def methods_table() -> str:
    gpu = GPUS["h100"]
    lines = ["| model on GPUs | seq_len | causal CP layouts | ring faster | ring step / gathered step: least, median, "
             "most |", "|---|---|---|---|---|"]
    for flavor, gpus, global_batch in METHOD_CLUSTERS:
        for seq_len in (32768, SEQ_LEN):
            args = model_args_for(flavor, seq_len)
            ratios = sorted(step_time(args, dataclasses.replace(layout, cp_method="ring"), seq_len, gpu).seconds
                            / step_time(args, layout, seq_len, gpu).seconds
                            for layout in candidate_layouts(flavor, gpus, seq_len, global_batch, gpu,
                                                            cp_methods=("allgather_kv",)) if layout.cp > 1)
            lines.append(f"| {flavor} on {gpus} | {seq_len:,} | {len(ratios)} | {sum(r < 1 for r in ratios)} | "
                         f"{ratios[0]:.2f}, {ratios[len(ratios) // 2]:.2f}, {ratios[-1]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("bytes", "recipes", "paper", "methods"))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["allgather_kv"],
                        help="with recipes: the parallelism.context_parallel_method(s) to dry-run")
    args = parser.parse_args(argv)
    try:
        print({"bytes": bytes_table, "paper": paper_table, "methods": methods_table}[args.what]()
              if args.what != "recipes"
              else recipes_table(args.methods))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
