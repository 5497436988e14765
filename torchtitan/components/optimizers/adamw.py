"""torch's AdamW (decoupled weight decay) and Adam (weight decay as an L2 term of the gradient).

Both are elementwise: on DTensor parameters every rank updates its own shard and nothing is gathered.
"""

import math

import torch

from torchtitan.components.optimizers import BuildContext, register_optimizer
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


@register_optimizer("AdamW", state_bytes=two_fp32_moments)
def build_adamw(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **adam_hyperparameters(config))


@register_optimizer("Adam", state_bytes=two_fp32_moments)
def build_adam(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return torch.optim.Adam(groups, **adam_hyperparameters(config))
