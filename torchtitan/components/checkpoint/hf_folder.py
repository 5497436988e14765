"""The Hugging Face folder format, whatever the model: `config.json`, and the weights in `model.safetensors` or in
shards listed by `model.safetensors.index.json`. The tensors' names and layout and config.json's content are the
model's: its `StateDictAdapter` (torchtitan/protocols.py) converts them. Whole state dicts in one process here
(`save_hf`, `load_hf`: the conversion script, generation, tests); hf.py streams them in and out of a sharded model.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from torchtitan.errors import UserError
from torchtitan.protocols import StateDictAdapter
from torchtitan.tools.logging import logger

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def is_hf_folder(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder / CONFIG_FILE).is_file() and ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file())


def check_hf_folder(folder: Path, adapter: StateDictAdapter) -> None:
    """A UserError unless `folder` is an HF folder whose config.json describes the adapter's model."""
    if not is_hf_folder(folder):
        raise UserError(f"{folder} is not a Hugging Face model folder: it needs {CONFIG_FILE} and {SINGLE_FILE} "
                        f"or {INDEX_FILE}")
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"Hugging Face config {config_path} cannot be read: {err}") from err
    adapter.check_hf_config(config, config_path)


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of an HF folder: those its index lists, else the single file."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        return [SINGLE_FILE]
    try:
        return sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as err:
        raise UserError(f"Hugging Face index {index_path} cannot be read (it needs a weight_map): {err}") from err


def plan_shards(tensor_bytes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into shards of at most `max_shard_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in tensor_bytes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file(number: int, count: int) -> str:
    """The file name of shard `number` (from 1) of `count`."""
    return SINGLE_FILE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def write_index_and_config(folder: Path, weight_map: dict[str, str], total_size: int, adapter: StateDictAdapter,
                           dtype: torch.dtype) -> None:
    """What completes a folder once its shards are written: the index (for several shards) and config.json."""
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(adapter.hf_config(dtype), indent=2) + "\n")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def save_hf(folder: str | os.PathLike, state_dict: dict[str, torch.Tensor], adapter: StateDictAdapter,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write our full (unsharded) `state_dict` as an HF folder that transformers' `from_pretrained` reads.

    The files are written into `<folder>.incomplete`, which is renamed to `folder` once everything is on disk, so a
    crash never leaves a `folder` that looks complete. `folder` must not exist yet.
    """
    folder = Path(folder)
    if folder.exists():
        raise UserError(f"Hugging Face output folder {folder} already exists; remove it or choose another")
    staging = folder.with_name(folder.name + ".incomplete")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    hf_state_dict = {name: tensor.detach().to("cpu", dtype).contiguous()
                     for name, tensor in adapter.to_hf(state_dict).items()}
    shards = plan_shards({name: _nbytes(tensor) for name, tensor in hf_state_dict.items()}, max_shard_bytes)
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        filename = shard_file(number, len(shards))
        save_file({name: hf_state_dict[name] for name in names}, staging / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    write_index_and_config(staging, weight_map, sum(map(_nbytes, hf_state_dict.values())), adapter, dtype)
    os.rename(staging, folder)


def load_hf(folder: str | os.PathLike, adapter: StateDictAdapter) -> dict[str, torch.Tensor]:
    """Read an HF folder into our full state dict (names, layout; dtype as stored), checking every shape."""
    folder = Path(folder)
    check_hf_folder(folder, adapter)
    files = weight_files(folder)
    tensors = {}
    for number, filename in enumerate(files, start=1):
        path = folder / filename
        if len(files) > 1:
            size = f" ({path.stat().st_size / 2**30:.2f} GiB)" if path.is_file() else ""
            logger.info(f"Reading Hugging Face weights {number}/{len(files)}: {filename}{size}")
        try:
            tensors.update(load_file(path))
        except (OSError, SafetensorError) as err:
            raise UserError(f"Hugging Face weights file {path} cannot be read: {err}") from err
    state_dict = adapter.from_hf(tensors)
    check_shapes(folder, {name: tensor.shape for name, tensor in state_dict.items()}, adapter)
    return state_dict


def check_shapes(folder: Path, shapes: dict[str, torch.Size | list[int]], adapter: StateDictAdapter) -> None:
    """A UserError unless the folder's tensors (`shapes`, under our names) are exactly the model's parameters."""
    expected = adapter.expected_shapes()
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise UserError(f"Hugging Face folder {folder} lacks {len(missing)} weight(s) of the model, the first "
                        f"being {adapter.hf_name(missing[0])}")
    for name, shape in shapes.items():
        if name not in expected:
            raise UserError(f"Hugging Face folder {folder} holds {adapter.hf_name(name)!r}, which the model of "
                            f"this model.flavor does not have ({len(expected)} parameters); choose the matching "
                            f"model.flavor")
        if tuple(shape) != tuple(expected[name]):
            raise UserError(f"Hugging Face folder {folder}: {name} has shape {list(shape)}, the model expects "
                            f"{list(expected[name])}; choose the matching model.flavor")
