"""What a forked rank inherits from the test process must not leak into its own world."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.unit.forked_ranks import join_forked


def doubled_on_own_mesh(rank: int) -> tuple[DTensor, object]:
    """As `rank` of a fake 2-rank world: an op on a DTensor over the world's mesh, and that mesh."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    shard = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
    return shard * 2, mesh


def rank_one_of_its_own_world(index: int) -> None:
    try:
        doubled, mesh = doubled_on_own_mesh(rank=1)
        assert doubled.device_mesh is mesh and tuple(doubled.device_mesh.get_coordinate()) == (1,), (
            f"the result lies on a mesh whose coordinate is {doubled.device_mesh.get_coordinate()}")
    finally:
        dist.destroy_process_group()


def test_a_forked_rank_gets_results_on_its_own_mesh_not_on_the_parents():
    """DTensor's sharding-propagation caches (torch's C++ fast path and the Python one) return the output spec of an
    earlier op whose input meshes compare equal, and a DeviceMesh's equality ignores the rank and the process
    group: a forked rank that inherited the parent's entries got its results on the parent's mesh (rank 0 of a
    fake world here, the fake world of test_parallelize's tensor-parallel tests in test_compression's ranks, where
    both ranks then saved rank 0's chunk)."""
    try:
        doubled_on_own_mesh(rank=0)  # the parent's entry, with rank 0's mesh
    finally:
        dist.destroy_process_group()
    join_forked(rank_one_of_its_own_world, (), 1, 30, "forked rank")
