"""LoCo (Xie et al., "Low-Bit Communication Adaptor"): gradients cross the wire as 4- or 8-bit codes, and what the
codes missed is added to the next step's gradient (error feedback), so that no gradient is lost, only delayed.

Installed with `FSDPModule.set_custom_reduce_scatter`: FSDP hands over the flat reduce-scatter input, one row per
destination rank (row j holds every parameter's j-th shard). Each row is quantized and the rows are exchanged with
one all-to-all of the uint8 payloads; each rank decodes the W rows it received and sums them (a reduce-scatter whose
wire format is the low-bit payload). The residual `h - decode(encode(h))` of the compensated input `h = grad +
residual` stays on the sender for the next step. This is classic error feedback: after any number of steps, what was
sent plus the residuals left equals the sum of the gradients.

QSDP's gradients use the same exchange with stochastic rounding and no residual (`error_feedback=False`).
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from torchtitan.distributed.compression.quantize import decode, encode, encode_and_restore


class CompressedReduceScatter(ReduceScatter):
    """A reduce-scatter (sum) that sends `bits`-bit payloads; one instance per FSDP module (it owns the module's
    residual, whose layout is that module's reduce-scatter input)."""

    def __init__(self, bits: int, error_feedback: bool, stochastic: bool, rotate: bool,
                 segments: list[int] | None = None):
        self.bits = bits
        # Lengths of the parameters' shards that make up a row (each quantized with blocks of its own).
        self.segments = segments
        self.error_feedback = error_feedback
        self.stochastic = stochastic
        self.rotate = rotate
        # (world size, row length) float32, created at the first call (the layout is FSDP's)
        self.residual: torch.Tensor | None = None
        # Bytes this rank sent to other ranks so far, and what an uncompressed reduce-scatter would have sent.
        self.sent_bytes = 0
        self.uncompressed_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        if op != dist.ReduceOp.SUM:
            # The trainer sums gradient reductions (fsdp.py); a mean would need a division this exchange skips.
            raise RuntimeError(f"compressed reduce-scatter implements a sum, not {op}")
        world = group.size()
        rows = input_tensor.view(world, -1).float()
        n = rows.shape[1]
        if self.error_feedback:
            if self.residual is None:
                self.residual = torch.zeros_like(rows)
            rows = rows + self.residual
        if self.error_feedback:
            payload, sent = encode_and_restore(rows, self.bits, self.stochastic, self.rotate, self.segments)
            self.residual = rows - sent
        else:
            payload = encode(rows, self.bits, self.stochastic, self.rotate, self.segments)
        received = torch.empty_like(payload)
        dist.all_to_all_single(received, payload, group=group)
        output_tensor.copy_(decode(received, n, self.bits, self.rotate, self.segments).sum(dim=0))
        self.sent_bytes += (world - 1) * payload.shape[1]
        self.uncompressed_bytes += (world - 1) * n * input_tensor.element_size()
        return None
