"""The `[checkpoint]` options' own checks, and the values they may take."""

import torch

from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.errors import UserError

LOADABLE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "diloco")
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def validate_config(config: CheckpointConfig) -> None:
    if config.interval < 1:
        raise UserError(f"option checkpoint.interval: {config.interval} must be at least 1")
    if config.keep_latest_k < 0:
        raise UserError(f"option checkpoint.keep_latest_k: {config.keep_latest_k} must be 0 (keep all) or more")
    if config.load_step < -1:
        raise UserError(f"option checkpoint.load_step: {config.load_step} must be -1 (latest) or a step")
    if config.async_mode not in ASYNC_MODES:
        raise UserError(f"option checkpoint.async_mode: {config.async_mode!r} is not one of {', '.join(ASYNC_MODES)}")
    if config.export_dtype not in EXPORT_DTYPES:
        raise UserError(f"option checkpoint.export_dtype: {config.export_dtype!r} is not one of "
                        f"{', '.join(EXPORT_DTYPES)}")
    unknown = [part for part in config.exclude_from_loading if part not in LOADABLE_PARTS]
    if unknown:
        raise UserError(f"option checkpoint.exclude_from_loading: {', '.join(map(repr, unknown))} is not one of "
                        f"{', '.join(LOADABLE_PARTS)}")
    if config.timeout_seconds < 1:
        raise UserError(f"option checkpoint.timeout_seconds: {config.timeout_seconds} must be at least 1")
    if config.create_seed_checkpoint and not config.enable:
        raise UserError("option checkpoint.create_seed_checkpoint: it needs checkpoint.enable = true")
