"""Activation checkpointing of transformer blocks: full, every N-th block, or per op.

Per-op mode keeps the outputs of the expensive ops (matmuls, attention, reduce-scatters) and recomputes the cheap
element-wise rest in backward: most of the memory saving of full checkpointing for a fraction of its recompute.
"""

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint

_OPS_TO_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # Float8's amax computations: cheap to keep, costly to redo under tensor parallelism.
    torch.ops.aten.max.default,
}


def _save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _OPS_TO_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, config: ActivationCheckpoint) -> None:
    """Wrap the chosen blocks of `model.layers` in place."""
    if config.mode == "none":
        return
    every_nth = int(config.selective_ac_option) if config.mode == "selective" and \
        config.selective_ac_option != "op" else 1
    per_op = config.mode == "selective" and config.selective_ac_option == "op"
    for index, (name, block) in enumerate(list(model.layers.items())):
        if (index + 1) % every_nth:
            continue
        if per_op:
            context_fn = functools.partial(create_selective_checkpoint_contexts, _save_expensive_ops)
            wrapped = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers.register_module(name, wrapped)
