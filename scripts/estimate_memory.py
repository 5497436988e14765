"""Peak memory per device of a training configuration, predicted without running the model.

From the repository root:

    python scripts/estimate_memory.py                       # the 8B/70B/405B presets on H100 layouts
    python scripts/estimate_memory.py --job.config_file train_configs/llama3_8b.toml --ngpu 8
    python scripts/estimate_memory.py --flavor 70B --seq_len 8192 --local_batch_size 8 --ngpu 64 --tp 8 --ac full
    python scripts/estimate_memory.py --validate             # estimate vs measured, small configs on this CPU

Any other argument is a trainer option (`--section.option value`, as torchtitan.train takes it); --flavor,
--seq_len, --local_batch_size, --tp, --pp, --cp, --dp_shard, --dp_replicate and --ac (none, full, op or an
integer N) are short forms of them. The vocabulary is the flavor's own (the trainer uses its tokenizer's).

The formula (bytes, per rank; the worst pipeline rank is reported)
-------------------------------------------------------------------
Notation: d model width, q = heads x head_dim, kv = kv_heads x head_dim, f FFN width, V vocabulary, L blocks
on the rank, t/p/c tensor/pipeline/context-parallel degrees, F = FSDP degree (dp_shard x c; 1 without FSDP).
T = micro-batch x seq_len / c tokens per micro-batch; sequence-parallel regions hold T/t of them. a = bytes of
the compute dtype (training.mixed_precision_param: 2 for bf16, 4 for fp32).

State, always resident (the optimizer keeps fp32 masters):
  parameters  P_rank x 4 / F                   P_rank: the rank's parameters, matrices and embeddings / t
  optimizer   2 x P_rank x 4 / F               Adam(W): exp_avg and exp_avg_sq
  gradients   P_rank x 4 / F                   fp32, sharded after FSDP's reduce-scatter; they exist from the
                                               backward on (with gradient accumulation or PP: all the time)

Activations saved for backward by one block and one micro-batch (what autograd keeps in this code; checked
with saved-tensor hooks):
  no AC       T/t x d x 2 x 8        both RMSNorms keep their input and normalised input in fp32
            + T x d x a x n_in       inputs of the linear layers: one per norm (n_in = 2); under autocast
                                     (bf16 without FSDP) every linear casts its own copy (n_in = 5)
            + T x A                  attention, what SDPA saves (query, key, value, output = wo's input):
                                     on CUDA the KV heads are expanded: A = 4 x q/t x a; on CPU SDPA takes
                                     grouped KV heads: A = (2 q + 2 kv)/t x a, and bf16 heads under 64 wide
                                     run in fp32: A = (2 q + 2 kv)/t x 4 + q/t x a (wo's input stays bf16)
            + T x heads/t x 4        SDPA's log-sum-exp
            + T x f/t x 4 x a        SwiGLU: w1 and w3 outputs, silu output, product (= w2's input)
  full        T/t x d x r            only the block input (r: bytes of the residual stream: 4 under autocast
                                     or fp32, a when FSDP casts the parameters)
  op          T/t x d x r + a x T x ((q + 2 kv)/t + 2 d + 2 f/t) + T x o [+ 2 x T/t x d x a under TP]
                                     block input + outputs of the matmuls and of SDPA (the ops the policy saves;
                                     SDPA's output o = q/t x a, or q/t x 4 where attention runs in fp32)
  every N     every N-th block as `full`, the others as `none`
A pipeline rank holds the activations of its in-flight micro-batches: 1F1B min(n_mb, p - rank), interleaved
schedules (v stages per rank) (v - 1) x p + 2 x (p - 1 - rank) + 1 stage-micro-batches, GPipe all n_mb. The last
stage adds the final norm (T/t x d x 8 + T x d x a).

Transients, of which only the largest coexists with the rest:
  loss         end of forward: logits, their fp32 copy and log-softmax: T x V/t x (a + 8) (8 in fp32);
               loss backward: log-softmax output, its gradient and the logits' gradient: T x V/t x 12;
               loss parallel (TP) adds T x V/t x 8 (two more fp32 copies, measured); without loss
               parallel the logits are whole (V instead of V/t)
  block        backward of a checkpointed block rebuilds its `none` activations (and autocast copies); any
               block's backward adds the gradients inside the SwiGLU backward: T x f/t x 2 x a
  optimizer    the foreach implementation allocates one fp32 temporary per parameter (P_rank x 4 / F); fused
               and for-loop implementations none to speak of

Mixed precision and FSDP buffers:
  FSDP (F > 1, or DDP)  the gathered parameters of 2 blocks (the running one and the prefetched one) and of the
                        norm + output (kept gathered after forward): (2 x P_block + P_head) / t x a_gather, with
                        a_gather = 1 for float8 all-gather, else a; during backward also one block's unsharded
                        gradients, in a plus their fp32 copy for the reduction when a = 2
  autocast (no FSDP)    bf16 copies of every matrix: held by autocast's cache to the end of forward, and saved
                        for backward by blocks without AC: P_matmul / t x 2

Peak = parameters + optimizer + max over the phases of the step:
  end of forward   activations + loss(forward) + buffers [+ gradients when accumulating]
  loss backward    activations + loss(backward) + buffers [+ gradients when accumulating]
  backward of      activations of blocks 0..i + block(i) + buffers + gradients of the head and of the blocks
    block i        after i (all gradients when accumulating); the largest over i
  optimizer step   gradients + optimizer temporaries
plus a fixed overhead (--overhead_gib; default 2 GiB on GPUs for the CUDA context, NCCL and cuBLAS workspaces,
not validated here; 0 for the CPU validation, which counts tensors only).

Not modelled: torch.compile (inductor's partitioner usually saves less), context parallelism's exchange buffers,
allocator fragmentation, Float8's transient casts (torchao saves the high-precision tensors for backward, so
activations are those of bf16). With a fused RMSNorm kernel (CUDA) each norm may keep one fp32 [T, d] tensor fewer.

Validation (--validate, tests/unit/test_estimate_memory.py): the real Trainer on this CPU, one process. The
measured figure is torch's own accounting of tensor memory: tensors alive at the start of the second step
(parameters, buffers, optimizer state) plus the highest running total of the CPU allocations and frees that the
profiler records during that step. Peak RSS is also shown, as its increase over the RSS before the Trainer is
built (measured in a step without the profiler): it adds what is not a tensor (the tokenizer and corpus, lazily
loaded libraries, gloo's buffers, memory glibc keeps after a free), 75-200 MiB over the tensor peak here, more
with bigger batches and more processes, so it is reported but not used for the check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Running `python scripts/estimate_memory.py` puts scripts/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from torchtitan.components.float8 import float8_enabled  # noqa: E402
from torchtitan.config import JobConfig, parse_args  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.distributed.pipeline_parallel import plan_pipeline  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import TransformerModelArgs, model_args_for, shape_overrides  # noqa: E402
from torchtitan.models.llama3.model import CPU_BF16_ATTENTION_MIN_HEAD_DIM, Transformer  # noqa: E402
from torchtitan.models.llama3.pipeline import stage_ids_for_rank  # noqa: E402

GIB = 2**30
MIB = 2**20
GPU_OVERHEAD_GIB = 2.0
# Schedules that keep every micro-batch's activations until the backward starts.
_ALL_IN_FLIGHT_SCHEDULES = ("GPipe", "LoopedBFS")


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank at the peak, by component; `phase` names the moment of the step that sets the peak."""

    parameters: int
    optimizer: int
    gradients: int
    activations: int
    transient: int
    buffers: int
    overhead: int
    phase: str
    rank: int

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer + self.gradients + self.activations + self.transient
                + self.buffers + self.overhead)


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


def estimate(config: JobConfig, ngpu: int, overhead_bytes: int = 0, device: str = "cuda") -> Estimate:
    """The peak over the pipeline ranks (every rank of a pipeline stage group holds the same) on `device` devices
    ("cuda" or "cpu": attention saves different tensors on each)."""
    dims = ParallelDims.from_config(config.parallelism, ngpu)
    args = model_args_for(config.model.flavor, config.training.seq_len, overrides=shape_overrides(config.model))
    stages_of_rank, in_flight = _pipeline_layout(config, args, dims)
    estimates = [_estimate_rank(config, args, dims, rank, stages, in_flight, overhead_bytes, device)
                 for rank, stages in enumerate(stages_of_rank)]
    return max(estimates, key=lambda e: e.total)


def _pipeline_layout(config: JobConfig, args: TransformerModelArgs, dims: ParallelDims):
    """Per pipeline rank, its stages as (blocks, has embedding, has head); and in_flight(rank, stage index), the
    micro-batches whose activations a stage holds at once."""
    if dims.pp == 1:
        return [[(args.n_layers, True, True)]], lambda rank, stage_index: 1
    with torch.device("meta"):
        model = Transformer(args)
    plan = plan_pipeline(model, dims.pp, config)
    stages = []
    for names in plan.stage_names:
        blocks = sum(name.startswith("layers.") for name in names)
        stages.append((blocks, "tok_embeddings" in names, "output" in names))
    per_rank = [[stages[s] for s in stage_ids_for_rank(r, dims.pp, plan.num_stages, plan.v_shaped)]
                for r in range(dims.pp)]
    n_mb, pp, v = plan.n_microbatches, dims.pp, plan.num_stages // dims.pp

    def in_flight(rank: int, stage_index: int) -> float:
        if plan.schedule_name in _ALL_IN_FLIGHT_SCHEDULES:
            return n_mb
        if not plan.multi_stage:
            return min(n_mb, pp - rank)
        # Interleaved 1F1B's warm-up on this rank, in stage-micro-batches, spread over its v stages.
        warmup = (v - 1) * pp + 2 * (pp - 1 - rank) + 1
        return min(n_mb, warmup / v)

    return per_rank, in_flight


def _attention_bytes(s: _Shapes, t: int, a: int, device: str) -> tuple[float, float]:
    """Bytes per token that attention saves for backward, and those of SDPA's output alone (model.causal_attention
    chooses the path; see the module docstring)."""
    if device != "cpu":
        return 4 * s.q / t * a, s.q / t * a
    if a == 2 and s.head_dim < CPU_BF16_ATTENTION_MIN_HEAD_DIM:
        return (2 * s.q + 2 * s.kv) / t * 4 + s.q / t * a, s.q / t * 4
    return (2 * s.q + 2 * s.kv) / t * a, s.q / t * a


def _block_activations(s: _Shapes, tokens: float, t: int, a: int, r: int, autocast: bool, mode: str,
                       device: str) -> float:
    """Bytes one block saves for backward for one micro-batch of `tokens` tokens (see the module docstring)."""
    sp = tokens / t
    attention, sdpa_output = _attention_bytes(s, t, a, device)
    if mode == "full":
        return sp * s.d * r
    if mode == "op":
        saved = (a * tokens * ((s.q + 2 * s.kv) / t + 2 * s.d + 2 * s.f / t) + tokens * sdpa_output
                 + tokens * s.n_heads / t * 4)
        return sp * s.d * r + saved + (2 * sp * s.d * a if t > 1 else 0)
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
                   stages: list[tuple[int, bool, bool]], in_flight, overhead: int, device: str) -> Estimate:
    s = _Shapes.of(args)
    t, fsdp = dims.tp, dims.dp_shard * dims.cp
    a = 2 if config.training.mixed_precision_param == "bfloat16" else 4
    wrapped = dims.fsdp_enabled or dims.ddp_enabled
    autocast = not wrapped and a != 4
    residual = a if wrapped else 4
    microbatch = config.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else \
        config.training.local_batch_size
    tokens = microbatch * config.training.seq_len / dims.cp

    block_params = s.block_matmul_params() / t + 2 * s.d
    head_params = s.vocab * s.d / t + s.d
    block_copies = s.block_matmul_params() / t * 2 if autocast else 0.0
    none = _block_activations(s, tokens, t, a, residual, autocast, "none", device)
    # Per block of the rank, in forward order: (saved bytes for its in-flight micro-batches, bytes rebuilt and
    # alive during its backward, autocast copies it keeps for backward).
    blocks: list[tuple[float, float, float]] = []
    params = head_activations = head_copies = 0.0
    has_head = False
    for stage_index, (n_blocks, has_embedding, stage_has_head) in enumerate(stages):
        mbs = in_flight(rank, stage_index)
        params += n_blocks * block_params + (s.vocab * s.d / t if has_embedding else 0.0)
        for mode in _ac_modes(config, n_blocks):
            saved = mbs * _block_activations(s, tokens, t, a, residual, autocast, mode, device)
            rebuilt = none + block_copies if mode != "none" else 0.0
            # Autocast's cache hands every micro-batch the same copy of a weight.
            blocks.append((saved, rebuilt, block_copies if mode == "none" else 0.0))
        if stage_has_head:
            has_head = True
            params += head_params
            head_activations += mbs * (tokens / t * s.d * 8 + tokens * s.d * a)
            head_copies += s.vocab * s.d / t * 2 if autocast else 0.0

    sharded = params / fsdp
    parameters, optimizer, gradients = 4 * sharded, 8 * sharded, 4 * sharded
    accumulating = dims.pp > 1 or config.training.global_batch_size > config.training.local_batch_size * dims.dp
    resident_grads = gradients if accumulating else 0.0
    activations = sum(b[0] for b in blocks) + head_activations
    saved_copies = sum(b[2] for b in blocks) + head_copies

    if wrapped:
        gather = 1 if float8_enabled(config) and config.quantize.linear.float8.enable_fsdp_float8_all_gather else a
        forward_buffers = (2 * block_params + (head_params if has_head else 0.0)) * gather
        backward_buffers = forward_buffers + block_params * (a + (4 if a != 4 else 0))
        forward_copies = 0.0
    else:
        forward_buffers = backward_buffers = 0.0
        forward_copies = len(blocks) * block_copies + head_copies

    loss_parallel = t > 1 and not config.parallelism.disable_loss_parallel
    logits = tokens * s.vocab / (t if loss_parallel else 1) if has_head else 0.0
    # Measured: torch's loss-parallel log-softmax keeps two more fp32 copies of the logits shard.
    loss_parallel_extra = 8 * logits if loss_parallel else 0.0
    phases = {
        "end of forward": (activations, logits * (a + 8 if a != 4 else 8) + loss_parallel_extra,
                           forward_buffers + forward_copies, resident_grads),
        "loss backward": (activations, logits * 12 + loss_parallel_extra, forward_buffers + saved_copies,
                          resident_grads),
        "optimizer step": (0.0, 4 * sharded if config.optimizer.implementation == "foreach" else 0.0, 0.0,
                           gradients),
    }
    # Backward walks the blocks from the last: the blocks before it still hold their activations, those after
    # it already hold their gradients; a checkpointed block rebuilds its activations.
    grads_after = (head_params * 4 / fsdp) if has_head else 0.0
    for index in reversed(range(len(blocks))):
        saved_before = sum(b[0] for b in blocks[:index + 1])
        copies_before = sum(b[2] for b in blocks[:index + 1])
        transient = blocks[index][1] + 2 * tokens * s.f / t * a
        phase = (saved_before, transient, backward_buffers + copies_before, max(resident_grads, grads_after))
        if sum(phase) > sum(phases.get("block backward", (0.0,))):
            phases["block backward"] = phase
        grads_after += block_params * 4 / fsdp
    phase, (acts, transient, buffers, grads) = max(phases.items(), key=lambda item: sum(item[1]))
    return Estimate(parameters=round(parameters), optimizer=round(optimizer), gradients=round(grads),
                    activations=round(acts), transient=round(transient), buffers=round(buffers), overhead=overhead,
                    phase=phase, rank=rank)


# ------------------------------------------------------------------------------------------------------------------
# Measurement on this CPU


def measure(trainer_argv: list[str]) -> dict[str, float]:
    """Peak bytes of a training step of the real Trainer in this process (see the module docstring).

    Returns `tensor_peak` (torch's accounting, from the third step), `resident` (the part of it that was alive
    before that step: parameters, buffers, optimizer state) and `rss_increase` (peak RSS during the second step,
    which runs without the profiler and its event buffers, minus the RSS before the Trainer was built).
    """
    from torch.profiler import ProfilerActivity, profile

    from torchtitan.tools.device_info import memory_stats, reset_peak_memory
    from torchtitan.train import Trainer

    cpu = torch.device("cpu")
    gc.collect()
    baseline_rss = memory_stats(cpu)["rss_gib"] * GIB
    with tempfile.TemporaryDirectory(prefix="estimate-memory-") as dump_folder:
        # A configured peak skips the start-up matmul measurement, which is irrelevant here.
        config = parse_args([*trainer_argv, "--job.dump_folder", dump_folder, "--metrics.peak_flops", "1e12",
                             "--validation.no_enable", "--checkpoint.no_enable"])
        trainer = Trainer(config)
        try:
            data_iterator = iter(trainer.dataloader)
            trainer.train_step(trainer._next_batches(data_iterator))
            batches = trainer._next_batches(data_iterator)
            reset_peak_memory(cpu)
            trainer.train_step(batches)
            peak_rss = memory_stats(cpu)["max_rss_gib"] * GIB
            # Frees the gradients now, so that every free inside the profiled step is of a tensor the profiler
            # saw allocated.
            trainer.optimizers.zero_grad()
            gc.collect()
            resident = _resident_bytes(trainer)
            batches = trainer._next_batches(data_iterator)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
                trainer.train_step(batches)
        finally:
            trainer.metrics.close()
            trainer.close()
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = highest = 0
    for _, nbytes in events:
        running += nbytes
        highest = max(highest, running)
    return {"tensor_peak": resident + highest, "resident": resident, "rss_increase": peak_rss - baseline_rss}


def _resident_bytes(trainer) -> int:
    storages: dict[int, int] = {}

    def add(tensor: torch.Tensor) -> None:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for part in trainer.model_parts:
        for tensor in (*part.parameters(), *part.buffers()):
            add(tensor)
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add(value)
    return sum(storages.values())


# ------------------------------------------------------------------------------------------------------------------
# Command line

# (name, TOML, devices, overrides): the published recipes, and variants that show what does not fit.
PRESETS = [
    ("8B FSDP 8, AC op", "llama3_8b.toml", 8, []),
    ("8B FSDP 8, AC none", "llama3_8b.toml", 8, ["--activation_checkpoint.mode", "none"]),
    ("8B FSDP 8, AC full, batch 4", "llama3_8b.toml", 8, ["--activation_checkpoint.mode", "full",
                                                          "--training.local_batch_size", "4"]),
    ("70B FSDP 8 x TP 8, AC full", "llama3_70b.toml", 64, []),
    ("70B FSDP 8, AC full, batch 1", "llama3_70b.toml", 8, ["--parallelism.tensor_parallel_degree", "1",
                                                            "--training.local_batch_size", "1"]),
    ("70B FSDP 8 x TP 8, AC none", "llama3_70b.toml", 64, ["--activation_checkpoint.mode", "none"]),
    ("405B FSDP 2 x TP 8 x PP 8, AC full", "llama3_405b.toml", 128, []),
    ("405B FSDP 4 x TP 8 x PP 8, AC full", "llama3_405b.toml", 256, []),
    ("405B FSDP 16 x TP 8, AC full, batch 1", "llama3_405b.toml", 128, [
        "--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "1"]),
]

def _debug(seq_len: int, batch: int, dtype: str, ac: str, *parallel: str) -> list[str]:
    mode, option = {"none": ("none", "2"), "full": ("full", "2"), "op": ("selective", "op")}.get(ac, ("selective", ac))
    return ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
            "--training.mixed_precision_param", dtype, "--activation_checkpoint.mode", mode,
            "--activation_checkpoint.selective_ac_option", option, *parallel]


# Small configs of the debug model measured on this CPU: (name, processes, trainer options).
VALIDATION = [
    ("seq 256 batch 4 fp32, AC none", 1, _debug(256, 4, "float32", "none")),
    ("seq 512 batch 2 fp32, AC full", 1, _debug(512, 2, "float32", "full")),
    ("seq 512 batch 4 bf16, AC none", 1, _debug(512, 4, "bfloat16", "none")),
    ("seq 256 batch 8 bf16, AC full", 1, _debug(256, 8, "bfloat16", "full")),
    ("seq 256 batch 8 bf16, AC op", 1, _debug(256, 8, "bfloat16", "op")),
    ("seq 512 batch 4 fp32, AC every 2", 1, _debug(512, 4, "float32", "2")),
    ("seq 512 batch 4 bf16, AC none, FSDP 2", 2, _debug(512, 4, "bfloat16", "none",
                                                         "--parallelism.data_parallel_shard_degree", "2")),
    ("seq 512 batch 4 fp32, AC full, FSDP 2", 2, _debug(512, 4, "float32", "full",
                                                         "--parallelism.data_parallel_shard_degree", "2")),
    ("seq 512 batch 4 bf16, AC none, TP 2", 2, _debug(512, 4, "bfloat16", "none",
                                                       "--parallelism.tensor_parallel_degree", "2")),
    ("seq 512 batch 4 bf16, AC op, TP 2", 2, _debug(512, 4, "bfloat16", "op",
                                                     "--parallelism.tensor_parallel_degree", "2")),
]
CONFIGS = Path(__file__).resolve().parent.parent / "train_configs"
DEBUG_TOML = ["--job.config_file", str(CONFIGS / "debug_model.toml")]

_SHORTHANDS = {"flavor": "model.flavor", "seq_len": "training.seq_len", "local_batch_size": "training.local_batch_size",
               "tp": "parallelism.tensor_parallel_degree", "pp": "parallelism.pipeline_parallel_degree",
               "cp": "parallelism.context_parallel_degree", "dp_shard": "parallelism.data_parallel_shard_degree",
               "dp_replicate": "parallelism.data_parallel_replicate_degree"}


def _trainer_argv(args: argparse.Namespace, rest: list[str]) -> list[str]:
    argv = list(rest)
    for name, option in _SHORTHANDS.items():
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{option}", str(value)]
    if args.ac is not None:
        mode, option = {"none": ("none", None), "full": ("full", None), "op": ("selective", "op")}.get(
            args.ac, ("selective", args.ac))
        argv += ["--activation_checkpoint.mode", mode]
        if option is not None:
            argv += ["--activation_checkpoint.selective_ac_option", option]
    return argv


def _row(name: str, e: Estimate, device_gib: float) -> str:
    flag = "EXCEEDS" if e.total > device_gib * GIB else "fits"
    return (f"{name:<50} {e.parameters / GIB:7.1f} {e.optimizer / GIB:7.1f} {e.gradients / GIB:6.1f} "
            f"{e.activations / GIB:7.1f} {e.transient / GIB:7.1f} {e.buffers / GIB:6.1f} {e.overhead / GIB:5.1f} "
            f"{e.total / GIB:7.1f}  {flag:<7} {e.phase}")


_HEADER = (f"{'GiB per device':<50} {'params':>7} {'optim':>7} {'grads':>6} {'activ':>7} {'transnt':>7} "
           f"{'buffer':>6} {'ovhd':>5} {'total':>7}  {'80 GiB':<7} peak at")


def presets_table(device_gib: float, overhead_gib: float) -> str:
    lines = [_HEADER]
    for name, toml, ngpu, overrides in PRESETS:
        config = parse_args(["--job.config_file", str(CONFIGS / toml), *overrides])
        lines.append(_row(f"{name} ({ngpu} GPUs)", estimate(config, ngpu, round(overhead_gib * GIB)), device_gib))
    return "\n".join(lines)


def validation_table() -> str:
    """Each config in fresh processes (one thread each), so that the RSS baseline is that of a new process."""
    lines = [f"{'debugmodel, CPU':<40} {'estimate':>9} {'measured':>9} {'error':>7} {'RSS incr.':>10}"]
    for name, nproc, overrides in VALIDATION:
        argv = [*DEBUG_TOML, *overrides]
        predicted = estimate(parse_args(argv), nproc, device="cpu").total
        measured = _measure_in_new_processes(argv, nproc)
        error = 100 * (predicted / measured["tensor_peak"] - 1)
        lines.append(f"{name:<40} {predicted / MIB:7.1f}Mi {measured['tensor_peak'] / MIB:7.1f}Mi {error:+6.1f}% "
                     f"{measured['rss_increase'] / MIB:8.1f}Mi")
    return "\n".join(lines)


def _measure_in_new_processes(trainer_argv: list[str], nproc: int) -> dict[str, float]:
    """The largest figures over the ranks of `--measure` runs (torchrun for more than one process)."""
    script = [str(Path(__file__).resolve()), "--measure", *trainer_argv]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                                                   "--rdzv-endpoint=localhost:0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, *script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or len(rows) != nproc:
        raise RuntimeError(f"measuring {trainer_argv} failed:\n{proc.stdout[-4000:]}")
    return {key: max(row[key] for row in rows) for key in rows[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--ngpu", type=int, default=None, help="devices (world size); default: the presets table")
    parser.add_argument("--device_memory_gib", type=float, default=80.0, help="memory of one device (H100: 80)")
    parser.add_argument("--overhead_gib", type=float, default=None,
                        help=f"fixed overhead per device (default {GPU_OVERHEAD_GIB} GiB; 0 with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="a CPU run: no CUDA context, no NCCL buffers")
    parser.add_argument("--validate", action="store_true", help="compare with measurements on this CPU")
    parser.add_argument("--measure", action="store_true",
                        help="measure the trainer options given (one line of JSON per rank; used by --validate)")
    for name in _SHORTHANDS:
        parser.add_argument(f"--{name}", default=None)
    parser.add_argument("--ac", default=None, help="activation checkpointing: none, full, op or N")
    parser.add_argument("--estimate-help", action="help", help="this help (--help lists the trainer's options)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    overhead_gib = args.overhead_gib if args.overhead_gib is not None else (0.0 if args.cpu else GPU_OVERHEAD_GIB)
    try:
        if args.validate:
            print(validation_table())
            return 0
        trainer_argv = _trainer_argv(args, rest)
        if args.measure:
            print(json.dumps(measure(trainer_argv)), flush=True)
            return 0
        if args.ngpu is None and not trainer_argv:
            print(presets_table(args.device_memory_gib, overhead_gib))
            return 0
        config = parse_args(trainer_argv)
        result = estimate(config, args.ngpu or 1, round(overhead_gib * GIB), "cpu" if args.cpu else "cuda")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_HEADER)
    print(_row(f"{config.model.flavor} on {args.ngpu or 1} device(s)", result, args.device_memory_gib))
    for field in dataclasses.fields(Estimate):
        value = getattr(result, field.name)
        print(f"  {field.name:<12} {value / GIB:10.3f} GiB" if isinstance(value, int) and field.name != "rank"
              else f"  {field.name:<12} {value}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
