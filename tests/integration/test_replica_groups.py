"""Replica-group fault tolerance on torchft (docs/resilience.md): two replica groups, each a torchrun job of one
gloo process, joined by a torchft lighthouse. One group's process is SIGKILLed mid-run and the group started again
(as a scheduler or its torchrun would) once the other has trained on alone; it heals from the live group (no
checkpoint exists to read), while the other group never stops.

The invariant (torchft's per-step semantics): every committed step applies the gradient averaged over the groups
in that step's quorum, the same update in every group, and a recovering group receives the live group's state
before its first step. So after the run both groups hold bitwise the same weights, at every step both ran.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import REPO, TINY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUPS = 2
STEPS = 200
INJECTOR = "tests.integration.fault_injection"


def group_command(replica_id: int, lighthouse: str, dump: Path, steps: int = STEPS,
                  extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0", *extra, "-m", INJECTOR, *TINY,
            "--training.steps", str(steps), "--training.local_batch_size", "2", "--job.dump_folder", str(dump),
            "--fault_tolerance.enable", "--fault_tolerance.group_size", str(GROUPS),
            "--fault_tolerance.replica_id", str(replica_id), "--fault_tolerance.lighthouse", lighthouse,
            "--fault_tolerance.process_group_timeout_ms", "5000", "--fault_tolerance.quorum_timeout_seconds", "120"]


def events(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("events-rank0-attempt*.jsonl"))
            for line in path.read_text().splitlines()]


def kill(proc: subprocess.Popen, workers_only: bool = False) -> None:
    """SIGKILL a group's torchrun workers (each in a session of its own: killing the agent's session leaves them),
    then, unless `workers_only`, its agent."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    for pid in (children.read_text().split() if children.exists() else []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    if not workers_only:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def last_step(folder: Path) -> int:
    return max((row["step"] for row in events(folder) if row["event"] == "step"), default=0)


def test_killed_replica_group_heals_from_a_live_peer_while_the_other_trains_on(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    procs: dict[str, subprocess.Popen] = {}
    logs = []

    def start(name: str, replica_id: int) -> None:
        report = tmp_path / name
        report.mkdir()
        # Every step takes 0.2 s more, so that the run outlasts two start-ups of a group (seconds each, more under
        # load) and the survivor is still training when the killed group comes back.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "FAULT_REPORT_DIR": str(report),
               "FAULT_PLAN": "slow@1:0", "FAULT_SLOW_SECONDS": "0.2"}
        logs.append(open(tmp_path / f"{name}.log", "w"))
        procs[name] = subprocess.Popen(group_command(replica_id, lighthouse.address(), tmp_path / "dump"), cwd=REPO,
                                       env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until(condition, what: str) -> None:
        while not condition():
            assert procs["survivor"].poll() is None, f"the survivor stopped while waiting until {what}"
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.1)

    deadline = time.monotonic() + 600
    try:
        # Group 0 first: group 1 then joins by healing from it, so group 0 holds the whole history.
        start("survivor", 0)
        wait_until(lambda: last_step(tmp_path / "survivor") >= 1, "group 0 trained a step")
        start("killed", 1)
        wait_until(lambda: len([r for r in events(tmp_path / "killed") if r["event"] == "step"]) >= 3,
                   "group 1 trained 3 steps with group 0")
        # Its process killed, mid-step or between steps; its torchrun (no restarts left) then ends the group.
        kill(procs["killed"], workers_only=True)
        assert procs["killed"].wait(timeout=60) != 0
        killed_at = last_step(tmp_path / "killed")
        wait_until(lambda: last_step(tmp_path / "survivor") >= killed_at + 8, "group 0 trained on alone")
        start("restarted", 1)
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill(proc)
                proc.wait()
        for log in logs:
            log.close()
        lighthouse.shutdown()
    outputs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in procs}
    for name in ("survivor", "restarted"):
        assert procs[name].returncode == 0, outputs[name][-6000:]

    survivor, killed, restarted = (events(tmp_path / name) for name in ("survivor", "killed", "restarted"))
    # The survivor ran one process to the end. A step its peer died in is not committed (its all-reduce failed)
    # and is run again with the next batch: at most that one step twice.
    survivor_steps = [row["step"] for row in survivor if row["event"] == "step"]
    assert sorted(set(survivor_steps)) == list(range(1, STEPS + 1)), survivor_steps
    assert len(survivor_steps) - STEPS <= 1, survivor_steps
    # The restarted group began where the survivor was, well past where it died, not at step 1: it took the
    # survivor's state (no checkpoint was written to read), and finished the run.
    resumed = [row["step"] for row in restarted if row["event"] == "step"]
    assert resumed and resumed[0] > killed_at + 8 and resumed[-1] == STEPS, resumed
    assert "recovered the state of step" in outputs["restarted"]
    assert not (tmp_path / "dump" / "replica_1" / "checkpoint").exists()
    # The same weights in both groups after every step both finished (the survivor's last record of a step is its
    # committed one), the killed group's first step and the restarted group's first included.
    digests = {row["step"]: row["digest"] for row in survivor if row["event"] == "step"}
    for group in (killed, restarted):
        for row in group:
            if row["event"] == "step":
                assert row["digest"] == digests[row["step"]], f"step {row['step']}"
    # While group 1 was down the survivor trained alone (one group in its quorums); both at the end.
    metrics = [json.loads(line) for line in
               (tmp_path / "dump" / "replica_0" / "metrics.jsonl").read_text().splitlines()]
    groups = {row["step"]: row["replica_groups"] for row in metrics if "replica_groups" in row}
    assert all(groups[step] == 1 for step in range(killed_at + 2, resumed[0])), groups
    assert groups[STEPS] == 2, groups


def test_group_with_no_live_peer_resumes_from_its_checkpoint(tmp_path):
    """The only live group (of 2 configured) is killed in step 8; its torchrun restarts it, no peer holds a newer
    state, so it resumes from its own checkpoint of step 5 and replays steps 6-7 exactly."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "FAULT_REPORT_DIR": str(tmp_path),
           "FAULT_PLAN": "sigkill@8:0", "FAULT_ATTEMPT": "0"}
    command = group_command(0, lighthouse.address(), tmp_path / "dump", steps=10, extra=("--max-restarts=1",))
    command += ["--checkpoint.enable", "--checkpoint.interval", "5"]
    try:
        with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) as proc:
            try:
                output, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                kill(proc)
                output, _ = proc.communicate()
    finally:
        lighthouse.shutdown()
    assert proc.returncode == 0, output[-6000:]
    steps = [row for row in events(tmp_path) if row["event"] == "step"]
    first, second = ([row for row in steps if row["attempt"] == attempt] for attempt in (0, 1))
    assert [row["step"] for row in first] == list(range(1, 8))
    assert [row["step"] for row in second] == list(range(6, 11))
    assert "recovered the state" not in output
    # Weights, optimizer state and data position came back from the checkpoint: the replayed steps are identical.
    assert [row["digest"] for row in second[:2]] == [row["digest"] for row in first[5:7]]
