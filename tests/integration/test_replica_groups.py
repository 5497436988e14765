"""Replica-group fault tolerance on torchft (docs/resilience.md): two replica groups, each a torchrun job of one
gloo process, joined by a torchft lighthouse. One group's process is SIGKILLed mid-run; the group is started again
(as its torchrun or the scheduler would) and heals from the live group (no checkpoint exists to read), while the
other group never stops.

The invariant (torchft's per-step semantics): every committed step applies the gradient averaged over the groups
in that step's quorum, the same update in every group, and a recovering group receives the live group's state
before its first step. So after the run both groups hold bitwise the same weights, at every step both ran.
"""

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
STEPS = 60
KILL_STEP = 6
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


def last_step(folder: Path) -> int:
    return max((row["step"] for row in events(folder) if row["event"] == "step"), default=0)


def test_killed_replica_group_heals_from_a_live_peer_while_the_other_trains_on(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    procs: dict[str, subprocess.Popen] = {}
    logs = []

    def start(name: str, replica_id: int, plan: str) -> None:
        report = tmp_path / name
        report.mkdir()
        # Every step of every group takes 0.2 s more, so that the steps of the run outlast a restart.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "FAULT_REPORT_DIR": str(report),
               "FAULT_PLAN": f"slow@1:0{plan}", "FAULT_SLOW_SECONDS": "0.2"}
        logs.append(open(tmp_path / f"{name}.log", "w"))
        procs[name] = subprocess.Popen(group_command(replica_id, lighthouse.address(), tmp_path / "dump"), cwd=REPO,
                                       env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)

    deadline = time.monotonic() + 600
    try:
        start("survivor", 0, "")
        start("killed", 1, f",sigkill@{KILL_STEP}:0")
        assert procs["killed"].wait(timeout=deadline - time.monotonic()) != 0
        # The group's restart (its torchrun's, or the scheduler's) comes once the survivor has trained on alone.
        while last_step(tmp_path / "survivor") < KILL_STEP + 8:
            assert procs["survivor"].poll() is None and time.monotonic() < deadline, "the survivor stopped"
            time.sleep(0.2)
        start("restarted", 1, "")
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
        lighthouse.shutdown()
    outputs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in procs}
    for name in ("survivor", "restarted"):
        assert procs[name].returncode == 0, outputs[name][-6000:]

    survivor, killed, restarted = (events(tmp_path / name) for name in ("survivor", "killed", "restarted"))
    # The survivor ran one process to the end. The step its peer died in is not committed (its all-reduce failed)
    # and is run again with the next batch: at most that one step twice.
    survivor_steps = [row["step"] for row in survivor if row["event"] == "step"]
    assert sorted(set(survivor_steps)) == list(range(1, STEPS + 1)), survivor_steps
    assert len(survivor_steps) - STEPS <= 1, survivor_steps
    assert [row["step"] for row in killed if row["event"] == "inject" and row["kind"] == "sigkill"] == [KILL_STEP]
    # The restarted group began where the survivor was, not at step 1: it took the survivor's state (no checkpoint
    # was written to read), and finished the run.
    resumed = [row["step"] for row in restarted if row["event"] == "step"]
    assert resumed and resumed[0] > KILL_STEP + 8 and resumed[-1] == STEPS, resumed
    assert "recovered the state of step" in outputs["restarted"]
    assert not (tmp_path / "dump" / "replica_1" / "checkpoint").exists()
    # The same weights in both groups after every step both finished, the restarted group's first included.
    digests = {row["step"]: row["digest"] for row in survivor if row["event"] == "step"}
    for group in (killed, restarted):
        for row in group:
            if row["event"] == "step":
                assert row["digest"] == digests[row["step"]], f"step {row['step']}"
    # While group 1 was down the survivor trained alone (one group in its quorums); both at the end.
    metrics = [json.loads(line) for line in
               (tmp_path / "dump" / "replica_0" / "metrics.jsonl").read_text().splitlines()]
    groups = [row["replica_groups"] for row in metrics if "replica_groups" in row]
    assert 1 in groups and groups[-1] == 2, groups


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
                os.killpg(proc.pid, signal.SIGKILL)
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
