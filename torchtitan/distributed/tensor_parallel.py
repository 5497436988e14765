"""Tensor + sequence parallelism for Llama blocks (Megatron-style), with the loss computed in parallel.

Q/K/V and W1/W3 are split by output column, O and W2 by input row; norms run sequence-parallel on a slice of the
sequence; the output projection is split by vocabulary column, whose sharded logits feed `loss_parallel` directly.

The embedding is split by column (the hidden dimension), not by row (the vocabulary) as Megatron and TorchTitan
split it: DTensor's embedding backward has no rule that yields a row shard's gradient, so a row-split embedding's
gradient comes out whole (vocabulary x dim, all-reduced over TP) on every rank; 4 GiB in bf16 at 405B, kept in
fp32 through a pipeline's micro-batches (found by the dry run, docs/scaling.md). Split by column, the gradient is
the rank's slice, and the lookup's output goes from hidden-dim shards to sequence shards with one all-to-all.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from torchtitan.distributed import torch_compat


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, async_tp: bool) -> None:
    top_plan = {}
    if model.tok_embeddings is not None:
        top_plan["tok_embeddings"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top_plan["norm"] = SequenceParallel()
    if model.output is not None:
        top_plan["output"] = ColwiseParallel(input_layouts=Shard(1),
                                             output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                             use_local_output=not loss_parallel)
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # The RoPE table (second input) stays a plain tensor: every rank needs all of it.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    if async_tp:
        enable_async_tp(tp_mesh)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor fuse TP collectives with matmuls through symmetric memory (CUDA + NCCL + compile; checked by
    validate_parallelism)."""
    torch_compat.get("inductor_config")._micro_pipeline_tp = True
    torch_compat.get("enable_symm_mem_for_group")(tp_mesh.get_group().group_name)
