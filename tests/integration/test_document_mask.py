"""Block-causal attention (model.attention_mask = block_causal, document positions) in the trainer: the layouts that
shard the model (FSDP, TP) or split it into stages (PP, where every stage gets the documents as keyword inputs)
reproduce the one-process loss curve, which differs from the causal one. Context parallelism is refused (unit test
in tests/unit/test_document_mask.py)."""

import pytest

from tests.integration.harness import TINY, losses, max_relative_difference, train

pytestmark = pytest.mark.integration

GLOBAL_BATCH = 4
BASE = [*TINY, "--training.steps", "6", "--training.seq_len", "128", "--optimizer.lr", "3e-3"]
BLOCK_CAUSAL = ["--model.attention_mask", "block_causal", "--model.document_positions"]


def run(tmp_path, name: str, nproc: int, dp: int, options: list[str]) -> list[float]:
    return losses(train(tmp_path / name, nproc, [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH // dp),
                                                 *options]))


def test_block_causal_composes_with_fsdp_tp_and_pp(tmp_path):
    reference = run(tmp_path, "one", 1, 1, BLOCK_CAUSAL)
    causal = run(tmp_path, "causal", 1, 1, [])
    # The embedded corpus's documents run to a few hundred tokens: some of the steps' windows cross a document start,
    # where the mask changes the loss.
    # At initialisation the loss hardly depends on what tokens attend to: the difference is small but far beyond the
    # layouts' rounding differences below.
    assert max_relative_difference(reference, causal) > 1e-5
    layouts = {
        "fsdp2_pp2": (4, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_degree",
                             "2"]),
        "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    }
    for name, (nproc, dp, options) in layouts.items():
        difference = max_relative_difference(run(tmp_path, name, nproc, dp, [*BLOCK_CAUSAL, *options]), reference)
        print(f"{name} block_causal vs one process: max relative loss difference {difference:.2e}")
        assert difference <= 2e-6, name
