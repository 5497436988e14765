"""A second model family trains through the trainer and the generic layers, which name no model: registered by the
module that job.custom_import names (parallel_block_model.py: Llama with parallel blocks), it trains under FSDP 2
and under PP 2 to the loss curve of its own one-process run. Same seed, data and global batch (4 sequences of 32
tokens), fp32: within 1e-5 relative, the bound of the Llama layouts (test_parallel_parity.py)."""

import re

import pytest
import torch

from tests.integration import parallel_block_model
from tests.integration.harness import TINY, launch, losses, max_relative_difference, read_metrics, train
from torchtitan.components.tokenizer import build_model_tokenizer
from torchtitan.config.job_config import Model
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.nn.parameters import count_parameters

pytestmark = pytest.mark.integration

STEPS = 4
GLOBAL_BATCH = 4
# Gradient norms of the tiny model start near 0.9: clipping scales every step's update, from norms of DTensors.
BASE = [*TINY, "--training.steps", str(STEPS), "--training.max_norm", "0.3",
        "--job.custom_import", "tests.integration.parallel_block_model", "--model.name", parallel_block_model.NAME]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[str, list[dict]]:
    dump = tmp_path_factory.mktemp("one_process")
    proc = launch(dump, 1, [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH)])
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout, read_metrics(dump)


def test_the_trainer_builds_the_registered_family(one_process):
    """The parameter count it logs is the parallel-block model's (one norm per block fewer than Llama's)."""
    vocab_size = build_model_tokenizer(Model()).vocab_size  # TINY trains with the bundled tokenizer
    args = model_args_for("tiny", 32, vocab_size)
    with torch.device("meta"):
        counts = [count_parameters(family(args))
                  for family in (parallel_block_model.ParallelBlockTransformer, Transformer)]
    assert counts[1] - counts[0] == args.n_layers * args.dim
    logged = re.search(rf"Model {parallel_block_model.NAME} tiny: ([\d,]+) parameters", one_process[0])
    assert logged is not None, one_process[0][-3000:]
    assert int(logged.group(1).replace(",", "")) == counts[0]


def assert_follows_one_process(name: str, rows: list[dict], one_process: tuple[str, list[dict]]) -> None:
    reference = one_process[1]
    assert len(losses(rows)) == STEPS
    difference = max_relative_difference(losses(rows), losses(reference))
    print(f"parity {parallel_block_model.NAME} {name}: max relative loss difference {difference:.2e}")
    assert difference <= TOLERANCE
    assert max_relative_difference([row["grad_norm"] for row in rows],
                                   [row["grad_norm"] for row in reference]) <= 10 * TOLERANCE


def test_fsdp2_matches_one_process(tmp_path, one_process):
    rows = train(tmp_path, 2, [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH // 2),
                               "--parallelism.data_parallel_shard_degree", "2"])
    assert_follows_one_process("fsdp2", rows, one_process)


@pytest.mark.slow
def test_pp2_matches_one_process(tmp_path, one_process):
    """Two stages, four micro-batches of one sequence: the family's split and stage modules (Llama's, reused)."""
    rows = train(tmp_path, 2, [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH),
                               "--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_schedule", "GPipe"])
    assert_follows_one_process("pp2", rows, one_process)
