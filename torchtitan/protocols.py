"""What a model family gives the trainer and the generic layers: a `ModelSpec`, registered by name in
`torchtitan.models` and chosen by model.name. `distributed/`, `components/` and `tools/` import no model
(tests/unit/test_model_spec.py): what they need of one comes from here, as functions the trainer hands them, or from
the model-agnostic `torchtitan/nn/` (attention over packed documents, parameter names and initialisation).

The generic layers also rely on the model's skeleton, which every family keeps:
- a chain of `tok_embeddings`, blocks in `layers` (an nn.ModuleDict keyed by the global block index, so that names
  survive a pipeline split), `norm` and `output`, any of them None in a pipeline stage that does not hold it; a
  `forward(tokens, document_ids=None, positions=None)` that reads the None ones as "hidden states in / out"
  (FSDP, activation checkpointing and compile wrap the blocks; pipeline stages learn their shapes from these);
- `args` (what `build_args` returns): a dataclass with `dim` and `vocab_size` (the hidden states and logits sent
  between pipeline stages), and `attention_device` (the device type whose attention layout to use, which a dry
  run on CPU tensors sets to cuda);
- `init_buffers(device)` and `parameter_initializers()`: (name, parameter, initializer) with values drawn from
  `torchtitan.nn.parameters.parameter_generator(seed, name)`, so that every layout starts from the same weights;
- a `rope` buffer (positions x rotary angles) and a `build_document_mask` attribute that context parallelism
  replaces (distributed/context_parallel.py).
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


class StateDictAdapter(ABC):
    """Conversion between the model's state dict and a Hugging Face checkpoint, for one model shape: the tensors'
    names, and the order of the rows in those whose rows HF orders otherwise. The folder format (config.json,
    safetensors files, their index) is the checkpointer's: torchtitan/components/checkpoint/hf_folder.py."""

    @abstractmethod
    def hf_name(self, name: str) -> str:
        """HF's name of our parameter `name` (a UserError for a name that is not one of the family's)."""

    @abstractmethod
    def our_name(self, hf_name: str) -> str | None:
        """Our name of HF's tensor `hf_name`; None for a tensor that HF checkpoints may hold and the model recomputes
        (it is skipped); a UserError for a tensor that is not one of the family's."""

    def row_groups(self, name: str) -> int | None:
        """The number of equal groups of rows (e.g. attention heads) of parameter `name` within which HF orders the
        rows otherwise (`to_hf_rows`, `from_hf_rows`); None where the two layouts agree."""
        return None

    def to_hf_rows(self, rows: torch.Tensor, groups: int) -> torch.Tensor:
        """`rows` (whole groups of a parameter that `row_groups` names) in HF's order."""
        raise NotImplementedError(f"{type(self).__name__} names row groups but does not reorder them")

    def from_hf_rows(self, rows: torch.Tensor, groups: int) -> torch.Tensor:
        """The inverse of `to_hf_rows`."""
        raise NotImplementedError(f"{type(self).__name__} names row groups but does not reorder them")

    @abstractmethod
    def hf_config(self, dtype: torch.dtype) -> dict:
        """The `config.json` of this model, with its weights stored in `dtype`."""

    @abstractmethod
    def check_hf_config(self, config: dict, path: Path) -> None:
        """A UserError, naming the option to change, where HF's config (read from `path`) describes a model that
        computes something else than this one."""

    @abstractmethod
    def expected_shapes(self) -> dict[str, torch.Size]:
        """Our parameter names and their shapes."""

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names and layout -> HF's."""
        return {self.hf_name(name): self._reordered(name, tensor, self.to_hf_rows)
                for name, tensor in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF's names and layout -> ours (the tensors the model recomputes left out)."""
        state_dict = {}
        for hf_name, tensor in hf_state_dict.items():
            name = self.our_name(hf_name)
            if name is not None:
                state_dict[name] = self._reordered(name, tensor, self.from_hf_rows)
        return state_dict

    def _reordered(self, name: str, tensor: torch.Tensor,
                   reorder: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        groups = self.row_groups(name)
        return tensor if groups is None else reorder(tensor, groups)


@dataclass(frozen=True)
class ModelShape:
    """What `model.json` records beside a checkpoint's weights (named as the model.* options), and which of its
    entries must match between a checkpoint and the run that loads it: every value that decides what the weights
    compute. The others (options whose result is recorded too) are for tools that rebuild the model from it."""

    record: dict[str, Any]
    compared: tuple[str, ...]


@dataclass(frozen=True)
class ModelSpec:
    """A model family: how to build it, parallelise it, split it into pipeline stages, and convert its checkpoints.
    `args` below is what `build_args` returns."""

    name: str
    """The model.name that selects the family."""

    build_args: Callable[[str, int, int | None, dict[str, Any]], Any]
    """(model.flavor, training.seq_len, the tokenizer's vocabulary size or None for the flavor's, the [model] shape
    overrides of torchtitan/config/model_shape.py) -> args; a UserError naming the option at fault."""

    build_model: Callable[[Any], nn.Module]
    """args -> the model, on the current device (the trainer builds it on the meta device)."""

    flops_per_token: Callable[[Any, int, int], int]
    """(args, parameters without the embedding, sequence length) -> training FLOPs per token, for MFU."""

    validate_parallelism: Callable[[Any, "ParallelDims", "JobConfig", str], None]
    """(args, parallel dims, config, device type): refuse the layouts the model cannot be split into."""

    parallelize: Callable[[nn.Module, "DeviceMesh", "ParallelDims", "JobConfig"], nn.Module]
    """Apply the model's parallelisms, activation checkpointing and compile (the apply_* functions of
    torchtitan/distributed/) to the meta model or one pipeline stage of it."""

    requested_stage_count: Callable[[int, int, Sequence[str], int | None], int]
    """(blocks, default count, parallelism.pipeline_parallel_split_points, pipeline_parallel_layers_per_stage) ->
    how many pipeline stages the options ask for (the default count when neither is set)."""

    split_into_stages: Callable[..., list[list[str]]]
    """(model, stages, *, split_points, layers_per_stage) -> the module names each stage keeps, in stage order."""

    build_stage_module: Callable[[nn.Module, Sequence[str]], nn.Module]
    """(meta model, module names) -> the stage: a copy of the model keeping only those modules."""

    model_shape: Callable[[Any], ModelShape]
    """args -> what model.json records of the model."""

    state_dict_adapter: Callable[[Any], StateDictAdapter] | None = None
    """args -> the Hugging Face adapter; None: the family has no HF format (checkpoint.initial_load_in_hf and
    checkpoint.last_save_in_hf are refused)."""

    def recorded_shape(self, args: Any) -> ModelShape:
        """What model.json records: the family's name, compared like the shape (another family's weights may have
        the same names and shapes), then the family's own record."""
        shape = self.model_shape(args)
        return ModelShape({"model": self.name, **shape.record}, ("model", *shape.compared))

    def hf_adapter(self, args: Any) -> StateDictAdapter | None:
        return None if self.state_dict_adapter is None else self.state_dict_adapter(args)
