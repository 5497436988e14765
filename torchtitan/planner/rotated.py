"""Rotated tensor parallelism (RTP, torchtitan/distributed/rotated.py) in the planner: the bytes one rank of the ring
sends per step, the memory it holds beyond its own shards, and the time its rotations add to a step.

A ring of N ranks (dp_shard x cp) rotates every tensor it splits, of r rows and c columns, in shards of s = ceil(r / N)
rows (the last ones padded).

Bytes sent. In each pass (a micro-batch's forward and backward) one rank sends (N - 1) shards of every Linear and of
the embedding in forward, in the compute dtype (p bytes), and again for every block whose forward activation
checkpointing runs again; in backward (N - 1) shards and as many gradient buffers (g bytes, the reduce dtype) of every
Linear, (N - 1) gradient buffers of the embedding. Once per step the replicated norm weights' gradients are
all-reduced: 2 (N - 1) / N of their bytes.

Memory (planner/memory.py adds these in place of FSDP's gathered blocks). The owned fp32 shards of the parameters,
their gradients and the optimizer state are FSDP's (the norms, which RTP keeps whole, are counted as FSDP shards them:
d x (2 L + 1) x 16 bytes fewer than RTP holds, 4 MiB at 8B). Beyond them, only while a Linear or the embedding runs:
in forward the shard in hand and the one arriving, 2 s c p; in a Linear's backward those two and the gradient buffer
in hand and arriving, 2 s c (p + g); in the embedding's backward the two buffers, one of which becomes its gradient.
Nothing is in flight at the end of forward and in the loss (where a step peaks unless a block's backward does); in a
block's backward, its widest Linear's. The vocabulary's shards (the output layer, the embedding) rotate next to the
logits' gradient or after every activation is freed, below those peaks. In a Linear's backward the input gradient
is summed over the N turns in fp32 before its one rounding to the compute dtype: with bf16 compute one more
T x in x 4 bytes beside it, at most w2's (in = the FFN width f). Activations are those of the rank's whole batch, as
under FSDP (eager ones when compiled: the rotations break each block's graph at every Linear).

Time. Each turn's transfer overlaps that turn's product on the shard in hand (on GPUs the transfers run on a stream of
their own): a tensor whose forward product takes C in all runs N products of C / N (each a thinner GEMM, timed by its
own shape) while N - 1 transfers of x = s c p / bandwidth (+ latency) run beside N - 1 of them: exposed
(N - 1) x max(0, x - C / N). Backward likewise with both of its products per turn and the shard and gradient buffer
in flight together (x = s c (p + g) / bandwidth); the embedding computes next to nothing while its shards and buffers
rotate: all of its transfer is exposed. Every rank sends to its neighbour at once, so a turn takes its slowest hop:
NVLink when the ring sits in one host, else one NIC. No prefetch across layers: FSDP hides a whole block's
all-gather behind the previous block, RTP only a shard's transfer behind the same shard's product, which is why RTP
loses where a shard's product is short against its transfer (few tokens per rank, slow links) and FSDP does not.
"""

import math
from dataclasses import dataclass

from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.planner.cost import (NCCL_BUS_FRACTION, NETWORK_HOP_LATENCY_S, NVLINK_HOP_LATENCY_S,
                                     OPTIMIZER_BYTES_PER_PARAM, RING_BASE_LATENCY_S, Layout, block_linear_shapes,
                                     recomputed_blocks)
from torchtitan.planner.hardware import GPU, gemm_seconds


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


def block_in_flight_bytes(args: TransformerModelArgs, world: int, param_bytes: int, reduce_bytes: int) -> float:
    """Bytes of the shards and gradient buffers in flight during a block's backward, at its widest Linear: the shard
    in hand and the one arriving, the gradient buffer in hand and the one arriving."""
    largest = max(_shard_values(fan_out, fan_in, world) for fan_in, fan_out in block_linear_shapes(args).values())
    return 2 * largest * (param_bytes + reduce_bytes)


def parameter_and_gradient_peak_bytes(args: TransformerModelArgs, world: int, param_bytes: int,
                                      reduce_bytes: int) -> float:
    """The peak of a rank's live parameter and gradient bytes (fp32 parameters and gradients, norms whole), the whole
    model on the ring: at the output layer's backward, the first, no gradient exists yet and its shards and gradient
    buffers are in flight, 2 s c (p + g) (on 2 ranks in fp32 with even shards one weight shard fewer: the one sent
    is the parameter itself); at the embedding's, the last, every other gradient exists and its gradient buffer
    arrives beside the one whose sum becomes its gradient, s c g more. The first rank's: the largest shards."""
    norms = (2 * args.n_layers + 1) * args.dim
    shapes = [(fan_out, fan_in) for fan_in, fan_out in block_linear_shapes(args).values()] * args.n_layers \
        + [(args.vocab_size, args.dim)] * 2
    owned = sum(_shard_values(rows, columns, world) for rows, columns in shapes) + norms
    vocabulary = _shard_values(args.vocab_size, args.dim, world)
    weight_copies = 1 if world == 2 and param_bytes == 4 and args.vocab_size % world == 0 else 2
    return max(4 * owned + vocabulary * (weight_copies * param_bytes + 2 * reduce_bytes),
               8 * owned + vocabulary * reduce_bytes)


def input_gradient_accumulator_bytes(args: TransformerModelArgs, tokens: float, param_bytes: int) -> float:
    """The fp32 sum of a Linear's input gradient over the turns, beside its rounding to a lower compute dtype: at
    w2, whose input is the FFN width."""
    return tokens * args.ffn_hidden_dim * 4 if param_bytes != 4 else 0.0


@dataclass(frozen=True)
class RotationTime:
    comm_s: float
    """Seconds of rotation transfers per step, and the norms' all-reduce."""
    exposed_s: float
    """Of these, what no product hides."""
    extra_compute_s: float
    """The products split into N thinner ones take this much longer than whole."""


def _p2p(gpu: GPU, world: int) -> tuple[float, float]:
    """(bytes/s, seconds of latency) of one shift around a ring of `world` neighbouring ranks: NVLink within a host,
    one NIC per rank across hosts (each rank sends one message to one neighbour)."""
    if world <= gpu.gpus_per_host:
        return gpu.nvlink_bytes_per_s * NCCL_BUS_FRACTION["nvlink"], RING_BASE_LATENCY_S + NVLINK_HOP_LATENCY_S
    return gpu.rdma_bytes_per_s * NCCL_BUS_FRACTION["network"], RING_BASE_LATENCY_S + NETWORK_HOP_LATENCY_S


def rotation_time(args: TransformerModelArgs, layout: Layout, seq_len: int, gpu: GPU,
                  efficiency: float) -> RotationTime:
    """The rotations of one step of a rank of `layout` (layout.rotated): see the module docstring."""
    world = layout.dp_shard * layout.cp
    bandwidth, latency = _p2p(gpu, world)
    p, g = 2, 4  # bf16 compute, fp32 reductions: the planner's layouts
    m = layout.microbatch * seq_len / layout.cp
    passes = layout.local_batch // layout.microbatch
    layers = args.n_layers / layout.pp
    recomputed = layers * recomputed_rotations(layout.ac, layout.ac_every)
    exposed = comm = extra = 0.0

    def linear(rows: int, columns: int, backwards: float, forwards: float) -> None:
        """A Linear of `rows` x `columns` running `forwards` forwards and `backwards` backwards per step."""
        nonlocal exposed, comm, extra
        s = math.ceil(rows / world)
        forward_turn = gemm_seconds(m, columns, s, gpu, efficiency)
        backward_turn = gemm_seconds(m, s, columns, gpu, efficiency) + gemm_seconds(s, m, columns, gpu, efficiency)
        forward_x = s * columns * p / bandwidth + latency
        backward_x = s * columns * (p + g) / bandwidth + latency
        comm += (world - 1) * (forwards * forward_x + backwards * backward_x)
        exposed += (world - 1) * (forwards * max(0.0, forward_x - forward_turn)
                                  + backwards * max(0.0, backward_x - backward_turn))
        whole_forward = gemm_seconds(m, columns, rows, gpu, efficiency)
        whole_backward = gemm_seconds(m, rows, columns, gpu, efficiency) + gemm_seconds(rows, m, columns, gpu,
                                                                                       efficiency)
        extra += (forwards * (world * forward_turn - whole_forward)
                  + backwards * (world * backward_turn - whole_backward))

    for fan_in, fan_out in block_linear_shapes(args).values():
        linear(fan_out, fan_in, passes * layers, passes * (layers + recomputed))
    # The slowest pipeline rank sets the pace: the last stage's output layer (linear_gemms counts it on every rank);
    # the embedding's rotations where one rank holds both ends.
    linear(args.vocab_size, args.dim, passes, passes)
    if layout.pp == 1:
        s = math.ceil(args.vocab_size / world)
        embedding_x = (world - 1) * (s * args.dim * (p + g) / bandwidth + 2 * latency) * passes
        comm += embedding_x
        exposed += embedding_x
    norms = (2 * layers + 1) * args.dim * g
    sync = 2 * (world - 1) / world * norms / bandwidth + latency
    return RotationTime(comm_s=comm + sync, exposed_s=exposed + sync, extra_compute_s=max(0.0, extra))


def parameter_traffic_bytes(stage_params: float, world: int, passes: int, param_bytes: int = 2) -> float:
    """HBM bytes per step of a rank's work on its parameters: the optimizer over its shard, and per pass the cast of
    the shard into the rotating copy in forward and again in backward (4 read, p written; fp32 compute uses the
    shard itself), its gradient cast from the buffer (4 + 4) and added to the accumulated one (4 + 4, 4 written)."""
    shard_params = stage_params / world
    casts = 2 * (4 + param_bytes) if param_bytes != 4 else 0
    return OPTIMIZER_BYTES_PER_PARAM * shard_params + passes * shard_params * (casts + 8 + 12)
