"""Float8 training of linear layers through torchao, applied to the meta model before any parallelism."""

import dataclasses

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger

FLOAT8_CONVERTERS = ("quantize.linear.float8", "float8")
# Real float8 matmuls (torch._scaled_mm) need both dimensions to be multiples of 16; below about a million
# weights per layer the casts cost more than the faster matmul saves.
_ALIGNMENT = 16
_MIN_REAL_KERNEL_WEIGHTS = 1024 * 1024


def float8_enabled(config: JobConfig) -> bool:
    return any(c in FLOAT8_CONVERTERS for c in config.model.converters)


def _should_convert(module: nn.Module, fqn: str, filter_fqns: list[str], emulate: bool) -> bool:
    if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
        return False
    if module.in_features % _ALIGNMENT or module.out_features % _ALIGNMENT:
        return False
    # Emulation is for numerics studies, where small layers should be converted too.
    return emulate or module.in_features * module.out_features >= _MIN_REAL_KERNEL_WEIGHTS


def apply_float8(model: nn.Module, config: JobConfig) -> list[str]:
    """Swap eligible nn.Linear modules for torchao's Float8Linear (no-op unless the converter is configured);
    returns the names of the converted layers."""
    if not float8_enabled(config):
        return []
    cfg = config.quantize.linear.float8
    if torch.cuda.is_available() and not cfg.emulate and torch.cuda.get_device_capability() < (8, 9):
        raise UserError("option model.converters: float8 needs a GPU of compute capability 8.9+ (H100, L4, ...); "
                        "set quantize.linear.float8.emulate = true to emulate it")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise UserError(f"option model.converters: float8 needs torchao (pip install torchao): {e}") from None
    recipe = cfg.recipe_name or "tensorwise"
    if recipe == "tensorwise":
        float8_config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
                                           emulate=cfg.emulate)
    else:
        if cfg.enable_fsdp_float8_all_gather or cfg.precompute_float8_dynamic_scale_for_fsdp:
            raise UserError(f"option quantize.linear.float8.enable_fsdp_float8_all_gather: float8 all-gather works "
                            f"with the tensorwise recipe only, not {recipe!r}")
        float8_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=cfg.emulate)
    converted: list[str] = []

    def module_filter(module: nn.Module, fqn: str) -> bool:
        keep = _should_convert(module, fqn, cfg.filter_fqns, cfg.emulate)
        if keep:
            converted.append(fqn)
        return keep

    convert_to_float8_training(model, config=float8_config, module_filter_fn=module_filter)
    if not converted:
        raise UserError(f"option model.converters: float8 would convert no linear layer of this model: real float8 "
                        f"kernels skip layers under {_MIN_REAL_KERNEL_WEIGHTS:,} weights or with a dimension not a "
                        f"multiple of {_ALIGNMENT}, and quantize.linear.float8.filter_fqns = {cfg.filter_fqns} "
                        f"excludes more; use a larger model, or quantize.linear.float8.emulate = true to study "
                        f"float8 numerics on any layer")
    logger.info(f"Float8 ({recipe}{', emulated' if cfg.emulate else ''}): converted {len(converted)} linear layers")
    return converted


def precomputes_fsdp_scales(config: JobConfig) -> bool:
    """Whether the trainer all-reduces the float8 all-gathered weights' scales after each optimizer step."""
    cfg = config.quantize.linear.float8
    return float8_enabled(config) and cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp


def precompute_float8_scales(model_parts: list[nn.Module], config: JobConfig) -> None:
    """After the optimizer step: one all-reduce computes the scales of every float8 all-gathered weight."""
    if not precomputes_fsdp_scales(config):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
