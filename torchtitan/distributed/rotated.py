"""Rotated tensor parallelism (RTP: Luo, Zhong, Fox, "RTP: Rethinking Tensor Parallelism with Memory Deduplication";
reference code wdlctc/rtp): the data-parallel shard ranks train on their own batches, as under FSDP, but no rank ever
gathers a weight. The weight of every Linear (the blocks' projections, the output layer) and of the embedding is split
by rows into one shard per rank, the layout FSDP2 gives it (a DTensor `Shard(0)` on the same 1-D mesh: the same
state-dict keys, global shapes and placements, so DCP checkpoints load either way); in forward and backward the shards
rotate around the ring of ranks while each rank computes with the shard in hand.

Rank r of N, a Linear y = x W^T whose shard j holds W's rows [a_j, b_j):

- forward, N turns: turn t holds shard j = r - t (mod N), sends it to rank r + 1 and receives shard j - 1 from rank
  r - 1 (`batch_isend_irecv`, in flight while) y[..., a_j:b_j] = x W_j^T is computed. After N turns y is whole.
- backward: the shards rotate again, for dx += dy[..., a_j:b_j] W_j; a gradient buffer rotates one shard behind them:
  rank r starts the buffer of shard r - 1 with its own dy[..., rows]^T x, sends it on, and at turn t adds its term to
  the buffer of shard r - 1 - t it received. After N - 1 hops the buffer of shard r, which has passed every rank,
  arrives at its owner: dW_r summed over all ranks, data parallelism's reduction folded into the rotation. (In the
  reference each buffer travels with its shard and takes one more hop home; starting it one rank ahead saves that
  hop.) `dW_r` becomes the gradient of the parameter's DTensor (through `to_local`'s autograd), accumulated over
  micro-batches like any gradient.
- the embedding: forward, turn t looks up the tokens whose ids fall in the shard in hand; backward, only gradient
  buffers rotate (a lookup's gradient, a scatter-add of dy into the rows of the tokens, needs no weight).

Bytes one rank sends per step, per rotated tensor of s rows (its rows divided by N, rounded up: shards of equal size
rotate, the last one padded) and c columns, with p and g the bytes per value of param_dtype and reduce_dtype:

    forward                    (N - 1) s c p     (shards rotate in the compute dtype)
    backward, a Linear         (N - 1) s c (p + g)
    backward, the embedding    (N - 1) s c g
    norms' gradients           2 (N - 1) / N x their bytes in reduce_dtype, counted as a ring all-reduce sends them

FSDP2 (resharding after forward) sends the same per tensor: an all-gather of (N - 1) s c p in forward and again in
backward, a reduce-scatter of (N - 1) s c g. A block under activation checkpointing recomputes its forward in
backward, rotations included: its shards travel three times per step (`forward_rotations` counts each forward).

Live parameter and gradient bytes of one rank, beyond the owned fp32 shards (4 P / N for the parameters, as much for
their gradients, P the model's parameters): while a Linear or the embedding runs forward, the shard in hand (being
sent) and the one being received, 2 s c p (the first turn's shard is the parameter itself when p is fp32's and the
rows divide evenly, else its cast copy); in a Linear's backward, those two and the gradient buffer being sent and the
one being received, 2 s c (p + g); in the embedding's, the two buffers, 2 s c g. The largest rotated tensor, the
output layer or the embedding (vocabulary x dim), sets the peak. FSDP2 holds a whole block instead: its all-gathered
parameters, the next block's in prefetch, and its unsharded gradients before the reduce-scatter.

Mixed precision as FSDP's MixedPrecisionPolicy: parameters, their gradients and optimizer state stay fp32; each Linear
computes in param_dtype (the rotating shards are cast once, before the first turn); the gradient buffers accumulate
and travel in reduce_dtype. Norm weights (vectors) are not split: each rank holds them whole (a Replicate DTensor on
the same mesh, so that the optimizer, fused AdamW included, and the gradient clipping see one kind of tensor), cast to
param_dtype in forward, and `RotatedTensorParallel.sync_replicated_gradients` all-reduces (sums) their gradients once
per step. Gradient reductions sum: the loss is already divided by the global token count (fsdp.py says why).

Inside torch.compile each rotation runs under `torch.compiler.disable`: a compiled block breaks its graph around it
(fullgraph=False) and does not trace the point-to-point ops. On CUDA the transfers are issued on a stream of their
own, which waits for the compute stream before each; the compute stream waits for a transfer before using what it
received, and each tensor a transfer reads or writes is referenced until then, so none is freed while in flight (no
record_stream needed). On the CPU the same code runs gloo's isend/irecv, which are asynchronous: the transfer runs in
gloo's threads during the matmul.

`init_rotated_weights` initialises the shards without a whole matrix where the initializer allows it (see there).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torchtitan.distributed.fsdp import TORCH_DTYPES
from torchtitan.distributed.utils import init_parameter
from torchtitan.nn.parameters import Initializer, parameter_generator
from torchtitan.tools.logging import logger

# Gloo matches point-to-point messages between two ranks by tag, in order: the weight shards and the gradient buffers
# of a backward turn are in flight together, each needs a tag of its own.
_WEIGHT_TAG, _GRADIENT_TAG = 1, 2


def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, stop) of `rows` split as DTensor's Shard(0) (torch.chunk) splits them: ceil(rows / world)
    each, the last ones shorter or empty."""
    size = math.ceil(rows / world)
    return [(min(rank * size, rows), min((rank + 1) * size, rows)) for rank in range(world)]


class _Transfer:
    """One shift of a tensor around the ring, in flight; `wait` gives what was received."""

    def __init__(self, works: list, sent: torch.Tensor, received: torch.Tensor, stream):
        self.works, self.sent, self.received, self.stream = works, sent, received, stream

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        if self.stream is not None:
            torch.get_device_module(self.received.device.type).current_stream().wait_stream(self.stream)
        # A finished work still references the tensors it sent and received: dropped, the shard sent is freed now,
        # not when the next turn replaces this transfer (a third shard and gradient buffer alive from 3 ranks on).
        self.works = self.sent = None
        return self.received


class RotatedTensorParallel:
    """The rotation of one model part's weights over a 1-D mesh: its ring, its precision, its counters."""

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.rotated: list[nn.Module] = []
        self.replicated: list[nn.Module] = []
        self._stream = None if mesh.device_type == "cpu" else torch.get_device_module(mesh.device_type).Stream()
        self.forward_sent_bytes = 0
        """Bytes of weight shards this rank sent in forwards (recomputed ones included)."""
        self.backward_sent_bytes = 0
        """Bytes of weight shards and gradient buffers this rank sent in backwards."""
        self.sync_sent_bytes = 0
        """Bytes of the norms' gradient all-reduce, as a ring all-reduce sends them."""
        self.forward_rotations = 0
        """Forwards of rotated modules run (a recomputed one counts again)."""
        self.backward_rotations = 0

    @property
    def sent_bytes(self) -> int:
        return self.forward_sent_bytes + self.backward_sent_bytes + self.sync_sent_bytes

    def _shift(self, tensor: torch.Tensor, tag: int, backward: bool) -> _Transfer:
        """Send `tensor` to the next rank and receive its like from the previous one."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.world, tag=tag),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.world, tag=tag)]
        if self._stream is None:
            works = dist.batch_isend_irecv(ops)
        else:
            device_module = torch.get_device_module(tensor.device.type)
            self._stream.wait_stream(device_module.current_stream())
            with device_module.stream(self._stream):
                works = dist.batch_isend_irecv(ops)
        sent = tensor.numel() * tensor.element_size()
        if backward:
            self.backward_sent_bytes += sent
        else:
            self.forward_sent_bytes += sent
        return _Transfer(works, tensor, received, self._stream)

    def _rotating_copy(self, weight: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
        """The local shard as it rotates: in the compute dtype, padded to the ring's equal shard size."""
        size = rows[0][1] - rows[0][0]
        if weight.dtype == self.param_dtype and weight.shape[0] == size:
            return weight.contiguous()
        shard = weight.new_zeros(size, *weight.shape[1:], dtype=self.param_dtype)
        shard[:weight.shape[0]] = weight
        return shard

    def _ring_turns(self):
        """Per turn: whether it is the last, the rank whose weight shard is in hand, and the rank whose gradient
        buffer is (one behind)."""
        for turn in range(self.world):
            yield turn + 1 == self.world, (self.rank - turn) % self.world, (self.rank - 1 - turn) % self.world

    def linear_forward(self, x: torch.Tensor, weight: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
        self.forward_rotations += 1
        out = x.new_empty(*x.shape[:-1], rows[-1][1])
        held = self._rotating_copy(weight, rows)
        for last, owner, _ in self._ring_turns():
            transfer = None if last else self._shift(held, _WEIGHT_TAG, backward=False)
            start, stop = rows[owner]
            out[..., start:stop] = F.linear(x, held[:stop - start])
            if transfer is not None:
                held = transfer.wait()
        return out

    def linear_backward(self, x: torch.Tensor, weight: torch.Tensor, rows: list[tuple[int, int]], dy: torch.Tensor,
                        needs_dx: bool, needs_dweight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.backward_rotations += 1
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        # Partial products summed in fp32 (at least): one rounding to the compute dtype at the end, as one GEMM has.
        dx = x2.new_zeros(x2.shape, dtype=torch.promote_types(x.dtype, torch.float32)) if needs_dx else None
        held = self._rotating_copy(weight, rows) if needs_dx else None
        gradient = x2.new_zeros(rows[0][1] - rows[0][0], x2.shape[-1], dtype=self.reduce_dtype) \
            if needs_dweight else None
        for last, owner, gradient_owner in self._ring_turns():
            weight_transfer = None if last or not needs_dx else self._shift(held, _WEIGHT_TAG, backward=True)
            gradient_transfer = None
            if needs_dweight:
                start, stop = rows[gradient_owner]
                _add_product(gradient[:stop - start], dy2[:, start:stop].t(), x2)
                gradient_transfer = None if last else self._shift(gradient, _GRADIENT_TAG, backward=True)
            if needs_dx:
                start, stop = rows[owner]
                _add_product(dx, dy2[:, start:stop], held[:stop - start])
            if weight_transfer is not None:
                held = weight_transfer.wait()
            if gradient_transfer is not None:
                gradient = gradient_transfer.wait()
        dweight = gradient[:weight.shape[0]].to(weight.dtype) if needs_dweight else None
        return (dx.to(x.dtype).view_as(x) if needs_dx else None), dweight

    def embedding_forward(self, tokens: torch.Tensor, weight: torch.Tensor, rows: list[tuple[int, int]]
                          ) -> torch.Tensor:
        self.forward_rotations += 1
        out = weight.new_zeros(*tokens.shape, weight.shape[-1], dtype=self.param_dtype)
        held = self._rotating_copy(weight, rows)
        for last, owner, _ in self._ring_turns():
            transfer = None if last else self._shift(held, _WEIGHT_TAG, backward=False)
            index, hit = _rows_hit(tokens, rows[owner])
            out = torch.where(hit.unsqueeze(-1), F.embedding(index, held), out)
            if transfer is not None:
                held = transfer.wait()
        return out

    def embedding_backward(self, tokens: torch.Tensor, weight_shape: torch.Size, weight_dtype: torch.dtype,
                           rows: list[tuple[int, int]], dy: torch.Tensor) -> torch.Tensor:
        self.backward_rotations += 1
        gradient = dy.new_zeros(rows[0][1] - rows[0][0], dy.shape[-1], dtype=self.reduce_dtype)
        for last, _, gradient_owner in self._ring_turns():
            index, hit = _rows_hit(tokens, rows[gradient_owner])
            gradient.index_add_(0, index.flatten(), torch.where(hit.unsqueeze(-1), dy, 0).flatten(0, -2)
                                .to(self.reduce_dtype))
            if not last:
                gradient = self._shift(gradient, _GRADIENT_TAG, backward=True).wait()
        return gradient[:weight_shape[0]].to(weight_dtype)

    @torch.no_grad()
    def sync_replicated_gradients(self) -> None:
        """Sum the gradients of the unsplit (norm) weights over the ranks: call once per step, after the last
        micro-batch's backward and before clipping or stepping."""
        grads = [module.weight.grad.to_local() for module in self.replicated if module.weight.grad is not None]
        if not grads or self.world == 1:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads]).to(self.reduce_dtype)
        dist.all_reduce(flat, group=self.group)
        self.sync_sent_bytes += 2 * (self.world - 1) * flat.numel() * flat.element_size() // self.world
        for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(summed.view_as(grad))


def _add_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """accumulator += a @ b, the product computed in a's dtype."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
    else:
        accumulator.add_(a @ b)


def _rows_hit(tokens: torch.Tensor, span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens fall in a shard of the vocabulary [start, stop), and each token's row in the shard, clamped into
    it for the others (used under the mask: shapes that do not depend on the ids, as fake tensors need)."""
    start, stop = span
    index = tokens - start
    hit = (index >= 0) & (index < stop - start)
    return index.clamp(0, max(stop - start - 1, 0)), hit


class _RotatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rotation: RotatedTensorParallel,
                rows: list[tuple[int, int]]) -> torch.Tensor:
        # The local shard (a view of the parameter) is saved, not the rotating copy: backward rotates it again.
        ctx.save_for_backward(x, weight)
        ctx.rotation, ctx.rows = rotation, rows
        return rotation.linear_forward(x, weight, rows)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dweight = ctx.rotation.linear_backward(x, weight, ctx.rows, dy, *ctx.needs_input_grad[:2])
        return dx, dweight, None, None


class _RotatedEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, rotation: RotatedTensorParallel,
                rows: list[tuple[int, int]]) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.rotation, ctx.rows, ctx.weight_shape, ctx.weight_dtype = rotation, rows, weight.shape, weight.dtype
        return rotation.embedding_forward(tokens, weight, rows)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        dweight = ctx.rotation.embedding_backward(tokens, ctx.weight_shape, ctx.weight_dtype, ctx.rows, dy) \
            if ctx.needs_input_grad[1] else None
        return None, dweight, None, None


@torch.compiler.disable
def _rotated_linear(module: "RotatedLinear", x: torch.Tensor) -> torch.Tensor:
    rotation = module.rotation
    return _RotatedLinearFunction.apply(x.to(rotation.param_dtype), module.weight.to_local(), rotation, module.rows)


@torch.compiler.disable
def _rotated_embedding(module: "RotatedEmbedding", tokens: torch.Tensor) -> torch.Tensor:
    return _RotatedEmbeddingFunction.apply(tokens, module.weight.to_local(), module.rotation, module.rows)


class RotatedLinear(nn.Linear):
    """An nn.Linear (no bias) whose weight, a Shard(0) DTensor, rotates over the ring (`apply_rtp` sets
    `rotation` and `rows`)."""

    rotation: RotatedTensorParallel
    rows: list[tuple[int, int]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rotated_linear(self, x)


class RotatedEmbedding(nn.Embedding):
    """An nn.Embedding whose vocabulary rows, a Shard(0) DTensor, rotate over the ring."""

    rotation: RotatedTensorParallel
    rows: list[tuple[int, int]]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _rotated_embedding(self, tokens)


class ReplicatedRMSNorm(nn.RMSNorm):
    """An nn.RMSNorm whose weight is whole on every rank (a Replicate DTensor), used in the compute dtype."""

    rotation: RotatedTensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local().to(self.rotation.param_dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def apply_rtp(model: nn.Module, mesh: DeviceMesh, *, param_dtype: str = "float32",
              reduce_dtype: str = "float32") -> RotatedTensorParallel:
    """Split every bias-free nn.Linear and plain nn.Embedding of `model` by rows over the 1-D `mesh` and make them
    rotate; replicate every nn.RMSNorm. Modules and parameters keep their names (their classes become the subclasses
    above); a model built on the meta device stays there (`to_empty` then materialises the shards). Run after
    activation checkpointing and compile have wrapped the blocks, as FSDP is.
    """
    if mesh.ndim != 1:
        raise ValueError(f"rotated tensor parallelism rotates over a 1-D mesh, not {mesh.ndim}-D")
    rotation = RotatedTensorParallel(mesh, TORCH_DTYPES[param_dtype], TORCH_DTYPES[reduce_dtype])
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        if any(isinstance(param, DTensor) for param in params.values()):
            raise ValueError(f"{name}: its parameters are already distributed; rotated tensor parallelism splits "
                             f"whole ones")
        if type(module) is nn.Linear and module.bias is None:
            rotated_class = RotatedLinear
        elif type(module) is nn.Embedding and module.padding_idx is None and module.max_norm is None \
                and not module.scale_grad_by_freq and not module.sparse:
            rotated_class = RotatedEmbedding
        elif type(module) is nn.RMSNorm:
            module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()],
                                                           src_data_rank=None),
                                         requires_grad=module.weight.requires_grad)
            module.__class__ = ReplicatedRMSNorm
            module.rotation = rotation
            rotation.replicated.append(module)
            continue
        else:
            raise ValueError(f"{name}: rotated tensor parallelism splits bias-free nn.Linear and plain nn.Embedding "
                             f"and replicates nn.RMSNorm, not {type(module).__name__}")
        weight = module.weight
        module.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)], src_data_rank=None),
                                     requires_grad=weight.requires_grad)
        module.__class__ = rotated_class
        module.rotation, module.rows = rotation, shard_rows(weight.shape[0], rotation.world)
        rotation.rotated.append(module)
    return rotation


def rotations(model_parts: list[nn.Module]) -> list[RotatedTensorParallel]:
    """The rotations of the model parts that apply_rtp split (one per part), in order."""
    found: list[RotatedTensorParallel] = []
    for part in model_parts:
        for module in part.modules():
            rotation = getattr(module, "rotation", None)
            if isinstance(rotation, RotatedTensorParallel) and not any(rotation is known for known in found):
                found.append(rotation)
    return found


# Values per chunk of the probe that checks an initializer draws the same values in row chunks as whole.
_PROBE_CHUNK_VALUES = 1024


@torch.no_grad()
def init_rotated_weights(model: nn.Module, seed: int, device: torch.device) -> list[str]:
    """Initialise a materialised rotated model part with exactly the values of `init_model_weights` (each parameter's
    generator seeded from the seed and its name, drawn on `device`), without a whole matrix where possible: a row-split
    parameter's rows before this rank's are drawn one shard at a time into a scratch shard and dropped, its own rows
    are drawn into the shard, and no later row is drawn, so the peak is one shard.

    That is exact only where drawing a tensor's rows chunk by chunk from one generator gives the whole draw's values.
    On the CPU, uniform_ draws one value per element in order and normal_ draws 16 at a time (Box-Muller over pairs 8
    apart), redrawing a tensor's last 16 when its size is no multiple of 16: chunks of multiples of 16 values give
    the whole draw's values. The model's matrices are drawn from a truncated normal by the inverse CDF of uniform_
    draws (models/llama3/model.py, `_trunc_normal`), which streams too, so on the CPU every split matrix of the model
    is drawn one shard at a time (torch's own trunc_normal_, which rejection-samples over the whole tensor since torch
    2.13, would not stream). CUDA's generators assign values by launch offset and thread layout, which presumably
    does not stream (untested here). So each parameter is first probed (its initializer on four chunks of its row
    width, against the same tensor drawn whole); one that fails, or whose shards are no multiple of 16 values, is
    drawn whole (one parameter at a time, as init_model_weights does).

    Returns the names of the split parameters drawn whole.
    """
    drawn_whole = []
    for name, param, initializer in model.parameter_initializers():
        if not _draw_owned_rows(name, param, initializer, seed, device):
            init_parameter(name, param, initializer, seed, device)
            if isinstance(param, DTensor) and param.placements == (Shard(0),):
                drawn_whole.append(name)
    if drawn_whole:
        logger.info(f"rotated tensor parallelism: {len(drawn_whole)} split parameters drawn whole, one at a time "
                    f"(their initializer's values depend on the whole tensor), e.g. {drawn_whole[0]}")
    return drawn_whole


def _draw_owned_rows(name: str, param: torch.Tensor, initializer: Initializer, seed: int,
                     device: torch.device) -> bool:
    """Draw this rank's rows of a row-split parameter by streaming its generator; False where that is not exact."""
    if not (isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.placements == (Shard(0),)):
        return False
    mesh = param.device_mesh
    rows = shard_rows(param.shape[0], mesh.size())
    shard_shape = (rows[0][1] - rows[0][0], *param.shape[1:])
    if math.prod(shard_shape) % 16 or param.numel() % 16 or not _chunk_stable(initializer, param, device):
        return False
    start, stop = rows[mesh.get_local_rank()]
    if stop == start:
        return True
    generator = parameter_generator(seed, name, device)
    scratch = torch.empty(shard_shape, dtype=param.dtype, device=device)
    for _ in range(start // shard_shape[0]):
        initializer(scratch, generator)
    local = param.to_local()
    if local.device == device and local.is_contiguous():
        initializer(local, generator)
    else:
        owned = scratch[:stop - start]
        initializer(owned, generator)
        local.copy_(owned)
    return True


def _chunk_stable(initializer: Initializer, param: torch.Tensor, device: torch.device) -> bool:
    """Whether `initializer` gives a tensor of `param`'s row width the same values drawn in four row chunks (each of
    at least _PROBE_CHUNK_VALUES values, a multiple of 16) as drawn whole, from generators of one seed."""
    width = math.prod(param.shape[1:])
    multiple = 16 // math.gcd(width, 16)
    chunk_rows = multiple * math.ceil(_PROBE_CHUNK_VALUES / (width * multiple))
    whole = torch.empty(4 * chunk_rows, *param.shape[1:], dtype=param.dtype, device=device)
    initializer(whole, torch.Generator(device=device).manual_seed(0))
    chunked = torch.empty_like(whole)
    generator = torch.Generator(device=device).manual_seed(0)
    for chunk in chunked.split(chunk_rows):
        initializer(chunk, generator)
    return torch.equal(whole, chunked)
