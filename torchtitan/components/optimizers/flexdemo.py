"""FlexDeMo (From et al., "Decoupled Momentum Optimization for Fully and Hybrid Sharded Training", after DeMo by
Peng et al.): replicas never all-reduce gradients. Each keeps its own momentum; every step it extracts the momentum's
fast-moving components (a DCT of each chunk of `chunk_size` values, the `topk` largest coefficients per chunk),
removes them from its momentum, and all-gathers only those across replicas. Every replica decodes the same mean of
the replicas' components and steps by its sign, so the replicas' weights stay identical while the rest of the
momentum stays local.

Under HSDP, FSDP shards and reduce-scatters within a replica (a host) as usual; this optimizer then owns the
exchange across replicas, on each rank's shard. The wire format of one step, per chunk: `topk` coefficient indices
(uint8) and values (bfloat16), in one all-gather.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizers import BuildContext, register_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig


def dct_matrix(size: int, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix: rows are the cosine basis, so `x @ D.T` transforms and `c @ D` inverts."""
    n = torch.arange(size, dtype=torch.float64)
    basis = torch.cos(math.pi / size * (n[None, :] + 0.5) * n[:, None])
    basis[0] /= math.sqrt(2)
    return (basis * math.sqrt(2 / size)).float().to(device)


def payload_bytes(numel: int, chunk_size: int, topk: int) -> int:
    """Bytes one replica sends per step for a tensor of `numel` values."""
    return -(-numel // chunk_size) * topk * 3


class FlexDeMo(torch.optim.Optimizer):
    def __init__(self, params, lr: float, weight_decay: float, chunk_size: int, topk: int, momentum_decay: float,
                 replicate_group: dist.ProcessGroup):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.chunk_size, self.topk, self.momentum_decay = chunk_size, topk, momentum_decay
        self.replicate_group = replicate_group
        self._dct: torch.Tensor | None = None
        self.sent_bytes = 0

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def _chunks(self, flat: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(-(-flat.numel() // self.chunk_size) * self.chunk_size, device=flat.device)
        padded[:flat.numel()] = flat
        return padded.view(-1, self.chunk_size)

    @torch.no_grad()
    def step(self, closure=None):
        # Every parameter's components travel in one all-gather: one collective per step, not one per tensor.
        work = [(param, group) for group in self.param_groups for param in group["params"] if param.grad is not None]
        extracted = [self._extract(param) for param, _ in work]
        payload = torch.cat([torch.cat((indices.to(torch.uint8), values.view(torch.uint8)), dim=1).view(-1)
                             for _, indices, values in extracted]) if extracted else torch.zeros(0, dtype=torch.uint8)
        replicas = dist.get_world_size(self.replicate_group)
        gathered = torch.empty(replicas * payload.numel(), dtype=torch.uint8, device=payload.device)
        dist.all_gather_into_tensor(gathered, payload, group=self.replicate_group)
        gathered = gathered.view(replicas, -1)
        self.sent_bytes += (replicas - 1) * payload.numel()
        offset = 0
        for (param, group), (coefficients, indices, _) in zip(work, extracted):
            chunks, k = indices.shape
            part = gathered[:, offset:offset + chunks * 3 * k].reshape(replicas, chunks, 3 * k)
            offset += chunks * 3 * k
            mean = torch.zeros_like(coefficients)
            for replica in range(replicas):  # in replica order: every replica sums identically
                mean.scatter_add_(1, part[replica, :, :k].long(),
                                  part[replica, :, k:].contiguous().view(torch.bfloat16).float())
            weight = self._local(param)
            update = (mean / replicas @ self._dct).view(-1)[:weight.numel()].view_as(weight)
            if group["weight_decay"]:
                weight.mul_(1 - group["lr"] * group["weight_decay"])
            weight.add_(update.sign().to(weight.dtype), alpha=-group["lr"])
        return None

    def _extract(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accumulate the gradient into the local momentum and take out its top DCT components: returns the chunks'
        coefficients (for their shape), and the indices and bfloat16 values sent."""
        grad = self._local(param.grad)
        state = self.state[param]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(param, dtype=torch.float32)
        momentum = self._local(state["momentum"])
        if self._dct is None:
            self._dct = dct_matrix(self.chunk_size, grad.device)
        momentum.mul_(self.momentum_decay).add_(grad.float())
        # An uneven shard can be empty: it sends nothing, but this rank still joins the all-gather.
        coefficients = self._chunks(momentum.view(-1)) @ self._dct.T
        indices = coefficients.abs().topk(min(self.topk, self.chunk_size), dim=1).indices
        values = coefficients.gather(1, indices).to(torch.bfloat16)
        # What is sent leaves the local momentum (as the receivers decode it: in bfloat16).
        sent = torch.zeros_like(coefficients).scatter_(1, indices, values.float())
        if momentum.numel():
            momentum.view(-1).sub_((sent @ self._dct).view(-1)[:momentum.numel()])
        return coefficients, indices, values

    def state_dict(self):
        """Before saving, the replicas' momenta are replaced by their mean (the total, what the exchange averages,
        is kept): every replica saves the same values, so the checkpoint holds one momentum per parameter, sharded
        and resharded like any optimizer state, and the run continues from exactly the state it saved."""
        for state in self.state.values():
            if "momentum" in state:
                momentum = self._local(state["momentum"])
                dist.all_reduce(momentum, group=self.replicate_group)
                momentum.div_(dist.get_world_size(self.replicate_group))
        return super().state_dict()


def _momentum_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                    matrix_method: bool) -> float:
    return 4 * math.prod(local_shape)


@register_optimizer("FlexDeMo", state_bytes=_momentum_bytes)
def build_flexdemo(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return FlexDeMo(groups, lr=config.lr, weight_decay=config.weight_decay, chunk_size=config.demo_chunk_size,
                    topk=config.demo_topk, momentum_decay=config.demo_momentum_decay,
                    replicate_group=context.replicate_group)
