"""The training state as DCP saves it: the Stateful wrappers of the model parts, the step and the random
generators, and the optimizer's hyperparameters packed into one record per parameter."""

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint.safe_io import deserialize, serialize


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelWrapper(Stateful):
    """The model parts (pipeline stages on this rank) as one state dict keyed by full parameter names."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        return {name: value for part in self.model_parts for name, value in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            # strict=False: each part takes its own parameters from the merged dict. A copy per part because
            # set_model_state_dict may pop entries from the dict it is given.
            set_model_state_dict(part, dict(state_dict), options=StateDictOptions(strict=False))


class RNGState(Stateful):
    """This process's random generators: Python's `random`, torch's CPU generator and, if present, CUDA's."""

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "python" in state_dict:
            random.setstate(state_dict["python"])
        if "torch" in state_dict:
            torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


_PARAM_GROUPS = "param_groups."


def _pack_param_groups(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """OptimizersContainer's flat state repeats a dozen hyperparameters per parameter (`param_groups.<name>.lr`,
    ...). DCP pickles every non-tensor entry as a record of its own, about a millisecond each, so each parameter's
    hyperparameters are packed into one record, still keyed by the parameter's name so that any sharding or
    pipeline split reloads them."""
    packed: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in optimizer_state.items():
        if key.startswith(_PARAM_GROUPS):
            name, field = key.removeprefix(_PARAM_GROUPS).rsplit(".", 1)
            groups.setdefault(name, {})[field] = value
        else:
            packed[key] = value
    packed.update({_PARAM_GROUPS + name: serialize(fields) for name, fields in groups.items()})
    return packed


def _unpack_param_groups(packed: dict[str, Any]) -> dict[str, Any]:
    optimizer_state: dict[str, Any] = {}
    for key, value in packed.items():
        if key.startswith(_PARAM_GROUPS):
            optimizer_state.update({f"{key}.{field}": v for field, v in deserialize(value).items()})
        else:
            optimizer_state[key] = value
    return optimizer_state
