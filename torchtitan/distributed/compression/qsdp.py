"""QSDP-style weights (Markov et al., "Quantized Distributed Training of Large Models with Convergence Guarantees"):
FSDP whose weight all-gather carries low-bit codes, rounded stochastically onto the quantization grid, while each
rank keeps its shard of the weights (and the optimizer's update) in full precision, as ZeRO++ does; the paper's
variant that keeps only the quantized weights is not offered. Its gradients go through the compressed
reduce-scatter of loco.py with stochastic rounding and no error feedback.

Installed with `FSDPModule.set_custom_all_gather`: FSDP hands over its flat all-gather buffer (this rank's shards of
the module's parameters, in the compute dtype, sitting inside the output at this rank's offset). The shard is
encoded, the payloads are all-gathered, and every rank, the owner included, decodes the same quantized weights: all
replicas compute with identical values. The stochastic draw depends only on the weights, so the backward re-gather
reproduces the forward's weights exactly.

The shard changes only when the optimizer steps (or a checkpoint is loaded), not between the forward all-gather and
the backward re-gather: its codes are made once and kept (one payload per FSDP module, 1 byte per local value at 8
bits, 0.5 at 4) until any optimizer steps (a hook on every torch optimizer's step: the fused AdamW kernel leaves
the parameters' version counters as they were) or the parameters' version counters say the shard changed (any
other in-place write: a checkpoint's copy_). A change made through `.data` would go unseen; the trainer makes none.
"""

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchtitan.distributed import torch_compat
from torchtitan.distributed.compression.quantize import decode, encode


# Every QSDP all-gather alive, for the optimizer hook that makes them forget their codes.
_GATHERS: weakref.WeakSet = weakref.WeakSet()


def _forget_codes(optimizer, args, kwargs) -> None:
    for gather in _GATHERS:
        gather.encoded = None


register_optimizer_step_post_hook(_forget_codes)


class QuantizedAllGather(torch_compat.private_base("FSDPAllGather")):
    def __init__(self, bits: int, rotate: bool, segments: list[int] | None = None, fsdp_params: list | None = None):
        """`fsdp_params`: the module's parameters, whose shards FSDP copies into the all-gather input (in order);
        given, the codes are reused while the shards are unchanged."""
        self.bits = bits
        self.fsdp_params = fsdp_params or []
        # (the shards' version, their payload) of the last encode
        self.encoded: tuple[tuple, torch.Tensor] | None = None
        _GATHERS.add(self)
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
        version = self._shards_version()
        if version is not None and self.encoded is not None and self.encoded[0] == version:
            payload = self.encoded[1]
        else:
            payload = encode(input_tensor.view(1, n), self.bits, stochastic=True, rotate=self.rotate,
                             segments=self.segments)
            self.encoded = (version, payload) if version is not None else None
        gathered = torch.empty(world, payload.shape[1], dtype=torch.uint8, device=payload.device)
        dist.all_gather_single(gathered, payload, group=group)
        decode(gathered, n, self.bits, self.rotate, self.segments, out=output_tensor.view(world, n))
        self.sent_bytes += (world - 1) * payload.shape[1]
        self.uncompressed_bytes += (world - 1) * n * input_tensor.element_size()
        return None

    def _shards_version(self) -> tuple | None:
        """Identifies the full-precision shards FSDP copied into the input; None when they cannot be tracked."""
        version = []
        for fsdp_param in self.fsdp_params:
            if fsdp_param.sharded_state != torch_compat.get("FSDPShardedState").SHARDED:
                return None  # gathered from the post-forward reshard (reshard_after_forward = an int)
            # The optimizer's in-place update bumps the DTensor parameter's own counter (not its local tensor's:
            # nn.Parameter detached it); a write into the local tensor or FSDP's padded buffer bumps theirs.
            param, data = fsdp_param.sharded_param, fsdp_param._sharded_param_data
            version.append((data.data_ptr(), data._version, param._version, param._local_tensor._version))
        return tuple(version) or None
