"""The planner's whole predictions (search.predict: speed, range and memory) beside TorchTitan's published runs
(validation.py reads them), and beside the dry run of each run's layout: the tables of `scripts/plan.py --validate`
(with --traced, --measured).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile

from torchtitan.models.llama3.args import model_args_for
from torchtitan.planner.cost import MODEL_CONSTANTS, tokens_per_second_per_gpu
from torchtitan.planner.hardware import GPU as GPUSpec
from torchtitan.planner.search import CONFIGS, PRESET_TOML, Prediction, layout_overrides, predict, reserved_gib
from torchtitan.planner.validation import GPU, Row, envelope, other_rows, published_rows, row_range
from torchtitan.tools.dry_run_report import read_report


def other_table(rows: list[Row] | None = None) -> list[dict]:
    """Published vs predicted tokens/s per GPU of OTHER's rows, and peak memory where published. The speed is the
    performance model's alone (a Megatron virtual-pipeline split this framework's trainer does not express still
    has a step time); the memory is the planner's (tensors plus the allocator's reserve)."""
    rows = rows if rows is not None else other_rows()
    table = []
    for row in rows:
        tps = tokens_per_second_per_gpu(row.args, row.layout, row.seq_len, row.gpu)
        memory = predict(row.flavor, row.layout, row.seq_len, row.gpu).peak_memory_gib if row.peak_memory_gib else 0.0
        conservative, optimistic = row_range(row, envelope())
        table.append({"row": row.index, "name": row.name, "gpu": row.gpu.name, "source": row.source,
                      "tps_published": row.tps_per_gpu, "tps_predicted": tps, "tps_error": tps / row.tps_per_gpu - 1,
                      "tps_conservative": conservative, "tps_optimistic": optimistic,
                      "memory_published_gib": row.peak_memory_gib or None,
                      "memory_predicted_gib": memory or None,
                      "memory_error": memory / row.peak_memory_gib - 1 if row.peak_memory_gib else None})
    return table


def predictions(rows: list[Row], **constants) -> list[Prediction]:
    """Each row's prediction, its memory that of the rank TorchTitan logged: the first rank of the last pipeline
    stage under PP (its metrics rank, where the loss is), rank 0 otherwise."""
    return [predict(row.flavor, row.layout, row.seq_len, GPU, pipeline_rank=row.layout.pp - 1, **constants)
            for row in rows]


def validation_table(rows: list[Row] | None = None, constants: dict[str, float] | None = None) -> list[dict]:
    """Published vs predicted tokens/s per GPU and peak memory for every row (with the model's constants unless
    others are given)."""
    rows = rows or published_rows()
    constants = constants or MODEL_CONSTANTS
    table = []
    for row, prediction in zip(rows, predictions(rows, **constants)):
        table.append({"row": row.index, "name": row.name, "fitted": row.fitted, "constants": constants,
                      "tps_published": row.tps_per_gpu, "tps_predicted": prediction.tps_per_gpu,
                      "tps_error": prediction.tps_per_gpu / row.tps_per_gpu - 1,
                      "tps_conservative": prediction.tps_conservative, "tps_optimistic": prediction.tps_optimistic,
                      "memory_published_gib": row.peak_memory_gib or None,
                      "memory_predicted_gib": prediction.peak_memory_gib,
                      "memory_error": prediction.peak_memory_gib / row.peak_memory_gib - 1 if row.peak_memory_gib
                      else None})
    return table


def _run_rank(row: Row, *options: str) -> dict:
    """The dry run of one rank of a published row's layout (a new process); returns its report."""
    args = model_args_for(row.flavor, row.seq_len)
    with tempfile.TemporaryDirectory(prefix="plan-validate-") as dump_folder:
        proc = subprocess.run(
            [sys.executable, "-m", "torchtitan.train", "--job.config_file", str(CONFIGS / PRESET_TOML[row.flavor]),
             *layout_overrides(row.layout, row.seq_len, args.n_layers), "--comm.mode", "fake_backend",
             "--comm.fake_world_size", str(row.gpus), *options, "--job.dump_folder", dump_folder,
             "--job.no_print_config"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        report = read_report(dump_folder)
        if report is None:
            raise RuntimeError(f"the dry run of row {row.index} failed:\n{proc.stdout[-4000:]}")
        return report


def traced_peak_gib(row: Row) -> float:
    """The dry run's tensor peak (largest over the ranks it runs) for a published row's layout."""
    return _run_rank(row, "--comm.fake_gpu", "h100_96gb")["max_peak_memory_gib"]


def measured_table(rows: list[Row], gpu: GPUSpec, steps: int) -> list[dict]:
    """Each row's rank alone on this machine's GPU (real tensors, fake collectives: `--comm.no_fake_tensors`), its
    time without communication and the allocator's peak, against what the model predicts for the same: compute and
    parameter traffic, no communication, no bubble (planner/cost.py), on `gpu`. Under PP both ends of the pipeline
    run: the first stage's rank, which holds the most micro-batches in flight, and the last stage's, which holds
    the output layer and the loss; the slower sets the pace and the larger peak is set against the model's worst
    rank. The run is this framework's, so its layout is predicted as this framework runs it (column-split
    embedding; no pipeline outputs kept; async TP off, which a rank alone cannot run)."""
    table = []
    for row in rows:
        layout = dataclasses.replace(row.layout, row_split_embedding=False, kept_pipeline_outputs=False,
                                     async_tp=False)
        ranks = sorted({0, (layout.pp - 1) * (row.gpus // layout.pp)})
        reports = [_run_rank(dataclasses.replace(row, layout=layout), "--comm.no_fake_tensors", "--comm.fake_rank",
                             str(rank), "--comm.fake_steps", str(steps)) for rank in ranks]
        slowest = min(reports, key=lambda report: report["tokens_per_second_per_gpu"])
        prediction = predict(row.flavor, layout, row.seq_len, gpu)
        measured_gib = max(report["memory"]["max_reserved_gib"] for report in reports)
        table.append({"row": row.index, "name": row.name, "ranks": ranks, "device": slowest["device"],
                      "step_seconds": {report["rank"]: report["step_seconds"] for report in reports},
                      "memory_by_rank": {report["rank"]: report["memory"] for report in reports},
                      "tps_measured": slowest["tokens_per_second_per_gpu"], "tps_predicted": prediction.tps_alone,
                      "tps_error": prediction.tps_alone / slowest["tokens_per_second_per_gpu"] - 1,
                      "tps_published": row.tps_per_gpu, "mfu_pct": slowest["mfu_pct"],
                      "memory_measured_gib": measured_gib,
                      "memory_allocated_gib": max(report["memory"]["max_allocated_gib"] for report in reports),
                      "memory_predicted_gib": prediction.peak_memory_gib,
                      "memory_error": prediction.peak_memory_gib / measured_gib - 1})
    return table


def traced_table(rows: list[Row] | None = None) -> list[dict]:
    """Published peak memory against the dry run's (plus the allocator model), one dry run per distinct layout
    (compile and async TP do not change what is traced), for the rows that publish it."""
    rows = [row for row in rows or published_rows() if row.peak_memory_gib]
    traced: dict = {}
    table = []
    for row in rows:
        key = (row.flavor, row.gpus, dataclasses.replace(row.layout, compile=False, async_tp=False))
        if key not in traced:
            traced[key] = traced_peak_gib(row)
        predicted = reserved_gib(traced[key] * 2**30)
        table.append({"row": row.index, "name": row.name, "tensor_peak_gib": traced[key],
                      "memory_published_gib": row.peak_memory_gib, "memory_predicted_gib": predicted,
                      "memory_error": predicted / row.peak_memory_gib - 1})
    return table
