"""The compressed gradient reduce-scatter, and the two ways it compensates what its codes miss.

Installed with `FSDPModule.set_custom_reduce_scatter`: FSDP hands over the flat reduce-scatter input, one row per
destination rank (row j holds every parameter's j-th shard). Each row is quantized and the rows are exchanged with
one all-to-all of the uint8 payloads; each rank decodes the W rows it received and sums them (a reduce-scatter whose
wire format is the low-bit payload). A rank's own row is never sent: it is summed in full precision.

Compensation (`comp_t` is what is added to step t's gradient before quantizing; `h_t = g_t + comp_t`):

- `ErrorFeedback`, classic error feedback (Seide et al. 2014; Karimireddy et al. 2019): `e_t = h_t - Q(h_t)`, kept in
  fp32, `comp_{t+1} = e_t`. After any number of steps, what was sent plus the residuals equals the sum of the
  gradients. 4 bytes per value of the input, every rank.
- `LoCo` (Xie et al., "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training", 2024): the compensation
  is a moving average of the historical compensation errors, `e_t = beta * e_{t-1} + (1 - beta) * (h_t - Q(h_t))`,
  `comp_{t+1} = e_t`, stored as 8-bit blockwise codes (about 1 byte per value), and reset to zero every
  `reset_interval` steps (the error of steps long past no longer estimates the current one). The average stabilises
  the estimate of the current compression error; it conserves nothing, so no sum identity holds.

QSDP's gradients use the same exchange with stochastic rounding and no compensation.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from torchtitan.distributed import torch_compat
from torchtitan.distributed.compression.quantize import decode, encode, encode_and_restore, payload_bytes

# LoCo stores its error in 8-bit codes, as the paper does.
LOCO_ERROR_BITS = 8


@dataclass
class LoCoOptions:
    """[comm.loco]"""

    TABLE: ClassVar[str] = "loco"
    OLD_PREFIX: ClassVar[str] = "loco_"  # comm.loco_<option>, deprecated

    beta: float = 0.8
    """gradient_compression = loco: weight of the previous error in the moving average e <- beta * e + (1 - beta) * (h - Q(h)), in [0, 1)."""

    reset_interval: int = 1024
    """gradient_compression = loco: the error is reset to zero every this many steps; 0 = never."""


def _used_on_current_stream(tensor: torch.Tensor | None) -> None:
    """Tell the caching allocator that `tensor` is also used on the current stream, so that its memory is not handed
    out again before this stream's work on it is done.

    The compensation state lives on FSDP's reduce-scatter stream: made there by `update`, read there by the next
    `compensate`. A checkpoint's save or load replaces it from the default stream. The replacement is then read on
    the reduce-scatter stream (which waits for the default stream before every reduction, so the read sees the
    write) and released there when the next step replaces it; the tensor it replaced, made on the reduce-scatter
    stream, may still be read by the default stream's pending work (the save's reduce-scatter). Each crossing is
    recorded here. On the CPU there are no streams."""
    if tensor is not None and tensor.device.type != "cpu":
        tensor.record_stream(torch.accelerator.current_stream(tensor.device))


class ErrorFeedback:
    """Classic error feedback: the whole error of the last step, in fp32."""

    def __init__(self):
        self._error: torch.Tensor | None = None  # (world size, row length) float32, created at the first step
        self._adopt = False  # the state was set from another stream (a checkpoint): record its use at the next step

    @staticmethod
    def bytes_per_value(segments: list[int]) -> float:
        return 4.0

    def compensate(self, rows: torch.Tensor) -> torch.Tensor:
        if self._adopt:
            _used_on_current_stream(self._error)
            self._adopt = False
        return rows if self._error is None else rows + self._error

    def update(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self._error = compensated - sent  # made on this (the reduction's) stream

    @property
    def residual(self) -> torch.Tensor | None:
        """The compensation the next step adds, as float32 (world size, row length); None before the first step."""
        return self._error

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        """Set from outside the reduction (a checkpoint's save or load), on the caller's stream."""
        _used_on_current_stream(self._error)
        self._error, self._adopt = value, True

    # What a checkpoint saves verbatim for an exact resume: the residual itself.
    raw = residual

    @staticmethod
    def raw_template(world: int, segments: list[int], device: torch.device) -> torch.Tensor:
        """A zero raw state: what a rank holds before its first step."""
        return torch.zeros(world, sum(segments), device=device)


class LoCo:
    """LoCo's compensation: a moving average of the compensation errors, stored as 8-bit codes, periodically reset.

    `steps` counts the reductions since the start of training (one per optimizer step: FSDP reduces once per
    backward that syncs), kept as a Python integer so that the reset needs no device synchronisation."""

    def __init__(self, beta: float, reset_interval: int, segments: list[int]):
        self.beta = beta
        self.reset_interval = reset_interval
        self.segments = segments
        self.steps = 0
        self._codes: torch.Tensor | None = None  # uint8 payload rows of the error (LOCO_ERROR_BITS codes + scales)
        self._row = sum(segments)
        self._adopt = False  # the state was set from another stream (a checkpoint): record its use at the next step

    @staticmethod
    def bytes_per_value(segments: list[int]) -> float:
        return payload_bytes(segments, LOCO_ERROR_BITS) / sum(segments)

    def compensate(self, rows: torch.Tensor) -> torch.Tensor:
        if self.reset_interval and self.steps and self.steps % self.reset_interval == 0:
            self._codes = None
        self.steps += 1
        if self._adopt:
            _used_on_current_stream(self._codes)
            self._adopt = False
        error = self.residual
        return rows if error is None else rows + error

    def update(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        error = (compensated - sent).mul_(1.0 - self.beta)
        previous = self.residual
        if previous is not None:
            error.add_(previous, alpha=self.beta)
        self._codes = encode(error, LOCO_ERROR_BITS, segments=self.segments)

    @property
    def residual(self) -> torch.Tensor | None:
        """The compensation the next step adds, decoded to float32 (world size, row length); None when zero."""
        if self._codes is None:
            return None
        return decode(self._codes, self._row, LOCO_ERROR_BITS, segments=self.segments)

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        """Set from outside the reduction (a checkpoint's save or load), on the caller's stream."""
        _used_on_current_stream(self._codes)
        self._codes = None if value is None else encode(value, LOCO_ERROR_BITS, segments=self.segments)
        self._adopt = True

    @property
    def raw(self) -> torch.Tensor | None:
        """What a checkpoint saves verbatim for an exact resume: the error's codes (decoding and encoding them again
        need not give the same codes)."""
        return self._codes

    @raw.setter
    def raw(self, value: torch.Tensor | None) -> None:
        _used_on_current_stream(self._codes)
        self._codes, self._adopt = value, True

    @staticmethod
    def raw_template(world: int, segments: list[int], device: torch.device) -> torch.Tensor:
        """Zero codes (they decode to a zero error): what a rank holds before its first step."""
        return torch.zeros(world, payload_bytes(segments, LOCO_ERROR_BITS), dtype=torch.uint8, device=device)


class CompressedReduceScatter(torch_compat.private_base("FSDPReduceScatter")):
    """A reduce-scatter (sum) that sends `bits`-bit payloads; one instance per FSDP module (its compensation state's
    layout is that module's reduce-scatter input). `compensation`: ErrorFeedback, LoCo, or None (QSDP)."""

    def __init__(self, bits: int, compensation: ErrorFeedback | LoCo | None, stochastic: bool, rotate: bool,
                 segments: list[int]):
        self.bits = bits
        # Lengths of the parameters' shards that make up a row (each quantized with blocks of its own).
        self.segments = segments
        self.compensation = compensation
        self.stochastic = stochastic
        self.rotate = rotate
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
        world, rank = group.size(), group.rank()
        rows = input_tensor.view(world, -1).float()
        n = rows.shape[1]
        if n != sum(self.segments):
            # FSDP leaves out a parameter whose gradient is missing when it reduces: the layout of the row, and of
            # the compensation state, is then not the module's.
            raise RuntimeError(f"compressed reduce-scatter: a row of {n} values, not the {sum(self.segments)} of "
                               f"the module's parameters (one has no gradient at the reduction)")
        if self.compensation is not None:
            rows = self.compensation.compensate(rows)
            payload, sent = encode_and_restore(rows, self.bits, self.stochastic, self.rotate, self.segments)
            # The own row never leaves the device: it is summed exactly, so it leaves no error behind.
            sent[rank] = rows[rank]
            self.compensation.update(rows, sent)
        else:
            payload = encode(rows, self.bits, self.stochastic, self.rotate, self.segments)
        received = torch.empty_like(payload)
        dist.all_to_all_single(received, payload, group=group)
        decoded = decode(received, n, self.bits, self.rotate, self.segments)
        decoded[rank] = rows[rank]
        output_tensor.copy_(decoded.sum(dim=0))
        self.sent_bytes += (world - 1) * payload.shape[1]
        self.uncompressed_bytes += (world - 1) * n * input_tensor.element_size()
        return None
