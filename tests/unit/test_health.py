"""Goodput accounting, the spike guard's statistics and decisions, and the straggler rule (components/health.py);
single process, with a fake clock."""

import json
import logging
import math
import statistics
import time

import pytest
import torch

from torchtitan.components.health import (JOB_CATEGORIES, Goodput, Health, RunningStats, RunRecord,
                                          SpikeGuard, TrainingDiverged, find_stragglers, goodput_summary, job_goodput,
                                          read_records)
from torchtitan.components.metrics import MetricsLogger
from torchtitan.config import parse_args
from torchtitan.config.job_config import Health as HealthConfig, Metrics
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def account_sums_to_wall(account: dict[str, float]) -> None:
    total = sum(account[f"{category}_s"] for category in JOB_CATEGORIES)
    assert total == pytest.approx(account["wall_s"], abs=1e-9)


# ------------------------------------------------------------------------------------------------------------------
# Goodput of one run


def run_steps(goodput: Goodput, clock: Clock, steps: range, step_s: float, data_s: float = 0.0,
              stalls: list[float] | None = None, save_every: int = 0, skipped: tuple[int, ...] = ()) -> None:
    for step in steps:
        clock.advance(data_s)
        goodput.add("data")
        clock.advance(step_s)
        goodput.add_step(step, applied=step not in skipped)
        if save_every and step % save_every == 0:
            clock.advance(0.5)
            stalls.append(0.5)
            goodput.add("checkpoint", step)


def test_one_run_attributes_every_second(tmp_path):
    """Start-up 10 s; step 1 takes 4 s (3 s of it compilation), steps 2-10 1 s each plus 0.25 s of data; a save
    every 5 steps blocks 0.5 s; an async save's copy makes step 7 wait 0.2 s inside the step; step 9 is skipped."""
    clock, stalls = Clock(), []
    goodput = Goodput(str(tmp_path), write_records=True, stalls=stalls, start=990.0, clock=clock)
    goodput.begin(0)
    clock.advance(0.25)
    goodput.add("data")
    clock.advance(4.0)
    goodput.add_step(1, applied=True)
    run_steps(goodput, clock, range(2, 7), 1.0, 0.25, stalls, save_every=5)
    clock.advance(0.25)
    goodput.add("data")
    clock.advance(1.2)
    stalls[-1] += 0.2  # the checkpoint manager adds the optimizer's wait to the last save's blocked time
    goodput.add_step(7, applied=True)
    run_steps(goodput, clock, range(8, 11), 1.0, 0.25, stalls, save_every=5, skipped=(9,))
    clock.advance(0.1)
    account = goodput.snapshot("finished")

    assert account["wall_s"] == pytest.approx(1000.0 + 10 * 0.25 + 4.0 + 9 * 1.0 + 0.2 + 2 * 0.5 + 0.1 - 990.0)
    assert account["startup_s"] == pytest.approx(10.0 + 3.0)
    # Step 1's steady second and steps 2-10 but the skipped step 9 (step 7's wait for the copy is the checkpoint's).
    assert account["productive_s"] == pytest.approx(1.0 + 8 * 1.0)
    assert account["skipped_s"] == pytest.approx(1.0)
    assert account["data_s"] == pytest.approx(10 * 0.25)
    assert account["checkpoint_s"] == pytest.approx(2 * 0.5 + 0.2)
    assert account["other_s"] == pytest.approx(0.1)
    assert account["lost_s"] == account["restart_s"] == 0.0
    account_sums_to_wall(account)
    assert account["goodput_pct"] == pytest.approx(100 * 9.0 / account["wall_s"])

    (record,) = read_records(tmp_path)
    assert (record.first_step, record.last_step, record.ended) == (0, 10, "finished")
    # Productive seconds by the save of step 5: steps 1-5 (step 1 without its compilation).
    assert record.productive_at == {5: pytest.approx(5.0), 10: pytest.approx(9.0)}
    assert "Goodput" in goodput_summary(account, 1) and "startup 13.0 s" in goodput_summary(account, 1)


# ------------------------------------------------------------------------------------------------------------------
# Goodput across runs


def record(start: float, end: float, first: int, last: int, productive: float, saves: dict[int, float],
           ended: str = "", startup: float = 0.0) -> RunRecord:
    seconds = dict.fromkeys(("productive", "startup", "checkpoint", "data", "validation", "skipped", "other"), 0.0)
    seconds.update(productive=productive, startup=startup, other=end - start - productive - startup)
    return RunRecord(start, end, first, last, seconds, saves, ended)


def test_a_crash_loses_the_steps_after_the_checkpoint_and_the_gap_is_restart_time():
    """Run 1: steps 1-7 at 1 s each, saved at step 4, killed; the restart begins 20 s later and resumes from step
    4: steps 5-7 are redone (3 s lost); the 20 s gap and the second run's start-up (5 s) are restart time."""
    first = record(0.0, 17.0, 0, 7, 7.0, {4: 4.0}, ended="", startup=10.0)
    second = record(37.0, 50.0, 4, 10, 6.0, {}, ended="finished", startup=5.0)
    account = job_goodput([first, second])
    assert account["lost_steps"] == 3
    assert account["lost_s"] == pytest.approx(3.0)
    assert account["productive_s"] == pytest.approx(7.0 + 6.0 - 3.0)
    assert account["restart_s"] == pytest.approx(20.0 + 5.0)
    assert account["startup_s"] == pytest.approx(10.0)
    assert account["wall_s"] == pytest.approx(50.0)
    account_sums_to_wall(account)


def test_after_a_preemption_the_time_off_is_not_the_jobs():
    """A preempted run saved its last step: nothing is redone, and the hour in the queue is not wall time."""
    first = record(0.0, 20.0, 0, 10, 10.0, {10: 10.0}, ended="preempted")
    second = record(3620.0, 3640.0, 10, 20, 10.0, {}, ended="finished", startup=4.0)
    account = job_goodput([first, second])
    assert (account["lost_steps"], account["lost_s"]) == (0, 0.0)
    assert account["restart_s"] == pytest.approx(4.0)
    assert account["wall_s"] == pytest.approx(40.0)
    account_sums_to_wall(account)


def test_productive_until_interpolates_between_known_points():
    run = record(0.0, 10.0, 2, 10, 8.0, {6: 3.0})
    assert [run.productive_until(step) for step in (0, 2, 4, 6, 8, 10, 12)] == \
        [0.0, 0.0, 1.5, 3.0, 5.5, 8.0, 8.0]


def test_a_later_run_reads_the_earlier_records(tmp_path):
    """The second Goodput of a folder (a restart) counts the first's redone steps as lost, from its file."""
    clock = Clock(0.0)
    first = Goodput(str(tmp_path), write_records=True, stalls=(stalls := []), start=0.0, clock=clock)
    clock.advance(2.0)
    first.begin(0)
    run_steps(first, clock, range(1, 7), 1.0, stalls=stalls, save_every=4)
    first.snapshot()  # the last record before the kill (ended stays "")
    clock.advance(3.0)
    second = Goodput(str(tmp_path), write_records=True, stalls=[], start=clock.now, clock=clock)
    clock.advance(2.0)
    second.begin(4)
    run_steps(second, clock, range(5, 9), 1.0)
    account = second.snapshot("finished")
    assert second.runs == 2 and len(read_records(tmp_path)) == 2
    assert account["lost_steps"] == 2 and account["lost_s"] == pytest.approx(2.0)
    assert account["restart_s"] == pytest.approx(3.0 + 2.0)
    assert account["productive_s"] == pytest.approx(8.0)
    account_sums_to_wall(account)


def test_an_unreadable_record_is_left_out_with_a_warning(tmp_path):
    folder = tmp_path / "health"
    folder.mkdir()
    (folder / "run-1.000-1.json").write_text("{not json")
    (folder / "run-2.000-1.json").write_text(json.dumps(record(2.0, 3.0, 0, 1, 1.0, {}).__dict__))
    messages = []
    handler = logging.Handler()
    handler.emit = lambda r: messages.append(r.getMessage())
    logger.addHandler(handler)
    try:
        records = read_records(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert [r.start for r in records] == [2.0]
    assert any("run-1.000-1.json cannot be read" in m for m in messages)


# ------------------------------------------------------------------------------------------------------------------
# Spike guard


def test_running_stats_measure_standard_deviations_above_the_mean():
    stats = RunningStats(window=4)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):  # the window keeps the last four
        stats.add(value)
    mean, std = 3.5, statistics.pstdev([2.0, 3.0, 4.0, 5.0])
    assert stats.sigmas_above(8.0) == pytest.approx((8.0 - mean) / std)
    assert stats.sigmas_above(2.0) < 0
    flat = RunningStats(window=3)
    for _ in range(3):
        flat.add(1.0)
    assert flat.sigmas_above(1.5) == 0.0  # no variation: no scale to judge by


def guard(**options) -> SpikeGuard:
    return SpikeGuard(HealthConfig(**{"spike_sigma": 4.0, "spike_window": 8, "spike_warmup": 4, **options}))


def test_spike_guard_waits_for_warmup_then_skips_spikes_of_loss_or_grad_norm():
    g = guard()
    # During warm-up nothing is judged, however large.
    assert [g.skip_update(s, loss, 1.0, False) for s, loss in enumerate([10.0, 9.0, 50.0, 9.5], 1)] == [False] * 4
    losses = list(g.loss.values)
    mean, std = statistics.fmean(losses), statistics.pstdev(losses)
    just_below, just_above = mean + 3.99 * std, mean + 4.01 * std
    assert g.skip_update(5, just_above, 1.0, False)
    assert list(g.loss.values) == losses, "a skipped step must not enter the statistics"
    assert not g.skip_update(6, just_below, 1.0, False)
    assert g.in_a_row == 0 and g.skipped == 1
    # The gradient norm is judged alike (its values were all 1.0 so far: add some spread first).
    for step, norm in enumerate([1.1, 0.9, 1.0], 7):
        assert not g.skip_update(step, mean, norm, False)
    assert g.skip_update(10, mean, 100.0, False)


def test_spike_guard_stops_after_max_skipped_in_a_row():
    g = guard(max_skipped_in_a_row=3)
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0], 1):
        g.skip_update(step, loss, 1.0, False)
    assert g.skip_update(5, 100.0, 1.0, False)
    assert not g.skip_update(6, 2.0, 1.0, False)  # resets the count in a row
    assert g.skip_update(7, 100.0, 1.0, False)
    assert g.skip_update(8, math.nan, math.nan, True)  # non-finite (debug.on_nonfinite = skip) counts too
    with pytest.raises(TrainingDiverged, match=r"step 9: loss 100 is .* 3 updates in a row were skipped "
                                               r"\(health.max_skipped_in_a_row = 3\)"):
        g.skip_update(9, 100.0, 1.0, False)


def test_nonfinite_is_skipped_with_the_guard_off_and_never_stops_with_limit_zero():
    g = guard(spike_sigma=0.0, max_skipped_in_a_row=0)
    assert all(g.skip_update(step, math.inf, 1.0, True) for step in range(1, 20))
    assert g.skipped == 19
    assert not g.skip_update(20, 1e9, 1e9, False)  # spike_sigma = 0: no spike judged


# ------------------------------------------------------------------------------------------------------------------
# Stragglers


def test_straggler_rule_uses_the_lower_median_and_counts_checks_in_a_row():
    report = find_stragglers([0.10, 0.30], 1.5, {})
    assert report.median == 0.10 and report.slow == {1: 1}
    report = find_stragglers([0.10, 0.31], 1.5, report.slow)
    assert report.slow == {1: 2}
    assert find_stragglers([0.10, 0.14], 1.5, report.slow).slow == {}  # back under the factor: the count restarts
    # Eight ranks, one 2x slower: the median is the others' time.
    times = [0.1] * 7 + [0.2]
    report = find_stragglers(times, 1.5, {})
    assert report.slow == {7: 1}
    assert report.metrics() == {"stragglers/step_time_median_s": 0.1, "stragglers/step_time_max_s": 0.2,
                                "stragglers/step_time_min_s": 0.1, "stragglers/slowest_rank": 7,
                                "stragglers/slowest_ratio": 2.0}


# ------------------------------------------------------------------------------------------------------------------
# Options and the console


@pytest.mark.parametrize("option,value,message", [
    ("health.straggler_factor", "1.0", "option health.straggler_factor: 1.0 must be above 1"),
    ("health.spike_sigma", "-1", "option health.spike_sigma: -1.0 must not be negative"),
    ("health.spike_window", "0", "option health.spike_window: 0 must be a positive integer"),
])
def test_bad_health_options_are_one_error_naming_them(option, value, message):
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        parse_args([f"--{option}", value])


def test_console_line_leaves_out_grouped_keys(tmp_path):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda r: messages.append(r.getMessage())
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    metrics = MetricsLogger(Metrics(disable_color_printing=True), str(tmp_path), 0, is_logging_rank=True)
    try:
        metrics.log(1, {"loss": 2.0, "goodput_pct": 42.0, "goodput/lost_s": 1.0})
        metrics.log(2, {"stragglers/slowest_rank": 1})
    finally:
        metrics.close()
        logger.removeHandler(handler)
        logger.setLevel(previous)
    assert messages == ["step:   1  loss:  2.0000  goodput: 42.0%"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["goodput/lost_s"] == 1.0 and rows[1]["stragglers/slowest_rank"] == 1


def test_a_group_healed_from_a_peer_redoes_nothing(tmp_path):
    """Replica groups (torchft): run 1 trains steps 1-6 (saved at 4) with its peers and is killed; run 2 loads the
    checkpoint of step 4, then at its first quorum takes a live group's state of step 20 (3 s: start-up too) and
    trains steps 21-24. Steps 5-6 were not redone (the peers went on from them): nothing is lost; the gap, run 2's
    start-up and the transfer are restart time."""
    clock = Clock(0.0)
    first = Goodput(str(tmp_path), write_records=True, stalls=(stalls := []), start=0.0, clock=clock)
    clock.advance(2.0)
    first.begin(0)
    run_steps(first, clock, range(1, 7), 1.0, stalls=stalls, save_every=4)
    first.snapshot()
    clock.advance(3.0)
    second = Goodput(str(tmp_path), write_records=True, stalls=[], start=clock.now, clock=clock)
    clock.advance(2.0)
    second.begin(4)
    clock.advance(3.0)
    second.healed(20)
    run_steps(second, clock, range(21, 25), 1.0)
    account = second.snapshot("finished")
    assert (account["lost_steps"], account["lost_s"]) == (0, 0.0)
    assert account["productive_s"] == pytest.approx(6.0 + 4.0)
    assert account["restart_s"] == pytest.approx(3.0 + 2.0 + 3.0)
    assert [record.first_step for record in read_records(tmp_path)] == [0, 20]
    account_sums_to_wall(account)


def test_a_group_that_fell_behind_and_healed_did_no_work_for_the_steps_it_skipped():
    """A group hangs after step 5 and heals to step 12 in the same run (2 s): steps 6-12 took this run no productive
    time, so a later run resuming anywhere in 5-12 loses none of them; the transfer is start-up."""
    clock = Clock(0.0)
    goodput = Goodput("unused", write_records=False, stalls=[], start=0.0, clock=clock)
    goodput.begin(0)
    run_steps(goodput, clock, range(1, 6), 1.0)
    clock.advance(2.0)
    goodput.healed(12)
    run_steps(goodput, clock, range(13, 16), 1.0)
    goodput.snapshot()
    run = goodput.run
    assert (run.first_step, run.last_step) == (0, 15)
    assert [run.productive_until(step) for step in (5, 8, 12, 14, 15)] == [5.0, 5.0, 5.0, 7.0, 8.0]
    assert run.seconds["startup"] == pytest.approx(2.0)


def test_a_step_the_quorum_did_not_commit_is_skipped_time(tmp_path):
    health = Health(HealthConfig(), str(tmp_path), rank=1, device=torch.device("cpu"), checkpoint_stalls=[])
    health.begin(0)
    with health.timed("step", 1):
        health.not_committed()
        time.sleep(0.01)
    assert health.goodput.run.seconds["skipped"] >= 0.01 and health.goodput.run.seconds["productive"] == 0.0


def test_a_replica_groups_wait_for_the_quorum_is_its_own_category(tmp_path):
    """The time from a step's end to its quorum is the wait for the other groups: milliseconds while they are live,
    the lighthouse's timeouts after one failed (8 s here, before step 3). It was booked as "other", where a failed
    group's cost to the survivors could not be told from logging. A quorum at which this group healed is
    start-up."""
    clock = Clock(0.0)
    health = Health(HealthConfig(), str(tmp_path), rank=1, device=torch.device("cpu"), checkpoint_stalls=[])
    health.goodput = Goodput("unused", write_records=False, stalls=[], start=0.0, clock=clock)
    health.begin(0)
    for step, wait_s in ((1, 0.01), (2, 0.01), (3, 8.0)):
        clock.advance(0.5)  # the previous step's end: logging
        health.mark()
        clock.advance(wait_s)
        health.quorum_formed(None)
        clock.advance(1.0)
        health.goodput.add_step(step, applied=True)
    health.mark()
    clock.advance(2.0)
    health.quorum_formed(10)
    account = health.goodput.snapshot()
    seconds = health.goodput.run.seconds
    assert seconds["quorum_wait"] == pytest.approx(8.02) and seconds["other"] == pytest.approx(1.5)
    assert seconds["startup"] == pytest.approx(2.0) and health.goodput.run.last_step == 10
    assert account["quorum_wait_s"] == pytest.approx(8.02)
    account_sums_to_wall(account)


# ------------------------------------------------------------------------------------------------------------------
# Re-running a skipped step


def run_with_faults(tmp_path, monkeypatch, faults: dict[int, str], options: list[str]) -> tuple[dict, list[dict]]:
    """A one-process run of the tiny model, 9 steps of 2 accumulated micro-batches, with
    tests/integration/fault_injection.py's faults (its patches of the Trainer undone after the run); returns the
    final model and optimizer state, and the metrics rows."""
    import torch.distributed.checkpoint as dcp

    from tests.integration import fault_injection
    from tests.integration.harness import TINY
    from torchtitan import train

    monkeypatch.delenv("FAULT_REPORT_DIR", raising=False)
    with monkeypatch.context() as patches:
        for owner, name in ((train.Trainer, "forward_backward"), (train.Trainer, "_next_batches"), (dcp, "save")):
            patches.setattr(owner, name, getattr(owner, name))
        fault_injection.install(faults)
        trainer = train.Trainer(parse_args([*TINY, "--training.steps", "9", "--training.local_batch_size", "2",
                                            "--training.global_batch_size", "4", "--job.dump_folder", str(tmp_path), "--health.spike_sigma", "5",
                                            "--health.spike_warmup", "3", *options]))
        try:
            trainer.train()
            state = {**trainer.checkpointer.model.state_dict(), **trainer.optimizers.state_dict()}
        finally:
            trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return state, rows


def test_a_skipped_step_is_rerun_to_tell_a_transient_fault_from_a_real_divergence(tmp_path, monkeypatch):
    """health.rerun_bad_steps: step 5's loss is multiplied by 100 once (the injector's `spike`, in the step's first
    micro-batch: its re-run computes the step as it should be, as after a transient hardware fault), step 7's in
    every micro-batch of every computation of the step (a `bad_batch`: the re-run reproduces it). Both updates are skipped; the re-run calls step 5 not reproducible and
    step 7 reproducible, in the log and the metrics. The re-runs change nothing: the final weights and optimizer
    state are bitwise those of the same run without them."""
    faults = {5: "spike", 7: "bad_batch"}
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger.addHandler(handler)
    try:
        rerun, rows = run_with_faults(tmp_path / "rerun", monkeypatch, faults, ["--health.rerun_bad_steps"])
    finally:
        logger.removeHandler(handler)
    plain, plain_rows = run_with_faults(tmp_path / "plain", monkeypatch, faults, [])
    verdicts = [line for line in warnings if "re-run on the same inputs" in line]
    assert len(verdicts) == 2, warnings
    assert verdicts[0].startswith("step 5: re-run on the same inputs from the same weights: not reproducible")
    assert verdicts[1].startswith("step 7: re-run on the same inputs from the same weights: reproducible")
    last = rows[-1]
    assert (last["health/skipped_steps"], last["health/reruns_reproducible"],
            last["health/reruns_not_reproducible"]) == (2, 1, 1), last
    assert plain_rows[-1]["health/skipped_steps"] == 2 and plain_rows[-1]["health/reruns_reproducible"] == 0
    assert rerun.keys() == plain.keys()
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(rerun[key], value), key


def test_rerun_bad_steps_is_refused_where_a_rerun_is_not_the_same_computation():
    # A compressed reduce-scatter's state is restored before the re-run (its reductions only stage it), and QSDP's
    # rounding draws from the values themselves: a re-run is the same computation
    # (tests/integration/test_fault_tolerance.py::test_a_skipped_step_leaves_the_compensation_state_as_it_was).
    for method in ("loco", "error_feedback", "qsdp"):
        parse_args(["--health.rerun_bad_steps", "--comm.gradient_compression", method])
    with pytest.raises(UserError, match=r"option health.rerun_bad_steps: does not compose with fault_tolerance.enable"):
        parse_args(["--health.rerun_bad_steps", "--fault_tolerance.enable", "--fault_tolerance.group_size", "2"])


def summary_worker(rank: int, out_dir: str) -> None:
    """The trainer's step summary on 2 gloo ranks that are FlexDeMo's 2 replicas, each with its own gradient norm."""
    import datetime
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    from torchtitan.train import Trainer  # imported by the test before the fork

    dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store", 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        trainer = SimpleNamespace(parallel_dims=SimpleNamespace(tp=1, world_size=2), device=torch.device("cpu"),
                                  preempt_requested=False, replica_gradients=True)
        loss, norm = torch.tensor(1.0 + rank), torch.tensor([3.0, 400.0][rank])
        torch.save({"summary": Trainer._summary(trainer, loss, norm)}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_flexdemo_replicas_judge_one_gradient_norm(tmp_path):
    """Under FlexDeMo each replica's gradient norm is its own (no gradient is all-reduced across replicas); the step
    summary gives every rank the same one, the replicas' root mean square sqrt((3^2 + 400^2) / 2), so that the spike
    guard's decision is the same on every rank (one replica skipping while the other stepped into FlexDeMo's
    exchange hung the run). The loss is the global sum, as before."""
    import torchtitan.train  # noqa: F401 (once, before the fork: each rank would import it again)
    from tests.unit.forked_ranks import run_ranks

    summaries = [result["summary"] for result in run_ranks(summary_worker, tmp_path, 2, 60, "summary")]
    assert summaries[0] == summaries[1]
    loss, norm, nonfinite, preempted = summaries[0]
    assert (loss, nonfinite, preempted) == (3.0, 0.0, 0.0)
    assert norm == pytest.approx(math.sqrt((3.0 ** 2 + 400.0 ** 2) / 2), rel=1e-6)
