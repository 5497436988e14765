"""The compressed gradient reduce-scatter, and the two ways it compensates what its codes miss.

Installed with `FSDPModule.set_custom_reduce_scatter`: FSDP hands over the flat reduce-scatter input, one row per
destination rank (row j holds every parameter's j-th shard). Each row is quantized and the rows are exchanged with
one all-to-all of the uint8 payloads; each rank decodes the W rows it received and sums them (a reduce-scatter whose
wire format is the low-bit payload). A rank's own row is never sent: it is summed in full precision.

Compensation (`comp_t` is what is added to step t's gradient before quantizing; `h_t = g_t + comp_t`):

- `ErrorFeedback`, classic error feedback (Seide et al. 2014; Karimireddy et al. 2019): `e_t = h_t - Q(h_t)`, kept in
  fp32, `comp_{t+1} = e_t`. After any number of steps, what was sent plus the residuals equals the sum of the
  gradients. 4 bytes per value of the input, every rank.
- `LoCo` (Xie et al., "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training", 2024), as DeepSpeed
  implements it (ZeRO++'s `zeropp_loco_param`: `loco_swizzled_quant_kernel` and `all_to_all_loco_quant_reduce`, the
  code the authors link to, DeepSpeed PR 6730):
  the compensation is a moving average of the compensation errors, `e_t = beta * e_{t-1} + (1 - beta) *
  (h_t - Q(h_t))`, `comp_{t+1} = e_t`, stored between steps as 8-bit blockwise codes (about 1 byte per value), and
  reset to zero every `reset_interval` optimizer steps (the error of steps long past no longer estimates the
  current one). The average stabilises the estimate of the current compression error; it conserves nothing, so no
  sum identity holds. Where this differs from DeepSpeed's: one exchange (DeepSpeed's is hierarchical, an
  all-to-all within the node and one across nodes, with an error kept at each level); the error is computed in
  fp32 (DeepSpeed's kernel: fp16) and quantized in this wire format's blocks; the reset counts optimizer steps,
  where DeepSpeed's counter counts every tensor's reduction (so its `reset_T` is in reductions, micro-batches
  and tensors alike); and a rank's own row is summed exactly, leaving no error.

Every reduction of a step stages the state it leaves; the optimizer step commits it, and a step whose gradients are
dropped (skipped, or not committed by torchft) discards it (`_StagedCompensation`).

QSDP's gradients use the same exchange with stochastic rounding and no compensation.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from torchtitan.distributed import torch_compat
from torchtitan.distributed.compression.quantize import decode, encode, encode_and_restore, payload_bytes

# LoCo stores its error between steps in 8-bit codes, as DeepSpeed's implementation does.
LOCO_ERROR_BITS = 8


@dataclass
class LoCoOptions:
    """[comm.loco]"""

    TABLE: ClassVar[str] = "loco"
    OLD_PREFIX: ClassVar[str] = "loco_"  # comm.loco_<option>, deprecated

    beta: float = 0.8
    """gradient_compression = loco: weight of the previous error in the moving average e <- beta * e + (1 - beta) * (h - Q(h)), in [0, 1)."""

    reset_interval: int = 1024
    """gradient_compression = loco: the error is reset to zero every this many optimizer steps (a step's micro-batches count once, a skipped step not at all); 0 = never."""


def _used_on_current_stream(tensor: torch.Tensor | None) -> None:
    """Tell the caching allocator that `tensor` is also used on the current stream, so that its memory is not handed
    out again before this stream's work on it is done.

    The compensation state lives on FSDP's reduce-scatter stream: made there by `update`, read there by the next
    `compensate`. A checkpoint's load replaces it from the default stream, and a save reads it there (the
    all-to-all of its codes). The replacement is then read on the reduce-scatter stream (which waits for
    the default stream before every reduction, so the read sees the write) and released there when a later step
    replaces it; the tensor it replaced, made on the reduce-scatter stream, may still be read by the default
    stream's pending work. Each crossing is recorded here. On the CPU there are no streams."""
    if tensor is not None and tensor.device.type != "cpu":
        tensor.record_stream(torch.accelerator.current_stream(tensor.device))


class _StagedCompensation:
    """The state a step's reductions update, staged until the optimizer applies the step's gradients.

    FSDP reduces inside the backward, before the trainer knows whether the step's update will be applied (a
    non-finite value or a spike skips it, debug.on_nonfinite and health.spike_sigma). So each reduction reads the
    state this step has staged so far (the step's earlier micro-batches) or, at the step's first, the committed
    state, and stages what it leaves: `commit` (the optimizer stepped) makes the staged state the committed one,
    `discard` (the step's gradients were dropped: skipped, or a step that torchft did not commit) forgets it. A
    skipped step thus leaves the state exactly as it was before the step, and a re-run of it (health.rerun_bad_steps)
    starts from the same state as the first run."""

    def __init__(self):
        self._committed: torch.Tensor | None = None  # what the next step starts from; None: zero
        self._staged: torch.Tensor | None = None  # this step's, until commit or discard
        self._adopt = False  # the state was set from another stream (a checkpoint): record its use at the next step

    def _start(self) -> torch.Tensor | None:
        """What the step's first reduction starts from, in the stored form."""
        return self._committed

    def _current(self) -> torch.Tensor | None:
        if self._adopt:
            _used_on_current_stream(self._committed)
            self._adopt = False
        return self._staged if self._staged is not None else self._start()

    def held(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The committed and the staged state (None where there is none)."""
        return self._committed, self._staged

    def commit(self) -> None:
        if self._staged is not None:
            self._committed, self._staged = self._staged, None

    def discard(self) -> None:
        self._staged = None

    def _set_committed(self, value: torch.Tensor | None) -> None:
        """Set from outside the reduction (a checkpoint's load), on the caller's stream."""
        _used_on_current_stream(self._committed)
        self._committed, self._staged, self._adopt = value, None, True


class ErrorFeedback(_StagedCompensation):
    """Classic error feedback: the whole error of the last step, in fp32."""

    @staticmethod
    def bytes_per_value(segments: list[int]) -> float:
        return 4.0

    def compensate(self, rows: torch.Tensor) -> torch.Tensor:
        error = self._current()
        return rows if error is None else rows + error

    def update(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self._staged = compensated - sent  # made on this (the reduction's) stream

    @property
    def residual(self) -> torch.Tensor | None:
        """The compensation the next step adds, as float32 (world size, row length); None before the first step."""
        return self._committed

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        self._set_committed(value)

    # What a checkpoint saves verbatim for an exact resume: the residual itself.
    raw = residual

    def owed_codes(self, segments: list[int]) -> torch.Tensor | None:
        """What this rank owes each rank's shards (one row per rank), as the 8-bit codes a save exchanges: the fp32
        residual rounded to LoCo's storage precision (within half a code, 1/254 of each block's largest value); None
        before the first step."""
        return None if self._committed is None else encode(self._committed, LOCO_ERROR_BITS, segments=segments)

    @staticmethod
    def raw_template(world: int, segments: list[int], device: torch.device) -> torch.Tensor:
        """A zero raw state: what a rank holds before its first step."""
        return torch.zeros(world, sum(segments), device=device)


class LoCo(_StagedCompensation):
    """LoCo's compensation: a moving average of the compensation errors, stored as 8-bit codes, periodically reset.

    `steps` counts the optimizer steps since the start of training that applied this state's gradients (commits),
    not the reductions: FSDP reduces every micro-batch of a step, and a skipped step's update is not applied. A
    Python integer, so that the reset needs no device synchronisation."""

    def __init__(self, beta: float, reset_interval: int, segments: list[int]):
        super().__init__()  # the committed and staged states are uint8 payload rows (LOCO_ERROR_BITS codes + scales)
        self.beta = beta
        self.reset_interval = reset_interval
        self.segments = segments
        self.steps = 0
        self._row = sum(segments)
        self._previous: torch.Tensor | None = None  # the decoded error the current reduction added

    @staticmethod
    def bytes_per_value(segments: list[int]) -> float:
        return payload_bytes(segments, LOCO_ERROR_BITS) / sum(segments)

    def _reset_due(self) -> bool:
        return bool(self.reset_interval and self.steps and self.steps % self.reset_interval == 0)

    def _start(self) -> torch.Tensor | None:
        # Every reset_interval steps the step starts from a zero error: `commit` drops the error then; a state loaded
        # from a checkpoint written before it did (the reset happened at the next reduction) is dropped here.
        return None if self._reset_due() else self._committed

    def _decoded(self, codes: torch.Tensor | None) -> torch.Tensor | None:
        return None if codes is None else decode(codes, self._row, LOCO_ERROR_BITS, segments=self.segments)

    def compensate(self, rows: torch.Tensor) -> torch.Tensor:
        self._previous = self._decoded(self._current())
        return rows if self._previous is None else rows + self._previous

    def update(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        error = (compensated - sent).mul_(1.0 - self.beta)
        if self._previous is not None:
            error.add_(self._previous, alpha=self.beta)
        self._previous = None
        self._staged = encode(error, LOCO_ERROR_BITS, segments=self.segments)

    def commit(self) -> None:
        super().commit()
        self.steps += 1
        if self._reset_due():
            self._committed = None

    @property
    def residual(self) -> torch.Tensor | None:
        """The compensation the next step adds, decoded to float32 (world size, row length); None when zero."""
        return self._decoded(self._start())

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        self._set_committed(None if value is None else encode(value, LOCO_ERROR_BITS, segments=self.segments))

    @property
    def raw(self) -> torch.Tensor | None:
        """What a checkpoint saves verbatim for an exact resume: the error's codes (decoding and encoding them again
        need not give the same codes)."""
        return self._committed

    @raw.setter
    def raw(self, value: torch.Tensor | None) -> None:
        self._set_committed(value)

    def owed_codes(self, segments: list[int]) -> torch.Tensor | None:
        """What this rank owes each rank's shards (one row per rank), as the 8-bit codes a save exchanges: the stored
        codes themselves (None: zero)."""
        return self._start()

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
