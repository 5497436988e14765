"""Data parallelism: FSDP2 (`fully_shard`, HSDP on a 2-D mesh) and DDP (replication on FSDP2's machinery: its
`replicate`, or, on a torch without it, `fully_shard` over the 2-D (replicate, shard) mesh whose shard dimension is one
rank, which is the same computation: every parameter whole on every rank, gradients all-reduced over replicas).

The loss is already divided by the global count of valid tokens, so gradient reductions must sum: the default
(averaging over ranks) would divide a second time. Every data-parallel module is set to a divide factor of 1.
"""

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from torchtitan.distributed import torch_compat

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """default: free gathered parameters after forward, except under PP, where each micro-batch's forward would
    gather them again."""
    return {"always": True, "never": False, "default": not pp_enabled}[policy]


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: str, reduce_dtype: str, pp_enabled: bool,
               cpu_offload: bool, reshard_policy: str) -> None:
    """Shard every transformer block, the embedding, the final norm + output, and the root.

    `dp_mesh` is 1-D for FSDP and 2-D (replicate, shard) for HSDP.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype])
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    reshard = reshard_after_forward(reshard_policy, pp_enabled)
    common = {"mesh": dp_mesh, "mp_policy": mp_policy, "offload_policy": offload}
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **common)
        # Under TP the embedding returns DTensor.to_local()'s view, and FSDP2 warns at every run that an in-place op
        # on it would skip its hook. The model only adds to it out of place (h = h + ...), which the FSDP x TP parity
        # tests would catch if it changed: only that warning, for the embedding, is silenced.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor",
                                category=UserWarning)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **common)
    tail = [m for m in (model.norm, model.output) if m is not None]
    if tail:
        # Backward starts with the output layer: keeping it gathered after forward saves one all-gather.
        fully_shard(tail, reshard_after_forward=False, **common)
    fully_shard(model, reshard_after_forward=reshard, **common)
    _sum_gradient_reductions(model)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, hsdp_mesh: DeviceMesh, *, param_dtype: str,
              reduce_dtype: str) -> None:
    """Replicate the model over `dp_mesh`; gradients are all-reduced (summed) during backward. `hsdp_mesh`: the
    (replicate, shard) mesh with a one-rank shard dimension, for a torch without FSDP2's replicate."""
    mp_policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype])
    replicate = torch_compat.lookup("replicate")
    if replicate is None:
        def replicate(module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
            fully_shard(module, mesh=hsdp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
    _sum_gradient_reductions(model)


def _sum_gradient_reductions(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM collective: gloo has no pre-multiplied sum, and a factor of 1 needs no scaling.
            module.set_force_sum_reduction_for_comms(True)
