"""Block-causal attention (model.attention_mask = block_causal, document positions) in the trainer: the layouts that
shard the model (FSDP, TP) or split it into stages (PP, where every stage gets the documents as keyword inputs)
reproduce the one-process loss curve, which differs from the causal one; so do context parallelism and its
compositions (slow)."""

import json
import random
import shutil

import pytest

from tests.integration.harness import TINY, losses, max_relative_difference, train

pytestmark = pytest.mark.integration

GLOBAL_BATCH = 4
BASE = [*TINY, "--training.steps", "6", "--training.seq_len", "128", "--optimizer.lr", "3e-3"]
BLOCK_CAUSAL = ["--model.attention_mask", "block_causal", "--model.document_positions"]


def run(tmp_path, name: str, nproc: int, dp: int, options: list[str]) -> list[float]:
    return losses(train(tmp_path / name, nproc, [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH // dp),
                                                 *options]))


@pytest.mark.slow
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


@pytest.mark.slow
def test_block_causal_under_context_parallelism_composes_and_resumes(tmp_path):
    """Context parallelism over packed documents (K/V all-gathered, chunks balanced by the mask's work) alone, at CP 4,
    with FSDP, TP and PP (interleaved), with global RoPE positions, and resumed under another CP degree: the one-process losses.
    (Exactness of losses and gradients at CP 2 and 4 on chosen layouts of documents: tests/unit/
    test_context_parallel_documents.py.)"""
    reference = run(tmp_path, "one", 1, 1, BLOCK_CAUSAL)
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    layouts = {
        "cp2": (2, 1, cp2),
        "cp4": (4, 1, ["--parallelism.context_parallel_degree", "4"]),
        "fsdp2_cp2": (4, 2, ["--parallelism.data_parallel_shard_degree", "2", *cp2]),
        "tp2_cp2": (4, 1, ["--parallelism.tensor_parallel_degree", "2", *cp2]),
        # Two stages per rank: they share each micro-batch's mask (pipeline_parallel.SharedDocumentMasks).
        "pp2_cp2": (4, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                           "Interleaved1F1B", *cp2]),
    }
    for name, (nproc, dp, options) in layouts.items():
        difference = max_relative_difference(run(tmp_path, name, nproc, dp, [*BLOCK_CAUSAL, *options]), reference)
        print(f"{name} block_causal vs one process: max relative loss difference {difference:.2e}")
        # fp32 throughout: rounding of sums taken in another order, as for the other layouts above.
        assert difference <= 2e-6, name

    global_positions = run(tmp_path, "global_positions_one", 1, 1, ["--model.attention_mask", "block_causal"])
    difference = max_relative_difference(
        run(tmp_path, "global_positions_cp2", 2, 1, ["--model.attention_mask", "block_causal", *cp2]), global_positions)
    print(f"cp2 block_causal with global positions vs one process: max relative loss difference {difference:.2e}")
    assert difference <= 2e-6

    # Saved at step 3 under CP 2, resumed under CP 4: steps 4-6 are the uninterrupted run's.
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    run(tmp_path, "saved_cp2", 2, 1, [*BLOCK_CAUSAL, *checkpoint, *cp2])
    shutil.copytree(tmp_path / "saved_cp2" / "checkpoint" / "step-3", tmp_path / "resumed_cp4" / "checkpoint" / "step-3")
    resumed = run(tmp_path, "resumed_cp4", 4, 1, [*BLOCK_CAUSAL, *checkpoint, *layouts["cp4"][2]])
    difference = max_relative_difference(resumed, reference[3:])
    print(f"cp2 -> cp4 resume: max relative loss difference of steps 4-6 {difference:.2e}")
    assert difference <= 2e-6


def write_documents(path, prefix: str, lengths: list[int]):
    """A jsonl corpus of documents of the given lengths in words (distinct words: `<prefix><doc>w<word>`)."""
    with path.open("w") as f:
        for doc, words in enumerate(lengths):
            f.write(json.dumps({"text": " ".join(f"{prefix}{doc}w{word}" for word in range(words))}) + "\n")
    return path


@pytest.mark.slow
def test_block_causal_under_context_parallelism_on_a_mixture_of_token_shards(tmp_path):
    """The data pipeline feeding CP: two corpora tokenized into shards by scripts/tokenize_dataset.py, mixed 0.6/0.4
    (training.sources), trained block-causal under CP 2: the one-process losses on the same data. The documents (a
    few to a few hundred tokens; CP 2 cuts 128 tokens into 16 chunks of 8) cross chunk and rank boundaries, one per
    source is longer than a whole window, and the mask changes the losses (the causal run on the same data differs)."""
    from scripts import tokenize_dataset

    generator = random.Random(0)
    sources = []
    for name in ("web", "code"):
        lengths = [generator.choice([2, 5, 9, 20, 40, 70]) for _ in range(60)] + [200]
        corpus = write_documents(tmp_path / f"{name}.jsonl", name, lengths)
        tokenize_dataset.tokenize(str(corpus), str(tmp_path / name), documents_per_shard=25, workers=1,
                                  progress=False)
        sources.append(f"{tmp_path / name}:{0.6 if name == 'web' else 0.4}")
    mixture = ["--training.sources", ",".join(sources)]
    reference = run(tmp_path, "one", 1, 1, [*BLOCK_CAUSAL, *mixture])
    causal = run(tmp_path, "causal", 1, 1, mixture)
    assert max_relative_difference(reference, causal) > 1e-5
    difference = max_relative_difference(
        run(tmp_path, "cp2", 2, 1, [*BLOCK_CAUSAL, *mixture, "--parallelism.context_parallel_degree", "2"]), reference)
    print(f"cp2 block_causal on a mixture of token shards vs one process: max relative loss difference "
          f"{difference:.2e}")
    # fp32 throughout: rounding of sums taken in another order, as for the layouts above.
    assert difference <= 2e-6
