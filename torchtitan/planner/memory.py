"""Analytic peak memory per device of a training layout: fast enough to search thousands of layouts.

The dry run (torchtitan/dry_run.py) traces the real step on fake tensors and is the reference; this model is
what the planner evaluates per candidate, and scripts/estimate_memory.py compares the two.

The formula (bytes, per rank; the worst pipeline rank is reported)
-------------------------------------------------------------------
Notation: d model width, q = heads x head_dim, kv = kv_heads x head_dim, f FFN width, V vocabulary, L blocks
on the rank, t/p/c tensor/pipeline/context-parallel degrees, F = FSDP degree (dp_shard x c; 1 without FSDP).
T = micro-batch x seq_len / c tokens per micro-batch; sequence-parallel regions hold T/t of them. a = bytes of
the compute dtype (training.mixed_precision_param: 2 for bf16, 4 for fp32).

State, always resident (the optimizer keeps fp32 masters):
  parameters  P_rank x 4 / F                   P_rank: the rank's parameters, matrices and embeddings / t
  optimizer   2 x P_rank x 4 / F               Adam(W): exp_avg and exp_avg_sq; other optimizers: the sum of their
                                               registered state_bytes over the rank's tensor shards (FSDP splits
                                               the first dimension), e.g. AdamW-bf16 4, AdamW-8bit ~2, Ranger21 16
                                               bytes per parameter
            + P_rank x b                       with FSDP, the gradient compression's compensation state (reported
                                               with the optimizer's): b = 1 + 2/128 for LoCo (8-bit codes and
                                               scales), 4 for error_feedback, 0 otherwise; NOT divided by F: it
                                               covers every row a rank sends (_compensation_state)
  gradients   P_rank x 4 / F                   fp32, sharded after FSDP's reduce-scatter; they exist from the
                                               backward on (with gradient accumulation: all the time)
              P_rank x 4                       under PP with FSDP: the schedule defers the reduce-scatter to the
                                               last micro-batch, so every parameter's unsharded gradient
                                               accumulates in the reduce dtype (fp32) until then

Activations saved for backward by one block and one micro-batch (what autograd keeps in this code; checked
with saved-tensor hooks):
  no AC       T/t x d x 2 x 8        both RMSNorms keep their input and normalised input in fp32
            + T x d x a x n_in       inputs of the linear layers: one per norm (n_in = 2); under autocast
                                     (bf16 without FSDP) every linear casts its own copy (n_in = 5)
            + T x A                  attention, what SDPA saves (query, key, value, output = wo's input):
                                     on CUDA the KV heads are expanded: A = 4 x q/t x a; on CPU SDPA takes
                                     grouped KV heads: A = (2 q + 2 kv)/t x a, and bf16 attention runs in
                                     fp32 where that is faster (model.cpu_attention_in_fp32: short sequences,
                                     narrow heads): A = (2 q + 2 kv)/t x 4 + q/t x a (wo's input stays bf16)
            + T x heads/t x 4        SDPA's log-sum-exp
            + T x f/t x 4 x a        SwiGLU: w1 and w3 outputs, silu output, product (= w2's input)
  no AC,      T/t x d x (r + a)      inductor's partitioner recomputes the norms and SiLU: the block input and
  compiled  + T x d x a x 2            the attention's sum, one linear input per norm, attention as above,
            + T x A + T x heads/t x 4  three of SwiGLU's four tensors (measured on this CPU with saved-tensor
            + T x f/t x 3 x a          hooks, eager against inductor, under autocast and bf16 parameters)
  no AC,      T/t x d x r + T x A + T x heads/t x 4 + T x f/t x 2 x a [+ T x q/t x a]
  compiled,                          the partitioner recomputes torchao's casts, and with them the norms'
  Float8                             outputs and SwiGLU's product: no linear input but a 2-D copy of wo's
                                     (unless attention ran in fp32, whose cast is that copy), two of SwiGLU's
                                     tensors (same measurement)
  full        T/t x d x r            only the block input (r: bytes of the residual stream: 4 under autocast
                                     or fp32, a when FSDP casts the parameters)
  op          T/t x d x r + a x T x ((q + kv)/t + d + f/t) + T x o [+ 2 x T/t x d x a under TP]
                                     block input + outputs of every other matmul (wq, wv, w1, w2) and of SDPA
                                     (what the policy saves; SDPA's output o = q/t x a, or q/t x 4 where attention
                                     runs in fp32), and under TP the two reduce-scattered outputs
  op,         the same without T x d x a and the TP term: inductor's partitioner saves only what backward reads,
  compiled                           and neither w2's output nor a reduce-scatter's is read (w2's measured on this
                                     CPU with saved-tensor hooks, bf16 and Float8; the reduce-scatters' by the same
                                     rule, torch cannot compile TP on the CPU; on an H200 a rank of the 70B's FSDP 64
                                     x TP 4, Float8, micro-batch 2 allocated 51.2 GiB at its peak, 46.3 estimated)
  every N     every N-th block as `full`, the others as `none`
A pipeline rank holds the activations of its in-flight micro-batches: 1F1B min(n_mb, p - rank), GPipe all n_mb,
and a multi-stage schedule what torch's own action list for the rank leaves in flight on each stage when the rank
holds the most (planner/pipeline_schedule.py: from a forward to its backward, or to its weight-gradient pass when
the backward is split). For Interleaved1F1B (v stages per rank) that is a warm-up of (v - 1) x p + 2 x (p - 1 -
rank) + 1 stage-micro-batches dealt p at a time to its stages in order (so its first stage holds the most); the
zero-bubble schedules hold theirs until the weight pass, the last rank as many as the first, and under activation
checkpointing a micro-batch awaiting its weight pass holds its blocks' whole activations (what the input-gradient
pass rebuilt; the weight pass rebuilding them again is not counted, docs/scaling.md). The last stage adds the
final norm (T/t x d x 8 + T x d x a) per micro-batch in flight, and for each beyond the one whose loss runs its
logits, which the schedule keeps as the stage's output, and what its loss saved for backward (T x V/t x (a + 4): the
fp32 log-softmax, and loss parallelism's extra copy; compiled, the logits alone).
Under PP a rank's backward peaks either in its first micro-batch (the other micro-batches' activations, the
gradients of the blocks already done) or in a later one (one micro-batch fewer, the gradients of its stage and the
later ones, and on the first stage the embedding's); with several stages per rank a stage's backward starts after
the later stages have run theirs for a round of p micro-batches.
A schedule that returns the last stage's outputs (torch.distributed.pipelining's default, TorchTitan's when it
measured the published figures; `kept_pipeline_outputs`) keeps each micro-batch's fp32 logits there, T x V/t x 4:
n_mb - 1 of them beside the last micro-batch's forward and backward, all n_mb through the optimizer step, and twice
that when the step concatenates them (this framework's trainer asks for none). The worst rank is reported; a
published run's is the rank it logged (TorchTitan's metrics rank: the first of the last stage under PP).
A TP plan that splits the embedding by vocabulary row (TorchTitan's, which measured the published figures; this
framework splits it by column) gets its gradient whole from DTensor's embedding backward (V x d); FSDP cuts it to the
shard with the rest, so under PP it accumulates whole, in fp32 (`row_split_embedding`).

Transients, of which only the largest coexists with the rest:
  loss         end of forward: logits, their fp32 copy and log-softmax: T x V/t x (a + 8) (8 in fp32);
               loss backward: log-softmax output, its gradient and the logits' gradient: T x V/t x 12;
               loss parallel (TP) adds T x V/t x 4 (one more fp32 copy, measured); without loss
               parallel the logits are whole (V instead of V/t). Compiled (compile.components has
               "loss", no loss parallel, which keeps it eager): fused kernels keep only the logits in
               forward, T x V x a, and the logits and their gradient in backward, T x V x 2a
  block        backward of a checkpointed block rebuilds its `none` activations (and autocast copies); any
               block's backward adds the gradients inside the SwiGLU backward: T x f/t x 2 x a
  optimizer    what the configured method's step allocates at its peak beyond its state, from the rank's
               tensors and layout (the registry's step_bytes: torch's foreach AdamW one fp32 temporary per value
               of the largest parameter group, the fused kernel none, Muon its stacks of one kind of matrix and
               their exchanges' buffers, FlexDeMo every replica's payload...; components/optimizers)
  compression  each compressed reduce-scatter: about 20 bytes per value of the module's unsharded local
               gradient (GRADIENT_COMPRESSION's reduction_bytes_per_value), beside the new compensation state the
               step's reductions stage until the optimizer step commits it (b per value of every module reduced so
               far); QSDP's weight codes (weight_bits / 8 per local parameter) from a module's first gather to the
               optimizer step
  float8       eager (not compiled) under TP: the cast of a whole-sequence output gradient in block backward
               passes through two fp32 copies, T x d x 8 (compiled blocks fuse the cast)

Mixed precision and FSDP buffers:
  FSDP (F > 1, or DDP)  the gathered parameters of 2 blocks (the running one and the prefetched one) and of the
                        norm + output (kept gathered after forward): (2 x P_block + P_head) / t x a_gather, with
                        a_gather = 1 for float8 all-gather, else a; during backward also one block's unsharded
                        gradients, in a plus their fp32 copy for the reduction when a = 2; under PP (no
                        resharding after forward) all the rank's parameters stay gathered: P_rank / t x a_gather
  pipeline (PP)         one receive buffer per micro-batch and stage for the previous stage's hidden states
                        (not on the first stage) and one for the next stage's gradients (not on the last):
                        n_mb x T/t x d x r each, kept from the first step on
  autocast (no FSDP)    bf16 copies of every matrix: held by autocast's cache to the end of forward, and saved
                        for backward by blocks without AC: P_matmul / t x 2

Peak = parameters + optimizer + max over the phases of the step:
  end of forward   activations + loss(forward) + buffers [+ gradients when accumulating]
  loss backward    activations + loss(backward) + buffers [+ gradients when accumulating]
  backward of      activations of blocks 0..i + block(i) + buffers + gradients of the head and of the blocks
    block i        after i (all gradients when accumulating); the largest over i
  optimizer step   gradients + optimizer temporaries
  [gradient        with compression: gradients + the staged compensation state; its reductions: the head's and
   reduction]      the embedding's (the largest in the backward), with the blocks' counted in their backward
The peaks of the forward's moments, the backward's and the step's are also kept apart (Estimate.phase_peaks), as the
dry run reports them.
Tensors only: what a GPU holds beyond them (the allocator's reserve, the CUDA context, NCCL's buffers) is
hardware.headroom, which the planner, the dry run's out-of-memory verdict and scripts/estimate_memory.py all add.

Compiled blocks with AC: per-op AC saves what its policy names and backward reads (above), full AC the block
input; the backward of a checkpointed block holds what the eager `none` set does (measured, one block
under full AC, backward peak: compiled bf16 22% below it, compiled Float8 2.5% below). Float8's linear layers cast
their weights themselves: under autocast no bf16 weight copies.

Rotated tensor parallelism (parallelism.data_parallel_shard_method = rotated) holds no gathered block: its shards
and gradient buffers in flight instead of FSDP's buffers, and one fp32 input gradient in block backward
(planner/rotated.py); gradients accumulate sharded under PP too, and compiled blocks keep eager's activations.

Context parallelism's exchange buffers (cp_exchange_bytes, cp_saved_bytes; T = this rank's tokens, c = CP degree,
h = the ring's key/value width: q/t on CUDA, whose kernels take the heads expanded, kv/t on CPU):
  K/V gathered        (the default, context_parallel_method = allgather_kv, and block-causal) the gathered grouped
                      keys and values (kv heads), c x T x 2 kv/t x a, and in backward their gradients before the
                      reduce-scatter (the same again); without AC each layer saves its gathered keys and values for
                      backward (per-op AC's policy saves attention's output, not them: backward gathers them again)
  ring, allgather     one layer's gathered keys and values during its attention call, c x T x 2h x a, plus in
                      backward the fp32 accumulators of the query gradient (T x q/t x 4) and of the rotating key
                      and value gradients (two chunks, the current and the incoming: 2 x T x 2h x 4)
  ring, alltoall      the current and the incoming chunk, 2 x T x 2h x a, and the same fp32 accumulators
These add to a block's backward transients; the saved ones to its activations.

Not modelled: allocator fragmentation (planner/hardware.py's headroom adds it); eager Float8 saves the
high-precision tensors for backward, so its activations are those of bf16. With a fused RMSNorm kernel (CUDA) each
norm may keep one fp32 [T, d] tensor fewer.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from torchtitan.components.float8 import float8_enabled
from torchtitan.components.optimizers import RankTensor, StepLayout, optimizer_spec
from torchtitan.config import JobConfig
from torchtitan.config.model_shape import shape_overrides
from torchtitan.distributed.compression import (QUANTIZE_BYTES_PER_VALUE, compensation_bytes_per_value,
                                                reduction_bytes_per_value, weight_code_bytes_per_value)
from torchtitan.distributed.context_parallel import gathers_keys_and_values
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import plan_pipeline, stage_ids_for_rank
from torchtitan.errors import UserError
from torchtitan.models import get as model_spec
from torchtitan.models.llama3.args import TransformerModelArgs, model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.nn.attention import cpu_attention_in_fp32
from torchtitan.planner import pipeline_schedule
from torchtitan.planner.rotated import block_in_flight_bytes, input_gradient_accumulator_bytes


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank at the peak, by component; `phase` names the moment of the step that sets the peak."""

    parameters: int
    optimizer: int
    gradients: int
    activations: int
    transient: int
    buffers: int
    phase: str
    rank: int
    phase_peaks: tuple[tuple[str, int], ...] = ()
    """The peak of each phase the dry run reports (fake.PHASES: forward, backward, optimizer step), bytes."""

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer + self.gradients + self.activations + self.transient
                + self.buffers)


@dataclass(frozen=True)
class _Shapes:
    d: int
    q: int
    kv: int
    f: int
    vocab: int
    n_heads: int
    head_dim: int

    @classmethod
    def of(cls, args: TransformerModelArgs) -> _Shapes:
        return cls(d=args.dim, q=args.n_heads * args.head_dim, kv=args.kv_heads * args.head_dim,
                   f=args.ffn_hidden_dim, vocab=args.vocab_size, n_heads=args.n_heads, head_dim=args.head_dim)

    def block_matmul_params(self) -> int:
        return 2 * self.d * self.q + 2 * self.d * self.kv + 3 * self.d * self.f

    def block_tensors(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(parameter group, shape, the dimension TP splits) of a block's parameters: TP splits wq, wk, wv, w1 and
        w3 by rows, wo and w2 by columns, not the norms."""
        return [("hidden_matrices", (self.q, self.d), 0), ("hidden_matrices", (self.kv, self.d), 0),
                ("hidden_matrices", (self.kv, self.d), 0), ("hidden_matrices", (self.d, self.q), 1),
                ("hidden_matrices", (self.f, self.d), 0), ("hidden_matrices", (self.f, self.d), 0),
                ("hidden_matrices", (self.d, self.f), 1), ("norms", (self.d,), None), ("norms", (self.d,), None)]


def _rank_tensors(config: JobConfig, tensors: list[tuple[str, tuple[int, ...], int | None]], t: int,
                  fsdp: int) -> list[RankTensor]:
    """These tensors (group, whole shape, the dimension TP splits) as a rank holds them: the TP shard, split by FSDP
    along its first dimension."""
    result = []
    for group, shape, tp_dim in tensors:
        local = [size / t if dim == tp_dim else size for dim, size in enumerate(shape)]
        local[0] /= fsdp
        result.append(RankTensor(group, shape, tuple(local), getattr(config.optimizer.groups, group).matrix_method,
                                 layout=(fsdp > 1, tp_dim if t > 1 else None)))
    return result


def _optimizer_state(config: JobConfig, tensors: list[RankTensor]) -> float:
    """Bytes of the configured optimizer's state one rank keeps for these tensors: the registry's state_bytes per
    method (AdamW's 8 per parameter, 4 for bf16 moments, about 2 for 8-bit, GaLore's share of each whole matrix's
    projector...)."""
    spec = optimizer_spec(config.optimizer.name)
    return sum(spec.state_bytes(t.shape, t.local_shape, config.optimizer, t.matrix_method) for t in tensors)


def _compensation_state(config: JobConfig, dims: ParallelDims, params: float) -> float:
    """Bytes of the gradient compression's compensation state on a rank holding `params` parameters (after TP,
    before FSDP): per FSDP module one row per data-parallel rank of its local shards, i.e. the whole unsharded local
    gradient at the method's bytes per value (LoCo's 8-bit codes, error feedback's fp32)."""
    return params * compensation_bytes_per_value(config) if dims.fsdp_enabled else 0.0


def require_planned_model(config: JobConfig, instead: str) -> None:
    """The planner models Llama 3 alone: another family's estimate would silently be Llama's."""
    if config.model.name != "llama3":
        raise UserError(f"option model.name: the planner's memory estimate models llama3 only, not "
                        f"{config.model.name!r}; {instead}")


def estimate(config: JobConfig, ngpu: int, device: str = "cuda", row_split_embedding: bool = False,
             kept_pipeline_outputs: bool = False, pipeline_rank: int | None = None) -> Estimate:
    """The peak over the pipeline ranks (every rank of a pipeline stage group holds the same), or that of
    `pipeline_rank`, on `device` devices ("cuda" or "cpu": attention saves different tensors on each).
    `row_split_embedding` models a TP plan that splits the embedding by vocabulary row (TorchTitan's, which measured
    the published figures; this framework splits it by column): its gradient is then whole on every rank.
    `kept_pipeline_outputs`: the last stage keeps every micro-batch's fp32 logits until the step merges them
    (TorchTitan's pipeline when it measured them; cost.Layout.kept_pipeline_outputs)."""
    require_planned_model(config, "measure the model's memory with a dry run (comm.mode = fake_backend)")
    dims = ParallelDims.from_config(config.parallelism, ngpu)
    args = model_args_for(config.model.flavor, config.training.seq_len, overrides=shape_overrides(config.model))
    stages_of_rank, in_flight = _pipeline_layout(config, args, dims)
    ranks = range(len(stages_of_rank)) if pipeline_rank is None else [pipeline_rank]
    estimates = [_estimate_rank(config, args, dims, rank, stages_of_rank[rank], in_flight, device,
                                row_split_embedding, kept_pipeline_outputs) for rank in ranks]
    return max(estimates, key=lambda e: e.total)


@functools.lru_cache(maxsize=None)
def _skeleton(n_layers: int) -> Transformer:
    """The pipeline split depends only on the depth: a tiny model of the same depth (on meta) stands in."""
    with torch.device("meta"):
        return Transformer(TransformerModelArgs(dim=8, n_layers=n_layers, n_heads=1, n_kv_heads=1, vocab_size=8,
                                                multiple_of=8, rope_len=1))


def _pipeline_layout(config: JobConfig, args: TransformerModelArgs, dims: ParallelDims):
    """Per pipeline rank, its stages as (blocks, has embedding, has head); and in_flight(rank, stage index), the
    micro-batches whose activations a stage holds at once."""
    if dims.pp == 1:
        return [[(args.n_layers, True, True)]], lambda rank, stage_index, rebuilt: (1, 0)
    plan = plan_pipeline(model_spec("llama3"), _skeleton(args.n_layers), dims.pp, config)
    stages = []
    for names in plan.stage_names:
        blocks = sum(name.startswith("layers.") for name in names)
        stages.append((blocks, "tok_embeddings" in names, "output" in names))
    per_rank = [[stages[s] for s in stage_ids_for_rank(r, dims.pp, plan.num_stages, plan.v_shaped)]
                for r in range(dims.pp)]
    v = plan.num_stages // dims.pp

    def in_flight(rank: int, stage_index: int, rebuilt: float) -> tuple[int, int]:
        held, awaiting = pipeline_schedule.in_flight(plan.schedule_name, dims.pp, v, plan.n_microbatches, rank,
                                                     round(rebuilt, 1))
        return held[stage_index], awaiting[stage_index]

    return per_rank, in_flight


def _attention_bytes(s: _Shapes, seq_len: float, t: int, a: int, device: str,
                     gathered_kv: bool = False) -> tuple[float, float]:
    """Bytes per token that attention saves for backward, and those of SDPA's output alone (model.causal_attention
    chooses the path from the local sequence length; see the module docstring). `gathered_kv`: context parallelism
    over gathered keys and values, whose attention saves the query and output of the rank's tokens and the gathered
    keys and values (cp_saved_bytes), not the rank's own."""
    if gathered_kv:
        return 2 * s.q / t * a, s.q / t * a
    if device != "cpu":
        return 4 * s.q / t * a, s.q / t * a
    if _attention_in_fp32(s, seq_len, a, device):
        return (2 * s.q + 2 * s.kv) / t * 4 + s.q / t * a, s.q / t * 4
    return (2 * s.q + 2 * s.kv) / t * a, s.q / t * a


def _cp_key_value_width(config: JobConfig, s: _Shapes, t: int, device: str) -> float:
    """Width of the keys and values one CP exchange moves, per token: both, over the heads of one TP rank."""
    if gathers_keys_and_values(config):
        return 2 * s.kv / t
    return 2 * (s.q if device == "cuda" else s.kv) / t


def cp_exchange_bytes(config: JobConfig, s: _Shapes, tokens: float, t: int, cp: int, a: int, device: str) -> float:
    """Bytes context parallelism's exchange keeps alive during one layer's attention backward (module docstring)."""
    if cp == 1:
        return 0.0
    width = _cp_key_value_width(config, s, t, device)
    if gathers_keys_and_values(config):
        return 2 * cp * tokens * width * a
    chunks = cp if config.parallelism.context_parallel_rotate_method == "allgather" else 2
    return chunks * tokens * width * a + tokens * s.q / t * 4 + 2 * tokens * width * 4


def cp_saved_bytes(config: JobConfig, s: _Shapes, tokens: float, t: int, cp: int, a: int, mode: str,
                   device: str) -> float:
    """Bytes one layer saves for backward of CP's gathered keys and values (module docstring)."""
    if not gathers_keys_and_values(config) or mode in ("full", "op"):
        return 0.0
    return cp * tokens * _cp_key_value_width(config, s, t, device) * a


def _attention_in_fp32(s: _Shapes, seq_len: float, a: int, device: str) -> bool:
    return device == "cpu" and a == 2 and cpu_attention_in_fp32(s.head_dim, int(seq_len))


def _block_activations(s: _Shapes, tokens: float, seq_len: float, t: int, a: int, r: int, autocast: bool,
                       mode: str, device: str, compiled: bool = False, float8: bool = False,
                       gathered_kv: bool = False) -> float:
    """Bytes one block saves for backward for one micro-batch of `tokens` tokens in sequences of `seq_len` (see the
    module docstring); `compiled`: what inductor's partitioner saves of a compiled block without AC, which with
    Float8 (`float8`) recomputes the casts and so the linear inputs too; `gathered_kv`: attention over keys and
    values gathered by context parallelism (their own bytes: cp_saved_bytes)."""
    sp = tokens / t
    attention, sdpa_output = _attention_bytes(s, seq_len, t, a, device, gathered_kv)
    if mode == "full":
        return sp * s.d * r
    if mode == "op":
        # Every other matmul's output: wq, wv, w1 and w2 (the activation-checkpoint policy), and under TP the two
        # reduce-scattered outputs. Compiled, the partitioner keeps of these only what backward reads: not w2's
        # output, nor the reduce-scatters'.
        kept_unread = 0.0 if compiled else tokens * s.d * a + (2 * sp * s.d * a if t > 1 else 0)
        saved = (a * tokens * ((s.q + s.kv) / t + s.f / t) + tokens * sdpa_output
                 + tokens * s.n_heads / t * 4)
        return sp * s.d * r + saved + kept_unread
    if compiled and float8:
        # The float8 matmul of wo takes its input as a 2-D copy, which the fp32 attention path's cast already is.
        wo_input = 0.0 if _attention_in_fp32(s, seq_len, a, device) else s.q / t * a
        return (sp * s.d * r + tokens * wo_input + tokens * attention + tokens * s.f / t * 2 * a
                + tokens * s.n_heads / t * 4)
    if compiled:
        return (sp * s.d * (r + a) + tokens * s.d * a * 2 + tokens * attention + tokens * s.f / t * 3 * a
                + tokens * s.n_heads / t * 4)
    n_in = 5 if autocast and a != 4 else 2
    return (sp * s.d * 2 * 8 + tokens * s.d * a * n_in + tokens * attention + tokens * s.f / t * 4 * a
            + tokens * s.n_heads / t * 4)


def _ac_modes(config: JobConfig, n_blocks: int) -> list[str]:
    ac = config.activation_checkpoint
    if ac.mode == "none":
        return ["none"] * n_blocks
    if ac.mode == "full":
        return ["full"] * n_blocks
    if ac.selective_ac_option == "op":
        return ["op"] * n_blocks
    every = int(ac.selective_ac_option)
    return ["full" if (i + 1) % every == 0 else "none" for i in range(n_blocks)]


def _estimate_rank(config: JobConfig, args: TransformerModelArgs, dims: ParallelDims, rank: int,
                   stages: list[tuple[int, bool, bool]], in_flight, device: str,
                   row_split_embedding: bool = False, kept_pipeline_outputs: bool = False) -> Estimate:
    s = _Shapes.of(args)
    t, fsdp = dims.tp, dims.dp_shard * dims.cp
    a = 2 if config.training.mixed_precision_param == "bfloat16" else 4
    wrapped = dims.fsdp_enabled or dims.ddp_enabled
    autocast = not wrapped and a != 4
    residual = a if wrapped else 4
    microbatch = config.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else \
        config.training.local_batch_size
    seq_len = config.training.seq_len / dims.cp
    tokens = microbatch * seq_len

    block_params = s.block_matmul_params() / t + 2 * s.d
    head_params = s.vocab * s.d / t + s.d
    # Float8's linear layers cast their weights themselves, from the fp32 parameters: no autocast copy.
    float8 = float8_enabled(config)
    block_copies = s.block_matmul_params() / t * 2 if autocast and not float8 else 0.0
    # Rotated tensor parallelism (planner/rotated.py): its rotations break a compiled block's graph at every Linear.
    rotated = config.parallelism.data_parallel_shard_method == "rotated"
    compiled_blocks = config.compile.enable and "model" in config.compile.components and not rotated
    # What a checkpointed block's backward holds while it recomputes: the eager `none` set, compiled or not
    # (measured on this CPU, one block under full AC, backward peak: compiled bf16 22% below it, compiled Float8
    # 2.5%).
    gathered_kv = gathers_keys_and_values(config)
    none = _block_activations(s, tokens, seq_len, t, a, residual, autocast, "none", device, gathered_kv=gathered_kv)
    # Per block of the rank, in forward order: (saved bytes for its in-flight micro-batches, bytes rebuilt and
    # alive during its backward, autocast copies it keeps for backward, micro-batches in flight, which of the
    # rank's stages holds it).
    blocks: list[tuple[float, float, float, float, int]] = []
    params = head_activations = head_copies = 0.0
    head_in_flight = 1
    has_head = False
    block_tensors = _rank_tensors(config, s.block_tensors(), t, fsdp)
    embedding_tensors = _rank_tensors(config, [("embeddings", (s.vocab, s.d), 0)], t, fsdp)
    head_tensors = _rank_tensors(config, [("output", (s.vocab, s.d), 0), ("norms", (s.d,), None)], t, fsdp)
    rank_tensors: list[RankTensor] = []  # every tensor the rank's optimizer steps
    # A split backward keeps what checkpointing rebuilt until the weight pass (pipeline_schedule.in_flight): per
    # checkpointed block (per-op AC's, or a whole block's under full and per-block AC), that over what it saved.
    ac = config.activation_checkpoint
    checkpointed_mode = "op" if ac.mode == "selective" and ac.selective_ac_option == "op" else "full"
    checkpointed = _block_activations(s, tokens, seq_len, t, a, residual, autocast, checkpointed_mode, device,
                                      compiled_blocks, float8, gathered_kv)
    rebuilt_ratio = max(0.0, none - checkpointed) / checkpointed if ac.mode != "none" else 0.0
    for stage_index, (n_blocks, has_embedding, stage_has_head) in enumerate(stages):
        mbs, awaiting_weight_pass = in_flight(rank, stage_index, rebuilt_ratio)
        params += n_blocks * block_params + (s.vocab * s.d / t if has_embedding else 0.0)
        rank_tensors += block_tensors * n_blocks + (embedding_tensors if has_embedding else [])
        for mode in _ac_modes(config, n_blocks):
            per_micro_batch = (_block_activations(s, tokens, seq_len, t, a, residual, autocast, mode, device,
                                                  compiled_blocks, float8, gathered_kv)
                               + cp_saved_bytes(config, s, tokens, t, dims.cp, a, mode, device))
            saved = mbs * per_micro_batch + awaiting_weight_pass * max(0.0, none - per_micro_batch) * (mode != "none")
            rebuilt = none + block_copies if mode != "none" else 0.0
            # Autocast's cache hands every micro-batch the same copy of a weight.
            blocks.append((saved, rebuilt, block_copies if mode == "none" else 0.0, mbs, stage_index))
        if stage_has_head:
            has_head = True
            params += head_params
            rank_tensors += head_tensors
            head_activations += mbs * (tokens / t * s.d * 8 + tokens * s.d * a)
            head_in_flight = mbs
            head_copies += s.vocab * s.d / t * 2 if autocast else 0.0

    sharded = params / fsdp
    parameters, gradients = 4 * sharded, 4 * sharded
    optimizer = _optimizer_state(config, rank_tensors)
    step_transient = optimizer_spec(config.optimizer.name).step_bytes(
        rank_tensors, config.optimizer, StepLayout(shard_ranks=fsdp * t, replicas=dims.dp_replicate,
                                                   device_type=device))
    accumulating = dims.pp > 1 or config.training.global_batch_size > config.training.local_batch_size * dims.dp
    grad_bytes = 4 / fsdp
    # A row-split embedding's gradient comes out of DTensor's embedding backward whole (vocabulary x dim; it has
    # no rule that yields the row shard), and FSDP cuts it to the shard only when it reduces the gradient.
    has_embedding = any(stage[1] for stage in stages)
    whole_embedding_grad = s.vocab * s.d * (1 - 1 / t) if has_embedding and t > 1 and row_split_embedding else 0.0
    if wrapped and dims.pp > 1 and not rotated:
        # The pipeline schedule turns FSDP's gradient sync off until the last micro-batch's backward
        # (torch.distributed.pipelining's stage.py): each parameter's unsharded gradient accumulates, upcast to
        # the reduce dtype (FSDPParam.to_accumulated_grad_if_needed), and is reduce-scattered at the end; the
        # embedding's whole-vocabulary gradient accumulates as it is.
        grad_bytes = max(4 if config.training.mixed_precision_reduce == "float32" else 2, a)
        params_with_grads = params + whole_embedding_grad
    else:
        params_with_grads = params
    resident_grads = params_with_grads * grad_bytes if accumulating else 0.0
    activations = sum(b[0] for b in blocks) + head_activations
    saved_copies = sum(b[2] for b in blocks) + head_copies

    if wrapped:
        gather = 1 if float8_enabled(config) and config.quantize.linear.float8.enable_fsdp_float8_all_gather else a
        forward_buffers = (2 * block_params + (head_params if has_head else 0.0)) * gather
        if dims.pp > 1 and config.parallelism.fsdp_reshard_after_forward != "always":
            # Under PP the parameters stay gathered from the first micro-batch to the last (fsdp.py).
            forward_buffers = params * gather
        backward_buffers = forward_buffers + block_params * (a + (4 if a != 4 else 0))
        forward_copies = 0.0
    else:
        forward_buffers = backward_buffers = 0.0
        forward_copies = len(blocks) * block_copies + head_copies
    if rotated:
        # No gathered block: in a block's backward its shards and gradient buffers in flight.
        forward_buffers, backward_buffers = 0.0, block_in_flight_bytes(
            args, fsdp, a, 4 if config.training.mixed_precision_reduce == "float32" else 2)
    # torch.distributed.pipelining gives a stage one receive buffer per micro-batch for the hidden states of the
    # previous stage, and one for the gradients of the next, allocated at the first step and kept (stage.py).
    receives = sum((not first) + (not last) for _, first, last in stages) if dims.pp > 1 else 0
    receive_buffers = receives * config.training.local_batch_size // microbatch * tokens / t * s.d * residual
    forward_buffers += receive_buffers
    backward_buffers += receive_buffers

    loss_parallel = t > 1 and not config.parallelism.disable_loss_parallel
    logits = tokens * s.vocab / (t if loss_parallel else 1) if has_head else 0.0
    # Measured (CPU run and trace agree): torch's loss-parallel log-softmax keeps one more fp32 copy of the
    # logits shard.
    loss_parallel_extra = 4 * logits if loss_parallel else 0.0
    # Compiled, the loss is fused kernels over the logits (measured on this CPU: nothing per logit beyond them in
    # forward, their gradient in backward); eager, it materialises fp32 copies. Loss parallelism keeps it eager.
    compiled_loss = config.compile.enable and "loss" in config.compile.components and not loss_parallel
    if compiled_loss:
        loss_forward, loss_backward = logits * a, logits * 2 * a
    else:
        loss_forward, loss_backward = logits * (a + 8 if a != 4 else 8) + loss_parallel_extra, \
            logits * 12 + loss_parallel_extra
    # A schedule that runs several forwards on the last stage before their backwards (GPipe, LoopedBFS, and the
    # zero-bubble schedules until the weight pass) keeps each one's logits, the stage's output (stage.fwd_cache),
    # and what its loss saved for backward: nothing more compiled, the fp32 log-softmax eager (and loss
    # parallelism's extra copy).
    loss_saved = logits * a if compiled_loss else (a + 4) * logits + loss_parallel_extra
    activations += (head_in_flight - 1) * loss_saved
    # With every micro-batch in flight at once (GPipe, or a rank whose warm-up covers the batch) no forward runs
    # after a backward: the forwards see no gradients yet.
    steady_grads = resident_grads if dims.pp == 1 or any(
        config.training.local_batch_size // microbatch > b[3] for b in blocks) or not blocks else 0.0
    if has_head and len(stages) > 1 and config.training.local_batch_size // microbatch <= dims.pp:
        # Interleaved schedules run backward in rounds of pp micro-batches, a rank's later stage first: in a single
        # round every loss backward comes before the rank's earlier stages hold any gradient.
        head_stage = len(stages) - 1
        steady_grads = min(steady_grads, (sum(block_params for b in blocks if b[4] == head_stage) + head_params)
                           * grad_bytes)
    # Compressed collectives (distributed/compression): QSDP's weight codes, made at each module's first gather and
    # kept until the optimizer has stepped; each compressed reduce-scatter's temporaries (per value of the module's
    # unsharded local gradient, its new state included) and the new compensation state of the modules reduced so
    # far, staged beside the committed one until the step commits it.
    compressed = wrapped and dims.fsdp_enabled
    reduction = reduction_bytes_per_value(config) if compressed else 0.0
    staged = compensation_bytes_per_value(config) if compressed else 0.0
    weight_codes = weight_code_bytes_per_value(config) if compressed else 0.0
    kept_codes = weight_codes * params / fsdp
    embedding_params = s.vocab * s.d / t if has_embedding else 0.0
    largest_module = max(block_params, head_params if has_head else 0.0, embedding_params)
    phases = {
        "end of forward": (activations, loss_forward, forward_buffers + forward_copies + kept_codes, steady_grads),
        "loss backward": (activations, loss_backward, forward_buffers + saved_copies + kept_codes, steady_grads),
        "optimizer step": (0.0, step_transient, receive_buffers + kept_codes, gradients),
        # After the backward, before the step: every gradient, and the compensation state they staged.
        "gradient clipping": (0.0, staged * params, receive_buffers + kept_codes, gradients),
    }
    if weight_codes:
        # A module's first gather encodes its shard (the quantizer's fp32 temporaries, as a reduce-scatter's without
        # the state) and receives every rank's codes.
        phases["weight gather"] = (activations, largest_module * (weight_codes + QUANTIZE_BYTES_PER_VALUE / fsdp),
                                   forward_buffers + kept_codes, steady_grads)
    if reduction:
        # The norm and output layer reduce first, with every block's activations still held; the embedding last,
        # with every other module's gradient and new state.
        unsharded_grad = a + (4 if a != 4 else 0)
        if has_head:
            phases["gradient reduction"] = (activations, reduction * head_params,
                                            forward_buffers + kept_codes + head_params * unsharded_grad,
                                            steady_grads + 4 * head_params / fsdp)
        if has_embedding:
            last_reduction = (0.0, reduction * embedding_params + staged * (params - embedding_params),
                              forward_buffers + kept_codes + embedding_params * unsharded_grad, gradients)
            if sum(last_reduction) > sum(phases.get("gradient reduction", (0.0,))):
                phases["gradient reduction"] = last_reduction
    if whole_embedding_grad:
        # The embedding's backward comes last: every other gradient exists, its whole-vocabulary one in the
        # compute dtype beside them.
        phases["embedding backward"] = (0.0, (whole_embedding_grad + s.vocab * s.d / t) * a, forward_buffers,
                                        max(resident_grads, (params - s.vocab * s.d / t) * grad_bytes))
    # Backward walks the blocks from the last: the blocks before it still hold their activations, those after
    # it have freed this micro-batch's (the other in-flight micro-batches keep theirs) and hold their gradients;
    # a checkpointed block rebuilds its activations. Under PP a later micro-batch's backward also runs with the
    # gradients of its stage and the later ones accumulated (and the embedding's, on the first stage) and one
    # micro-batch fewer in flight. With several stages per rank a stage's backward starts when the later stages
    # have run theirs for a round of `pp` micro-batches: what they still hold is the rest.
    last = len(stages) - 1
    # A multi-stage schedule reduces a stage's gradients right after its last backward (schedules.py's
    # _add_reduce_grad): in a single round of pp micro-batches a rank's later stages are done before its earlier
    # ones start, and hold their gradient shards only.
    # Eager Float8 casts a tensor through two fp32 intermediates (torchao: scaled, then clamped) before the float8
    # copy; the largest, under TP, is the whole-sequence output gradient of wo and w2 (T x d). Compiled blocks fuse
    # the cast into one kernel. Without TP the casts are no larger than SwiGLU's own tensors and the traces' peaks
    # did not move (8B rows).
    float8_casts = 8 * tokens * s.d if float8_enabled(config) and not config.compile.enable and t > 1 else 0.0
    total_micro_batches = config.training.local_batch_size // microbatch
    later_bytes = 4 / fsdp if dims.pp > 1 and total_micro_batches <= dims.pp else grad_bytes
    cp_exchange = cp_exchange_bytes(config, s, tokens, t, dims.cp, a, device)
    # Parameters whose gradients the backward has produced so far, per stage of this rank (the head's first).
    done = {stage: 0.0 for stage in range(len(stages))}
    done[last] = head_params if has_head else 0.0

    # Sums over the blocks before and after each one, kept as running totals (a sum per block would make this
    # quadratic in the depth, and the planner estimates thousands of layouts). Stages are contiguous in `blocks`.
    saved_before = list(itertools.accumulate(b[0] for b in blocks))
    copies_before_of = list(itertools.accumulate(b[2] for b in blocks))
    own_stage_params = {stage: sum(block_params for b in blocks if b[4] == stage) for stage in done}
    stage_saved_before = []  # this block's stage: saved bytes up to it, and those less one micro-batch
    running: dict[int, tuple[float, float]] = {}
    for saved, _, _, mbs, stage in blocks:
        total, less_one = running.get(stage, (0.0, 0.0))
        running[stage] = (total + saved, less_one + saved * (mbs - 1) / mbs)
        stage_saved_before.append(running[stage])
    after = {stage: (0.0, 0.0) for stage in done}  # this stage's later blocks: less one, less two micro-batches
    later_held_after = {stage: 0.0 for stage in done}  # all later blocks: what exceeds a round of pp micro-batches
    held_after = 0.0
    for index in reversed(range(len(blocks))):
        saved, rebuilt, _, mbs, stage = blocks[index]
        same_after_less_one, same_after_less_two = after[stage]
        # Only a rank with several stages has later ones; they keep what exceeds a round of `pp` micro-batches.
        later_held = held_after - later_held_after[stage]
        copies_before = copies_before_of[index]
        # A block's compressed reduce-scatter runs beside the next block's backward (on its own stream on GPUs).
        transient = (rebuilt + 2 * tokens * s.f / t * a + float8_casts + cp_exchange + reduction * block_params
                     + staged * sum(done.values())
                     + (input_gradient_accumulator_bytes(args, tokens, a) if rotated else 0.0))
        candidates = [(saved_before[index] + same_after_less_one + later_held,
                       max(resident_grads if dims.pp == 1 else 0.0,
                           done[stage] * grad_bytes
                           + sum(done[later_stage] for later_stage in done if later_stage > stage) * later_bytes))]
        if dims.pp > 1 and total_micro_batches > 1:
            own = (own_stage_params[stage] + (head_params if has_head and stage == last else 0.0)
                   + ((s.vocab * s.d / t + whole_embedding_grad) if stage == 0 and has_embedding else 0.0))
            later = sum(own_stage_params[later_stage] for later_stage in done if later_stage > stage) + (
                head_params if has_head and stage < last else 0.0)
            stage_total, stage_less_one = stage_saved_before[index]
            candidates.append((saved_before[index] - stage_total + stage_less_one + same_after_less_two + later_held,
                               own * grad_bytes + later * later_bytes))
        for saved_bytes, grads in candidates:
            phase = (saved_bytes, transient, backward_buffers + copies_before + kept_codes, grads)
            if sum(phase) > sum(phases.get("block backward", (0.0,))):
                phases["block backward"] = phase
        done[stage] += block_params
        after[stage] = (same_after_less_one + saved * (mbs - 1) / mbs,
                        same_after_less_two + saved * max(mbs - 2, 0) / mbs)
        exceeding = saved * max(mbs - dims.pp, 0) / mbs
        held_after += exceeding
        later_held_after[stage] += exceeding
    if kept_pipeline_outputs and has_head and dims.pp > 1:
        # The schedule keeps each micro-batch's fp32 logits on the last stage (stage.output_chunks): by the last
        # micro-batch's forward and backward the earlier ones, through the optimizer step all of them; after the
        # last backward it concatenates them into one more copy to return (schedules.py's _merge_outputs).
        kept = 4 * logits
        for name, (acts_, transient_, buffers_, grads_) in phases.items():
            held = kept * (total_micro_batches if name == "optimizer step" else total_micro_batches - 1)
            phases[name] = (acts_, transient_, buffers_ + held, grads_)
        phases["outputs merged"] = (0.0, 2 * kept * total_micro_batches, receive_buffers, gradients)
    phase, (acts, transient, buffers, grads) = max(phases.items(), key=lambda item: sum(item[1]))
    optimizer += _compensation_state(config, dims, params)
    phase_peaks: dict[str, float] = {}
    for name, held in phases.items():
        reported = _REPORTED_PHASE[name]
        phase_peaks[reported] = max(phase_peaks.get(reported, 0.0), parameters + optimizer + sum(held))
    return Estimate(parameters=round(parameters), optimizer=round(optimizer), gradients=round(grads),
                    activations=round(acts), transient=round(transient), buffers=round(buffers),
                    phase=phase, rank=rank, phase_peaks=tuple((name, round(phase_peaks[name])) for name in
                                                              ("forward", "backward", "optimizer step")))


# The phase of the step each of the model's moments belongs to, as the dry run reports its peaks (fake.PHASES).
_REPORTED_PHASE = {"end of forward": "forward", "loss backward": "backward", "block backward": "backward",
                   "embedding backward": "backward", "gradient reduction": "backward", "outputs merged": "backward",
                   "weight gather": "forward", "gradient clipping": "backward",
                   "optimizer step": "optimizer step"}
