"""The performance model: predicted seconds per training step of one layout, and so tokens/s per GPU.

Per GPU and step (all stages of one pipeline rank together; the slowest pipeline rank sets the pace):

    step = (compute + exposed communication) x pipeline bubble + communication after the pipeline drains
           + parameter traffic (the optimizer step, precision casts) + the pipeline's sends on its critical path

- compute = matrix products by shape + attention + memory-bound time.
  Each linear layer's forward and two backward products per micro-batch, at their shapes (linear_gemms; full
  activation checkpointing runs each block's forward again up to the last tensor backward reads, all but w2's
  product), each timed by gemm_seconds (planner/hardware.py): whole output tiles at
  the fitted efficiency, no faster than HBM reads its inputs, plus its output's store, so a thin TP shard runs
  slower per FLOP than the whole layer. Attention runs at its own speed, not the
  GEMM efficiency (planner/attention.py, attention_step): the pairs its mask leaves (causal s^2/2; block-causal
  the documents' sum of len^2/2; under CP the rank's queries against the gathered keys, or the ring's diagonal and
  off-diagonal blocks), at FlashAttention-2's published speed by length and head dimension (or the GPU's
  calibrated one; FlexAttention at its published fraction of it), plus ring attention's fp32 merges.
  Float8 runs the blocks' linear layers at the GPU's float8 peak, the rest at its bf16 peak; both at the same
  achievable fraction EFFICIENCY (fitted on H100 rows; on another GPU times the ratio one benchmark measured on
  both, GPU.gemm_level_vs_h100, so an efficiency given or refitted is in the H100's terms). The memory-bound work
  (norms, RoPE, SwiGLU's product, residual adds, casts, float8's scaling) moves MEMORY_BOUND_BYTES bytes per element
  of the hidden state per block (fitted, eager); compiled blocks fuse it into COMPILED_FRACTION of that (fitted).
  Float8 adds its dynamic casts, counted from what
  torchao reads and writes (float8_cast_bytes_per_token: no constant); under TP some of them work on whole-sequence
  tensors, which is most of what makes the 70B and 405B layouts slower per token than the 8B ones. It runs at the
  GPU's HBM bandwidth, as do the copies torch makes to gather and scatter sequence-parallel TP's buffers along the
  sequence (sequence_reorder_bytes).
- communication, each collective's bytes over the link it crosses (NVLink within a host of 8, the RDMA network
  between hosts; mesh dimensions are laid out pp, dp_replicate, dp_shard, cp, tp, the last varying fastest, so a
  dimension stays within a host when its stride x size <= 8). A ring moves (n - 1) / n of the buffer over its
  slowest link at the bus bandwidth NCCL reaches there (NCCL_BUS_FRACTION of the datasheet's, published; between
  hosts one NIC per rank the group has in a host, up to NVLink's: _link_bandwidth), and each call pays NCCL's ring
  latency (ring_latency_seconds: per hop, NVLink or network).
- overlap is bounded by what there is to overlap with: each kind hides behind compute only (async TP behind the
  forward matmuls), and the kinds that share a link hide behind the step's compute once, so a layout whose
  communication exceeds its compute is never predicted compute-bound.
  - FSDP's all-gathers and reduce-scatters are prefetched and overlap the blocks' compute, except the first
    block's all-gather and the last reduce-scatter: exposed are that edge and what exceeds the compute. HSDP's
    replica all-reduce of the gradient shards too. With gradient accumulation, all of it in every micro-step.
    Under PP the parameters stay gathered from the first micro-batch, whose forward hides the all-gathers, and
    each stage's gradients are reduced after its last micro-batch's backward (torch.distributed.pipelining's
    perform_reduce_grad), which then makes the compute stream wait for the reduction (FSDP's finalize_backward):
    exposed, whether it comes after the drain or, for a rank's later stage, between its earlier stage's backwards.
  - Rotated tensor parallelism (layout.rotated) replaces FSDP's collectives by its rotations, each shard's transfer
    hidden behind the product on the shard before it, and splits each product into N thinner ones
    (planner/rotated.py).
  - Sequence-parallel TP's all-gathers and reduce-scatters sit between the matmuls that need them: exposed, unless
    async TP decomposes them into chunks that overlap the matmuls (then exposed only beyond the matmul time).
  - Context parallelism by default (parallelism.context_parallel_method = allgather_kv), and always under
    block-causal attention, all-gathers the grouped keys and values (n_kv_heads, not expanded) before the attention
    call (exposed) and reduce-scatters their gradients; attention then runs FlexAttention over the rank's queries
    and all keys. torch's ring attention (context_parallel_method = ring) all-gathers the keys and values expanded to
    the query heads, n_heads / n_kv_heads times the bytes, once per attention call ("allgather" rotation) and waits
    for them after the local chunk; backward also passes their gradients around the ring: exposed beyond 1/c of
    attention's time. The "alltoall" rotation passes each chunk on c - 1 times while the current block computes:
    exposed beyond (c - 1)/c of it. Head-tail balancing makes causal work even; block-causal's chunk assignment
    balances the counted pairs. The calls and bytes of TP and CP are those the dry run counts
    (sequence_collectives).
  - Pipeline sends overlap the other micro-batches' compute in the steady state; those of the first micro-batch
    down the pipeline and of the last one's gradients back up are on the critical path (pipeline_p2p_seconds).
- parameter traffic, memory-bound at the GPU's HBM bandwidth, counted, not fitted (parameter_traffic_bytes): once
  per step, fused AdamW and gradient-norm clipping over the rank's parameter shard; per forward-backward pass, the
  mixed-precision casts of the parameters and gradients (FSDP's copies into and out of its collectives' buffers,
  or without FSDP autocast's), and Float8's work on the weights (float8_weight_bytes): with FSDP's float8
  all-gather the eager cast of each fp32 shard, its absolute maximum once per step and a transposed float8 copy of
  each gathered weight in every backward; otherwise a cast of the weight (gathered bf16, or the fp32 parameter) in
  every forward and again in every backward (compiled: with the forward's maximum, into the layout its product
  wants). It does not grow with the tokens of a pass, so it weighs most at small
  batches on few GPUs (one GPU, one sequence of the 8B's shape: about a seventh of the step) and is noise at scale.
- pipeline bubble: each rank runs torch's own action list of the schedule (planner/pipeline_schedule.py), a pass
  starting when what it needs is done; the step's length over a rank's work. It reproduces
  (micro-batches x v + pp - 1) / (micro-batches x v) for 1F1B, GPipe, Interleaved1F1B and LoopedBFS (v stages per
  rank) and gives the zero-bubble schedules their smaller bubble, their weight-gradient passes filling it.

The three fitted constants (GEMM efficiency: the level of a large, well-shaped product; memory-bound bytes, compiled
fraction) are fitted on the three 8B rows
on 8 GPUs of the published table (eager, compiled, compiled + float8) and held fixed for every other row and layout
(docs/scaling.md); attention's speed is published, not fitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.planner import pipeline_schedule
from torchtitan.planner.attention import attention_calls, attention_seconds
from torchtitan.planner.hardware import GPU, gemm_seconds

# Fitted on the 8B, 8-GPU rows of the published table (scripts/plan.py --validate refits and prints them).
EFFICIENCY = 0.61
MEMORY_BOUND_BYTES = 1040.0
COMPILED_FRACTION = 0.6
MODEL_CONSTANTS = {"efficiency": EFFICIENCY, "memory_bound_bytes": MEMORY_BOUND_BYTES,
                   "compiled_fraction": COMPILED_FRACTION}

HOST_SIZE = 8

# Latency of one ring collective (NCCL's own tuning model for the ring algorithm and its Simple protocol, which it
# uses for large buffers): a base cost, plus one per step of the ring, an NVLink hop within a host and a network hop
# between hosts. Microseconds; from NCCL's published tables, not fitted.
RING_BASE_LATENCY_S = 8.4e-6
NVLINK_HOP_LATENCY_S = 3.4e-6
NETWORK_HOP_LATENCY_S = 14.0e-6

# The bus bandwidth NCCL reaches on each link, as a fraction of the datasheet's (per direction), for large buffers;
# published, not fitted. NVLink 4 (H100 SXM): about 783 of 900 GB/s both directions together
# (github.com/NVIDIA/nccl/issues/1264, nccl-tests on an 8 x H100 SXM host without NVLink SHARP). The network: 46-48
# GB/s per 400 Gb/s NIC, NVIDIA's expected range for NDR (github.com/NVIDIA/nccl-tests/issues/290), its low end.
NCCL_BUS_FRACTION = {"nvlink": 783 / 900, "network": 46 / 50}

# Per fp32 parameter of the shard and step: fused AdamW reads the parameter, its gradient and both moments and
# writes back the parameter and the moments (7 x 4 bytes); clipping reads every gradient for the norm, then reads
# and writes it to scale it (3 x 4 bytes).
OPTIMIZER_BYTES_PER_PARAM = 40


@dataclass(frozen=True)
class Layout:
    """One way to run a model: degrees, pipeline schedule, batch, and the techniques on or off."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    schedule: str | None
    stages_per_rank: int
    local_batch: int
    """Sequences per data-parallel rank and optimizer step."""
    microbatch: int
    """Sequences per forward: a pipeline micro-batch, or without PP the gradient-accumulation micro-step."""
    ac: str
    """none, full, op (selective per-op) or layer (selective per block: every ac_every-th block recomputed whole,
    activation_checkpoint.selective_ac_option = ac_every; TorchTitan's default of 2024 was every 2nd)."""
    float8: bool
    compile: bool
    async_tp: bool
    row_split_embedding: bool = False
    """Split the embedding by vocabulary row under TP, as TorchTitan did for the published figures (this framework
    splits it by column): its gradient is then whole on every rank (planner/memory.py)."""
    document_length: float = 0.0
    """Block-causal attention over packed documents of this E[len^2] / E[len] tokens (for documents of one
    length, that length); 0: causal over the whole sequence (model.attention_mask)."""
    cp_method: str = "allgather_kv"
    """How causal CP runs (parallelism.context_parallel_method): allgather_kv all-gathers the grouped keys and values,
    as block-causal always does; ring runs torch's ring attention over keys and values expanded to the query heads."""
    cp_rotate: str = "allgather"
    """How the ring exchanges keys and values (parallelism.context_parallel_rotate_method)."""
    ac_every: int = 2
    """With ac = layer: every how many blocks one is checkpointed."""
    float8_all_gather: bool = True
    """Under FSDP, all-gather Float8 weights in float8 with precomputed scales
    (quantize.linear.float8.enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp; tensorwise
    only), as the planner's layouts do; off, FSDP gathers bf16. TorchTitan's published 8B and 70B runs had them off
    (its configs' default), its 405B runs on."""
    float8_recipe: str = "tensorwise"
    """torchao's Float8 recipe (quantize.linear.float8.recipe_name). The model counts tensorwise scaling's casts
    and kernels; another recipe is predicted as tensorwise and marked outside the validated envelope."""
    compiled_loss: bool = True
    """With compile, compile the loss too (fused, it keeps no fp32 copy of the logits). TorchTitan compiled only the
    blocks when it measured the published figures: its loss stayed eager ("compiling loss function causes CUDA
    errors, turning off for now" in its train.py of late 2024)."""
    rotated: bool = False
    """The shard ranks rotate the weights (rotated tensor parallelism, parallelism.data_parallel_shard_method =
    rotated) instead of FSDP's gathers: planner/rotated.py."""
    kept_pipeline_outputs: bool = False
    """Under PP, the last stage keeps every micro-batch's output until the step returns them merged
    (torch.distributed.pipelining's default, `return_outputs=True`), as TorchTitan's did when it measured the
    published figures: its train.py called `step()` without asking otherwise and its model returned fp32 logits
    (`.float()`). This framework's trainer passes `return_outputs=False`: nothing is kept."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def gathers_kv(self) -> bool:
        """Whether CP all-gathers the grouped keys and values (block-causal, or causal with cp_method allgather_kv)
        rather than running the ring."""
        return self.cp > 1 and (bool(self.document_length) or self.cp_method == "allgather_kv")

    def attention_document_length(self, seq_len: int) -> float:
        """The document length attention's mask works over (planner/attention.py): the documents' under
        block-causal; one causal document of seq_len where CP gathers the keys (its kernel, FlexAttention, takes the
        mask over the rank's queries and all keys); 0 for causal attention's own kernel."""
        return self.document_length or (float(seq_len) if self.gathers_kv else 0.0)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def tokens_per_gpu(self, seq_len: int) -> float:
        """Tokens one GPU's share of a step covers: its data-parallel rank's batch over TP x CP x PP."""
        return self.local_batch * seq_len / (self.tp * self.cp * self.pp)

    @property
    def recomputed_blocks(self) -> float:
        """The share of blocks whose forward runs again whole in backward."""
        return recomputed_blocks(self.ac, self.ac_every)

    @property
    def ac_label(self) -> str:
        """The activation checkpointing, as tables name it."""
        return {"none": "no AC", "op": "AC op", "full": "AC full", "layer": f"AC every {self.ac_every}"}[self.ac]


def recomputed_blocks(ac: str, every: int = 2) -> float:
    """The share of blocks that activation checkpointing `ac` recomputes whole: all under full AC, one in `every`
    under per-block selective AC (layer), none otherwise (per-op AC recomputes some matmuls of every block)."""
    return {"full": 1.0, "layer": 1 / every}.get(ac, 0.0)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    exposed_comm_s: float
    bubble: float
    fsdp_comm_s: float
    tp_comm_s: float
    cp_comm_s: float
    drained_comm_s: float = 0.0
    """Communication after the pipeline has drained (PP's gradient reduction): not stretched by the bubble."""
    parameter_s: float = 0.0
    """Parameter traffic: the optimizer step and clipping, and the precision casts of parameters and gradients."""
    hidden_comm_s: float = 0.0
    """Communication the model hides behind compute (the rest of fsdp/tp/cp_comm_s is exposed or drained)."""
    pipeline_p2p_s: float = 0.0
    """The pipeline's sends on its critical path: the first micro-batch's activations down every stage boundary
    and the last one's gradients back up (planner/cost.py, pipeline_p2p_seconds)."""

    @property
    def seconds(self) -> float:
        return ((self.compute_s + self.exposed_comm_s) * self.bubble + self.drained_comm_s + self.parameter_s
                + self.pipeline_p2p_s)

    @property
    def seconds_alone(self) -> float:
        """The step of one rank alone: no communication and no bubble, what a dry run on real tensors measures
        (`--comm.no_fake_tensors`)."""
        return self.compute_s + self.parameter_s

    @property
    def overlap_ratio(self) -> float:
        """Seconds of communication hidden per second of compute: how far the prediction leans on overlap."""
        return self.hidden_comm_s / self.compute_s

    def seconds_hiding_at_most(self, ratio: float) -> float:
        """The step if at most `ratio` x compute of communication hides (what validated layouts hid), the rest
        exposed."""
        over = max(0.0, self.hidden_comm_s - ratio * self.compute_s)
        return ((self.compute_s + self.exposed_comm_s + over) * self.bubble + self.drained_comm_s + self.parameter_s
                + self.pipeline_p2p_s)

    @property
    def seconds_without_overlap(self) -> float:
        """The step if no communication overlapped compute: the bound for a layout whose overlap fails (a network
        slower than its datasheet, NCCL and compute kernels contending for the GPU)."""
        communication = self.fsdp_comm_s + self.tp_comm_s + self.cp_comm_s
        return ((self.compute_s + communication) * self.bubble + self.drained_comm_s + self.parameter_s
                + self.pipeline_p2p_s)


def _link(gpu: GPU, stride: int, size: int) -> str:
    """The link a ring over `size` ranks `stride` apart crosses: NVLink when the whole group sits in one host."""
    return "nvlink" if stride * size <= gpu.gpus_per_host else "network"


def _link_bandwidth(gpu: GPU, stride: int, size: int) -> float:
    """Bytes/s a ring over `size` ranks `stride` apart gets: NCCL's bus bandwidth on its link
    (NCCL_BUS_FRACTION of the datasheet's). Between hosts every rank of the group in a host brings its own NIC
    (one per GPU): NCCL spreads its rings' channels over them, so a group with g ranks in each host crosses the
    network g NICs wide, up to what NVLink carries within the host (NCCL's maintainers: about 24 GB/s of bus
    bandwidth per 200 Gb/s NIC, 96 GB/s the target of a node with four, "more NICs ... more bandwidth, up to ...
    the NVLink intra-node bandwidth": github.com/NVIDIA/nccl-tests/issues/119, github.com/NVIDIA/nccl/issues/412).
    A group with one rank per host (FSDP or HSDP across TP groups, a pipeline's hop) has one NIC."""
    nvlink = gpu.nvlink_bytes_per_s * NCCL_BUS_FRACTION["nvlink"]
    if _link(gpu, stride, size) == "nvlink":
        return nvlink
    ranks_per_host = max(1, min(size, gpu.gpus_per_host // stride))
    return min(nvlink, ranks_per_host * gpu.rdma_bytes_per_s * NCCL_BUS_FRACTION["network"])


def ring_latency_seconds(gpu: GPU, stride: int, size: int) -> float:
    """Latency of one collective over a ring of `size` ranks `stride` apart: its hops within hosts over NVLink,
    those between hosts over the network."""
    if size <= 1:
        return 0.0
    hosts = min(size, max(1, stride * size // gpu.gpus_per_host))
    return RING_BASE_LATENCY_S + (size - hosts) * NVLINK_HOP_LATENCY_S + (hosts - 1) * NETWORK_HOP_LATENCY_S


def _ring_seconds(buffer_bytes: float, size: int, bandwidth: float, calls: float, latency_s: float) -> float:
    """Time of `calls` collectives that move `buffer_bytes` in all over a ring of `size` ranks."""
    return 0.0 if size <= 1 else buffer_bytes * (size - 1) / size / bandwidth + calls * latency_s


# The linear layers whose products per-op AC runs again in backward (its policy saves the others' outputs).
OP_RECOMPUTED_LINEARS = ("wk", "wo", "w3")
# A block's forward run again in backward (full AC; per-block AC in the blocks it recomputes) stops once the last
# tensor backward reads exists (torch.utils.checkpoint's non-reentrant early stop, on by default; compiled, the
# partitioner recomputes only what backward reads): the block's last linear layer, whose output backward does not
# read, does not run again, nor its Float8 casts (tests/unit/test_planner.py counts the products, eager and compiled).
NOT_RECOMPUTED_LINEARS = ("w2",)


def block_linear_shapes(args: TransformerModelArgs, t: int = 1) -> dict[str, tuple[int, int]]:
    """Each linear layer of a block, (in, out) of its shard on one of `t` TP ranks: column-parallel layers split
    out, row-parallel ones (wo, w2) in."""
    d, q, kv, f = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    return {"wq": (d, q // t), "wk": (d, kv // t), "wv": (d, kv // t), "wo": (q // t, d), "w1": (d, f // t),
            "w3": (d, f // t), "w2": (f // t, d)}


def block_linear_params(args: TransformerModelArgs) -> int:
    return sum(fan_in * fan_out for fan_in, fan_out in block_linear_shapes(args).values())


def parameter_traffic_bytes(stage_params: float, shard: int, gather_bytes: int, gathers: int, passes: int) -> float:
    """HBM bytes per step of a rank's work on its parameters rather than its tokens: the optimizer over the shard
    (OPTIMIZER_BYTES_PER_PARAM), and per forward-backward pass the precision casts. With FSDP (shard > 1) each
    all-gather casts the fp32 shard into the gather buffer (4 bytes read, `gather_bytes` written) and copies the
    gathered parameters out of it (read and written), each reduction casts the bf16 gradients into the fp32
    reduce-scatter buffer (2 + 4) and adds the reduced shard to the gradient (read 4 + 4, write 4). Without FSDP,
    autocast casts each weight for the forward (4 + 2) and each gradient back to fp32 (2 + 4). Float8's own work on
    the weights is float8_weight_bytes."""
    shard_params = stage_params / shard
    if shard > 1:
        per_pass = (gathers * (shard_params * (4 + gather_bytes) + stage_params * 2 * gather_bytes)
                    + stage_params * 6 + shard_params * 12)
    else:
        per_pass = stage_params * 12
    return OPTIMIZER_BYTES_PER_PARAM * shard_params + passes * per_pass


def float8_gathered(layout: Layout) -> bool:
    """Whether FSDP all-gathers the weights in float8 (tensorwise scaling only)."""
    return layout.float8 and layout.float8_all_gather and layout.float8_recipe == "tensorwise"


# torchao's cast of an fp32 tensor to float8 outside compiled code, per element: the scaled copy and its clamp to
# the float8 range, each read and written in fp32 (4 + 4, 4 + 4), then the cast (4 read, 1 written).
EAGER_FLOAT8_CAST_BYTES = 21
# Its fused form, what FSDP's all-gather is charged in parameter_traffic_bytes: 4 read, 1 written.
FUSED_FLOAT8_CAST_BYTES = 5


def float8_weight_bytes(weights: float, rerun_weights: float, recast_weights: float, shard: int, gathered: bool,
                        compiled: bool, gathers: int, gather_passes: int, microbatches: int) -> float:
    """HBM bytes per step of torchao's Float8 work on the weights of a rank's converted linear layers (tensorwise
    dynamic scaling). `weights`: the rank's elements of them (its TP shard of every block's linear layers);
    `rerun_weights`: those whose forward full (or per-block) AC runs again (all but w2's), per micro-batch; `recast_weights`:
    those whose product per-op AC runs again, with the absolute maximum its policy saved (aten.max). Per element:

    - With FSDP's float8 all-gather and precomputed scales (`gathered`; the planner's layouts set both): after the
      optimizer step one fused pass reads the fp32 shard for its absolute maximum (torch._foreach_norm, 4 bytes,
      once per step); each all-gather casts the fp32 shard in FSDP's hook, eager: EAGER_FLOAT8_CAST_BYTES, of which
      parameter_traffic_bytes charges FUSED_FLOAT8_CAST_BYTES. The gathered weight is float8 and row-major
      (out x in): the forward's product takes its transpose, column-major as _scaled_mm wants its second operand,
      but the input gradient's product takes the weight itself, copied transposed (1 read, 1 written) in every
      backward: per micro-batch, under PP too, where the parameters stay gathered. A recomputed forward finds the
      weight in float8 and casts nothing.
    - Otherwise each forward (and forward run again) casts the weight it finds, the fp32 parameter without FSDP
      (source 4 bytes) or the gathered bf16 weight with FSDP's bf16 all-gather (2): its absolute maximum (a
      reduction, one read) and the cast (one read, 1 byte written). The backward's input-gradient product needs
      the weight cast again, column-major. Eager, torchao casts it again in full and copies the cast transposed
      (2). Compiled, torch 2.13's partitioner keeps the forward's absolute maximum (it does not recompute
      reductions) and recomputes the cast in the layout the product wants: one read and 1 byte written, nothing
      else. torch 2.14's computes the maximum again in backward, one read more per weight, which is not counted:
      the fitted constants and the published runs this model is checked against predate it, and the extra read is
      small beside the activations' traffic. The partitioner's graphs of a compiled Float8Linear:
      tests/unit/test_planner.py. A product per-op AC runs again
      casts with the saved maximum: one read, 1 byte written. Without FSDP autocast makes no bf16 copy of these
      weights, so parameter_traffic_bytes' forward cast (4 + 2) is taken back."""
    if shard > 1 and gathered:
        shard_bytes = 4 + gathers * gather_passes * (EAGER_FLOAT8_CAST_BYTES - FUSED_FLOAT8_CAST_BYTES)
        return weights / shard * shard_bytes + microbatches * weights * 2
    source = 2 if shard > 1 else 4
    forward = 2 * source + 1
    backward = source + 1 if compiled else forward + 2
    autocast_copy = 0 if shard > 1 else 4 + 2
    return microbatches * (weights * (forward + backward - autocast_copy) + rerun_weights * forward
                           + recast_weights * (source + 1))


def recomputed_tp_gathers(layout: Layout) -> float:
    """Sequence-parallel all-gathers per block that activation checkpointing runs again in backward: the two of a
    recomputed forward (full AC; per-block AC in the blocks it recomputes), or the two whose outputs per-op AC does
    not save."""
    return 2 * layout.recomputed_blocks + (2 if layout.ac == "op" else 0)


def sequence_collectives(args: TransformerModelArgs, layout: Layout,
                         seq_len: int) -> dict[tuple[str, str], tuple[int, float]]:
    """The collectives of tensor and context parallelism in one step of a rank, as the dry run counts them:
    (kind, mesh dimension) -> (calls, bytes of the gathered or unreduced buffers); tests/unit/test_planner.py holds
    them against dry runs.

    Sequence-parallel TP gathers the hidden state before attention and before the FFN and reduce-scatters after
    each: per block 2 + 2 forward, and backward the reverse of each (2 reduce-scatters, 2 all-gathers); full AC's
    recomputed forward (per-block AC's, in the blocks it recomputes) gathers twice and reduce-scatters once (it
    stops at the last tensor backward needs); per-op AC saves the reduce-scatters' outputs but not the gathered
    inputs, which backward needs for the weight gradients, so it gathers them again (twice per block; torch's
    partitioner recomputes a collective the policy marks for recomputation, compiled or not). The output layer's
    input is gathered once more, and its gradient reduce-scattered, on the last stage. Context parallelism runs
    torch's ring attention (cp_method ring): each attention call (forward, recomputed forward, backward) all-gathers
    the keys and values, which the GPU attention path has expanded to the query heads; backward passes the keys' and
    values' gradients, in fp32, to the next rank c times (all-to-all). With the "alltoall" rotation each call instead
    passes the keys and values on c - 1 times (all-to-all, the buffer of one rank's chunk). Where CP gathers the keys
    (cp_method allgather_kv, and block-causal; context_parallel.py) each forward (and recomputed forward; per-op AC
    saves attention's output, not its gathered inputs, and gathers them again) all-gathers the grouped keys and values
    (kv heads, not expanded) together in one call per layer, and backward reduce-scatters their gradients; each
    micro-batch's forward first gathers the tokens' positions (int64; and the document ids, block-causal) once for
    all layers.
    """
    t, c = layout.tp, layout.cp
    layers = args.n_layers / layout.pp
    passes = layout.local_batch // layout.microbatch
    recompute = layout.recomputed_blocks
    collectives: dict[tuple[str, str], tuple[int, float]] = {}
    if t > 1:
        hidden_bytes = layout.microbatch * seq_len / c * args.dim * 2
        for kind, per_block in (("all_gather", 4 + recomputed_tp_gathers(layout)), ("reduce_scatter", 4 + recompute)):
            calls = (per_block * layers + 1) * passes
            collectives[(kind, "tp")] = (round(calls), calls * hidden_bytes)
    if layout.gathers_kv:
        gathered = layout.microbatch * seq_len * 2 * args.kv_heads / t * args.head_dim * 2
        gathers = (1 + recompute + (layout.ac == "op")) * layers * passes
        positions = layout.microbatch * seq_len * 8 * (2 if layout.document_length else 1)
        collectives[("all_gather", "cp")] = (round(gathers + passes), gathers * gathered + passes * positions)
        collectives[("reduce_scatter", "cp")] = (round(layers * passes), layers * passes * gathered)
    elif c > 1:
        kv_bytes = layout.microbatch * seq_len / c * 2 * args.n_heads / t * args.head_dim * 2
        gathers = (2 + recompute) * layers * passes
        exchanges = c * layers * passes
        if layout.cp_rotate == "alltoall":
            rotations = gathers * (c - 1)
            collectives[("all_to_all", "cp")] = (round(rotations + exchanges),
                                                 rotations * kv_bytes + exchanges * 2 * kv_bytes)
        else:
            collectives[("all_gather", "cp")] = (round(gathers), gathers * c * kv_bytes)
            collectives[("all_to_all", "cp")] = (round(exchanges), exchanges * 2 * kv_bytes)
    return collectives


def sequence_reorder_bytes(layout: Layout, sequence: dict[tuple[str, str], tuple[int, float]]) -> float:
    """HBM bytes per step of the copies torch makes around sequence-parallel TP's collectives (read and written
    once each). NCCL gathers and scatters along the first dimension, the batch; the sequence is the second. So each
    reduce-scatter first copies its input into rank order (the functional collectives' chunk-and-cat), and each
    all-gather copies its output into sequence order, except for micro-batches of one sequence, whose gathered
    buffer torch returns as a view (`_maybe_view_chunk_cat`; the torch of the published runs copied those too).
    Compiled alike, inductor emitting a copy kernel next to the linear layer that reads or writes the buffer,
    except that compiled Float8's cast of a gathered input reads it once for both and writes the reordered copy
    beside the float8 one: the write alone (inductor's code for each, on this CPU). Async TP's fused
    collective-matmul kernels gather and scatter in sequence order themselves: none. `sequence`: the step's
    collectives (sequence_collectives)."""
    if layout.tp == 1 or layout.async_tp:
        return 0.0
    gather_copy = 1 if layout.compile and layout.float8 else 2
    gathered = sequence[("all_gather", "tp")][1] if layout.microbatch > 1 else 0.0
    return gather_copy * gathered + 2 * sequence[("reduce_scatter", "tp")][1]


# torch's ring attention merges each block's output into the running one by log-sum-exp (_SDPAMerger), in fp32:
# per element of the rank's output and merge step it reads the running output and the block's (cast to fp32) and
# writes the rescaled sum: the block's cast to fp32 (2 + 4 bytes), the difference (4 + 4 + 4), its product with the
# weight (4 + 4 + 4) and the update (4 + 4 + 4), 42 bytes counted; measured, one step over 32k x 32 x 128 elements
# took 1.94 ms on an H100 SXM (torch 2.11): 48 bytes per element at the datasheet's HBM bandwidth, the figure used.
# Backward accumulates the query gradient and the rotating key and value gradients in fp32: each read as fp32 and
# bf16 and written back (10 bytes) per step.
MERGE_BYTES_PER_ELEMENT = 48
GRADIENT_ACCUMULATION_BYTES_PER_ELEMENT = 10


@dataclass(frozen=True)
class AttentionTime:
    """Seconds per step and GPU of attention's kernels (planner/attention.py) and of ring attention's merges."""

    forward_s: float
    """One forward of every layer's attention over the rank's tokens."""
    backward_s: float
    merge_s: float
    recompute: float
    """The share of blocks whose forward runs twice (Layout.recomputed_blocks)."""

    @property
    def seconds(self) -> float:
        return self.forward_s * (1 + self.recompute) + self.backward_s + self.merge_s


def pipeline_p2p_seconds(args: TransformerModelArgs, layout: Layout, seq_len: int, gpu: GPU) -> float:
    """The sends on the pipeline's critical path: the first micro-batch's hidden states cross every stage boundary
    before the last stage can start (v x pp - 1 hops with v stages per rank, one fewer at a V's turn), and the last
    micro-batch's gradients cross them back before the first stage's backward ends: two sends per boundary of one
    micro-batch's hidden states (its sequence-parallel shard under TP, bf16), each one hop between ranks world / pp
    apart. The sends of the steady state overlap the other micro-batches' compute."""
    if layout.pp == 1:
        return 0.0
    stride = layout.world_size // layout.pp
    hop_bytes = layout.microbatch * seq_len / (layout.cp * layout.tp) * args.dim * 2
    hops = 2 * pipeline_schedule.boundaries_between_ranks(layout.schedule, layout.pp, layout.stages_per_rank)
    return hops * (hop_bytes / _link_bandwidth(gpu, stride, 2) + ring_latency_seconds(gpu, stride, 2))


def attention_step(args: TransformerModelArgs, layout: Layout, seq_len: int, gpu: GPU) -> AttentionTime:
    """Attention's time in one step of a GPU of `layout`: the kernel calls of each layer and sequence
    (planner/attention.py: pairs by mask and CP split, speed by length and head dim), heads split over TP; under the
    ring the c - 1 merges of each forward and the fp32 gradient accumulation of each backward step, at HBM
    bandwidth; where CP gathers the keys, FlexAttention over them (one causal document of the whole sequence). Full AC runs the forward twice (per-block AC in the blocks it recomputes); per-op AC saves SDPA's
    output and does not."""
    t, c = layout.tp, layout.cp
    heads = args.n_heads / t
    sequences = layout.local_batch * args.n_layers / layout.pp
    document_length = layout.attention_document_length(seq_len)
    calls = attention_calls(seq_len, c, document_length)
    forward, backward = attention_seconds(calls, 4 * args.head_dim * heads, gpu.attention_rates(args.head_dim),
                                          document_length)
    merge_bytes = 0.0
    if c > 1 and not layout.gathers_kv:
        elements = seq_len / c * heads * args.head_dim
        merge_bytes = (c - 1) * elements * (MERGE_BYTES_PER_ELEMENT * (1 + layout.recomputed_blocks)
                                            + 3 * GRADIENT_ACCUMULATION_BYTES_PER_ELEMENT)
    return AttentionTime(forward_s=forward * sequences, backward_s=backward * sequences,
                         merge_s=merge_bytes * sequences / gpu.hbm_bytes_per_s, recompute=layout.recomputed_blocks)


def float8_cast_bytes_per_token(args: TransformerModelArgs, t: int, ac: str, ac_every: int = 2) -> float:
    """HBM bytes per token and block of Float8's dynamic tensorwise casts (torchao), on one TP rank.

    Every tensor a float8 matmul takes is read twice (its absolute maximum, then the scaled cast) and written once
    in float8: 5 bytes per element. Forward: the two normalised block inputs (each shared by its projections), wo's
    and w2's inputs; full AC casts them again in the recomputed forward but w2's, which it does not run again
    (per-block AC in the blocks it recomputes), per-op AC the inputs of the matmuls it recomputes (wk, wo, w3). Backward: the gradients of the seven outputs.
    The weight-gradient matmuls take the inputs and the output gradients transposed: one more float8 copy of each
    (2 bytes). Under TP the block inputs and the output gradients of wo and w2 are whole-sequence tensors (gathered
    from the sequence-parallel regions): they cost d per token on every rank, where the hidden state's other work
    costs d / t."""
    d, q, kv, f = args.dim, args.n_heads * args.head_dim / t, args.kv_heads * args.head_dim / t, args.ffn_hidden_dim / t
    inputs = 2 * d + q + f
    output_grads = q + 2 * kv + 2 * d + 2 * f
    recast = (inputs - f) * recomputed_blocks(ac, ac_every) + (2 * d + q if ac == "op" else 0.0)
    return 5 * (inputs + recast + output_grads) + 2 * (inputs + output_grads)


def linear_gemms(args: TransformerModelArgs, layout: Layout,
                 seq_len: int) -> list[tuple[float, int, int, int, bool, bool]]:
    """The matrix products of one step of a rank's linear layers: (count, m, k, n, float8, forward).

    Each linear layer of in x out (its TP shard: column-parallel layers split out, row-parallel ones in) runs, per
    micro-batch of M tokens (the whole gathered sequence under sequence-parallel TP, its 1/cp share under CP), its
    forward (M x in) @ (in x out), the input gradient (M x out) @ (out x in) and the weight gradient
    (out x M) @ (M x in). Full AC runs every forward but w2's again (per-block AC in the blocks it recomputes),
    per-op AC those of wk, wo and w3. Float8 runs the blocks' products in float8 (torchao casts all three); the output layer
    stays bf16, on the last pipeline stage."""
    t, c = layout.tp, layout.cp
    m = round(layout.microbatch * seq_len / c)
    blocks = args.n_layers / layout.pp * (layout.local_batch // layout.microbatch)
    recomputed_by_op = OP_RECOMPUTED_LINEARS if layout.ac == "op" else ()
    gemms = []
    for name, (fan_in, fan_out) in block_linear_shapes(args, t).items():
        forwards = blocks * (1 + layout.recomputed_blocks * (name not in NOT_RECOMPUTED_LINEARS)
                             + (name in recomputed_by_op))
        gemms += [(forwards, m, fan_in, fan_out, layout.float8, True),
                  (blocks, m, fan_out, fan_in, layout.float8, False),
                  (blocks, fan_out, m, fan_in, layout.float8, False)]
    outputs = layout.local_batch // layout.microbatch
    vocab = args.vocab_size // t
    d = args.dim
    gemms += [(outputs, m, d, vocab, False, True), (outputs, m, vocab, d, False, False),
              (outputs, vocab, m, d, False, False)]
    return gemms


def step_time(args: TransformerModelArgs, layout: Layout, seq_len: int, gpu: GPU,
              efficiency: float = EFFICIENCY, memory_bound_bytes: float = MEMORY_BOUND_BYTES,
              compiled_fraction: float = COMPILED_FRACTION) -> StepTime:
    """Predicted time of one optimizer step on every GPU of `layout`."""
    t, p, c = layout.tp, layout.pp, layout.cp
    layers = args.n_layers / p
    # Tokens one GPU's share of the work covers: its data-parallel rank's batch, split over tp x cp (and the
    # pipeline splits layers, not tokens).
    tokens = layout.local_batch * seq_len / (t * c)
    recompute = layout.recomputed_blocks
    block_weights = block_linear_params(args)
    if layout.float8 and not gpu.fp8_flops:
        raise UserError(f"option model.converters: float8 needs a GPU with float8 tensor cores, and {gpu.name} "
                        f"has none: leave quantize.linear.float8 out of model.converters")
    if gpu.gemm_efficiency:  # the calibrated GPU's own level
        efficiency = gpu.gemm_efficiency
    else:  # the level fitted on H100s, carried to another GPU by a published measurement of both
        efficiency = min(1.0, efficiency * gpu.gemm_level_vs_h100)
    gemms = linear_gemms(args, layout, seq_len)
    matmul_s = sum(count * gemm_seconds(m, k, n, gpu, efficiency, float8) for count, m, k, n, float8, _ in gemms)
    attention = attention_step(args, layout, seq_len, gpu)
    hidden_elements = tokens * args.dim * layers * (1 + recompute / 3)
    memory_bound = memory_bound_bytes * hidden_elements
    if layout.float8:
        memory_bound += float8_cast_bytes_per_token(args, t, layout.ac, layout.ac_every) * tokens * t * layers
    memory_bound *= compiled_fraction if layout.compile else 1.0
    sequence = sequence_collectives(args, layout, seq_len)
    compute_s = (matmul_s + (memory_bound + sequence_reorder_bytes(layout, sequence)) / gpu.hbm_bytes_per_s
                 + attention.seconds)

    # FSDP over dp_shard x cp (stride tp), HSDP's replicas (stride dp_shard x cp x tp).
    stage_params = (block_weights * layers + args.vocab_size * args.dim * (2 / p)) / t
    shard = layout.dp_shard * c
    gather_bytes = 1 if float8_gathered(layout) else 2
    gathers = 2 if p == 1 else 1  # parameters are gathered again for backward unless PP keeps them
    fsdp_bytes_ag = gathers * stage_params * gather_bytes
    fsdp_bytes_rs = stage_params * 4
    fsdp_bw, fsdp_latency = _link_bandwidth(gpu, t, shard), ring_latency_seconds(gpu, t, shard)
    # One all-gather and one reduce-scatter per block (FSDP groups the parameters by block) and pass.
    gather_s = _ring_seconds(fsdp_bytes_ag, shard, fsdp_bw, gathers * layers, fsdp_latency)
    reduce_s = _ring_seconds(fsdp_bytes_rs, shard, fsdp_bw, layers, fsdp_latency)
    if layout.dp_replicate > 1:
        replica_bw = _link_bandwidth(gpu, t * shard, layout.dp_replicate)
        # An all-reduce is a reduce-scatter and an all-gather: twice the ring's traffic and steps.
        reduce_s += 2 * _ring_seconds(stage_params * 4 / shard, layout.dp_replicate, replica_bw, layers,
                                      ring_latency_seconds(gpu, t * shard, layout.dp_replicate))
    fsdp_s = gather_s + reduce_s

    microbatches = layout.local_batch // layout.microbatch
    tp_s, tp_exposed = 0.0, 0.0
    if t > 1:
        gather_calls, gathered = sequence[("all_gather", "tp")]
        reduce_calls, reduced = sequence[("reduce_scatter", "tp")]
        tp_s = _ring_seconds(gathered + reduced, t, _link_bandwidth(gpu, 1, t), gather_calls + reduce_calls,
                             ring_latency_seconds(gpu, 1, t))
        tp_exposed = tp_s
        if layout.async_tp:
            # Async TP (inductor's micro-pipelining) splits each all-gather feeding a matmul into chunks that
            # overlap it: the two such all-gathers of every forward (and those AC runs again) hide, as far as the
            # forward matmuls last; backward's stay exposed.
            hidden_calls = (2 + recomputed_tp_gathers(layout)) * layers * microbatches
            forward_matmul_s = sum(count * gemm_seconds(m, k, n, gpu, efficiency, float8)
                                   for count, m, k, n, float8, forward in gemms if forward)
            tp_exposed = tp_s - min(tp_s * hidden_calls / (gather_calls + reduce_calls), forward_matmul_s)
    # Context parallelism: a ring all-gather (or reduce-scatter) moves (c - 1) / c of its buffer, an all-to-all
    # rotation or gradient exchange its whole buffer to the next rank.
    cp_s, cp_exposed, cp_link = 0.0, 0.0, _link(gpu, t, c)
    if c > 1:
        cp_bw, cp_latency = _link_bandwidth(gpu, t, c), ring_latency_seconds(gpu, t, c)
        for (kind, dim), (calls, moved) in sequence.items():
            if dim != "cp":
                continue
            cp_s += (_ring_seconds(moved, c, cp_bw, calls, cp_latency) if kind != "all_to_all"
                     else moved / cp_bw + calls * cp_latency)
        if layout.gathers_kv:
            # The all-gather feeds the attention call directly: nothing computes while it runs.
            cp_exposed = cp_s
        elif layout.cp_rotate == "alltoall":
            # The ring passes the next chunk on while the current block computes: each of the c - 1 rotations hides
            # behind one block (1/c of the attention).
            cp_exposed = max(0.0, cp_s - attention.seconds * (c - 1) / c)
        else:
            # torch's ring attention all-gathers the keys and values once per call and waits for them after the
            # local chunk: only that chunk's attention (1/c of it) hides the exchange.
            cp_exposed = max(0.0, cp_s - attention.seconds / c)

    bubble, drained_s = 1.0, 0.0
    if p > 1:
        # One stage-micro-batch's passes in the shares the first micro-batch's forward uses below: the forward,
        # the input gradients with what AC runs again, the weight gradients.
        bubble = pipeline_schedule.bubble(layout.schedule, p, layout.stages_per_rank, microbatches, 1.0,
                                        1.0 + recompute, 1.0)
        # The schedule keeps the parameters gathered from the first micro-batch (whose forward hides the
        # all-gathers) and reduces each stage's gradients after its last backward; the compute stream waits for
        # that reduction before it goes on (perform_reduce_grad ends in FSDP's finalize_backward), so none of it
        # overlaps compute.
        first_forward_s = compute_s / (microbatches * layout.stages_per_rank) * (1 / (3 + recompute))
        fsdp_exposed = max(0.0, gather_s - first_forward_s)
        fsdp_hidden = gather_s - fsdp_exposed
        drained_s = reduce_s
    else:
        # Prefetching hides each block's all-gather behind the previous block's compute and its reduce-scatter
        # behind the next one's, except the first block's all-gather and the last reduce-scatter. FSDP gathers
        # and reduces again in every gradient-accumulation micro-step (the trainer keeps gradient sync on).
        edge_s = fsdp_s / layers
        fsdp_exposed = microbatches * (edge_s + max(0.0, fsdp_s - edge_s - compute_s / microbatches))
        fsdp_s *= microbatches
        fsdp_hidden = fsdp_s - fsdp_exposed
    if layout.rotated:
        rotation = rotation_time(args, layout, seq_len, gpu, efficiency)
        compute_s += rotation.extra_compute_s
        fsdp_s, fsdp_exposed, drained_s = rotation.comm_s, rotation.exposed_s, 0.0
        fsdp_hidden = fsdp_s - fsdp_exposed
    # Each kind hides behind compute only, and the kinds that share a link share it: what a link hides in a step is
    # at most the step's compute. A layout whose communication exceeds its compute is never compute-bound.
    hidden: dict[str, float] = {}
    for link, seconds in ((_link(gpu, t, shard), fsdp_hidden), (_link(gpu, 1, t), tp_s - tp_exposed),
                          (cp_link, cp_s - cp_exposed)):
        hidden[link] = hidden.get(link, 0.0) + seconds
    exposed = fsdp_exposed + tp_exposed + cp_exposed + sum(max(0.0, h - compute_s) for h in hidden.values())
    hidden_s = sum(min(h, compute_s) for h in hidden.values())
    # Under PP with FSDP the parameters are gathered and reduced once per step; otherwise once per pass.
    passes = 1 if p > 1 and shard > 1 else microbatches
    parameter_bytes = parameter_traffic_bytes(stage_params, shard, gather_bytes, gathers, passes)
    if layout.rotated:
        parameter_bytes = rotated_parameter_traffic_bytes(stage_params, shard, microbatches)
    if layout.float8:
        sizes = {name: fan_in * fan_out for name, (fan_in, fan_out) in block_linear_shapes(args, t).items()}
        weights = sum(sizes.values()) * layers
        recast_by_op = sum(sizes[name] for name in OP_RECOMPUTED_LINEARS) * layers if layout.ac == "op" else 0.0
        recast = (weights - sum(sizes[name] for name in NOT_RECOMPUTED_LINEARS) * layers) * recompute
        parameter_bytes += float8_weight_bytes(weights, recast, recast_by_op, shard,
                                               float8_gathered(layout), layout.compile, gathers, passes, microbatches)
    parameter_s = parameter_bytes / gpu.hbm_bytes_per_s
    return StepTime(compute_s=compute_s, exposed_comm_s=exposed, bubble=bubble, fsdp_comm_s=fsdp_s, tp_comm_s=tp_s,
                    cp_comm_s=cp_s, drained_comm_s=drained_s, parameter_s=parameter_s, hidden_comm_s=hidden_s,
                    pipeline_p2p_s=pipeline_p2p_seconds(args, layout, seq_len, gpu))


def tokens_per_second_per_gpu(args: TransformerModelArgs, layout: Layout, seq_len: int, gpu: GPU, alone: bool = False,
                              **constants) -> float:
    """Tokens/s per GPU of the layout; `alone`: of one of its ranks with no communication (StepTime.seconds_alone)."""
    step = step_time(args, layout, seq_len, gpu, **constants)
    return layout.tokens_per_gpu(seq_len) / (
        step.seconds_alone if alone else step.seconds)


# Rotated tensor parallelism's time terms (its bytes and memory: planner/rotated.py).

def recomputed_rotations(ac: str, every: int = 2) -> float:
    """The share of blocks whose rotations run again in backward: those activation checkpointing recomputes whole,
    and under per-op AC every block (its policy caches matmul outputs, but the recomputed forward runs each rotated
    Linear again, rotations included)."""
    return 1.0 if ac == "op" else recomputed_blocks(ac, every)


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
    """The rotations of one step of a rank of `layout` (layout.rotated): planner/rotated.py's docstring says how."""
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


def rotated_parameter_traffic_bytes(stage_params: float, world: int, passes: int, param_bytes: int = 2) -> float:
    """HBM bytes per step of a rank's work on its parameters: the optimizer over its shard, and per pass the cast of
    the shard into the rotating copy in forward and again in backward (4 read, p written; fp32 compute uses the
    shard itself), its gradient cast from the buffer (4 + 4) and added to the accumulated one (4 + 4, 4 written)."""
    shard_params = stage_params / world
    casts = 2 * (4 + param_bytes) if param_bytes != 4 else 0
    return OPTIMIZER_BYTES_PER_PARAM * shard_params + passes * shard_params * (casts + 8 + 12)
