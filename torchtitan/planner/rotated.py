"""Rotated tensor parallelism (RTP, torchtitan/distributed/rotated.py) in the planner: the bytes one rank of the ring
sends per step.

A ring of N ranks (dp_shard x cp) rotates every tensor it splits, of r rows and c columns, in shards of s = ceil(r / N)
rows (the last ones padded): in each pass (a micro-batch's forward and backward) one rank sends (N - 1) shards of
every Linear and of the embedding in forward, in the compute dtype (p bytes), and again for every block whose forward
activation checkpointing runs again; in backward (N - 1) shards and as many gradient buffers (g bytes, the reduce
dtype) of every Linear, (N - 1) gradient buffers of the embedding. Once per step the replicated norm weights' gradients
are all-reduced: 2 (N - 1) / N of their bytes.
"""

import math
from dataclasses import dataclass

from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.planner.cost import block_linear_shapes, recomputed_blocks


def recomputed_rotations(ac: str, every: int = 2) -> float:
    """The share of blocks whose rotations run again in backward: those activation checkpointing recomputes whole,
    and under per-op AC every block (its policy caches matmul outputs, but the recomputed forward runs each rotated
    Linear again, rotations included)."""
    return 1.0 if ac == "op" else recomputed_blocks(ac, every)


@dataclass(frozen=True)
class RotatedBytes:
    forward: float
    """Weight shards rotated in forwards, recomputed ones included."""
    backward: float
    """Weight shards and gradient buffers rotated in backwards."""
    sync: float
    """The norms' gradient all-reduce."""

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.sync


def _shard_values(rows: int, columns: int, world: int) -> int:
    return math.ceil(rows / world) * columns


def sent_bytes(args: TransformerModelArgs, world: int, *, layers: float, embedding: bool, output: bool,
               passes: int, recomputed_layers: float, param_bytes: int, reduce_bytes: int) -> RotatedBytes:
    """What one rank of a ring of `world` sends per step for a model part of `layers` blocks (and the embedding, the
    final norm and output layer where it holds them): `passes` forward-backward passes (micro-batches), each running
    the forwards of `recomputed_layers` blocks again."""
    hops = world - 1
    block = sum(_shard_values(fan_out, fan_in, world) for fan_in, fan_out in block_linear_shapes(args).values())
    vocabulary = _shard_values(args.vocab_size, args.dim, world)
    forward = hops * param_bytes * (block * (layers + recomputed_layers) + vocabulary * (embedding + output))
    linears = block * layers + output * vocabulary
    backward = hops * (linears * (param_bytes + reduce_bytes) + embedding * vocabulary * reduce_bytes)
    norm_bytes = (2 * layers + output) * args.dim * reduce_bytes
    return RotatedBytes(forward=passes * forward, backward=passes * backward,
                        sync=2 * hops * norm_bytes // world if world > 1 else 0)
