"""AdamW/Adam over the model parts, with no weight decay on norms and embeddings unless configured."""


import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.optimizers.flexdemo import FlexDeMo
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.compression import CompressionState

_NO_DECAY_MODULES = (nn.Embedding, nn.RMSNorm, nn.LayerNorm)
_COMPRESSION = "compression."


def param_groups(model: nn.Module, config: OptimizerConfig) -> list[dict]:
    """Matrices get weight decay; norm weights and embeddings only with decay_norms_and_embeddings."""
    no_decay_ids = set()
    if not config.decay_norms_and_embeddings:
        no_decay_ids = {id(p) for m in model.modules() if isinstance(m, _NO_DECAY_MODULES)
                        for p in m.parameters(recurse=False)}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in no_decay_ids], "weight_decay": config.weight_decay},
              {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class OptimizersContainer(Stateful):
    """One optimizer per model part (pipeline stages hold several), stepped and checkpointed together.

    The state dict is keyed by parameter name, so it reloads under any sharding or pipeline split.
    """

    def __init__(self, model_parts: list[nn.Module], config: OptimizerConfig,
                 replicate_group: dist.ProcessGroup | None = None):
        self.model_parts = model_parts
        if config.name == "FlexDeMo":
            self.optimizers = [FlexDeMo(param_groups(m, config), lr=config.lr, weight_decay=config.weight_decay,
                                        chunk_size=config.demo_chunk_size, topk=config.demo_topk,
                                        momentum_decay=config.demo_momentum_decay, replicate_group=replicate_group)
                               for m in model_parts]
        else:
            optimizer_class = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[config.name]
            kwargs = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps}
            kwargs.update(_implementation_flags(config.implementation))
            self.optimizers = [optimizer_class(param_groups(m, config), **kwargs) for m in model_parts]
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Error-feedback residuals of compressed gradient reductions: state of the update, saved with it.
        self.compression = CompressionState(model_parts)

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


def _implementation_flags(implementation: str) -> dict:
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}


def build_optimizers(model_parts: list[nn.Module], config: OptimizerConfig,
                     replicate_group: dist.ProcessGroup | None = None) -> OptimizersContainer:
    """`replicate_group`: the ranks holding the same shard in other replicas (FlexDeMo exchanges over it)."""
    return OptimizersContainer(model_parts, config, replicate_group)
