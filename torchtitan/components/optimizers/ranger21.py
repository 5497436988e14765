"""Ranger21 (Wright and Demeure, "Ranger21: a synergistic deep learning optimizer", 2021): AdamW with the
published components it combines, each switchable from [optimizer.ranger21]:

1. Adaptive gradient clipping (Brock et al. 2021): a unit's gradient (a row of a matrix, a whole vector) is scaled
   down to at most agc_clip x its weight norm (weight norms under agc_eps count as agc_eps).
2. Gradient centralization (Yong et al. 2020): each row of a matrix's (clipped) gradient loses its mean; then, as
   the reference's default `using_normgc`, the gradient is divided by its standard deviation over the whole tensor
   (unbiased) plus 1e-8 (tensors of two values or fewer are left as they are). The moments below see that gradient.
3. Positive-negative momentum (Xie et al. 2021): two momenta, each updated every other step with beta1^2; the step
   follows ((1 + b0) m_this - b0 m_other) / sqrt((1 + b0)^2 + b0^2), b0 = pnm_momentum, over Adam's
   bias-corrected second moment as usual, whose denominator sqrt(v_hat) + eps passes through softplus(x, beta =
   softplus_beta) = ln(1 + exp(beta x)) / beta (Tong et al.'s SAdam; the reference's default `softplus=True`,
   beta 50): a denominator near zero becomes about ln(2) / beta instead of eps, so no value's step explodes.
4. Stable weight decay (Xie et al. 2020): decoupled decay divided by the square root of the mean of the bias-corrected
   second moment over all parameters, w <- w (1 - lr wd / sqrt(mean v_hat)). The decay is in units of the Adam
   step, so its optimizer.weight_decay is about sqrt(mean v_hat) times AdamW's (1e-4 where AdamW takes 0.1, see
   docs/recipes.md); norms and embeddings follow the groups' rules as for AdamW.
5. Norm loss: each unit's weight is scaled by 1 - lr 2 norm_loss (1 - 1 / |w_unit|), towards norm 1.
6. Lookahead (Zhang et al. 2019): every lookahead_steps steps the weights become slow + alpha (fast - slow)
   and the slow weights take that value.
7. Linear warm-up and the explore-exploit schedule are not repeated here: the trainer's learning-rate scheduler
   sets the lr of every group, and Ranger21's schedule is its warmup-stable-decay form (lr_scheduler.warmup_steps,
   decay_ratio = 0.28 for Ranger21's final 28% of linear warm-down). Ranger21 computes its warm-up length from
   beta2 (2 / (1 - beta2) steps: 40 at beta2 = 0.95); set warmup_steps to that for the published recipe.

Where this differs from the reference (lessw2020/Ranger21, ranger21.py), and why:
- its positive-negative momentum divides by sqrt((1 + beta2)^2 + beta2^2) and weighs the momenta by 1 + True and
  True (a bool), whatever pnm_momentum_factor says; this follows the PNM paper's sqrt((1 + b0)^2 + b0^2) with
  b0 = pnm_momentum, which at the default b0 = 1 is the reference's weights, and a normalisation within 0.06% of
  its sqrt(1.999^2 + 0.999^2) at beta2 = 0.999 (3% above it at beta2 = 0.95);
- its stable weight decay and norm loss are applied once per parameter group, to the group's last parameter only;
  here to every parameter;
- its warm-up and warm-down are the trainer's scheduler (7. below); its Chebyshev, MADGRAD and AdaBelief options,
  off by default there, are not offered.

On DTensor parameters (FSDP and TP shards) every elementwise update runs on each rank's local shard. The unit norms
(1, 5) and row means (2) are DTensor reductions: a unit split across ranks (a row under TP's row-wise sharding,
a vector under FSDP) is reduced over the ranks that hold its pieces (an all-reduce of one value per row), a unit
whole on its rank (rows under FSDP's dim-0 sharding) needs no communication. The gradients' standard deviations
(2) are one all-reduce per mesh dimension of two float64 values per tensor (sum and sum of squares), all tensors
together; the mean of v_hat (4) one of two (sum and count); every shard counts once (a shard replicated over a mesh
dimension is weighted by 1 / its copies). Under pipeline parallelism each stage's optimizer takes that mean over its
own stage's parameters.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.components.optimizers import (BuildContext, RankTensor, StepLayout, gradient, largest_shard, local,
                                              register_optimizer)
from torchtitan.distributed.utils import placed_like
from torchtitan.config.job_config import Optimizer as OptimizerConfig


@dataclass
class Ranger21Options:
    """[optimizer.ranger21]"""

    TABLE: ClassVar[str] = "ranger21"
    OLD_PREFIX: ClassVar[str] = "ranger_"  # optimizer.ranger_<option>, deprecated
    # The options that had flat names (the softplus and normalisation options came with the table).
    OLD_OPTIONS: ClassVar[tuple[str, ...]] = ("agc_clip", "agc_eps", "gradient_centralization", "pnm_momentum",
                                              "norm_loss", "lookahead_steps", "lookahead_alpha")

    agc_clip: float = 0.01
    """Ranger21: adaptive gradient clipping, the largest ratio of a unit's gradient norm to its weight norm (a unit: a row of a matrix, a whole vector). 0 disables it."""

    agc_eps: float = 1e-3
    """Ranger21: weight norms below this count as this in adaptive gradient clipping (lets zero-initialised units move)."""

    gradient_centralization: bool = True
    """Ranger21: subtract from each row of a matrix's gradient its mean (vectors are left as they are)."""

    gradient_normalization: bool = True
    """Ranger21: divide each (centralized) gradient by its standard deviation over the whole tensor plus 1e-8, as the reference's using_normgc (tensors of two values or fewer are left as they are)."""

    softplus: bool = True
    """Ranger21: pass Adam's denominator sqrt(v_hat) + eps through softplus(x, softplus_beta), as the reference does by default."""

    softplus_beta: float = 50.0
    """Ranger21: softplus's beta: denominators near zero become about ln(2) / beta."""

    pnm_momentum: float = 1.0
    """Ranger21: positive-negative momentum's beta0, the weight of the difference between the two alternating momenta. 0 = plain momentum (of beta1^2 every other step)."""

    norm_loss: float = 1e-4
    """Ranger21: norm loss factor, pulling each unit's weight norm towards 1. 0 disables it."""

    lookahead_steps: int = 5
    """Ranger21: every this many steps the weights move back towards the slow (Lookahead) weights. 0 disables Lookahead."""

    lookahead_alpha: float = 0.5
    """Ranger21: Lookahead's step of the slow weights towards the fast ones (1 = keep the fast weights)."""


def _per_unit(t: torch.Tensor, reduce) -> torch.Tensor:
    """`reduce` over each unit of the whole tensor `t` (the dims after the first; a vector is one unit), as a local
    tensor that broadcasts against t's local shard."""
    result = reduce(t, tuple(range(1, t.dim()))) if t.dim() > 1 else reduce(t, None)
    if isinstance(result, DTensor):
        # A unit split across ranks gives a partial value on each: reduce it over them.
        result = result.redistribute(result.device_mesh,
                                     [Replicate() if p.is_partial() else p for p in result.placements]).to_local()
    return result


def _unit_norm(t: torch.Tensor) -> torch.Tensor:
    return _per_unit(t, lambda x, dims: torch.linalg.vector_norm(x, dim=dims, keepdim=dims is not None))


def _row_mean(t: torch.Tensor) -> torch.Tensor:
    return _per_unit(t, lambda x, dims: x.mean(dim=dims, keepdim=True))


def _whole_tensor_sums(tensors: list[torch.Tensor], sums) -> list[torch.Tensor]:
    """For each whole tensor of `tensors` (possibly sharded: a DTensor gives its mesh and placements), the float64
    vector `sums(local shard)` added over the ranks that hold its shards, each shard counted once (a shard replicated
    over a mesh dimension is weighted by 1 / its copies): one all-reduce per mesh dimension for all the tensors."""
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    by_mesh: dict = {}
    for index, t in enumerate(tensors):
        shard = local(t)
        mesh = t.device_mesh if isinstance(t, DTensor) else None
        copies = math.prod(mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate()) if mesh else 1
        by_mesh.setdefault(mesh, []).append((index, torch.stack(sums(shard)).to(torch.float64) / copies))
    for mesh, entries in by_mesh.items():
        stacked = torch.stack([row for _, row in entries])
        if mesh is not None:
            for dim in range(mesh.ndim):
                dist.all_reduce(stacked, group=mesh.get_group(dim))
        for (index, _), row in zip(entries, stacked):
            rows[index] = row
    return rows


def _global_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The mean of all values of `tensors` (whole tensors, possibly sharded)."""
    total = sum(_whole_tensor_sums(tensors, lambda shard: [shard.sum(dtype=torch.float64),
                                                           torch.tensor(float(shard.numel()), dtype=torch.float64,
                                                                        device=shard.device)]))
    # A tensor, not a Python number: no host synchronisation, and a dry run's fake tensors have no value to read.
    return total[0] / total[1]


def _normalized(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each local gradient shard divided by its whole tensor's unbiased standard deviation plus 1e-8 (the
    reference's `normalize_gradient`); tensors of two values or fewer as they are. From each tensor's sum and sum of
    squares in float64, where the centralized gradients' mean (near zero) costs no precision."""
    placed = [placed_like(grad, param) for param, grad in zip(params, grads)]
    totals = _whole_tensor_sums(placed, lambda shard: [shard.sum(dtype=torch.float64),
                                                       shard.double().square().sum()])
    result = []
    for param, grad, (total, squares) in zip(params, grads, totals):
        n = param.numel()
        if n <= 2:
            result.append(grad)
            continue
        variance = (squares - total * total / n) / (n - 1)
        result.append(grad / (variance.clamp(min=0).sqrt() + 1e-8).to(grad.dtype))
    return result


class Ranger21(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, agc_clip: float, agc_eps: float,
                 gradient_centralization: bool, pnm_momentum: float, norm_loss: float, lookahead_steps: int,
                 lookahead_alpha: float, gradient_normalization: bool = True, softplus: bool = True,
                 softplus_beta: float = 50.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        # Steps taken, on the host (the parity of the step picks the momentum); the state's `step` tensors save it.
        self.steps = 0
        self.agc_clip, self.agc_eps = agc_clip, agc_eps
        self.gradient_centralization, self.gradient_normalization = gradient_centralization, gradient_normalization
        self.softplus, self.softplus_beta = softplus, softplus_beta
        self.pnm_momentum, self.norm_loss = pnm_momentum, norm_loss
        self.lookahead_steps, self.lookahead_alpha = lookahead_steps, lookahead_alpha

    @torch.no_grad()
    def step(self, closure=None):
        work = [(param, group) for group in self.param_groups for param in group["params"]
                if param.grad is not None]
        if not work:
            return None
        self.steps += 1
        grads = [self._clipped_and_centralized(param) for param, _ in work]
        if self.gradient_normalization:
            grads = _normalized([param for param, _ in work], grads)
        for (param, group), grad in zip(work, grads):
            self._update_moments(param, grad, group["betas"])
        beta2 = work[0][1]["betas"][1]
        # Stable weight decay's denominator: one value for all parameters (0 before any gradient: no decay).
        mean_v_hat = _global_mean([self.state[param]["exp_avg_sq"] for param, _ in work]) / (1 - beta2 ** self.steps)
        decay_scale = torch.where(mean_v_hat > 0, mean_v_hat.rsqrt(), 0.0).float()
        for param, group in work:
            self._apply(param, group, self.steps, decay_scale)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.steps = max((int(state["step"]) for state in self.state.values() if "step" in state), default=0)

    def _clipped_and_centralized(self, param: torch.Tensor) -> torch.Tensor:
        """The local shard of the gradient, clipped (AGC) and centralized."""
        sharded_grad = gradient(param)
        grad = local(sharded_grad)
        if self.agc_clip:
            max_norm = _unit_norm(param).clamp_(min=self.agc_eps) * self.agc_clip
            grad_norm = _unit_norm(sharded_grad)
            grad = torch.where(grad_norm > max_norm, grad * (max_norm / grad_norm.clamp(min=1e-6)), grad)
        if self.gradient_centralization and param.dim() > 1:
            grad = grad - _row_mean(placed_like(grad, param))
        return grad

    def _update_moments(self, param: torch.Tensor, grad: torch.Tensor, betas: tuple[float, float]) -> None:
        """Update the momentum of this step's parity and the second moment with the prepared local gradient."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in ("exp_avg", "neg_exp_avg", "exp_avg_sq"):
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if self.lookahead_steps:
                state["slow_weights"] = param.detach().clone()
        state["step"].fill_(self.steps)
        beta1, beta2 = betas
        momentum = state["exp_avg" if self.steps % 2 else "neg_exp_avg"]
        local(momentum).mul_(beta1 ** 2).add_(grad, alpha=1 - beta1 ** 2)
        local(state["exp_avg_sq"]).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _apply(self, param: torch.Tensor, group: dict, step: int, decay_scale: torch.Tensor) -> None:
        state = self.state[param]
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        this, other = ("exp_avg", "neg_exp_avg") if step % 2 else ("neg_exp_avg", "exp_avg")
        b0 = self.pnm_momentum
        weight = local(param)
        momentum = local(state[this]).mul(1 + b0).sub_(local(state[other]), alpha=b0)
        momentum /= math.sqrt((1 + b0) ** 2 + b0 ** 2)
        denominator = (local(state["exp_avg_sq"]) / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        if self.softplus:
            denominator = torch.nn.functional.softplus(denominator, beta=self.softplus_beta)
        if group["weight_decay"]:
            weight.mul_(1 - lr * group["weight_decay"] * decay_scale.to(weight.device))
        if self.norm_loss:
            weight.mul_(1 - lr * 2 * self.norm_loss * (1 - 1 / (_unit_norm(param) + 1e-8)))
        weight.addcdiv_(momentum, denominator, value=-lr / (1 - beta1 ** step))
        if self.lookahead_steps and step % self.lookahead_steps == 0:
            slow = local(state["slow_weights"])
            slow.add_(weight - slow, alpha=self.lookahead_alpha)
            weight.copy_(slow)


def _ranger21_state_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                          matrix_method: bool) -> float:
    """Two momenta and the second moment, plus the slow weights with Lookahead, in fp32, of the shard."""
    return (16 if config.ranger21.lookahead_steps else 12) * math.prod(local_shape)


def _ranger21_step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
    """Every shard's clipped and centralized gradient at once (fp32); with gradient_normalization, beside them, each
    shard's float64 copy and its square for the sums (16 bytes per value of the largest shard), then their
    normalized copies until the division is done; then, tensor by tensor, the combined momentum, the denominator
    and its softplus (12 bytes per value of the largest shard)."""
    prepared = 4 * sum(math.prod(t.local_shape) for t in tensors)
    largest = largest_shard(tensors)
    peak = prepared + 12 * largest
    if config.ranger21.gradient_normalization:
        peak = max(peak, prepared + 16 * largest, 2 * prepared)
    return peak


@register_optimizer("Ranger21", state_bytes=_ranger21_state_bytes, step_bytes=_ranger21_step_bytes,
                    options=Ranger21Options)
def build_ranger21(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    options = config.ranger21
    return Ranger21(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                    agc_clip=options.agc_clip, agc_eps=options.agc_eps,
                    gradient_centralization=options.gradient_centralization, pnm_momentum=options.pnm_momentum,
                    norm_loss=options.norm_loss, lookahead_steps=options.lookahead_steps,
                    lookahead_alpha=options.lookahead_alpha, gradient_normalization=options.gradient_normalization,
                    softplus=options.softplus, softplus_beta=options.softplus_beta)
