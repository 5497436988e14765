"""FlexDeMo (From et al., "Decoupled Momentum Optimization for Fully and Hybrid Sharded Training", after DeMo by
Peng et al.): replicas never all-reduce gradients. Each keeps its own momentum; every step it extracts the momentum's
fast-moving components, removes them from its momentum, and all-gathers only those across replicas. Every replica
decodes the same mean of the replicas' components and steps by its sign, so the replicas' weights stay identical
while the rest of the momentum stays local.

The components are the `topk` largest DCT coefficients of each chunk of `chunk_size` consecutive values of the
flattened tensor (`tiles=False`), or, as DeMo's reference takes them (`tiles=True`), of each h x w tile of a matrix
(2-D DCT; other tensors keep 1-D chunks). The reference's tiles are up to 64 x 64 (4096 values, top 32); here a tile
holds `chunk_size` values (8 x 8 for 64, `tile_shape`), so an index fits in a byte and the bytes per value are the
chunks'. On the debug model the chunks trained better (docs/recipes.md, "FlexDeMo at more replicas"): the default.

Under HSDP, FSDP shards and reduce-scatters within a replica (a host) as usual; this optimizer then owns the
exchange across replicas, on each rank's shard (tiles of its rows when tiled). The wire format of one step, per tile or chunk:
`topk` coefficient indices (uint8) and values (bfloat16), in one all-gather. Each replica sends (R - 1) / R of the
gathered payload, so the bytes per rank grow with the replica count R where a ring all-reduce's stay near twice the
tensor: docs/recipes.md, "FlexDeMo at more replicas", has the table.

The parameters are processed in buckets of whole tensors (each padded to whole chunks or tiles, one per row of a
matrix; the tiled matrices first), so a step
runs a handful of large kernels instead of a dozen small ones per tensor, while its temporaries stay bounded by the
bucket's size rather than the model's.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

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
    OLD_OPTIONS: ClassVar[tuple[str, ...]] = ("chunk_size", "topk", "momentum_decay")  # transform came with the table

    chunk_size: int = 64
    """FlexDeMo: values per DCT chunk of the momentum, or per tile of a matrix with transform = tiles (h x w, as square
    as it divides: 8 x 8 for 64); at most 256."""

    topk: int = 8
    """FlexDeMo: DCT coefficients per tile or chunk sent to the other replicas each step (at most chunk_size)."""

    momentum_decay: float = 0.999
    """FlexDeMo: decay of the local momentum, which accumulates gradients and keeps what was not sent."""

    transform: Literal["chunks", "tiles"] = "chunks"
    """FlexDeMo: what each DCT covers: chunks (chunk_size consecutive values of the flattened tensor, 1-D DCT) or tiles
    (a matrix's h x w tiles, h * w = chunk_size, 2-D DCT, as DeMo's reference; other tensors keep chunks). Same bytes;
    docs/recipes.md compares their loss."""


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


def tile_shape(chunk_size: int) -> tuple[int, int]:
    """The h x w tile of a matrix's 2-D DCT: h * w = chunk_size, as square as it divides (8 x 8 for 64, 8 x 16 for
    128; a prime size gives 1 x chunk_size, rows of a matrix)."""
    height = max(d for d in range(1, math.isqrt(chunk_size) + 1) if chunk_size % d == 0)
    return height, chunk_size // height


def row_count(shape: tuple[int, ...], chunk_size: int) -> int:
    """Tiles of a matrix, chunks of another tensor: the rows it takes in a bucket, each padded with zeros."""
    if len(shape) == 2:
        height, width = tile_shape(chunk_size)
        return -(-shape[0] // height) * -(-shape[1] // width)
    return -(-math.prod(shape) // chunk_size)


def to_rows(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The tensor's tiles (a matrix: row-major h x w tiles, each flattened row-major) or chunks, one per row,
    zero-padded: (row_count, chunk_size)."""
    if tensor.dim() == 2:
        (rows, cols), (height, width) = tensor.shape, tile_shape(chunk_size)
        tiles_down, tiles_across = -(-rows // height), -(-cols // width)
        padded = torch.nn.functional.pad(tensor, (0, tiles_across * width - cols, 0, tiles_down * height - rows))
        return padded.view(tiles_down, height, tiles_across, width).transpose(1, 2).reshape(-1, chunk_size)
    flat = tensor.reshape(-1)
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % chunk_size)).view(-1, chunk_size)


def from_rows(rows: torch.Tensor, shape: tuple[int, ...], chunk_size: int) -> torch.Tensor:
    """The inverse of `to_rows`: a tensor of `shape` from its rows, the padding dropped."""
    if len(shape) == 2:
        (height, width), tiles_across = tile_shape(chunk_size), -(-shape[1] // tile_shape(chunk_size)[1])
        whole = rows.view(-1, tiles_across, height, width).transpose(1, 2).reshape(-1, tiles_across * width)
        return whole[:shape[0], :shape[1]]
    return rows.reshape(-1)[:math.prod(shape)].view(shape)


def tile_dct_matrix(chunk_size: int, device: torch.device) -> torch.Tensor:
    """The 2-D DCT of a flattened (row-major) h x w tile as one matrix: D_h X D_w^T is (D_h kron D_w) vec(X)."""
    height, width = tile_shape(chunk_size)
    return torch.kron(dct_matrix(height, device), dct_matrix(width, device))


def payload_bytes(shape: tuple[int, ...], chunk_size: int, topk: int) -> int:
    """Bytes one replica sends per step for a tensor (its local shard) of `shape`."""
    return row_count(shape, chunk_size) * topk * 3


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
                 replicate_group: dist.ProcessGroup, tiles: bool = False):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.chunk_size, self.topk, self.momentum_decay = chunk_size, min(topk, chunk_size), momentum_decay
        self.tiles = tiles
        self.replicate_group = replicate_group
        self._dct: torch.Tensor | None = None
        self._tile_dct: torch.Tensor | None = None
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
        # The tiled matrices first: their tiles take one transform, the chunks another.
        return [sorted(bucket, key=lambda entry: len(self._shape(self._local(entry[0]))) != 2) for bucket in buckets]

    def _shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """The shape the rows are cut from: a matrix's own when tiled, else the flattened tensor's."""
        return tuple(tensor.shape) if self.tiles and tensor.dim() == 2 else (tensor.numel(),)

    def _row_counts(self, tensors: list[torch.Tensor]) -> tuple[int, int]:
        """The rows of the tensors, and how many of them are tiles."""
        shapes = [self._shape(t) for t in tensors]
        return (sum(row_count(shape, self.chunk_size) for shape in shapes),
                sum(row_count(shape, self.chunk_size) for shape in shapes if len(shape) == 2))

    def _rows(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's rows: the tiled matrices' tiles, then the chunks."""
        return torch.cat([to_rows(t.float().reshape(self._shape(t)), self.chunk_size) for t in tensors])

    def _from_rows(self, rows: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = rows.split([row_count(self._shape(t), self.chunk_size) for t in like])
        return [from_rows(part, self._shape(t), self.chunk_size).view(t.shape) for t, part in zip(like, parts)]

    def _transform(self, rows: torch.Tensor, tiles: int, inverse: bool = False) -> torch.Tensor:
        """Each row's DCT (2-D for the first `tiles` rows, 1-D for the rest), or with `inverse` its inverse."""
        tile_dct, dct = (self._tile_dct, self._dct) if inverse else (self._tile_dct.T, self._dct.T)
        if tiles == rows.shape[0]:
            return rows @ tile_dct
        return torch.cat((rows[:tiles] @ tile_dct, rows[tiles:] @ dct)) if tiles else rows @ dct

    @torch.no_grad()
    def step(self, closure=None):
        work = [(param, group) for group in self.param_groups for param in group["params"] if param.grad is not None]
        if self._dct is None and work:
            device = self._local(work[0][0]).device
            self._dct, self._tile_dct = dct_matrix(self.chunk_size, device), tile_dct_matrix(self.chunk_size, device)
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
            rows, tiles = self._row_counts(weights)
            part = gathered.view(replicas, -1)[:, offset:offset + rows * 3 * self.topk]
            offset += rows * 3 * self.topk
            for (param, group), update in zip(bucket, self._from_rows(self._decode(part, rows, tiles), weights)):
                weight = self._local(param)
                if group["weight_decay"]:
                    weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.add_(update.to(weight.dtype), alpha=-group["lr"])
        return None

    def _extract(self, bucket: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
        """Accumulate the gradients into the local momenta and take out their top DCT components: returns the bytes
        sent, per tile or chunk the `topk` indices (uint8) then their values (bfloat16)."""
        momenta = [self._momentum(param) for param, _ in bucket]
        accumulated = [torch.add(self._local(param.grad), momentum, alpha=self.momentum_decay)
                       for momentum, (param, _) in zip(momenta, bucket)]
        coefficients = self._transform(self._rows(accumulated), self._row_counts(accumulated)[1])
        indices = top_k_indices(coefficients, self.topk)
        values = coefficients.gather(1, indices).to(torch.bfloat16)
        # What is sent leaves the local momentum (as the receivers decode it: in bfloat16).
        sent = torch.zeros_like(coefficients).scatter_(1, indices, values.float())
        removed = self._from_rows(self._transform(sent, self._row_counts(momenta)[1], inverse=True), momenta)
        for momentum, accumulated_values, removed_values in zip(momenta, accumulated, removed):
            torch.sub(accumulated_values, removed_values, out=momentum)
        return torch.cat((indices.to(torch.uint8), values.view(torch.uint8)), dim=1).view(-1)

    def _decode(self, part: torch.Tensor, rows: int, tiles: int) -> torch.Tensor:
        """The sign of the replicas' mean components, back in the value space of the tiles and chunks."""
        replicas, k = part.shape[0], self.topk
        part = part.reshape(replicas, rows, 3 * k)
        total = torch.zeros(rows, self.chunk_size, device=self._dct.device)
        for replica in range(replicas):  # in replica order: every replica sums identically
            values = part[replica, :, k:].contiguous().view(torch.bfloat16).float()
            total.scatter_add_(1, part[replica, :, :k].long(), values)
        return self._transform(total.div_(replicas), tiles, inverse=True).sign_()

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
                    replicate_group=context.replicate_group, tiles=options.transform == "tiles")
