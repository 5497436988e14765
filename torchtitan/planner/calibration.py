"""The performance model against your own GPU runs, and its three constants refitted to them
(`scripts/plan.py --calibrate RUN_FOLDER ... --gpu h100`).

The constants were fitted on TorchTitan's published runs, on H100s capped at 500 W; another cluster (other clocks,
power limits, network, software) runs at its own level. A run is a trainer dump folder of a GPU run: its resolved
`config.toml`, its `run.json` (world size and device, written at start) and its `metrics.jsonl` (tokens/s per
device and the peak reserved memory of each logging window). The first logged window holds compilation and
warm-up and is left out: a run needs at least two logged windows (training.steps and metrics.log_freq).

A run can also be one rank of the target layout alone on one GPU, before the cluster: the dump folder of a dry run
on real tensors (`--comm.no_fake_tensors`: its `config.toml` and `dry_run.json`), compared with what the model
predicts for a rank alone (no communication, no bubble).

By default only the efficiency is refitted: the level of your GPUs and software, the other two constants kept.
With `refit_all` (three runs or more, varied in what the constants tell apart: eager and compiled, Float8, AC
modes) all three are: on the one-H100 runs of docs/scaling.md that gave efficiency 1.0, the end of its range, where
the efficiency alone gave 0.79 and errors within 9.3% (from -21%), before attention had its own speed (then 0.88,
within 8.0%; with GEMMs timed by shape 0.90, within 7.7%): the model's structure, not only its level, differs
there. scripts/calibrate_gpu.py measures the
GEMM, attention, Float8 and allocator figures on one GPU instead (`plan.py --calibrate FILE.json`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.metrics import RUN_INFO_FILE
from torchtitan.config import JobConfig, parse_args
from torchtitan.config.model_shape import shape_overrides
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.planner.cost import MODEL_CONSTANTS, Layout
from torchtitan.planner.hardware import GPU, require_same_gpu
from torchtitan.planner.search import layout_from_config, predict
from torchtitan.planner.validation import fit
from torchtitan.tools.dry_run_report import REPORT_FILE as DRY_RUN_REPORT, read_report


@dataclass(frozen=True)
class MeasuredRun:
    folder: Path
    config: JobConfig
    world_size: int
    device_name: str
    layout: Layout
    tps_per_gpu: float
    """Median over the logged windows after the first."""
    peak_memory_gib: float
    """Largest reserved peak over the logged windows."""
    alone: bool = False
    """One rank alone (a dry run on real tensors): compared with the model's figure without communication."""


def read_run(folder: str | Path) -> MeasuredRun:
    folder = Path(folder)
    if (folder / DRY_RUN_REPORT).is_file():
        return _read_dry_run(folder)
    files = {name: folder / name for name in ("config.toml", RUN_INFO_FILE, "metrics.jsonl")}
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing:
        raise UserError(f"option --calibrate: {folder} is not a finished trainer run: it has no "
                        f"{', '.join(missing)} (run.json is written by this version's trainer at start)")
    try:
        info = json.loads(files[RUN_INFO_FILE].read_text())
    except ValueError as e:
        raise UserError(f"option --calibrate: {files[RUN_INFO_FILE]} is not JSON ({e})") from None
    if not isinstance(info, dict) or not {"world_size", "device_type", "device_name"} <= info.keys():
        raise UserError(f"option --calibrate: {files[RUN_INFO_FILE]} is not the trainer's run record (it needs "
                        f"world_size, device_type and device_name)")
    if info["device_type"] != "cuda":
        raise UserError(f"option --calibrate: {folder} ran on {info['device_type']} ({info['device_name']}); the "
                        f"model describes GPUs: give runs on the GPU named by --gpu")
    config = parse_args(["--job.config_file", str(files["config.toml"])])
    records = [json.loads(line) for line in files["metrics.jsonl"].read_text().splitlines() if line.strip()]
    windows = [record for record in records if "tps" in record][1:]
    if not windows:
        raise UserError(f"option --calibrate: {folder} logged fewer than two windows of training metrics (the "
                        f"first holds compilation and warm-up); train for more steps than metrics.log_freq")
    return MeasuredRun(folder=folder, config=config, world_size=info["world_size"], device_name=info["device_name"],
                       layout=layout_from_config(config, info["world_size"]),
                       tps_per_gpu=statistics.median(record["tps"] for record in windows),
                       peak_memory_gib=max(record["memory_gib"] for record in windows))


def _read_dry_run(folder: Path) -> MeasuredRun:
    try:
        report = read_report(folder)
    except ValueError as e:
        raise UserError(f"option --calibrate: {folder / DRY_RUN_REPORT} is not JSON ({e})") from None
    if "tokens_per_second_per_gpu" not in report:
        raise UserError(f"option --calibrate: {folder} is a dry run on fake tensors, which times nothing; run the "
                        f"rank on a GPU with --comm.no_fake_tensors")
    if "max_reserved_gib" not in report.get("memory", {}):
        raise UserError(f"option --calibrate: {folder} ran on {report.get('device')}, not a GPU; the model "
                        f"describes GPUs: give runs on the GPU named by --gpu")
    if not (folder / "config.toml").is_file():
        raise UserError(f"option --calibrate: {folder} has no config.toml beside its {DRY_RUN_REPORT}")
    config = parse_args(["--job.config_file", str(folder / "config.toml")])
    return MeasuredRun(folder=folder, config=config, world_size=report["world_size"], device_name=report["device"],
                       layout=layout_from_config(config, report["world_size"]),
                       tps_per_gpu=report["tokens_per_second_per_gpu"],
                       peak_memory_gib=report["memory"]["max_reserved_gib"], alone=True)


def calibrate(runs: list[MeasuredRun], gpu: GPU, refit_all: bool = False) -> tuple[dict[str, float], list[dict]]:
    """The refitted constants, and per run its measured and predicted figures (with the model's constants and with
    the refitted ones)."""
    if refit_all and len(runs) < 3:
        raise UserError(f"option --refit_all: three constants need three runs or more, got {len(runs)}")
    for run in runs:
        require_same_gpu(gpu, run.device_name, str(run.folder))
    points = []
    for run in runs:
        args = model_args_for(run.config.model.flavor, run.config.training.seq_len,
                              overrides=shape_overrides(run.config.model))
        points.append((args, run.layout, run.config.training.seq_len, run.tps_per_gpu, run.alone))
    fitted = fit(points, gpu, only_efficiency=not refit_all)
    table = []
    for run in runs:
        before, after = (predict(run.config.model.flavor, run.layout, run.config.training.seq_len, gpu,
                                 config=run.config, **constants) for constants in (MODEL_CONSTANTS, fitted))
        figure = "tps_alone" if run.alone else "tps_per_gpu"
        table.append({"run": str(run.folder), "gpus": run.world_size, "alone": run.alone,
                      "tps_measured": run.tps_per_gpu, "tps_model": getattr(before, figure),
                      "tps_fitted": getattr(after, figure),
                      "memory_measured_gib": run.peak_memory_gib, "memory_predicted_gib": after.peak_memory_gib})
    return fitted, table
