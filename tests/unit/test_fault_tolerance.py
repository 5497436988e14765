"""Replica-group fault tolerance (torchtitan/distributed/fault_tolerance.py): its options, the data split over
groups, and a lighthouse that is not there. The run itself: tests/integration/test_replica_groups.py (slow)."""

import copy
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from torchtitan.config import parse_args
from torchtitan.config.job_config import FaultTolerance
from torchtitan.distributed.fault_tolerance import (GroupStopped, QuorumError, QuorumGuard, ReplicaGroup, data_slice,
                                                   lighthouse_address, peer_checkpoint_folders, quorum_problem,
                                                   wait_for_lighthouse)
from torchtitan.distributed.lighthouse import main as lighthouse_main
from torchtitan.distributed.utils import LAUNCHER_PID_ENV, end_with_launcher
from torchtitan.distributed.lighthouse import (heartbeats, lighthouse_flags, refuse_a_second_copy,
                                               survivor_pause_bound_s)
from torchtitan.errors import UserError

REPO = Path(__file__).resolve().parents[2]
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "3"]


@pytest.mark.parametrize("argv, message", [
    ([*FT, "--fault_tolerance.replica_id", "3"],
     "option fault_tolerance.replica_id: 3 is not a group of group_size = 3; valid: 0 to 2"),
    (["--fault_tolerance.enable"],
     "option fault_tolerance.group_size: 0 must be the number of replica groups (1 or more) when "
     "fault_tolerance.enable is set"),
    ([*FT, "--fault_tolerance.min_replica_size", "4"],
     "option fault_tolerance.min_replica_size: 4 must be in [1, group_size = 3]"),
    ([*FT, "--fault_tolerance.quorum_timeout_seconds", "0"],
     "option fault_tolerance.quorum_timeout_seconds: 0.0 must be positive"),
    ([*FT, "--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "0"],
     "option fault_tolerance.sync_steps: 0 must be positive"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.outer_lr", "0"],
     "option fault_tolerance.outer_lr: 0.0 must be positive"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.outer_momentum", "1"],
     "option fault_tolerance.outer_momentum: 1.0 must be in [0, 1)"),
    ([*FT, "--health.spike_sigma", "3"], "option health.spike_sigma > 0: does not compose with fault_tolerance.enable"),
    ([*FT, "--fault_tolerance.process_group", "mpi"], "option fault_tolerance.process_group: 'mpi' is not one of"),
])
def test_bad_settings_are_one_error_naming_the_option(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse_args(argv)


def test_torchtitan_section_is_accepted():
    config = parse_args([*FT, "--fault_tolerance.replica_id", "2", "--fault_tolerance.min_replica_size", "2"])
    assert (config.fault_tolerance.replica_id, config.fault_tolerance.min_replica_size) == (2, 2)


def test_a_group_knows_the_other_groups_checkpoint_folders():
    # main() puts group i under <dump folder>/replica_i (as run_train.sh's FT_GROUPS groups share one dump folder).
    config = parse_args([*FT, "--fault_tolerance.replica_id", "1", "--job.dump_folder", "/jobs/run/replica_1",
                         "--checkpoint.folder", "ckpt"])
    assert peer_checkpoint_folders(config) == [Path("/jobs/run/replica_0/ckpt"), Path("/jobs/run/replica_2/ckpt")]
    assert peer_checkpoint_folders(parse_args(["--checkpoint.folder", "ckpt"])) == []
    config.checkpoint.folder = "/shared/ckpt"  # one folder for every group: no peers to look at
    assert peer_checkpoint_folders(config) == []


def test_each_group_reads_its_own_slice_of_the_data():
    config = FaultTolerance(enable=True, group_size=3, replica_id=1)
    # Group 1 of 3, with 2 data-parallel ranks inside it: slices 2 and 3 of 6; all slices once over the groups.
    assert [data_slice(config, rank, 2) for rank in range(2)] == [(2, 6), (3, 6)]
    slices = {data_slice(FaultTolerance(enable=True, group_size=3, replica_id=g), r, 2)[0]
              for g in range(3) for r in range(2)}
    assert slices == set(range(6))
    assert data_slice(FaultTolerance(), 1, 2) == (1, 2)


def test_no_lighthouse_is_one_error():
    with pytest.raises(UserError, match=r"option fault_tolerance\.lighthouse: not set and TORCHFT_LIGHTHOUSE"):
        lighthouse_address(FaultTolerance(enable=True, group_size=1), {})
    assert lighthouse_address(FaultTolerance(enable=True, group_size=1), {"TORCHFT_LIGHTHOUSE": "http://h:1"}) == \
        "http://h:1"
    # A port nothing listens on: bound, never listening.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        with pytest.raises(UserError, match=rf"no torchft lighthouse reachable at http://127\.0\.0\.1:{port} within "
                                            rf"0\.2 s \(fault_tolerance\.connect_timeout_seconds\)"):
            wait_for_lighthouse(f"http://127.0.0.1:{port}", 0.2)
    with pytest.raises(UserError, match=r"'lighthouse' is not an address of the form http://host:port"):
        wait_for_lighthouse("lighthouse", 0.2)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        wait_for_lighthouse(f"127.0.0.1:{listening.getsockname()[1]}", 0.2)


@pytest.mark.parametrize("env, message", [
    ({"FT_GROUPS": "0"}, "error: FT_GROUPS='0' is not a positive integer: the number of replica groups"),
    ({"FT_GROUPS": "2", "FT_GROUP_ID": "2"},
     "error: FT_GROUP_ID='2' is not a replica group of FT_GROUPS=2; valid: 0 to 1"),
    ({"FT_GROUPS": "2", "FT_GROUP_ID": "1"}, "error: FT_GROUP_ID is set but TORCHFT_LIGHTHOUSE is not"),
])
def test_run_train_sh_refuses_bad_group_settings(env, message):
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHFT_LIGHTHOUSE", "FT_GROUP_ID")}
    proc = subprocess.run(["bash", str(REPO / "run_train.sh")], env={**base, "NGPU": "1", **env},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.strip() == proc.stderr.strip().splitlines()[0]
    assert proc.stderr.startswith(message), proc.stderr


# Stand-ins for the commands run_train.sh runs: each records what it was given in $FAKE_DIR/calls.
FAKE_LAUNCH_COMMANDS = {
    # The lighthouse module's answers, and the group's torchrun (torchtitan.launch), which trains until SIGTERM.
    "python": """#!/bin/bash
case "$2 $3" in
  "torchtitan.distributed.lighthouse flags")
    echo "lighthouse flags ${*:4}" >> "$FAKE_DIR/calls"
    echo "--min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 5000";;
  "torchtitan.distributed.lighthouse check") echo "check $4" >> "$FAKE_DIR/calls";;
  "torchtitan.launch "*)
    group=$(printf '%s\\n' "$@" | grep -A1 -x -- --fault_tolerance.replica_id | tail -1)
    echo "$$" > "$FAKE_DIR/launcher$group.pid"
    echo "launcher $group: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" >> "$FAKE_DIR/calls"
    trap 'echo "launcher $group SIGTERM" >> "$FAKE_DIR/calls"; kill $!; exit 143' TERM
    sleep 60 &
    wait;;
  *) exit 3;;
esac
""",
    "torchft_lighthouse": """#!/bin/bash
echo "torchft_lighthouse $*" >> "$FAKE_DIR/calls"
echo "$$" > "$FAKE_DIR/lighthouse.pid"
trap 'echo "lighthouse SIGTERM" >> "$FAKE_DIR/calls"; kill $!; exit 143' TERM
sleep 60 &
wait
""",
}


@pytest.fixture
def fake_launch(tmp_path):
    for name, text in FAKE_LAUNCH_COMMANDS.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("TORCHFT_LIGHTHOUSE", "FT_GROUP_ID")}
    return tmp_path, {**env, "PATH": f"{tmp_path}{os.pathsep}{env['PATH']}", "FAKE_DIR": str(tmp_path), "NGPU": "1"}


def wait_for(path: Path, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return int(path.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" if Path(f"/proc/{pid}").exists() else True


def test_sigterm_to_run_train_sh_stops_every_group_then_the_lighthouse(fake_launch):
    """FT_GROUPS=2: the script started each group's torchrun in a subshell and, on SIGTERM, signalled the subshells:
    the torchruns and their workers trained on. Now each subshell becomes its group's torchrun, and the script
    signals them, waits for them, then stops the lighthouse. Each group's console lines start with its name."""
    folder, env = fake_launch
    script = subprocess.Popen(["bash", str(REPO / "run_train.sh")], env={**env, "FT_GROUPS": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        launchers = [wait_for(folder / f"launcher{group}.pid", script) for group in (0, 1)]
        lighthouse = wait_for(folder / "lighthouse.pid", script)
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=30) == 143
    finally:
        script.kill()
        script.communicate()
    calls = (folder / "calls").read_text().splitlines()
    # The lighthouse with the flags the job's options give (tested above), asked with the options the groups get.
    assert calls[:2] == [f"lighthouse flags --job.config_file {REPO}/train_configs/debug_model.toml "
                         f"--fault_tolerance.enable --fault_tolerance.group_size 2 --fault_tolerance.min_replica_size 1",
                         "torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 5000 "
                         "--bind [::]:29510"]
    assert sorted(calls[2:4]) == ["launcher 0: [group0 rank${rank}] ", "launcher 1: [group1 rank${rank}] "]
    assert sorted(calls[4:6]) == ["launcher 0 SIGTERM", "launcher 1 SIGTERM"] and calls[6:] == ["lighthouse SIGTERM"]
    assert not any(alive(pid) for pid in [*launchers, lighthouse])


def test_run_train_sh_with_a_group_id_becomes_the_groups_torchrun(fake_launch):
    """FT_GROUP_ID=1: the group is checked against the lighthouse once, before torchrun (a refused group failed in
    every one of torchrun's restarts, one error line each), and the script's PID is then the torchrun's, so that
    a signal to it reaches the group."""
    folder, env = fake_launch
    script = subprocess.Popen(["bash", str(REPO / "run_train.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "FT_GROUPS": "2", "FT_GROUP_ID": "1", "TORCHFT_LIGHTHOUSE": "http://h:1"})
    try:
        assert wait_for(folder / "launcher1.pid", script) == script.pid
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=30) == 143
    finally:
        script.kill()
        script.communicate()
    assert (folder / "calls").read_text().splitlines() == ["check 1", "launcher 1: [group1 rank${rank}] ",
                                                           "launcher 1 SIGTERM"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_worker_ends_with_its_launcher():
    """torchrun starts each worker in a session of its own: a SIGKILLed torchrun left its workers training (a replica
    group relaunched beside them was the group twice). A worker of torchtitan.launch now gets SIGTERM when its
    launcher dies; one whose launcher died before it asked stops at once."""
    read_end, write_end = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # the launcher: starts a worker, then waits
        os.close(read_end)
        if os.fork() == 0:
            end_with_launcher({LAUNCHER_PID_ENV: str(os.getppid())})
            os.write(write_end, b"r")
            time.sleep(60)
            os._exit(0)
        os.close(write_end)
        time.sleep(60)
        os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"r"
        os.kill(launcher, signal.SIGKILL)
        os.waitpid(launcher, 0)
        # The worker holds the pipe's other end: it is closed once the worker is gone.
        assert select.select([read_end], [], [], 10)[0] and os.read(read_end, 1) == b""
    finally:
        os.close(read_end)
    orphan = os.fork()
    if orphan == 0:
        end_with_launcher({LAUNCHER_PID_ENV: "1"})
        os._exit(0)
    assert os.waitpid(orphan, 0)[1] == signal.SIGTERM


def bare_group(config: FaultTolerance, manager) -> ReplicaGroup:
    """A ReplicaGroup around a stand-in for torchft's Manager (no lighthouse, no process group)."""
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.config, group.manager, group.semi_sync = config, manager, None
    group.stop_requested = group.stopped = group.waiting_for_quorum = False
    return group


class FailedQuorumManager:
    """torchft's Manager when the lighthouse failed the step's quorum request: start_quorum raises its timeout."""

    def start_quorum(self):
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')

    def current_step(self):
        return 45


def test_a_failed_quorum_is_one_error_saying_whether_the_lighthouse_is_back():
    """The group stops (QuorumError: exit code 4, for its torchrun to restart it) with one line naming the option
    and the lighthouse, reachable again or not."""
    group = bare_group(FaultTolerance(enable=True, group_size=2, replica_id=1, quorum_timeout_seconds=15),
                       FailedQuorumManager())
    with socket.socket() as listening:
        listening.bind(("localhost", 0))
        listening.listen()
        group.address = f"http://localhost:{listening.getsockname()[1]}"
        with pytest.raises(QuorumError) as back:
            group.start_step()
    with pytest.raises(QuorumError) as gone:
        group.start_step()
    for error, state in ((back, "accepts connections now"), (gone, "is unreachable")):
        assert str(error.value).startswith(
            f"replica group 1: no quorum for step 46 within fault_tolerance.quorum_timeout_seconds = 15 s; the "
            f"lighthouse at {group.address} {state}"), str(error.value)


# ----------------------------------------------------------------------------------------------------------------
# One replica group, once


class Quorum:
    def __init__(self, *replica_ids: str):
        self.replica_ids = list(replica_ids)


class RecordingClient:
    """torchft's manager client: answers each quorum with the next of `quorums`; records the commit votes."""

    def __init__(self, *quorums: Quorum):
        self.quorums = list(quorums)
        self.votes = []

    def _quorum(self, **kwargs):
        return self.quorums.pop(0)

    def should_commit(self, group_rank, step, should_commit, timeout):
        self.votes.append(should_commit)
        return should_commit


def test_a_quorum_holding_a_group_twice_is_refused_by_the_newcomer_and_committed_by_none(caplog):
    """A second copy of replica group 1 (its launcher stopped, its worker left training, the group launched again)
    was a fourth group of three: every update counted group 1's data slice twice. Now the copy in its first quorum
    stops with one error line; a running group that sees such a quorum votes against committing it; so does every
    group of a quorum larger than group_size."""
    config = FaultTolerance(enable=True, group_size=3, replica_id=1)
    twice = Quorum("torchtitan_ft_0:a", "torchtitan_ft_1:b", "torchtitan_ft_1:c", "torchtitan_ft_2:d")
    newcomer = QuorumGuard(RecordingClient(twice), config)
    with pytest.raises(UserError, match=re.escape(
            "replica group 1: the quorum holds torchtitan_ft_1 twice (torchtitan_ft_0:a, torchtitan_ft_1:b, "
            "torchtitan_ft_1:c, torchtitan_ft_2:d): a second copy of a running group joined (option "
            "fault_tolerance.replica_id; stop the running copy first: its launcher and workers); this process joined "
            "last and stops without taking part")):
        newcomer._quorum(step=0)
    incumbent = QuorumGuard(client := RecordingClient(Quorum("torchtitan_ft_0:a", "torchtitan_ft_1:b"), twice,
                                                      Quorum("torchtitan_ft_1:b", "torchtitan_ft_2:d")), config)
    for _ in range(3):
        incumbent._quorum(step=0)
        incumbent.should_commit(0, 0, True, timeout=None)
    assert client.votes == [True, False, True]
    assert "this step is not committed" in caplog.text
    too_many = Quorum("torchtitan_ft_0:a", "torchtitan_ft_1:b", "torchtitan_ft_2:d")
    other_size = QuorumGuard(client := RecordingClient(Quorum("torchtitan_ft_0:a"), too_many),
                             FaultTolerance(enable=True, group_size=2, replica_id=0))
    other_size._quorum()
    other_size._quorum()
    assert not other_size.should_commit(0, 0, True, timeout=None) and client.votes == [False]
    assert quorum_problem(too_many.replica_ids, FaultTolerance(enable=True, group_size=2)) == (
        "the quorum holds 3 replica groups (torchtitan_ft_0:a, torchtitan_ft_1:b, torchtitan_ft_2:d), more than "
        "fault_tolerance.group_size = 2: launch every group with the same group_size")


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    yield server.address()
    server.shutdown()


class Heartbeats:
    """A replica group's rank 0 as the lighthouse hears it: a heartbeat every 0.1 s, as torchft's manager sends."""

    def __init__(self, address: str, replica_id: str):
        from torchft.coordination import LighthouseClient

        self.client = LighthouseClient(address, timedelta(seconds=5))
        self.replica_id = replica_id
        self.beating = threading.Event()
        self.beating.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.beating.is_set():
            self.client.heartbeat(self.replica_id)
            time.sleep(0.1)

    def stop(self):
        self.beating.clear()
        self.thread.join()


def test_a_second_copy_of_a_running_group_stops_before_it_joins(lighthouse):
    """Group 1 heartbeats: another process of group 1 stops with one line before writing anything or joining; group
    0's does not. Once group 1's process died (a crash: its torchrun restarts it), its restart waits until the
    lighthouse has dropped the dead process (its heartbeat timeout, 1 s here), so that no quorum holds both."""
    running = Heartbeats(lighthouse, "torchtitan_ft_1:6f1c")
    config = FaultTolerance(enable=True, group_size=2, replica_id=1, heartbeat_timeout_seconds=1.0)
    try:
        time.sleep(0.3)
        with pytest.raises(UserError, match=re.escape(
                f"option fault_tolerance.replica_id: replica group 1 is running already (the lighthouse at "
                f"{lighthouse} hears from torchtitan_ft_1:6f1c); this copy stops without joining. Stop the running "
                f"one first (its launcher and workers), or start another group id below fault_tolerance.group_size "
                f"= 2")):
            refuse_a_second_copy(config, lighthouse)
        refuse_a_second_copy(FaultTolerance(enable=True, group_size=2, replica_id=0), lighthouse)
    finally:
        running.stop()
    refuse_a_second_copy(config, lighthouse)
    assert heartbeats(lighthouse)["torchtitan_ft_1:6f1c"] >= 1.0


class WaitingManager:
    """torchft's Manager waiting for a quorum that does not form (a peer of the group died before asking)."""

    def __init__(self):
        self.asked = False
        self._manager = self
        self.server_shut_down = False

    def start_quorum(self):
        self.asked = True
        threading.Event().wait(30)

    def shutdown(self):
        self.server_shut_down = True

    def current_step(self):
        return 7


def test_sigterm_while_waiting_for_a_quorum_leaves_it_at_once():
    """torchrun stops a group whose process died with SIGTERM to the others; one that waits for the quorum (for the
    dead one's request) took it as a preemption and waited on, heartbeating, for torchrun's 30 s: the other groups
    waited for it as long. Now the signal stops the group's heartbeats and ends the wait; one that arrives before
    the quorum keeps the group from asking."""
    group = bare_group(FaultTolerance(enable=True, group_size=2, replica_id=1), WaitingManager())
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: group.stop())
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        with pytest.raises(GroupStopped, match="replica group 1: SIGTERM while waiting for the quorum of step 8; the "
                                               "group left the quorum at once"):
            group.start_step()
        assert time.monotonic() - started < 5 and group.manager.server_shut_down
        late = bare_group(group.config, WaitingManager())
        late.stop_requested = True  # SIGTERM arrived during the step before
        with pytest.raises(GroupStopped):
            late.start_step()
        assert not late.manager.asked and late.manager.server_shut_down
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_launchers_give_the_lighthouse_the_jobs_timeouts(capsys):
    """run_train.sh and multinode_trainer.slurm start the lighthouse with these flags (it had torchft's 60 s join
    timeout whatever the job said; tests/integration/test_slurm.py and test_replica_groups.py check the scripts)."""
    config = FaultTolerance(enable=True, group_size=3, min_replica_size=2, join_timeout_seconds=1.5,
                            heartbeat_timeout_seconds=4.0, process_group_timeout_ms=5000)
    assert lighthouse_flags(config) == ["--min_replicas", "2", "--join_timeout_ms", "1500", "--heartbeat_timeout_ms",
                                        "4000"]
    assert survivor_pause_bound_s(config) == 5.0 + 4.0 + 1.5
    assert lighthouse_main(["flags", *FT, "--fault_tolerance.join_timeout_seconds", "1.5"]) == 0
    assert capsys.readouterr().out.split() == ["--min_replicas", "1", "--join_timeout_ms", "1500",
                                               "--heartbeat_timeout_ms", "5000"]


class TwoGroupManager:
    """torchft's Manager as DiLoCo uses it, in one of two groups: each all-reduce averages the tensor with the other
    group's (`peer`, in order), and the state functions DiLoCo registers are kept (what a healing group receives from
    this one, with the trainer's states)."""
    _use_async_quorum = False

    def __init__(self):
        self.peer: list[torch.Tensor] = []
        self.state_fns = {}

    def register_state_dict_fn(self, key, load_state_dict, state_dict):
        self.state_fns[key] = (load_state_dict, state_dict)

    def start_quorum(self):
        pass

    def current_step(self):
        return 0

    def should_commit(self):
        return True

    def batches_committed(self):
        return 0

    def load_state_dict(self, state_dict):
        pass

    def allreduce(self, tensor, should_quantize=False):
        tensor.add_(self.peer.pop(0)).div_(2)
        return FinishedWork()


class FinishedWork:
    def wait(self):
        return True


def diloco_group(model: torch.nn.Module, lr: float, momentum: float, sync_steps: int) -> ReplicaGroup:
    group = bare_group(FaultTolerance(enable=True, group_size=2, semi_sync_method="diloco", sync_steps=sync_steps,
                                      outer_lr=lr, outer_momentum=momentum), TwoGroupManager())
    group.semi_sync = group._semi_sync([model])
    return group


def inner_steps_then_sync(group: ReplicaGroup, model: torch.nn.Module, change: list[torch.Tensor],
                          peer: list[torch.Tensor], step: int) -> None:
    """`change`: what this group's sync_steps inner steps did to the weights; `peer`: the other group's
    pseudo-gradient at this sync."""
    with torch.no_grad():
        for p, d in zip(model.parameters(), change):
            p.add_(d)
    group.manager.peer = [t.clone() for t in peer]
    assert not group.sync(step)


def test_diloco_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient():
    """DiLoCo (arXiv 2311.08105, Algorithm 1) at each sync: pseudo-gradient = last sync's weights - this group's
    weights after sync_steps inner steps, averaged over the groups; then SGD with Nesterov momentum from the last
    sync's weights: buf = momentum * buf + delta (buf = delta at the first sync), w = w_sync - lr * (delta +
    momentum * buf). Two syncs exercise the momentum; a group healed with this one's states takes the same next
    step; between syncs the weights are the group's own."""
    torch.manual_seed(0)
    lr, momentum, sync_steps = 0.7, 0.9, 3
    model = torch.nn.Linear(4, 3)
    group = diloco_group(model, lr, momentum, sync_steps)
    synced = [p.detach().clone() for p in model.parameters()]
    buf = None
    for sync in (1, 2):
        change = [torch.randn_like(p) for p in synced]
        peer = [torch.randn_like(p) for p in synced]
        with torch.no_grad():
            model.weight.add_(1.0)
        group.sync(sync * sync_steps - 1)  # not a sync step: the weights stay this group's own
        torch.testing.assert_close(model.weight.detach(), synced[0] + 1.0)
        with torch.no_grad():
            model.weight.sub_(1.0)
        local = [w + d for w, d in zip(synced, change)]
        inner_steps_then_sync(group, model, change, peer, sync * sync_steps)
        delta = [((w - x) + q) / 2 for w, x, q in zip(synced, local, peer)]
        buf = delta if buf is None else [momentum * b + d for b, d in zip(buf, delta)]
        synced = [w - lr * (d + momentum * b) for w, d, b in zip(synced, delta, buf)]
        for p, expected in zip(model.parameters(), synced):
            torch.testing.assert_close(p.detach(), expected)

    # A group that heals from this one receives the model's state and what DiLoCo registered with the manager (its
    # last sync's weights and the outer momentum): its next sync then equals this group's. Without the momentum it
    # would not (buf differs from zero).
    healed_model = torch.nn.Linear(4, 3)
    healed = diloco_group(healed_model, lr, momentum, sync_steps)
    healed_model.load_state_dict(model.state_dict())
    (key, (_, save)), = group.manager.state_fns.items()
    # A copy, as torchft's transport sends: the optimizer state holds the sender's momentum buffer itself.
    healed.manager.state_fns[key][0](copy.deepcopy(save()))
    change = [torch.randn_like(p) for p in synced]
    peer = [torch.randn_like(p) for p in synced]
    inner_steps_then_sync(group, model, change, peer, 3 * sync_steps)
    inner_steps_then_sync(healed, healed_model, change, peer, 3 * sync_steps)
    for p, q in zip(model.parameters(), healed_model.parameters()):
        torch.testing.assert_close(p, q)


def test_diloco_resumed_from_a_checkpoint_syncs_from_the_loaded_weights():
    """DiLoCo copies the weights at its construction, before the trainer loads the checkpoint: resume() takes the
    loaded weights as the last sync's. With no change and a zero pseudo-gradient from the peer, the next sync then
    leaves the weights as loaded (from the construction's copy it would move them back towards the initial ones)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    group = diloco_group(model, 0.7, 0.9, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    loaded = [p.detach().clone() for p in model.parameters()]
    group.resume(6)
    zero = [torch.zeros_like(p) for p in loaded]
    inner_steps_then_sync(group, model, zero, zero, 9)
    for p, expected in zip(model.parameters(), loaded):
        torch.testing.assert_close(p.detach(), expected)


def test_diloco_state_in_a_checkpoint_resumes_the_outer_optimization(tmp_path):
    """The `diloco` part of a checkpoint (DiLoCoState): a group saved between two syncs (its weights its own, the
    last sync's elsewhere, the outer momentum non-zero) and resumed into a fresh DiLoCo takes the next sync exactly as
    the group that went on. Without it the resumed group would sync from the loaded weights with zero momentum."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    lr, momentum, sync_steps = 0.7, 0.9, 3
    model = torch.nn.Linear(4, 3)
    group = diloco_group(model, lr, momentum, sync_steps)
    for sync in (1, 2):
        inner_steps_then_sync(group, model, [torch.randn_like(p) for p in model.parameters()],
                              [torch.randn_like(p) for p in model.parameters()], sync * sync_steps)
    with torch.no_grad():  # an inner step after the last sync: the checkpoint is taken between syncs
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    dcp.save({"model": model.state_dict(), "diloco": group.diloco_state.state_dict()}, checkpoint_id=tmp_path,
             no_dist=True)

    resumed_model = torch.nn.Linear(4, 3)
    resumed = diloco_group(resumed_model, lr, momentum, sync_steps)
    state = {"model": resumed_model.state_dict(), "diloco": resumed.diloco_state.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    resumed_model.load_state_dict(state["model"])
    resumed.diloco_state.load_state_dict(state["diloco"])
    resumed.resume(2 * sync_steps + 1)
    change = [torch.randn_like(p) for p in model.parameters()]
    peer = [torch.randn_like(p) for p in model.parameters()]
    inner_steps_then_sync(group, model, change, peer, 3 * sync_steps)
    inner_steps_then_sync(resumed, resumed_model, change, peer, 3 * sync_steps)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
