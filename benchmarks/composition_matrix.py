"""Every pair of features, tried: a pairwise covering array of the feature space, run cell by cell on the tiny model.

    python benchmarks/composition_matrix.py                # run every cell (about an hour on 2 cores)
    python benchmarks/composition_matrix.py --list         # the cells and what the compatibility table says of each
    python benchmarks/composition_matrix.py --cells 0,5,9  # some cells only
    python benchmarks/composition_matrix.py --table        # the compatibility table (docs/compatibility.md)

Each factor below is one feature axis (the layout, compile, activation checkpointing, Float8, the optimizer, gradient
compression, the health options, checkpoint save + resume, the dry run, replica fault tolerance), with its levels.
The covering array holds every pair of levels of every two factors in at least one cell (a greedy construction,
deterministic). A cell either

- is refused by the compatibility table (torchtitan/config/compatibility.py) or by a single option's own check: the
  run must then exit with status 2 and that one error line, before training; or
- trains: status 0 and finite losses (a step whose NaN the cell injected on purpose excepted), and where the cell is
  exact by construction (fp32, an exact optimizer, no lossy compression or Float8) the losses of the one-process run
  of the same options within 1e-5.

A timeout (a hang) or any other exit fails the cell. tests/integration/test_composition.py runs the whole array as a
slow test and a fixed sample of it in the default suite; docs/compatibility.md has the table of refused pairs.
"""

import argparse
import itertools
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.components.optimizers import optimizer_names  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 4
BASE = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.mixed_precision_param", "float32",
        "--debug.seed", "0", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--validation.no_enable",
        "--metrics.disable_color_printing", "--metrics.peak_flops", "1e12", "--training.steps", str(STEPS),
        "--activation_checkpoint.mode", "none", "--comm.train_timeout_seconds", "60"]

# layout -> (processes, data-parallel degree, options)
LAYOUTS: dict[str, tuple[int, int, list[str]]] = {
    "one": (1, 1, []),
    "fsdp2": (2, 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "hsdp2x2": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2"]),
    "rtp2": (2, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_shard_method",
                    "rotated"]),
    "ddp2": (2, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1"]),
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2_1f1b": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                        "1F1B"]),
    "pp2_interleaved": (2, 1, ["--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "pp2_zbv": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                       "ZBVZeroBubble"]),
    "cp2_causal": (2, 1, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_block_causal": (2, 1, ["--parallelism.context_parallel_degree", "2", "--model.attention_mask",
                                "block_causal"]),
}

FACTORS: dict[str, dict[str, list[str]]] = {
    "layout": {name: [] for name in LAYOUTS},
    "compile": {"off": [], "on": ["--compile.enable"]},
    "activation_checkpoint": {"none": [], "full": ["--activation_checkpoint.mode", "full"],
                              "per_block": ["--activation_checkpoint.mode", "selective",
                                            "--activation_checkpoint.selective_ac_option", "2"],
                              "per_op": ["--activation_checkpoint.mode", "selective",
                                         "--activation_checkpoint.selective_ac_option", "op"]},
    "float8": {"off": [], "tensorwise": ["--model.converters", "quantize.linear.float8",
                                         "--quantize.linear.float8.emulate"],
               "rowwise": ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate",
                           "--quantize.linear.float8.recipe_name", "rowwise"]},
    "optimizer": {name: ["--optimizer.name", name] for name in optimizer_names()},
    "compression": {"none": [], "loco": ["--comm.gradient_compression", "loco"],
                    "error_feedback": ["--comm.gradient_compression", "error_feedback"],
                    "qsdp": ["--comm.gradient_compression", "qsdp", "--comm.weight_quantization", "qsdp"]},
    # The health options, each with the fault it exists for (tests/integration/fault_injection.py).
    "health": {"none": [], "skip_nonfinite": ["--debug.on_nonfinite", "skip"],
               "spike_guard": ["--health.spike_sigma", "3", "--health.spike_warmup", "1"],
               "rerun_bad_steps": ["--debug.on_nonfinite", "skip", "--health.rerun_bad_steps"]},
    "checkpoint": {"off": [], "resume": ["--checkpoint.enable", "--checkpoint.interval", "2"]},
    "dry_run": {"off": [], "on": ["--comm.mode", "fake_backend"]},
    # Two replica groups of the layout, and a lighthouse, through run_train.sh (FT_GROUPS=2).
    "fault_tolerance": {"off": [], "on": ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                                          "--fault_tolerance.join_timeout_seconds", "2"]},
}
FAULTS = {"skip_nonfinite": "nan@2:*", "spike_guard": "spike@3:*", "rerun_bad_steps": "nan@2:*"}
INJECTED_STEP = {"skip_nonfinite": 2, "spike_guard": 3, "rerun_bad_steps": 2}

# Exact by construction: the same sums in another order (fp32) give the one-process losses within 1e-5 over 4 steps.
EXACT_OPTIMIZERS = {"AdamW", "Adam", "Ranger21", "GaLore-AdamW", "Muon", "AdamW-bf16"}


def covering_array(factors: dict[str, list[str]], allowed=lambda cell: True) -> list[dict[str, str]]:
    """Cells (factor -> level) that hold every pair of levels of every two factors at least once, in a cell that
    `allowed` accepts where one exists. Greedy and deterministic: each new cell starts from the first pair not yet
    held, and every other factor, in order, takes the level that holds the most pairs not yet held with the levels
    chosen so far, among the levels that keep the cell allowed (unset factors read as their first level); ties go to
    the level listed first. A pair that no completion makes allowed (a refused pair) gets a cell of its own that
    holds that pair only: the refusal's witness."""
    names = list(factors)

    def pair(p: tuple[str, str], q: tuple[str, str]) -> tuple:
        return (p, q) if names.index(p[0]) < names.index(q[0]) else (q, p)

    def complete(cell: dict[str, str]) -> dict[str, str]:
        return {name: cell.get(name, factors[name][0]) for name in names}

    uncovered = {pair((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}
    cells = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda p: (names.index(p[0][0]), factors[p[0][0]].index(p[0][1]),
                                                       names.index(p[1][0]), factors[p[1][0]].index(p[1][1])))
        cell = {a: x, b: y}
        for name in names:
            if name in cell:
                continue

            def gain(level: str) -> int:
                return sum(pair((name, level), (other, value)) in uncovered for other, value in cell.items())
            candidates = [level for level in factors[name] if allowed(complete({**cell, name: level}))]
            cell[name] = max(candidates or factors[name], key=lambda level: (gain(level), -factors[name].index(level)))
        cell = complete(cell)
        if allowed(cell):
            uncovered -= {pair((p, cell[p]), (q, cell[q])) for p, q in itertools.combinations(names, 2)}
        else:
            cell = complete({a: x, b: y})
            uncovered.discard(((a, x), (b, y)))
        cells.append(cell)
    return cells


def cells() -> list[dict[str, str]]:
    return covering_array({name: list(levels) for name, levels in FACTORS.items()},
                          allowed=lambda levels: predicted_refusal(Cell(-1, levels)) is None)


@dataclass
class Cell:
    index: int
    levels: dict[str, str]
    nproc: int = field(init=False)
    args: list[str] = field(init=False)
    env: dict[str, str] = field(init=False)

    def __post_init__(self):
        nproc, dp, layout = LAYOUTS[self.levels["layout"]]
        self.nproc = nproc
        self.args = [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH // dp), *layout]
        for name, level in self.levels.items():
            self.args += FACTORS[name][level]
        if self.dry_run:
            self.args += ["--comm.fake_world_size", str(nproc), "--comm.fake_device", "cpu"]
        fault = FAULTS.get(self.levels["health"])
        # run_train.sh launches the trainer itself: a replica-group cell's health options run without their fault.
        self.env = {"FAULT_PLAN": fault} if fault and not self.dry_run and not self.replica_groups else {}

    @property
    def replica_groups(self) -> bool:
        return self.levels["fault_tolerance"] == "on"

    @property
    def dry_run(self) -> bool:
        return self.levels["dry_run"] == "on"

    @property
    def exact(self) -> bool:
        levels = self.levels
        return (levels["float8"] == "off" and levels["compression"] == "none" and levels["compile"] == "off"
                and levels["optimizer"] in EXACT_OPTIMIZERS and not self.dry_run and not self.replica_groups)

    def reference_levels(self) -> dict[str, str]:
        """The same options on one process."""
        return {**self.levels, "layout": "one"}

    def describe(self) -> str:
        return ", ".join(f"{name}={level}" for name, level in self.levels.items())


def predicted_refusal(cell: Cell) -> str | None:
    """The one error line the run must stop with, from the configuration alone (the compatibility table and the
    options' own checks that need no devices), or None."""
    from torchtitan.config import parse_args
    from torchtitan.config.compatibility import check_composition, setup_of
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.errors import UserError

    try:
        config = parse_args(cell.args)
        dims = ParallelDims.from_config(config.parallelism, cell.nproc)
        check_composition(setup_of(config, dims, "cpu"))
    except UserError as e:
        return str(e)
    return None


@dataclass
class Outcome:
    status: str  # trained, refused, failed
    detail: str
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _launch(cell: Cell, folder: Path, timeout: int) -> subprocess.CompletedProcess | None:
    module = "tests.integration.fault_injection" if cell.env else "torchtitan.train"
    trainer = ["-m", module, *cell.args, "--job.dump_folder", str(folder)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **cell.env}
    if cell.replica_groups and not cell.dry_run:
        cmd = [str(REPO / "run_train.sh"), *cell.args, "--job.dump_folder", str(folder)]
        env.update(NGPU=str(cell.nproc), FT_GROUPS="2", FT_LIGHTHOUSE_PORT=str(_free_port()), FT_MAX_RESTARTS="0",
                   PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    elif cell.nproc == 1 or cell.dry_run:
        cmd = [sys.executable, *trainer]
    else:
        # torchtitan.launch: torchrun, with the first failed worker's exit code (2 for a refusal) as its own.
        cmd = [sys.executable, "-m", "torchtitan.launch", f"--nproc_per_node={cell.nproc}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", *trainer]
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


def _losses(folder: Path) -> list[float]:
    """The logged loss of each step. Replica groups log their own: a group that joined the first quorum late healed
    from the other and logs from its first step on, so each step's loss is group 0's, else group 1's."""
    paths = [folder / "metrics.jsonl"] if (folder / "metrics.jsonl").exists() else \
        [folder / "replica_1" / "metrics.jsonl", folder / "replica_0" / "metrics.jsonl"]
    by_step = {}
    for path in filter(Path.exists, paths):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        # The metrics file writes a non-finite value as a string ("nan"), which float() reads back.
        by_step.update({row["step"]: float(row["loss"]) for row in rows if "loss" in row})
    return [by_step[step] for step in sorted(by_step)]


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "error: " in line]
    return lines[-1].split("error: ", 1)[1] if lines else output[-400:]


def run_cell(cell: Cell, folder: Path, timeout: int = 300) -> Outcome:
    """Launch the cell (twice for a save + resume); its outcome as the module docstring defines it."""
    start = time.perf_counter()
    expected = predicted_refusal(cell)
    resume = cell.levels["checkpoint"] == "resume" and not cell.dry_run
    first = cell
    if resume:  # the first launch stops after the step-2 checkpoint, the second resumes from it
        first = Cell(cell.index, cell.levels)
        first.args = [*cell.args, "--training.steps", "2"]
    result = _launch(first, folder, timeout)
    if result is not None and result.returncode == 0 and resume and expected is None:
        result = _launch(cell, folder, timeout)
    seconds = time.perf_counter() - start
    if result is None:
        return Outcome("failed", f"no exit within {timeout} s (a hang)", seconds=seconds)
    if expected is not None:
        if result.returncode == 2 and _error_line(result.stdout) == expected:
            return Outcome("refused", expected, seconds=seconds)
        return Outcome("failed", f"expected the refusal {expected!r}, got exit {result.returncode}: "
                                 f"{result.stdout[-1500:]}", seconds=seconds)
    if result.returncode == 2:
        return Outcome("failed", f"refused outside the compatibility table: {_error_line(result.stdout)}",
                       seconds=seconds)
    if result.returncode != 0:
        return Outcome("failed", f"exit {result.returncode}: {result.stdout[-2500:]}", seconds=seconds)
    if cell.dry_run:
        return Outcome("trained", "dry run", seconds=seconds)
    losses = _losses(folder)
    injected = INJECTED_STEP.get(cell.levels["health"])
    if len(losses) != STEPS:
        return Outcome("failed", f"{len(losses)} logged losses, not {STEPS}", losses, seconds)
    bad = [step for step, loss in enumerate(losses, 1) if not math.isfinite(loss) and step != injected]
    if bad:
        return Outcome("failed", f"non-finite losses at steps {bad}", losses, seconds)
    return Outcome("trained", "finite losses", losses, seconds)


def compare_with_reference(cell: Outcome, reference: Outcome, bound: float = 1e-5) -> str | None:
    """None when the losses agree within `bound` (relative); else why not. Steps whose loss was made non-finite on
    purpose are left out."""
    pairs = [(a, b) for a, b in zip(cell.losses, reference.losses) if math.isfinite(a) and math.isfinite(b)]
    worst = max((abs(a - b) / abs(b) for a, b in pairs), default=0.0)
    return None if worst <= bound else f"losses differ from one process by {worst:.2e} (bound {bound:.0e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the cells and the table's verdict, run nothing")
    parser.add_argument("--table", action="store_true",
                        help="print the compatibility table's refused pairs as Markdown (docs/compatibility.md)")
    parser.add_argument("--cells", default="", help="comma-separated cell indices to run (default: all)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a launch may take before it is a hang")
    parser.add_argument("--output", type=Path, help="write the outcomes as JSON here")
    args = parser.parse_args(argv)
    if args.table:
        from torchtitan.config.compatibility import matrix_markdown

        print(matrix_markdown())
        return 0
    every = [Cell(index, levels) for index, levels in enumerate(cells())]
    chosen = [every[int(i)] for i in args.cells.split(",")] if args.cells else every
    if args.list:
        for cell in chosen:
            verdict = predicted_refusal(cell)
            print(f"{cell.index:3d} {cell.describe()}: {'REFUSED: ' + verdict if verdict else 'trains'}")
        print(f"{len(every)} cells hold every pair of levels of {len(FACTORS)} factors")
        return 0
    results, references = {}, {}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="composition-") as tmp:
        for cell in chosen:
            outcome = run_cell(cell, Path(tmp) / f"cell{cell.index}", args.timeout)
            if outcome.status == "trained" and cell.exact and cell.levels["layout"] != "one":
                key = json.dumps(cell.reference_levels(), sort_keys=True)
                if key not in references:
                    reference_cell = Cell(-1, cell.reference_levels())
                    references[key] = run_cell(reference_cell, Path(tmp) / f"reference{len(references)}",
                                               args.timeout)
                reference = references[key]
                mismatch = ("the one-process reference did not train: " + reference.detail
                            if reference.status != "trained" else compare_with_reference(outcome, reference))
                if mismatch:
                    outcome = Outcome("failed", mismatch, outcome.losses, outcome.seconds)
            failed += outcome.status == "failed"
            results[cell.index] = outcome
            print(f"{cell.index:3d} {outcome.status:8s} {outcome.seconds:5.1f}s {cell.describe()}: "
                  f"{outcome.detail.splitlines()[0][:200] if outcome.detail else ''}", flush=True)
            shutil.rmtree(Path(tmp) / f"cell{cell.index}", ignore_errors=True)
    if args.output:
        args.output.write_text(json.dumps({index: outcome.__dict__ for index, outcome in results.items()}, indent=1))
    print(f"{len(results)} cells: {sum(o.status == 'trained' for o in results.values())} trained, "
          f"{sum(o.status == 'refused' for o in results.values())} refused by the table, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
