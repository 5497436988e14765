"""Parallel degrees -> one `DeviceMesh`.

The mesh always has the five named dimensions `pp, dp_replicate, dp_shard, cp, tp` (a disabled one has size 1),
plus flattened views:
- `dp` (dp_replicate x dp_shard): the ranks that read different data;
- `dp_shard_cp` (dp_shard x cp): the ranks FSDP shards parameters over;
- `dp_cp` (dp_replicate x dp_shard x cp): the ranks whose losses and token counts are summed;
and `hsdp`, the 2-D (dp_replicate, dp_shard_cp) mesh that HSDP shards over. torch deprecates slicing a flattened
dimension from the root mesh ("users need to bookkeep the flattened mesh directly"): ask `get_mesh` for these.
"""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.torch_compat import flatten_mesh
from torchtitan.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, config: Parallelism, world_size: int) -> "ParallelDims":
        """Resolve `data_parallel_shard_degree = -1` and check that the degrees multiply to the world size."""
        dp_replicate = config.data_parallel_replicate_degree
        cp, tp, pp = config.context_parallel_degree, config.tensor_parallel_degree, config.pipeline_parallel_degree
        dp_shard = config.data_parallel_shard_degree
        others = dp_replicate * cp * tp * pp
        if dp_shard == -1:
            if world_size % others:
                raise UserError(
                    f"option parallelism: data_parallel_replicate_degree x context_parallel_degree x "
                    f"tensor_parallel_degree x pipeline_parallel_degree = {dp_replicate} x {cp} x {tp} x {pp} = "
                    f"{others} does not divide the world size {world_size}")
            dp_shard = world_size // others
        if dp_shard * others != world_size:
            raise UserError(
                f"option parallelism: the degrees multiply to {dp_replicate} (data_parallel_replicate_degree) x "
                f"{dp_shard} (data_parallel_shard_degree) x {cp} (context_parallel_degree) x {tp} "
                f"(tensor_parallel_degree) x {pp} (pipeline_parallel_degree) = {dp_shard * others}, but "
                f"{world_size} processes were started; make the product equal the world size "
                f"(or set data_parallel_shard_degree = -1)")
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
        self._meshes = {"root": mesh,
                        "dp": flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp"),
                        "dp_shard_cp": flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp"),
                        "dp_cp": flatten_mesh(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp"),
                        "hsdp": flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp", leading="dp_replicate")}
        return mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """A dimension of the mesh that build_mesh() built: one of MESH_DIMS, a flattened one, or hsdp."""
        return self._meshes[name] if name in self._meshes else self._meshes["root"][name]

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp: context-parallel ranks hold the same parameters, so they shard them."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def describe(self) -> str:
        return ", ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, (self.pp, self.dp_replicate,
                                                                               self.dp_shard, self.cp, self.tp)))
