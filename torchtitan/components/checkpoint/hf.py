"""Hugging Face checkpoints in and out of a (sharded, pipelined) model: the names and layouts are converted by
`torchtitan.models.llama3.state_dict_adapter`."""

from pathlib import Path

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.state_dict_adapter import load_hf


def load_hf_model(model_parts: list[nn.Module], folder: Path, model_args: TransformerModelArgs) -> None:
    """Load an HF folder into the model parts of this rank."""
    full_state_dict = load_hf(folder, model_args)
    for part in model_parts:
        # Every rank holds the full tensors; set_model_state_dict shards them into the part's DTensors.
        set_model_state_dict(part, dict(full_state_dict),
                             options=StateDictOptions(full_state_dict=True, strict=False))
