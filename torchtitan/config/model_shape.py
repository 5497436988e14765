"""The [model] options that change the flavor's shape, whatever the model family (each family's args builder takes
them as overrides and refuses the combinations its model cannot have)."""

from typing import Any

# None in [model] = the flavor's value.
SHAPE_OPTIONS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of", "vocab_size",
                 "rope_theta")


def shape_overrides(model_config: Any) -> dict[str, Any]:
    """The shape options that the [model] section (a job_config.Model) sets."""
    return {name: getattr(model_config, name) for name in SHAPE_OPTIONS if getattr(model_config, name) is not None}


def describe_model(flavor: str, overrides: dict[str, Any]) -> str:
    """`debugmodel`, or `debugmodel with dim 768, n_layers 12` when [model] changes the flavor's shape."""
    changes = ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                        for name, value in overrides.items())
    return f"{flavor} with {changes}" if changes else flavor
