"""GaLore-AdamW (Zhao et al., "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection"; GaLore 2,
Su et al.): Adam's moments of a weight matrix are kept for its gradient projected onto a rank-r subspace, found from
the gradient itself by an SVD every `update_gap` steps; the step is projected back and scaled by `scale`.

A matrix of m x n (m < n) keeps P, its gradient's top-r left singular vectors (m x r), and moments of P^T G (r x n);
with m >= n it keeps Q, the top-r right singular vectors (n x r), and moments of G Q (m x r): the smaller side is
projected. The projector is optimizer state (`projector`), so a checkpoint resumes with the same subspace.

The refresh is either the exact SVD or (GaLore 2) a randomized one: a range finder with `oversample` extra columns
and `power_iterations` power iterations, whose Gaussian test matrix comes from a generator seeded by `seed` and the
step, so every rank (and every layout) draws the same one and computes the same projector. The moments are carried
into the new subspace unchanged, as in both papers (`moments="carry"`), or rotated into it (`"rotate"`, not in the
papers; see `rotate_moments`).

Under FSDP / HSDP / TP (DTensor parameters), the computation is sharded, not gathered, except at a refresh:
- refresh (every `update_gap` steps): the gradient is all-gathered (`full_tensor`, m x n values) and every rank
  computes the same projector, and keeps 1/N of it (sharded along the projected side wherever the parameter is
  sharded);
- each step: the projector is all-gathered (size x r values) and the projection runs on the local shard. Where the parameter is sharded along the kept side, it needs
  no communication; where it is sharded along the projected side, the partial products are reduce-scattered
  (r x kept values). The moments are sharded along the kept side over every mesh dimension the parameter is
  sharded on, so they take 1/N of a rank's memory like AdamW's. Back-projecting all-gathers the normalised low-rank
  step where the parameter is sharded along the projected side (r x kept values), and none otherwise.
"""

import math
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.components.optimizers import (BuildContext, RankTensor, StepLayout, gradient, largest_shard, local,
                                              register_optimizer)
from torchtitan.components.optimizers.adam_direction import adam_direction
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger


@dataclass
class GaLoreOptions:
    """[optimizer.galore]"""

    TABLE: ClassVar[str] = "galore"
    OLD_PREFIX: ClassVar[str] = "galore_"  # optimizer.galore_<option>, deprecated

    rank: int | None = None
    """GaLore-AdamW: rank of the gradient projection of each matrix_method matrix. None = a quarter of each matrix's smaller side."""

    update_gap: int = 200
    """GaLore-AdamW: steps between refreshes of the projection subspace (an SVD of the current gradient)."""

    scale: float = 1.0
    """GaLore-AdamW: factor of the projected-back step of the matrix_method matrices."""

    svd: Literal["randomized", "exact"] = "randomized"
    """GaLore-AdamW: how a refresh finds the gradient's top singular subspace: randomized (GaLore 2: a range finder with 2 power iterations and 8 extra columns) or exact (a full SVD)."""

    moments: Literal["carry", "rotate"] = "carry"
    """GaLore-AdamW: what a refresh does with the projected moments: carry them unchanged into the new subspace (the GaLore and GaLore 2 papers), or rotate them into it (first moment by the new basis' overlap with the old, second moment by its square; not in the papers)."""


def top_subspace(matrix: torch.Tensor, rank: int, method: str, generator: torch.Generator | None = None,
                 oversample: int = 8, power_iterations: int = 2) -> torch.Tensor:
    """An orthonormal basis (rows x rank) of the span of `matrix`'s top-`rank` left singular vectors.

    method "exact": torch.linalg.svd. "randomized": project onto rank + oversample Gaussian directions, refine by
    power iterations (re-orthonormalised each time), and take the exact SVD of the small projected matrix.
    """
    if method == "exact":
        return torch.linalg.svd(matrix, full_matrices=False).U[:, :rank]
    columns = min(rank + oversample, *matrix.shape)
    test = torch.randn(matrix.shape[1], columns, generator=generator, dtype=matrix.dtype).to(matrix.device)
    basis = torch.linalg.qr(matrix @ test).Q
    for _ in range(power_iterations):
        basis = torch.linalg.qr(matrix @ (matrix.T @ basis)).Q
    small_left = torch.linalg.svd(basis.T @ matrix, full_matrices=False).U
    return basis @ small_left[:, :rank]


def projected_dim(shape: torch.Size) -> int:
    """0: project the rows (m < n, moments of r x n); 1: project the columns (moments of m x r)."""
    return 0 if shape[0] < shape[1] else 1


def default_rank(shape: torch.Size) -> int:
    """A quarter of the matrix's smaller side."""
    return max(1, min(shape) // 4)


def _placed(tensor: torch.Tensor, like: torch.Tensor, placements: list) -> torch.Tensor:
    """`tensor` (a DTensor, or a full tensor identical on every rank) laid out with `placements` on `like`'s mesh;
    plain tensors when `like` is not a DTensor."""
    if not isinstance(like, DTensor):
        return tensor
    if not isinstance(tensor, DTensor):
        tensor = DTensor.from_local(tensor, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return tensor.redistribute(like.device_mesh, placements)


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW whose parameter groups with `matrix_method=True` (2-D weights only) keep low-rank moments.

    Group options (defaults from the constructor): lr, betas, eps, weight_decay, matrix_method, rank (None: a quarter
    of each matrix's smaller side), update_gap, scale, svd ("randomized" or "exact").
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, rank: int | None = None, update_gap: int = 200, scale: float = 1.0,
                 svd: str = "randomized", moments: str = "carry", oversample: int = 8, power_iterations: int = 2,
                 seed: int = 0):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "matrix_method": False,
                    "rank": rank, "update_gap": update_gap, "scale": scale, "svd": svd, "moments": moments}
        super().__init__(params, defaults)
        self.oversample, self.power_iterations, self.seed = oversample, power_iterations, seed
        for group in self.param_groups:
            if group["matrix_method"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("GaLore projects 2-D weights only: a matrix_method group holds other tensors")
        # Subspace refreshes (gather + SVD) so far and their time: logged at each step that refreshes.
        self.refresh_seconds = 0.0
        self.refreshes = 0

    @torch.no_grad()
    def step(self, closure=None):
        refreshes, refresh_seconds = self.refreshes, self.refresh_seconds
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if group["matrix_method"]:
                    direction = self._projected_direction(param, state, group)
                else:
                    direction = adam_direction(gradient(param), state, beta1, beta2, group["eps"])
                if group["weight_decay"]:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(direction, alpha=-group["lr"])
        if self.refreshes > refreshes:
            logger.info(f"GaLore: {self.refreshes - refreshes} subspaces refreshed ({self.defaults['svd']} SVD) in "
                        f"{self.refresh_seconds - refresh_seconds:.3f} s")
        return None

    def _projected_direction(self, param: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        grad = gradient(param)
        d = projected_dim(param.shape)
        if int(state.get("step", 0)) % group["update_gap"] == 0:
            self._refresh(param, state, group, d)
        placements = list(param.placements) if isinstance(param, DTensor) else []
        # Stored sharded like the rest of the state, gathered for use (size x r values).
        projector = _placed(state["projector"], param, [Replicate()] * len(placements))
        # Moments: sharded along the kept side wherever the parameter is sharded at all.
        kept = Shard(1 - d)
        moment_placements = [kept if isinstance(p, Shard) else Replicate() for p in placements]
        low_rank = projector.T @ grad if d == 0 else grad @ projector
        low_rank = _placed(low_rank, param, moment_placements)
        beta1, beta2 = group["betas"]
        normalised = adam_direction(low_rank, state, beta1, beta2, group["eps"])
        # Back-projection without redistributing the full-size result: where the parameter is sharded along the
        # projected side, the projector is taken sharded the same way and the low-rank step whole.
        along_projected = [isinstance(p, Shard) and p.dim == d for p in placements]
        normalised = _placed(normalised, param, [Replicate() if a else p
                                                 for a, p in zip(along_projected, moment_placements)])
        factor = projector if d == 0 else projector.T
        factor = _placed(factor, param, [p if a else Replicate() for a, p in zip(along_projected, placements)])
        update = factor @ normalised if d == 0 else normalised @ factor
        return _placed(update, param, placements).mul_(group["scale"])

    def _refresh(self, param: torch.Tensor, state: dict, group: dict, d: int) -> None:
        start = time.perf_counter()
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        rank = group["rank"] or default_rank(param.shape)
        generator = torch.Generator().manual_seed(self.seed + int(state.get("step", 0)))
        basis = top_subspace(grad if d == 0 else grad.T, rank, group["svd"], generator, self.oversample,
                             self.power_iterations)
        if group["moments"] == "rotate" and "exp_avg" in state:
            rotate_moments(state, basis, d)
        placements = param.placements if isinstance(param, DTensor) else []
        state["projector"] = _placed(basis.contiguous(), param,
                                     [Shard(0) if isinstance(p, Shard) else Replicate() for p in placements])
        self.refresh_seconds += time.perf_counter() - start
        self.refreshes += 1


def rotate_moments(state: dict, basis: torch.Tensor, d: int) -> None:
    """Express the moments kept in the old subspace in the new one (`basis`, whole, the same on every rank).

    With R = new^T old (r x r), a low-rank matrix M of the old subspace is R M (rows projected, d = 0) or M R^T
    (d = 1) in the new one: the first moment maps so; the second moment, a per-coordinate mean of squares, maps by R
    squared elementwise (its coordinates taken as independent). The moments are sharded along the kept side only,
    so each rank rotates its local shard.
    """
    old = state["projector"]
    old = old.full_tensor() if isinstance(old, DTensor) else old
    rotation = basis.T @ old
    for key, matrix in (("exp_avg", rotation), ("exp_avg_sq", rotation.square())):
        moment = local(state[key])
        moment.copy_(matrix @ moment if d == 0 else moment @ matrix.T)


def _check(config: OptimizerConfig, groups: list[dict]) -> None:
    options = config.galore
    if options.update_gap < 1:
        raise UserError(f"option optimizer.galore.update_gap: {options.update_gap} must be at least 1")
    smallest = min((min(p.shape) for g in groups if g["matrix_method"] for p in g["params"]), default=None)
    if options.rank is not None and not 1 <= options.rank <= (smallest or options.rank):
        raise UserError(f"option optimizer.galore.rank: {options.rank} must be in [1, {smallest}] (the "
                        f"smallest side of a projected matrix), or unset for a quarter of each matrix's smaller side")


def state_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                matrix_method: bool) -> float:
    """Projected matrices: two fp32 moments of rank x kept side plus the fp32 projector (rank x projected side), the
    rank and sides those of the whole matrix; a rank holding a shard keeps the same share of both (the moments are
    sharded along the kept side, the projector along the projected side, wherever the parameter is sharded; exact
    for even shards). The rest: AdamW's two fp32 moments of the shard."""
    if not matrix_method:
        return 8 * math.prod(local_shape)
    rank = config.galore.rank or default_rank(shape)
    d = projected_dim(shape)
    return 4 * rank * (2 * shape[1 - d] + shape[d]) * math.prod(local_shape) / math.prod(shape)


def step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
    """Tensor by tensor, by reading (fp32): the unprojected tensors AdamW's direction (three temporaries of the shard,
    the previous tensor's direction still bound: 16 bytes per value); a projected matrix its gathered projector, the
    low-rank gradient with Adam's temporaries of it and the projected-back update of the shard; at a refresh (every
    update_gap steps) the whole gathered gradient and the SVD's factors (the range finder's rank + oversample columns,
    or the exact SVD's full factors)."""
    options = config.galore
    peak = 16 * largest_shard([t for t in tensors if not t.matrix_method])
    for t in tensors:
        if not t.matrix_method:
            continue
        rank = options.rank or default_rank(t.shape)
        d = projected_dim(t.shape)
        local_values = math.prod(t.local_shape)
        regular = 4 * (t.shape[d] * rank + 4 * t.shape[1 - d] * rank + 2 * local_values)
        columns = min(t.shape) if options.svd == "exact" else min(rank + 8, *t.shape)
        refresh = 4 * (math.prod(t.shape) + 3 * sum(t.shape) * columns)
        peak = max(peak, regular, refresh)
    return peak


@register_optimizer("GaLore-AdamW", state_bytes=state_bytes, step_bytes=step_bytes, needs_matrices=True,
                    options=GaLoreOptions)
def build_galore_adamw(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    _check(config, groups)
    options = config.galore
    return GaLoreAdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                       rank=options.rank, update_gap=options.update_gap, scale=options.scale, svd=options.svd,
                       moments=options.moments)
