"""The optimizer registry: `[optimizer] name` looks a method up here; one file per method in this package.

How to add an optimizer
-----------------------
1. Write `torchtitan/components/optimizers/<method>.py` with a builder registered under its config name:

       def my_state_bytes(shape, local_shape, config, matrix_method):
           return 8 * math.prod(local_shape)

       def my_step_bytes(tensors, config, layout):
           return 4 * max(math.prod(t.local_shape) for t in tensors)  # one fp32 temporary of the largest shard

       @register_optimizer("MyOpt", state_bytes=my_state_bytes, step_bytes=my_step_bytes)
       def build_my_opt(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
           return MyOpt(groups, lr=config.lr, ...)

   A method with options of its own declares them next to its builder as a small dataclass, each field followed by
   its docstring (the `--help` text), with `TABLE` (its TOML table: [optimizer.<TABLE>], flags
   --optimizer.<TABLE>.<option>) as a ClassVar, and registers it with `options=`; the builder reads them as
   `config.<TABLE>`:

       @dataclass
       class MyOptOptions:
           TABLE: ClassVar[str] = "myopt"
           beta: float = 0.9
           '''MyOpt: the help text of beta.'''

       @register_optimizer("MyOpt", state_bytes=my_state_bytes, step_bytes=my_step_bytes, options=MyOptOptions)

   `groups` are torch parameter groups, one per non-empty parameter group of the model part (see
   torchtitan/components/optimizer_groups.py): keys `params`, `lr` (optimizer.lr x the group's lr_scale),
   `weight_decay`, `group` (its name: hidden_matrices, output, embeddings, norms, other) and `matrix_method` (whether
   the method's matrix treatment, e.g. a low-rank projection or an orthogonalisation, applies to it). Keep every key in
   the groups handed to the optimizer: the learning-rate scheduler scales `lr` per group, and the checkpoint saves
   the groups by parameter name. The parameters may be DTensors (FSDP and TP shards): say in the module docstring
   what the method computes per shard and what it gathers.
   `state_bytes(shape, local_shape, config, matrix_method)` returns the optimizer-state bytes one rank keeps for a
   tensor of `shape` (the whole tensor) of which it holds a shard of `local_shape` (FSDP, TP; the same shape on one
   process): elementwise state follows the shard, state of the whole matrix (a projector) does not (the memory
   planner and scripts/estimate_memory.py use it). `step_bytes(tensors, config, layout)` returns the bytes its step
   allocates at its peak beyond the state (temporaries: a for-loop's per-tensor ones, a foreach call's per group,
   whatever the method gathers or exchanges), given the rank's tensors (`RankTensor`) and a `StepLayout`; the memory
   planner adds it to the optimizer step, tests/unit/test_step_memory.py checks it against the dry run's trace.
   Pass `needs_matrices=True` when the method
   only makes sense with at least one 2-D group with matrix_method = true (the container then checks the groups).
2. Import the module at the end of this file, add the name to the `name` Literal of `Optimizer` in
   torchtitan/config/job_config.py (tests/unit/test_optimizer_registry.py checks that the two agree), describe it in
   that option's docstring and regenerate docs/config_reference.md (scripts/generate_config_reference.py).
3. Add it to OPTIMIZERS in tests/integration/test_parallel_parity.py (FSDP 2 and TP 2 against one process) and in
   tests/integration/test_checkpoint_resume.py (exact resume, resharding), and to docs/recipes.md, Optimizers.

OptimizersContainer saves `self.state[param]` by parameter name (torch's get/set_optimizer_state_dict): state shaped
like the parameter (a DTensor sharded like it, e.g. `torch.zeros_like(param)`) and scalars reload under any sharding;
state of another shape (a projection matrix) must be a DTensor whose placements say how it reshards, or be rebuilt
on load. `local(t)` and `gradient(param)` below give the local shard and the gradient sharded like its parameter, for
elementwise updates.

Saving must not change training (checkpoint.interval is no hyperparameter): `state_dict()` reads the state and
changes none of it (tests/unit/test_optimizer_registry.py checks every registered method). State that differs between
data-parallel replicas (FlexDeMo's local momenta), which DCP would keep once for all replicas, is returned by a
`replica_state()` method ({param: {name: live tensor}}): the container saves it per replica, and every resume loads it
(into another number of replicas, replica r continues saved replica r mod R: checkpoint/loading.py); the optimizer's
own state_dict() holds it in new tensors (a load's template must not alias the live ones) and runs no collective
(FlexDeMo: the replica's own delta; DCP writes one replica's copy).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config.compatibility import MethodRefusal
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.errors import UserError


@dataclass(frozen=True)
class BuildContext:
    """What a builder may need beyond the groups and the config."""

    replicate_group: dist.ProcessGroup | None = None
    """The ranks holding the same shard in the other replicas (HSDP/DDP); FlexDeMo exchanges over it."""

    device_type: str = "cuda"
    """The device whose code paths the run takes ("cuda" or "cpu"; a dry run's target device): Muon computes in
    bfloat16 off the CPU."""


@dataclass(frozen=True)
class RankTensor:
    """One of a rank's tensors, as the memory planner sees it."""

    group: str
    """Its parameter group (hidden_matrices, output, embeddings, norms, other)."""
    shape: tuple[int, ...]
    """The whole tensor's."""
    local_shape: tuple[float, ...]
    """The shard this rank holds."""
    matrix_method: bool
    """Whether the group's matrix_method applies."""
    layout: tuple = ()
    """How it is sharded (the tensor dimension each mesh dimension splits): tensors of one shape and layout stack
    together (Muon)."""


@dataclass(frozen=True)
class StepLayout:
    """What an optimizer step's temporaries depend on beyond the tensors."""

    shard_ranks: int = 1
    """Ranks that shard the parameters (FSDP x TP): Muon spreads its matrices over them."""
    replicas: int = 1
    """Data-parallel replicas holding the same shards (HSDP's, DDP's)."""
    device_type: str = "cuda"


Builder = Callable[[list[dict], OptimizerConfig, BuildContext], torch.optim.Optimizer]
StateBytes = Callable[[tuple[int, ...], tuple[float, ...], OptimizerConfig, bool], float]
StepBytes = Callable[[list[RankTensor], OptimizerConfig, StepLayout], float]


def largest_shard(tensors: list[RankTensor]) -> float:
    """Values of the largest shard among `tensors` (0 for none): what a for-loop step's temporaries scale with."""
    return max((math.prod(t.local_shape) for t in tensors), default=0.0)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Builder
    state_bytes: StateBytes
    """Optimizer-state bytes one rank keeps for a tensor of a shape (whole) of which it holds a shard of another,
    given whether matrix_method applies."""
    step_bytes: StepBytes
    """Bytes the step allocates at its peak beyond the state, for a rank's tensors."""
    needs_matrices: bool = False
    """The method needs at least one group of 2-D weights with matrix_method = true."""
    options: type | None = None
    """The dataclass of the method's own options, [optimizer.<options.TABLE>]; None: it has none."""
    refuses: tuple[MethodRefusal, ...] = ()
    """The features (config/compatibility.py) the method does not compose with, and why: refused at start-up."""


_REGISTRY: dict[str, OptimizerSpec] = {}


def register_optimizer(name: str, *, state_bytes: StateBytes, step_bytes: StepBytes, needs_matrices: bool = False,
                       options: type | None = None, refuses: tuple[MethodRefusal, ...] = ()):
    """Decorator: registers `build` under the config name `name`."""

    def register(build: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"optimizer {name!r} is registered twice")
        _REGISTRY[name] = OptimizerSpec(name, build, state_bytes, step_bytes, needs_matrices, options, refuses)
        return build

    return register


def method_options() -> dict[str, type]:
    """{table: options dataclass} of the registered optimizers: the config's [optimizer.<table>] tables."""
    return {spec.options.TABLE: spec.options for spec in _REGISTRY.values() if spec.options is not None}


def optimizer_names() -> list[str]:
    return list(_REGISTRY)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registered method called `name`; an unknown name is a UserError naming the valid ones."""
    if name not in _REGISTRY:
        raise UserError(f"option optimizer.name: {name!r} is not one of "
                        f"{', '.join(repr(n) for n in _REGISTRY)}")
    return _REGISTRY[name]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor as it is): what an elementwise update works on."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gradient(param: torch.Tensor) -> torch.Tensor:
    """The parameter's gradient, sharded like the parameter: under TP a gradient can arrive with other placements
    (e.g. replicated), and an update on local shards needs the two to match."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


# Each module registers its builders on import.
from torchtitan.components.optimizers import adamw, flexdemo, galore, low_precision, muon, ranger21  # noqa: E402,F401
