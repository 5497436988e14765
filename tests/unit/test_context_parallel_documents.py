"""Context parallelism over packed documents (block-causal mask): the mask each rank builds from its shard, the
balance of the chunk assignment, and the losses and gradients of real CP 2 and CP 4 processes (gloo) against one
process, on chosen layouts of documents and on a batch of the real data pipeline (token shards, a mixture)."""

import datetime
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.unit.forked_ranks import join_forked
from torchtitan.distributed import context_parallel as cp
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.nn.attention import document_ids, document_positions

BOS = 1
SEQ_LEN = 64
# Document starts of the sequences of each test batch. "documents": documents that cross chunk and rank boundaries
# (CP 4 cuts the sequence into 32 chunks of 2 tokens, CP 2 into 16 of 4), one (30..50) longer than a CP 4 rank's
# whole shard of 16 tokens; balanced by work, the chunks are not assigned head-tail. "whole": one document longer
# than the sequence (no BOS), and one that is the whole sequence.
BATCHES = {"documents": [[0, 5, 13, 14, 30, 50, 61]], "whole": [[], [0]]}
DOCUMENT_STARTS = [*BATCHES["documents"], *BATCHES["whole"]]


def block_causal_reference(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq, seq): query i sees key j when j <= i in the same document."""
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    return (ids[:, :, None] == ids[:, None, :]) & causal


def ids_with_starts(starts: list[list[int]], seq_len: int) -> torch.Tensor:
    tokens = torch.full((len(starts), seq_len), 5)
    for row, row_starts in enumerate(starts):
        tokens[row, row_starts] = BOS
    return document_ids(tokens, BOS)


def fake_mesh(size: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(size=lambda: size, get_local_rank=lambda: rank)


def test_chunk_work_counts_the_visible_pairs_of_the_mask():
    ids = ids_with_starts(list(DOCUMENT_STARTS), SEQ_LEN)
    for chunks in (4, 8):
        visible_per_query = block_causal_reference(ids).sum(dim=2)
        expected = visible_per_query.reshape(len(DOCUMENT_STARTS), chunks, -1).sum(dim=(0, 2))
        assert torch.equal(cp.chunk_work(ids, chunks), expected)


@pytest.mark.parametrize("degree", [2, 4])
def test_each_rank_builds_its_rows_of_the_single_process_mask(degree):
    """Simulated ranks: the shards cover every token once, in equal lengths, and the mask of a rank's queries against
    the gathered keys (rank after rank) is the single-process mask at those tokens."""
    ids = ids_with_starts(list(DOCUMENT_STARTS), SEQ_LEN)
    index = torch.arange(SEQ_LEN).expand_as(ids)
    reference = block_causal_reference(ids)
    for positions in (index, document_positions(ids)):
        shards = [cp.shard_documents(fake_mesh(degree, rank), ids, [index, ids, positions]) for rank in range(degree)]
        key_index, key_ids, key_positions = (torch.cat(parts, dim=1) for parts in zip(*shards))
        assert sorted(key_index[0].tolist()) == list(range(SEQ_LEN))
        assert {shard[0].shape[1] for shard in shards} == {SEQ_LEN // degree}
        for query_index, query_ids, query_positions in shards:
            visible = cp.visible_keys(query_ids, query_positions, key_ids, key_positions, flex=False)[:, 0]
            expected = torch.stack([reference[b][query_index[b]][:, key_index[b]] for b in range(ids.shape[0])])
            assert torch.equal(visible, expected)


@pytest.mark.slow
@torch.no_grad()
def test_flex_attention_mask_over_gathered_keys_matches_the_sdpa_mask(monkeypatch):
    """The GPU path (FlexAttention with a BlockMask of a rank's queries against all keys) computes what the CPU path
    (SDPA with booleans) does; FlexAttention runs forward on the CPU too (eager here: compiling takes seconds more;
    even eager, building the mask and attending took 1.6-5 s, hence slow)."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan.nn import attention
    from torchtitan.nn.attention import GatheredDocuments, block_causal_attention

    monkeypatch.setattr(attention, "_compiled_flex_attention", flex_attention)
    degree, rank = 2, 1
    seq_len = 256  # FlexAttention's blocks are 128 tokens: a rank's 128 queries against two blocks of keys
    ids = ids_with_starts([[0, 5, 70, 71, 150, 200]], seq_len)
    positions = document_positions(ids)
    query_ids, query_positions = cp.shard_documents(fake_mesh(degree, rank), ids, [ids, positions])
    key_ids, key_positions = (torch.cat(parts, dim=1) for parts in zip(
        *[cp.shard_documents(fake_mesh(degree, r), ids, [ids, positions]) for r in range(degree)]))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, seq_len // degree, 16, generator=generator)
    k, v = torch.randn(1, 1, seq_len, 16, generator=generator), torch.randn(1, 1, seq_len, 16, generator=generator)
    outputs = [block_causal_attention(q, k, v, GatheredDocuments(cp.visible_keys(
        query_ids, query_positions, key_ids, key_positions, flex=flex), lambda gathered: gathered), "cpu")
        for flex in (True, False)]
    torch.testing.assert_close(*outputs, rtol=1e-4, atol=1e-5)


def test_the_mask_follows_the_models_attention_device():
    """FlexAttention's BlockMask where the model's attention runs on CUDA, even over tensors on the host (a dry run for
    GPUs: the memory of the GPUs' kernel, not of the CPU's dense boolean mask); booleans where it runs on the CPU,
    and by the mesh's device where the model does not say."""
    import dataclasses

    for attention_device, mesh_device, flex in (("cuda", "cpu", True), ("cpu", "cpu", False), (None, "cpu", False),
                                                (None, "cuda", True)):
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(model_args_for("tiny", SEQ_LEN), attention_device=attention_device))
        cp.apply_document_cp(model, SimpleNamespace(device_type=mesh_device, get_group=lambda: None))
        assert model.build_document_mask.flex is flex, (attention_device, mesh_device)


def test_one_document_is_balanced_as_head_tail_does():
    # One causal document cut in chunks of c tokens: chunk i has c^2 i + c(c+1)/2 visible pairs, and chunks s + r and
    # s + 2cp-1-r add up to c^2 (2s + 2cp-1) + c(c+1) for every r: every rank gets exactly the mean.
    ids = ids_with_starts([[]], SEQ_LEN)
    for degree in (2, 4, 8):
        work = cp.chunk_work(ids, cp.CHUNKS_PER_RANK * degree)
        loads = cp.rank_loads(work, cp.balanced_chunk_order(work, degree), degree)
        assert loads.max() == loads.min() == SEQ_LEN * (SEQ_LEN + 1) // 2 // degree


def test_short_and_long_documents_are_balanced_where_head_tail_is_not():
    # CP 2, four chunks of 16 tokens: a 16-token document (136 visible pairs), 32 one-token documents (16 per chunk),
    # and another 16-token document. Head-tail pairs chunks (0, 3) and (1, 2): 272 against 32; by work, the two
    # heavy chunks go to different ranks: 152 each.
    ids = ids_with_starts([[0, *range(16, 48), 48]], SEQ_LEN)
    work = cp.chunk_work(ids, 4)
    assert work.tolist() == [136, 16, 16, 136]
    assert cp.rank_loads(work, cp.head_tail_order(2, 2), 2).tolist() == [272, 32]
    order = cp.balanced_chunk_order(work, 2)
    assert sorted(order) == [0, 1, 2, 3]
    assert cp.rank_loads(work, order, 2).tolist() == [152, 152]


def test_balance_report_prints_every_mix_and_assignment():
    from benchmarks import cp_balance
    from torchtitan.errors import UserError

    lines = cp_balance.report("tiny", 1024, [2], windows=2, seed=0).splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and not line.startswith("| mix")]
    assert [row[0].lstrip("| ") for row in rows] == list(cp_balance.MIXES)
    one_document = rows[-1]
    # Contiguous halves of one causal document: (3/4) / (1/2) of the work on the busier rank; head-tail and by work:
    # exactly the mean (up to the 1 / (2 x seq_len) of the diagonal, below the table's two decimals).
    assert one_document[2] == "1.000" and one_document[5].startswith("1.50")
    assert [cell.split()[0] for cell in one_document[6:]] == ["1.00", "1.00", "1.00"]
    with pytest.raises(UserError, match="--cp: 3 must be at least 2 and 8 x cp must divide --seq_len 1024"):
        cp_balance.report("tiny", 1024, [3], windows=1, seed=0)


def scaling_options(**changes):
    from benchmarks import cp_scaling

    options = {"flavor": "tiny", "n_layers": 1, "seq_len": [512], "cp": [1, 2], "mix": "few long", "warmup": 1,
               "steps": 1, "seed": 0}
    return cp_scaling, SimpleNamespace(**{**options, **changes})


def test_scaling_benchmark_window_and_bad_degrees():
    from torchtitan.errors import UserError

    cp_scaling, options = scaling_options()
    tokens = cp_scaling.window("few long", 1024, 2304, seed=0)
    # "few long": documents of seq/8 to seq/2 tokens, BOS at each start, the first token included.
    starts = (tokens[0] == cp_scaling.BOS).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) >= 2
    assert all(1024 // 8 <= b - a <= 1024 // 2 for a, b in zip(starts, starts[1:]))
    with pytest.raises(UserError, match="--cp: 3 must be at least 1 and 8 x cp must divide --seq_len 512"):
        cp_scaling.measure(SimpleNamespace(**{**vars(options), "cp": [3]}))


@pytest.mark.slow
def test_scaling_benchmark_runs_causal_and_block_causal_side_by_side():
    """A short run of benchmarks/cp_scaling.py (forked CP 1 and CP 2 ranks): a row per degree with both masks' speeds
    and peaks, the counted balance for CP 2 only."""
    cp_scaling, options = scaling_options()
    rows = [line.split(" | ") for line in cp_scaling.measure(options).splitlines() if line.startswith("| 512")]
    assert [row[3] for row in rows] == ["1", "2"]
    assert rows[0][7] == "-" and rows[1][7] != "-"
    assert all(float(cell.replace(",", "")) > 0 for row in rows for cell in row[4:7])


def test_block_causal_with_context_parallelism_options():
    from torchtitan.config import parse_args
    from torchtitan.errors import UserError

    block_causal_cp = ["--model.attention_mask", "block_causal", "--parallelism.context_parallel_degree", "2"]
    assert parse_args([*block_causal_cp, "--model.document_positions"]).parallelism.context_parallel_degree == 2
    with pytest.raises(UserError, match="option parallelism.context_parallel_rotate_method = 'alltoall': does not "
                                        "compose with context parallelism over gathered keys and values .*"
                                        "model.attention_mask = 'block_causal'.*; leave parallelism.context_parallel_rotate_method at "
                                        "'allgather'"):
        parse_args([*block_causal_cp, "--parallelism.context_parallel_rotate_method", "alltoall"])


# ----------------------------------------------------------------------------------------------------------------
# Real processes

def build_model() -> Transformer:
    model = Transformer(model_args_for("tiny", SEQ_LEN))
    model.init_weights(seed=0)
    return model


# The batches of the real-process tests: BATCHES, and one of the data pipeline.
BATCH_NAMES = [*BATCHES, "pipeline"]


@pytest.fixture(scope="module")
def pipeline_batch(tmp_path_factory) -> Path:
    """One batch of the data pipeline: two sources of token shards (written by the shard writer that
    scripts/tokenize_dataset.py uses, documents encoded as it encodes them), mixed 0.6 / 0.4 (training.sources), two
    windows of SEQ_LEN tokens with the tokenizer's BOS at document starts. Documents of a few to a dozen tokens: they
    cross the chunks of CP 2 (4 tokens) and CP 4 (2 tokens) and the ranks' shares. (The trainer on shards that
    tokenize_dataset.py wrote, under CP 2: tests/integration/test_document_mask.py, slow.)"""
    from torchtitan.components.datasets import build_dataloader
    from torchtitan.components.datasets.shards import shard_name, token_dtype, write_manifest, write_shard
    from torchtitan.components.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("")
    folder = tmp_path_factory.mktemp("pipeline")
    sources = []
    for name, weight in (("web", 0.6), ("code", 0.4)):
        texts = [" ".join(f"{name}{word}" for word in range(doc % 5 + 1)) for doc in range(12)]
        documents = [tokenizer.encode(text, add_bos=True, add_eos=True) for text in texts]
        (folder / name).mkdir()
        shards = [write_shard(folder / name, shard_name(shard), documents[shard * 6:(shard + 1) * 6],
                              token_dtype(tokenizer.vocab_size)) for shard in range(2)]
        write_manifest(folder / name, tokenizer, shards, source=name, text_field="text")
        sources.append(f"{folder / name}:{weight}")
    loader = build_dataloader(dataset="x", dataset_path=None, text_field="text", tokenizer=tokenizer, seq_len=SEQ_LEN,
                              local_batch_size=2, dp_rank=0, dp_degree=1, infinite=True, sources=sources)
    inputs, labels = next(iter(loader))
    text = [tokenizer.decode(row) for row in inputs.tolist()]
    assert any("web" in row for row in text) and any("code" in row for row in text), "a window of each source"
    torch.save({"inputs": inputs, "labels": labels, "bos": tokenizer.bos_id}, folder / "batch.pt")
    return folder / "batch.pt"


def batch(name: str, pipeline: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(inputs, labels, BOS id) of a test batch."""
    if name == "pipeline":
        saved = torch.load(pipeline)
        return saved["inputs"], saved["labels"], saved["bos"]
    vocab = model_args_for("tiny", SEQ_LEN).vocab_size
    tokens = torch.randint(BOS + 1, vocab, (len(BATCHES[name]), SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(1))
    for row, starts in enumerate(BATCHES[name]):
        tokens[row, starts] = BOS
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), BOS


def masking(inputs: torch.Tensor, bos: int, restart_positions: bool) -> dict[str, torch.Tensor]:
    """What the trainer passes the model (Trainer._masking): positions always, under context parallelism."""
    ids = document_ids(inputs, bos)
    positions = document_positions(ids) if restart_positions else torch.arange(SEQ_LEN).expand_as(ids)
    return {"document_ids": ids, "positions": positions}


def loss_and_grads(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor, **model_inputs) -> dict:
    model.zero_grad(set_to_none=True)
    logits = model(inputs, **model_inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    loss.backward()
    return {"loss": loss.detach(), "grads": {name: p.grad for name, p in model.named_parameters()}}


def cp_worker(rank: int, world_size: int, store_path: str, out_dir: str, pipeline: Path) -> None:
    """CP 2 on ranks (0, 1) and (2, 3) side by side, then CP 4 on all: one start of four processes for both."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        meshes = {2: dist.device_mesh.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "cp"))["cp"],
                  4: dist.device_mesh.DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("cp",))}
        for degree, mesh in meshes.items():
            model = build_model()
            cp.apply_document_cp(model, mesh)
            for name, restart_positions in itertools.product(BATCH_NAMES, (False, True)):
                inputs, labels, bos = batch(name, pipeline)
                model_inputs = masking(inputs, bos, restart_positions)
                inputs, labels, *sharded = cp.shard_documents(mesh, model_inputs["document_ids"],
                                                              [inputs, labels, *model_inputs.values()])
                result = loss_and_grads(model, inputs, labels, **dict(zip(model_inputs, sharded)))
                for tensor in (result["loss"], *result["grads"].values()):
                    dist.all_reduce(tensor, group=mesh.get_group())
                if rank == 0:
                    torch.save(result, Path(out_dir) / f"cp{degree}_{name}_restart{restart_positions}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory, pipeline_batch) -> Path:
    tmp = tmp_path_factory.mktemp("cp_documents")
    join_forked(cp_worker, (4, str(tmp / "store"), str(tmp), pipeline_batch), 4, 120, "4 context-parallel workers")
    return tmp


@pytest.mark.smoke
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("restart_positions", [False, True])
@pytest.mark.parametrize("name", BATCH_NAMES)
def test_losses_and_gradients_match_one_process(cp_results, pipeline_batch, name, degree, restart_positions):
    """fp32 on both sides; what differs is the order of the sums (attention over gathered keys in another order,
    gradients summed over ranks), of at most a few thousand terms: far below 1e-5 relative to the largest term. The
    bound scales with a gradient's largest entry (fp32 rounds relative to magnitude): with random tokens entries are
    of order 1; the pipeline batch repeats tokens (BOS, EOS, the sources' words), whose output rows sum tens of
    terms (entries up to about 40)."""
    model = build_model()
    inputs, labels, bos = batch(name, pipeline_batch)
    model_inputs = masking(inputs, bos, restart_positions)
    if not restart_positions:
        # One process uses its RoPE table in order, as the trainer does without context parallelism.
        del model_inputs["positions"]
    reference = loss_and_grads(model, inputs, labels, **model_inputs)
    if name == "pipeline":
        # Both sources' documents, several per window: the mask is not causal's.
        assert all(row.count(bos) >= 3 for row in inputs.tolist())
    if name == "documents":
        work = cp.chunk_work(document_ids(inputs, BOS), cp.CHUNKS_PER_RANK * degree)
        assert cp.balanced_chunk_order(work, degree) != cp.head_tail_order(degree, cp.CHUNKS_PER_RANK)
        # The mask matters for this batch (for the gradients above all: at initialisation the loss hardly depends
        # on what tokens attend to), far beyond the tolerance below: a CP run that ignored it could not match.
        causal = loss_and_grads(model, inputs, labels)
        assert max((causal["grads"][key] - grad).abs().max() for key, grad in reference["grads"].items()) > 1e-2
    result = torch.load(cp_results / f"cp{degree}_{name}_restart{restart_positions}.pt")
    torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=0)
    assert result["grads"].keys() == reference["grads"].keys()
    for name, grad in result["grads"].items():
        difference = (grad - reference["grads"][name]).abs().max().item()
        largest = reference["grads"][name].abs().max().item()
        assert difference <= 1e-5 * max(1.0, largest), f"{name}: gradient differs by {difference:.3g} (largest entry {largest:.3g})"


def test_per_op_activation_checkpointing_saves_flex_attention():
    """Per-op AC keeps attention's output, whichever kernel ran it: on GPUs FlexAttention (over gathered keys, or
    packed documents) and the compiled region that runs it, as SDPA's, instead of running attention again in
    backward (what the planner counts for per-op AC)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from torchtitan.distributed.activation_checkpoint import _per_op_policy

    policy = _per_op_policy()
    context = SimpleNamespace(is_recompute=False)
    for op in (torch.ops.higher_order.flex_attention, torch.ops.higher_order.inductor_compiled_code,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert policy(context, op) == CheckpointPolicy.MUST_SAVE, op
    assert policy(context, torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
