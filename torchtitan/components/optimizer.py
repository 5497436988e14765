"""The optimizers of the model parts: the method named by `[optimizer] name` (see the registry in
torchtitan/components/optimizers/__init__.py) over the parameter groups of torchtitan/components/optimizer_groups.py.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizer_groups import check_matrix_groups, log_groups, param_groups
from torchtitan.components.optimizers import BuildContext, local, optimizer_spec
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.compression import EXACT, CompressionState, compression_stats, replica_suffix

_COMPRESSION = "compression."


class OptimizersContainer(Stateful):
    """One optimizer per model part (pipeline stages hold several), stepped and checkpointed together.

    The state dict is keyed by parameter name, so it reloads under any sharding or pipeline split.
    """

    def __init__(self, model_parts: list[nn.Module], config: OptimizerConfig,
                 replicate_group: dist.ProcessGroup | None = None, device_type: str | None = None):
        self.model_parts = model_parts
        spec = optimizer_spec(config.name)
        groups_per_part = [param_groups(m, config) for m in model_parts]
        if spec.needs_matrices:
            check_matrix_groups(spec.name, [g for groups in groups_per_part for g in groups])
        log_groups(groups_per_part, spec.name)
        device_type = device_type or next(model_parts[0].parameters()).device.type
        context = BuildContext(replicate_group=replicate_group, device_type=device_type)
        self.optimizers = [spec.build(groups, config, context) for groups in groups_per_part]
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Error-feedback residuals of compressed gradient reductions: state of the update, saved with it.
        self.compression = CompressionState(model_parts, replicate_group)
        self._replica_suffix = replica_suffix(replicate_group)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: local shards, quantized tensors by their codes and scales, and
        gradient compression's compensation state (its whole local gradient's, unsharded)."""
        return sum(_tensor_bytes(value) for optimizer in self.optimizers for state in optimizer.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor)) + self.compression.state_bytes()

    def sent_bytes(self) -> dict[str, int]:
        """What this rank has sent so far, by kind (see `sent_bytes`)."""
        return sent_bytes(self.model_parts, self.optimizers, self.compression.save_sent_bytes)

    def step(self) -> None:
        """Apply the gradients. The compensation state their compressed reductions staged is committed first: the
        previous state is then freed before the optimizers' temporaries are allocated (the step holds one state,
        not two)."""
        self.compression.commit()
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        """Drop the gradients, and the compensation state their reductions staged: a step whose update is skipped
        (or run again, health.rerun_bad_steps) leaves that state as it was before the step."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.compression.discard()

    def replica_group_view(self) -> Stateful:
        """The state a replica group sends a peer that heals from it (fault_tolerance.py): the optimizers' state
        without the compensation state of compressed reductions. That state is the sending group's own history (each
        group reduce-scatters within itself, and a group's residuals are owed to its own next gradients), and saving it
        runs collectives of the sending group, which torchft's checkpoint server, a thread beside the training loop,
        must not issue. The healed group starts without compensation, as a run does at its first step."""
        return _WithoutCompensation(self)

    def state_dict(self) -> dict:
        """Reads the state, never changes it: a run that saves trains exactly as one that does not.

        State that differs between data-parallel replicas (an optimizer's `replica_state()`, e.g. FlexDeMo's local
        momenta) is also saved verbatim per replica, as `exact.<parameter>.<state><replica suffix>`, sharded like the
        parameter: a resume into the same number of replicas restores it bit for bit (resharded over FSDP where its
        degree changed), and one into another number continues each replica r from saved replica r mod R
        (checkpoint/loading.py, exact_where_it_fits). Saving runs no collective across replicas."""
        state = self._optimizer_state_dict()
        if self.compression:
            state.update({k if k.startswith(EXACT) else _COMPRESSION + k: v
                          for k, v in self.compression.state_dict().items()})
        return state

    def _optimizer_state_dict(self) -> dict:
        state: dict = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            state.update(get_optimizer_state_dict(model, optimizer, options=self._options))
            state.update({self._exact_key(fqn, name): value
                          for fqn, name, value in self._replica_state(model, optimizer)})
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """`state_dict` may lack the `exact.` entries (checkpoint/loading.py loads them only into the layout they were
        saved from)."""
        if self.compression:
            self.compression.load_state_dict({k.removeprefix(_COMPRESSION): v for k, v in state_dict.items()
                                              if k.startswith((_COMPRESSION, EXACT))})
        self._load_optimizer_state_dict(state_dict)

    def _load_optimizer_state_dict(self, state_dict: dict) -> None:
        optimizer_state = {k: v for k, v in state_dict.items()
                           if not k.startswith(_COMPRESSION) and not k.startswith(EXACT)}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state, options=self._options)
            for fqn, name, value in self._replica_state(model, optimizer):
                # This replica's own, or the saved replica it continues (checkpoint/loading.py renames the key).
                stem = f"{EXACT}{fqn}.{name}.replica"
                saved = next((v for k, v in state_dict.items() if k.startswith(stem)), None)
                if saved is not None:
                    local(value).copy_(local(saved))

    def _exact_key(self, fqn: str, name: str) -> str:
        return f"{EXACT}{fqn}.{name}{self._replica_suffix}"

    @staticmethod
    def _replica_state(model: nn.Module, optimizer: torch.optim.Optimizer):
        """(parameter name, state name, live tensor) of the optimizer's replica-local state."""
        if not hasattr(optimizer, "replica_state"):
            return
        names = {param: fqn for fqn, param in model.named_parameters()}
        for param, states in optimizer.replica_state().items():
            for name, value in states.items():
                yield names[param], name, value


def _tensor_bytes(tensor: torch.Tensor) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        # A tensor subclass (torchao's quantized optimizer state) holds its data in inner tensors.
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def sent_bytes(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
               save_sent_bytes: int) -> dict[str, int]:
    """Bytes this rank has sent so far: `sent_bytes` through the collectives that replace a full-precision one (the
    compressed FSDP collectives, FlexDeMo's exchange) and `uncompressed_bytes`, what those would have sent (NCCL's ring
    arithmetic); `exchange_sent_bytes` through optimizers' own exchanges, which replace none (Muon's spreading), and
    `exchange_replica_bytes`, their part across data-parallel replicas; `save_sent_bytes` through the optimizer
    state's saves (gradient compression's totals)."""
    counters = compression_stats(model_parts)
    for optimizer in optimizers:
        for key in ("sent_bytes", "uncompressed_bytes", "exchange_sent_bytes", "exchange_replica_bytes"):
            counters[key] = counters.get(key, 0) + getattr(optimizer, key, 0)
    counters["save_sent_bytes"] = save_sent_bytes
    return counters


def build_optimizers(model_parts: list[nn.Module], config: OptimizerConfig,
                     replicate_group: dist.ProcessGroup | None = None,
                     device_type: str | None = None) -> OptimizersContainer:
    """`replicate_group`: the ranks holding the same shard in other replicas (FlexDeMo exchanges over it);
    `device_type`: the device whose code paths the run takes (a dry run's target; None: the parameters')."""
    return OptimizersContainer(model_parts, config, replicate_group, device_type)


class _WithoutCompensation(Stateful):
    """OptimizersContainer.replica_group_view()."""

    def __init__(self, container: OptimizersContainer):
        self.container = container

    def state_dict(self) -> dict:
        return self.container._optimizer_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.container._load_optimizer_state_dict(state_dict)
        self.container.compression.clear()
