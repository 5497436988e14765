"""A checkpoint read whole in one process, without collectives (scripts, tests, comparisons of runs)."""

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.components.checkpoint.integrity import verify_checkpoint
from torchtitan.components.checkpoint.safe_io import (dcp_load, deserialize, read_metadata, set_element,
                                                      without_collectives)
from torchtitan.components.checkpoint.state import _unpack_param_groups
from torchtitan.errors import UserError


def read_full_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, unsharded, in this process alone: the optimizer's hyperparameters and the
    data loader's state unpacked into plain values, as the trainer restores them."""
    metadata = read_metadata(checkpoint)
    verify_checkpoint(checkpoint)
    # The template DCP loads into, nested as saved: tensors of the saved shapes, placeholders for the rest.
    state_dict: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        value = (torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                 if isinstance(entry, TensorStorageMetadata) else b"")
        set_element(state_dict, (metadata.planner_data or {}).get(key, (key,)), value)
    with without_collectives():
        dcp_load(state_dict, checkpoint, no_dist=True)
    if "optimizer" in state_dict:
        state_dict["optimizer"] = _unpack_param_groups(state_dict["optimizer"])
    if isinstance(state_dict.get("dataloader"), bytes):
        state_dict["dataloader"] = deserialize(state_dict["dataloader"])
    return state_dict


def read_full_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a DCP checkpoint, unsharded, on CPU, in this process alone (no collectives)."""
    metadata = read_metadata(checkpoint)
    verify_checkpoint(checkpoint)
    prefix = "model."
    state_dict = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                  for key, entry in metadata.state_dict_metadata.items()
                  if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    if not state_dict:
        raise UserError(f"checkpoint {checkpoint} holds no model weights (no 'model.*' entries)")
    with without_collectives():
        dcp_load(state_dict, checkpoint, no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in state_dict.items()}
