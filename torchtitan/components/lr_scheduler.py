"""Warmup -> stable -> decay (linear, sqrt or cosine) down to a minimum learning rate."""

import functools
import math

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, total_steps: int, decay_type: str,
              min_lr_factor: float) -> float:
    """Multiplier of the peak learning rate for the update made at 0-based `step`."""
    if step < warmup_steps:
        # (step + 1) / (warmup + 1): the first update already moves the weights, the last reaches near the peak.
        return (step + 1) / (warmup_steps + 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start + 1) / max(decay_steps, 1), 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


class LRSchedulersContainer(Stateful):
    """One LambdaLR per optimizer, stepped together; all share one schedule, so one state is saved."""

    def __init__(self, optimizers: OptimizersContainer, config: LRSchedulerConfig, total_steps: int):
        warmup = min(config.warmup_steps, total_steps)
        if config.decay_ratio is None:
            decay_steps = total_steps - warmup
        else:
            decay_steps = min(round(total_steps * config.decay_ratio), total_steps - warmup)
        factor = functools.partial(lr_factor, warmup_steps=warmup, decay_steps=decay_steps, total_steps=total_steps,
                                   decay_type=config.decay_type, min_lr_factor=config.min_lr_factor)
        self.schedulers = [LambdaLR(optimizer, factor) for optimizer in optimizers.optimizers]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    @property
    def last_lr(self) -> float:
        return float(self.schedulers[0].get_last_lr()[0])

    def state_dict(self) -> dict:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.last_epoch = state_dict["last_epoch"]
            for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                              scheduler.lr_lambdas):
                lr = base_lr * factor(scheduler.last_epoch)
                # torchao's optimizers keep lr as a tensor (their compiled step takes it as an input).
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            scheduler._last_lr = [float(group["lr"]) for group in scheduler.optimizer.param_groups]


def build_lr_schedulers(optimizers: OptimizersContainer, config: LRSchedulerConfig,
                        total_steps: int) -> LRSchedulersContainer:
    return LRSchedulersContainer(optimizers, config, total_steps)
