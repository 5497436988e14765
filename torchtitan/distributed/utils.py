"""Process-group set-up, seeding, sharding-independent weight init and gradient clipping across meshes."""

import contextlib
import ctypes
import datetime
import os
import random
import signal
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.distributed import torch_compat
from torchtitan.distributed.fake import init_fake_process_group
from torchtitan.errors import UserError
from torchtitan.models.llama3.model import Initializer, parameter_generator
from torchtitan.tools.logging import logger, warn_once


# What bounds rank-to-rank waits right now, named in the message when one fails: the option, its value, and whether
# the process is still joining the group.
_timeout_in_force: dict = {"option": "comm.init_timeout_seconds", "seconds": None, "joining": True}

# Set by torchtitan.launch for its workers: the PID of the torchrun agent that starts them.
LAUNCHER_PID_ENV = "TORCHTITAN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def end_with_launcher(environ: dict[str, str]) -> None:
    """A worker of torchtitan.launch gets SIGTERM when its torchrun agent dies (Linux's parent-death signal), as
    when the agent is stopped by a signal it can handle (it then signals its workers itself). torchrun starts each
    worker in a session of its own, so without this a SIGKILLed agent left its workers training: a relaunched
    replica group beside them was the same group twice. A worker whose agent died before this is set stops at once."""
    launcher = environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGTERM)



def placed_like(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`shard` as this rank's shard of a DTensor shaped and placed like `like` (or itself where `like` is a plain
    tensor)."""
    if not isinstance(like, DTensor):
        return shard
    return DTensor.from_local(shard, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())

def device_type() -> str:
    """The one place that chooses the accelerator: CUDA when present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_kind: str) -> str:
    return "nccl" if device_kind == "cuda" else "gloo"


def cuda_device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The GPU of this process among the `visible` ones. `local_world_size` processes of this node share them
    (torchrun's LOCAL_WORLD_SIZE; 1 where a scheduler starts each task alone, with GPUs of its own): local rank r
    takes GPU r. A scheduler that shows each task only its own GPU(s) may still number the tasks of a node 0..7:
    such a process takes GPU `local_rank % visible` of its own."""
    if local_world_size > visible:
        raise UserError(f"{local_world_size} training processes on this node (NGPU / --nproc_per_node) but only "
                        f"{visible} GPU(s) visible (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {visible} per node")
    return local_rank % visible


def nccl_environment(trace_buf_size: int, trace_folder: str | None) -> dict[str, str]:
    """What NCCL runs need in the environment, unless the user set it. On NCCL a failed or timed-out collective is
    seen by the watchdog thread, not raised in the training thread: with async error handling 1 the watchdog aborts
    the communicators and ends the process (SIGABRT), so that a dead peer never leaves the others hanging, and with
    the flight recorder on, each rank first dumps its last collectives (`trace_buf_size` entries) into
    `trace_folder`/nccl_trace_rank_<R>, which tells which rank stalled in which collective."""
    environment = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": str(trace_buf_size)}
    if trace_buf_size > 0:
        environment["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        if trace_folder is not None:
            environment["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(trace_folder, "nccl_trace_rank_")
    return environment


def init_distributed(init_timeout_seconds: int, trace_buf_size: int = 0, trace_folder: str | None = None,
                     fake_rank: tuple[int, int] | None = None, fake_on_device: bool = False) -> torch.device:
    """Join the process group that torchrun set up (or a one-process group without torchrun).

    The store is prefixed with torchrun's restart count: after an elastic restart, the agent's store still holds
    the previous attempt's addresses, and gloo would otherwise try to connect to the dead processes.
    `fake_rank = (rank, world_size)`: a dry run's process plays that rank on the fake backend, on the CPU (fake
    tensors), or on this machine's device when `fake_on_device` (real tensors).
    """
    kind = device_type()
    if fake_rank is not None:
        init_fake_process_group(*fake_rank)
        _timeout_in_force["joining"] = False
        return _local_device(kind) if fake_on_device else torch.device("cpu")
    device = _local_device(kind)
    if kind == "cuda":
        for name, value in nccl_environment(trace_buf_size, trace_folder).items():
            os.environ.setdefault(name, value)
    timeout = datetime.timedelta(seconds=init_timeout_seconds)
    _timeout_in_force.update(option="comm.init_timeout_seconds", seconds=init_timeout_seconds, joining=True)
    if "WORLD_SIZE" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"torchtitan/attempt{attempt}", store)
    else:
        store, rank, world_size = dist.HashStore(), 0, 1
    dist.init_process_group(backend_for(kind), store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if kind == "cuda" else None)
    _timeout_in_force["joining"] = False
    return device


def _local_device(kind: str) -> torch.device:
    """This process's device: its GPU (made current) under CUDA, else the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device(kind, cuda_device_index(int(os.environ.get("LOCAL_RANK", "0")),
                                                  int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                                  torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


# Groups whose collectives have a timeout of their own (checkpoint I/O), which set_train_timeout leaves alone.
_groups_with_own_timeout: list[dist.ProcessGroup] = []


def new_group_with_own_timeout(seconds: int) -> dist.ProcessGroup:
    """A gloo group of every rank whose collectives wait up to `seconds`, also after set_train_timeout: waits on the
    slowest writer of a checkpoint grow with the checkpoint, not with a training step."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    _groups_with_own_timeout.append(group)
    return group


def set_train_timeout(seconds: int) -> None:
    """After the first step, bound every collective by the (shorter) training timeout, except in the groups that
    have their own."""
    set_timeout, groups = torch_compat.lookup("set_pg_timeout"), torch_compat.lookup("process_groups")
    if set_timeout is None or groups is None:
        warn_once(f"comm.train_timeout_seconds: torch {torch.__version__} cannot shorten a process group's timeout "
                  f"after it is created; collectives keep comm.init_timeout_seconds for the whole run")
        return
    timeout = datetime.timedelta(seconds=seconds)
    for group in [dist.group.WORLD, *groups]:
        if not any(group is own for own in _groups_with_own_timeout):
            set_timeout(timeout, group)
    _timeout_in_force.update(option="comm.train_timeout_seconds", seconds=seconds, joining=False)


@contextlib.contextmanager
def collectives_bounded_by(option: str, seconds: int) -> Iterator[None]:
    """Collectives inside run in a group with its own timeout (`option`): a failure names that option."""
    previous = dict(_timeout_in_force)
    _timeout_in_force.update(option=option, seconds=seconds)
    try:
        yield
    finally:
        _timeout_in_force.update(previous)


# Lower-cased fragments of the errors gloo, NCCL and the TCP store raise when a peer does not answer in time, and
# when a peer's connection is gone (it crashed or was killed).
_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                      "socket closed")


def describe_comm_failure(err: BaseException, during: str) -> str | None:
    """One line saying which rank-to-rank wait failed and which option bounds it, or None if `err` is not a
    communication failure. `during` says what the process was doing, e.g. "step 3"."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).strip()
    # gloo prefixes its messages with the C++ source location, which tells a user nothing.
    detail = text.splitlines()[-1].split("] ", 1)[-1] if text else type(err).__name__
    lowered = text.lower()
    option, seconds = _timeout_in_force["option"], _timeout_in_force["seconds"]
    if any(marker in lowered for marker in _TIMEOUT_MARKERS):
        if _timeout_in_force["joining"]:
            master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return (f"{during}: not every rank joined the process group within {option} = {seconds} s; a rank did "
                    f"not start, crashed, or cannot reach MASTER_ADDR:MASTER_PORT = {master} ({detail})")
        until = " (in force until the first step completes)" if option == "comm.init_timeout_seconds" else ""
        return (f"{during}: a collective did not complete within {option} = {seconds} s{until}; a peer rank "
                f"stalled or died ({detail})")
    if any(marker in lowered for marker in _PEER_LOST_MARKERS):
        return f"{during}: a peer rank closed its connection in a collective: it crashed or was killed ({detail})"
    return None


def set_determinism(seed: int | None, deterministic: bool, warn_only: bool, device: torch.device) -> int:
    """Seed every generator with the same seed on all ranks (rank 0 draws one if none is given)."""
    if seed is None:
        drawn = torch.tensor([random.SystemRandom().randrange(2**31)], dtype=torch.int64, device=device)
        dist.broadcast(drawn, src=0)
        seed = int(drawn.item())
        logger.info(f"Seed drawn: {seed} (set debug.seed to reproduce this run)")
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return seed


@torch.no_grad()
def init_model_weights(model: nn.Module, seed: int, device: torch.device) -> None:
    """Initialise the parameters of a materialised model part so that their values do not depend on the layout.
    They are drawn on `device`, also when they live in host memory (CPU offload), so offloading changes no value.

    Each parameter is drawn from its own generator (seed, name) at its full shape; a sharded parameter then keeps
    only its local slice. The transient full tensor costs one parameter's memory at a time.
    """
    for name, param, initializer in model.parameter_initializers():
        init_parameter(name, param, initializer, seed, device)


@torch.no_grad()
def init_parameter(name: str, param: torch.Tensor, initializer: Initializer, seed: int,
                   device: torch.device) -> None:
    """One parameter of init_model_weights: drawn whole on `device`; a DTensor keeps its local slice."""
    if isinstance(param, DTensor):
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        initializer(full, parameter_generator(seed, name, device))
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        initializer(param, parameter_generator(seed, name, device))


def materialize_model(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Allocate the parameters of a model part built on the meta device (and sharded), and compute its buffers,
    for training on `device`; init_model_weights then fills the parameters.

    With FSDP's CPU offload the parameters (and with them gradients and optimizer state) live in host memory, as
    FSDP2 requires them at materialisation; buffers (the RoPE table), which FSDP does not offload, go to `device`.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    model.init_buffers(device)


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None,
                    device: torch.device) -> torch.Tensor:
    """Total L2 norm of all gradients across every mesh (DTensor reductions, plus a sum over pipeline stages),
    then scale gradients down to `max_norm` if it is exceeded (max_norm = 0 only measures).

    The gradients may live in host memory (CPU offload) while the process group communicates on `device`: every
    reduction takes the local norms to `device` first, so no collective gets a tensor its backend cannot send."""
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    # DTensors on different meshes cannot be stacked together: reduce each group to a plain scalar first.
    squares = [_reduced_on(torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True),
                           device).float().square()
               for group in by_mesh.values()]
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    total_norm = total_sq.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
    return total_norm


def _reduced_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, reduced over its mesh if it is a (partial) DTensor."""
    if not isinstance(t, DTensor):
        return t.to(device)
    return DTensor.from_local(t.to_local().to(device), t.device_mesh, t.placements, run_check=False).full_tensor()
