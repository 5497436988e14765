"""Every data/tensor/context-parallel layout reproduces the single-process loss curve (issue: N-D parallelism).

Same seed, same data, same global batch (4 sequences of 32 tokens), fp32, 10 steps: each layout's per-step loss
must equal the one-process run within 1e-5 relative.
"""

import re
import shutil
from pathlib import Path

import pytest

from tests.integration.harness import TINY, launch, losses, max_relative_difference, read_metrics, train
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.models.llama3.args import model_args_for
from torchtitan.planner.rotated import sent_bytes

pytestmark = pytest.mark.integration

STEPS = 10
GLOBAL_BATCH = 4
# Gradient norms of the tiny model start near 0.6: clipping scales every step's update, from norms of DTensors.
BASE = [*TINY, "--training.steps", str(STEPS), "--training.max_norm", "0.3"]

# (name, processes, data-parallel degree, extra options)
LAYOUTS = [
    ("fsdp2", 2, 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    ("ddp2", 2, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("tp2", 2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    ("cp2", 2, 1, ["--parallelism.context_parallel_degree", "2"]),
    ("fsdp4", 4, 4, ["--parallelism.data_parallel_shard_degree", "4"]),
    ("hsdp2x2", 4, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2"]),
    ("tp4", 4, 1, ["--parallelism.tensor_parallel_degree", "4"]),
    ("fsdp2_tp2", 4, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    ("fsdp2_cp2", 4, 2, ["--parallelism.data_parallel_shard_degree", "2",
                         "--parallelism.context_parallel_degree", "2"]),
    # Context parallelism's default all-gathers the keys and values of the heads TP left on the rank.
    ("tp2_cp2", 4, 1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]),
    # torch's ring attention, the other CP method.
    ("tp2_cp2_ring", 4, 1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
                            "--parallelism.context_parallel_method", "ring",
                            "--parallelism.context_parallel_rotate_method", "alltoall"]),
    ("cp2_ring", 2, 1, ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ring"]),
    ("cp4", 4, 1, ["--parallelism.context_parallel_degree", "4"]),
]
# The ring (both rotations) is checked against one process at CP 2 and 4 in tests/unit/test_context_parallel.py.
SLOW_LAYOUTS = {"cp2_ring", "tp2_cp2_ring", "cp4", "tp4", "tp2_cp2"}


def batch_args(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return train(tmp_path_factory.mktemp("reference"), 1, [*BASE, *batch_args(1)])


# The other tested torch's smoke set (.ci/run): one layout of each kind (cp2: causal CP over gathered keys and
# values, the default method); the compositions run on the README's torch.
SMOKE_LAYOUTS = {"fsdp2", "ddp2", "hsdp2x2", "tp2", "cp2"}


def _marks(name: str) -> list:
    return [mark for mark, names in ((pytest.mark.smoke, SMOKE_LAYOUTS), (pytest.mark.slow, SLOW_LAYOUTS))
            if name in names]


@pytest.mark.parametrize("name,nproc,dp,options", [pytest.param(*layout, id=layout[0], marks=_marks(layout[0]))
                                                   for layout in LAYOUTS])
def test_layout_matches_single_process(tmp_path, reference, name, nproc, dp, options):
    assert_follows_reference(tmp_path / name, name, nproc, [*BASE, *batch_args(dp), *options], reference)


def assert_follows_reference(dump: Path, name: str, nproc: int, args: list[str], reference: list[dict],
                             loss_bound: float = 1e-5) -> None:
    proc = launch(dump, nproc, args)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # No layout triggers a Python warning (torch's deprecated slicing of flattened meshes, torchdata's set_vital).
    assert not re.search(r"\w+Warning: ", proc.stdout), proc.stdout
    rows = read_metrics(dump)
    assert len(losses(rows)) == STEPS
    difference = max_relative_difference(losses(rows), losses(reference))
    print(f"parity {name}: max relative loss difference {difference:.2e}")
    assert difference <= loss_bound
    grad_norms = [row["grad_norm"] for row in rows]
    reference_norms = [row["grad_norm"] for row in reference]
    assert max_relative_difference(grad_norms, reference_norms) <= 1e-4


# The optimizers beyond AdamW (docs/recipes.md, Optimizers) under FSDP 2 and TP 2, each against its own one-process
# run. Ranger21 reduces over rows split by TP and over all parameters; the low-precision states are elementwise, and
# torchao's blocks are a rank's local shard (the tiny model's dim-0 shards keep the one-process blocks). GaLore and Muon
# need whole matrices (gathered or computed on shards, see their modules); GaLore refreshes its subspace at steps 1, 5
# and 9, so that refreshes happen under sharding.
OPTIMIZERS = {
    "Ranger21": ["--optimizer.name", "Ranger21", "--optimizer.weight_decay", "1e-4"],
    "AdamW-bf16": ["--optimizer.name", "AdamW-bf16"],
    "AdamW-8bit": ["--optimizer.name", "AdamW-8bit"],
    "AdamW-4bit": ["--optimizer.name", "AdamW-4bit"],
    "GaLore-AdamW": ["--optimizer.name", "GaLore-AdamW", "--optimizer.galore.update_gap", "4"],
    "Muon": ["--optimizer.name", "Muon"],
}
# torchao quantizes a rank's local shard in its own blocks (128 values for 4-bit): under TP the embedding's state is
# split along its second dimension (the embedding is split by column), so its blocks hold other values than one
# process's, and 4-bit's coarse codes turn that into 1.1e-5 of loss over 10 steps (8-bit's into less than 1e-5).
LOSS_BOUND = {"AdamW-4bit": 2e-5}
FAST_OPTIMIZER_LAYOUTS = {("Ranger21", "fsdp2"), ("Muon", "tp2")}
OPTIMIZER_LAYOUTS = [pytest.param(optimizer, layout, marks=() if (optimizer, layout) in FAST_OPTIMIZER_LAYOUTS
                                  else pytest.mark.slow, id=f"{optimizer}-{layout}")
                     for optimizer in OPTIMIZERS for layout in ("fsdp2", "tp2")]
OPTIMIZER_LAYOUTS += [pytest.param(optimizer, "fsdp2_tp2", marks=pytest.mark.slow, id=f"{optimizer}-fsdp2_tp2")
                      for optimizer in ("GaLore-AdamW", "Muon")]


@pytest.fixture(scope="module")
def optimizer_references(tmp_path_factory) -> dict[str, list[dict]]:
    """Each optimizer's one-process run, made on first use."""
    references: dict[str, list[dict]] = {}

    def reference_of(optimizer: str) -> list[dict]:
        if optimizer not in references:
            references[optimizer] = train(tmp_path_factory.mktemp(f"reference_{optimizer}"), 1,
                                          [*BASE, *batch_args(1), *OPTIMIZERS[optimizer]])
        return references[optimizer]

    return reference_of


@pytest.mark.parametrize("optimizer,layout", OPTIMIZER_LAYOUTS)
def test_optimizer_matches_single_process(tmp_path, optimizer_references, optimizer, layout):
    name, nproc, dp, options = next(entry for entry in LAYOUTS if entry[0] == layout)
    assert_follows_reference(tmp_path / name, f"{optimizer} {name}", nproc,
                             [*BASE, *batch_args(dp), *options, *OPTIMIZERS[optimizer]], optimizer_references(optimizer),
                             LOSS_BOUND.get(optimizer, 1e-5))


@pytest.mark.slow
def test_context_parallel_checkpoint_resumes_under_another_degree(tmp_path, reference):
    """Causal attention over gathered keys and values: a checkpoint saved at step 5 under CP 2, resumed under CP 4,
    continues the one-process run (each rank's share of the sequence, and so of the keys it gathers, changes)."""
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    train(tmp_path / "saved_cp2", 2, [*BASE, *batch_args(1), *checkpoint, "--parallelism.context_parallel_degree", "2"])
    shutil.copytree(tmp_path / "saved_cp2" / "checkpoint" / "step-5", tmp_path / "resumed_cp4" / "checkpoint" / "step-5")
    resumed = losses(train(tmp_path / "resumed_cp4", 4, [*BASE, *batch_args(1), *checkpoint,
                                                          "--parallelism.context_parallel_degree", "4"]))
    assert len(resumed) == STEPS - 5
    difference = max_relative_difference(resumed, losses(reference)[5:])
    print(f"cp2 -> cp4 resume: max relative loss difference of steps 6-{STEPS} {difference:.2e}")
    assert difference <= 1e-5


# Rotated tensor parallelism (parallelism.data_parallel_shard_method = rotated, docs/parallelism.md): the ring of
# shard ranks passes the weight shards around instead of gathering them, and computes the same sums as one process in
# another order. (name, processes, options); the global batch is 4 sequences in each.
ROTATED = ["--parallelism.data_parallel_shard_method", "rotated"]
ROTATED_LAYOUTS = [
    pytest.param("rtp4", 4, ["--parallelism.data_parallel_shard_degree", "4", *batch_args(4)],
                 marks=pytest.mark.slow),
    pytest.param("rtp2_compiled", 2, ["--parallelism.data_parallel_shard_degree", "2", *batch_args(2),
                                      "--compile.enable"], marks=pytest.mark.slow),
    pytest.param("rtp2_per_op_ac", 2, ["--parallelism.data_parallel_shard_degree", "2", *batch_args(2),
                                       "--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.selective_ac_option", "op"], marks=pytest.mark.slow),
    pytest.param("rtp2_pp2", 4, ["--parallelism.data_parallel_shard_degree", "2",
                                 "--parallelism.pipeline_parallel_degree", "2", *batch_args(2)],
                 marks=pytest.mark.slow),
    pytest.param("rtp2_cp2", 4, ["--parallelism.data_parallel_shard_degree", "2",
                                 "--parallelism.context_parallel_degree", "2", *batch_args(2)],
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,nproc,options", ROTATED_LAYOUTS)
def test_rotated_layout_matches_single_process(tmp_path, reference, name, nproc, options):
    assert_follows_reference(tmp_path / name, name, nproc, [*BASE, *options, *ROTATED], reference)


def test_rotated_with_accumulation_and_checkpointing_matches_single_process(tmp_path, reference):
    """RTP 2 with two accumulated micro-batches per step and every block checkpointed (its recomputed forward rotates
    the shards again): the one-process losses, and the bytes sent per step that the trainer logs are the
    arithmetic's (planner/rotated.py), recomputed forwards and the norms' all-reduce once per step included."""
    dump = tmp_path / "rtp2"
    assert_follows_reference(dump, "rtp2 accumulated, AC full", 2,
                             [*BASE, "--parallelism.data_parallel_shard_degree", "2", *ROTATED,
                              "--training.local_batch_size", "1", "--training.global_batch_size", str(GLOBAL_BATCH),
                              "--activation_checkpoint.mode", "full"], reference)
    args = model_args_for("tiny", 32, build_tokenizer("").vocab_size)
    expected = sent_bytes(args, 2, layers=args.n_layers, embedding=True, output=True, passes=2,
                          recomputed_layers=args.n_layers, param_bytes=4, reduce_bytes=4)
    assert {row["comm_sent_mib_per_step"] for row in read_metrics(dump)} == {expected.total / 2**20}


def test_fsdp_shards_model_state(tmp_path, reference):
    """Parameters + gradients + optimizer state per rank under FSDP N are 1/N of one process's, within 10%."""
    for n in (2, 4):
        rows = train(tmp_path / f"fsdp{n}", n, [*BASE, "--training.steps", "1", *batch_args(n),
                                                "--parallelism.data_parallel_shard_degree", str(n)])
        ratio = rows[0]["model_state_gib"] / reference[0]["model_state_gib"]
        print(f"FSDP {n}: per-rank model state = {ratio:.4f} of one process's (ideal {1 / n:.4f})")
        assert abs(ratio * n - 1) <= 0.10, f"FSDP {n}: per-rank state is {ratio:.4f} of one process's"


def test_bf16_mixed_precision_close_to_fp32(tmp_path, reference):
    """bf16 parameters in compute (FSDP's MixedPrecisionPolicy) with fp32 reductions and master weights.

    bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); over 10 steps of a freshly initialised model
    the loss (about 8) moves by well under 1% from the fp32 curve, while a real bug (a wrong reduction, a lost
    gradient) moves it by far more than that.
    """
    rows = train(tmp_path / "fsdp2_bf16", 2, [*BASE, *batch_args(2), "--parallelism.data_parallel_shard_degree", "2",
                                              "--training.mixed_precision_param", "bfloat16"])
    difference = max_relative_difference(losses(rows), losses(reference))
    print(f"parity fsdp2 bf16: max relative loss difference to fp32 {difference:.2e}")
    assert 0 < difference <= 1e-2


def test_validation_loss_matches_under_context_and_tensor_parallel(tmp_path):
    """Validation shards the sequence (CP) and the vocabulary (TP) like training does; its loss must not change."""
    validation = ["--training.steps", "2", "--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
                  "--validation.seq_len", "32", "--validation.local_batch_size", "2"]

    def validation_loss(rows: list[dict]) -> float:
        return next(row["validation_loss"] for row in rows if "validation_loss" in row)

    single = train(tmp_path / "single", 1, [*BASE, *batch_args(1), *validation])
    sharded = train(tmp_path / "cp2_tp2", 4, [*BASE, *batch_args(1), *validation,
                                              "--parallelism.context_parallel_degree", "2",
                                              "--parallelism.tensor_parallel_degree", "2"])
    assert abs(validation_loss(sharded) / validation_loss(single) - 1) <= 1e-5
