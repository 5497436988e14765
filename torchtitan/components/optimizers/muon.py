"""Muon (K. Jordan et al., "Muon: MomentUm Orthogonalized by Newton-Schulz"): a 2-D hidden weight steps along its
Nesterov momentum orthogonalised by a few Newton-Schulz iterations (the polar factor U V^T, approximately); every
other tensor (embeddings, norms, the output layer) takes AdamW's step.

The orthogonalised step is scaled by 0.2 * sqrt(max(m, n)) (Liu et al., "Muon is Scalable for LLM Training"), which
gives it about the RMS of an AdamW step: both kinds of groups share one learning rate and weight decay.

Under FSDP / HSDP / DDP / TP (DTensor parameters) the momentum stays sharded like the parameter; Newton-Schulz needs
the whole matrix, and the matrices are spread over the ranks of the parameters' mesh: each rank orthogonalises its
share (`spread`: the same number of matrices of each shape per rank, the remainders to the ranks with the fewest
FLOPs so far), so the FLOPs per rank fall as 1 / ranks instead of every rank computing every matrix. Matrices of one
shape and layout are stacked along a new last dimension and redistributed (DTensor: an all-to-all, on gloo an
all-gather) so that each rank holds its share whole; the results travel back the same way to the parameters'
placements. The iterations run in bfloat16 on accelerators, as the reference does, and in fp32 on the CPU.
docs/recipes.md, "Muon at scale", has the measured and modelled cost.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor, Shard

from torchtitan.components.optimizers import BuildContext, gradient, local, register_optimizer
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
    """An approximation of U V^T for matrix = U S V^T (for each matrix of a batch: the last two dimensions), in the
    input's dtype. The iterations run in bfloat16 off the CPU, as Jordan et al.'s reference does: the quintic drives
    the singular values only into about [0.7, 1.2], well within bfloat16's precision, at the tensor cores' bf16 rate;
    on the CPU in fp32 (bf16 matmuls are not faster on every CPU, and the tests' bounds are fp32's)."""
    a, b, c = _NEWTON_SCHULZ
    x = matrix.float() if matrix.device.type == "cpu" else matrix.bfloat16()
    tall = matrix.shape[-2] > matrix.shape[-1]
    x = x.mT if tall else x  # iterate on the side with the smaller Gram matrix
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(matrix.dtype)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """FLOPs of `steps` iterations on an m x n matrix (m <= n after the transpose): X X^T (2 m^2 n), its square
    (2 m^3) and the product with X (2 m^2 n) per iteration."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m ** 3)


def spread(kinds: list, flops: list[float], ranks: int) -> list[list[int | None]]:
    """Which matrix each rank orthogonalises. Matrices of one kind (shape and layout: they stack) go n // ranks to
    every rank, and the n % ranks left over to the ranks with the fewest FLOPs so far, kinds taken from the costliest
    matrix down (longest-processing-time first). Returns, per kind, its slots: rank r orthogonalises the matrices
    (indices into `kinds`) in slots[r * b:(r + 1) * b], b = ceil(n / ranks), None where it has one fewer."""
    members: dict = {}
    for index, kind in enumerate(kinds):
        members.setdefault(kind, []).append(index)
    load = [0.0] * ranks
    result = []
    for indices in sorted(members.values(), key=lambda indices: -flops[indices[0]]):
        even, left = divmod(len(indices), ranks)
        shares = [indices[r * even:(r + 1) * even] for r in range(ranks)]
        for rank, index in zip(sorted(range(ranks), key=lambda r: (load[r], r)), indices[ranks * even:]):
            shares[rank].append(index)
        width = even + (left > 0)
        for rank, share in enumerate(shares):
            load[rank] += flops[indices[0]] * len(share)
        result.append([slot for share in shares for slot in share + [None] * (width - len(share))])
    return result


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
        matrices = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["matrix_method"]:
                    matrices.append((param, group, self._momentum(param, self.state[param], group)))
                    continue
                direction = adam_direction(gradient(param), self.state[param], *group["betas"], group["eps"])
                self._apply(local(param), local(direction), group)
        for (param, group, _), update in zip(matrices, self._orthogonalised(matrices)):
            self._apply(local(param), update.mul_(0.2 * max(param.shape) ** 0.5), group)
        return None

    @staticmethod
    def _apply(weight: torch.Tensor, direction: torch.Tensor, group: dict) -> None:
        if group["weight_decay"]:
            weight.mul_(1 - group["lr"] * group["weight_decay"])
        weight.add_(direction, alpha=-group["lr"])

    @staticmethod
    def _momentum(param: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        grad = gradient(param)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    @staticmethod
    def _orthogonalised(matrices: list[tuple[torch.Tensor, dict, torch.Tensor]]) -> list[torch.Tensor]:
        """The local shard of each matrix's orthogonalised momentum, each matrix orthogonalised by one rank of its
        parameter's mesh."""
        updates: list[torch.Tensor | None] = [None] * len(matrices)
        by_mesh: dict = {}
        for index, (param, _, _) in enumerate(matrices):
            by_mesh.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(index)
        for mesh, indices in by_mesh.items():
            if mesh is None:  # plain tensors: this process has every matrix whole
                for i in indices:
                    updates[i] = newton_schulz(matrices[i][2], matrices[i][1]["ns_steps"])
                continue
            ranks = mesh.size()
            # Shard(2) on every mesh dimension gives rank (i, j, ...) the stack's chunks in row-major order.
            me = sum(c * math.prod(mesh.shape[d + 1:]) for d, c in enumerate(mesh.get_coordinate()))
            kinds = [(matrices[i][0].shape, matrices[i][0].placements, matrices[i][1]["ns_steps"]) for i in indices]
            flops = [newton_schulz_flops(shape, steps) for shape, _, steps in kinds]
            for slots in spread(kinds, flops, ranks):
                param, group, first = matrices[indices[next(s for s in slots if s is not None)]]
                # Stacked along a new last dimension, the stack shards exactly like the parameter.
                padding = torch.zeros_like(local(first))
                stack = torch.stack([padding if s is None else local(matrices[indices[s]][2]) for s in slots], dim=-1)
                width = len(slots) // ranks
                share = slots[me * width:(me + 1) * width]
                whole = torch.Size((*param.shape, len(slots)))
                stack = _redistribute(stack, mesh, param.placements, [Shard(2)] * mesh.ndim, whole)
                results = torch.zeros_like(stack)
                # One matrix at a time, as the reference does: on this CPU a batched matmul ran 25% slower than the
                # same matmuls one by one, and on a GPU these matrices are large enough to fill it alone.
                for j, s in enumerate(share):
                    if s is not None:
                        results[..., j] = newton_schulz(stack[..., j].contiguous(), group["ns_steps"])
                # Each update contiguous again: the elementwise step on the stack's interleaved layout is slower.
                results = _redistribute(results, mesh, [Shard(2)] * mesh.ndim, param.placements, whole)
                results = results.movedim(-1, 0).contiguous()
                for j, s in enumerate(slots):
                    if s is not None:
                        updates[indices[s]] = results[j]
        return updates


def _redistribute(local_tensor: torch.Tensor, mesh, placements, target, shape: torch.Size) -> torch.Tensor:
    """This rank's part of a stack of matrices under `target`, from its part under `placements`."""
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    stacked = DTensor.from_local(local_tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
    return stacked.redistribute(mesh, target).to_local()


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
