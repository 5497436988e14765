"""GaLore-AdamW and Muon: their math on plain tensors, and the same steps on DTensor parameters of every placement
the trainer's layouts give them (FSDP Shard(0), TP Shard(0)/Shard(1), HSDP, FSDP x TP)."""

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.unit.forked_ranks import run_ranks
from torchtitan.components.metrics import communication_metrics
from torchtitan.components.optimizer import OptimizersContainer, sent_bytes
from torchtitan.components.optimizers import optimizer_spec
from torchtitan.components.optimizers.galore import GaLoreAdamW, rotate_moments, top_subspace
from torchtitan.components.optimizers import muon
from torchtitan.components.optimizers.muon import Muon, newton_schulz, spread
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer


def test_newton_schulz_is_nearly_orthogonal():
    """Five quintic iterations put every singular value of a random (badly conditioned) matrix into [0.6, 1.25],
    for tall and wide matrices; the input's singular values spread over two orders of magnitude (as a gradient's do)."""
    generator = torch.Generator().manual_seed(0)
    for shape in [(64, 256), (256, 64), (128, 128)]:
        left = torch.linalg.qr(torch.randn(shape[0], min(shape), generator=generator)).Q
        right = torch.linalg.qr(torch.randn(shape[1], min(shape), generator=generator)).Q
        matrix = left @ torch.diag(torch.logspace(0, -2, min(shape))) @ right.T
        singular = torch.linalg.svdvals(newton_schulz(matrix, steps=5))
        assert 0.6 <= singular.min() and singular.max() <= 1.25, (shape, singular.min(), singular.max())
        # The same singular vectors: the result is the input's polar factor up to the singular values' errors.
        polar = left @ right.T
        assert (newton_schulz(matrix, steps=5) - polar).norm() / polar.norm() < 0.3


def test_randomized_svd_finds_the_exact_subspace():
    """On a gradient-like matrix (decaying spectrum plus noise) the randomized range finder's rank-16 subspace is
    that of the exact SVD: the cosines of the principal angles between them are all above 0.99."""
    generator = torch.Generator().manual_seed(0)
    m, n, rank = 96, 160, 16
    left = torch.linalg.qr(torch.randn(m, m, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(n, m, generator=generator)).Q
    matrix = left @ torch.diag(0.8 ** torch.arange(m, dtype=torch.float32)) @ right.T
    matrix += 1e-4 * torch.randn(m, n, generator=generator)
    exact = top_subspace(matrix, rank, "exact")
    randomized = top_subspace(matrix, rank, "randomized", torch.Generator().manual_seed(1))
    assert exact.shape == randomized.shape == (m, rank)
    assert torch.allclose(randomized.T @ randomized, torch.eye(rank), atol=1e-5)
    cosines = torch.linalg.svdvals(exact.T @ randomized)
    assert cosines.min() > 0.99, cosines


def galore_model() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(24, 40), (40, 24), (8,)]]


def test_galore_keeps_rank_r_moments_and_the_projector():
    """Wide matrices project their rows (moments r x n), tall ones their columns (m x r); the projector is state."""
    wide, tall, vector = galore_model()
    optimizer = GaLoreAdamW([{"params": [wide, tall], "matrix_method": True}, {"params": [vector]}], lr=1e-2, rank=6)
    for p in (wide, tall, vector):
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.state[wide]["exp_avg"].shape == optimizer.state[wide]["exp_avg_sq"].shape == (6, 40)
    assert optimizer.state[wide]["projector"].shape == (24, 6)
    assert optimizer.state[tall]["exp_avg"].shape == (40, 6)
    assert optimizer.state[tall]["projector"].shape == (24, 6)
    assert optimizer.state[vector]["exp_avg"].shape == (8,)
    # The default rank: a quarter of the smaller side.
    default = GaLoreAdamW([{"params": [wide], "matrix_method": True}], lr=1e-2)
    default.step()
    assert default.state[wide]["exp_avg"].shape == (6, 40)


def test_galore_refreshes_the_subspace_every_update_gap_steps(caplog):
    caplog.set_level("INFO", logger="torchtitan")
    (wide, *_) = galore_model()
    optimizer = GaLoreAdamW([{"params": [wide], "matrix_method": True}], lr=1e-2, rank=4, update_gap=3)
    projectors = []
    for _ in range(7):
        wide.grad = torch.randn_like(wide)
        optimizer.step()
        projectors.append(optimizer.state[wide]["projector"].clone())
    changed = [not torch.equal(a, b) for a, b in zip(projectors, projectors[1:])]
    assert changed == [False, False, True, False, False, True]  # refreshed before steps 4 and 7
    assert optimizer.refreshes == 3
    refreshes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GaLore:")]
    assert len(refreshes) == 3 and refreshes[0].startswith("GaLore: 1 subspaces refreshed (randomized SVD) in ")


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_rotated_moments_follow_the_subspace(shape):
    """galore_moments = "rotate": a refresh whose new basis spans the old subspace (columns permuted, signs flipped)
    leaves the first moment's full-size image unchanged and permutes the second moment's coordinates; carried, the
    first moment would point elsewhere."""
    param = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    rotated = GaLoreAdamW([{"params": [param], "matrix_method": True}], lr=1e-2, rank=4, update_gap=2,
                          moments="rotate")
    param.grad = torch.randn(shape)
    rotated.step()
    state = rotated.state[param]
    old, exp_avg, exp_avg_sq = state["projector"].clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    order, signs = torch.tensor([2, 0, 3, 1]), torch.tensor([1.0, -1.0, -1.0, 1.0])
    new = old[:, order] * signs
    rows = shape[0] < shape[1]
    rotate_moments(state, new, 0 if rows else 1)
    image = (lambda basis, m: basis @ m) if rows else (lambda basis, m: m @ basis.T)
    torch.testing.assert_close(image(new, state["exp_avg"]), image(old, exp_avg))
    expected_sq = exp_avg_sq[order] if rows else exp_avg_sq[:, order]
    torch.testing.assert_close(state["exp_avg_sq"], expected_sq)
    assert not torch.allclose(image(new, exp_avg), image(old, exp_avg))


# ----------------------------------------------------------------------------------------------------------------
# Through the registry


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_args_for("tiny", 16))
    model.init_weights()
    return model


@pytest.mark.parametrize("name", ["GaLore-AdamW", "Muon"])
def test_registry_state_bytes_match_the_state_after_a_step(name):
    """The registry's per-tensor estimate (memory planner, estimate_memory.py) is the state the optimizer keeps."""
    config = OptimizerConfig(name=name)
    model = tiny_model()
    container = OptimizersContainer([model], config)
    model(torch.randint(0, 2304, (2, 16))).sum().backward()
    container.step()
    (optimizer,) = container.optimizers
    spec = optimizer_spec(name)
    for group in optimizer.param_groups:
        for param in group["params"]:
            kept = sum(v.numel() * v.element_size() for v in optimizer.state[param].values() if v.dim() > 0)
            assert kept == spec.state_bytes(tuple(param.shape), tuple(param.shape), config,
                                           group["matrix_method"]), group["group"]


@pytest.mark.parametrize("option,value,message", [
    ("rank", 65, r"^option optimizer.galore.rank: 65 must be in \[1, 32\]"),
    ("rank", 0, r"^option optimizer.galore.rank: 0 must be in \[1, 32\]"),
    ("update_gap", 0, r"^option optimizer.galore.update_gap: 0 must be at least 1"),
])
def test_galore_options_are_checked(option, value, message):
    config = OptimizerConfig(name="GaLore-AdamW")
    setattr(config.galore, option, value)
    with pytest.raises(UserError, match=message):
        OptimizersContainer([tiny_model()], config)


@pytest.mark.parametrize("option,value,message", [
    ("momentum", 1.0, r"^option optimizer.muon.momentum: 1.0 must be in \[0, 1\)"),
    ("ns_steps", 0, r"^option optimizer.muon.ns_steps: 0 must be at least 1"),
])
def test_muon_options_are_checked(option, value, message):
    config = OptimizerConfig(name="Muon")
    setattr(config.muon, option, value)
    with pytest.raises(UserError, match=message):
        OptimizersContainer([tiny_model()], config)


# ----------------------------------------------------------------------------------------------------------------
# The same steps on DTensor parameters

STEPS = 4
SHAPES = [(24, 40), (40, 24), (18, 30)]  # wide, tall, and one that 4 ranks shard unevenly
# name -> (mesh shape, placements)
LAYOUTS = {
    "shard0": ((4,), [Shard(0)]),
    "shard1": ((4,), [Shard(1)]),
    "hsdp": ((2, 2), [Replicate(), Shard(0)]),
    "shard0_shard1": ((2, 2), [Shard(0), Shard(1)]),
    "replicate": ((4,), [Replicate()]),  # DDP
}
OPTIMIZERS = {
    "galore_randomized": lambda groups: GaLoreAdamW(groups, lr=1e-2, weight_decay=0.1, rank=5, update_gap=2),
    "galore_exact": lambda groups: GaLoreAdamW(groups, lr=1e-2, weight_decay=0.1, rank=5, update_gap=2, svd="exact"),
    "galore_rotate": lambda groups: GaLoreAdamW(groups, lr=1e-2, weight_decay=0.1, rank=5, update_gap=2,
                                                moments="rotate"),
    "muon": lambda groups: Muon(groups, lr=1e-2, weight_decay=0.1),
    "muon_spread_over_replicas": lambda groups: Muon(groups, lr=1e-2, weight_decay=0.1, spread_over_replicas=True),
}


def train_steps(optimizer_name: str, params: list[torch.Tensor],
                grads: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    optimizer = OPTIMIZERS[optimizer_name]([{"params": params, "matrix_method": True}])
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad
        optimizer.step()
    return optimizer


def reference_grads() -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]


def reference_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def sharded_worker(rank: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    results = {}
    orthogonalised = []  # this rank's Newton-Schulz calls, one per matrix
    newton_schulz_of_muon = muon.newton_schulz
    muon.newton_schulz = lambda matrix, *args: (orthogonalised.append(matrix.shape),
                                                newton_schulz_of_muon(matrix, *args))[1]
    for layout, (mesh_shape, placements) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", mesh_shape)
        for name in OPTIMIZERS:
            orthogonalised.clear()
            params = [torch.nn.Parameter(distribute_tensor(p, mesh, placements)) for p in reference_params()]
            grads = [[distribute_tensor(g, mesh, placements) for g in step] for step in reference_grads()]
            optimizer = train_steps(name, params, grads)
            results[layout, name] = [p.full_tensor() for p in params]
            results[layout, name, "orthogonalised"] = len(orthogonalised)
            results[layout, name, "sent"] = (getattr(optimizer, "exchange_sent_bytes", 0),
                                             getattr(optimizer, "exchange_replica_bytes", 0))
            results[layout, name, "metrics"] = communication_metrics(sent_bytes([], [optimizer], save_sent_bytes=0),
                                                                     {}, steps=STEPS)
            state = [value for p in params for value in optimizer.state[p].values() if isinstance(value, DTensor)]
            results[layout, name, "state_fraction"] = (sum(v.to_local().numel() for v in state)
                                                       / sum(v.numel() for v in state))
            results[layout, name, "local_state"] = [
                (tuple(p.to_local().shape), sum(v.to_local().numel() * v.element_size()
                                                for v in optimizer.state[p].values() if v.dim() > 0))
                for p in params]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["TEST_PORT"] = str(s.getsockname()[1])
    return run_ranks(sharded_worker, tmp_path_factory.mktemp("galore_muon"), 4, 120, "GaLore/Muon")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_steps_equal_the_plain_ones(sharded_results, layout, name):
    """Four steps (two subspace refreshes for GaLore) on 4 ranks end at the one-process weights within 1e-5."""
    params = [p.detach().clone() for p in reference_params()]
    train_steps(name, params, reference_grads())
    for expected, actual in zip(params, sharded_results[0][layout, name]):
        assert not isinstance(actual, DTensor)
        difference = ((actual - expected).abs().max() / expected.abs().max()).item()
        assert difference <= 1e-5, (layout, name, difference)


# Newton-Schulz calls per step: (all ranks together, the busiest rank), by layout; spreading over the replicas too.
SPREAD = {"shard0": (3, 1), "shard1": (3, 1), "shard0_shard1": (3, 1), "hsdp": (6, 2), "replicate": (12, 3)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("over_replicas", [False, True])
def test_muon_spreads_the_matrices_over_the_ranks(sharded_results, layout, over_replicas):
    """Each of the three matrices (three shapes) is orthogonalised by one rank of those that shard it each step: 3
    matrices a step in all, at most one per rank, where every rank took all three before the spreading. The replicas
    of HSDP (2 x 2) and DDP (4) hold the same momenta and each orthogonalises its own (so nothing crosses between
    replicas): HSDP's replicas 3 each over their 2 ranks, DDP's ranks all 3; with spread_over_replicas the matrices
    are spread over every rank of the mesh."""
    name = "muon_spread_over_replicas" if over_replicas else "muon"
    counts = [rank_results[layout, name, "orthogonalised"] for rank_results in sharded_results]
    total, busiest = (3, 1) if over_replicas else SPREAD[layout]
    assert (sum(counts), max(counts)) == (total * STEPS, busiest * STEPS), counts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("over_replicas", [False, True])
def test_muon_counts_the_bytes_its_exchanges_send(sharded_results, layout, over_replicas):
    """Rank 0's count, by the arithmetic of each collective on its fp32 stacks (4 bytes per value on the CPU): per
    kind (one matrix each, so a stack of one slot per spreading rank) an all-to-all over each sharded dimension of n
    ranks sends (n - 1) / n of what the rank holds, each way; spread over replicas, the way out slices the replicated
    dimension and the way back all-gathers it (n - 1 times the rank's part). Nothing crosses between replicas unless
    asked."""
    mesh_shape, placements = LAYOUTS[layout]
    name = "muon_spread_over_replicas" if over_replicas else "muon"
    sent, replica_sent = sharded_results[0][layout, name, "sent"]
    expected = expected_replica = 0.0
    for shape in SHAPES:
        spread_dims = [d for d, p in enumerate(placements) if over_replicas or isinstance(p, Shard)]
        slots = math.prod(mesh_shape[d] for d in spread_dims)
        local = list(shape)
        for d, placement in enumerate(placements):  # rank 0's shard: the first chunk, ceil-sized
            if isinstance(placement, Shard):
                local[placement.dim] = -(-local[placement.dim] // mesh_shape[d])
        stack = 4 * math.prod(local) * slots
        # The way out slices the replicated dimensions first: its all-to-alls move the rank's part of the stack. The
        # way back starts from the rank's share, one whole matrix (evenly split, or whole on a 1-D mesh).
        out = stack / math.prod(mesh_shape[d] for d in spread_dims if not isinstance(placements[d], Shard))
        back = 4 * math.prod(shape)
        for d in spread_dims:
            n = mesh_shape[d]
            if isinstance(placements[d], Shard):
                expected += (out + back) * (n - 1) / n
            else:  # one replicated dimension in these layouts: the way back gathers it
                expected += back * (n - 1)
                expected_replica += back * (n - 1)
    assert (sent, replica_sent) == (pytest.approx(expected * STEPS, abs=16), pytest.approx(expected_replica * STEPS,
                                                                                            abs=16))
    # The trainer logs them per step as the optimizer's own exchange, apart from the compressed collectives' bytes
    # (whose percentage of full precision they would distort); DDP's ranks, which exchange nothing, log nothing.
    metrics = sharded_results[0][layout, name, "metrics"]
    assert metrics == ({} if not sent else {
        "optimizer_exchange_mib_per_step": pytest.approx(sent / STEPS / 2**20),
        "optimizer_exchange_across_replicas_mib_per_step": pytest.approx(replica_sent / STEPS / 2**20)})


@pytest.mark.parametrize("over_replicas", [False, True])
def test_the_benchmarks_byte_model_is_what_muon_counts(sharded_results, over_replicas):
    """benchmarks/muon_cost.py's bytes table models what the optimizer counts: HSDP, 2 replicas x 2 FSDP ranks
    (every shape even over 2), fp32 stacks on the CPU; across replicas only with spread_over_replicas."""
    from benchmarks.muon_cost import exchanged_bytes

    name = "muon_spread_over_replicas" if over_replicas else "muon"
    sent, replica_sent = exchanged_bytes(SHAPES, shard=2, replicas=2, over_replicas=over_replicas, element=4)
    assert sharded_results[0]["hsdp", name, "sent"] == (sent * STEPS, replica_sent * STEPS)
    assert (replica_sent > 0) == over_replicas


def test_spread_balances_flops():
    """Per kind, n // ranks matrices to every rank, the remainder to the ranks with the fewest FLOPs so far, the
    costliest kind first: 5 of cost 10 over 2 ranks give 3 / 2 (rank 0 first on a tie), then 3 of cost 1 give
    1 / 2, so 31 / 22 FLOPs."""
    kinds = ["b", "a", "a", "b", "a", "a", "b", "a"]
    flops = [1.0 if kind == "b" else 10.0 for kind in kinds]
    assert spread(kinds, flops, 2) == [[1, 2, 7, 4, 5, None], [0, None, 3, 6]]


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "replicate"])
def test_a_rank_keeps_its_share_of_the_state(sharded_results, layout):
    """Muon's momentum is sharded like the parameter, GaLore's moments along the kept side and its projectors along
    the projected side wherever the parameter is sharded: a rank holds 1/4 of the state (1/2 under HSDP, whose
    replicas hold the same shard; 4 ranks split 30 columns unevenly)."""
    shards = 2 if layout == "hsdp" else 4
    for name in ("muon", "galore_randomized", "galore_exact"):
        assert sharded_results[0][layout, name, "state_fraction"] == pytest.approx(1 / shards, abs=0.02)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_registry_state_bytes_count_a_ranks_share_of_the_state(sharded_results, layout):
    """The registry's state_bytes (what the memory planner sums over a rank's shards) given a matrix's whole and
    local shapes is what rank 0 keeps: GaLore's share of the whole matrix's moments and projector, not the state of
    a matrix shaped like the shard (another projected side and rank). The evenly sharded matrices are exact."""
    configs = {"galore_randomized": OptimizerConfig(name="GaLore-AdamW"),
               "galore_exact": OptimizerConfig(name="GaLore-AdamW"),
               "muon": OptimizerConfig(name="Muon")}
    configs["galore_randomized"].galore.rank = configs["galore_exact"].galore.rank = 5
    for name, config in configs.items():
        spec = optimizer_spec(config.name)
        for shape, (local_shape, kept) in zip(SHAPES[:2], sharded_results[0][layout, name, "local_state"]):
            assert spec.state_bytes(shape, local_shape, config, True) == kept, (name, shape, local_shape)


def test_galore_costs_script_reports_state_and_refresh_times(monkeypatch, capsys):
    import runpy
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "galore_costs.py"
    monkeypatch.setattr("sys.argv", [str(script), "--flavor", "tiny", "--repeats", "1"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    # tiny: dim 64; wq/wo 64 x 64 at rank 16 keep 2 x 16 x 64 + 16 x 64 values against AdamW's 2 x 64 x 64.
    assert "| 64 x 64 | 8 | 16 | 37.5% |" in out
    assert "projected matrices: GaLore state 0.46 MiB = 30.7% of AdamW's 1.50 MiB" in out
