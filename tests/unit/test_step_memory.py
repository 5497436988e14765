"""The memory of the optimizer step, method by method: the planner's model (planner/memory.py, each optimizer's
registered `step_bytes`, gradient compression's state and temporaries) against the dry run's trace of a real step
on fake tensors (its peak of the optimizer step phase), on layouts where the step is the peak of the whole step.

Why the step is the peak here: a micro-batch of one 32-token sequence makes the activations a fraction of a MiB,
so the backward's peak is the persistent state plus every gradient, which the step holds too; the step's
temporaries (a foreach group's square roots, Muon's stacks, Ranger21's prepared gradients...) then put it on top.
Under FSDP the backward also holds one module's unsharded parameters and gradients and, with gradient compression,
its reduce-scatter's temporaries (about 20 bytes per value of the module's unsharded gradient): there the step must
outweigh them, which a step whose temporaries grow with the number of blocks (Ranger21's prepared gradients, 4 bytes
per local value; Muon's stacks of every block's matrix of one kind) does at 8 blocks of the debug model's 0.79M
values each. Each case also requires the step's counted temporaries to exceed the 10% tolerance, so a model that
leaves them out fails.

Error feedback is the exception: its backward holds the committed compensation state and the one the reductions
stage (4 bytes per unsharded value each, until the step commits the staged one), where the step holds one; a step
would need temporaries of more than 8 bytes per local value at FSDP 2 to overtake it, more than any optimizer here
allocates. Its case checks both the step's peak and the backward's (the whole step's) against the planner.

Each dry run is one process forked from the fork server (tests/unit/forked_ranks.py): a few seconds for one
process or a 2-block model, more for the 8-block FSDP models; the default suite runs one case per kind of step,
the slow suite the rest.
"""

import json
from pathlib import Path

import pytest

from scripts.estimate_memory import DEBUG_TOML
from tests.unit.forked_ranks import join_forked
from torchtitan.config import parse_args
from torchtitan.planner.memory import estimate

MIB = 2**20
TINY_BATCH = ["--training.seq_len", "32", "--training.local_batch_size", "1"]
FP32 = ["--training.mixed_precision_param", "float32"]
# One process: the output layer and embedding (32768 x 256, 8.4M values each) make AdamW's temporaries large.
ONE_PROCESS = (1, ["--model.n_layers", "2", "--model.vocab_size", "32768", *FP32])
# Muon's spread over TP's ranks: dim 1024 and a 256-token vocabulary, so that the stacks of the matrices (w1 of
# 4.2M values) and not the AdamW groups make the step's peak. On 2 ranks each kind's 2 matrices go one to a rank; on
# 4 ranks a kind has fewer matrices than ranks, and a rank stacks a whole matrix (4 slots of its quarter).
MUON_TP = ["--model.n_layers", "2", "--model.dim", "1024", "--model.vocab_size", "256", *FP32]
# FSDP 2 over 8 blocks (the compressed reduce-scatters need FSDP): see the module docstring.
FSDP_8_BLOCKS = ["--model.n_layers", "8", "--parallelism.data_parallel_shard_degree", "2"]

# One case per kind of step in the default suite (foreach groups, a for-loop, each method of its own); the other
# variants and the FSDP layouts run with the slow tests.
CASES = {
    "Adam_foreach": (*ONE_PROCESS, ["--optimizer.name", "Adam", "--optimizer.implementation", "foreach"]),
    "AdamW_for_loop": (*ONE_PROCESS, ["--optimizer.implementation", "for-loop"]),
    "AdamW-bf16": (*ONE_PROCESS, ["--optimizer.name", "AdamW-bf16"]),
    "GaLore-AdamW": (*ONE_PROCESS, ["--optimizer.name", "GaLore-AdamW"]),
    "Ranger21": (*ONE_PROCESS, ["--optimizer.name", "Ranger21"]),
    "Muon_tp4_whole_matrices": (4, MUON_TP, ["--optimizer.name", "Muon", "--parallelism.tensor_parallel_degree",
                                             "4"]),
    # DDP 2: FlexDeMo's replicas, each holding every gradient.
    "FlexDeMo": (2, ONE_PROCESS[1], ["--optimizer.name", "FlexDeMo", "--parallelism.data_parallel_replicate_degree",
                                     "2", "--parallelism.data_parallel_shard_degree", "1"]),
}
SLOW_CASES = {
    "AdamW_foreach": (*ONE_PROCESS, ["--optimizer.implementation", "foreach"]),
    "Adam_for_loop": (*ONE_PROCESS, ["--optimizer.name", "Adam", "--optimizer.implementation", "for-loop"]),
    "Muon_one_process": (1, MUON_TP, ["--optimizer.name", "Muon"]),
    "Muon_tp2": (2, MUON_TP, ["--optimizer.name", "Muon", "--parallelism.tensor_parallel_degree", "2"]),
    "Muon_fsdp2": (2, FSDP_8_BLOCKS, ["--optimizer.name", "Muon"]),
    "loco": (2, FSDP_8_BLOCKS, ["--optimizer.name", "Ranger21", "--comm.gradient_compression", "loco"]),
    "error_feedback": (2, FSDP_8_BLOCKS, ["--optimizer.name", "Ranger21", "--comm.gradient_compression",
                                          "error_feedback"]),
    "qsdp_gradients": (2, FSDP_8_BLOCKS, ["--optimizer.name", "Ranger21", "--comm.gradient_compression", "qsdp"]),
    "qsdp_weights": (2, FSDP_8_BLOCKS, ["--optimizer.name", "Ranger21", "--comm.weight_quantization", "qsdp"]),
}


def dry_run_worker(rank: int, argv: list[str], folder: str) -> None:
    from torchtitan.dry_run import run
    from torchtitan.train import Trainer

    run(parse_args([*argv, "--job.dump_folder", folder, "--job.no_print_config"]), Trainer)


def dry_run_report(argv: list[str], folder: Path) -> dict:
    join_forked(dry_run_worker, (argv, str(folder)), 1, 300, "dry run")
    return json.loads((folder / "dry_run.json").read_text())


def check_step_peak(tmp_path: Path, world: int, layout: list[str], method: list[str]) -> None:
    argv = [*DEBUG_TOML, *TINY_BATCH, *layout, *method, "--comm.mode", "fake_backend", "--comm.fake_world_size",
            str(world), "--comm.fake_device", "cuda"]
    report = dry_run_report(argv, tmp_path)
    traced = {phase: gib * 1024 for phase, gib in report["phase_peak_memory_gib"].items()}
    predicted = estimate(parse_args(argv), world)
    planned = {phase: value / MIB for phase, value in predicted.phase_peaks}
    step, planned_step = traced["optimizer step"], planned["optimizer step"]
    summary = f"traced {traced}, planned {planned} MiB, step temporaries planned {predicted.transient / MIB:.2f} MiB"
    assert abs(planned_step / step - 1) <= 0.10, summary
    assert abs(max(planned.values()) / max(traced.values()) - 1) <= 0.10, summary
    if "error_feedback" in method:
        assert traced["backward"] > step, summary
        return
    assert step == max(traced.values()) and predicted.phase == "optimizer step", summary
    # Leaving the step's temporaries out would miss by more than the tolerance; and the temporaries themselves (what
    # the traced step holds beyond the planner's state, gradients and buffers) are within 10% of the planner's.
    assert predicted.transient / MIB > 0.10 * step, summary
    traced_temporaries = step - (planned_step - predicted.transient / MIB)
    assert abs(traced_temporaries / (predicted.transient / MIB) - 1) <= 0.10, summary


@pytest.mark.parametrize("case", CASES)
def test_planned_step_peak_within_10_percent_of_the_dry_run(tmp_path, case):
    check_step_peak(tmp_path, *CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_planned_step_peak_of_more_layouts_within_10_percent_of_the_dry_run(tmp_path, case):
    check_step_peak(tmp_path, *SLOW_CASES[case])
