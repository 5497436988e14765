"""Muon (K. Jordan et al., "Muon: MomentUm Orthogonalized by Newton-Schulz"): a 2-D hidden weight steps along its
Nesterov momentum orthogonalised by a few Newton-Schulz iterations (the polar factor U V^T, approximately); every
other tensor (embeddings, norms, the output layer) takes AdamW's step.

The orthogonalised step is scaled by 0.2 * sqrt(max(m, n)) (Liu et al., "Muon is Scalable for LLM Training"), which
gives it about the RMS of an AdamW step: both kinds of groups share one learning rate and weight decay.

Under FSDP / HSDP / TP (DTensor parameters) the momentum stays sharded like the parameter; Newton-Schulz needs the
whole matrix, so each step all-gathers the momentum of every Muon matrix (`full_tensor`: m x n values), every rank
computes the same orthogonalisation of the whole matrix, and keeps its own shard of the result (a local slice, no
communication).
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.components.optimizers import BuildContext, gradient, register_optimizer
from torchtitan.components.optimizers.adam_direction import adam_direction
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.errors import UserError


@dataclass
class MuonOptions:
    """[optimizer.muon]"""

    TABLE: ClassVar[str] = "muon"
    OLD_PREFIX: ClassVar[str] = "muon_"  # optimizer.muon_<option>, deprecated

    momentum: float = 0.95
    """Muon: momentum of the matrix_method matrices (Nesterov); the other groups take AdamW's beta1/beta2."""

    ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise each step of a matrix_method matrix."""

# The quintic iteration's coefficients (Jordan et al.): they push every singular value into about [0.7, 1.2] in 5
# steps, faster than the cubic iteration that converges to exactly 1.
_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def newton_schulz(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """An approximation of U V^T for matrix = U S V^T."""
    a, b, c = _NEWTON_SCHULZ
    wide = matrix.shape[0] > matrix.shape[1]
    x = matrix.T if wide else matrix  # iterate on the side with the smaller Gram matrix
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if wide else x


class Muon(torch.optim.Optimizer):
    """Muon for parameter groups with `matrix_method=True` (2-D weights only), AdamW for the others.

    Group options (defaults from the constructor): lr, weight_decay, matrix_method, momentum, nesterov, ns_steps;
    betas and eps of the AdamW groups.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        defaults = {"lr": lr, "weight_decay": weight_decay, "matrix_method": False, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "betas": betas, "eps": eps}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["matrix_method"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalises 2-D weights only: a matrix_method group holds other tensors")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["matrix_method"]:
                    direction = self._orthogonalised(param, self.state[param], group)
                else:
                    direction = adam_direction(gradient(param), self.state[param], *group["betas"], group["eps"])
                if group["weight_decay"]:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(direction, alpha=-group["lr"])
        return None

    @staticmethod
    def _orthogonalised(param: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        grad = gradient(param)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])
        momentum = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
        whole = momentum.full_tensor() if isinstance(momentum, DTensor) else momentum
        update = newton_schulz(whole, group["ns_steps"]).mul_(0.2 * max(param.shape) ** 0.5)
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            update = DTensor.from_local(update, mesh, [Replicate()] * mesh.ndim, run_check=False)
            update = update.redistribute(mesh, param.placements)
        return update


def state_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                matrix_method: bool) -> float:
    """Muon matrices: one fp32 momentum, sharded like the parameter; the rest: AdamW's two fp32 moments."""
    return (4 if matrix_method else 8) * math.prod(local_shape)


@register_optimizer("Muon", state_bytes=state_bytes, needs_matrices=True, options=MuonOptions)
def build_muon(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    options = config.muon
    if not 0 <= options.momentum < 1:
        raise UserError(f"option optimizer.muon.momentum: {options.momentum} must be in [0, 1)")
    if options.ns_steps < 1:
        raise UserError(f"option optimizer.muon.ns_steps: {options.ns_steps} must be at least 1")
    return Muon(groups, lr=config.lr, momentum=options.momentum, ns_steps=options.ns_steps,
                betas=(config.beta1, config.beta2), eps=config.eps)
