"""Run health: where the wall time went (goodput), loss and gradient-norm spikes, and straggler ranks.

The trainer makes one `Health` per rank and calls it at a few points of its loop (docs/resilience.md):

- `timed(category)` around the loop's parts (data, step, validation, checkpoint): the wall time of the process is
  attributed, end to end, to productive steps, start-up and compilation, checkpoint stalls, data waits,
  validation, skipped steps, a replica group's waits for the quorum of the groups (what a failed group costs the
  others) and the rest ("other": logging, garbage collection). Rank 0 keeps a record of its run
  in `<dump_folder>/health/`; a later run of the same folder (a restart, a resume) reads the earlier records, so
  that steps it redoes count as lost work and the time between a crash and its restart counts as restart time.
- `skip_update(...)` after each step's loss and gradient norm are known: whether to drop the update (non-finite,
  or a spike above the running statistics), and stop after too many dropped in a row. With
  `health.rerun_bad_steps` the trainer then runs the dropped step again and `rerun_verdict(...)` says whether the
  re-run reproduced it (a real divergence) or not (a non-deterministic, likely hardware, fault).
- `waiting_for_peers()` around the step's first collective and `step_end(step)` after the step: every
  `health.straggler_interval` steps the ranks share their own step times in one all_gather and a rank that stays
  slower than the median is named with its host.
"""

import contextlib
import json
import math
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.config.job_config import Health as HealthConfig
from torchtitan.errors import UserError
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import logger

RECORDS_FOLDER = "health"
# Where a run's wall time goes; the job-level accounting adds the two that span runs (lost, restart).
RUN_CATEGORIES = ("productive", "startup", "checkpoint", "data", "validation", "skipped", "quorum_wait", "other")
JOB_CATEGORIES = (*RUN_CATEGORIES, "lost", "restart")
# How a run ended: after these, the time until the next launch is not the job's (it was not running, by intent).
CLEAN_ENDS = ("finished", "preempted")
# Steps whose median is the steady step time that the first step's compilation is measured against.
_STEADY_SAMPLE = 20


class TrainingDiverged(UserError):
    """health.max_skipped_in_a_row updates in a row were dropped (loss/gradient-norm spikes or non-finite values)."""


def process_start_time() -> float:
    """Unix time at which this process started (Linux: from /proc, so the interpreter's and torch's imports count
    as start-up); elsewhere, the time this module was imported."""
    global _runs_in_process
    _runs_in_process += 1
    if _runs_in_process > 1:
        # A later run in the same process (tests, a notebook) starts now: the process's start was an earlier run's.
        return time.time()
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()
_runs_in_process = 0


# ------------------------------------------------------------------------------------------------------------------
# Goodput


@dataclass
class RunRecord:
    """One run (one process lifetime of rank 0) of a dump folder, as `<dump_folder>/health/run-*.json` holds it.

    `seconds` attributes the run's wall time from `start` to `end` (unix times of its process start and of the last
    update of the record); `productive_at` maps each step the run checkpointed (and, for a replica group that fell
    behind and healed, the steps it healed from and to) to the productive seconds it had accumulated by then, so
    that a later run resuming from one of those steps knows how much work it redoes.
    `ended`: "finished", "preempted", "left" (a replica group that left the quorum on SIGTERM: torchrun restarting
    it after one of its processes failed, or a scheduler stopping it), or "" while running (or after it crashed,
    was killed or stopped on an error: the record is then as of its last update)."""

    start: float
    end: float
    first_step: int
    last_step: int
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(RUN_CATEGORIES, 0.0))
    productive_at: dict[int, float] = field(default_factory=dict)
    ended: str = ""

    def productive_until(self, step: int) -> float:
        """Productive seconds of this run's steps up to `step` (linear between its known points)."""
        total = self.seconds["productive"]
        points = sorted({self.first_step: 0.0, **self.productive_at, self.last_step: total}.items())
        if step <= points[0][0]:
            return 0.0
        for (s0, p0), (s1, p1) in zip(points, points[1:]):
            if step <= s1:
                return p0 + (p1 - p0) * (step - s0) / (s1 - s0)
        return total


def read_records(dump_folder: str | os.PathLike) -> list[RunRecord]:
    """The run records of a dump folder, oldest first; a record that cannot be read is skipped with a warning (it
    only informs the accounting)."""
    records = []
    for path in sorted(Path(dump_folder, RECORDS_FOLDER).glob("run-*.json")):
        try:
            raw = json.loads(path.read_text())
            raw["productive_at"] = {int(step): value for step, value in raw.get("productive_at", {}).items()}
            records.append(RunRecord(**raw))
        except (OSError, ValueError, TypeError) as err:
            logger.warning(f"goodput: {path} cannot be read ({err}); it is left out of the accounting")
    return sorted(records, key=lambda record: record.start)


def job_goodput(records: list[RunRecord]) -> dict[str, float]:
    """The job-level account of a dump folder's runs: seconds per category (JOB_CATEGORIES), `wall_s`,
    `lost_steps` and `goodput_pct`, the share of the wall time whose steps' updates stand.

    A run's steps past the step the next run resumed from are redone: their productive time becomes `lost`. The
    gap between a run that did not end cleanly (crashed, killed, failed) and the next run, and every later run's
    start-up (building, loading the checkpoint), are `restart`. The gap after a finished or preempted run is not
    the job's time (nothing was running by intent), so it is not in `wall_s`."""
    totals = dict.fromkeys(JOB_CATEGORIES, 0.0)
    wall = lost_steps = 0.0
    for i, record in enumerate(records):
        wall += record.end - record.start
        for category, seconds in record.seconds.items():
            totals["restart" if category == "startup" and i > 0 else category] += seconds
        if i + 1 == len(records):
            continue
        resumed_from = records[i + 1].first_step
        lost = record.seconds["productive"] - record.productive_until(resumed_from)
        totals["productive"] -= lost
        totals["lost"] += lost
        lost_steps += max(0, record.last_step - max(resumed_from, record.first_step))
        if record.ended not in CLEAN_ENDS:
            gap = max(0.0, records[i + 1].start - record.end)
            totals["restart"] += gap
            wall += gap
    return {**{f"{category}_s": seconds for category, seconds in totals.items()}, "wall_s": wall,
            "lost_steps": lost_steps, "goodput_pct": 100 * totals["productive"] / wall if wall > 0 else 0.0}


class Goodput:
    """This run's accounting: every second of the process's wall time goes to one RUN_CATEGORIES entry.

    `stalls` is the checkpoint manager's `blocked_s` list (its appends and in-place additions are read at each
    mark): time a checkpoint kept the loop waiting inside another part (the optimizer step waiting for an async
    save's copy) moves from that part to `checkpoint`."""

    def __init__(self, dump_folder: str, write_records: bool, stalls: list[float], start: float | None = None,
                 clock: Callable[[], float] = time.time):
        self._folder = Path(dump_folder, RECORDS_FOLDER)
        self.writes_records = write_records
        self._clock = clock
        self._stalls = stalls
        self._stalls_seen = 0.0
        self._saves_seen = 0
        self.run = RunRecord(start=start if start is not None else process_start_time(), end=0.0, first_step=0,
                             last_step=0)
        self._path = self._folder / f"run-{self.run.start:.3f}-{os.getpid()}.json"
        self._mark = self.run.start
        self._earlier: list[RunRecord] = []
        self._first_step_s: float | None = None
        self._steady: list[float] = []

    def begin(self, step: int) -> None:
        """The training loop starts at `step` (0, or the step a checkpoint resumed): start-up ends here."""
        if self.writes_records:
            self._earlier = read_records(self._folder.parent)
        self.run.first_step = self.run.last_step = step
        self.add("startup")

    def healed(self, step: int) -> None:
        """This group's state was replaced by a live replica group's state of `step` (torchft healing). The steps up
        to `step` stand: this group's earlier runs committed theirs with the quorum, and the others did the rest
        without it. So, unlike a resume from an older checkpoint, no step of the folder's earlier runs is redone:
        on the run's first step, the run starts at `step` (an earlier run's steps after its own checkpoint are not
        lost); later (a group that hung and fell behind), the steps it skipped add no productive time. The time to
        here (start-up, the transfer) is start-up, hence restart time for any run but the folder's first."""
        if self.run.last_step == self.run.first_step:
            self.run.first_step = step
        else:
            productive = self.run.seconds["productive"]
            self.run.productive_at.update({self.run.last_step: productive, step: productive})
        self.run.last_step = step
        self.add("startup")

    def add(self, category: str, step: int | None = None) -> float:
        """Attribute the time since the last mark to `category`; returns the seconds attributed to it. For
        "checkpoint", `step` is the step whose save the time covered, if one was written."""
        now = self._clock()
        elapsed, self._mark = max(0.0, now - self._mark), now
        stalls = sum(self._stalls)
        stalled, self._stalls_seen = stalls - self._stalls_seen, stalls
        moved = elapsed if category == "checkpoint" else min(stalled, elapsed)
        self.run.seconds["checkpoint"] += moved
        if category == "checkpoint":
            if len(self._stalls) > self._saves_seen and step is not None:
                # A save was written: a later run resuming from it redoes nothing before it.
                self.run.productive_at[step] = self.run.seconds["productive"]
            self._saves_seen = len(self._stalls)
            return elapsed
        self.run.seconds[category] += elapsed - moved
        return elapsed - moved

    def add_step(self, step: int, applied: bool) -> None:
        """The step just finished: productive if its update was applied, else skipped. The first step's excess over
        the steady step time (the median of the next steps) is compilation and lazy initialisation: start-up."""
        seconds = self.add("productive" if applied else "skipped")
        self.run.last_step = step
        if self._first_step_s is None:
            self._first_step_s = seconds if applied else 0.0
        elif applied and len(self._steady) < _STEADY_SAMPLE:
            self._steady.append(seconds)

    def _compile_s(self) -> float:
        if self._first_step_s is None or not self._steady:
            return 0.0
        return max(0.0, self._first_step_s - statistics.median(self._steady))

    def snapshot(self, ended: str = "") -> dict[str, float]:
        """Bring the record up to now (written to the dump folder on the recording rank) and return the job's
        account so far (`job_goodput`)."""
        self.add("other")
        self.run.end = self._mark
        self.run.ended = ended
        compile_s = self._compile_s()
        seconds = {**self.run.seconds, "productive": self.run.seconds["productive"] - compile_s,
                   "startup": self.run.seconds["startup"] + compile_s}
        productive_at = {step: max(0.0, value - compile_s) for step, value in self.run.productive_at.items()}
        current = RunRecord(**{**asdict(self.run), "seconds": seconds, "productive_at": productive_at})
        if self.writes_records:
            self._folder.mkdir(parents=True, exist_ok=True)
            with atomic_write(self._path) as f:
                f.write(json.dumps(asdict(current)) + "\n")
        return job_goodput([*self._earlier, current])

    @property
    def runs(self) -> int:
        return len(self._earlier) + 1


def goodput_metrics(account: dict[str, float]) -> dict[str, float]:
    """The metrics record of a job account: `goodput_pct` on the console, the rest (`goodput/<category>_s`,
    `goodput/wall_s`, `goodput/lost_steps`) in metrics.jsonl, TensorBoard and W&B only."""
    return {"goodput_pct": account["goodput_pct"],
            **{f"goodput/{key}": value for key, value in account.items() if key != "goodput_pct"}}


def goodput_summary(account: dict[str, float], runs: int) -> str:
    parts = ", ".join(f"{category} {account[f'{category}_s']:.1f} s" for category in JOB_CATEGORIES
                      if category != "productive")
    lost = f" ({int(account['lost_steps'])} steps redone)" if account["lost_steps"] else ""
    return (f"Goodput {account['goodput_pct']:.1f}%: {account['productive_s']:.1f} s of {account['wall_s']:.1f} s "
            f"wall time ({runs} run{'s' if runs > 1 else ''} of this dump folder) trained the model; {parts}{lost}")


# ------------------------------------------------------------------------------------------------------------------
# Spikes and bad steps


class RunningStats:
    """Mean and standard deviation of the last `window` accepted values."""

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self.values.append(value)

    def sigmas_above(self, value: float) -> float:
        """How many standard deviations `value` lies above the mean (0 when the values do not vary)."""
        mean = statistics.fmean(self.values)
        std = statistics.pstdev(self.values, mean)
        return (value - mean) / std if std > 0 else 0.0


class SpikeGuard:
    """Decides, from the step's global loss and gradient norm (the same numbers on every rank, so every rank takes
    the same decision without a collective), whether the update is dropped."""

    def __init__(self, config: HealthConfig):
        self.config = config
        self.loss = RunningStats(config.spike_window)
        self.grad_norm = RunningStats(config.spike_window)
        self.in_a_row = 0
        self.skipped = 0

    def skip_update(self, step: int, loss: float, grad_norm: float, nonfinite: bool) -> bool:
        reason = "non-finite loss or gradient norm" if nonfinite else self._spike(loss, grad_norm)
        if reason is None:
            self.in_a_row = 0
            self.loss.add(loss)
            self.grad_norm.add(grad_norm)
            return False
        self.in_a_row += 1
        self.skipped += 1
        policy = "debug.on_nonfinite = skip" if nonfinite else f"health.spike_sigma = {self.config.spike_sigma:g}"
        limit = self.config.max_skipped_in_a_row
        if limit and self.in_a_row >= limit:
            raise TrainingDiverged(
                f"step {step}: {reason}; {self.in_a_row} updates in a row were skipped (health.max_skipped_in_a_row "
                f"= {limit}), so training stopped before this update. The run diverged: resume from an earlier "
                f"checkpoint with a lower optimizer.lr or a longer warm-up, or check the data of these steps")
        logger.warning(f"step {step}: {reason}; update skipped ({policy}; {self.in_a_row} in a row, "
                       f"{self.skipped} in this run)")
        return True

    def _spike(self, loss: float, grad_norm: float) -> str | None:
        sigma = self.config.spike_sigma
        # Before `spike_warmup` accepted steps the statistics describe too few steps (and the fastest-moving ones).
        if sigma <= 0 or len(self.loss.values) < max(self.config.spike_warmup, 2):
            return None
        for name, value, stats in (("loss", loss, self.loss), ("gradient norm", grad_norm, self.grad_norm)):
            above = stats.sigmas_above(value)
            if above > sigma:
                return (f"{name} {value:.4g} is {above:.1f} standard deviations above the mean "
                        f"{statistics.fmean(stats.values):.4g} of the last {len(stats.values)} accepted steps")
        return None


# ------------------------------------------------------------------------------------------------------------------
# Stragglers


@dataclass
class StragglerReport:
    times: list[float]
    median: float
    slow: dict[int, int]  # rank -> checks in a row above the factor

    def metrics(self) -> dict[str, float]:
        slowest = max(range(len(self.times)), key=self.times.__getitem__)
        return {"stragglers/step_time_median_s": self.median, "stragglers/step_time_max_s": self.times[slowest],
                "stragglers/step_time_min_s": min(self.times), "stragglers/slowest_rank": slowest,
                "stragglers/slowest_ratio": self.times[slowest] / self.median if self.median > 0 else 0.0}


def find_stragglers(times: list[float], factor: float, slow_before: dict[int, int]) -> StragglerReport:
    """The ranks whose time is above `factor` x the median, with how many checks in a row each has been. The median
    is the lower one: with two ranks, the faster's time, against which the other is measured."""
    median = statistics.median_low(times)
    slow = {rank: slow_before.get(rank, 0) + 1 for rank, t in enumerate(times) if median > 0 and t > factor * median}
    return StragglerReport(times, median, slow)


class StragglerMonitor:
    """Each rank's own time per step: the period from one step's first collective to the next, less the time it
    waited in that collective for its peers. A rank whose input pipeline, host or step-end work (optimizer,
    checkpoint, garbage collection) is slower arrives last at that collective and has the longest own time."""

    def __init__(self, config: HealthConfig, device: torch.device):
        self.config = config
        self.device = device
        self._synced: float | None = None  # when this rank left the last step's first collective
        self._own = 0.0
        self._steps = 0
        self._slow: dict[int, int] = {}
        self._hosts: list[str] | None = None

    @contextlib.contextmanager
    def waiting_for_peers(self) -> Iterator[None]:
        if self.config.straggler_interval <= 0:
            yield
            return
        entered = time.perf_counter()
        yield
        if self.device.type != "cpu":
            # Collectives on an accelerator return before they complete: the wait is only seen once they do.
            torch.accelerator.synchronize(self.device)
        left = time.perf_counter()
        if self._synced is not None:
            self._own += entered - self._synced
            self._steps += 1
        self._synced = left

    def step_end(self, step: int) -> StragglerReport | None:
        """Every `straggler_interval` steps: share the mean own step time (one all_gather), name stragglers."""
        interval = self.config.straggler_interval
        if interval <= 0 or step % interval or self._steps == 0:
            return None
        mine = torch.tensor([self._own / self._steps], dtype=torch.float64, device=self.device)
        gathered = torch.empty(dist.get_world_size(), dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(gathered, mine)
        self._own, self._steps = 0.0, 0
        if self._hosts is None:
            # Once per run: the host names, for the warning.
            self._hosts = [""] * dist.get_world_size()
            dist.all_gather_object(self._hosts, socket.gethostname())
        report = find_stragglers(gathered.tolist(), self.config.straggler_factor, self._slow)
        self._slow = report.slow
        if dist.get_rank() == 0:
            for rank, checks in report.slow.items():
                if checks >= self.config.straggler_patience:
                    logger.warning(
                        f"straggler: rank {rank} on host {self._hosts[rank]} took {report.times[rank]:.3f} s per step "
                        f"of its own work, {report.times[rank] / report.median:.1f}x the median {report.median:.3f} s "
                        f"of {len(report.times)} ranks, for {checks} checks in a row (every "
                        f"{interval} steps; health.straggler_factor = {self.config.straggler_factor:g}); every rank "
                        f"waits for it")
        return report


# ------------------------------------------------------------------------------------------------------------------
# The trainer's one object


class Health:
    """Goodput, spike guard and straggler monitor of one rank (see the module docstring for the hooks)."""

    def __init__(self, config: HealthConfig, dump_folder: str, rank: int, device: torch.device,
                 checkpoint_stalls: list[float]):
        self.goodput = Goodput(dump_folder, write_records=rank == 0, stalls=checkpoint_stalls)
        self.guard = SpikeGuard(config)
        self.stragglers = StragglerMonitor(config, device)
        self._applied = True
        # Skipped steps run again (health.rerun_bad_steps), by verdict.
        self.reruns = {"reproducible": 0, "not_reproducible": 0}

    def begin(self, step: int) -> None:
        self.goodput.begin(step)

    @contextlib.contextmanager
    def timed(self, category: str, step: int | None = None) -> Iterator[None]:
        """Time inside goes to `category` ("step": productive or skipped, as the step's update went; "checkpoint"
        with `step`: a save of that step, if one was written), time since the last mark to "other"."""
        self.goodput.add("other")
        yield
        if category == "step":
            self.goodput.add_step(step, self._applied)
        else:
            saves = len(self.goodput.run.productive_at)
            self.goodput.add(category, step)
            if len(self.goodput.run.productive_at) > saves:
                # Recorded at once: a run killed before its next logged step must still say what this save kept.
                self.goodput.snapshot()

    def skip_update(self, step: int, loss: float, grad_norm: float, nonfinite: bool) -> bool:
        self._applied = not self.guard.skip_update(step, loss, grad_norm, nonfinite)
        return not self._applied

    def rerun_verdict(self, step: int, first: tuple[float, float], rerun: tuple[float, float]) -> bool:
        """Whether the re-run of a skipped step, from the same weights on the same inputs, gave the first run's
        (loss, gradient norm) bit for bit (NaN counts as equal to NaN); logged and counted either way."""
        reproducible = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(first, rerun))
        self.reruns["reproducible" if reproducible else "not_reproducible"] += 1
        figures = f"loss {first[0]:.9g}, gradient norm {first[1]:.9g}"
        if reproducible:
            logger.warning(f"step {step}: re-run on the same inputs from the same weights: reproducible ({figures} "
                           f"again, bit for bit): a real divergence (the data or the numerics of this step), not a "
                           f"hardware fault (health.rerun_bad_steps)")
        else:
            logger.warning(f"step {step}: re-run on the same inputs from the same weights: not reproducible (first "
                           f"{figures}; re-run loss {rerun[0]:.9g}, gradient norm {rerun[1]:.9g}): suspect a hardware "
                           f"or other non-deterministic fault on some rank (check the hosts: ECC errors, GPU health, "
                           f"dmesg) (health.rerun_bad_steps)")
        return reproducible

    def mark(self) -> None:
        """The time since the last mark was "other" (before a part timed by its end, such as the quorum)."""
        self.goodput.add("other")

    def quorum_formed(self, healed_to: int | None) -> None:
        """The step's quorum of replica groups formed (torchft). The time since the last mark was the wait for it:
        milliseconds a step while the groups are live, the heartbeat and join timeouts of the lighthouse after one
        failed (what its failure costs the others), "quorum_wait"; or, if this group was behind and received a live
        group's state of step `healed_to`, healing (start-up)."""
        if healed_to is None:
            self.goodput.add("quorum_wait")
        else:
            self.goodput.healed(healed_to)

    def not_committed(self) -> None:
        """The replica groups' quorum did not commit this step (torchft): its time is skipped, not productive."""
        self._applied = False

    def healed(self, step: int) -> None:
        self.goodput.healed(step)

    def waiting_for_peers(self):
        return self.stragglers.waiting_for_peers()

    def step_end(self, step: int) -> dict[str, float]:
        """The straggler check's metrics on the steps it runs (else empty)."""
        report = self.stragglers.step_end(step)
        return report.metrics() if report is not None else {}

    def metrics(self) -> dict[str, float]:
        """The goodput metrics so far (also updates the run's record)."""
        return {**goodput_metrics(self.goodput.snapshot()), "health/skipped_steps": self.guard.skipped,
                **{f"health/reruns_{verdict}": count for verdict, count in self.reruns.items()}}

    def finish(self, ended: str) -> None:
        """At the end of the run (finished or preempted): the final record and, on rank 0, the summary line."""
        account = self.goodput.snapshot(ended)
        if self.goodput.writes_records:
            logger.info(goodput_summary(account, self.goodput.runs))
