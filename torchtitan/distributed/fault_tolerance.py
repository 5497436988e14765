"""Replica-group fault tolerance on torchft (docs/resilience.md).

The data-parallel replicas of a job are separate torchrun jobs, replica groups, each with its own mesh (FSDP, TP, PP
inside it, no replicate dimension across groups). A torchft lighthouse joins the live groups into a quorum at the
start of every step; their gradients are averaged over torchft's managed process group, and the optimizer step is
taken only when torchft's commit protocol agrees. A group that dies is restarted by its own torchrun and, at its
first quorum, receives the model, optimizer, LR schedule, train step and data position from a live peer (torchft's
HTTP checkpoint transport: no disk), while the other groups keep training. With no live peer, a restarted group
resumes from its own checkpoint as any run does. Semi-synchronous modes (torchft's LocalSGD and DiLoCo) sync the
groups every sync_steps steps instead.
"""

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import FaultTolerance as FaultToleranceConfig
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.lighthouse import (connect_to_lighthouse, group_prefix, lighthouse_address,
                                               refuse_a_second_copy, wait_for_lighthouse)
from torchtitan.distributed.utils import placed_like
from torchtitan.errors import UserError
from torchtitan.nn.parameters import checkpoint_name
from torchtitan.tools.logging import logger


class QuorumError(RuntimeError):
    """A step's quorum was not formed: the trainer stops with one line and the exit code of a communication failure
    (EXIT_COMM_FAILURE), so that the group's torchrun restarts it."""


class GroupStopped(Exception):
    """SIGTERM reached this process while it waited for a quorum (or before it asked for one): the group left."""


class QuorumGuard:
    """Between torchft's manager and its client (the manager's `_client`): checks the groups of every quorum before
    the step uses it. A quorum that holds a group twice (a second copy of it, started while it ran) or more groups
    than fault_tolerance.group_size would count a data slice twice in the step's average: every group in it votes
    against committing (torchft does not count the step; it is run again), and the newcomer, a process in its first
    quorum, stops with one error line instead of taking part. Semi-synchronous modes go through the same client."""

    def __init__(self, client: Any, config: FaultToleranceConfig):
        self._client = client
        self._config = config
        self._quorums = 0
        self.problem: str | None = None

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        self._quorums += 1
        self.problem = quorum_problem(list(result.replica_ids), self._config)
        if self.problem is not None:
            if self._quorums == 1:
                raise UserError(f"replica group {self._config.replica_id}: {self.problem}; this process joined last "
                                f"and stops without taking part")
            logger.warning(f"replica group {self._config.replica_id}: {self.problem}; this step is not committed")
        return result

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        return self._client.should_commit(group_rank, step, should_commit and self.problem is None, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def quorum_problem(replica_ids: list[str], config: FaultToleranceConfig) -> str | None:
    """Why a quorum of these torchft replica ids (`torchtitan_ft_<group>:<uuid>`) cannot be committed, or None."""
    groups = [replica.split(":")[0] for replica in replica_ids]
    twice = sorted({group for group in groups if groups.count(group) > 1})
    if twice:
        return (f"the quorum holds {' and '.join(twice)} twice ({', '.join(sorted(replica_ids))}): a second copy of a "
                f"running group joined (option fault_tolerance.replica_id; stop the running copy first: its launcher "
                f"and workers)")
    if len(groups) > config.group_size:
        return (f"the quorum holds {len(groups)} replica groups ({', '.join(sorted(replica_ids))}), more than "
                f"fault_tolerance.group_size = {config.group_size}: launch every group with the same group_size")
    return None


class DiLoCoState(Stateful):
    """What DiLoCo keeps between syncs, as the `diloco` part of the trainer's checkpoints: per parameter, the last
    sync's weights and the outer optimizer's momentum, keyed by the parameter's checkpoint name and laid out as the
    parameter (a DTensor of its sharding, else a tensor), so that DCP reshards them as it does the model. A run
    resumed from disk then continues the outer optimization where it was. (A healing group receives the same state
    from its peer through the state functions torchft's DiLoCo registers with the manager.)"""

    def __init__(self, model_parts: list[torch.nn.Module], diloco: Any):
        fragment = diloco._fragments[0]
        # This rank's local shards, by the names of DiLoCo's ModuleList over the parts.
        self.last_sync: dict[str, torch.Tensor] = fragment.original_parameters
        self.outer: torch.optim.SGD = fragment._outer_optimizer
        self.parameters = [(checkpoint_name(name), f"{index}.{name}", param)
                           for index, part in enumerate(model_parts) for name, param in part.named_parameters()]
        # Whether a checkpoint's DiLoCo state was loaded (else ReplicaGroup.resume takes the loaded weights as the
        # last sync's).
        self.loaded = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for name, key, param in self.parameters:
            state[f"{name}.last_sync"] = placed_like(self.last_sync[key].to(param.device), param)
            if self.outer.param_groups[0]["momentum"]:
                # Zero before the first sync: SGD's first momentum buffer is then momentum * 0 + delta = delta, as
                # when it initialises the buffer to delta itself.
                momentum = self.outer.state.get(param, {}).get("momentum_buffer")
                state[f"{name}.outer_momentum"] = momentum if momentum is not None else torch.zeros_like(param)
        return state

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, key, param in self.parameters:
                loaded = state_dict[f"{name}.last_sync"]
                self.last_sync[key].copy_(loaded.to_local() if isinstance(loaded, DTensor) else loaded)
                if f"{name}.outer_momentum" in state_dict:
                    self.outer.state[param]["momentum_buffer"] = state_dict[f"{name}.outer_momentum"]
        self.loaded = True


class ReplicaGroup:
    """This process's part in the quorum of replica groups: one torchft Manager per process, as torchft requires.

    `states` are what a recovering group receives from a peer, by name: each a Stateful (model, optimizer, LR
    schedulers, data loader, train state). With DiLoCo it also receives DiLoCo's last-sync weights and outer
    optimizer state, which torchft's DiLoCo registers with the manager itself; `diloco_state` is the same state for
    the trainer's checkpoints.
    """

    def __init__(self, config: FaultToleranceConfig, states: dict[str, Stateful], environ: dict[str, str],
                 model_parts: list[torch.nn.Module]):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.config = config
        self.states = states
        self.healed = False
        # SIGTERM: the group leaves the quorum (stop()).
        self.stop_requested = False
        self.stopped = False
        self.waiting_for_quorum = False
        self.address = address = lighthouse_address(config, environ)
        wait_for_lighthouse(address, config.connect_timeout_seconds)
        timeout = timedelta(milliseconds=config.process_group_timeout_ms)
        backend = ProcessGroupGloo if config.process_group == "gloo" else ProcessGroupNCCL

        rank, world_size = dist.get_rank(), dist.get_world_size()
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            store_addr, store_port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        else:
            # One process started without torchrun: the group's store (the other groups reach the primary group's
            # to set up the cross-group process group) is hosted here.
            self.store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", self.store.port

        def manager():
            return Manager(
                pg=backend(timeout=timeout), load_state_dict=self._load_state_dict, state_dict=self._state_dict,
                min_replica_size=config.min_replica_size, rank=rank, world_size=world_size,
                store_addr=store_addr, store_port=store_port,
                # Synchronous quorum: a recovering group loads its peer's state before it reads its step's data
                # and runs forward, so that it takes part in that step with its batch like any other group.
                use_async_quorum=False,
                # torchft derives global ranks from the id's trailing digits (TorchTitan's naming).
                replica_id=group_prefix(config.replica_id), lighthouse_addr=address, timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=config.connect_timeout_seconds))

        # The group's rank 0 publishes its manager server's address in torchrun's store, which outlives a restart
        # of the workers: the other ranks read it only after rank 0 has written this attempt's.
        self.manager = manager() if rank == 0 else None
        dist.barrier()
        if rank != 0:
            self.manager = manager()
        self.manager._client = QuorumGuard(self.manager._client, config)
        self.committed = True
        self.semi_sync = self._semi_sync(model_parts)

    def _semi_sync(self, model_parts: list[torch.nn.Module]) -> Any:
        """torchft's LocalSGD or DiLoCo over every parameter of `model_parts`, or None in per-step mode. Their
        optimizer hooks are not used (the trainer calls sync() after its optimizer step and LR schedule step), so
        they get no inner optimizer."""
        from torchft.local_sgd import DiLoCo, LocalSGD

        config = self.config
        self.diloco_state = None
        model = torch.nn.ModuleList(model_parts)
        if config.semi_sync_method == "local_sgd":
            return LocalSGD(self.manager, model, optimizer=None, sync_every=config.sync_steps)
        if config.semi_sync_method != "diloco":
            return None
        # torch's SGD refuses Nesterov without momentum: outer_momentum 0 is plain SGD.
        outer = torch.optim.SGD(model.parameters(), lr=config.outer_lr, momentum=config.outer_momentum,
                                nesterov=config.outer_momentum > 0)
        # DiLoCo copies the weights as the last sync's ("original" parameters, host memory) and registers them and
        # the outer optimizer's state with the manager: a healing group receives them with the states.
        diloco = DiLoCo(self.manager, [model], inner_optimizer=None, outer_optimizer=outer,
                        sync_every=config.sync_steps)
        self.diloco_state = DiLoCoState(model_parts, diloco)
        return diloco

    def _state_dict(self) -> dict[str, Any]:
        return {name: state.state_dict() for name, state in self.states.items()}

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, state in self.states.items():
            state.load_state_dict(state_dict[name])
        self.healed = True

    def resume(self, step: int) -> None:
        """After a checkpoint load: the quorum compares steps (torchft counts committed quorums: every step, or in
        semi-synchronous modes every sync), so a group resumed at `step` is not taken for one at step 0 (which would
        heal from a peer, or make its peers heal from it). DiLoCo's last-sync weights and outer momentum come from
        the checkpoint (`diloco_state`); from one without them (another run's, an older one) DiLoCo takes the loaded
        weights as the last sync's, with zero momentum: it copied the weights at its construction, before the
        load."""
        syncs = step // self.config.sync_steps if self.semi_sync is not None else step
        self.manager.load_state_dict({"step": syncs, "batches_committed": self.manager.batches_committed()})
        if self.diloco_state is not None and not self.diloco_state.loaded:
            self.semi_sync._save_parameters()

    def start_step(self) -> bool:
        """Join this step's quorum (per-step mode; LocalSGD and DiLoCo join one per sync); True if this group was
        behind and loaded a peer's state (the data iterator must then restart from the loaded position)."""
        if self.semi_sync is not None:
            return False
        self.healed = False
        with self._quorum():
            self.manager.start_quorum()
        self._log_healed()
        return self.healed

    @contextlib.contextmanager
    def _quorum(self) -> Iterator[None]:
        """Around a wait for a quorum: a SIGTERM before or during it ends it (GroupStopped, from stop())."""
        self.waiting_for_quorum = True
        try:
            if self.stop_requested:
                self.stop()
            yield
        except TimeoutError as e:
            raise self._quorum_failed(e) from None
        finally:
            self.waiting_for_quorum = False

    def stop(self) -> None:
        """SIGTERM (torchrun stopping the group after one of its processes failed, or a scheduler stopping the job).
        While this process waits for a quorum, or before it asks for one, the group leaves at once: its heartbeats
        stop (torchft's manager server on the group's rank 0), so that the lighthouse drops it after
        heartbeat_timeout_seconds instead of the other groups waiting for it as long as this process lives (a rank
        whose peer died waits in the quorum for the peer's request, and torchrun gives it 30 s to exit), and the wait
        ends with GroupStopped. In a step, the step is finished first (the trainer saves it if it is committed)."""
        self.stop_requested = True
        if not self.waiting_for_quorum or self.stopped:
            return
        self.stopped = True
        if self.manager._manager is not None:
            self.manager._manager.shutdown()
        raise GroupStopped(f"replica group {self.config.replica_id}: SIGTERM while waiting for the quorum of "
                           f"{self._quorum_name()}; the group left the quorum at once (heartbeats stopped)")

    def _quorum_name(self) -> str:
        # torchft counts committed quorums: steps, or in semi-synchronous modes syncs.
        return (f"step {self.manager.current_step() + 1}" if self.semi_sync is None
                else f"sync {self.manager.current_step() + 1}")

    def sync(self, step: int) -> bool:
        """LocalSGD or DiLoCo, after the optimizer step of `step`: every sync_steps steps, join a quorum, then
        LocalSGD averages the weights over its groups (a failed averaging keeps this group's own weights); DiLoCo
        averages the pseudo-gradients (last sync's weights - this group's) and takes the outer step from the last
        sync's weights (a failed averaging goes back to them). True if this group was behind and loaded a peer's
        state at the quorum (its train state is then the peer's; it takes part in the sync with the peer's weights)."""
        if self.semi_sync is None or step % self.config.sync_steps:
            return False
        self.healed = False
        with self._quorum():
            if self.config.semi_sync_method == "local_sgd":
                self.semi_sync.sync()
            else:
                # DiLoCo's optimizer hook counts steps from its construction, which neither a resume nor a heal
                # moves; the groups' syncs are at the train steps they share. So this runs what the hook runs at
                # its sync_every-th step (one fragment, the whole model; no sync delay).
                self.manager.start_quorum()
                fragment = self.semi_sync._fragments[0]
                fragment.prepare_sync()
                fragment.perform_sync()
        self._log_healed()
        return self.healed

    def _log_healed(self) -> None:
        if self.healed:
            logger.warning(f"replica group {self.config.replica_id}: recovered the state of step "
                           f"{self.states['train_state'].step} from a live peer ({self.manager.num_participants()} "
                           f"group(s) in the quorum)")

    def _quorum_failed(self, error: TimeoutError) -> QuorumError:
        # torchft's manager asks the lighthouse once per quorum: a request the lighthouse failed (it was down, even
        # briefly) is not retried, and the manager's next quorum re-raises this one's error. So the group stops;
        # its torchrun restarts it, and it resumes from its checkpoint or heals from a live peer.
        try:
            connect_to_lighthouse(self.address, 5.0)
            now = "accepts connections now (it was restarted, or the other groups did not reach this step)"
        except OSError:
            now = "is unreachable"
        when = self._quorum_name()
        return QuorumError(
            f"replica group {self.config.replica_id}: no quorum for {when} within "
            f"fault_tolerance.quorum_timeout_seconds = {self.config.quorum_timeout_seconds:g} s; the lighthouse at "
            f"{self.address} {now} ({error}); this group stops so that its torchrun restarts it (from its "
            f"checkpoint, or healing from a live group)")

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Average every gradient over the groups of the quorum (each rank its own shard: the groups' layouts are
        the same). torchft divides by the number of participants; a failed collective is recorded by the manager
        and makes should_commit() false. LocalSGD and DiLoCo sync at their syncs instead."""
        if self.semi_sync is not None:
            return
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in parameters if p.grad is not None]
        for work in [self.manager.allreduce(grad) for grad in grads]:
            work.wait()

    def should_commit(self) -> bool:
        """Whether this step's update is taken (torchft's commit vote within the group; enough groups took part and
        none of this group's collectives failed). When not, the step is redone with the next batch. With LocalSGD or
        DiLoCo, every step is this group's own and is taken."""
        if self.semi_sync is not None:
            return True
        self.committed = self.manager.should_commit()
        if not self.committed:
            logger.warning(f"replica group {self.config.replica_id}: step {self.manager.current_step() + 1} not "
                           f"committed (a group failed during it, or fewer than min_replica_size = "
                           f"{self.config.min_replica_size} took part); redone with the next batch")
        return self.committed

    def participants(self) -> int:
        return self.manager.num_participants()

    def shutdown(self) -> None:
        # A group stopped in a quorum has its manager server shut down, and a quorum request still pending in
        # torchft's thread: the process exits without waiting for it.
        if not self.stopped:
            self.manager.shutdown(wait=False)


def join_checks(config: FaultToleranceConfig, environ: dict[str, str]) -> None:
    """Before a group's process writes anything: the lighthouse is reachable (within connect_timeout_seconds), and
    this replica group is not running already (one error line each)."""
    address = lighthouse_address(config, environ)
    wait_for_lighthouse(address, config.connect_timeout_seconds)
    refuse_a_second_copy(config, address)


def data_slice(config: FaultToleranceConfig, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(rank, degree) of this data-parallel rank in the data split over all groups: group g reads slice g of
    group_size, cut again by its own data-parallel degree. Every sample is read once while all groups are live."""
    if not config.enable:
        return dp_rank, dp_degree
    return config.replica_id * dp_degree + dp_rank, config.group_size * dp_degree


def peer_checkpoint_folders(config: JobConfig) -> list[Path]:
    """The checkpoint folders of the other replica groups (`<dump folder>/replica_<i>/<checkpoint.folder>`, the
    layout main() gives each group), which a group resumes from when theirs are newer; none without fault tolerance
    or with an absolute checkpoint.folder."""
    ft = config.fault_tolerance
    if not ft.enable or Path(config.checkpoint.folder).is_absolute():
        return []
    jobs = Path(config.job.dump_folder).parent
    return [jobs / f"replica_{group}" / config.checkpoint.folder for group in range(ft.group_size)
            if group != ft.replica_id]


def setup_fault_tolerance(config: FaultToleranceConfig, states: dict[str, Stateful], environ: dict[str, str],
                          model_parts: list[torch.nn.Module]) -> ReplicaGroup | None:
    """This process's replica group, or None when fault_tolerance.enable is off. `model_parts` hold every parameter
    (LocalSGD and DiLoCo sync them)."""
    return ReplicaGroup(config, states, environ, model_parts) if config.enable else None
