"""Faults injected into real torchrun runs of the trainer: a worker killed (elastic restart), preemption by SIGTERM,
a NaN loss on one rank, a stalled rank, a rank that never joins.

The faults come from tests/integration/fault_injection.py, whose event files say which faults fired, which step each
rank finished and how each rank exited; every test counts the faults injected and checks each one was survived.
All runs: the tiny model, 2 processes with FSDP, 8 steps, fixed seed and data, so that losses compare exactly.
"""

import json
import math
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.integration.harness import TINY, launch, read_metrics
from torchtitan.components.checkpoint import read_metadata
from torchtitan.components.health import JOB_CATEGORIES, job_goodput, read_records

pytestmark = pytest.mark.integration

STEPS = 8
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
BASE = [*TINY, "--training.steps", str(STEPS), "--training.local_batch_size", "2", "--metrics.peak_flops", "1e12"]
INJECTOR = "tests.integration.fault_injection"
EXIT_NONFINITE, EXIT_COMM_FAILURE, EXIT_PREEMPTED = 3, 4, 143


def run(dump: Path, args: list[str], plan: str = "", timeout: int = 240, launcher_args: list[str] | None = None,
        **env):
    """One 2-process torchrun launch of the fault-injecting entry point."""
    return launch(dump, 2, [*BASE, *args], timeout=timeout, module=INJECTOR, launcher_args=launcher_args,
                  env={"FAULT_PLAN": plan, "FAULT_REPORT_DIR": str(dump), **env})


def events(dump: Path, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for path in sorted(dump.glob("events-rank*-attempt*.jsonl"))
            for line in path.read_text().splitlines()]
    return [row for row in rows if kind is None or row["event"] == kind]


def exit_codes(dump: Path, attempt: int = 0) -> dict[int, int]:
    return {row["rank"]: row["code"] for row in events(dump, "exit") if row["attempt"] == attempt}


def last_steps(dump: Path, attempt: int = 0) -> dict[int, int]:
    finished = {}
    for row in events(dump, "step"):
        if row["attempt"] == attempt:
            finished[row["rank"]] = max(finished.get(row["rank"], 0), row["step"])
    return finished


def final_losses(dump: Path) -> list[float]:
    """Per-step losses of a run spread over several launches or attempts: metrics.jsonl is appended to, so a step
    re-run after a resume appears again; its last row is the one the finished run stands on."""
    by_step = {row["step"]: row["loss"] for row in read_metrics(dump) if "loss" in row}
    assert sorted(by_step) == list(range(1, STEPS + 1)), f"steps logged: {sorted(by_step)}"
    return [by_step[step] for step in range(1, STEPS + 1)]


def assert_same_losses(actual: list[float], expected: list[float]) -> None:
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected))
    print(f"max relative loss difference to the uninterrupted run: {worst:.1e}")
    assert worst <= 1e-6, f"losses {actual} vs uninterrupted {expected}"


def checkpoint_steps(dump: Path) -> list[str]:
    folder = dump / "checkpoint"
    return sorted(entry.name for entry in folder.iterdir()) if folder.is_dir() else []


def rank_lines(output: str, rank: int, text: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"[rank{rank}]") and text in line]


def report_faults(what: str, injected: list[dict], survived: int) -> None:
    """The count of faults the injector recorded (its `inject` events) and how many the run survived or detected."""
    kinds = ", ".join(sorted({f"{event['kind']}@{event['step']}:{event['rank']}" for event in injected}))
    print(f"{what}: faults injected {len(injected)} ({kinds}), survived {survived}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    dump = tmp_path_factory.mktemp("uninterrupted")
    proc = run(dump, [*FSDP2, "--checkpoint.enable", "--checkpoint.interval", "2"])
    assert proc.returncode == 0, proc.stdout[-6000:]
    return final_losses(dump)


@pytest.mark.slow
def test_elastic_restart_after_sigkill_resumes_exactly(tmp_path, uninterrupted):
    """torchrun --max-restarts 2: rank 1 dies by SIGKILL in step 6 of the first attempt; the restarted group resumes
    from step-4 and ends on the uninterrupted run's losses. The goodput account of the two runs counts step 5 as
    redone (lost) and the time from the first run's last record to the second's first step as restart time."""
    proc = run(tmp_path, [*FSDP2, "--checkpoint.enable", "--checkpoint.interval", "2"], plan="sigkill@6:1",
               launcher_args=["--max-restarts", "2"], FAULT_ATTEMPT="0")
    assert proc.returncode == 0, proc.stdout[-6000:]
    injected = events(tmp_path, "inject")
    assert [(e["kind"], e["rank"], e["attempt"], e["step"]) for e in injected] == [("sigkill", 1, 0, 6)]
    assert exit_codes(tmp_path, attempt=1) == {0: 0, 1: 0}
    resumed = [e["step"] for e in events(tmp_path, "step") if e["attempt"] == 1]
    assert min(resumed) == 5, f"the restarted attempt ran steps {resumed}"
    assert len(rank_lines(proc.stdout, 0, "checkpoint/step-4 in")) == 1
    assert_same_losses(final_losses(tmp_path), uninterrupted)
    killed, restarted = read_records(tmp_path)
    assert (killed.first_step, killed.last_step, killed.ended) == (0, 5, "")
    assert (restarted.first_step, restarted.last_step, restarted.ended) == (4, STEPS, "finished")
    account = job_goodput([killed, restarted])
    assert account["lost_steps"] == 1 and account["lost_s"] > 0
    assert account["restart_s"] >= restarted.start - killed.end > 0
    assert sum(account[f"{category}_s"] for category in JOB_CATEGORIES) == pytest.approx(account["wall_s"])
    (summary,) = rank_lines(proc.stdout, 0, "Goodput")
    assert f"Goodput {account['goodput_pct']:.1f}%" in summary and "(2 runs of this dump folder)" in summary
    assert "(1 steps redone)" in summary
    report_faults("elastic restart", injected, survived=1)


def test_ctrl_c_stops_with_one_line_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT) mid-run: a warning naming the step instead of a KeyboardInterrupt traceback, exit 130."""
    proc = launch(tmp_path, 1, [*BASE, "--checkpoint.enable", "--checkpoint.interval", "2"], timeout=120,
                  module=INJECTOR, env={"FAULT_PLAN": "sigint@3:0"})
    assert proc.returncode == 128 + signal.SIGINT, proc.stdout[-6000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-6000:]
    assert "interrupted (SIGINT) during step 3; stopped without saving a checkpoint" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]


@pytest.mark.slow
def test_preemption_saves_and_a_relaunch_continues_exactly(tmp_path, uninterrupted):
    """SIGTERM twice, as a scheduler preempts: first to the workers alone (rank 0 only, so the ranks must agree on
    where to stop), then to the torchrun agent, which forwards it to every worker. Each time the workers finish
    the step, save a full checkpoint and exit 143; the next launch continues, and the three launches together
    give the uninterrupted run's losses."""
    args = [*FSDP2, "--checkpoint.enable", "--checkpoint.interval", "100"]
    stops = []
    injected = []
    for plan in ("sigterm@3:0", "sigterm_agent@6:1"):
        for stale in tmp_path.glob("events-*.jsonl"):
            stale.unlink()
        proc = run(tmp_path, args, plan=plan)
        injected += events(tmp_path, "inject")
        assert proc.returncode != 0, "torchrun must not report a preempted run as finished"
        assert len(events(tmp_path, "inject")) == 1, proc.stdout[-6000:]
        assert exit_codes(tmp_path) == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, proc.stdout[-6000:]
        stopped = set(last_steps(tmp_path).values())
        assert len(stopped) == 1, f"ranks stopped after different steps: {last_steps(tmp_path)}"
        stop = stopped.pop()
        assert checkpoint_steps(tmp_path) == sorted(f"step-{s}" for s in [*stops, stop])
        saved = {key.split(".")[0] for key in read_metadata(tmp_path / "checkpoint" / f"step-{stop}")
                 .state_dict_metadata}
        assert {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"} <= saved, saved
        stops.append(stop)
    # A signal to the worker itself is handled before that step's all-reduce; one through the agent arrives a
    # moment later, possibly after it.
    assert stops[0] == 3 and stops[1] in (6, 7), stops
    for stale in tmp_path.glob("events-*.jsonl"):
        stale.unlink()
    proc = run(tmp_path, args)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert min(e["step"] for e in events(tmp_path, "step")) == stops[1] + 1
    assert_same_losses(final_losses(tmp_path), uninterrupted)
    report_faults("preemption", injected, survived=len(stops))


@pytest.mark.slow
def test_kill_while_saving_resumes_from_the_previous_checkpoint(tmp_path):
    """One process killed after DCP wrote step-4 but before it was published: step-4.incomplete is never loaded;
    the next launch resumes from step-2, removes the leftover, and repeats steps 3-4 exactly."""
    args = [*BASE, "--checkpoint.enable", "--checkpoint.interval", "2"]
    env = {"FAULT_PLAN": "sigkill_in_save@4:0", "FAULT_REPORT_DIR": str(tmp_path)}
    proc = launch(tmp_path, 1, args, timeout=180, module=INJECTOR, env=env)
    assert proc.returncode == -9, proc.stdout[-6000:]
    assert [(e["kind"], e["step"]) for e in events(tmp_path, "inject")] == [("sigkill_in_save", 4)]
    assert checkpoint_steps(tmp_path) == ["step-2", "step-4.incomplete"]
    first = {row["step"]: row["loss"] for row in read_metrics(tmp_path)}
    proc = launch(tmp_path, 1, args, timeout=180, module=INJECTOR, env={"FAULT_REPORT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "checkpoint/step-2 in" in proc.stdout and "step-4.incomplete, left by an interrupted save" in proc.stdout
    assert checkpoint_steps(tmp_path) == ["step-2", "step-4", "step-6", "step-8"]
    assert final_losses(tmp_path)[2:4] == [first[3], first[4]]
    report_faults("kill during a checkpoint save", events(tmp_path, "inject"), survived=1)


@pytest.mark.slow  # the injected fault's detection runs by default in test_nonfinite_on_one_rank_is_skipped_by_every_rank
@pytest.mark.parametrize("kind", ["nan", "inf_grad"])
def test_nonfinite_on_one_rank_stops_every_rank(tmp_path, kind):
    """A NaN loss, or a finite loss with an infinite gradient, on rank 1 only: every rank stops before the update,
    and nothing non-finite is checkpointed."""
    proc = run(tmp_path, [*FSDP2, "--checkpoint.enable", "--checkpoint.interval", "1"], plan=f"{kind}@3:1")
    assert proc.returncode != 0
    assert [(e["kind"], e["rank"]) for e in events(tmp_path, "inject")] == [(kind, 1)]
    assert exit_codes(tmp_path) == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}, proc.stdout[-6000:]
    assert last_steps(tmp_path) == {0: 2, 1: 2}
    for rank in (0, 1):
        errors = rank_lines(proc.stdout, rank, "error:")
        assert len(errors) == 1 and "step 3: non-finite loss" in errors[0], proc.stdout[-6000:]
        assert not rank_lines(proc.stdout, rank, "Traceback")
    assert checkpoint_steps(tmp_path) == ["step-1", "step-2"]
    report_faults(f"non-finite ({kind}), stop", events(tmp_path, "inject"), survived=1)


@pytest.mark.parametrize("layout,kind", [("fsdp", "inf"), pytest.param("ddp", "nan", marks=pytest.mark.slow)])
def test_nonfinite_on_one_rank_is_skipped_by_every_rank(tmp_path, layout, kind):
    """With on_nonfinite = skip no rank applies the step-3 update: each rank's parameters are unchanged by it (under
    DDP every rank holds the whole model, so the ranks' parameters also stay identical to each other)."""
    degree = FSDP2 if layout == "fsdp" else ["--parallelism.data_parallel_replicate_degree", "2"]
    proc = run(tmp_path, [*degree, "--debug.on_nonfinite", "skip"], plan=f"{kind}@3:1")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert len(events(tmp_path, "inject")) == 1
    digests = {(e["rank"], e["step"]): e["digest"] for e in events(tmp_path, "step")}
    for rank in (0, 1):
        assert digests[rank, 3] == digests[rank, 2], f"rank {rank} applied the non-finite update"
        assert digests[rank, 4] != digests[rank, 3], f"rank {rank} stopped updating after the skipped step"
        assert len(rank_lines(proc.stdout, rank, "step 3: non-finite loss or gradient norm; update skipped")) == 1
    if layout == "ddp":
        for step in range(1, STEPS + 1):
            assert digests[0, step] == digests[1, step], f"replicas differ after step {step}"
    rows = {row["step"]: row["loss"] for row in read_metrics(tmp_path)}
    assert rows[3] == kind
    assert all(isinstance(rows[step], float) for step in range(4, STEPS + 1)), rows
    report_faults(f"non-finite ({kind}), skip ({layout})", events(tmp_path, "inject"), survived=1)


def test_spikes_are_skipped_by_every_rank_and_a_straggler_is_named(tmp_path):
    """One launch, two faults. Rank 0's data loading is 0.4 s slower every step: the straggler check (every 2 steps)
    names rank 0 and no other. Rank 1's loss is multiplied by 100 in steps 5, 7 and 8: the global loss is a spike
    (> 5 standard deviations over steps 1-4), so no rank applies those updates; step 6 is applied; the second skip
    in a row (step 8) stops every rank with one error line and exit code 3, before its update.

    With health.rerun_bad_steps, FSDP 2: the skipped steps 5 and 7 are run again. Step 5's spike is injected once
    (the re-run does not see it: not reproducible), step 7's in every computation of the step (a bad batch:
    reproducible); every rank says so, and the re-runs leave the weights as they were."""
    health = ["--health.spike_sigma", "5", "--health.spike_warmup", "4", "--health.max_skipped_in_a_row", "2",
              "--health.straggler_interval", "2", "--health.straggler_patience", "2", "--health.rerun_bad_steps"]
    proc = run(tmp_path, [*FSDP2, *health], plan="slow@1:0,spike@5:1,bad_batch@7:1,spike@8:1",
               FAULT_SLOW_SECONDS="0.4")
    assert exit_codes(tmp_path) == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}, proc.stdout[-6000:]
    digests = {(e["rank"], e["step"]): e["digest"] for e in events(tmp_path, "step")}
    assert last_steps(tmp_path) == {0: 7, 1: 7}
    for rank in (0, 1):
        assert digests[rank, 5] == digests[rank, 4], f"rank {rank} applied the spike of step 5"
        assert digests[rank, 6] != digests[rank, 5], f"rank {rank} did not apply step 6"
        assert digests[rank, 7] == digests[rank, 6], f"rank {rank} applied the spike of step 7"
        assert len(rank_lines(proc.stdout, rank, "step 5: loss")) == 1
        (error,) = rank_lines(proc.stdout, rank, "error:")
        assert "step 8: loss" in error and "(health.max_skipped_in_a_row = 2)" in error, error
        verdicts = rank_lines(proc.stdout, rank, "re-run on the same inputs from the same weights")
        assert [line.split("WARNING ", 1)[1].split(" (", 1)[0] for line in verdicts] == [
            "step 5: re-run on the same inputs from the same weights: not reproducible",
            "step 7: re-run on the same inputs from the same weights: reproducible"], verdicts
    rows = read_metrics(tmp_path)
    assert [row["health/skipped_steps"] for row in rows if "loss" in row] == [0, 0, 0, 0, 1, 1, 2]
    assert [(row["health/reruns_not_reproducible"], row["health/reruns_reproducible"])
            for row in rows if "loss" in row][-3:] == [(1, 0), (1, 0), (1, 1)]
    checks = [row for row in rows if "stragglers/slowest_rank" in row]
    assert [row["step"] for row in checks] == [2, 4, 6]
    assert all(row["stragglers/slowest_rank"] == 0 for row in checks), checks
    named = rank_lines(proc.stdout, 0, "straggler: rank")
    assert named and all("straggler: rank 0 on host" in line for line in named), proc.stdout[-6000:]
    report_faults("loss spikes and a slow rank", events(tmp_path, "inject"), survived=3)


def compression_state(checkpoint: Path) -> dict:
    from torchtitan.components.checkpoint import read_full_checkpoint

    state = read_full_checkpoint(checkpoint)["optimizer"]
    return {key: value for key, value in state.items() if "compression." in key}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["loco", "error_feedback"])
def test_a_skipped_step_leaves_the_compensation_state_as_it_was(tmp_path, method):
    """Compressed gradients (FSDP 2, 2 micro-batches a step) with on_nonfinite = skip, the spike guard and re-runs
    of skipped steps. Every rank's loss is NaN in step 3, rank 1's is 100x in step 6 (in every computation of the
    step: a batch whose loss really spikes). Both updates are skipped, and so is what their reductions made of the
    compensation state: the checkpoints of steps 3 and 6 hold the state of steps 2 and 5 bit for bit (LoCo's step
    count too, which counts applied steps: 5 after step 7), the run trains on, and the re-run of step 6, which
    starts from that same state, reproduces its loss and gradient norm bit for bit. The NaN had stayed in the
    state and every later step was skipped until the run stopped as diverged."""
    health = ["--debug.on_nonfinite", "skip", "--health.spike_sigma", "5", "--health.spike_warmup", "4",
              "--health.rerun_bad_steps"]
    proc = run(tmp_path, [*FSDP2, *health, "--comm.gradient_compression", method, "--training.global_batch_size",
                          "8", "--checkpoint.enable", "--checkpoint.interval", "1"], plan="nan@3:*,bad_batch@6:1")
    assert exit_codes(tmp_path) == {0: 0, 1: 0}, proc.stdout[-6000:]
    digests = {(e["rank"], e["step"]): e["digest"] for e in events(tmp_path, "step")}
    for rank in (0, 1):
        for skipped in (3, 6):
            assert digests[rank, skipped] == digests[rank, skipped - 1], f"rank {rank} applied step {skipped}"
            assert digests[rank, skipped + 1] != digests[rank, skipped], f"rank {rank} stopped after {skipped}"
        verdicts = rank_lines(proc.stdout, rank, "step 6: re-run on the same inputs from the same weights")
        assert len(verdicts) == 1 and ": reproducible" in verdicts[0], verdicts
    states = {step: compression_state(tmp_path / "checkpoint" / f"step-{step}") for step in (2, 3, 5, 6, 7)}
    for skipped in (3, 6):
        assert sorted(states[skipped]) == sorted(states[skipped - 1])
        for key, value in states[skipped].items():
            assert torch.equal(value, states[skipped - 1][key]), f"step {skipped} changed {key}"
    assert any(not torch.equal(value, states[5][key]) for key, value in states[7].items())
    if method == "loco":
        assert [int(states[step]["compression.loco_steps"]) for step in (2, 3, 5, 6, 7)] == [2, 2, 4, 4, 5]
    losses = {row["step"]: row["loss"] for row in read_metrics(tmp_path) if "loss" in row}
    assert all(isinstance(losses[step], float) and math.isfinite(losses[step]) for step in (4, 5, 7, 8)), losses


@pytest.mark.slow
def test_a_gradient_spike_on_one_flexdemo_replica_is_skipped_by_every_replica(tmp_path):
    """FlexDeMo on 2 DDP replicas, which never all-reduce their gradients: each replica's gradient norm is its own.
    Rank 1's gradients are 100x in step 5 (its loss is not). The spike guard decides on the replicas' root mean
    square norm, which every rank computes alike: both skip step 5 and go on, and the replicas stay identical.
    Rank 1 alone had skipped on its own norm while rank 0 stepped into FlexDeMo's exchange, and the run hung there
    until the training timeout."""
    health = ["--health.spike_sigma", "5", "--health.spike_warmup", "4", "--comm.train_timeout_seconds", "20"]
    proc = run(tmp_path, ["--parallelism.data_parallel_replicate_degree", "2", "--optimizer.name", "FlexDeMo",
                          *health], plan="grad_spike@5:1")
    assert exit_codes(tmp_path) == {0: 0, 1: 0}, proc.stdout[-6000:]
    digests = {(e["rank"], e["step"]): e["digest"] for e in events(tmp_path, "step")}
    for rank in (0, 1):
        assert digests[rank, 5] == digests[rank, 4], f"rank {rank} applied the spike of step 5"
        assert digests[rank, 6] != digests[rank, 5], f"rank {rank} stopped updating after the skipped step"
        assert len(rank_lines(proc.stdout, rank, "step 5: gradient norm")) == 1, proc.stdout[-6000:]
    for step in range(1, STEPS + 1):
        assert digests[0, step] == digests[1, step], f"replicas differ after step {step}"
    rows = [row for row in read_metrics(tmp_path) if "loss" in row]
    assert [row["health/skipped_steps"] for row in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    report_faults("gradient spike on one FlexDeMo replica", events(tmp_path, "inject"), survived=1)


@pytest.mark.slow
def test_stalled_rank_times_out_with_a_clear_error(tmp_path):
    """Rank 1 stalls in step 3: rank 0's collective times out after comm.train_timeout_seconds and it exits with a
    message naming the option. torchrun then gives the stalled rank a fixed 30 s to exit after SIGTERM before it
    SIGKILLs it; the stall (90 s) outlasts that, so the job ends because of the timeout, not because the stall did."""
    stall_seconds = 90
    proc = run(tmp_path, [*FSDP2, "--comm.train_timeout_seconds", "5"], plan="sleep@3:1", timeout=240,
               FAULT_SLEEP_SECONDS=str(stall_seconds))
    ended = time.time()
    assert proc.returncode != 0
    injected = events(tmp_path, "inject")
    (stall,) = injected
    # Rank 1 has no exit event: it was killed inside the stall.
    assert exit_codes(tmp_path) == {0: EXIT_COMM_FAILURE}, proc.stdout[-6000:]
    (rank0_exit,) = [e for e in events(tmp_path, "exit") if e["rank"] == 0]
    errors = rank_lines(proc.stdout, 0, "error:")
    assert len(errors) == 1, proc.stdout[-6000:]
    assert ("step 3: a collective did not complete within comm.train_timeout_seconds = 5 s; a peer rank stalled "
            "or died") in errors[0]
    assert not rank_lines(proc.stdout, 0, "Traceback")
    detected, whole_job = rank0_exit["time"] - stall["time"], ended - stall["time"]
    print(f"stall: rank 0 exited {detected:.1f} s after the stall began, the job {whole_job:.1f} s after it")
    assert detected < 5 + 15
    assert whole_job < stall_seconds
    report_faults("hang", injected, survived=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_rank_that_never_joins_times_out_at_init(tmp_path):
    """Rank 0 of two started by hand, with a 3 s init timeout: it waits for a peer that never comes."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "RANK": "0",
           "LOCAL_RANK": "0"}
    began = time.time()
    proc = launch(tmp_path, 1, [*BASE, "--comm.init_timeout_seconds", "3"], timeout=120, env=env)
    assert proc.returncode == EXIT_COMM_FAILURE, proc.stdout[-6000:]
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stdout[-6000:]
    assert ("start-up: not every rank joined the process group within comm.init_timeout_seconds = 3 s"
            in errors[0]), errors[0]
    assert "1/2 clients joined" in errors[0]
    assert "Traceback" not in proc.stdout
    print(f"init timeout: exited {time.time() - began:.1f} s after the start")
