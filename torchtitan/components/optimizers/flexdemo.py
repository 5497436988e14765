"""FlexDeMo (From et al., "Decoupled Momentum Optimization for Fully and Hybrid Sharded Training", 2025): DeMo's
step (Peng et al., "DeMo: Decoupled Momentum Optimization", 2024; reference code bloc97/DeMo, `demo.py`) on the
shards of FSDP/HSDP. Replicas never all-reduce gradients: each keeps its own momentum `delta` and, every step, sends
only its fast-moving components. Per parameter (its local shard), with the group's lr and weight decay wd:

1. w <- w (1 - lr wd) (decoupled weight decay);
2. delta <- momentum_decay * delta + lr * g: DeMo accumulates the gradient scaled by the learning rate of its step,
   so the schedule weighs each gradient as it enters the momentum;
3. the orthonormal DCT-II of delta, chunk by chunk: a matrix is cut into h x w tiles, h the largest divisor of its
   row count that is at most `chunk_size`, w the same of its column count (64 x 64 tiles for dimensions that are
   multiples of 64; a dimension with no divisor but 1 up to `chunk_size` gives 1), and each tile takes the 2-D DCT;
   a vector is cut into chunks of its largest divisor up to `chunk_size`, each taking the 1-D DCT;
4. the `topk` largest-magnitude coefficients of each tile (of its h x w; all of them if it has fewer) are sent, and
   removed from delta (delta -= the inverse DCT of what was sent);
5. every replica gathers every replica's (index, value) pairs and decodes, per coefficient, the mean over the replicas
   that sent it (the reference's `scatter_reduce(reduce="mean", include_self=False)`): a coefficient sent by one
   replica of R keeps its value, it is not divided by R; one sent by none is zero;
6. w <- w - lr sign(the inverse DCT of those means).

Every replica decodes the same means, so the replicas' weights stay identical while the rest of each momentum stays
local. Tensors of more than two dimensions are treated as matrices of their first dimension by the rest.

Where this differs from the reference, and why: the indices travel as int16 (the reference's are int64; they carry
the same numbers, so `chunk_size` is at most 128); the mean is summed replica by replica in replica order with
`scatter_add_` (the reference's `scatter_reduce` notes it is not deterministic across CUDA devices, which would let
the replicas' weights drift apart); a parameter without a gradient is skipped (the reference fails on it); and under
FSDP each rank transforms its own shard, the tiles cut from the shard's shape (FlexDeMo's setting: the exchange is
between the replicas of a shard). The values travel in full precision (fp32), as the reference sends them in the
parameter's dtype: 6 bytes per sent coefficient, 32 of each 4096-value tile by default (0.047 bytes per value).

Under HSDP, FSDP shards and reduce-scatters within a replica (a host) as usual; this optimizer then owns the
exchange across replicas: one all-gather per step of every parameter's payload. Each replica sends (R - 1) / R of
the gathered payload, so the bytes per rank grow with the replica count R where a ring all-reduce's stay near twice
the tensor: docs/recipes.md, "FlexDeMo: DeMo's step, at more replicas", has the table.
"""

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizers import (BuildContext, RankTensor, StepLayout, largest_shard,
                                              register_optimizer)
from torchtitan.config.compatibility import MethodRefusal
from torchtitan.config.job_config import Optimizer as OptimizerConfig

# Bytes per sent coefficient: an int16 index and an fp32 value.
INDEX_BYTES, VALUE_BYTES = 2, 4


@dataclass
class FlexDeMoOptions:
    """[optimizer.flexdemo]"""

    TABLE: ClassVar[str] = "flexdemo"
    OLD_PREFIX: ClassVar[str] = "demo_"  # optimizer.demo_<option>, deprecated
    OLD_OPTIONS: ClassVar[tuple[str, ...]] = ("chunk_size", "topk", "momentum_decay")

    chunk_size: int = 64
    """FlexDeMo: the DCT's length along each dimension, at most: a dimension is cut into chunks of its largest divisor up to this (a matrix into tiles, 64 x 64 by default, as DeMo's reference); at most 128."""

    topk: int = 32
    """FlexDeMo: DCT coefficients of each tile (or vector chunk) sent to the other replicas each step (all of them where a tile has fewer)."""

    momentum_decay: float = 0.999
    """FlexDeMo: decay of the local momentum, which accumulates lr-scaled gradients and keeps what was not sent."""


def chunk_length(size: int, chunk_size: int) -> int:
    """The largest divisor of `size` that is at most `chunk_size` (the reference's `_get_smaller_split`): the
    chunks cover the dimension exactly, with no padding."""
    return max(d for d in range(1, min(size, chunk_size) + 1) if size % d == 0)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a tensor is transformed as: a vector as one row, more than two dimensions as (first, rest)."""
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def tile_shape(shape: tuple[int, ...], chunk_size: int) -> tuple[int, int]:
    """The h x w tile of a tensor of `shape` (a vector's chunks are 1 x w tiles: the 2-D DCT of a 1-row tile is the
    1-D DCT of its row)."""
    rows, cols = matrix_shape(shape)
    return chunk_length(rows, chunk_size), chunk_length(cols, chunk_size)


def tile_count(shape: tuple[int, ...], chunk_size: int) -> int:
    (rows, cols), (height, width) = matrix_shape(shape), tile_shape(shape, chunk_size)
    return rows // height * (cols // width)


def sent_per_tile(shape: tuple[int, ...], chunk_size: int, topk: int) -> int:
    height, width = tile_shape(shape, chunk_size)
    return min(topk, height * width)


def payload_bytes(shape: tuple[int, ...], chunk_size: int, topk: int) -> int:
    """Bytes one replica sends per step for a tensor (its local shard) of `shape`."""
    if math.prod(shape) == 0:
        return 0
    return tile_count(shape, chunk_size) * sent_per_tile(shape, chunk_size, topk) * (INDEX_BYTES + VALUE_BYTES)


@functools.lru_cache(maxsize=64)
def dct_matrix(size: int, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix: rows are the cosine basis, so `D @ x` transforms and `D.T @ c` inverts."""
    n = torch.arange(size, dtype=torch.float64)
    basis = torch.cos(math.pi / size * (n[None, :] + 0.5) * n[:, None])
    basis[0] /= math.sqrt(2)
    return (basis * math.sqrt(2 / size)).float().to(device)


def to_tiles(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The tensor's tiles (row-major order), each flattened row-major: (tiles, h * w)."""
    (rows, cols), (height, width) = matrix_shape(tuple(tensor.shape)), tile_shape(tuple(tensor.shape), chunk_size)
    tiles = tensor.reshape(rows // height, height, cols // width, width).transpose(1, 2)
    return tiles.reshape(-1, height * width)


def from_tiles(tiles: torch.Tensor, shape: tuple[int, ...], chunk_size: int) -> torch.Tensor:
    """The inverse of `to_tiles`: the tensor of `shape`."""
    (rows, cols), (height, width) = matrix_shape(shape), tile_shape(shape, chunk_size)
    matrix = tiles.view(rows // height, cols // width, height, width).transpose(1, 2)
    return matrix.reshape(shape)


def transform(tiles: torch.Tensor, height: int, width: int, inverse: bool = False) -> torch.Tensor:
    """Each flattened h x w tile's 2-D DCT-II, D_h X D_w^T, or with `inverse` its inverse, D_h^T C D_w."""
    rows, cols = dct_matrix(height, tiles.device), dct_matrix(width, tiles.device)
    if inverse:
        rows, cols = rows.T, cols.T
    return (rows @ tiles.view(-1, height, width) @ cols.T).reshape(tiles.shape)


class FlexDeMo(torch.optim.Optimizer):
    def __init__(self, params, lr: float, weight_decay: float, chunk_size: int, topk: int, momentum_decay: float,
                 replicate_group: dist.ProcessGroup):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.chunk_size, self.topk, self.momentum_decay = chunk_size, topk, momentum_decay
        self.replicate_group = replicate_group
        # Bytes this rank sent, and what the fp32 ring all-reduce it replaces sends (2 (R - 1) / R of the tensor).
        self.sent_bytes = 0
        self.uncompressed_bytes = 0

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def _delta(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(param, dtype=torch.float32)
        return self._local(state["delta"])

    @torch.no_grad()
    def step(self, closure=None):
        work = [(param, group) for group in self.param_groups for param in group["params"]
                if param.grad is not None and self._local(param).numel()]
        # Every parameter's components travel in one all-gather: one collective per step. A rank without gradients
        # (or with empty shards only) sends nothing, but still joins it, with a tensor on its parameters' device
        # (NCCL rejects a CPU tensor).
        payload = (torch.cat([self._extract(param, group) for param, group in work]) if work
                   else torch.zeros(0, dtype=torch.uint8, device=self._local(self.param_groups[0]["params"][0]).device))
        replicas = dist.get_world_size(self.replicate_group)
        gathered = torch.empty(replicas * payload.numel(), dtype=torch.uint8, device=payload.device)
        dist.all_gather_single(gathered, payload, group=self.replicate_group)
        self.sent_bytes += (replicas - 1) * payload.numel()
        self.uncompressed_bytes += 2 * (replicas - 1) * 4 * sum(self._local(p).numel() for p, _ in work) // replicas
        offset = 0
        for param, group in work:
            weight = self._local(param)
            size = payload_bytes(tuple(weight.shape), self.chunk_size, self.topk)
            update = self._decode(gathered.view(replicas, -1)[:, offset:offset + size], tuple(weight.shape))
            offset += size
            weight.add_(update.to(weight.dtype), alpha=-group["lr"])
        return None

    def _extract(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """Decay the weight, accumulate the lr-scaled gradient into delta and take out its top DCT coefficients:
        returns the bytes sent, the tiles' int16 indices then their fp32 values."""
        weight, delta = self._local(param), self._delta(param)
        if group["weight_decay"]:
            weight.mul_(1 - group["lr"] * group["weight_decay"])
        delta.mul_(self.momentum_decay).add_(self._local(param.grad), alpha=group["lr"])
        shape = tuple(delta.shape)
        height, width = tile_shape(shape, self.chunk_size)
        coefficients = transform(to_tiles(delta, self.chunk_size), height, width)
        # Sorted: torch's CPU topk took 26x longer unsorted (92 ms against 3.5 ms for the 144 tiles of 2304 x 256).
        indices = coefficients.abs().topk(sent_per_tile(shape, self.chunk_size, self.topk), dim=1).indices
        values = coefficients.gather(1, indices)
        sent = torch.zeros_like(coefficients).scatter_(1, indices, values)
        delta.sub_(from_tiles(transform(sent, height, width, inverse=True), shape, self.chunk_size))
        return torch.cat((indices.to(torch.int16).view(torch.uint8).view(-1), values.view(torch.uint8).view(-1)))

    def _decode(self, part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The sign of the inverse DCT of each coefficient's mean over the replicas that sent it (zero where none
        did), for a tensor of `shape`, from the replicas' payloads (one row each)."""
        replicas, tiles = part.shape[0], tile_count(shape, self.chunk_size)
        height, width = tile_shape(shape, self.chunk_size)
        k = sent_per_tile(shape, self.chunk_size, self.topk)
        part = part.contiguous()
        indices = part[:, :tiles * k * INDEX_BYTES].contiguous().view(torch.int16).view(replicas, tiles, k).long()
        values = part[:, tiles * k * INDEX_BYTES:].contiguous().view(torch.float32).view(replicas, tiles, k)
        total = torch.zeros(tiles, height * width, device=part.device)
        senders = torch.zeros(tiles, height * width, device=part.device)
        ones = torch.ones(tiles, k, device=part.device)
        for replica in range(replicas):  # in replica order, each call's indices distinct: every replica sums alike
            total.scatter_add_(1, indices[replica], values[replica])
            senders.scatter_add_(1, indices[replica], ones)
        mean = total.div_(senders.clamp_(min=1))
        return from_tiles(transform(mean, height, width, inverse=True), shape, self.chunk_size).sign_()

    def state_dict(self):
        """This replica's deltas, in new tensors (no collective: their mean would take an all-reduce of fp32 deltas
        across replicas, the link this optimizer spares). Every resume loads each replica's own (`replica_state`);
        DCP writes one replica's copy of these. New tensors, because a load's template is this state dict: the live
        deltas, which the per-replica entries load into, must not also receive this copy."""
        saved = super().state_dict()
        # torch's state_dict() holds the live per-parameter dicts: copied before one of their entries is replaced.
        saved["state"] = {index: {name: value.detach().clone() if name == "delta" else value
                                  for name, value in state.items()} for index, state in saved["state"].items()}
        return saved

    def replica_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """The state that differs between replicas, live: each replica's own delta. OptimizersContainer saves it per
        replica, which is what every resume loads (a resume into another number of replicas continues each replica
        from one saved replica's delta)."""
        return {param: {"delta": state["delta"]} for param, state in self.state.items() if "delta" in state}


def _delta_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                 matrix_method: bool) -> float:
    return 4 * math.prod(local_shape)


def _step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
    """By reading (fp32): every shard's payload, in a list and concatenated, and the gather buffer of every replica's
    (R x the payload); tensor by tensor, the tiles, the DCT's two products, the sent coefficients and their inverse
    transform (about 20 bytes per value of the largest shard, extracting or decoding)."""
    options = config.flexdemo
    payload = sum(payload_bytes(tuple(round(size) for size in t.local_shape), options.chunk_size, options.topk)
                  for t in tensors)
    return (layout.replicas + 2) * payload + 20 * largest_shard(tensors)


@register_optimizer("FlexDeMo", state_bytes=_delta_bytes, step_bytes=_step_bytes, options=FlexDeMoOptions, refuses=(
    MethodRefusal("rotated", "FlexDeMo's replicas are FSDP2 groups: each is sharded with fully_shard, over one "
                  "rank too, and the replicas exchange their momentum instead of an all-reduce",
                  "use parallelism.data_parallel_shard_method = 'fsdp' with FlexDeMo"),
    MethodRefusal("one_replica", "FlexDeMo exchanges momentum components across replicas, and this layout has one",
                  "set parallelism.data_parallel_replicate_degree to 2 or more (HSDP, or DDP when "
                  "data_parallel_shard_degree = 1)"),))
def build_flexdemo(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    options = config.flexdemo
    return FlexDeMo(groups, lr=config.lr, weight_decay=config.weight_decay, chunk_size=options.chunk_size,
                    topk=options.topk, momentum_decay=options.momentum_decay,
                    replicate_group=context.replicate_group)
