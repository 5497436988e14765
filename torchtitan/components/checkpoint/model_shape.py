"""`model.json`: the model's shape written beside its weights, and the check that a checkpoint's model is this
run's."""

import json
from pathlib import Path

from torchtitan.components.checkpoint.safe_io import describe
from torchtitan.errors import UserError
from torchtitan.protocols import ModelShape

MODEL_FILE = "model.json"


def check_model_shape(checkpoint: Path, shape: ModelShape) -> None:
    """A UserError naming every compared value in which the checkpoint's `MODEL_FILE` differs from this run's model
    (a checkpoint without one, from an older version, is left to the parameter-shape check)."""
    path = checkpoint / MODEL_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {checkpoint}: {path} cannot be read ({describe(err)})") from err
    ours = shape.record
    differ = [name for name in shape.compared if name in saved and saved[name] != ours[name]]
    if differ:
        raise UserError(f"checkpoint {checkpoint} was saved from another model: "
                        + ", ".join(f"{name} {saved[name]} (this run: {ours[name]})" for name in differ)
                        + "; set model.name, model.flavor and the [model] shape options it was trained with (its shape is in "
                        f"{path})")
