"""torch's AdamW (decoupled weight decay) and Adam (weight decay as an L2 term of the gradient).

Both are elementwise: on DTensor parameters every rank updates its own shard and nothing is gathered.
"""

import math

import torch

from torchtitan.components.optimizer_groups import group_weight_decay
from torchtitan.components.optimizers import BuildContext, RankTensor, StepLayout, register_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig


def adam_hyperparameters(config: OptimizerConfig) -> dict:
    """lr, betas, eps and the kernel flags of torch's Adam family (the groups carry lr and weight decay)."""
    return {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
            **implementation_flags(config.implementation)}


def implementation_flags(implementation: str) -> dict:
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}


def two_fp32_moments(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                     matrix_method: bool) -> float:
    """exp_avg and exp_avg_sq of the shard in fp32 (the scalar step counter is left out)."""
    return 8 * math.prod(local_shape)


def _adam_step_bytes(decoupled: bool):
    def step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
        """torch's kernels: the foreach implementation runs one parameter group at a time and allocates one fp32
        temporary per value of it (the second moment's square root, the denominator; Adam's decayed copy of the
        gradients is deleted before it); the for-loop one, tensor by tensor, that root and its quotient by the bias
        correction, beside Adam's decayed gradient (an L2 term, in groups that decay); the fused kernel nothing."""
        if config.implementation == "fused":
            return 0.0
        if config.implementation == "foreach":
            groups: dict[str, float] = {}
            for t in tensors:
                groups[t.group] = groups.get(t.group, 0.0) + math.prod(t.local_shape)
            return 4.0 * max(groups.values(), default=0.0)

        def per_value(group: str) -> float:
            decays = group_weight_decay(group, getattr(config.groups, group), config) != 0
            return 8.0 + (4.0 if decays and not decoupled else 0.0)

        return max((per_value(t.group) * math.prod(t.local_shape) for t in tensors), default=0.0)
    return step_bytes


@register_optimizer("AdamW", state_bytes=two_fp32_moments, step_bytes=_adam_step_bytes(decoupled=True))
def build_adamw(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **adam_hyperparameters(config))


@register_optimizer("Adam", state_bytes=two_fp32_moments, step_bytes=_adam_step_bytes(decoupled=False))
def build_adam(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return torch.optim.Adam(groups, **adam_hyperparameters(config))
