"""What the generic layers know of a model's parameters: the name checkpoints key each by, its initial values (drawn
from the run's seed and its name alone, so that any sharding starts from the same weights), and how many there are."""

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

Initializer = Callable[[torch.Tensor, torch.Generator], None]


def checkpoint_name(wrapped_name: str) -> str:
    """A parameter's name as checkpoints key it: activation-checkpoint and compile wrappers insert these segments
    into `named_parameters()` names; the model's state dict omits them."""
    return wrapped_name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def trunc_normal(std: float, cutoff: float | None = None) -> Initializer:
    """A normal of mean 0 and this std truncated to +-cutoff (default 2 std), by the inverse CDF of uniform draws:
    torch 2.11's `trunc_normal_` method. torch 2.13 rejection-samples instead, which draws other values from the same
    generator (docs/torch_versions.md); this one gives every tested torch the same initial weights, and draws value
    after value in order, so that a shard's rows can be drawn alone (distributed/rotated.py)."""
    bound = cutoff if cutoff is not None else 2 * std
    low, high = (math.erf(-bound / (std * math.sqrt(2.0))), math.erf(bound / (std * math.sqrt(2.0))))

    def draw(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        t.uniform_(low, high, generator=g).erfinv_().mul_(std * math.sqrt(2.0))
        return t.clamp_(-bound, bound)
    return draw


def parameter_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator for one parameter, seeded from the run's seed and the parameter's name."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count (on any device, meta included)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and getattr(model, "tok_embeddings", None) is not None:
        total -= model.tok_embeddings.weight.numel()
    return total
