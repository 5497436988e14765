"""FlexDeMo (From et al., "Decoupled Momentum Optimization for Fully and Hybrid Sharded Training", after DeMo by
Peng et al.): replicas never all-reduce gradients. Each keeps its own momentum; every step it extracts the momentum's
fast-moving components (a DCT of each chunk of `chunk_size` values, the `topk` largest coefficients per chunk),
removes them from its momentum, and all-gathers only those across replicas. Every replica decodes the same mean of
the replicas' components and steps by its sign, so the replicas' weights stay identical while the rest of the
momentum stays local.

Under HSDP, FSDP shards and reduce-scatters within a replica (a host) as usual; this optimizer then owns the
exchange across replicas, on each rank's shard. The wire format of one step, per chunk: `topk` coefficient indices
(uint8) and values (bfloat16), in one all-gather.

The parameters are processed in buckets of whole tensors (each padded to whole chunks, laid end to end), so a step
runs a handful of large kernels instead of a dozen small ones per tensor, while its temporaries stay bounded by the
bucket's size rather than the model's.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizers import BuildContext, register_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig


@dataclass
class FlexDeMoOptions:
    """[optimizer.flexdemo]"""

    TABLE: ClassVar[str] = "flexdemo"
    OLD_PREFIX: ClassVar[str] = "demo_"  # optimizer.demo_<option>, deprecated

    chunk_size: int = 64
    """FlexDeMo: values per DCT chunk of the momentum (at most 256)."""

    topk: int = 8
    """FlexDeMo: DCT coefficients per chunk sent to the other replicas each step (at most chunk_size)."""

    momentum_decay: float = 0.999
    """FlexDeMo: decay of the local momentum, which accumulates gradients and keeps what was not sent."""


def bucket_values(device: torch.device) -> int:
    """Values per bucket (beyond one tensor's own size). On the CPU each fp32 temporary stays at 4 MiB, which the
    allocator reuses, where larger ones are mapped fresh (and zeroed page by page) every step: the debug model's
    6M values in one bucket made the step 1.6x slower. A GPU's caching allocator keeps blocks of any size, and each
    kernel launch costs microseconds: 256 MiB there (not measured: no GPU here)."""
    return 1 << 20 if device.type == "cpu" else 1 << 26


def dct_matrix(size: int, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix: rows are the cosine basis, so `x @ D.T` transforms and `c @ D` inverts."""
    n = torch.arange(size, dtype=torch.float64)
    basis = torch.cos(math.pi / size * (n[None, :] + 0.5) * n[:, None])
    basis[0] /= math.sqrt(2)
    return (basis * math.sqrt(2 / size)).float().to(device)


def payload_bytes(numel: int, chunk_size: int, topk: int) -> int:
    """Bytes one replica sends per step for a tensor of `numel` values."""
    return -(-numel // chunk_size) * topk * 3


# The bit pattern of float32's smallest normal number: smaller magnitudes count as equal to it (denormals would
# compare as zero where the CPU flushes them).
_SMALLEST_NORMAL_BITS = 0x00800000


def _running_maxima(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest keys, in descending order: k running maxima, each below the last. A compiler fuses them
    into one pass per row, where a CPU `topk` sorts (value, index) pairs row by row and costs several times more."""
    found = [keys.amax(dim=1, keepdim=True)]
    for _ in range(k - 1):
        found.append(torch.where(keys < found[-1], keys, -1.0).amax(dim=1, keepdim=True))
    return torch.cat(found, dim=1)


@functools.cache
def _compiled_running_maxima() -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Compiled on first use, not at import: `torch.compile` loads inductor, most of a second of every trainer
    process's start-up. TORCHDYNAMO_DISABLE=1 (or a platform without a compiler) runs it eagerly: the same result,
    slower."""
    return torch.compile(_running_maxima, dynamic=True)


def top_k_indices(coefficients: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of each row's k largest magnitudes. Non-negative floats order as their bit patterns, so each
    magnitude's lowest bits are replaced by its position: every key of a row is distinct, still a float in the same
    order, and the k largest keys carry their own positions. Magnitudes within 2^-17 of each other (rows of 64; 2^-15
    for 256), far below the bfloat16 they are sent in, are ordered by position instead of by value."""
    width = coefficients.shape[1]
    low_bits = (1 << (width - 1).bit_length()) - 1
    positions = torch.arange(width, dtype=torch.int32, device=coefficients.device)
    keys = coefficients.abs().view(torch.int32).clamp_min_(_SMALLEST_NORMAL_BITS)
    keys.bitwise_and_(~low_bits).bitwise_or_(low_bits - positions)
    top = _compiled_running_maxima()(keys.view(torch.float32), k)
    return (low_bits - (top.view(torch.int32) & low_bits)).long()


class FlexDeMo(torch.optim.Optimizer):
    def __init__(self, params, lr: float, weight_decay: float, chunk_size: int, topk: int, momentum_decay: float,
                 replicate_group: dist.ProcessGroup):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.chunk_size, self.topk, self.momentum_decay = chunk_size, min(topk, chunk_size), momentum_decay
        self.replicate_group = replicate_group
        self._dct: torch.Tensor | None = None
        # Bytes this rank sent, and what the fp32 ring all-reduce it replaces sends (2 (R - 1) / R of the tensor).
        self.sent_bytes = 0
        self.uncompressed_bytes = 0

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def _momentum(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(param, dtype=torch.float32)
        return self._local(state["momentum"])

    def _buckets(self, work: list[tuple[torch.Tensor, dict]]) -> list[list[tuple[torch.Tensor, dict]]]:
        buckets, size, limit = [[]], 0, bucket_values(self._dct.device)
        for param, group in work:
            numel = self._local(param).numel()
            if buckets[-1] and size + numel > limit:
                buckets.append([])
                size = 0
            buckets[-1].append((param, group))
            size += numel
        return buckets

    def _rows(self, tensors: list[torch.Tensor]) -> list[int]:
        return [-(-t.numel() // self.chunk_size) for t in tensors]

    def _chunk_matrix(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """A zero (chunks x chunk_size) matrix with room for the tensors, each padded to whole chunks."""
        return torch.zeros(sum(self._rows(tensors)), self.chunk_size, device=self._dct.device)

    def _unchunk(self, chunks: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        return [part.view(-1)[:t.numel()].view_as(t) for t, part in zip(like, chunks.split(self._rows(like)))]

    @torch.no_grad()
    def step(self, closure=None):
        work = [(param, group) for group in self.param_groups for param in group["params"] if param.grad is not None]
        if self._dct is None and work:
            self._dct = dct_matrix(self.chunk_size, self._local(work[0][0]).device)
        buckets = self._buckets(work) if work else []
        # Every bucket's components travel in one all-gather: one collective per step. A rank without gradients (or
        # with empty shards) sends nothing, but still joins it, with a tensor on its parameters' device (NCCL
        # rejects a CPU tensor).
        payload = (torch.cat([self._extract(bucket) for bucket in buckets]) if buckets
                   else torch.zeros(0, dtype=torch.uint8, device=self._local(self.param_groups[0]["params"][0]).device))
        replicas = dist.get_world_size(self.replicate_group)
        gathered = torch.empty(replicas * payload.numel(), dtype=torch.uint8, device=payload.device)
        dist.all_gather_single(gathered, payload, group=self.replicate_group)
        self.sent_bytes += (replicas - 1) * payload.numel()
        self.uncompressed_bytes += 2 * (replicas - 1) * 4 * sum(self._local(p).numel() for p, _ in work) // replicas
        offset = 0
        for bucket in buckets:
            weights = [self._local(param) for param, _ in bucket]
            rows = sum(self._rows(weights))
            part = gathered.view(replicas, -1)[:, offset:offset + rows * 3 * self.topk]
            offset += rows * 3 * self.topk
            for (param, group), update in zip(bucket, self._unchunk(self._decode(part, rows), weights)):
                weight = self._local(param)
                if group["weight_decay"]:
                    weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.add_(update.to(weight.dtype), alpha=-group["lr"])
        return None

    def _extract(self, bucket: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
        """Accumulate the gradients into the local momenta and take out their top DCT components: returns the bytes
        sent, per chunk the `topk` indices (uint8) then their values (bfloat16)."""
        momenta = [self._momentum(param) for param, _ in bucket]
        accumulated = self._chunk_matrix(momenta)
        accumulated_views = self._unchunk(accumulated, momenta)
        for momentum, accumulated_view, (param, _) in zip(momenta, accumulated_views, bucket):
            torch.add(self._local(param.grad), momentum, alpha=self.momentum_decay, out=accumulated_view)
        coefficients = accumulated @ self._dct.T
        indices = top_k_indices(coefficients, self.topk)
        values = coefficients.gather(1, indices).to(torch.bfloat16)
        # What is sent leaves the local momentum (as the receivers decode it: in bfloat16).
        sent = torch.zeros_like(coefficients).scatter_(1, indices, values.float())
        removed_views = self._unchunk(sent @ self._dct, momenta)
        for momentum, accumulated_view, removed_view in zip(momenta, accumulated_views, removed_views):
            torch.sub(accumulated_view, removed_view, out=momentum)
        return torch.cat((indices.to(torch.uint8), values.view(torch.uint8)), dim=1).view(-1)

    def _decode(self, part: torch.Tensor, rows: int) -> torch.Tensor:
        """The sign of the replicas' mean components, back in the chunks' value space."""
        replicas, k = part.shape[0], self.topk
        part = part.reshape(replicas, rows, 3 * k)
        total = torch.zeros(rows, self.chunk_size, device=self._dct.device)
        for replica in range(replicas):  # in replica order: every replica sums identically
            values = part[replica, :, k:].contiguous().view(torch.bfloat16).float()
            total.scatter_add_(1, part[replica, :, :k].long(), values)
        return (total.div_(replicas) @ self._dct).sign_()

    def state_dict(self):
        """The replicas' mean momentum (the total, what the exchange averages, divided by the replicas), in a new
        tensor: every replica saves the same values, so the checkpoint holds one momentum per parameter, sharded and
        resharded like any optimizer state. The live momenta are left as they are (saving must not change training);
        OptimizersContainer also saves each replica's own (`replica_state`) for an exact resume."""
        saved = super().state_dict()
        replicas = dist.get_world_size(self.replicate_group)
        # torch's state_dict() holds the live per-parameter dicts: copied before one of their entries is replaced.
        saved["state"] = {index: dict(state) for index, state in saved["state"].items()}
        for state in saved["state"].values():
            if "momentum" in state:
                mean = state["momentum"].detach().clone()
                dist.all_reduce(self._local(mean), group=self.replicate_group)
                self._local(mean).div_(replicas)
                state["momentum"] = mean
        return saved

    def replica_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """The state that differs between replicas, live: each replica's own momentum."""
        return {param: {"momentum": state["momentum"]} for param, state in self.state.items() if "momentum" in state}


def _momentum_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                    matrix_method: bool) -> float:
    return 4 * math.prod(local_shape)


@register_optimizer("FlexDeMo", state_bytes=_momentum_bytes, options=FlexDeMoOptions)
def build_flexdemo(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    options = config.flexdemo
    return FlexDeMo(groups, lr=config.lr, weight_decay=config.weight_decay, chunk_size=options.chunk_size,
                    topk=options.topk, momentum_decay=options.momentum_decay,
                    replicate_group=context.replicate_group)
