"""Rotated tensor parallelism (RTP, torchtitan/distributed/rotated.py) in the planner: the bytes one rank of the ring
sends per step, the memory it holds beyond its own shards, and the time its rotations add to a step (the time terms
live in planner/cost.py, beside the step time that uses them: `rotation_time`).

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
from torchtitan.planner.cost import block_linear_shapes


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
