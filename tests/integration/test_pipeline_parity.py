"""Pipeline parallelism reproduces the single-process loss curve with every schedule and next to FSDP, TP and CP.

Same seed, data and global batch, fp32: each layout's per-step loss must equal the one-process run's within 1e-5
relative. Micro-batches of one sequence make 4 micro-batches per step (2 next to FSDP 2), enough for every schedule
on 2 ranks (and DualPipeV's 4 stages); a gradient wrongly divided by them would show at the second step.
"""

import pytest

from tests.integration.harness import TINY, losses, max_relative_difference, train

pytestmark = pytest.mark.integration

STEPS = 10
# Gradient norms of the tiny model start near 0.6: clipping scales every step's update, across the stages.
BASE = [*TINY, "--training.steps", str(STEPS), "--training.max_norm", "0.3"]
LOCAL_BATCH = 4
TOLERANCE = 1e-5
# Validation with shorter sequences: the pipeline re-learns the stage shapes for it and back for training.
VALIDATION_FREQ = 5
VALIDATION = ["--validation.enable", "--validation.freq", str(VALIDATION_FREQ), "--validation.local_batch_size", str(LOCAL_BATCH),
              "--validation.seq_len", "16", "--validation.steps", "2"]


def batch(local_batch_size: int) -> list[str]:
    return ["--training.local_batch_size", str(local_batch_size)]


def pipeline(degree: int, schedule: str, *options: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", str(degree), "--parallelism.pipeline_parallel_schedule",
            schedule, *options]


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory) -> list[dict]:
    return train(tmp_path_factory.mktemp("tiny_reference"), 1, [*BASE, *batch(LOCAL_BATCH), *VALIDATION])


@pytest.fixture(scope="module")
def debugmodel_reference(tmp_path_factory) -> list[dict]:
    return train(tmp_path_factory.mktemp("debugmodel_reference"), 1,
                 [*BASE, *batch(LOCAL_BATCH), *VALIDATION, "--model.flavor", "debugmodel"])


def grad_norms(rows: list[dict]) -> list[float]:
    return [row["grad_norm"] for row in rows if "grad_norm" in row]


def validation_losses(rows: list[dict]) -> list[float]:
    return [row["validation_loss"] for row in rows if "validation_loss" in row]


def assert_parity(name: str, rows: list[dict], reference: list[dict], validated: bool = True) -> None:
    assert len(losses(rows)) == STEPS
    difference = max_relative_difference(losses(rows), losses(reference))
    print(f"parity {name}: max relative loss difference {difference:.2e}")
    assert difference <= TOLERANCE
    assert max_relative_difference(grad_norms(rows), grad_norms(reference)) <= 10 * TOLERANCE
    if validated:
        assert len(validation_losses(rows)) == STEPS // VALIDATION_FREQ
        assert max_relative_difference(validation_losses(rows), validation_losses(reference)) <= TOLERANCE


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
# One schedule also accumulates gradients: two pipeline steps of 2 sequences per optimizer step.
EXTRA_OPTIONS = {"GPipe": ["--training.local_batch_size", "2", "--training.global_batch_size", str(LOCAL_BATCH)]}


@pytest.mark.parametrize("schedule", [pytest.param(schedule, marks=pytest.mark.smoke)
                                      if schedule in ("GPipe", "Interleaved1F1B") else schedule
                                      for schedule in SCHEDULES])
def test_pp2_schedule_matches_single_process(tmp_path, tiny_reference, schedule):
    rows = train(tmp_path / schedule, 2, [*BASE, *batch(LOCAL_BATCH), *VALIDATION, *pipeline(2, schedule),
                                          *EXTRA_OPTIONS.get(schedule, [])])
    assert_parity(f"pp2 {schedule}", rows, tiny_reference)


@pytest.mark.slow
def test_pp4_interleaved_one_block_per_stage(tmp_path, debugmodel_reference):
    """8 stages of one unit each on 4 ranks: the embedding and the head get stages of their own."""
    rows = train(tmp_path / "pp4", 4, [*BASE, *batch(LOCAL_BATCH), *VALIDATION, "--model.flavor", "debugmodel",
                                       *pipeline(4, "Interleaved1F1B",
                                                 "--parallelism.pipeline_parallel_layers_per_stage", "1")])
    assert_parity("pp4 Interleaved1F1B, one block per stage", rows, debugmodel_reference)


def looped_breadth_first_csv(pp_degree: int, stages_per_rank: int, n_microbatches: int) -> str:
    """A compute-only schedule, one row per rank: each local stage's forwards, then its backwards in reverse."""
    rows = []
    for rank in range(pp_degree):
        stages = range(rank, pp_degree * stages_per_rank, pp_degree)
        forwards = [f"{stage}F{mb}" for stage in stages for mb in range(n_microbatches)]
        backwards = [f"{stage}B{mb}" for stage in reversed(stages) for mb in reversed(range(n_microbatches))]
        rows.append(",".join(forwards + backwards))
    return "\n".join(rows) + "\n"


def test_pp2_custom_csv_schedule(tmp_path, tiny_reference):
    csv = tmp_path / "schedule.csv"
    csv.write_text(looped_breadth_first_csv(2, 2, LOCAL_BATCH))
    rows = train(tmp_path / "csv", 2, [*BASE, *batch(LOCAL_BATCH), *VALIDATION, *pipeline(
        2, "Interleaved1F1B", "--parallelism.pipeline_parallel_schedule_csv", str(csv))])
    assert_parity("pp2 custom CSV schedule", rows, tiny_reference)


def test_pp2_fsdp2(tmp_path, tiny_reference):
    """Two data-parallel ranks of half the batch each: 2 micro-batches per step, gradients reduce-scattered once."""
    rows = train(tmp_path / "pp2_fsdp2", 4, [*BASE, *batch(LOCAL_BATCH // 2), *pipeline(2, "1F1B"),
                                             "--parallelism.data_parallel_shard_degree", "2"])
    assert_parity("pp2 x fsdp2 (1F1B)", rows, tiny_reference, validated=False)


@pytest.mark.slow
def test_pp2_tp2(tmp_path, tiny_reference):
    """Stage boundaries carry each TP rank's sequence shard of the hidden states."""
    rows = train(tmp_path / "pp2_tp2", 4, [*BASE, *batch(LOCAL_BATCH), *VALIDATION, *pipeline(2, "Interleaved1F1B"),
                                           "--parallelism.tensor_parallel_degree", "2"])
    assert_parity("pp2 x tp2 (Interleaved1F1B)", rows, tiny_reference)


def test_pp2_cp2(tmp_path, tiny_reference):
    rows = train(tmp_path / "pp2_cp2", 4, [*BASE, *batch(LOCAL_BATCH), *VALIDATION, *pipeline(2, "ZBVZeroBubble"),
                                           "--parallelism.context_parallel_degree", "2"])
    assert_parity("pp2 x cp2 (ZBVZeroBubble)", rows, tiny_reference)


@pytest.mark.slow
def test_pp2_fsdp2_tp2(tmp_path, tiny_reference):
    rows = train(tmp_path / "pp2_fsdp2_tp2", 8, [*BASE, *batch(LOCAL_BATCH // 2), *pipeline(2, "Interleaved1F1B"),
                                                 "--parallelism.data_parallel_shard_degree", "2",
                                                 "--parallelism.tensor_parallel_degree", "2"], timeout=600)
    assert_parity("pp2 x fsdp2 x tp2 (Interleaved1F1B)", rows, tiny_reference, validated=False)
