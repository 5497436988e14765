"""Muon (K. Jordan et al., "Muon: MomentUm Orthogonalized by Newton-Schulz"): a 2-D hidden weight steps along its
Nesterov momentum orthogonalised by a few Newton-Schulz iterations (the polar factor U V^T, approximately); every
other tensor (embeddings, norms, the output layer) takes AdamW's step.

The orthogonalised step is scaled by 0.2 * sqrt(max(m, n)) (Liu et al., "Muon is Scalable for LLM Training"), which
gives it about the RMS of an AdamW step: both kinds of groups share one learning rate and weight decay.

Under FSDP / HSDP / DDP / TP (DTensor parameters) the momentum stays sharded like the parameter; Newton-Schulz needs
the whole matrix, and the matrices are spread over the ranks that shard the parameters (FSDP's, TP's; HSDP's
within a replica): each rank orthogonalises its share (`spread`: the same number of matrices of each shape per rank,
the remainders to the ranks with the fewest FLOPs so far), so the FLOPs per rank fall as 1 / ranks instead of every
rank computing every matrix. Matrices of one shape and layout are stacked along a new last dimension and
redistributed (DTensor: an all-to-all, on gloo an all-gather) so that each rank holds its share whole; the results
travel back the same way to the parameters' placements. The iterations run in bfloat16 on accelerators, as the
reference does, and in fp32 on the CPU; the stacks travel in that dtype (on accelerators half the bytes of fp32,
with the same result: Newton-Schulz rounds its input to bf16 first, and its output is bf16).

The replicas of HSDP and DDP hold the same momenta (their gradients are all-reduced), so each replica orthogonalises
its own shards' matrices and nothing crosses between replicas (usually between hosts); DDP, whose parameters no
mesh dimension shards, orthogonalises every matrix on every rank. `[optimizer.muon] spread_over_replicas` spreads
over the replicas too: fewer FLOPs per rank, and every update all-gathered across the replicas each step (at 8B on
8 replicas of 8 ranks, 1.9 GB per rank and step across replicas; benchmarks/muon_cost.py has the table).

Memory: one kind (shape and layout) at a time is stacked, exchanged, orthogonalised in place, exchanged back and
applied (`Muon._orthogonalise_kind`); `step_bytes` below is what the memory planner counts.
docs/recipes.md, "Muon at scale", has the measured and modelled cost.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor, Shard

from torchtitan.components.optimizers import (BuildContext, RankTensor, StepLayout, gradient, largest_shard, local,
                                              register_optimizer)
from torchtitan.components.optimizers.adam_direction import adam_direction
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.errors import UserError


@dataclass
class MuonOptions:
    """[optimizer.muon]"""

    TABLE: ClassVar[str] = "muon"
    OLD_PREFIX: ClassVar[str] = "muon_"  # optimizer.muon_<option>, deprecated
    OLD_OPTIONS: ClassVar[tuple[str, ...]] = ("momentum", "ns_steps")  # the flat options there were

    momentum: float = 0.95
    """Muon: momentum of the matrix_method matrices (Nesterov); the other groups take AdamW's beta1/beta2."""

    ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise each step of a matrix_method matrix."""

    spread_over_replicas: bool = False
    """Muon: also spread the Newton-Schulz work over the data-parallel replicas (HSDP's and DDP's replicate dimension): fewer FLOPs per rank, but every step's updates are then all-gathered across the replicas (usually between hosts). Off: each replica orthogonalises its own shards' matrices and nothing crosses between replicas."""

# The quintic iteration's coefficients (Jordan et al.): they push every singular value into about [0.7, 1.2] in 5
# steps, faster than the cubic iteration that converges to exactly 1.
_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximation of U V^T for matrix = U S V^T (for each matrix of a batch: the last two dimensions), in the
    input's dtype, computed in `dtype`. By default the iterations run in bfloat16 off the CPU, as Jordan et al.'s
    reference does: the quintic drives the singular values only into about [0.7, 1.2], well within bfloat16's
    precision, at the tensor cores' bf16 rate; on the CPU in fp32 (bf16 matmuls are not faster on every CPU, and the
    tests' bounds are fp32's)."""
    a, b, c = _NEWTON_SCHULZ
    if dtype is None:
        dtype = torch.float32 if matrix.device.type == "cpu" else torch.bfloat16
    x = matrix.to(dtype)
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
    betas and eps of the AdamW groups. `iteration_dtype`: what Newton-Schulz computes in (None: bfloat16 off the CPU,
    fp32 on it); the stacks travel in it too. `spread_over_replicas`: spread the matrices over the parameters'
    replicated mesh dimensions too (HSDP's and DDP's replicas), whose exchange then all-gathers every update across
    them; by default only over the dimensions that shard the parameters.

    `exchange_sent_bytes` counts what this rank's exchanges sent so far, `exchange_replica_bytes` the part of it
    over replicated dimensions: by the arithmetic of NCCL's collectives (an all-to-all sends (n - 1) / n of its
    tensor, an all-gather's ring n - 1 times the rank's part). The trainer logs them per step
    (`optimizer_exchange_mib_per_step`, `optimizer_exchange_across_replicas_mib_per_step`).
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 iteration_dtype: torch.dtype | None = None, spread_over_replicas: bool = False):
        defaults = {"lr": lr, "weight_decay": weight_decay, "matrix_method": False, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "betas": betas, "eps": eps}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["matrix_method"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalises 2-D weights only: a matrix_method group holds other tensors")
        self.iteration_dtype = iteration_dtype
        self.spread_over_replicas = spread_over_replicas
        self.exchange_sent_bytes = 0
        self.exchange_replica_bytes = 0

    @torch.no_grad()
    def step(self, closure=None):
        matrices = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["matrix_method"]:
                    self._update_momentum(param, self.state[param], group)
                    matrices.append((param, group))
                    continue
                direction = adam_direction(gradient(param), self.state[param], *group["betas"], group["eps"])
                self._apply(local(param), local(direction), group)
        self._orthogonalised_steps(matrices)
        return None

    @staticmethod
    def _apply(weight: torch.Tensor, direction: torch.Tensor, group: dict) -> None:
        if group["weight_decay"]:
            weight.mul_(1 - group["lr"] * group["weight_decay"])
        weight.add_(direction, alpha=-group["lr"])

    @staticmethod
    def _update_momentum(param: torch.Tensor, state: dict, group: dict) -> None:
        grad = gradient(param)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        state["momentum_buffer"].lerp_(grad, 1 - group["momentum"])

    def _direction(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """The local shard of what Newton-Schulz orthogonalises: the Nesterov momentum, or the momentum itself."""
        buffer = local(self.state[param]["momentum_buffer"])
        return local(gradient(param)).lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _dtype(self, device: torch.device) -> torch.dtype:
        if self.iteration_dtype is not None:
            return self.iteration_dtype
        return torch.float32 if device.type == "cpu" else torch.bfloat16

    def _orthogonalised_steps(self, matrices: list[tuple[torch.Tensor, dict]]) -> None:
        """Each matrix steps along its orthogonalised momentum, each orthogonalised by one rank of its parameter's
        mesh. One kind (shape and layout) at a time: its momenta are stacked, exchanged, orthogonalised in place,
        exchanged back and applied before the next kind's are stacked, so a rank holds one kind's stack at a time
        (planner/memory.py counts it)."""
        by_mesh: dict = {}
        for param, group in matrices:
            by_mesh.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append((param, group))
        for mesh, members in by_mesh.items():
            if mesh is None:  # plain tensors: this process has every matrix whole
                for param, group in members:
                    self._apply_update(param, group, newton_schulz(self._direction(param, group), group["ns_steps"],
                                                                   self._dtype(param.device)))
                continue
            kinds = [(param.shape, param.placements, group["ns_steps"]) for param, group in members]
            flops = [newton_schulz_flops(shape, steps) for shape, _, steps in kinds]
            spread_dims = [d for d, placement in enumerate(members[0][0].placements)
                           if self.spread_over_replicas or isinstance(placement, Shard)]
            ranks = math.prod(mesh.shape[d] for d in spread_dims)
            if ranks == 1:  # replicated only (DDP): every rank orthogonalises every matrix, nothing to exchange
                for param, group in members:
                    self._apply_update(param, group, newton_schulz(self._direction(param, group), group["ns_steps"],
                                                                   self._dtype(local(param).device)))
                continue
            # Shard(2) on the spread dimensions gives rank (i, j, ...) the stack's chunks in row-major order.
            coordinate = mesh.get_coordinate()
            me = sum(coordinate[d] * math.prod(mesh.shape[e] for e in spread_dims if e > d) for d in spread_dims)
            for slots in spread(kinds, flops, ranks):
                self._orthogonalise_kind([None if s is None else members[s] for s in slots], mesh, spread_dims,
                                         ranks, me)

    def _orthogonalise_kind(self, slots: list, mesh, spread_dims: list[int], ranks: int, me: int) -> None:
        param, group = next(member for member in slots if member is not None)
        placements = list(param.placements)
        dtype = self._dtype(local(param).device)
        # Stacked along a new last dimension, the stack shards exactly like the parameter; it travels, and is
        # orthogonalised, in the iteration's dtype (what Newton-Schulz computes in: no precision is lost).
        stack = torch.zeros((*local(param).shape, len(slots)), dtype=dtype, device=local(param).device)
        for j, member in enumerate(slots):
            if member is not None:
                stack[..., j] = self._direction(*member)
        whole = torch.Size((*param.shape, len(slots)))
        spread_placements = [Shard(2) if d in spread_dims else p for d, p in enumerate(placements)]
        stack = self._exchange(stack, mesh, placements, spread_placements, whole)
        width = len(slots) // ranks
        # One matrix at a time, as the reference does: on this CPU a batched matmul ran 25% slower than the same
        # matmuls one by one, and on a GPU these matrices are large enough to fill it alone.
        for j, member in enumerate(slots[me * width:(me + 1) * width]):
            if member is not None:
                stack[..., j] = newton_schulz(stack[..., j], member[1]["ns_steps"], dtype)
        stack = self._exchange(stack, mesh, spread_placements, placements, whole)
        for j, member in enumerate(slots):
            if member is not None:
                # A contiguous fp32 update per matrix: the elementwise step on the stack's interleaved layout is
                # slower.
                self._apply_update(member[0], member[1], stack[..., j].to(torch.float32, copy=True,
                                                                          memory_format=torch.contiguous_format))

    def _apply_update(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        self._apply(local(param), update.float().mul_(0.2 * max(param.shape) ** 0.5), group)

    def _exchange(self, local_tensor: torch.Tensor, mesh, placements: list, target: list,
                  shape: torch.Size) -> torch.Tensor:
        """This rank's part of a stack of matrices under `target`, from its part under `placements`, one mesh
        dimension at a time (the slices of replicated dimensions first, their all-gathers last: each collective then
        moves the least), counting the bytes sent."""
        dims = range(len(placements))
        order = ([d for d in dims if not isinstance(placements[d], Shard)]
                 + [d for d in dims if isinstance(placements[d], Shard) and isinstance(target[d], Shard)]
                 + [d for d in dims if not isinstance(target[d], Shard)])
        current = list(placements)
        for d in order:
            if current[d] == target[d]:
                continue
            n = mesh.shape[d]
            size = local_tensor.numel() * local_tensor.element_size()
            sent = size * (n - 1) / n if isinstance(current[d], Shard) and isinstance(target[d], Shard) else \
                size * (n - 1) if isinstance(current[d], Shard) else 0
            self.exchange_sent_bytes += round(sent)
            if not (isinstance(placements[d], Shard) and isinstance(target[d], Shard)):  # a replicated dimension
                self.exchange_replica_bytes += round(sent)
            nxt = current[:d] + [target[d]] + current[d + 1:]
            local_tensor = _redistribute(local_tensor, mesh, current, nxt, shape)
            current = nxt
        return local_tensor


def _redistribute(local_tensor: torch.Tensor, mesh, placements, target, shape: torch.Size) -> torch.Tensor:
    """This rank's part of a stack of matrices under `target`, from its part under `placements`."""
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    stacked = DTensor.from_local(local_tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
    return stacked.redistribute(mesh, target).to_local()


def state_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                matrix_method: bool) -> float:
    """Muon matrices: one fp32 momentum, sharded like the parameter; the rest: AdamW's two fp32 moments."""
    return (4 if matrix_method else 8) * math.prod(local_shape)


def newton_schulz_bytes(shape: tuple[int, ...], element: int) -> float:
    """What `newton_schulz` holds at once for one m x n matrix, by reading, in the iteration's dtype: the iterate
    with the Gram matrix and the three k x k terms of the polynomial (k the smaller side), or the iterate, the
    polynomial's product with it, its multiple and their sum (m x n each) beside the Gram matrix."""
    m, n = shape[-2:]
    k = min(m, n)
    return element * max(m * n + 4 * k * k, 4 * m * n + k * k)


def step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
    """Muon's step at its peak (tests/unit/test_step_memory.py checks it against the dry run's trace):

    - AdamW's groups, tensor by tensor: adam_direction's three temporaries of the shard (fp32), while the previous
      tensor's direction is still bound: 16 bytes per value of the largest shard;
    - each kind of matrix (shape and layout), one at a time: its stack, `width` = ceil(matrices / ranks) slots per
      spreading rank, in the iteration's dtype. Each exchange holds three copies of what the rank holds (the input,
      the all-to-all's contiguous send buffer and its receive buffer, or the received buffer made contiguous: torch's
      `_dtensor::shard_dim_alltoall` on GPUs); between them the rank's share (width whole matrices) and one matrix's
      Newton-Schulz temporaries; last, per matrix, an fp32 update of the shard. Where a kind has fewer matrices than
      ranks a rank stacks a whole matrix (width 1: one slot per rank): at 8B on 512 ranks each kind's stack holds a
      whole matrix in bf16, where the rank's momenta of that kind's 64 (or 32) matrices hold an eighth (a sixteenth)
      of one in fp32: 4 (8) times their bytes.
    Without spreading (one process, or DDP's replicas) each matrix is orthogonalised whole, one at a time: its fp32
    Nesterov momentum and Newton-Schulz's temporaries."""
    element = 4 if layout.device_type == "cpu" else 2
    ranks = layout.shard_ranks * (layout.replicas if config.muon.spread_over_replicas else 1)
    peak = 16 * largest_shard([t for t in tensors if not t.matrix_method])
    kinds: dict = {}
    for t in tensors:
        if t.matrix_method:
            kinds.setdefault((t.shape, t.layout), []).append(t)
    for (shape, _), members in kinds.items():
        whole = math.prod(shape)
        if ranks == 1:
            peak = max(peak, 4 * whole + newton_schulz_bytes(shape, element))
            continue
        width = -(-len(members) // ranks)
        sent = element * width * ranks * math.prod(members[0].local_shape)  # the stack before the exchange
        share = element * width * whole
        update = 4 * math.prod(members[0].local_shape)
        peak = max(peak, 3 * sent, share + newton_schulz_bytes(shape, element), 3 * share, sent + update)
    return peak


@register_optimizer("Muon", state_bytes=state_bytes, step_bytes=step_bytes, needs_matrices=True, options=MuonOptions)
def build_muon(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    options = config.muon
    if not 0 <= options.momentum < 1:
        raise UserError(f"option optimizer.muon.momentum: {options.momentum} must be in [0, 1)")
    if options.ns_steps < 1:
        raise UserError(f"option optimizer.muon.ns_steps: {options.ns_steps} must be at least 1")
    return Muon(groups, lr=config.lr, momentum=options.momentum, ns_steps=options.ns_steps,
                betas=(config.beta1, config.beta2), eps=config.eps,
                iteration_dtype=torch.float32 if context.device_type == "cpu" else torch.bfloat16,
                spread_over_replicas=options.spread_over_replicas)
