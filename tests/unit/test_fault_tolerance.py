"""Replica-group fault tolerance (torchtitan/distributed/fault_tolerance.py): its options, the data split over
groups, and a lighthouse that is not there. The run itself: tests/integration/test_replica_groups.py (slow)."""

import copy
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from torchtitan.config import parse_args
from torchtitan.config.job_config import FaultTolerance
from torchtitan.distributed.fault_tolerance import (QuorumError, ReplicaGroup, data_slice, lighthouse_address,
                                                   peer_checkpoint_folders, wait_for_lighthouse)
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
    ([*FT, "--health.spike_sigma", "3"], "option health.spike_sigma: 3.0 cannot be used with fault_tolerance.enable"),
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


class FailedQuorumManager:
    """torchft's Manager when the lighthouse failed the step's quorum request: start_quorum raises its timeout."""

    def start_quorum(self):
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')

    def current_step(self):
        return 45


def test_a_failed_quorum_is_one_error_saying_whether_the_lighthouse_is_back():
    """The group stops (QuorumError: exit code 4, for its torchrun to restart it) with one line naming the option
    and the lighthouse, reachable again or not."""
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.config = FaultTolerance(enable=True, group_size=2, replica_id=1, quorum_timeout_seconds=15)
    group.manager = FailedQuorumManager()
    group.semi_sync = None
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
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.config = FaultTolerance(enable=True, group_size=2, semi_sync_method="diloco", sync_steps=sync_steps,
                                  outer_lr=lr, outer_momentum=momentum)
    group.manager = TwoGroupManager()
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
