"""Hugging Face checkpoints in and out of a (sharded, pipelined) model, a tensor at a time: the names and layouts
are converted by the model's `StateDictAdapter` (torchtitan/protocols.py), the folder format is hf_folder.py's.

Import: each rank opens the safetensors files lazily (`safe_open`, memory-mapped) and reads, with `get_slice`, only
the tensors of its pipeline stages and, of each, only the rows and columns of its shard. What a rank adds to its host
memory is its share of the files' pages plus one tensor being converted, never the whole model.

Export: every rank writes its shards of the model, in the export dtype, into a scratch DCP folder; rank 0 then reads
it back one safetensors shard at a time (at most `max_shard_bytes` of tensors, in the export dtype) and writes
that shard, so that its peak is about two shards (safetensors serialises a shard into one buffer) plus one tensor,
whatever the model's size.
"""

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.components.checkpoint.hf_folder import (DEFAULT_MAX_SHARD_BYTES, check_hf_folder, check_shapes,
                                                        plan_shards, shard_file, weight_files, write_index_and_config)
from torchtitan.components.checkpoint.safe_io import dcp_load, read_metadata, without_collectives
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError
from torchtitan.protocols import StateDictAdapter
from torchtitan.tools.logging import logger


# ----------------------------------------------------------------------------------------------------------------
# Import

class LazyHFWeights:
    """The tensors of an HF folder under our names, read on demand: `read(name, offset, shape)` reads one block of
    one tensor, in our layout. Names, shapes and the config are checked when it is opened."""

    def __init__(self, folder: Path, adapter: StateDictAdapter, files: contextlib.ExitStack):
        check_hf_folder(folder, adapter)
        self.folder = folder
        self.adapter = adapter
        self._handles: dict[str, Any] = {}
        # Our name -> (file, HF name). Each file's header is read here; its tensors only in read().
        self._where: dict[str, tuple[str, str]] = {}
        # Bytes of the stored tensors read so far (whole query/key heads where a block cuts one).
        self.bytes_read = 0
        for filename in weight_files(folder):
            path = folder / filename
            try:
                self._handles[filename] = files.enter_context(safe_open(path, framework="pt"))
            except (OSError, SafetensorError) as err:
                raise UserError(f"Hugging Face weights file {path} cannot be read: {err}") from err
            for hf_name in self._handles[filename].keys():
                name = adapter.our_name(hf_name)
                if name is not None:
                    self._where[name] = (filename, hf_name)
        check_shapes(folder, {name: self.shape(name) for name in self._where}, adapter)

    def shape(self, name: str) -> list[int]:
        filename, hf = self._where[name]
        return self._handles[filename].get_slice(hf).get_shape()

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of tensor `name` (our name and layout) at `offset` of size `shape`."""
        filename, hf = self._where[name]
        stored = self._handles[filename].get_slice(hf)
        groups = self.adapter.row_groups(name)
        if len(shape) == 1:
            return self._counted(stored[offset[0]:offset[0] + shape[0]])
        (row, col), (rows, cols) = offset, shape
        if groups is None or rows == 0:
            return self._counted(stored[row:row + rows, col:col + cols])
        # Our rows of a group (e.g. a query/key head) are a permutation of the group's rows in HF's layout: read the
        # whole groups that the block touches, permute them, keep the block's rows.
        group_rows = self.shape(name)[0] // groups
        first, last = row // group_rows, math.ceil((row + rows) / group_rows)
        block = self.adapter.from_hf_rows(
            self._counted(stored[first * group_rows:last * group_rows, col:col + cols]), last - first)
        return block[row - first * group_rows:row - first * group_rows + rows]

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _local_block(name: str, value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's block of `value` in the full tensor.

    FSDP over TP shards a tensor TP already split by rows (wq, wk, wv, w1, w3, output) along the same dimension:
    its placement on the FSDP mesh dimension is a `_StridedShard` whose split factor is the TP degree, and the
    local tensor is one block, a contiguous piece of the TP rank's rows (torch computes its offset)."""
    if not isinstance(value, DTensor):
        return (0,) * value.dim(), tuple(value.shape)
    mesh, placements = value.device_mesh, value.placements
    for index, placement in enumerate(placements):
        if type(placement) in (Shard, Replicate):
            continue
        later = math.prod(mesh.size(j) for j in range(index + 1, len(placements))
                          if type(placements[j]) is Shard and placements[j].dim == placement.dim)
        if not (isinstance(placement, torch_compat.get("StridedShard")) and placement.split_factor == later):
            raise ValueError(f"{name}: placements {placements} leave this rank's part in several blocks; the Hugging "
                             f"Face import reads one block per tensor (Shard, Replicate, FSDP's _StridedShard over "
                             f"TP)")
    shape, offset = torch_compat.get("compute_local_shape_and_global_offset")(value.shape, mesh, placements)
    return tuple(offset), tuple(shape)


@torch.no_grad()
def load_hf_model(model_parts: list[nn.Module], folder: Path, adapter: StateDictAdapter) -> int:
    """Load an HF folder into the model parts of this rank, reading only the blocks of the tensors they hold;
    returns the bytes this rank read."""
    with contextlib.ExitStack() as files:
        weights = LazyHFWeights(Path(folder), adapter, files)
        for part in model_parts:
            for name, value in get_model_state_dict(part).items():
                local = value.to_local() if isinstance(value, DTensor) else value
                local.copy_(weights.read(name, *_local_block(name, value)))
    return weights.bytes_read


# ----------------------------------------------------------------------------------------------------------------
# Export

def export_hf_from_dcp(scratch: Path, folder: Path, adapter: StateDictAdapter, dtype: torch.dtype,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the `model.*` tensors of the DCP folder `scratch` into `folder` (which must not exist) as an HF folder
    in `dtype`, one safetensors shard at a time, in this process alone."""
    prefix = "model."
    metadata = read_metadata(scratch)
    entries = {key.removeprefix(prefix): entry for key, entry in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards({name: math.prod(entry.size) * itemsize for name, entry in entries.items()},
                         max_shard_bytes)
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    for number, names in enumerate(shards, start=1):
        filename = shard_file(number, len(shards))
        # DCP converts each stored chunk into the template's dtype as it reads it.
        state_dict = {prefix + name: torch.empty(tuple(entries[name].size), dtype=dtype) for name in names}
        with without_collectives():
            dcp_load(state_dict, scratch, no_dist=True)
        shard: dict[str, torch.Tensor] = {}
        for name in names:
            shard.update(adapter.to_hf({name: state_dict.pop(prefix + name)}))
        save_file({name: tensor.contiguous() for name, tensor in shard.items()}, folder / filename,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
        total_size += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
        del shard
        if len(shards) > 1:
            logger.info(f"Hugging Face export: wrote shard {number}/{len(shards)} ({filename})")
    write_index_and_config(folder, weight_map, total_size, adapter, dtype)
