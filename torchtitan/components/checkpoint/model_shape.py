"""`model.json`: the model's shape written beside its weights, and the check that a checkpoint's model is this
run's."""

import json
from pathlib import Path
from typing import Any

from torchtitan.components.checkpoint.safe_io import describe
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs

MODEL_FILE = "model.json"


def _model_shape(model_args: TransformerModelArgs) -> dict[str, Any]:
    """What `MODEL_FILE` records: every value that decides what the weights compute, named as the model.* options
    (the SwiGLU width both as its options and as the width they give, which is what is compared)."""
    return {"dim": model_args.dim, "n_layers": model_args.n_layers, "n_heads": model_args.n_heads,
            "n_kv_heads": model_args.kv_heads, "ffn_dim_multiplier": model_args.ffn_dim_multiplier,
            "multiple_of": model_args.multiple_of, "ffn_hidden_dim": model_args.ffn_hidden_dim,
            "vocab_size": model_args.vocab_size, "rope_theta": model_args.rope_theta, "norm_eps": model_args.norm_eps,
            "use_scaled_rope": model_args.use_scaled_rope}


def check_model_shape(checkpoint: Path, model_args: TransformerModelArgs) -> None:
    """A UserError naming every shape value in which the checkpoint's `MODEL_FILE` differs from this run's model
    (a checkpoint without one, from an older version, is left to the parameter-shape check)."""
    path = checkpoint / MODEL_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {checkpoint}: {path} cannot be read ({describe(err)})") from err
    ours = _model_shape(model_args)
    differ = [name for name in ours if name in saved and saved[name] != ours[name]
              and name not in ("ffn_dim_multiplier", "multiple_of")]
    if differ:
        raise UserError(f"checkpoint {checkpoint} was saved from another model: "
                        + ", ".join(f"{name} {saved[name]} (this run: {ours[name]})" for name in differ)
                        + "; set model.flavor and the [model] shape options it was trained with (its shape is in "
                        f"{path})")
