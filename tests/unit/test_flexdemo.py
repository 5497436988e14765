"""FlexDeMo with two real replicas (gloo, forked processes): what is exchanged, what stays local, what is saved."""

import datetime
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.forked_ranks import run_ranks
from torchtitan.components.optimizers.flexdemo import (FlexDeMo, dct_matrix, from_rows, payload_bytes,
                                                      tile_dct_matrix, tile_shape, to_rows, top_k_indices)

# A deprecated torch API (all_gather_into_tensor and reduce_scatter_tensor were) fails here, not in users' logs.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

REPLICAS = 2
CHUNK, TOPK = 64, 8


def test_dct_is_orthonormal():
    dct = dct_matrix(CHUNK, torch.device("cpu"))
    assert torch.allclose(dct @ dct.T, torch.eye(CHUNK), atol=1e-5)


def test_payload_is_under_a_tenth_of_an_fp32_ring_all_reduce():
    for shape in [(64, 64), (4096,)]:  # 64 tiles of 8 x 8, 64 chunks of 64
        all_reduce = 2 * (REPLICAS - 1) / REPLICAS * 4 * 4096  # bytes a rank sends in a ring all-reduce of fp32
        assert payload_bytes(shape, CHUNK, TOPK) / all_reduce == pytest.approx(3 * TOPK / (4 * CHUNK))
        assert payload_bytes(shape, CHUNK, TOPK) / all_reduce < 0.1


def test_tile_transform_is_the_2d_dct_of_each_tile():
    """A matrix's row r is tile (r // tiles across, r % tiles across) of the zero-padded matrix, flattened row-major,
    and its transform is the 2-D DCT-II of that tile: C[u, v] = a(u) a(v) sum_x sum_y X[x, y] cos(pi (2x + 1) u / 2h)
    cos(pi (2y + 1) v / 2w), a(0) = sqrt(1/n), else sqrt(2/n). 10 x 13 pads to 2 x 2 tiles of 8 x 8."""
    assert tile_shape(64) == (8, 8) and tile_shape(128) == (8, 16) and tile_shape(61) == (1, 61)
    matrix = torch.randn(10, 13, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = to_rows(matrix.float(), CHUNK)
    assert rows.shape == (4, CHUNK) and torch.equal(from_rows(rows, (10, 13), CHUNK), matrix.float())
    coefficients = rows.double() @ tile_dct_matrix(CHUNK, torch.device("cpu")).double().T
    padded = torch.zeros(16, 16, dtype=torch.float64)
    padded[:10, :13] = matrix
    x = torch.arange(8, dtype=torch.float64)
    scale = torch.full((8,), math.sqrt(2 / 8), dtype=torch.float64)
    scale[0] = math.sqrt(1 / 8)
    cosines = torch.cos(math.pi * (2 * x[None, :] + 1) * x[:, None] / 16) * scale[:, None]  # [u, x]
    for row in range(4):
        tile = padded[8 * (row // 2):8 * (row // 2 + 1), 8 * (row % 2):8 * (row % 2 + 1)]
        expected = torch.einsum("ux,vy,xy->uv", cosines, cosines, tile)
        # fp32 transform of 64 terms: a few fp32 roundings of values of order 1.
        assert torch.allclose(coefficients[row].view(8, 8), expected, atol=1e-5)


def test_top_k_indices_are_the_largest_magnitudes_and_always_k_distinct_positions():
    # Well separated magnitudes, random signs and order: exactly torch.topk's choice.
    generator = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(CHUNK, generator=generator) for _ in range(300)]).float() + 1
    rows *= torch.randint(0, 2, rows.shape, generator=generator) * 2 - 1
    expected = rows.abs().topk(TOPK, dim=1).indices.sort(dim=1).values
    assert torch.equal(top_k_indices(rows, TOPK).sort(dim=1).values, expected)
    # Ties (an all-zero chunk, equal values) are broken by position: k distinct positions, the lowest; tiny values
    # still beat zeros.
    ties = torch.zeros(3, CHUNK)
    ties[1, 40:] = -2.0
    ties[2, ::2] = 1e-30
    chosen = top_k_indices(ties, TOPK).sort(dim=1).values
    assert chosen.tolist() == [list(range(TOPK)), list(range(40, 40 + TOPK)), list(range(0, 2 * TOPK, 2))]


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
        weight = torch.nn.Parameter(torch.randn(30, 20, generator=torch.Generator().manual_seed(0)))
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
        momentum = optimizer.state[weight]["momentum"].clone()
        saved = optimizer.state_dict()
        torch.save({"weight": weight.detach().clone(), "start": start, "momentum": momentum,
                    "saved_momentum": saved["state"][0]["momentum"].clone(), "sent_bytes": optimizer.sent_bytes,
                    "live_after_save": optimizer.state[weight]["momentum"].clone(),
                    "replica_state": optimizer.replica_state()[weight]["momentum"].clone()},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(worker, tmp_path_factory.mktemp("flexdemo"), REPLICAS, 60, "FlexDeMo")


def test_replicas_stay_identical_while_their_momenta_differ(results):
    first, second = results
    assert torch.equal(first["weight"], second["weight"])
    assert not torch.equal(first["weight"], first["start"])
    assert not torch.allclose(first["momentum"], second["momentum"])
    # Sign updates: every weight moved by at most lr per step.
    assert (first["weight"] - first["start"]).abs().max() <= 3 * 0.01 + 1e-6


def test_saving_saves_the_mean_momentum_and_leaves_each_replicas_own(results):
    """The mean reshards to any layout; the live momenta are not touched (saving must not change training), and
    each replica's own is what the checkpoint keeps for an exact resume."""
    mean = (results[0]["momentum"] + results[1]["momentum"]) / 2
    for rank_results in results:
        assert torch.allclose(rank_results["saved_momentum"], mean, atol=1e-6)
        assert torch.equal(rank_results["live_after_save"], rank_results["momentum"])
        assert torch.equal(rank_results["replica_state"], rank_results["momentum"])
    assert torch.equal(results[0]["saved_momentum"], results[1]["saved_momentum"])


def test_bytes_sent_per_step(results):
    # 600 values: 10 chunks of 64 (padded), 8 coefficients each, 3 bytes per coefficient, 3 steps.
    assert results[0]["sent_bytes"] == 3 * payload_bytes((600,), CHUNK, TOPK) == 3 * 10 * 8 * 3


def test_importing_the_trainer_loads_no_compiler():
    """FlexDeMo's selection is compiled on first use, not when the optimizer registry imports it: inductor's code
    generator takes most of a second of every trainer process's start-up, runs without compile included."""
    import subprocess
    import sys

    check = "import sys, torchtitan.train; print('torch._inductor.compile_fx' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "False"
