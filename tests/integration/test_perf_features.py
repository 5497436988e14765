"""Performance features keep the numerics: compile, activation checkpointing, Float8 (emulated) and bf16 autocast.

Numbers only, never timings. The reference is the tiny fp32 model in eager mode, one process, a global batch of 4
sequences of 32 tokens, 5 steps. Compiled kernels are cached under the repository's .cache/inductor (or
$TORCHINDUCTOR_CACHE_DIR), so only the first run pays the ~10-20 s of compilation.
"""

import os

import pytest

from scripts.estimate_memory import DEBUG_TOML, measure
from tests.integration.harness import REPO, TINY, launch, losses, max_relative_difference, read_metrics, train

pytestmark = pytest.mark.integration

STEPS = 5
GLOBAL_BATCH = 4
BASE = [*TINY, "--training.steps", str(STEPS)]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]
# The tiny model's 4 blocks x 7 linears; the output layer is filtered out (filter_fqns = output).
TINY_FLOAT8_LAYERS = 28
INDUCTOR_ENV = {"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                          str(REPO / ".cache" / "inductor"))}


def batch_args(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


def run(tmp_path, nproc: int, args: list[str], env: dict | None = None) -> tuple[str, list[float]]:
    """The trainer's console output and its losses; fails the test if it does not finish."""
    proc = launch(tmp_path, nproc, args, env=env)
    assert proc.returncode == 0, f"trainer exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout, losses(read_metrics(tmp_path))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return losses(train(tmp_path_factory.mktemp("eager"), 1, [*BASE, *batch_args(1)]))


COMPILE_LAYOUTS = {
    "alone": (1, 1, []),
    "fsdp2": (2, 2, FSDP2),
    "cp2": (2, 1, ["--parallelism.context_parallel_degree", "2"]),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    "ac_full": (1, 1, ["--activation_checkpoint.mode", "full"]),
}


# FSDP 2 by default (and in the smoke set); the others, 10-30 s each here, with the slow ones.
@pytest.mark.parametrize("layout", [pytest.param(layout, marks=pytest.mark.smoke) if layout == "fsdp2" else
                                    pytest.param(layout, marks=pytest.mark.slow)
                                    for layout in COMPILE_LAYOUTS])
def test_compile_matches_eager(tmp_path, reference, layout):
    """Every block and the loss compiled with inductor, alone, with FSDP, CP, PP and full AC: fusion reorders float
    operations, nothing more. (TP: the next test.)"""
    nproc, dp, options = COMPILE_LAYOUTS[layout]
    output, compiled = run(tmp_path, nproc, [*BASE, *batch_args(dp), *options, "--compile.enable"],
                           env={**INDUCTOR_ENV, "TORCH_LOGS": "dynamo"})
    # Dynamo logs each function it traces: the block's forward and the loss.
    assert "torchdynamo done tracing forward" in output
    assert "torchdynamo start tracing cross_entropy_sum" in output
    assert len(compiled) == STEPS
    assert max_relative_difference(compiled, reference) <= 1e-4


def test_compile_under_tensor_parallel(tmp_path, reference):
    """On the CPU, compiled TP blocks are one clear error (torch fails inside DTensor). The loss compiles under TP
    without loss parallelism, and stays eager under it (compiled, it gave wrong losses): both match eager."""
    blocks = launch(tmp_path / "blocks", 2, [*BASE, *batch_args(1), *TP2, "--compile.enable"])
    # torchrun itself exits 1 whatever its workers' code. Each worker logs the one error line, unless torchrun
    # stopped it first because the other had already exited with it.
    assert blocks.returncode != 0
    errors = [line for line in blocks.stdout.splitlines() if " ERROR error: " in line]
    assert 1 <= len(errors) <= 2, blocks.stdout[-4000:]
    assert all("option compile.enable with 'model' in compile.components: does not compose with "
               "tensor_parallel_degree > 1 on the CPU" in e for e in errors), errors
    loss_only = [*BASE, *batch_args(1), *TP2, "--compile.enable", "--compile.components", "loss"]
    output, eager_loss = run(tmp_path / "loss_parallel", 2, loss_only, env=INDUCTOR_ENV)
    assert "the loss runs eagerly under loss parallelism" in output
    assert max_relative_difference(eager_loss, reference) <= 1e-5
    output, compiled_loss = run(tmp_path / "no_loss_parallel", 2, [*loss_only, "--parallelism.disable_loss_parallel"],
                                env={**INDUCTOR_ENV, "TORCH_LOGS": "dynamo"})
    assert "torchdynamo start tracing cross_entropy_sum" in output
    assert max_relative_difference(compiled_loss, reference) <= 1e-4


@pytest.mark.parametrize("mode", [["full"], ["selective", "2"], ["selective", "op"]],
                         ids=["full", "selective2", "selective_op"])
def test_activation_checkpointing_keeps_losses(tmp_path, reference, mode):
    """Recomputation repeats the same fp32 kernels on the same inputs: the losses must not move."""
    args = [*BASE, *batch_args(1), "--activation_checkpoint.mode", mode[0]]
    if len(mode) > 1:
        args += ["--activation_checkpoint.selective_ac_option", mode[1]]
    checkpointed = losses(train(tmp_path, 1, args))
    assert max_relative_difference(checkpointed, reference) <= 1e-6


def test_full_checkpointing_halves_activation_memory():
    """Bytes a debug-model step allocates above the parameters and optimizer state, from torch's own accounting
    of CPU allocations (profiler), not from the clock or the RSS."""
    common = [*DEBUG_TOML, "--training.seq_len", "256", "--training.local_batch_size", "4",
              "--training.mixed_precision_param", "float32"]
    step_bytes = {}
    for mode in ("none", "full"):
        measured = measure([*common, "--activation_checkpoint.mode", mode])
        step_bytes[mode] = measured["tensor_peak"] - measured["resident"]
    assert step_bytes["full"] <= 0.5 * step_bytes["none"], step_bytes


@pytest.mark.parametrize("recipe,layout", [pytest.param("tensorwise", "fsdp2", marks=pytest.mark.smoke),
                                           ("rowwise", "tp2"),
                                           pytest.param("rowwise", "fsdp2", marks=pytest.mark.slow),
                                           pytest.param("tensorwise", "tp2", marks=pytest.mark.slow)])
def test_float8_emulated_distributed(tmp_path, reference, recipe, layout):
    """Float8 linears under FSDP 2 (tensorwise: with float8 all-gather and precomputed scales) and TP 2.

    On this tiny model emulated float8 moves the loss by about 1e-6 relative; 1e-4 leaves room for that and
    for the layouts' own rounding while catching a wrong scale or a lost gradient.
    """
    args = [*BASE, *FLOAT8, "--quantize.linear.float8.recipe_name", recipe]
    if layout == "fsdp2":
        args += [*batch_args(2), *FSDP2]
        if recipe == "tensorwise":
            args += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                     "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    else:
        args += [*batch_args(1), *TP2]
    output, float8 = run(tmp_path, 2, args)
    assert f"converted {TINY_FLOAT8_LAYERS} linear layers" in output
    assert max_relative_difference(float8, reference) <= 1e-4


# Two 50-step runs of the debug model: about 2 minutes on a 2-core CPU, so slow; the emulated float8 layouts above
# stay in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_emulated_close_to_bf16_over_50_steps(tmp_path, recipe):
    """The debug model as configured (train_configs/debug_model.toml: seq 256, batch 8, bf16): over 50 steps
    every step's loss of emulated float8 stays within 1% of the bf16 run's (measured: 0.14% tensorwise)."""
    args = [*DEBUG_TOML, "--training.steps", "50", "--debug.seed", "0", "--metrics.log_freq", "1",
            "--validation.no_enable", "--metrics.disable_color_printing"]
    bf16 = losses(train(tmp_path / "bf16", 1, args))
    _, float8 = run(tmp_path / "float8", 1, [*args, *FLOAT8, "--quantize.linear.float8.recipe_name", recipe])
    assert len(float8) == 50
    difference = max_relative_difference(float8, bf16)
    print(f"float8 {recipe} vs bf16 over 50 steps: max relative loss difference {difference:.2e}")
    assert difference <= 1e-2


def test_bf16_autocast_close_to_fp32(tmp_path, reference):
    """Without FSDP the trainer runs bf16 through autocast: different from fp32 (so bf16 was used), but by
    well under 1% over 5 steps."""
    bf16 = losses(train(tmp_path, 1, [*BASE, *batch_args(1), "--training.mixed_precision_param", "bfloat16"]))
    assert 0 < max_relative_difference(bf16, reference) <= 1e-2
