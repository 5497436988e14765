"""Compare training runs (recipes): a summary table and loss/throughput plots, optionally a loss parity check.

From the repository root:

    python scripts/compare_runs.py outputs/fp32 outputs/bf16 --out compare --labels fp32,bf16
    python scripts/compare_runs.py --out compare --ngpu 2 \\
        --launch "fsdp=train_configs/debug_model.toml --training.steps 20" \\
        --launch "tp=train_configs/debug_model.toml --training.steps 20 --parallelism.tensor_parallel_degree 2"
    python scripts/compare_runs.py outputs/a outputs/b --out compare --assert-close 1e-5

Each RUN is a trainer dump folder: its metrics.jsonl is read, or, without one, the TensorBoard event files under
it. Its goodput (the share of the wall time that trained the model, and where the rest went) comes from the run
records in RUN/health/ (every run of that folder: restarts and resumes included), else from the last goodput
metrics logged. `--launch "LABEL=CONFIG.toml [--section.option value ...]"` first trains that recipe with
./run_train.sh (NGPU from --ngpu) into OUT/LABEL (its console output in OUT/LABEL/train.log). Folders come first in the table, then
launched runs, in the order given. The first run is the reference of --assert-close.

Writes OUT/comparison.md (also printed), OUT/loss_vs_step.png, OUT/loss_vs_tokens.png and OUT/throughput.png.
Exit status: 0, 1 when --assert-close finds a difference, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Running `python scripts/compare_runs.py` puts scripts/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(REPO))

from torchtitan.errors import UserError  # noqa: E402
from torchtitan.tools.files import atomic_write  # noqa: E402

JSONL_FILE = "metrics.jsonl"
TB_EVENTS_PATTERN = "events.out.tfevents.*"
# metrics.jsonl holds NaN and infinities as strings (JSON cannot hold them).
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass
class Run:
    """One run's logged metrics: for each metric, step -> value (a later record of a step replaces an earlier
    one, as when a resumed run repeats steps after its last checkpoint), and the time of each record."""

    label: str
    source: Path
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    goodput: dict[str, float] | None = None

    def add(self, step: int, time: float | None, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.series.setdefault(key, {})[step] = value
        if time is not None:
            self.times.append(time)

    def points(self, key: str, min_step: int = 0) -> list[tuple[int, float]]:
        return sorted((step, value) for step, value in self.series.get(key, {}).items() if step >= min_step)


# ------------------------------------------------------------------------------------------------------------------
# Reading runs


def read_run(folder: Path, label: str) -> Run:
    if not folder.is_dir():
        raise UserError(f"run folder {folder} does not exist")
    jsonl = folder / JSONL_FILE
    if jsonl.is_file():
        run = _read_jsonl(jsonl, label)
    else:
        event_dirs = sorted({path.parent for path in folder.rglob(TB_EVENTS_PATTERN)})
        if not event_dirs:
            raise UserError(f"run folder {folder} has no {JSONL_FILE} and no TensorBoard event files "
                            f"({TB_EVENTS_PATTERN}); is it a trainer's job.dump_folder?")
        # With metrics.save_for_all_ranks every rank has a folder (rank_0, rank_1, ...): the first is rank 0's.
        run = _read_tensorboard(event_dirs[0], label)
    if "loss" not in run.series:
        raise UserError(f"run {run.source} holds no training loss")
    run.goodput = _read_goodput(folder, run)
    return run


def _read_goodput(folder: Path, run: Run) -> dict[str, float] | None:
    """The job's goodput account: from the run records (complete: up to each run's end), else the last one logged
    (up to the last logged step), else None (a trainer from before goodput)."""
    if (folder / "health").is_dir():
        # Imported here: torchtitan.components.health imports torch, slow and only needed for these folders.
        from torchtitan.components.health import job_goodput, read_records

        records = read_records(folder)
        if records:
            return job_goodput(records)
    if "goodput_pct" not in run.series:
        return None
    last = {key: _last(run.points(key)) for key in run.series if key.startswith("goodput")}
    return {key.removeprefix("goodput/"): value for key, value in last.items()}


def _read_jsonl(path: Path, label: str) -> Run:
    run = Run(label, path)
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record.pop("step"))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{path}, line {number}: not a metrics record ({err})") from None
        time = record.pop("time", None)
        metrics = {key: _NONFINITE.get(value, value) for key, value in record.items()}
        run.add(step, time, {key: float(value) for key, value in metrics.items() if isinstance(value, (int, float))})
    return run


def _read_tensorboard(folder: Path, label: str) -> Run:
    # Imported here: TensorBoard is slow to import and only needed for runs without metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    run = Run(label, folder)
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            run.add(event.step, event.wall_time, {tag: float(event.value)})
    return run


# ------------------------------------------------------------------------------------------------------------------
# Launching recipes


@dataclass
class Launch:
    label: str
    config: Path
    overrides: list[str]


def parse_launch(spec: str) -> Launch:
    try:
        words = shlex.split(spec)
    except ValueError as err:
        raise UserError(f"--launch {spec!r}: {err}") from None
    label, sep, config = words[0].partition("=") if words else ("", "", "")
    if not sep or not label or not config:
        raise UserError(f"--launch {spec!r}: expected \"LABEL=CONFIG.toml [--section.option value ...]\"")
    if "/" in label or label in (".", ".."):
        raise UserError(f"--launch {spec!r}: the label {label!r} names a folder under --out; it cannot contain '/'")
    if not Path(config).is_file():
        raise UserError(f"--launch {label}: config file {config} does not exist")
    return Launch(label, Path(config).resolve(), words[1:])


def launch(recipe: Launch, out: Path, ngpu: int) -> Path:
    """Train `recipe` into out/LABEL with ./run_train.sh; returns the dump folder."""
    dump = out / recipe.label
    if (dump / JSONL_FILE).exists():
        raise UserError(f"--launch {recipe.label}: {dump} already holds a run (the trainer would append to it); "
                        f"remove it or choose another --out or label")
    dump.mkdir(parents=True, exist_ok=True)
    log = dump / "train.log"
    command = [str(REPO / "run_train.sh"), *recipe.overrides, "--job.dump_folder", str(dump.resolve())]
    # torchrun from the environment of this interpreter, also when that environment is not activated.
    env = {**os.environ, "NGPU": str(ngpu), "CONFIG_FILE": str(recipe.config),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    print(f"training {recipe.label}: NGPU={ngpu} CONFIG_FILE={recipe.config} {shlex.join(command)} (log: {log})",
          flush=True)
    with open(log, "w") as output:
        status = subprocess.run(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT).returncode
    if status != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(tail, file=sys.stderr)
        raise UserError(f"--launch {recipe.label}: the trainer exited with status {status}; see {log}")
    return dump


# ------------------------------------------------------------------------------------------------------------------
# Summary


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def _last(points: list[tuple[int, float]]) -> float | None:
    return points[-1][1] if points else None


def summarize(run: Run) -> dict[str, float | None]:
    losses = run.points("loss")
    finite_losses = [value for _, value in losses if math.isfinite(value)]
    memory = [value for _, value in run.points("memory_gib") if math.isfinite(value)]
    validation = [value for _, value in run.points("validation_loss") if math.isfinite(value)]
    # Smoothness of the curve: the variance of the change from one logged step to the next.
    changes = [b - a for (_, a), (_, b) in zip(losses, losses[1:]) if math.isfinite(b - a)]
    optimizer_state = [value for _, value in run.points("optimizer_state_gib") if math.isfinite(value)]
    return {
        "steps": losses[-1][0],
        "final loss": losses[-1][1],
        "best loss": min(finite_losses) if finite_losses else None,
        "loss change variance": statistics.pvariance(changes) if len(changes) > 1 else None,
        "final validation loss": _last(run.points("validation_loss")),
        "best validation loss": min(validation) if validation else None,
        # Step 1 includes start-up work (allocation, compilation, the first collectives): not the steady state.
        "mean tokens/s": _mean([value for _, value in run.points("tps", min_step=2)]),
        "mean MFU %": _mean([value for _, value in run.points("mfu", min_step=2)]),
        "peak memory GiB": max(memory) if memory else None,
        "optimizer state MiB": max(optimizer_state) * 1024 if optimizer_state else None,
        "wall time s": max(run.times) - min(run.times) if run.times else None,
        "goodput %": run.goodput["goodput_pct"] if run.goodput else None,
    }


_FORMATS: dict[str, Callable[[float], str]] = {
    "steps": lambda v: f"{int(v)}",
    "final loss": lambda v: f"{v:.4f}",
    "best loss": lambda v: f"{v:.4f}",
    "loss change variance": lambda v: f"{v:.2e}",
    "final validation loss": lambda v: f"{v:.4f}",
    "best validation loss": lambda v: f"{v:.4f}",
    "mean tokens/s": lambda v: f"{v:,.0f}",
    "mean MFU %": lambda v: f"{v:.2f}",
    "peak memory GiB": lambda v: f"{v:.2f}",
    "optimizer state MiB": lambda v: f"{v:.2f}",
    "wall time s": lambda v: f"{v:.1f}",
    "goodput %": lambda v: f"{v:.1f}",
}

# The goodput table's columns: the account's key -> the column's name.
_GOODPUT_COLUMNS = {"wall_s": "wall s", "productive_s": "productive s", "startup_s": "start-up + compile s",
                    "checkpoint_s": "checkpoint s", "data_s": "data s", "validation_s": "validation s",
                    "skipped_s": "skipped steps s", "quorum_wait_s": "quorum wait s", "lost_s": "lost work s",
                    "restart_s": "restart s",
                    "other_s": "other s", "lost_steps": "steps redone"}


def goodput_table(runs: list[Run]) -> list[str]:
    """Where each run's wall time went (runs without a goodput account show n/a)."""
    header = ["run", "goodput %", *_GOODPUT_COLUMNS.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for run in runs:
        account = run.goodput or {}
        cells = [f"{account['goodput_pct']:.1f}" if "goodput_pct" in account else "n/a"]
        cells += [("n/a" if key not in account else f"{int(account[key])}" if key == "lost_steps"
                   else f"{account[key]:.1f}") for key in _GOODPUT_COLUMNS]
        lines.append("| " + " | ".join([run.label, *cells]) + " |")
    return lines


def comparison_table(runs: list[Run]) -> str:
    header = ["run", *_FORMATS]
    rows = []
    for run in runs:
        summary = summarize(run)
        rows.append([run.label, *(("n/a" if summary[key] is None else fmt(summary[key]))
                                  for key, fmt in _FORMATS.items())])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(_FORMATS)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    sources = [f"- {run.label}: {run.source}" for run in runs]
    goodput = []
    if any(run.goodput for run in runs):
        goodput = ["", "## Where the time went", "", *goodput_table(runs), "",
                   "Goodput: the share of the wall time whose steps' updates stand (docs/resilience.md). Lost work: "
                   "steps redone after a restart; restart: the time from a crashed run's last record to the next "
                   "run's first step. Over every run of the dump folder."]
    return "\n".join(["# Run comparison", "", *lines, "",
                      "Mean tokens/s (per device) and MFU exclude step 1 (warm-up); they compare only runs made "
                      "side by side on the same quiet machine (runs made one after another on a shared machine "
                      "differ by its load, not by their method). Loss change variance: the "
                      "variance of the loss's change between consecutive logged steps (lower: a smoother curve). "
                      "Optimizer state: the most one rank held. Sources:", *sources, *goodput, ""])


# ------------------------------------------------------------------------------------------------------------------
# Plots


def plot(runs: list[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        ax.plot(*zip(*run.points("loss")), color=color, label=run.label)
        validation = run.points("validation_loss")
        if validation:
            ax.plot(*zip(*validation), color=color, linestyle="--", marker="o", label=f"{run.label} (validation)")
    ax.set(xlabel="step", ylabel="loss", title="Loss vs step")
    paths.append(_save(fig, out / "loss_vs_step.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        tokens = run.series.get("tokens_seen", {})
        points = [(tokens[step], value) for step, value in run.points("loss") if step in tokens]
        if points:
            ax.plot(*zip(*points), color=colors[i % len(colors)], label=run.label)
        else:
            print(f"warning: run {run.label} logged no tokens_seen: left out of loss_vs_tokens.png", file=sys.stderr)
    ax.set(xlabel="tokens seen", ylabel="loss", title="Loss vs tokens")
    paths.append(_save(fig, out / "loss_vs_tokens.png"))

    fig, (tps_ax, mfu_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        for ax, key in ((tps_ax, "tps"), (mfu_ax, "mfu")):
            points = run.points(key, min_step=2)
            if points:
                ax.plot(*zip(*points), color=color, label=run.label)
    tps_ax.set(ylabel="tokens/s per device", title="Throughput (step 1, the warm-up, left out)")
    mfu_ax.set(xlabel="step", ylabel="MFU %")
    paths.append(_save(fig, out / "throughput.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------------------------
# Parity


def check_close(runs: list[Run], tolerance: float) -> str | None:
    """None if every run's loss equals the first run's within `tolerance` (relative) at every step either logged;
    else a message naming the first step where one differs."""
    reference = runs[0].series["loss"]
    steps = sorted(set().union(*(run.series["loss"] for run in runs)))
    for step in steps:
        for run in runs[1:]:
            losses = run.series["loss"]
            if (step in losses) != (step in reference):
                has, lacks = (run, runs[0]) if step in losses else (runs[0], run)
                return f"step {step}: run {has.label} logged a loss, run {lacks.label} did not"
            if step not in losses:
                continue
            ours, theirs = losses[step], reference[step]
            # Equal covers two equal infinities, whose difference is NaN; two NaNs diverged alike.
            if ours == theirs or (math.isnan(ours) and math.isnan(theirs)):
                continue
            difference = abs(ours - theirs) / abs(theirs) if theirs != 0 else abs(ours)
            if not difference <= tolerance:
                return (f"step {step}: run {run.label} has loss {ours!r}, run {runs[0].label} has {theirs!r} "
                        f"(relative difference {difference:.3g} > {tolerance:g})")
    return None


# ------------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python scripts/compare_runs.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, metavar="RUN", help="dump folder of a finished run")
    parser.add_argument("--out", required=True, type=Path, help="folder for comparison.md and the plots")
    parser.add_argument("--labels", help="comma-separated names of the RUN folders (default: the folder names)")
    parser.add_argument("--launch", action="append", default=[], metavar='"LABEL=CONFIG.toml [OPTIONS]"',
                        help="train this recipe into OUT/LABEL first (repeatable)")
    parser.add_argument("--ngpu", type=int, default=1, help="processes per launched run (default 1)")
    parser.add_argument("--assert-close", type=float, metavar="TOL",
                        help="exit 1 unless every run's loss equals the first run's within TOL (relative) at every "
                             "step")
    return parser


def _labels(args: argparse.Namespace) -> list[str]:
    if args.labels is None:
        names = [path.resolve().name for path in args.runs]
        # Folders of the same name (a/run, b/run) are told apart by the path as given.
        return [name if names.count(name) == 1 else str(path) for name, path in zip(names, args.runs)]
    labels = [label.strip() for label in args.labels.split(",")]
    if not all(labels):
        raise UserError(f"--labels: {args.labels!r} has an empty label")
    if len(labels) != len(args.runs):
        raise UserError(f"--labels: {len(labels)} label(s) ({args.labels}) for {len(args.runs)} RUN folder(s); give "
                        f"one per folder (launched runs are named by their LABEL=)")
    return labels


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.runs and not args.launch:
            raise UserError("no runs to compare: give RUN folders and/or --launch recipes")
        if args.ngpu < 1:
            raise UserError(f"--ngpu: {args.ngpu} must be at least 1")
        if args.assert_close is not None and not args.assert_close >= 0:
            raise UserError(f"--assert-close: {args.assert_close} must be a non-negative tolerance")
        recipes = [parse_launch(spec) for spec in args.launch]
        labels = _labels(args) + [recipe.label for recipe in recipes]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise UserError(f"run label(s) {', '.join(duplicates)} used twice; labels name the runs in the table")
        if args.assert_close is not None and len(labels) < 2:
            raise UserError("--assert-close compares runs with the first one: give at least two runs")
        runs = [read_run(folder, label) for folder, label in zip(args.runs, labels)]
        args.out.mkdir(parents=True, exist_ok=True)
        runs += [read_run(launch(recipe, args.out, args.ngpu), recipe.label) for recipe in recipes]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    table = comparison_table(runs)
    with atomic_write(args.out / "comparison.md") as f:
        f.write(table)
    print(table)
    for path in plot(runs, args.out):
        print(f"wrote {path}")

    if args.assert_close is not None:
        mismatch = check_close(runs, args.assert_close)
        if mismatch is not None:
            print(f"losses differ: {mismatch}", file=sys.stderr)
            return 1
        print(f"losses agree: every run is within {args.assert_close:g} (relative) of {runs[0].label} at every step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
