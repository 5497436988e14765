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
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.harness import REPO, TINY
from torchtitan.distributed.fault_tolerance import wait_for_lighthouse

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUPS = 2
STEPS = 200
QUORUM_TIMEOUT_S = 15
STALL_S = 20
PROCESS_GROUP_TIMEOUT_S = 5
HEARTBEAT_TIMEOUT_S = 5  # torchft's lighthouse default
JOIN_TIMEOUT_S = 1
INJECTOR = "tests.integration.fault_injection"


def group_command(replica_id: int, lighthouse: str, dump: Path, steps: int = STEPS,
                  torchrun: tuple[str, ...] = (), groups: int = GROUPS, nproc: int = 1) -> list[str]:
    """A group of `nproc` processes (FSDP over them when more than one)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0", *torchrun, "-m", INJECTOR, *TINY,
            "--training.steps", str(steps), "--training.local_batch_size", "2", "--job.dump_folder", str(dump),
            "--fault_tolerance.enable", "--fault_tolerance.group_size", str(groups),
            "--fault_tolerance.replica_id", str(replica_id), "--fault_tolerance.lighthouse", lighthouse,
            "--fault_tolerance.process_group_timeout_ms", str(1000 * PROCESS_GROUP_TIMEOUT_S),
            "--fault_tolerance.quorum_timeout_seconds", "120"]


def events(folder: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob(f"events-rank{rank}-attempt*.jsonl"))
            for line in path.read_text().splitlines()]


def kill(proc: subprocess.Popen, workers_only: bool = False) -> None:
    """SIGKILL a group's torchrun workers (each in a session of its own: killing the agent's session leaves them),
    then, unless `workers_only`, its agent."""
    for pid in workers(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not workers_only:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def last_step(folder: Path) -> int:
    return max((row["step"] for row in events(folder) if row["event"] == "step"), default=0)


class Groups:
    """The replica groups of one test, each a torchrun job started by `start(name, ...)`: its output in
    `<tmp>/<name>.log`, its fault reports in `<tmp>/<name>/`, its dump folder `<tmp>/dump` (each group writes under
    `replica_<id>`). Every group's data loading takes 0.2 s more per step, so that a run outlasts a group's start-up
    (seconds each, more under load) and the others are still training when a failed group comes back."""

    def __init__(self, tmp_path: Path, lighthouse: str, timeout_s: float = 600, size: int = GROUPS):
        self.size = size
        self.tmp = tmp_path
        self.lighthouse = lighthouse
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = []
        self.deadline = time.monotonic() + timeout_s

    def start(self, name: str, replica_id: int, extra: tuple[str, ...] = (), steps: int = STEPS,
              torchrun: tuple[str, ...] = (), nproc: int = 1, **env: str) -> None:
        report = self.tmp / name
        report.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "FAULT_REPORT_DIR": str(report),
               "FAULT_PLAN": "slow@1:0", "FAULT_SLOW_SECONDS": "0.2", **env}
        self.logs.append(open(self.tmp / f"{name}.log", "w"))
        command = group_command(replica_id, self.lighthouse, self.tmp / "dump", steps, torchrun, self.size,
                                nproc) + list(extra)
        self.procs[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=self.logs[-1],
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until(self, condition, what: str, running: tuple[str, ...] = ("survivor",)) -> None:
        while not condition():
            for name in running:
                assert self.procs[name].poll() is None, f"{name} stopped while waiting until {what}"
            assert time.monotonic() < self.deadline, f"timed out waiting until {what}"
            time.sleep(0.1)

    def wait(self) -> None:
        for proc in self.procs.values():
            proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill(proc)
                proc.wait()
        for log in self.logs:
            log.close()

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def steps(self, name: str, rank: int = 0) -> list[dict]:
        """The group's committed steps (one record each; a step run again after a failed one has two)."""
        return [row for row in events(self.tmp / name, rank) if row["event"] == "step" and row["committed"]]

    def assert_finished(self, *names: str) -> None:
        for name in names:
            assert self.procs[name].returncode == 0, self.output(name)[-6000:]

    def replica_groups(self, replica_id: int) -> dict[int, int]:
        """Step -> the number of groups in its quorum, from the group's metrics (its last record of a step)."""
        path = self.tmp / "dump" / f"replica_{replica_id}" / "metrics.jsonl"
        return {row["step"]: row["replica_groups"] for row in map(json.loads, path.read_text().splitlines())
                if "replica_groups" in row}


def workers(proc: subprocess.Popen) -> list[int]:
    """The worker processes of a group's torchrun agent."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    return [int(pid) for pid in (children.read_text().split() if children.exists() else [])]


def assert_survivor_never_stopped(folder: Path, joined_late: bool = False) -> None:
    """The survivor ran one process to the end, committing every step once from step 1 (or, if it `joined_late`,
    from the step it healed to). A step during which its peer failed is not committed (its all-reduce failed) and
    is run again with the next batch: at most that one."""
    rows = [row for row in events(folder) if row["event"] == "step"]
    committed = [row["step"] for row in rows if row["committed"]]
    assert {row["attempt"] for row in rows} == {0}
    assert committed == list(range(committed[0] if joined_late else 1, STEPS + 1)), committed
    assert len(rows) - len(committed) <= 1, [row["step"] for row in rows]


def assert_same_weights(reference: list[dict], *others: list[dict]) -> None:
    """The same weights in every group after every step both committed (at least one)."""
    digests = {row["step"]: row["digest"] for row in reference}
    for group in others:
        common = [row for row in group if row["step"] in digests]
        assert common
        for row in common:
            assert row["digest"] == digests[row["step"]], f"step {row['step']}"


def test_killed_replica_group_heals_from_a_live_peer_while_the_other_trains_on(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    groups = Groups(tmp_path, lighthouse.address())
    try:
        # Group 0 first: group 1 then joins by healing from it, so group 0 holds the whole history.
        groups.start("survivor", 0)
        groups.wait_until(lambda: last_step(tmp_path / "survivor") >= 1, "group 0 trained a step")
        groups.start("killed", 1)
        groups.wait_until(lambda: len(groups.steps("killed")) >= 3, "group 1 trained 3 steps with group 0")
        # Its process killed, mid-step or between steps; its torchrun (no restarts left) then ends the group.
        kill(groups.procs["killed"], workers_only=True)
        assert groups.procs["killed"].wait(timeout=60) != 0
        killed_at = last_step(tmp_path / "killed")
        groups.wait_until(lambda: last_step(tmp_path / "survivor") >= killed_at + 8, "group 0 trained on alone")
        groups.start("restarted", 1)
        groups.wait()
    finally:
        groups.stop()
        lighthouse.shutdown()
    groups.assert_finished("survivor", "restarted")
    survivor, killed, restarted = (groups.steps(name) for name in ("survivor", "killed", "restarted"))
    assert_survivor_never_stopped(tmp_path / "survivor")
    # The restarted group began where the survivor was, well past where it died, not at step 1: it took the
    # survivor's state (no checkpoint was written to read), and finished the run.
    resumed = [row["step"] for row in restarted]
    assert resumed and resumed[0] > killed_at + 8 and resumed[-1] == STEPS, resumed
    assert "recovered the state of step" in groups.output("restarted")
    assert not (tmp_path / "dump" / "replica_1" / "checkpoint").exists()
    # The killed group's first step and the restarted group's first included.
    assert_same_weights(survivor, killed, restarted)
    # While group 1 was down the survivor trained alone (one group in its quorums); both at the end.
    replica_groups = groups.replica_groups(0)
    assert all(replica_groups[step] == 1 for step in range(killed_at + 2, resumed[0])), replica_groups
    assert replica_groups[STEPS] == 2, replica_groups


def test_three_groups_of_two_processes_train_on_while_a_killed_one_restarts_and_heals(tmp_path):
    """The issue's headline: 3 replica groups x 2 processes (FSDP 2 inside each, gloo), one process of group 1
    SIGKILLed mid-run; group 1's torchrun restarts both of its workers (`--max-restarts 1`).

    The invariant (torchft's per-step semantics): every committed step applies the gradient averaged over the groups
    in that step's quorum, identically in every group; a group that was down receives a live group's whole state
    (weights, optimizer, schedule, step, data position) before its first step. So the final weights are those of a
    run in which the survivors alone processed the steps of the outage (each step's update the mean of the quorum's
    gradients; the batches the dead group would have read are read by no one): every rank's shards are bitwise the
    same in the three groups after every step they both committed, the last one included.

    Bounds, from the configuration: a survivor's step in which group 1 died fails at once or after
    process_group_timeout (5 s); it is run again in a quorum that the lighthouse forms without the dead group after at
    most its join timeout (1 s) once the dead group has stopped heartbeating (5 s), since 2 of 3 groups are a
    majority. So no survivor waits longer than 5 + 5 + 1 s plus a few steps' work (the redone step, the transfer to
    the healing group and its first step: 4 median steps allowed) between two committed steps. The restarted group
    asks for a quorum once started; the lighthouse puts it into the next quorum the survivors ask for (it has
    joined, so the quorum waits for nobody), so it takes part in the step after the survivors' step in progress:
    at most 2 steps after the last one they had committed when it asked."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000 * JOIN_TIMEOUT_S,
                                  heartbeat_timeout_ms=1000 * HEARTBEAT_TIMEOUT_S)
    groups = Groups(tmp_path, lighthouse.address(), size=3)
    started = time.monotonic()
    try:
        groups.start("group0", 0, nproc=2)
        groups.wait_until(lambda: last_step(tmp_path / "group0") >= 1, "group 0 trained a step", ("group0",))
        groups.start("killed", 1, torchrun=("--max-restarts=1",), nproc=2)
        groups.start("group2", 2, nproc=2)
        groups.wait_until(lambda: all(len(groups.steps(name)) >= 3 for name in ("killed", "group2")),
                          "groups 1 and 2 trained 3 steps with group 0", ("group0", "killed", "group2"))
        victim = workers(groups.procs["killed"])[-1]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        groups.wait()
    finally:
        groups.stop()
        lighthouse.shutdown()
    duration = time.monotonic() - started
    groups.assert_finished("group0", "killed", "group2")
    assert_survivor_never_stopped(tmp_path / "group0")
    assert_survivor_never_stopped(tmp_path / "group2", joined_late=True)
    output = groups.output("killed")
    restart = output[output.index("exitcode: -9"):]
    # Healed from a peer, not from disk: no checkpoint exists, none was loaded.
    assert "recovered the state of step" in restart and "Loaded model" not in output, restart[-6000:]
    assert not any((tmp_path / "dump").glob("replica_*/checkpoint"))

    survivors = [groups.steps(name) for name in ("group0", "group2")]
    before = [row for row in groups.steps("killed") if row["attempt"] == 0]
    after = [row for row in groups.steps("killed") if row["attempt"] == 1]
    rejoined_at = after[0]["time"]
    # The survivors committed steps all through the outage, with no pause beyond the bound.
    times = sorted(row["time"] for row in survivors[0])
    gaps = [b - a for a, b in zip(times, times[1:])]
    median = sorted(gaps)[len(gaps) // 2]
    bound = bound_s(median)
    assert max(gaps) < bound, (max(gaps), bound)
    # The steps between group 1's last before the kill and its first after it.
    during = [row["step"] for row in survivors[0] if before[-1]["step"] < row["step"] < after[0]["step"]]
    assert len(during) >= (rejoined_at - killed_at - bound) / (2 * median) and len(during) >= 5, during
    replica_groups = groups.replica_groups(0)
    assert all(replica_groups[step] == 2 for step in during[1:]), replica_groups
    assert replica_groups[STEPS] == 3, replica_groups
    # Rejoined within the bound of steps after it asked for a quorum.
    asked = next(row["time"] for row in events(tmp_path / "killed") if row["event"] == "first_quorum"
                 and row["attempt"] == 1)
    committed_when_asked = max(row["step"] for row in survivors[0] if row["time"] < asked)
    assert committed_when_asked < after[0]["step"] <= committed_when_asked + 2, (committed_when_asked, after[0])
    assert after[-1]["step"] == STEPS
    # The invariant, on every rank's shards.
    for rank in (0, 1):
        killed = groups.steps("killed", rank)
        assert_same_weights(groups.steps("group0", rank), groups.steps("group2", rank), killed)
        final = {name: [row["digest"] for row in groups.steps(name, rank) if row["step"] == STEPS][-1]
                 for name in ("group0", "killed", "group2")}
        assert len(set(final.values())) == 1, final
    print(f"3 groups x 2 processes, {duration:.0f} s: group 1 killed after step {before[-1]['step']}; the survivors "
          f"committed {len(during)} steps meanwhile (longest pause {max(gaps):.1f} s, median step {median:.2f} s, "
          f"bound {bound:.1f} s); group 1 asked for a quorum {asked - killed_at:.1f} s after the kill, with the "
          f"survivors at step {committed_when_asked}, and took part in step {after[0]['step']} "
          f"{rejoined_at - killed_at:.1f} s after the kill")


@pytest.mark.parametrize("size", [2, 3])
def test_hung_group(tmp_path, size):
    """Group 1's process stalls for STALL_S (SIGUSR1 to the fault injector: its main thread sleeps while torchft's
    heartbeat threads run on, as in a hung kernel or a deadlock, so the lighthouse still counts it as alive). The
    others' collective with it fails after process_group_timeout_ms (5 s) and they run that step again.

    torchft's lighthouse forms a quorum only of more than half of the heartbeating groups. With 3 groups, the two
    others carry on once it stops waiting for the stalled one (join_timeout_ms, 1 s); awake, group 1 fails the step
    it was in, finds itself behind at its next quorum and heals from them, in the same process. With 2, the other
    group waits the stall out (at most fault_tolerance.quorum_timeout_seconds), then both go on together."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    groups = Groups(tmp_path, lighthouse.address(), size=size)
    others = ["survivor", "peer"][:size - 1]
    try:
        groups.start("survivor", 0)
        groups.wait_until(lambda: last_step(tmp_path / "survivor") >= 1, "group 0 trained a step")
        groups.start("hung", 1, FAULT_SLEEP_SECONDS=str(STALL_S))
        if size == 3:
            groups.start("peer", 2)
        groups.wait_until(lambda: all(len(groups.steps(name)) >= 3 for name in ["hung", *others[1:]]),
                          "the other groups trained 3 steps with group 0", ("survivor", "hung", *others[1:]))
        os.kill(workers(groups.procs["hung"])[0], signal.SIGUSR1)
        groups.wait()
    finally:
        groups.stop()
        lighthouse.shutdown()
    groups.assert_finished("hung", *others)
    for name in others:
        assert_survivor_never_stopped(tmp_path / name, joined_late=name == "peer")
    survivor, hung = groups.steps("survivor"), groups.steps("hung")
    reports = events(tmp_path / "hung")
    stalled = next(row["time"] for row in reports if row["event"] == "inject")
    woke = next(row["time"] for row in reports if row["event"] == "stall_end")
    times = [row["time"] for row in survivor]
    pause = max(b - a for a, b in zip(times, times[1:]))
    during = [row["step"] for row in survivor if stalled < row["time"] < woke]
    before = [row["step"] for row in hung if row["time"] < stalled]
    after = [row["step"] for row in hung if row["time"] > woke]
    # The stalled group went on in the same process, to the end.
    assert {row["attempt"] for row in reports} == {0}
    assert after[-1] == STEPS
    for name in ["hung", *others[1:]]:
        assert_same_weights(survivor, groups.steps(name))
    replica_groups = groups.replica_groups(0)
    assert replica_groups[STEPS] == size
    if size == 3:
        # The others did not wait for the stalled group: their longest pause is far below the stall.
        assert pause < STALL_S - 5, pause
        assert len(during) >= 10, during
        assert all(replica_groups[step] == 2 for step in during[1:]), replica_groups
        # Group 1 healed past the steps it missed, on joining and after the stall.
        assert after[0] > max(during), (before, after)
        assert groups.output("hung").count("recovered the state of step") == 2
    else:
        # The survivor waited for the stalled group (its pause is the stall, less the time the stall began before
        # the survivor's last step), trained nothing meanwhile, and both went on from the step it stalled in.
        assert pause > STALL_S - 5 and not during, (pause, during)
        assert after[0] == before[-1] + 1
    print(f"{size} groups; stall of {woke - stalled:.1f} s: group 0's longest pause {pause:.1f} s, {len(during)} "
          f"steps meanwhile; group 1 stalled after step {before[-1]}, went on at step {after[0]} "
          f"({next(row['time'] for row in hung if row['time'] > woke) - woke:.1f} s after waking)")


def test_group_killed_during_a_checkpoint_save(tmp_path):
    """Both groups checkpoint every 10 steps. Group 1's process is SIGKILLed inside a save (SIGUSR2 to the fault
    injector: once DCP has written step-N.incomplete, before it is published) and its torchrun restarts it. Group 0
    trains on; group 1 loads the newest published checkpoint of the two groups (its own is as it was before the
    kill) and, if group 0 is further by then, heals from it (when group 1 restarts quickly, group 0 may still be
    waiting for it in the step after that checkpoint: then both go on from there together, nothing to heal); the
    interrupted save is never published and the next save removes it; no published checkpoint of either group is
    lost."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    groups = Groups(tmp_path, lighthouse.address())
    options = ("--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "0")
    folder = tmp_path / "dump" / "replica_1" / "checkpoint"

    def published(where: Path = folder) -> list[Path]:
        return sorted((path for path in where.glob("step-*") if "." not in path.name),
                      key=lambda path: int(path.name.split("-")[1]))

    try:
        groups.start("survivor", 0, options)
        groups.wait_until(lambda: last_step(tmp_path / "survivor") >= 1, "group 0 trained a step")
        groups.start("killed", 1, options, torchrun=("--max-restarts=1",))
        groups.wait_until(lambda: published(), "group 1 published a checkpoint", ("survivor", "killed"))
        kept = published()[-1]
        files = {path.relative_to(kept): path.read_bytes() for path in kept.rglob("*") if path.is_file()}
        os.kill(workers(groups.procs["killed"])[0], signal.SIGUSR2)
        groups.wait()
    finally:
        groups.stop()
        lighthouse.shutdown()
    groups.assert_finished("survivor", "killed")
    assert_survivor_never_stopped(tmp_path / "survivor")
    reports = events(tmp_path / "killed")
    killed_in = next(row["step"] for row in reports if row["event"] == "inject" and row["kind"] == "sigkill_in_save")
    steps = groups.steps("killed")
    after = [row["step"] for row in steps if row["attempt"] == 1]
    output = groups.output("killed")
    restart = output[output.index("failed (exitcode: -9)"):]
    # The restarted group read the newest full checkpoint of either group: its own, published before the kill, or
    # group 0's, if newer (the groups' states are equal at every committed step); then it took the live group's
    # state if that was newer still, else it went on from the checkpoint's step (the same weights as group 0 there:
    # assert_same_weights below).
    loaded = re.search(r"Loaded model, optimizer.* from (\S+) in \S+ s \(step (\d+)\)", restart)
    assert loaded, restart[:3000]
    source, loaded_step = Path(loaded[1]), int(loaded[2])
    assert source == kept or (source.parent == tmp_path / "dump" / "replica_0" / "checkpoint"
                              and int(source.name.split("-")[1]) > int(kept.name.split("-")[1])), restart[:3000]
    healed = "recovered the state of step" in restart[loaded.end():]
    assert healed or after[0] == loaded_step + 1, (loaded_step, after[0])
    assert after[0] > killed_in and after[-1] == STEPS, after
    assert {path.relative_to(kept): path.read_bytes() for path in kept.rglob("*") if path.is_file()} == files
    # Not published, and removed by the next save; every save of both groups is there.
    names = [path.name for path in published()]
    assert f"step-{killed_in}" not in names and not list(folder.glob("*.incomplete"))
    assert names == [kept.name] + [f"step-{step}" for step in range(10, STEPS + 1, 10) if step >= after[0]], names
    assert [path.name for path in published(tmp_path / "dump" / "replica_0" / "checkpoint")] == [
        f"step-{step}" for step in range(10, STEPS + 1, 10)]
    assert_same_weights(groups.steps("survivor"), steps)
    print(f"killed in the save of step {killed_in}; {kept.name} kept; loaded {source}, "
          f"{'healed from group 0 and ' if healed else ''}resumed at step {after[0]}")


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_semi_sync_makes_the_weights_equal_every_sync_steps(tmp_path, method):
    """fault_tolerance.semi_sync_method = local_sgd or diloco, sync_steps 3 (torchft's LocalSGD, DiLoCo): each group
    takes optimizer steps of its own on its own slice of the data, so the groups' weights differ after every step
    between syncs, and are the same right after each sync (LocalSGD: the average over the groups; DiLoCo: the outer
    step from the last sync's weights, with the averaged pseudo-gradient). Group 1 starts later and heals from
    group 0 at its first sync (DiLoCo: with group 0's last-sync weights and outer momentum, else the next syncs'
    weights would differ)."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    groups = Groups(tmp_path, lighthouse.address())
    options = ("--fault_tolerance.semi_sync_method", method, "--fault_tolerance.sync_steps", "3")
    try:
        groups.start("group0", 0, options)
        groups.wait_until(lambda: last_step(tmp_path / "group0") >= 1, "group 0 trained a step", ("group0",))
        groups.start("group1", 1, options)
        groups.wait()
    finally:
        groups.stop()
        lighthouse.shutdown()
    groups.assert_finished("group0", "group1")
    logged = [{row["step"]: row["digest"] for row in events(tmp_path / name) if row["event"] == "logged"}
              for name in ("group0", "group1")]
    assert sorted(logged[0]) == list(range(1, STEPS + 1))
    # Group 1 took steps 1 and 2 of its own, then at its first sync healed to group 0's step and synced with it on.
    healed_to = min(step for step in logged[1] if step % 3 == 0)
    assert sorted(logged[1]) == [1, 2, *range(healed_to, STEPS + 1)], sorted(logged[1])
    both = list(range(healed_to, STEPS + 1))
    synced = [step for step in both if step % 3 == 0]
    between = [step for step in both if step % 3]
    assert len(synced) >= 10 and len(between) >= 20, both
    assert all(logged[0][step] == logged[1][step] for step in synced), synced
    assert all(logged[0][step] != logged[1][step] for step in between), between
    assert groups.output("group1").count("recovered the state of step") == 1
    print(f"group 1 healed to step {both[0]}; equal at {len(synced)} syncs, different at {len(between)} steps "
          f"between")


@pytest.mark.parametrize("method", ["none", "diloco"])
def test_group_with_no_live_peer_resumes_from_its_checkpoint(tmp_path, method):
    """The only live group (of 2 configured) is killed in step 8; its torchrun restarts it, no peer holds a newer
    state, so it resumes from its own checkpoint of step 5 and replays steps 6-7 exactly: the same losses and weights,
    bitwise (the same fp32 operations in the same order on bitwise-equal state and batches, one thread: no
    tolerance is needed, so none is given).

    With DiLoCo (sync_steps 3) the checkpoint of step 5 lies between the syncs of steps 3 and 6: step 7 runs from
    the weights of the sync of step 6, the outer step from the weights of step 3 with the momentum of the sync of
    step 3 (the checkpoint's `diloco` part). Without that part the resumed group would sync from step 5's weights
    with zero momentum, and step 7 would differ."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "FAULT_REPORT_DIR": str(tmp_path),
           "FAULT_PLAN": "sigkill@8:0", "FAULT_ATTEMPT": "0"}
    command = group_command(0, lighthouse.address(), tmp_path / "dump", steps=10, torchrun=("--max-restarts=1",))
    command += ["--checkpoint.enable", "--checkpoint.interval", "5", "--fault_tolerance.semi_sync_method", method,
                "--fault_tolerance.sync_steps", "3"]
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
    # Weights, optimizer state, data position (and DiLoCo's state) came back from the checkpoint: the replayed steps
    # are identical.
    assert [(row["loss"], row["digest"]) for row in second[:2]] == [(row["loss"], row["digest"]) for row in first[5:7]]
    if method == "diloco":
        assert "Loaded model, optimizer, lr_scheduler, dataloader, train_state, rng, diloco from" in output


def test_diloco_checkpoint_reloads_into_another_layout(tmp_path):
    """The `diloco` part of a checkpoint is keyed by parameter name and sharded as the parameters: written by a group
    of 2 processes (FSDP 2; the checkpoint of step 4, between the syncs of steps 3 and 6, so the last sync's weights
    are not the current ones), it loads into one process whole, as DCP reshards the model: every parameter's
    last-sync weights and outer momentum equal the checkpoint's full tensors."""
    from torchft.coordination import LighthouseServer

    from torchtitan.components.checkpoint import read_full_checkpoint
    from torchtitan.config import parse_args
    from torchtitan.train import Trainer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    dump = tmp_path / "dump"
    options = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "3",
               "--checkpoint.enable", "--checkpoint.interval", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    try:
        written = subprocess.run(group_command(0, lighthouse.address(), dump, steps=5, groups=1, nproc=2) + options,
                                 cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=300)
        assert written.returncode == 0, written.stdout[-6000:]
        folder = dump / "replica_0"
        saved = read_full_checkpoint(folder / "checkpoint" / "step-4")
        # The same options in this one process (the group's dump folder as the trainer's main() makes it).
        command = group_command(0, lighthouse.address(), folder, steps=5, groups=1)
        trainer = Trainer(parse_args(command[command.index(INJECTOR) + 1:] + options))
        try:
            trainer.checkpointer.load()
            state = trainer.fault_tolerance.diloco_state
            assert state.loaded
            for name, key, param in state.parameters:
                assert torch.equal(state.last_sync[key], saved["diloco"][f"{name}.last_sync"]), name
                assert torch.equal(state.outer.state[param]["momentum_buffer"],
                                   saved["diloco"][f"{name}.outer_momentum"]), name
                assert not torch.equal(saved["model"][name], saved["diloco"][f"{name}.last_sync"]), name
        finally:
            trainer.close()
    finally:
        lighthouse.shutdown()


def start_lighthouse(port: int, log) -> subprocess.Popen:
    """torchft's lighthouse as a process of its own, as run_train.sh starts it; returns once it accepts connections."""
    proc = subprocess.Popen([str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
                             "--join_timeout_ms", "1000", "--bind", f"[::]:{port}"], stdout=log,
                            stderr=subprocess.STDOUT)
    wait_for_lighthouse(f"http://localhost:{port}", 30)
    return proc


def test_lighthouse_killed_and_restarted(tmp_path):
    """The lighthouse is SIGKILLed while two groups train and started again on its port 5 s later. torchft 0.2.0's
    managers do not retry a quorum request the lighthouse failed, so both groups stop at the quorum timeout with
    one error line (exit code 4, a communication failure) and no traceback; their torchruns restart them, they
    resume from their checkpoints (the later one to restart may heal from the earlier) against the new lighthouse
    and finish, with the same weights in both groups."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path / "lighthouse.log", "w")
    lighthouse = start_lighthouse(port, log)
    groups = Groups(tmp_path, f"http://localhost:{port}")
    options = ("--checkpoint.enable", "--checkpoint.interval", "10", "--fault_tolerance.quorum_timeout_seconds",
               str(QUORUM_TIMEOUT_S))
    try:
        groups.start("group0", 0, options, torchrun=("--max-restarts=1",))
        groups.wait_until(lambda: last_step(tmp_path / "group0") >= 1, "group 0 trained a step", ("group0",))
        groups.start("group1", 1, options, torchrun=("--max-restarts=1",))
        groups.wait_until(lambda: len(groups.steps("group1")) >= 3, "group 1 trained 3 steps with group 0",
                          ("group0", "group1"))
        lighthouse.kill()
        lighthouse.wait()
        killed_at = time.time()
        time.sleep(5)
        lighthouse = start_lighthouse(port, log)
        groups.wait()
    finally:
        groups.stop()
        lighthouse.kill()
        lighthouse.wait()
        log.close()
    groups.assert_finished("group0", "group1")
    first = {}
    for name in ("group0", "group1"):
        output = groups.output(name)
        assert len(re.findall(r"error: replica group \d: no quorum for step \d+ within "
                              r"fault_tolerance.quorum_timeout_seconds = 15 s; the lighthouse at \S+ accepts "
                              r"connections now", output)) == 1, output[-6000:]
        assert "Traceback" not in output, output[-6000:]
        steps = groups.steps(name)
        before, after = ([row for row in steps if row["attempt"] == attempt] for attempt in (0, 1))
        # The stop came at the quorum timeout after the kill (not before: nothing else failed).
        assert max(row["time"] for row in before) < killed_at + QUORUM_TIMEOUT_S
        # Restarted, it resumed from its last checkpoint (a multiple of the interval, at or before the last step it
        # finished), or from the other group, if that one had resumed first and trained on (it heals from it).
        first[name] = after[0]["step"]
        restarted = output[output.index("error: replica group"):]
        assert (first[name] - 1) % 10 == 0 or "recovered the state of step" in restarted, first[name]
        assert first[name] - 1 <= before[-1]["step"] or "recovered the state of step" in restarted, first[name]
        assert after[-1]["step"] == STEPS
    survivor = [row for row in groups.steps("group0") if row["attempt"] == 1]
    assert_same_weights(survivor, [row for row in groups.steps("group1") if row["attempt"] == 1])
    print(f"lighthouse killed at {killed_at:.1f}; " + "; ".join(
        f"{name}: last step {max(r['step'] for r in groups.steps(name) if r['attempt'] == 0)} at "
        f"{max(r['time'] for r in groups.steps(name) if r['attempt'] == 0) - killed_at:+.1f} s, resumed at step "
        f"{first[name]}, first step after {min(r['time'] for r in groups.steps(name) if r['attempt'] == 1) - killed_at:.1f} s"
        for name in ("group0", "group1")))


def test_a_second_copy_of_a_running_group_is_refused_while_the_first_trains_on(tmp_path):
    """Group 1 trains with group 0; a second copy of group 1 is started (its launcher was stopped and its worker left
    training, then the group was launched again). The copy read the same data slice, wrote into the same dump
    folder, and joined the quorum as a group more: 3 groups of group_size 2, group 1's slice counted twice in every
    update. Now it stops with one error line before writing anything, and the two groups train on (10 more steps
    watched, then they are stopped), never more than two in a quorum."""
    from torchft.coordination import LighthouseServer

    from torchtitan.components.health import read_records

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    groups = Groups(tmp_path, lighthouse.address())

    def counted() -> set[int]:
        """The numbers of groups in group 0's quorums so far."""
        return set(groups.replica_groups(0).values()) if (tmp_path / "dump" / "replica_0" / "metrics.jsonl").exists() \
            else set()

    try:
        groups.start("group0", 0, steps=100_000)
        groups.wait_until(lambda: last_step(tmp_path / "group0") >= 1, "group 0 trained a step", ("group0",))
        groups.start("group1", 1, steps=100_000)
        groups.wait_until(lambda: len(groups.steps("group1")) >= 3, "group 1 trained 3 steps with group 0",
                          ("group0", "group1"))
        groups.start("copy", 1, steps=100_000)
        groups.wait_until(lambda: groups.procs["copy"].poll() is not None or 3 in counted(),
                          "the copy stopped or joined", ("group0", "group1"))
        refused_at = last_step(tmp_path / "group1")
        groups.wait_until(lambda: last_step(tmp_path / "group1") >= refused_at + 10, "group 1 trained on",
                          ("group0", "group1"))
    finally:
        groups.stop()
        lighthouse.shutdown()
    output = groups.output("copy")
    assert groups.procs["copy"].returncode != 0
    # One line from the trainer (the rest is plain torchrun's report of a failed worker: run_train.sh's launcher
    # leaves it out).
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in output.split("failed (exitcode")[0], output[-6000:]
    assert "option fault_tolerance.replica_id: replica group 1 is running already" in errors[0], errors
    assert [row["code"] for row in events(tmp_path / "copy")] == [2]
    # Nothing of the copy in group 1's folder: one run's record, every step's metrics once.
    assert len(read_records(tmp_path / "dump" / "replica_1")) == 1
    logged = [row["step"] for row in map(json.loads, (tmp_path / "dump" / "replica_1" / "metrics.jsonl").read_text()
                                         .splitlines()) if "loss" in row]
    assert len(logged) == len(set(logged)) and logged[-1] >= refused_at + 10
    assert counted() <= {1, 2} and set(groups.replica_groups(1).values()) <= {1, 2}, counted()
    assert_same_weights(groups.steps("group0"), groups.steps("group1"))
    print(f"the copy stopped with group 1 at step {refused_at}: {errors[0]}")


def shipped_launch(tmp_path: Path, groups: int, nproc: int, options: list[str], **env: str) -> subprocess.Popen:
    """run_train.sh with FT_GROUPS: the lighthouse it starts and the groups' torchruns, as shipped; only the trainer
    module is the fault injector's (a `python` first in PATH swaps the module name). Output in <tmp>/launch.log,
    each group's fault reports in <tmp>/<group>/."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(f"""#!/bin/bash
args=()
for arg in "$@"; do [ "$arg" = torchtitan.train ] && arg={INJECTOR}; args+=("$arg"); done
exec {sys.executable} "${{args[@]}}"
""")
    (shim / "python").chmod(0o755)
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    environ = {**os.environ, "PATH": f"{shim}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NGPU": str(nproc), "FT_GROUPS": str(groups),
               "FT_LIGHTHOUSE_PORT": str(port), "FAULT_REPORT_DIR": str(tmp_path / "{group}"),
               "FAULT_SLOW_SECONDS": "0.2", **env}
    for name in ("TORCHFT_LIGHTHOUSE", "FT_GROUP_ID"):
        environ.pop(name, None)
    command = [str(REPO / "run_train.sh"), *TINY, "--training.local_batch_size", "2", "--job.dump_folder",
               str(tmp_path / "dump"), "--fault_tolerance.process_group_timeout_ms",
               str(1000 * PROCESS_GROUP_TIMEOUT_S), "--fault_tolerance.join_timeout_seconds", str(JOIN_TIMEOUT_S),
               "--fault_tolerance.quorum_timeout_seconds", "120", *options]
    return subprocess.Popen(command, cwd=REPO, env=environ, stdout=open(tmp_path / "launch.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish_launch(launch: subprocess.Popen, timeout_s: float) -> None:
    try:
        launch.wait(timeout=timeout_s)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGTERM)
            launch.wait(timeout=60)


def committed_pauses(folder: Path) -> tuple[float, float]:
    """(longest, median) time between two committed steps of a group's rank 0."""
    times = sorted(row["time"] for row in events(folder) if row["event"] == "step" and row["committed"])
    gaps = [b - a for a, b in zip(times, times[1:])]
    return max(gaps), sorted(gaps)[len(gaps) // 2]


def bound_s(median: float) -> float:
    from torchtitan.config.job_config import FaultTolerance
    from torchtitan.distributed.lighthouse import survivor_pause_bound_s

    # The configuration's bound, plus the steps around the wait (the failed one run again, the one after).
    return survivor_pause_bound_s(FaultTolerance(process_group_timeout_ms=1000 * PROCESS_GROUP_TIMEOUT_S,
                                                 join_timeout_seconds=JOIN_TIMEOUT_S,
                                                 heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)) + 4 * median


def test_a_group_whose_process_died_leaves_the_quorum_at_once_under_the_shipped_launch(tmp_path):
    """FT_GROUPS=2 NGPU=2 ./run_train.sh: group 1's rank 1 dies after a step's commit vote, before the next quorum.
    Its rank 0 waited in that quorum for the dead rank's request, heartbeating, and took torchrun's SIGTERM as a
    preemption: group 0 waited for it torchrun's 30 s grace, plus the heartbeat timeout (37 s measured). Now the
    signal takes group 1 out of the quorum at once: group 0's longest pause between committed steps is within
    survivor_pause_bound_s (the configuration's 5 + 5 + 1 s) plus 4 median steps, and that wait is booked as its
    own goodput category. Group 1's torchrun restarts it; it heals and both finish. Console lines name the group."""
    steps, kill_at = 80, 30
    launch = shipped_launch(tmp_path, 2, 2, ["--training.steps", str(steps), "--parallelism.data_parallel_shard_degree",
                                              "2"], FAULT_PLAN=f"slow@1:*,sigkill_at_quorum@{kill_at}:1/1",
                            FAULT_ATTEMPT="0", FT_MAX_RESTARTS="1")
    finish_launch(launch, 600)
    output = (tmp_path / "launch.log").read_text(errors="replace")
    assert launch.returncode == 0, output[-6000:]
    injected = [row["step"] for row in events(tmp_path / "1", rank=1) if row.get("kind") == "sigkill_at_quorum"]
    assert injected == [kill_at], "group 1 trained step 29 with group 0, then was killed"
    longest, median = committed_pauses(tmp_path / "0")
    assert longest < bound_s(median), (longest, bound_s(median))
    assert "SIGTERM while waiting for the quorum of step" in output, output[-6000:]
    from torchtitan.components.health import read_records

    waited = read_records(tmp_path / "dump" / "replica_0")[-1].seconds["quorum_wait"]
    assert waited >= longest - 2 * median, (waited, longest)
    assert "[group0 rank0]" in output and "[group1 rank0]" in output
    restarted = [row["step"] for row in events(tmp_path / "1") if row["event"] == "step" and row["attempt"] == 1]
    assert restarted and restarted[-1] == steps
    print(f"group 0's longest pause {longest:.1f} s (bound {bound_s(median):.1f} s, median step {median:.2f} s), "
          f"booked quorum_wait {waited:.1f} s")


def test_a_hung_group_is_left_out_after_the_join_timeout_the_launcher_gives_the_lighthouse(tmp_path):
    """FT_GROUPS=3 ./run_train.sh, the --fault_tolerance.join_timeout_seconds of the job 1 s: group 1 stalls 20 s in
    a step (heartbeating). The launcher started the lighthouse with torchft's 60 s join timeout whatever the job
    said, so groups 0 and 2 waited out the stall; now they form their quorum 1 s after giving up on group 1's
    collective, within survivor_pause_bound_s plus 4 median steps."""
    steps, stall_at = 80, 30
    launch = shipped_launch(tmp_path, 3, 1, ["--training.steps", str(steps)],
                            FAULT_PLAN=f"slow@1:*,sleep@{stall_at}:0/1", FAULT_SLEEP_SECONDS=str(STALL_S))
    finish_launch(launch, 600)
    output = (tmp_path / "launch.log").read_text(errors="replace")
    assert launch.returncode == 0, output[-6000:]
    assert [row["step"] for row in events(tmp_path / "1") if row.get("kind") == "sleep"] == [stall_at]
    for group in ("0", "2"):
        longest, median = committed_pauses(tmp_path / group)
        assert longest < bound_s(median) < STALL_S, (group, longest, bound_s(median))
        print(f"group {group}'s longest pause {longest:.1f} s (bound {bound_s(median):.1f} s)")


def test_no_lighthouse_is_one_line_from_the_shipped_launch(tmp_path):
    """FT_GROUP_ID with a lighthouse that is not there: the trainer's error made torchrun restart the group
    FT_MAX_RESTARTS times, so the line came four times, after four connect timeouts. run_train.sh checks first."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{unused.getsockname()[1]}"
        environ = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                   f"{os.environ['PATH']}", "FT_GROUPS": "2", "FT_GROUP_ID": "0", "TORCHFT_LIGHTHOUSE": address,
                   "NGPU": "1"}
        proc = subprocess.run([str(REPO / "run_train.sh"), *TINY, "--job.dump_folder", str(tmp_path),
                               "--fault_tolerance.connect_timeout_seconds", "1"], cwd=REPO, env=environ,
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: option fault_tolerance.lighthouse: no torchft lighthouse reachable at {address} within 1 s "
        f"(fault_tolerance.connect_timeout_seconds): [Errno 111] Connection refused; start it first "
        f"(torchft_lighthouse, or run_train.sh with FT_GROUPS)"], proc.stderr
    assert not list(tmp_path.iterdir()), "no torchrun, no trainer"
