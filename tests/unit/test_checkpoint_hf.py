"""Hugging Face import and export of a sharded or pipelined model hold a rank's share of the model, never all of it.

The host memory a step adds is measured in forked ranks on gloo, two ways: the peak resident set size (VmHWM, reset
through /proc/self/clear_refs just before the step) minus the resident size before it, and the peak of the private
(anonymous) part alone, sampled every 0.2 ms. The import reads memory-mapped files: the pages it touches count as
resident file pages, at the file system's page-cache granularity (ext4 maps large folios, up to 2 MiB, so a slice
of a small tensor can map more than its bytes), and are shared by the ranks of a host; its private memory is what
it allocates. The model (64 MiB in fp32) is larger than the tiny one, so that its quarter stands above the noise.
"""

import ctypes
import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.unit.test_checkpoint import run_forked
from torchtitan.components.checkpoint.hf import export_hf_from_dcp, load_hf_model
from torchtitan.components.checkpoint.hf_folder import load_hf, save_hf
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.pipeline import build_stage_module, split_into_stages
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

MODEL_ARGS = dataclasses.replace(model_args_for("debugmodel", 32), dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                 vocab_size=4096)
ADAPTER = Llama3StateDictAdapter(MODEL_ARGS)
MIB = 2**20
# Python objects, the allocator's arenas and torch's bookkeeping: what a step adds besides tensors.
SLACK = 6 * MIB


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def added_peak_bytes(step) -> tuple[int, int]:
    """The peak resident memory, and the peak private memory, that `step()` adds to this process."""
    # Freed heap memory that the allocator kept would serve the step's allocations unseen: return it first.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before, before_private = status_kib("VmRSS"), status_kib("RssAnon")
    peak_private = [before_private]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_private[0] = max(peak_private[0], status_kib("RssAnon"))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    peak_private[0] = max(peak_private[0], status_kib("RssAnon"))
    return (status_kib("VmHWM") - before) * 1024, (peak_private[0] - before_private) * 1024


def reference_model() -> Transformer:
    model = Transformer(MODEL_ARGS)
    model.init_weights(seed=0)
    return model


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in get_model_state_dict(model).items()}


def init_group(rank: int, world_size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world_size), rank=rank,
                            world_size=world_size)


def fsdp_model(world_size: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(MODEL_ARGS)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def import_worker(rank: int, world_size: int, tmp: str, layout: str) -> None:
    init_group(rank, world_size, tmp)
    try:
        if layout == "fsdp":
            part = fsdp_model(world_size)
        else:
            with torch.device("meta"):
                whole = Transformer(MODEL_ARGS)
            part = build_stage_module(whole, split_into_stages(whole, world_size)[rank])
            part.to_empty(device="cpu")
        with torch.no_grad():
            for param in part.parameters():
                param.zero_()
        added, private = added_peak_bytes(lambda: load_hf_model([part], Path(tmp) / "hf", ADAPTER))
        model_bytes = tensor_bytes(reference_model().parameters())
        largest = max(p.numel() * p.element_size() for p in reference_model().parameters())
        share = model_bytes / world_size if layout == "fsdp" else tensor_bytes(part.parameters())
        Path(tmp, f"import-{layout}-{rank}.txt").write_text(f"{added} {private} {share} {largest} {model_bytes}")
        # Private memory: one block being converted at a time. Resident, with the mapped pages: this rank's share
        # of the files, plus, for blocks of tensors (FSDP), the rest of the page-cache folios they start and end in
        # (up to 2 MiB each on ext4: up to 1.5 shares more for this small model, little for a large one's tensors).
        assert private <= largest + SLACK, (private / MIB, largest / MIB)
        granularity = 1.5 * share if layout == "fsdp" else 0
        assert added <= share + granularity + largest + SLACK, (added / MIB, share / MIB, largest / MIB)
        assert added < model_bytes
        # The weights equal what the whole-folder reader gives.
        expected = load_hf(Path(tmp) / "hf", ADAPTER)
        loaded = full_tensors(part)
        assert loaded and all(torch.equal(tensor, expected[name]) for name, tensor in loaded.items())
    finally:
        dist.destroy_process_group()


# Small: the bytes read are counted, not measured in the process's memory.
SMALL_ARGS = dataclasses.replace(MODEL_ARGS, dim=256, n_layers=2, vocab_size=1024)


def fsdp_tp_import_worker(rank: int, world_size: int, tmp: str) -> None:
    """FSDP 2 x TP 2, as the trainer applies them: FSDP gives the row-split matrices (wq, wk, wv, w1, w3, output)
    a _StridedShard placement, whose local part is still one block of rows."""
    from torchtitan.distributed.fsdp import apply_fsdp
    from torchtitan.distributed.tensor_parallel import apply_tp

    init_group(rank, world_size, tmp)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        with torch.device("meta"):
            model = Transformer(SMALL_ARGS)
        apply_tp(model, mesh["tp"], loss_parallel=True, async_tp=False)
        apply_fsdp(model, mesh["dp_shard"], param_dtype="float32", reduce_dtype="float32", pp_enabled=False,
                   cpu_offload=False, reshard_policy="default")
        model.to_empty(device="cpu")
        state = get_model_state_dict(model)
        assert any("_StridedShard" in str(value.placements) for value in state.values())
        read = load_hf_model([model], Path(tmp) / "hf", Llama3StateDictAdapter(SMALL_ARGS))
        # Every block is whole query/key heads here (a TP rank's heads, split in two by FSDP: 2 of 8 query heads,
        # 1 of 4 key heads), so the rank reads exactly its blocks: a quarter of each matrix, half of each norm
        # (FSDP splits the norms, TP replicates them). The whole model is 4x that and more.
        local_bytes = tensor_bytes(value.to_local() for value in state.values())
        assert read == local_bytes, (read, local_bytes)
        assert read < tensor_bytes(Transformer(SMALL_ARGS).parameters()) / 3
        expected = load_hf(Path(tmp) / "hf", Llama3StateDictAdapter(SMALL_ARGS))
        loaded = full_tensors(model)
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(tensor, expected[name]) for name, tensor in loaded.items())
    finally:
        dist.destroy_process_group()


def test_hf_import_under_fsdp_and_tp_reads_only_this_ranks_blocks(tmp_path):
    small = Transformer(SMALL_ARGS)
    small.init_weights(seed=0)
    save_hf(tmp_path / "hf", small.state_dict(), Llama3StateDictAdapter(SMALL_ARGS), max_shard_bytes=MIB)
    run_forked(fsdp_tp_import_worker, 4, str(tmp_path))


@pytest.mark.parametrize("layout, world_size", [pytest.param("fsdp", 4, marks=pytest.mark.slow), ("pipeline", 2)])
def test_hf_import_reads_only_this_ranks_share(tmp_path, layout, world_size):
    save_hf(tmp_path / "hf", reference_model().state_dict(), ADAPTER, max_shard_bytes=8 * MIB)
    run_forked(import_worker, world_size, str(tmp_path), layout)


def export_worker(rank: int, world_size: int, tmp: str, max_shard_bytes: int) -> None:
    init_group(rank, world_size, tmp)
    try:
        model = fsdp_model(world_size)
        reference = reference_model().state_dict()
        with torch.no_grad():
            for name, value in get_model_state_dict(model).items():
                value.to_local().copy_(distribute_tensor(
                    reference[name], value.device_mesh, value.placements, src_data_rank=None).to_local())
        scratch = Path(tmp) / "scratch"
        dcp.save({"model": {name: value.to(torch.bfloat16) for name, value in get_model_state_dict(model).items()}},
                 checkpoint_id=scratch)
        if rank == 0:
            added, private = added_peak_bytes(lambda: export_hf_from_dcp(scratch, Path(tmp) / "hf", ADAPTER,
                                                                         torch.bfloat16, max_shard_bytes))
            bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in reference.items()}
            largest = max(tensor_bytes([t]) for t in bf16.values())
            Path(tmp, "export.txt").write_text(f"{added} {private} {max_shard_bytes} {largest} "
                                               f"{tensor_bytes(bf16.values())}")
            # Two shards (one being serialised) and one tensor being converted, far below the model.
            assert added <= 2 * max_shard_bytes + 2 * largest + SLACK, (added / MIB, max_shard_bytes / MIB)
    finally:
        dist.destroy_process_group()


def test_hf_export_streams_one_shard_at_a_time(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = reference_model()
    bf16_bytes = tensor_bytes(model.parameters()) // 2
    max_shard_bytes = math.ceil(bf16_bytes / 8)
    run_forked(export_worker, 2, str(tmp_path), max_shard_bytes)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 8
    # transformers loads the export, and computes the logits of our model with the exported (bf16) weights.
    exported = load_hf(tmp_path / "hf", ADAPTER)
    assert all(torch.equal(exported[name], value.to(torch.bfloat16)) for name, value in model.state_dict().items())
    model.load_state_dict({name: value.float() for name, value in exported.items()})
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf_model(tokens).logits, atol=1e-4, rtol=0)
