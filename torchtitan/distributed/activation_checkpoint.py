"""Activation checkpointing of transformer blocks: full, every N-th block, or per op.

Per-op mode keeps the outputs of attention, of the reduce-scatters and of every other matmul of a block (the 1st,
3rd, ...: wq, wv, w1, w2), and recomputes the rest in backward: the element-wise ops, which are cheap, and the other
matmuls (wk, wo, w3), whose outputs would cost as much memory as the saved ones. TorchTitan's per-op policy makes
the same trade, so the recipes of both compare like for like.
"""

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


def _per_op_policy():
    """A fresh policy for one block: matmuls are counted in order, separately in the forward and in the
    recomputation, which must make the same choices."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _OPS_TO_SAVE else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _per_op_contexts():
    return create_selective_checkpoint_contexts(_per_op_policy())


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
            wrapped = checkpoint_wrapper(block, context_fn=_per_op_contexts, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers.register_module(name, wrapped)
