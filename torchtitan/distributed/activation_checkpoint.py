"""Activation checkpointing of transformer blocks: full, every N-th block, or per op.

Per-op mode keeps the outputs of attention, of the reduce-scatters and of every other matmul of a block (the 1st,
3rd, ...: wq, wv, w1, w2), and recomputes the rest in backward: the element-wise ops, which are cheap, and the other
matmuls (wk, wo, w3), whose outputs would cost as much memory as the saved ones. TorchTitan's per-op policy makes
the same trade, so the recipes of both compare like for like.
"""

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed import torch_compat

def _ops(*names: str) -> set:
    """The ops of these 'namespace.op' names that this torch has (the attention kernels differ between releases)."""
    found = set()
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default)
    return found


_OPS_TO_SAVE = _ops(
    "aten.mm", "aten._scaled_mm", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu", "_c10d_functional.reduce_scatter_tensor",
    # Float8's amax computations: cheap to keep, costly to redo under tensor parallelism.
    "aten.max") | {
    # FlexAttention, the GPUs' kernel over keys gathered by context parallelism and over packed documents, and the
    # compiled region torch.compile runs it in (model._compiled_flex_attention): saved like SDPA (TorchTitan's
    # policy saves both too), not run again in backward.
    hop for name in ("flex_attention", "inductor_compiled_code")
    if (hop := getattr(torch.ops.higher_order, name, None)) is not None}


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
    checkpoint_wrapper = torch_compat.get("checkpoint_wrapper")
    for index, (name, block) in enumerate(list(model.layers.items())):
        if (index + 1) % every_nth:
            continue
        if per_op:
            wrapped = checkpoint_wrapper(block, context_fn=_per_op_contexts, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers.register_module(name, wrapped)
