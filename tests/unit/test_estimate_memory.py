"""scripts/estimate_memory.py: the analytic peak against torch's accounting of a real training step, and the
properties any memory model must have (sharding divides the state, checkpointing shrinks activations)."""

import pytest

from scripts import estimate_memory
from scripts.estimate_memory import CONFIGS, DEBUG_TOML, GIB, estimate, measure
from torchtitan.config import parse_args
from torchtitan.planner.hardware import GPUS

# Small enough to measure in a few seconds; the two dtypes and AC modes exercise different saved-tensor sets.
MEASURED = [
    ("seq256_fp32_none", ["--training.seq_len", "256", "--training.local_batch_size", "4",
                          "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"]),
    ("seq512_fp32_full", ["--training.seq_len", "512", "--training.local_batch_size", "2",
                          "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "full"]),
    ("seq512_bf16_none", ["--training.seq_len", "512", "--training.local_batch_size", "2",
                          "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "none"]),
]


def config(*overrides: str):
    return parse_args([*DEBUG_TOML, *overrides])


def preset(toml: str, *overrides: str):
    return parse_args(["--job.config_file", str(CONFIGS / toml), *overrides])


@pytest.mark.parametrize("overrides", [m[1] for m in MEASURED], ids=[m[0] for m in MEASURED])
def test_estimate_within_15_percent_of_measured_peak(overrides):
    measured = measure([*DEBUG_TOML, *overrides])["tensor_peak"]
    predicted = estimate(config(*overrides), 1, device="cpu").total
    assert abs(predicted / measured - 1) <= 0.15, f"estimated {predicted / 2**20:.1f} MiB, measured " \
                                                  f"{measured / 2**20:.1f} MiB"


@pytest.mark.slow
def test_compiled_estimate_within_5_percent_of_measured_peak():
    """Compiled blocks and loss save less than eager ones (inductor recomputes the norms and SiLU, the fused loss
    keeps no fp32 copy of the logits); a vocabulary of 32,768 makes the loss the peak, as in the presets. The
    eager-bound estimate is 70% high here."""
    overrides = ["--training.seq_len", "256", "--training.local_batch_size", "4", "--model.n_layers", "2",
                 "--model.vocab_size", "32768", "--training.mixed_precision_param", "bfloat16",
                 "--activation_checkpoint.mode", "none", "--compile.enable"]
    measured = measure([*DEBUG_TOML, *overrides])["tensor_peak"]
    predicted = estimate(config(*overrides), 1, device="cpu").total
    eager = estimate(config(*overrides, "--compile.no_enable"), 1, device="cpu").total
    assert abs(predicted / measured - 1) <= 0.05, f"estimated {predicted / 2**20:.1f} MiB, measured " \
                                                  f"{measured / 2**20:.1f} MiB"
    assert eager > 1.3 * measured


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("name", ["AdamW", "GaLore-AdamW"])
def test_fsdp_divides_parameter_state(n, name):
    """GaLore too: a rank keeps 1/n of each matrix's moments and projector, not the state of a matrix shaped like
    its shard."""
    whole = estimate(preset("llama3_8b.toml", "--parallelism.data_parallel_shard_degree", "1",
                            "--optimizer.name", name), 1)
    sharded = estimate(preset("llama3_8b.toml", "--parallelism.data_parallel_shard_degree", str(n),
                              "--optimizer.name", name), n)
    for part in ("parameters", "optimizer"):
        assert getattr(sharded, part) == pytest.approx(getattr(whole, part) / n, rel=1e-6)


@pytest.mark.parametrize("name, ratio", [("Adam", 1.0), ("AdamW-bf16", 0.5), ("AdamW-8bit", 0.254), ("Ranger21", 2.0),
                                         ("Muon", 0.565), ("GaLore-AdamW", 0.391)])
def test_optimizer_state_follows_the_registered_method(name, ratio):
    """8B on FSDP 8: the optimizer term is the method's state bytes (8-bit: codes, a scale per 256 values and a
    256-entry code book per moment), the rest of the estimate unchanged."""
    adamw = estimate(preset("llama3_8b.toml"), 8)
    other = estimate(preset("llama3_8b.toml", "--optimizer.name", name), 8)
    assert other.optimizer / adamw.optimizer == pytest.approx(ratio, abs=1e-3)
    assert (other.parameters, other.gradients, other.activations) == (adamw.parameters, adamw.gradients,
                                                                      adamw.activations)


@pytest.mark.slow  # torchao compiles its step: about 25 s on 2 cores
def test_measured_optimizer_state_counts_quantized_codes():
    """The measured side counts torchao's 8-bit state by its codes and scales, not as fp32 tensors: resident state
    is fp32 weights (4 bytes per parameter) and the moments, 8 bytes with AdamW, about 2 with 8-bit (ratio ~0.5;
    counted as fp32 tensors it would be 1)."""
    measured = {name: measure([*DEBUG_TOML, "--training.seq_len", "64", "--training.local_batch_size", "1",
                               "--optimizer.name", name])["resident"] for name in ("AdamW", "AdamW-8bit")}
    assert measured["AdamW-8bit"] / measured["AdamW"] < 0.6


def test_tensor_parallel_divides_matrices_and_activations():
    base = ["--activation_checkpoint.mode", "none", "--parallelism.data_parallel_shard_degree", "8"]
    alone = estimate(preset("llama3_70b.toml", *base, "--parallelism.tensor_parallel_degree", "1"), 8)
    tp = estimate(preset("llama3_70b.toml", *base, "--parallelism.tensor_parallel_degree", "8"), 64)
    # Norm weights are replicated over TP and the block inputs of linears are gathered: a little more than 1/8.
    assert alone.parameters / 8 < tp.parameters < alone.parameters / 7.9
    assert alone.activations / 8 < tp.activations < alone.activations / 4


def test_full_checkpointing_cuts_activations():
    none = estimate(config("--activation_checkpoint.mode", "none"), 1)
    full = estimate(config("--activation_checkpoint.mode", "full"), 1)
    per_op = estimate(config("--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"), 1)
    assert full.activations < none.activations / 4
    assert full.total < per_op.total < none.total


def test_longer_sequences_cost_activation_memory_linearly():
    short = estimate(preset("llama3_8b.toml", "--training.seq_len", "4096"), 8)
    long = estimate(preset("llama3_8b.toml", "--training.seq_len", "8192"), 8)
    assert long.activations == pytest.approx(2 * short.activations, rel=1e-3)
    assert long.parameters == short.parameters


def test_presets_table_flags_layouts_over_80_gib():
    lines = {line.split(" (")[0]: line for line in estimate_memory.presets_table(GPUS["h100"]).splitlines()[1:]}
    assert "EXCEEDS" in lines["70B FSDP 8 x TP 8, AC none"]
    assert "fits" in lines["8B FSDP 8, AC op"]
    # 74 GiB of tensors on 128 GPUs leave no room for the allocator's reserve (15.5% of them), the CUDA context
    # and NCCL's buffers on an 80 GB H100; on 256 GPUs the shards halve.
    assert "EXCEEDS" in lines["405B FSDP 2 x TP 8 x PP 8, AC full"]
    assert "fits" in lines["405B FSDP 4 x TP 8 x PP 8, AC full"]
    over = estimate(preset("llama3_70b.toml", "--activation_checkpoint.mode", "none"), 64)
    assert over.total > 80 * GIB


def test_headroom_is_the_planners_and_the_dry_runs():
    """estimate_memory adds to the tensors what the planner and the dry run's out-of-memory verdict add
    (hardware.headroom): the allocator's reserve, the CUDA context, NCCL's buffers per communicator; on the CPU
    nothing."""
    from torchtitan.planner.hardware import CUDA_CONTEXT_GIB, NCCL_COMMUNICATOR_GIB, headroom
    from torchtitan.planner.search import layout_from_config, predict

    config, gpu = preset("llama3_70b.toml"), GPUS["h100"]
    tensors = estimate(config, 64).total
    extra = estimate_memory.device_headroom(config, 64, tensors, gpu)
    # FSDP 8 x TP 8: the world's communicator, TP's and FSDP's.
    assert extra == headroom(tensors / GIB, gpu, {"dp_shard": 8, "tp": 8})
    assert extra.total_gib == pytest.approx(tensors / GIB * 0.155 + CUDA_CONTEXT_GIB + 3 * NCCL_COMMUNICATOR_GIB)
    planned = predict("70B", layout_from_config(config, 64), config.training.seq_len, gpu, config=config)
    assert tensors / GIB + extra.total_gib == pytest.approx(planned.device_memory_gib)
    assert estimate_memory.device_headroom(config, 64, tensors, None).total_gib == 0.0


# The dry run's trace against the real run's measured tensor peak, per layout (one process, FSDP 2, TP 2, PP 2,
# CP 2, rotated tensor parallelism 2).
LAYOUTS = [
    ("one_process", 1, []),
    ("fsdp2", 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2"]),
    ("cp2", 2, ["--parallelism.context_parallel_degree", "2"]),
    ("rtp2", 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_shard_method",
                 "rotated"]),
]


# Each case measures a real run and traces it (20-70 s here): one process runs by default, the layouts (RTP's trace
# is also covered by tests/unit/test_rotated.py's fake-tensor test) with the slow ones.
@pytest.mark.parametrize("nproc, layout", [pytest.param(n, args, id=name,
                                                        marks=[pytest.mark.slow] * (name != "one_process"))
                                           for name, n, args in LAYOUTS])
def test_dry_run_within_10_percent_of_measured_peak(nproc, layout):
    argv = [*DEBUG_TOML, "--training.seq_len", "256", "--training.local_batch_size", "4",
            "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "none", *layout]
    measured = estimate_memory._measure_in_new_processes(argv, nproc)["tensor_peak"]
    traced = estimate_memory.traced_peak(argv, nproc, device="cpu")
    assert abs(traced / measured - 1) <= 0.10, f"dry run {traced / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"


@pytest.mark.parametrize("schedule, ac", [pytest.param("GPipe", "full", marks=pytest.mark.slow),
                                          pytest.param("ZBVZeroBubble", "none", marks=pytest.mark.slow),
                                          pytest.param("InterleavedZeroBubble", "none", marks=pytest.mark.slow)])
def test_pipeline_schedules_within_10_percent_of_measured_peak(schedule, ac):
    """Schedules that hold many micro-batches where 1F1B holds one: GPipe runs every forward first, so its last
    stage keeps each micro-batch's logits (the stage's output) and loss (the fp32 log-softmax) until its backward,
    under full AC too; the zero-bubble schedules keep
    each micro-batch's activations (and loss) until its weight pass, and the model reads how many from torch's
    action list. Eight micro-batches on PP 2, real processes, torch's own accounting (the dry run cannot trace a
    split backward). Before: GPipe with full AC -12.2% (one micro-batch's logits and loss counted), ZBVZeroBubble
    -15.5% and InterleavedZeroBubble -15.3% (Interleaved1F1B's warm-up formula, which gave their last rank about
    half its micro-batches)."""
    argv = [*DEBUG_TOML, "--training.seq_len", "512", "--training.local_batch_size", "8",
            "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", ac,
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--parallelism.pipeline_parallel_schedule", schedule]
    measured = estimate_memory._measure_in_new_processes(argv, 2)["tensor_peak"]
    predicted = estimate(parse_args(argv), 2, device="cpu").total
    assert abs(predicted / measured - 1) <= 0.10, f"model {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f}"


# Layouts where the analytic model once disagreed with the trace: loss parallel's log-softmax (one extra fp32 copy
# of the logits shard, not two), a pipeline under FSDP (unsharded fp32 gradients accumulate until the last
# micro-batch's backward) and eager Float8 under TP; and CP, whose trace measured a twice-sharded batch until each
# dry-run step got a batch of its own.
ANALYTIC_AGAINST_TRACE = [
    ("tp2_loss_parallel", ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                           "2", "--activation_checkpoint.mode", "full", "--model.vocab_size", "32768"]),
    ("pp2_fsdp2", ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                   "--activation_checkpoint.mode", "full", "--parallelism.pipeline_parallel_microbatch_size", "1"]),
    # Eager Float8 under TP: the whole-sequence output gradient's cast passes through two fp32 copies.
    ("tp2_float8_eager", ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                          "2", "--activation_checkpoint.mode", "full", "--model.converters", "quantize.linear.float8",
                          "--model.dim", "1024", "--model.n_heads", "16", "--model.n_layers", "2",
                          "--training.local_batch_size", "16"]),
    ("cp2_tp2", ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                 "--activation_checkpoint.mode", "none"]),
    # Rotated tensor parallelism: no gathered block, a block's shards and gradient buffers in flight in its backward
    # (planner/rotated.py); measured 0.13% below the trace.
    ("rtp4_full", ["--activation_checkpoint.mode", "full", "--parallelism.data_parallel_shard_method", "rotated"]),
]
SLOW_ANALYTIC = {"rtp4_full", "pp2_fsdp2", "tp2_loss_parallel", "cp2_tp2"}


@pytest.mark.parametrize("layout", [pytest.param(args, id=name, marks=[pytest.mark.slow] * (name in SLOW_ANALYTIC))
                                    for name, args in ANALYTIC_AGAINST_TRACE])
def test_analytic_estimate_within_5_percent_of_the_trace(layout):
    argv = [*DEBUG_TOML, "--training.seq_len", "256", "--training.local_batch_size", "4", *layout]
    traced = estimate_memory.traced_peak(argv, 4)
    predicted = estimate(parse_args(argv), 4).total
    assert abs(predicted / traced - 1) <= 0.05, f"analytic {predicted / 2**20:.1f} MiB, traced {traced / 2**20:.1f} MiB"


# Each case traces torchao's Float8 block through dynamo, about 45 s here: both run with the slow ones (the default
# suite reads the partitioned graphs of a compiled Float8 linear in tests/unit/test_planner.py).
@pytest.mark.parametrize("ac", [pytest.param("none", marks=pytest.mark.slow), pytest.param("op", marks=pytest.mark.slow)])
def test_compiled_float8_block_saves_what_the_model_says(ac):
    """Inductor recomputes torchao's Float8 casts, and with them the norms' outputs, instead of saving them; under
    per-op AC it saves only the policy's tensors that backward reads (not w2's output). One compiled block with bf16
    parameters (as under FSDP), counted with saved-tensor hooks."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from torchtitan.distributed.activation_checkpoint import _per_op_contexts
    from torchtitan.models.llama3.args import TransformerModelArgs
    from torchtitan.models.llama3.model import TransformerBlock, rope_table
    from torchtitan.planner.memory import _block_activations, _Shapes

    args = TransformerModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=256)
    block = TransformerBlock(0, args).to(torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig())
    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    if ac == "op":
        block = checkpoint_wrapper(block, context_fn=_per_op_contexts, preserve_rng_state=False)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 256, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    # The first call compiles the forward graph as AOT autograd partitions it against the backward: what it saves
    # is decided there, so no backward needs to run (that would compile a second graph, half of this test's time).
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compiled(x, rope_table(args))
    rope = rope_table(args).untyped_storage().nbytes()
    predicted = _block_activations(_Shapes.of(args), 512, 256, 1, 2, 2, False, ac, "cpu", compiled=True,
                                   float8=True)
    assert sum(saved.values()) - rope == pytest.approx(predicted, rel=0.01)
