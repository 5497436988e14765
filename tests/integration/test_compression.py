"""Compressed FSDP collectives through the real trainer: LoCo's residuals resume bit for bit and reshard, and the
recipes train close to the uncompressed baseline."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.harness import TINY, losses, max_relative_difference, train
from tests.integration.test_checkpoint_resume import write_corpus
from torchtitan.components.checkpoint import read_full_checkpoint

pytestmark = pytest.mark.integration

STEPS, SAVED_STEP = 8, 4
BASE = [*TINY, "--lr_scheduler.decay_ratio", "0", "--training.steps", str(STEPS)]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
LOCO = ["--comm.gradient_compression", "loco", "--comm.gradient_bits", "4", "--comm.quantization_rotation",
        "hadamard"]


def fsdp(nproc: int, corpus: Path) -> list[str]:
    return [*BASE, "--training.dataset_path", str(corpus), "--training.local_batch_size", str(4 // nproc),
            "--parallelism.data_parallel_shard_degree", str(nproc)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data") / "numbered.jsonl")


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> list[dict]:
    """An uninterrupted 8-step LoCo run on 2 ranks that never saves."""
    return train(tmp_path_factory.mktemp("straight"), 2, [*fsdp(2, corpus), *LOCO])


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory) -> Path:
    """The dump folder of the same run stopped after step 4, saving every 2 steps."""
    dump = tmp_path_factory.mktemp("saved")
    train(dump, 2, [*fsdp(2, corpus), *LOCO, *CHECKPOINT, "--training.steps", str(SAVED_STEP)])
    return dump


def after_save(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "loss" in row and row["step"] > SAVED_STEP]


@pytest.mark.slow
def test_saving_changes_nothing_and_loco_resumes_bitwise(tmp_path, corpus, straight, saved):
    """A run that saves at steps 2 and 4, resumes from step 4 and saves at 6 and 8 has, at every step, the loss and
    gradient norm of the run that never saves: saving changes no state, and the checkpoint restores it exactly."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    rows = train(tmp_path, 2, [*fsdp(2, corpus), *LOCO, *CHECKPOINT])
    rows = [row for row in rows if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    uninterrupted = [row for row in straight if "loss" in row]
    assert [row["loss"] for row in rows] == [row["loss"] for row in uninterrupted]
    assert [row["grad_norm"] for row in rows] == [row["grad_norm"] for row in uninterrupted]


@pytest.mark.slow
def test_loco_checkpoint_reshards_to_four_ranks(tmp_path, corpus, straight, saved):
    """The residuals are saved per parameter, sharded like it: 4 ranks resume 2 ranks' step-4 checkpoint and follow
    the 2-rank run closely (4-bit codes of other shards: not bitwise). A smoke test of the trainer's path only: with
    the residuals dropped on the reshard, steps 5-8 stay as close (1.6e-5, against 1.9e-5 with them, 2026-11-26),
    so that the residuals reach the new ranks exactly is tests/unit/test_compression.py's
    test_residuals_reshard_from_two_to_four_ranks_exactly."""
    shutil.copytree(saved / "checkpoint" / f"step-{SAVED_STEP}", tmp_path / "checkpoint" / f"step-{SAVED_STEP}")
    rows = train(tmp_path, 4, [*fsdp(4, corpus), *LOCO, *CHECKPOINT])
    assert [row["step"] for row in rows if "loss" in row] == list(range(SAVED_STEP + 1, STEPS + 1))
    difference = max_relative_difference(losses(rows), losses(after_save(straight)))
    print(f"LoCo 2 -> 4 ranks: max relative loss difference of steps 5-8 {difference:.2e}")
    assert difference < 1e-3


def test_the_checkpoint_holds_the_residuals_per_parameter(saved):
    state = read_full_checkpoint(saved / "checkpoint" / f"step-{SAVED_STEP}")["optimizer"]
    residuals = {key: value for key, value in state.items()
                 if key.startswith("compression.") and key != "compression.loco_steps"}
    # Each rank's own codes verbatim too, one block per rank, per FSDP module (named by its first parameter).
    assert state["exact.compression.layers.0.attention_norm.weight.replica0of1"].shape[0] == 2
    assert int(state["compression.loco_steps"]) == SAVED_STEP  # LoCo's reset counts steps across a resume
    weight = state["state.layers.0.attention.wq.weight.exp_avg"]
    assert residuals["compression.layers.0.attention.wq.weight"].shape == weight.shape
    assert len(residuals) == len([key for key in state if key.endswith(".exp_avg")])
    assert any(value.abs().sum() > 0 for value in residuals.values())


@pytest.mark.slow
def test_saving_changes_nothing_and_flexdemo_resumes_bitwise(tmp_path, corpus):
    """Two DDP replicas under FlexDeMo: a run that saves every 2 steps and resumes from step 4 has the losses of one
    that never saves. The checkpoint holds each replica's own delta (DeMo's momentum, what every resume loads) and,
    as the optimizer's state, one replica's copy of it (saving sends nothing across replicas); saving leaves the live
    deltas as they are."""
    args = [*BASE, "--training.dataset_path", str(corpus), "--training.local_batch_size", "2",
            "--parallelism.data_parallel_replicate_degree", "2", "--optimizer.name", "FlexDeMo"]
    straight = train(tmp_path / "straight", 2, args)
    train(tmp_path / "resumed", 2, [*args, *CHECKPOINT, "--training.steps", str(SAVED_STEP)])
    rows = train(tmp_path / "resumed", 2, [*args, *CHECKPOINT])
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, STEPS + 1))
    assert losses(rows) == losses(straight)
    state = read_full_checkpoint(tmp_path / "resumed" / "checkpoint" / f"step-{SAVED_STEP}")["optimizer"]
    deltas = [state[f"exact.layers.0.attention.wq.weight.delta.replica{r}of2"] for r in range(2)]
    copy = state["state.layers.0.attention.wq.weight.delta"]
    assert copy.shape == (64, 64) and copy.abs().sum() > 0
    assert not torch.equal(deltas[0], deltas[1])
    assert torch.equal(copy, deltas[0]) or torch.equal(copy, deltas[1])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_degree", "2"],
], ids=["fsdp2_tp2", "fsdp2_pp2"])
def test_loco_and_qsdp_compose_with_tensor_and_pipeline_parallelism(tmp_path, corpus, layout):
    """The hooks see each rank's local shards and the data-parallel group only: 4 processes, 5 steps, within 0.1%
    of the same layout uncompressed."""
    args = [*TINY, "--training.dataset_path", str(corpus), "--training.steps", "5", "--training.local_batch_size",
            "2", *layout]
    plain = train(tmp_path / "plain", 4, args)
    compressed = train(tmp_path / "compressed", 4, [*args, "--comm.gradient_compression", "loco",
                                                    "--comm.weight_quantization", "qsdp"])
    difference = max_relative_difference(losses(compressed), losses(plain))
    assert 0 < difference < 1e-3


@pytest.mark.slow
def test_flexdemo_checkpoint_reshards_from_ddp_to_hsdp(tmp_path, corpus):
    """FlexDeMo's deltas are saved one per parameter, sharded like it: DDP 2's step-4 checkpoint resumes on HSDP
    2 x 2 (4 ranks). The first resumed step's loss is the forward of the step-4 weights on the same global batch, so
    it equals the DDP run's step 5 (fp32, 1e-5). Later steps differ by design, not by resharding: FlexDeMo keeps one
    momentum per replica, and HSDP's replica 0 reads windows 0 and 1 of a step where DDP's reads windows 0 and 2 (rank
    r of D data-parallel ranks takes window r), so each replica's delta sees other gradients (measured 1.2e-3 by step
    8): they must stay finite."""
    args = [*BASE, "--training.dataset_path", str(corpus), "--optimizer.name", "FlexDeMo", *CHECKPOINT,
            "--parallelism.data_parallel_replicate_degree", "2"]
    ddp = train(tmp_path / "ddp", 2, [*args, "--training.local_batch_size", "2"])
    shutil.copytree(tmp_path / "ddp" / "checkpoint" / f"step-{SAVED_STEP}",
                    tmp_path / "hsdp" / "checkpoint" / f"step-{SAVED_STEP}")
    hsdp = train(tmp_path / "hsdp", 4, [*args, "--training.local_batch_size", "1",
                                        "--parallelism.data_parallel_shard_degree", "2"])
    assert [row["step"] for row in hsdp if "loss" in row] == list(range(SAVED_STEP + 1, STEPS + 1))
    resumed, straight = losses(hsdp), losses(after_save(ddp))
    assert max_relative_difference(resumed[:1], straight[:1]) < 1e-5
    assert all(torch.isfinite(torch.tensor(resumed)))
