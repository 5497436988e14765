"""Convert checkpoints between our DCP format, Hugging Face safetensors and a single torch.save file.

From the repository root:

    python -m scripts.convert_checkpoint dcp-to-hf   outputs/checkpoint/step-1000 hf_out --flavor 8B [--dtype bfloat16]
    python -m scripts.convert_checkpoint hf-to-dcp   Meta-Llama-3.1-8B dcp_out --flavor 8B
    python -m scripts.convert_checkpoint dcp-to-torch outputs/checkpoint/step-1000 model.pt

`hf-to-dcp` writes a model-only checkpoint (keys `model.*`) to start training from, with
`checkpoint.initial_load_path` (its `initial_load_model_only` default). The vocabulary size is read from the
checkpoint: training replaces the flavor's with the tokenizer's. `dcp-to-hf` takes the model's shape from the
checkpoint's model.json (written by the trainer, with any [model] shape options), on top of --flavor.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.components.checkpoint import (EXPORT_DTYPES, INCOMPLETE_SUFFIX, MODEL_FILE, check_model_shape,
                                              read_full_checkpoint, read_metadata, verify_checkpoint,
                                              without_collectives)
from torchtitan.components.checkpoint.hf import export_hf_from_dcp
from torchtitan.components.checkpoint.hf_folder import CONFIG_FILE, load_hf
from torchtitan.config.model_shape import SHAPE_OPTIONS
from torchtitan.errors import UserError
from torchtitan.models import get as model_spec
from torchtitan.models.llama3.args import TransformerModelArgs, llama3_flavors, model_args_for
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.tools.logging import init_logger, logger


def _model_args(flavor: str, vocab_size: int, overrides: dict | None = None) -> TransformerModelArgs:
    # seq_len only sizes the RoPE table, which checkpoints do not hold.
    return model_args_for(flavor, seq_len=1, vocab_size=vocab_size, overrides=overrides)


def _saved_shape_options(checkpoint: Path) -> dict:
    """The [model] shape options recorded in the checkpoint's model.json (none for a checkpoint without one)."""
    path = checkpoint / MODEL_FILE
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} cannot be read: {err}") from err
    return {name: saved[name] for name in SHAPE_OPTIONS if saved.get(name) is not None and name != "vocab_size"}


def _check_shapes(shapes: dict[str, tuple[int, ...]], model_args: TransformerModelArgs, source: Path,
                  flavor: str) -> None:
    expected = Llama3StateDictAdapter(model_args).expected_shapes()
    for name, shape in expected.items():
        if name not in shapes:
            raise UserError(f"{source} has no weight {name}; it does not match --flavor {flavor}")
        if tuple(shapes[name]) != tuple(shape):
            raise UserError(f"{source}: {name} has shape {list(shapes[name])}, --flavor {flavor} expects "
                            f"{list(shape)}")


def dcp_to_hf(source: Path, output: Path, flavor: str, dtype: str) -> None:
    """Streamed, one safetensors shard at a time (a 405B checkpoint need not fit in memory): the shapes come from
    the checkpoint's metadata, the weights from DCP shard by shard."""
    if output.exists():
        raise UserError(f"Hugging Face output folder {output} already exists; remove it or choose another")
    verify_checkpoint(source)
    shapes = {key.removeprefix("model."): tuple(entry.size)
              for key, entry in read_metadata(source).state_dict_metadata.items()
              if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    if "tok_embeddings.weight" not in shapes:
        raise UserError(f"{source} has no model.tok_embeddings.weight, so it is not a Llama checkpoint")
    model_args = _model_args(flavor, shapes["tok_embeddings.weight"][0], _saved_shape_options(source))
    check_model_shape(source, model_spec("llama3").recorded_shape(model_args))
    _check_shapes(shapes, model_args, source, flavor)
    staging = output.with_name(output.name + INCOMPLETE_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    export_hf_from_dcp(source, staging, Llama3StateDictAdapter(model_args), EXPORT_DTYPES[dtype])
    os.rename(staging, output)


def hf_to_dcp(source: Path, output: Path, flavor: str) -> None:
    config_path = source / CONFIG_FILE
    try:
        vocab_size = json.loads(config_path.read_text())["vocab_size"]
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{config_path} cannot be read or has no vocab_size: {err}") from err
    state_dict = load_hf(source, Llama3StateDictAdapter(_model_args(flavor, vocab_size)))
    if output.exists():
        raise UserError(f"output {output} already exists; remove it or choose another")
    staging = output.with_name(output.name + INCOMPLETE_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    with without_collectives():
        dcp.save({"model": state_dict}, checkpoint_id=staging, no_dist=True)
    os.rename(staging, output)


def dcp_to_torch(source: Path, output: Path) -> None:
    if output.exists():
        raise UserError(f"output {output} already exists; remove it or choose another")
    state_dict = read_full_checkpoint(source)
    staging = output.with_name(output.name + INCOMPLETE_SUFFIX)
    torch.save(state_dict, staging)
    os.rename(staging, output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.convert_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    to_hf = commands.add_parser("dcp-to-hf", help="a DCP step folder -> a Hugging Face folder (model only)")
    to_hf.add_argument("input", type=Path, help="DCP checkpoint folder (step-N)")
    to_hf.add_argument("output", type=Path, help="Hugging Face folder to create (must not exist)")
    to_hf.add_argument("--flavor", required=True, choices=list(llama3_flavors), help="model flavor")
    to_hf.add_argument("--dtype", default="bfloat16", choices=list(EXPORT_DTYPES), help="dtype of the weights")

    from_hf = commands.add_parser("hf-to-dcp", help="a Hugging Face folder -> a model-only DCP folder")
    from_hf.add_argument("input", type=Path, help="Hugging Face folder (config.json + safetensors)")
    from_hf.add_argument("output", type=Path, help="DCP folder to create (must not exist)")
    from_hf.add_argument("--flavor", required=True, choices=list(llama3_flavors), help="model flavor")

    to_torch = commands.add_parser("dcp-to-torch", help="a DCP step folder -> one torch.save file (all entries)")
    to_torch.add_argument("input", type=Path, help="DCP checkpoint folder (step-N)")
    to_torch.add_argument("output", type=Path, help="file to create (must not exist)")
    return parser


def main(argv: list[str] | None = None) -> int:
    init_logger()
    args = build_parser().parse_args(argv)
    try:
        if args.command == "dcp-to-hf":
            dcp_to_hf(args.input, args.output, args.flavor, args.dtype)
        elif args.command == "hf-to-dcp":
            hf_to_dcp(args.input, args.output, args.flavor)
        else:
            dcp_to_torch(args.input, args.output)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logger.info(f"Wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
