"""QSDP (Markov et al., "Quantized Distributed Training of Large Models with Convergence Guarantees"): FSDP whose
weight all-gather carries low-bit codes, rounded stochastically onto the quantization grid, while each rank keeps
its shard of the weights (and the optimizer's update) in full precision. Its gradients go through the compressed
reduce-scatter of loco.py with stochastic rounding and no error feedback.

Installed with `FSDPModule.set_custom_all_gather`: FSDP hands over its flat all-gather buffer (this rank's shards of
the module's parameters, in the compute dtype, sitting inside the output at this rank's offset). The shard is
encoded, the payloads are all-gathered, and every rank, the owner included, decodes the same quantized weights: all
replicas compute with identical values. The stochastic draw depends only on the weights, so the backward re-gather
reproduces the forward's weights exactly.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from torchtitan.distributed.compression.quantize import decode, encode


class QuantizedAllGather(AllGather):
    def __init__(self, bits: int, rotate: bool, segments: list[int] | None = None):
        self.bits = bits
        self.segments = segments
        self.rotate = rotate
        self.sent_bytes = 0
        self.uncompressed_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        if not input_tensor.is_floating_point():
            # FSDP packs parameters of mixed dtypes (e.g. float8 all-gather) as bytes: nothing to quantize.
            raise RuntimeError(f"QSDP all-gather expects floating-point weights, got {input_tensor.dtype}")
        world = group.size()
        n = input_tensor.numel()
        payload = encode(input_tensor.view(1, n), self.bits, stochastic=True, rotate=self.rotate,
                         segments=self.segments)
        gathered = torch.empty(world, payload.shape[1], dtype=torch.uint8, device=payload.device)
        dist.all_gather_into_tensor(gathered, payload, group=group)
        output_tensor.view(world, n).copy_(decode(gathered, n, self.bits, self.rotate, self.segments))
        self.sent_bytes += (world - 1) * payload.shape[1]
        self.uncompressed_bytes += (world - 1) * n * input_tensor.element_size()
        return None
