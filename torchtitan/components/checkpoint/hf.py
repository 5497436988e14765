"""Hugging Face checkpoints in and out of a (sharded, pipelined) model, a tensor at a time: the names and layouts
are converted by `torchtitan.models.llama3.state_dict_adapter`.

Import: each rank opens the safetensors files lazily (`safe_open`, memory-mapped) and reads, with `get_slice`, only
the tensors of its pipeline stages and, of each, only the rows and columns of its shard. What a rank adds to its host
memory is its share of the files' pages plus one tensor being converted, never the whole model.

Export: every rank writes its shards of the model, in the export dtype, into a scratch DCP folder; rank 0 then reads
it back one safetensors shard at a time (at most `max_shard_bytes` of tensors, in the export dtype) and writes
that shard, so that its peak is about two shards (safetensors serialises a shard into one buffer) plus one tensor,
whatever the model's size.
"""

import contextlib
import json
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

from torchtitan.components.checkpoint.safe_io import dcp_load, read_metadata, without_collectives
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.state_dict_adapter import (_HF_IGNORED_SUFFIX, CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES,
                                                          INDEX_FILE, SINGLE_FILE, _check_config, _hf_to_meta_rows,
                                                          _rope_heads, expected_shapes, hf_config, hf_name,
                                                          is_hf_folder, to_hf)
from torchtitan.tools.logging import logger


# ----------------------------------------------------------------------------------------------------------------
# Import

class LazyHFWeights:
    """The tensors of an HF Llama folder under our names, read on demand: `read(name, offset, shape)` reads one
    block of one tensor, in our layout. Names, shapes and the config are checked when it is opened."""

    def __init__(self, folder: Path, model_args: TransformerModelArgs, files: contextlib.ExitStack):
        if not is_hf_folder(folder):
            raise UserError(f"{folder} is not a Hugging Face model folder: it needs {CONFIG_FILE} and {SINGLE_FILE} "
                            f"or {INDEX_FILE}")
        _check_config(folder, model_args)
        self.folder = folder
        self.model_args = model_args
        self._handles: dict[str, Any] = {}
        self._shapes = expected_shapes(model_args)
        ours = {hf_name(name): name for name in self._shapes}
        # Our name -> (file, HF name). Each file's header is read here; its tensors only in read().
        self._where: dict[str, tuple[str, str]] = {}
        # Bytes of the stored tensors read so far (whole query/key heads where a block cuts one).
        self.bytes_read = 0
        for filename in self._files():
            path = folder / filename
            try:
                self._handles[filename] = files.enter_context(safe_open(path, framework="pt"))
            except (OSError, SafetensorError) as err:
                raise UserError(f"Hugging Face weights file {path} cannot be read: {err}") from err
            for name in self._handles[filename].keys():
                if name.endswith(_HF_IGNORED_SUFFIX):
                    continue
                if name not in ours:
                    raise UserError(f"Hugging Face folder {folder} holds {name!r}, which the {model_args.n_layers}-"
                                    f"layer model of this flavor does not have; choose the matching model.flavor")
                self._where[ours[name]] = (filename, name)
        self._check_shapes()

    def _files(self) -> list[str]:
        index_path = self.folder / INDEX_FILE
        if not index_path.is_file():
            return [SINGLE_FILE]
        try:
            return sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as err:
            raise UserError(f"Hugging Face index {index_path} cannot be read (it needs a weight_map): {err}") from err

    def _check_shapes(self) -> None:
        missing = [name for name in self._shapes if name not in self._where]
        if missing:
            raise UserError(f"Hugging Face folder {self.folder} lacks {len(missing)} weight(s) of the model, the "
                            f"first being {hf_name(missing[0])}")
        for name in self._where:
            if tuple(self.shape(name)) != tuple(self._shapes[name]):
                raise UserError(f"Hugging Face folder {self.folder}: {name} has shape {list(self.shape(name))}, the "
                                f"model expects {list(self._shapes[name])}; choose the matching model.flavor")

    def shape(self, name: str) -> list[int]:
        filename, hf = self._where[name]
        return self._handles[filename].get_slice(hf).get_shape()

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of tensor `name` (our name and layout) at `offset` of size `shape`."""
        filename, hf = self._where[name]
        stored = self._handles[filename].get_slice(hf)
        heads = _rope_heads(name.split(".", 2)[-1], self.model_args)
        if len(shape) == 1:
            return self._counted(stored[offset[0]:offset[0] + shape[0]])
        (row, col), (rows, cols) = offset, shape
        if heads is None or rows == 0:
            return self._counted(stored[row:row + rows, col:col + cols])
        # Our rows of a query/key head are a permutation of the head's rows in HF's layout: read the whole heads
        # that the block touches, permute them, keep the block's rows.
        head_dim = self.shape(name)[0] // heads
        first, last = row // head_dim, math.ceil((row + rows) / head_dim)
        block = _hf_to_meta_rows(self._counted(stored[first * head_dim:last * head_dim, col:col + cols]),
                                 last - first)
        return block[row - first * head_dim:row - first * head_dim + rows]

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
def load_hf_model(model_parts: list[nn.Module], folder: Path, model_args: TransformerModelArgs) -> int:
    """Load an HF folder into the model parts of this rank, reading only the blocks of the tensors they hold;
    returns the bytes this rank read."""
    with contextlib.ExitStack() as files:
        weights = LazyHFWeights(Path(folder), model_args, files)
        for part in model_parts:
            for name, value in get_model_state_dict(part).items():
                local = value.to_local() if isinstance(value, DTensor) else value
                local.copy_(weights.read(name, *_local_block(name, value)))
    return weights.bytes_read


# ----------------------------------------------------------------------------------------------------------------
# Export

def _plan_shards(entries: dict[str, TensorStorageMetadata], dtype: torch.dtype,
                 max_shard_bytes: int) -> list[list[str]]:
    """Our tensor names grouped into consecutive shards of at most `max_shard_bytes` in `dtype` (a larger tensor
    alone)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, entry in entries.items():
        tensor_bytes = math.prod(entry.size) * itemsize
        if shards[-1] and size + tensor_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor_bytes
    return shards


def export_hf_from_dcp(scratch: Path, folder: Path, model_args: TransformerModelArgs, dtype: torch.dtype,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the `model.*` tensors of the DCP folder `scratch` into `folder` (which must not exist) as an HF folder
    in `dtype`, one safetensors shard at a time, in this process alone."""
    prefix = "model."
    metadata = read_metadata(scratch)
    entries = {key.removeprefix(prefix): entry for key, entry in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    shards = _plan_shards(entries, dtype, max_shard_bytes)
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    for number, names in enumerate(shards, start=1):
        filename = SINGLE_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        # DCP converts each stored chunk into the template's dtype as it reads it.
        state_dict = {prefix + name: torch.empty(tuple(entries[name].size), dtype=dtype) for name in names}
        with without_collectives():
            dcp_load(state_dict, scratch, no_dist=True)
        shard: dict[str, torch.Tensor] = {}
        for name in names:
            shard.update(to_hf({name: state_dict.pop(prefix + name)}, model_args))
        save_file({name: tensor.contiguous() for name, tensor in shard.items()}, folder / filename,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
        total_size += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
        del shard
        if len(shards) > 1:
            logger.info(f"Hugging Face export: wrote shard {number}/{len(shards)} ({filename})")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config(model_args, dtype), indent=2) + "\n")

