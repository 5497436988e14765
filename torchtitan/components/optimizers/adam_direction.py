"""Adam's normalised step direction, shared by the optimizers that apply AdamW to some of their tensors (GaLore to
the projected gradients and to the unprojected parameters, Muon to embeddings, norms and the output layer).

Elementwise only, so that it runs unchanged on plain tensors and on DTensors of any placement.
"""

import torch


def adam_direction(grad: torch.Tensor, state: dict, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """Update `state` (exp_avg, exp_avg_sq, step: created on first use) with `grad`; returns the bias-corrected
    m / (sqrt(v) + eps), the direction AdamW steps along (before the learning rate)."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg_sq"] = torch.zeros_like(grad)
    state["step"] += 1
    step = state["step"].item()
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(eps)
    return state["exp_avg"] / (1 - beta1 ** step) / denominator
