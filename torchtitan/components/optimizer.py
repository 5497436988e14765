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
from torchtitan.components.optimizers import BuildContext, optimizer_spec
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.compression import CompressionState

_COMPRESSION = "compression."


class OptimizersContainer(Stateful):
    """One optimizer per model part (pipeline stages hold several), stepped and checkpointed together.

    The state dict is keyed by parameter name, so it reloads under any sharding or pipeline split.
    """

    def __init__(self, model_parts: list[nn.Module], config: OptimizerConfig,
                 replicate_group: dist.ProcessGroup | None = None):
        self.model_parts = model_parts
        spec = optimizer_spec(config.name)
        groups_per_part = [param_groups(m, config) for m in model_parts]
        if spec.needs_matrices:
            check_matrix_groups(spec.name, [g for groups in groups_per_part for g in groups])
        log_groups(groups_per_part, spec.name)
        context = BuildContext(replicate_group=replicate_group)
        self.optimizers = [spec.build(groups, config, context) for groups in groups_per_part]
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Error-feedback residuals of compressed gradient reductions: state of the update, saved with it.
        self.compression = CompressionState(model_parts)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: local shards, quantized tensors by their codes and scales."""
        return sum(_tensor_bytes(value) for optimizer in self.optimizers for state in optimizer.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor))

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        state: dict = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            state.update(get_optimizer_state_dict(model, optimizer, options=self._options))
        if self.compression:
            state.update({_COMPRESSION + k: v for k, v in self.compression.state_dict().items()})
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if self.compression:
            self.compression.load_state_dict({k.removeprefix(_COMPRESSION): v for k, v in state_dict.items()
                                              if k.startswith(_COMPRESSION)})
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(_COMPRESSION)}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, optimizer, optim_state_dict=state_dict, options=self._options)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        # A tensor subclass (torchao's quantized optimizer state) holds its data in inner tensors.
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def build_optimizers(model_parts: list[nn.Module], config: OptimizerConfig,
                     replicate_group: dist.ProcessGroup | None = None) -> OptimizersContainer:
    """`replicate_group`: the ranks holding the same shard in other replicas (FlexDeMo exchanges over it)."""
    return OptimizersContainer(model_parts, config, replicate_group)
