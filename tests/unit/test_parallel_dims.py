"""ParallelDims builds one mesh and hands out its flattened views without torch's deprecated slicing."""

import warnings

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.distributed.parallel_dims import ParallelDims


@pytest.fixture
def fake_world():
    def join(rank: int, world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield join
    dist.destroy_process_group()


def test_meshes_are_built_and_handed_out_without_a_warning(fake_world):
    fake_world(rank=5, world_size=32)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2, world_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = dims.build_mesh("cpu")
        meshes = {name: dims.get_mesh(name) for name in ("dp", "dp_shard_cp", "dp_cp", "hsdp", "tp", "pp", "cp")}
    assert {name: mesh.size() for name, mesh in meshes.items()} == {
        "dp": 4, "dp_shard_cp": 4, "dp_cp": 8, "hsdp": 8, "tp": 2, "pp": 2, "cp": 2}
    # HSDP's 2-D mesh is what slicing the root by (dp_replicate, dp_shard_cp) gives (which torch now warns about),
    # down to the process groups.
    with pytest.warns(UserWarning, match="Slicing a flattened dim from root mesh"):
        sliced = root["dp_replicate", "dp_shard_cp"]
    hsdp = meshes["hsdp"]
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert hsdp.mesh.tolist() == sliced.mesh.tolist()
    assert hsdp._dim_group_names == sliced._dim_group_names
