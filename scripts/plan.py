"""Which layout to run on N GPUs, before renting them: every layout that fits, with a predicted range of tokens/s
per GPU, ranked by the range's conservative end; layouts outside what published runs validated are marked.

From the repository root:

    python scripts/plan.py --flavor 405B --gpus 512 --gpu h100 --seq_len 8192 --global_batch 256
    python scripts/plan.py --flavor 8B --gpus 64 --gpu h200 --json            # the same list as JSON
    python scripts/plan.py --predict --gpus 256 --gpu h100 --job.config_file train_configs/llama3_70b.toml \\
        --parallelism.tensor_parallel_degree 8                                 # one configuration, as the trainer
    python scripts/plan.py --validate                                          # against TorchTitan's published runs
    python scripts/plan.py --validate --fit                                    # refit the three constants
    python scripts/plan.py --validate --measured --gpu h200 --rows 0,6         # one rank of each row on this GPU
    python scripts/plan.py --calibrate outputs/run1 outputs/run2 --gpu h100    # the model against your own runs
    python scripts/plan.py --flavor 70B --gpus 256 --efficiency 0.6            # plan with constants of your own

The model (torchtitan/planner/cost.py, docs/scaling.md): compute from FLOPs over the GPU's peak, communication
from the bytes of each collective over the link it crosses, the pipeline bubble; memory from the analytic model
checked against the dry run, plus what the CUDA caching allocator reserves. Confirm a choice with a dry run:
`NGPU=512 COMM_MODE=fake_backend CONFIG_FILE=... ./run_train.sh <overrides>`.
"""

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.config import parse_args, parse_script_args  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.planner.cost import MODEL_CONSTANTS, Layout  # noqa: E402
from torchtitan.planner.hardware import GPU, GPUS, gpu_named, require_same_gpu  # noqa: E402
from torchtitan.planner.search import RANKINGS, Prediction, exclusions, layout_from_config, plan, predict  # noqa: E402


def describe(layout: Layout) -> str:
    parts = []
    if layout.dp_replicate > 1:
        parts.append(f"HSDP {layout.dp_replicate}x{layout.dp_shard}")
    elif layout.dp_shard > 1:
        parts.append(f"FSDP {layout.dp_shard}")
    parts += [f"TP {layout.tp}"] if layout.tp > 1 else []
    parts += [f"PP {layout.pp} {layout.schedule} ({layout.stages_per_rank} stage(s)/rank, micro-batch "
              f"{layout.microbatch})"] if layout.pp > 1 else []
    parts += [f"CP {layout.cp}"] if layout.cp > 1 else []
    parts.append({"op": "AC op", "full": "AC full", "none": "no AC"}[layout.ac])
    parts += ["float8"] if layout.float8 else []
    parts += ["compile"] if layout.compile else []
    parts += ["async TP"] if layout.async_tp else []
    accumulation = layout.local_batch // layout.microbatch if layout.pp == 1 else 1
    parts.append(f"batch {layout.local_batch}" + (f" in {accumulation} accumulation steps of {layout.microbatch}"
                                                   if accumulation > 1 else ""))
    return ", ".join(parts)


def table(predictions: list[Prediction]) -> str:
    """Each layout's predicted range of tokens/s per GPU (conservative to optimistic: Prediction's), its speed
    without overlap,
    its memory; `*` marks a layout outside the validated envelope, with what lies outside on the line below."""
    lines = [f"{'#':>3} {'tokens/s/GPU range':>19} {'no overlap':>10} {'peak GiB':>9}  layout"]
    for rank, p in enumerate(predictions, 1):
        mark = "*" if p.outside_envelope else " "
        lines.append(f"{rank:>3} {p.tps_conservative:9.0f}-{p.tps_optimistic:<8.0f}{mark}{p.tps_without_overlap:10.0f} "
                     f"{p.peak_memory_gib:9.1f}  {describe(p.layout)}")
        if p.outside_envelope:
            lines.append(f"{'':>45}* outside the validated envelope: {'; '.join(p.outside_envelope)}")
        lines.append(f"{'':>45}{shlex.join(p.overrides)}")
    return "\n".join(lines)


def validation_markdown(refit: bool) -> str:
    from torchtitan.planner import validation

    rows = validation.published_rows()
    constants = validation.fit_constants(rows) if refit else None
    entries = validation.validation_table(rows, constants)
    fitted = [e for e in entries if e["fitted"]]
    held_out = [e for e in entries if not e["fitted"]]
    used = entries[0]["constants"]
    lines = [f"Constants: efficiency {used['efficiency']}, memory-bound bytes {used['memory_bound_bytes']}, "
             f"compiled fraction {used['compiled_fraction']} (fitted on rows {', '.join(map(str, validation.FIT_ROWS))}); "
             f"GPU {validation.GPU.description}.", "",
             "| row | run | fitted | tokens/s/GPU published | predicted | error | peak GiB published | predicted | error |",
             "|---:|---|:---:|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        lines.append(f"| {e['row']} | {e['name']} | {'yes' if e['fitted'] else ''} | {e['tps_published']:,.0f} | "
                     f"{e['tps_predicted']:,.0f} | {100 * e['tps_error']:+.1f}% | {e['memory_published_gib']:.1f} | "
                     f"{e['memory_predicted_gib']:.1f} | {100 * e['memory_error']:+.1f}% |")
    for name, group in (("fitted rows", fitted), ("other rows", held_out)):
        lines.append(f"\nLargest error, {name}: tokens/s {100 * max(abs(e['tps_error']) for e in group):.1f}%, "
                     f"peak memory {100 * max(abs(e['memory_error']) for e in group):.1f}%")
    return "\n".join(lines)


def calibration_report(folders: list[str], gpu: GPU, refit_all: bool, as_json: bool) -> str:
    from torchtitan.planner.calibration import calibrate, read_run

    fitted, entries = calibrate([read_run(folder) for folder in folders], gpu, refit_all)
    if as_json:
        return json.dumps({"gpu": gpu.name, "model_constants": MODEL_CONSTANTS, "fitted_constants": fitted,
                           "runs": entries}, indent=2)
    lines = ["| run | GPUs | tokens/s/GPU measured | model | error | refitted | error | peak GiB measured | "
             "predicted | error |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        run = f"{e['run']} (one rank alone)" if e["alone"] else e["run"]
        lines.append(f"| {run} | {e['gpus']} | {e['tps_measured']:,.0f} | {e['tps_model']:,.0f} | "
                     f"{100 * (e['tps_model'] / e['tps_measured'] - 1):+.1f}% | {e['tps_fitted']:,.0f} | "
                     f"{100 * (e['tps_fitted'] / e['tps_measured'] - 1):+.1f}% | {e['memory_measured_gib']:.1f} | "
                     f"{e['memory_predicted_gib']:.1f} | "
                     f"{100 * (e['memory_predicted_gib'] / e['memory_measured_gib'] - 1):+.1f}% |")
    refitted = [name for name in fitted if fitted[name] != MODEL_CONSTANTS[name]] or ["none changed"]
    options = " ".join(f"--{name} {value:g}" for name, value in fitted.items())
    lines += ["", f"Model constants: {', '.join(f'{n} {v:g}' for n, v in MODEL_CONSTANTS.items())}; refitted to these "
              f"runs on {gpu.name}: {', '.join(f'{n} {v:g}' for n, v in fitted.items())} "
              f"({'all three' if refit_all else 'the efficiency only; --refit_all for all three'}; "
              f"moved: {', '.join(refitted)}).",
              f"Plan with them: python scripts/plan.py ... {options}"]
    return "\n".join(lines)


def measured_markdown(gpu: GPU, rows: str | None, steps: int, as_json: bool) -> str:
    from torchtitan.planner import validation
    from torchtitan.tools.device_info import device_name

    import torch

    if not torch.cuda.is_available():
        raise UserError("option --measured: runs each row's rank on this machine's GPU, and it has none (CUDA is not "
                        "available); without a GPU, --validate --traced gives the dry run's memory")
    require_same_gpu(gpu, device_name(torch.device("cuda")), "the rows' runs on this machine")
    if steps < 1:
        raise UserError(f"option --steps: {steps} must be a positive integer (3 or more give a median past "
                        f"compilation)")
    published = validation.published_rows()
    wanted = [published[index] for index in _row_indices(rows, len(published))]
    entries = validation.measured_table(wanted, gpu, steps)
    if as_json:
        return json.dumps(entries, indent=2)
    lines = [f"One rank of each row alone on {entries[0]['device']} (real tensors, fake collectives), against the "
             f"model's compute + parameter traffic on {gpu.name} (no communication, no bubble).", "",
             "| row | run | ranks | tokens/s/GPU measured | model | error | MFU | reserved GiB measured | model | "
             "error |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {e['row']} | {e['name']} | {', '.join(map(str, e['ranks']))} | {e['tps_measured']:,.0f} | "
              f"{e['tps_predicted']:,.0f} | "
              f"{100 * e['tps_error']:+.1f}% | {e['mfu_pct']:.1f}% | {e['memory_measured_gib']:.1f} | "
              f"{e['memory_predicted_gib']:.1f} | {100 * e['memory_error']:+.1f}% |" for e in entries]
    return "\n".join(lines)


def _row_indices(rows: str | None, count: int) -> list[int]:
    if rows is None:
        return list(range(count))
    try:
        indices = [int(part) for part in rows.split(",")]
    except ValueError:
        indices = [-1]
    if not all(0 <= index < count for index in indices):
        raise UserError(f"option --rows: {rows!r} is not a comma-separated list of row numbers 0 to {count - 1}")
    return indices


def traced_markdown() -> str:
    from torchtitan.planner import validation

    entries = validation.traced_table()
    lines = ["| row | run | dry run tensor peak GiB | + allocator | published GiB | error |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {e['row']} | {e['name']} | {e['tensor_peak_gib']:.1f} | {e['memory_predicted_gib']:.1f} | "
              f"{e['memory_published_gib']:.1f} | {100 * e['memory_error']:+.1f}% |" for e in entries]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--global_batch", type=int, default=None, help="sequences per step (default: 2 per GPU)")
    parser.add_argument("--top", type=int, default=10, help="layouts to list")
    for technique in ("float8", "compile", "async_tp"):
        parser.add_argument(f"--{technique}", choices=("on", "off"), default=None,
                            help=f"only layouts with {technique} on (or off); default: either")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--rank_by", choices=tuple(RANKINGS), default="conservative",
                        help="rank by the conservative end of each layout's range (no more communication hidden "
                             "behind compute than in the validated rows), by the prediction (the optimistic end), or "
                             "by what a layout keeps if no communication overlaps compute")
    parser.add_argument("--predict", action="store_true",
                        help="predict the one configuration given by trainer options (--job.config_file ...)")
    parser.add_argument("--validate", action="store_true", help="the model against the published H100 runs")
    parser.add_argument("--fit", action="store_true", help="with --validate: refit the three constants")
    parser.add_argument("--traced", action="store_true",
                        help="with --validate: the dry run's peak memory of each row instead (about 20 minutes)")
    parser.add_argument("--measured", action="store_true",
                        help="with --validate, on a GPU machine: each row's rank alone on this GPU (real tensors, "
                             "fake collectives), its time without communication and its reserved memory against the "
                             "model's (name the GPU with --gpu)")
    parser.add_argument("--rows", default=None, help="with --measured: the rows to run, e.g. 0,1,2 (default all)")
    parser.add_argument("--steps", type=int, default=5, help="with --measured: steps per row (the first two are "
                                                               "left out of the median)")
    parser.add_argument("--calibrate", nargs="+", metavar="RUN_FOLDER", default=None,
                        help="the model against your own GPU runs (trainer dump folders, or those of a dry run on real "
                             "tensors: one rank of the target layout on one GPU), its efficiency refitted")
    parser.add_argument("--refit_all", action="store_true",
                        help="with --calibrate: refit all three constants (three runs or more)")
    for name, value in MODEL_CONSTANTS.items():
        parser.add_argument(f"--{name}", type=float, default=value,
                            help=f"a constant of the performance model (default {value:g}, fitted on TorchTitan's "
                                 f"runs; --calibrate fits it to yours)")
    args, trainer_argv = parse_script_args(parser, sys.argv[1:] if argv is None else argv)
    try:
        gpu = gpu_named(args.gpu, "--gpu")
        if args.validate and args.measured:
            print(measured_markdown(gpu, args.rows, args.steps, args.json))
            return 0
        if args.validate:
            print(traced_markdown() if args.traced else validation_markdown(args.fit))
            return 0
        if args.calibrate:
            print(calibration_report(args.calibrate, gpu, args.refit_all, args.json))
            return 0
        constants = {name: getattr(args, name) for name in MODEL_CONSTANTS}
        if not 0 < constants["efficiency"] <= 1 or constants["memory_bound_bytes"] < 0 or \
                constants["compiled_fraction"] < 0:
            raise UserError(f"options --efficiency (0 to 1), --memory_bound_bytes and --compiled_fraction (0 or "
                            f"more): got {constants['efficiency']:g}, {constants['memory_bound_bytes']:g}, "
                            f"{constants['compiled_fraction']:g}")
        if args.predict:
            config = parse_args(trainer_argv)
            layout = layout_from_config(config, args.gpus)
            results = [predict(config.model.flavor, layout, config.training.seq_len, gpu, config=config,
                               **constants)]
        else:
            if trainer_argv:
                raise UserError(f"unknown arguments {' '.join(trainer_argv)} (trainer options need --predict)")
            for name in ("gpus", "seq_len", "top"):
                if getattr(args, name) < 1:
                    raise UserError(f"option --{name}: {getattr(args, name)} must be a positive integer")
            global_batch = args.global_batch or 2 * args.gpus
            if global_batch < 1:
                raise UserError(f"option --global_batch: {global_batch} must be a positive integer")
            fixed = {name: getattr(args, name) == "on" for name in ("float8", "compile", "async_tp")
                     if getattr(args, name) is not None}
            results = plan(args.flavor, args.gpus, gpu, args.seq_len, global_batch, fixed, constants,
                           rank_by=args.rank_by)[:args.top]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.as_json() for p in results], indent=2))
    else:
        print("\n".join([*(f"note: {reason}" for reason in exclusions(gpu)), table(results)]))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
