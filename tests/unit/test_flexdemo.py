"""FlexDeMo with two real replicas (gloo, forked processes): what is exchanged, what stays local, what is saved."""

import datetime
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.forked_ranks import run_ranks
from torchtitan.components.optimizers.flexdemo import (FlexDeMo, chunk_length, dct_matrix, from_tiles, payload_bytes,
                                                      tile_shape, to_tiles, transform)

# A deprecated torch API (all_gather_into_tensor and reduce_scatter_tensor were) fails here, not in users' logs.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

REPLICAS = 2
CHUNK, TOPK = 64, 32


def test_dct_is_orthonormal():
    dct = dct_matrix(CHUNK, torch.device("cpu"))
    assert torch.allclose(dct @ dct.T, torch.eye(CHUNK), atol=1e-5)


def test_chunks_are_the_largest_divisor_up_to_the_chunk_size():
    """DeMo's reference's `_get_smaller_split`: chunks cover a dimension exactly."""
    assert [chunk_length(n, 64) for n in (4096, 2304, 1152, 768, 100, 30, 127, 1)] == [64, 64, 64, 64, 50, 30, 1, 1]
    assert tile_shape((256, 768), 64) == (64, 64) and tile_shape((100, 127), 64) == (50, 1)
    assert tile_shape((256,), 64) == (1, 64)  # a vector's chunks are one-row tiles


def test_payload_of_the_reference_defaults():
    """32 of each 64 x 64 tile's 4096 coefficients, 6 bytes each (int16 index, fp32 value): 0.047 bytes per value,
    1.2% of what a rank sends in a ring all-reduce of fp32 gradients at 2 replicas."""
    all_reduce = 2 * (REPLICAS - 1) / REPLICAS * 4 * 256 * 768
    assert payload_bytes((256, 768), CHUNK, TOPK) == 4 * 12 * 32 * 6  # 4 x 12 tiles
    assert payload_bytes((256, 768), CHUNK, TOPK) / all_reduce == pytest.approx(6 * 32 / (4 * 4096))
    assert payload_bytes((11,), CHUNK, TOPK) == 11 * 6  # one 11-value chunk: all 11 sent
    assert payload_bytes((0, 20), CHUNK, TOPK) == 0


def test_tile_transform_is_the_2d_dct_of_each_tile():
    """A matrix's row t of `to_tiles` is tile (t // tiles across, t % tiles across), flattened row-major, and its
    transform is the 2-D DCT-II of that tile: C[u, v] = a(u) a(v) sum_x sum_y X[x, y] cos(pi (2x + 1) u / 2h)
    cos(pi (2y + 1) v / 2w), a(0) = sqrt(1/n), else sqrt(2/n). 16 x 12 at chunk 8: 2 x 2 tiles of 8 x 6."""
    matrix = torch.randn(16, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tiles = to_tiles(matrix.float(), 8)
    assert tiles.shape == (4, 48) and torch.equal(from_tiles(tiles, (16, 12), 8), matrix.float())
    coefficients = transform(tiles, 8, 6)
    assert torch.allclose(transform(coefficients, 8, 6, inverse=True), tiles, atol=1e-6)

    def cosines(n: int) -> torch.Tensor:  # [u, x]
        x = torch.arange(n, dtype=torch.float64)
        scale = torch.full((n,), math.sqrt(2 / n), dtype=torch.float64)
        scale[0] = math.sqrt(1 / n)
        return torch.cos(math.pi * (2 * x[None, :] + 1) * x[:, None] / (2 * n)) * scale[:, None]

    for row in range(4):
        tile = matrix[8 * (row // 2):8 * (row // 2 + 1), 6 * (row % 2):6 * (row % 2 + 1)]
        expected = torch.einsum("ux,vy,xy->uv", cosines(8), cosines(6), tile)
        # fp32 transform of 48 terms: a few fp32 roundings of values of order 1.
        assert torch.allclose(coefficients[row].view(8, 6).double(), expected, atol=1e-5)


def test_a_rank_without_gradients_joins_the_exchange_with_a_tensor_on_its_parameters_device(monkeypatch):
    """NCCL rejects a CPU tensor: the empty payload lives where the parameters do (meta here, for any device)."""
    sent = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_single", lambda output, payload, group=None: sent.append(payload))
    weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    FlexDeMo([weight], lr=0.01, weight_decay=0.0, chunk_size=CHUNK, topk=TOPK, momentum_decay=0.9,
             replicate_group=None).step()
    assert sent[0].numel() == 0 and sent[0].device.type == "meta"


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store", REPLICAS), rank=rank,
                            world_size=REPLICAS, timeout=datetime.timedelta(seconds=60))
    try:
        weight = torch.nn.Parameter(torch.randn(32, 20, generator=torch.Generator().manual_seed(0)))
        empty = torch.nn.Parameter(torch.zeros(0, 20))  # an uneven shard can be empty
        optimizer = FlexDeMo([weight, empty], lr=0.01, weight_decay=0.0, chunk_size=CHUNK, topk=TOPK,
                             momentum_decay=0.9, replicate_group=dist.group.WORLD)
        start = weight.detach().clone()
        optimizer.step()  # no gradients yet: nothing sent and nothing changed, but the exchange is still joined
        assert torch.equal(weight, start) and not optimizer.state
        generator = torch.Generator().manual_seed(rank)  # every replica sees other gradients
        for _ in range(3):
            weight.grad = torch.randn(weight.shape, generator=generator)
            empty.grad = torch.zeros(0, 20)
            optimizer.step()
        delta = optimizer.state[weight]["delta"].clone()
        collectives = []  # the tensors of every collective issued while saving
        for name in ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "broadcast"):
            original = getattr(dist, name)
            setattr(dist, name, lambda tensor, *args, _original=original, **kwargs: (
                collectives.append(tensor), _original(tensor, *args, **kwargs))[1])
        saved = optimizer.state_dict()
        torch.save({"weight": weight.detach().clone(), "start": start, "delta": delta,
                    "saved_delta": saved["state"][0]["delta"].clone(), "sent_bytes": optimizer.sent_bytes,
                    "live_after_save": optimizer.state[weight]["delta"].clone(),
                    "replica_state": optimizer.replica_state()[weight]["delta"].clone(),
                    "save_collectives": len(collectives)},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(worker, tmp_path_factory.mktemp("flexdemo"), REPLICAS, 60, "FlexDeMo")


def test_replicas_stay_identical_while_their_deltas_differ(results):
    first, second = results
    assert torch.equal(first["weight"], second["weight"])
    assert not torch.equal(first["weight"], first["start"])
    assert not torch.allclose(first["delta"], second["delta"])
    # Sign updates: every weight moved by at most lr per step.
    assert (first["weight"] - first["start"]).abs().max() <= 3 * 0.01 + 1e-6


def test_saving_sends_nothing_across_replicas_and_leaves_each_replicas_own(results):
    """Saving reads each replica's own delta, with no collective (it had all-reduced the fp32 deltas across the
    replicas, the link FlexDeMo spares, to save their mean); the live deltas are not touched (saving must not change
    training), and each replica's own is what the checkpoint keeps for every resume."""
    for rank_results in results:
        assert rank_results["save_collectives"] == 0
        assert torch.equal(rank_results["saved_delta"], rank_results["delta"])
        assert torch.equal(rank_results["live_after_save"], rank_results["delta"])
        assert torch.equal(rank_results["replica_state"], rank_results["delta"])


def test_a_resume_into_more_replicas_continues_each_from_a_saved_ones_delta(monkeypatch):
    """A checkpoint of 2 replicas loaded by replica 3 of 4: the template's key of its own delta is renamed to saved
    replica 1's (3 mod 2), which the container's load copies into the live delta. Compression's verbatim state is
    not moved between replicas, and a layout whose shapes differ loads nothing verbatim."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    from torchtitan.components.checkpoint.loading import exact_where_it_fits
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import parse_args

    def metadata(*shape):
        return TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape),
                                     chunks=[])

    saved = {f"optimizer.exact.weight.delta.replica{r}of2": metadata(32, 20) for r in range(2)}
    saved["optimizer.exact.compression.weight.replica1of2"] = metadata(2, 640)
    template = {"exact.weight.delta.replica3of4": torch.zeros(32, 20), "state.weight.delta": torch.zeros(32, 20),
                "exact.compression.weight.replica3of4": torch.zeros(2, 640),
                "exact.bias.delta.replica3of4": torch.zeros(32)}
    assert set(exact_where_it_fits(template, {**saved, "optimizer.exact.bias.delta.replica0of2": metadata(16)},
                                   "optimizer.")) == {"exact.weight.delta.replica1of2", "state.weight.delta"}

    # The container's load, on one process playing replica 3 of 4.
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_single", lambda output, payload, group=None: output.copy_(payload))
    monkeypatch.setattr("torchtitan.components.optimizer.replica_suffix", lambda group: ".replica3of4")
    model = torch.nn.Sequential()
    model.register_parameter("weight", torch.nn.Parameter(torch.randn(32, 20)))
    config = parse_args(["--optimizer.name", "FlexDeMo"]).optimizer
    optimizers = build_optimizers([model], config)
    state = exact_where_it_fits(optimizers.state_dict(), saved, "optimizer.")
    # DCP fills the template's tensors in place, in an order of its own: here the per-replica entry first, then the
    # optimizer's own entry (the copy of the replica DCP wrote, replica 0's), which must not land in the live delta.
    replicas = [torch.randn(32, 20, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    state["exact.weight.delta.replica1of2"].copy_(replicas[1])
    state["state.weight.delta"].copy_(replicas[0])
    optimizers.load_state_dict(state)
    assert torch.equal(optimizers.optimizers[0].state[model.weight]["delta"], replicas[1])


def test_bytes_sent_per_step(results):
    # 32 x 20 values: tiles of 32 x 20 (each side its largest divisor up to 64), one tile; 32 coefficients of it,
    # 6 bytes each, 3 steps.
    assert results[0]["sent_bytes"] == 3 * payload_bytes((32, 20), CHUNK, TOPK) == 3 * 32 * 6


def test_importing_the_trainer_loads_no_compiler():
    """Nothing the trainer imports (the optimizer registry among it) loads inductor at import: its code generator
    takes most of a second of every trainer process's start-up, runs without compile included."""
    import subprocess
    import sys

    check = "import sys, torchtitan.train; print('torch._inductor.compile_fx' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "False"


def test_an_earlier_flexdemo_checkpoint_is_refused_with_one_clear_error():
    """Checkpoints of FlexDeMo before DeMo's step hold `momentum` (gradient units), not DeMo's lr-scaled `delta`:
    loading names the key and why, instead of DCP's "missing key" of a corrupt checkpoint."""
    from torchtitan.components.checkpoint.loading import require_saved_optimizer_state
    from torchtitan.errors import UserError

    template = {"state.layers.0.attention.wq.weight.delta": torch.zeros(2),
                "exact.layers.0.attention.wq.weight.delta.replica0of2": torch.zeros(2)}
    saved = {"optimizer.state.layers.0.attention.wq.weight.momentum": None}
    with pytest.raises(UserError, match=r"holds no optimizer.state.layers.0.attention.wq.weight.delta: .* an earlier "
                                        r"FlexDeMo's: its momentum, in units of the gradient, became DeMo's delta"):
        require_saved_optimizer_state(Path("ckpt"), template, saved)
    require_saved_optimizer_state(Path("ckpt"), template, {"optimizer.state.layers.0.attention.wq.weight.delta": None})
