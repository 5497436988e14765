"""Context parallelism: torch's `context_parallel` ring attention, made to work on CPU as well as on GPUs.

torch 2.13 shards SDPA over the sequence only for the CUDA attention kernels (flash, memory-efficient, cuDNN). On
CPU, SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`, which has neither a context-parallel handler nor
a DTensor sharding rule, so `context_parallel` fails there. The CPU kernel computes the same things as the CUDA
flash kernel (the output and the logsumexp the ring merges blocks with), so torch's own ring-attention loops work
for it unchanged; only the ops' argument and return conventions differ. When the context-parallel mesh is on the
CPU, this module therefore

- adds a handler for the CPU op and its backward to the table of ops that CP dispatches to ring attention
  (`custom_ops` in `torch.distributed.tensor.experimental._context_parallel._attention`), once: torch merges that
  table into DTensor's dispatcher only while a CP context is open;
- installs sequence-sharded (`Shard(2)`) sharding rules for the two ops only while the context is open, through
  `_op_strategy_context` of `..._context_parallel._sharding_rules`, exactly as torch does for the CUDA ops:
  outside CP a sequence-sharded SDPA would be wrong;
- computes with torch's `_templated_ring_attention` and `_templated_ring_attention_backward`, so head-tail load
  balancing and both rotate methods (allgather, alltoall) behave as on GPUs.

These are private torch symbols; `tests/unit/test_context_parallel.py` pins them, and a torch that handles the CPU
op itself is left alone.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context

from torchtitan.errors import UserError

ROTATE_METHODS = ("allgather", "alltoall")

aten = torch.ops.aten
CPU_SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# torch's ring attention hard-codes (batch, heads, seq, head_dim) for q/k/v; the logsumexp is (batch, heads, seq).
SEQ_DIM = 2


@contextlib.contextmanager
def context_parallel_context(cp_mesh: DeviceMesh, buffers: list[Tensor], buffer_seq_dims: list[int],
                             no_restore_buffers: set[Tensor], rotate_method: str) -> Iterator[None]:
    """Shard `buffers` along their sequence dims over `cp_mesh` (head-tail load balanced) and run every causal SDPA
    inside as ring attention. Forward, loss and backward must all run inside: the backward is ring attention too.
    Buffers not in `no_restore_buffers` get their full contents back on exit."""
    if rotate_method not in ROTATE_METHODS:
        raise UserError(f"option parallelism.context_parallel_rotate_method: {rotate_method!r} is not valid; "
                        f"valid: {', '.join(ROTATE_METHODS)}")
    cp_attention.set_rotate_method(rotate_method)
    with contextlib.ExitStack() as stack:
        if cp_mesh.device_type == "cpu":
            stack.enter_context(_cpu_sharding_rules())
        stack.enter_context(context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=buffer_seq_dims,
                                             no_restore_buffers=no_restore_buffers))
        yield


@contextlib.contextmanager
def _cpu_sharding_rules() -> Iterator[None]:
    register_cpu_ring_attention()
    with contextlib.ExitStack() as stack:
        for op, strategy in ((CPU_SDPA, _cpu_sdpa_strategy), (CPU_SDPA_BACKWARD, _cpu_sdpa_backward_strategy)):
            if cp_attention.custom_ops[op] is _cpu_sdpa_handler:
                stack.enter_context(_op_strategy_context(op, strategy))
        yield


def register_cpu_ring_attention() -> None:
    """Route the CPU SDPA ops to ring attention whenever a CP context is open. Idempotent; a handler torch itself
    provides for these ops wins."""
    for op in (CPU_SDPA, CPU_SDPA_BACKWARD):
        cp_attention.custom_ops.setdefault(op, _cpu_sdpa_handler)


def _cpu_sdpa_strategy(op_schema: OpSchema) -> OpStrategy:
    # (output, logsumexp) from (query, key, value), all sharded on the sequence.
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, [[Shard(SEQ_DIM)] * 5],
                                           input_index=2)


def _cpu_sdpa_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    # (grad_query, grad_key, grad_value) from (grad_out, query, key, value, out, logsumexp).
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                           [[Shard(SEQ_DIM)] * 9], input_index=3)


def _cpu_sdpa_handler(op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """DTensor's entry for the CPU SDPA ops while CP is on: local shards in, ring attention, sharded DTensors out."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    if op_info.local_kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallel attention supports is_causal masking only, not attn_mask")
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise AssertionError(f"context parallel {op_call} expects query, key and value sharded on the sequence")
    ring: Callable[..., tuple[Tensor, ...]] = _RING_ATTENTION[op_call]
    local_results = ring(op_info.compute_mesh.get_group(), *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local_results, output_sharding.output_spec)


def _ring_sdpa(group: dist.ProcessGroup, query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, *, attn_mask: Tensor | None = None,
               scale: float | None = None) -> tuple[Tensor, ...]:
    return cp_attention._templated_ring_attention(group, SEQ_DIM, CPU_SDPA, query=query, key=key, value=value,
                                                  is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_sdpa_backward(group: dist.ProcessGroup, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                        out: Tensor, logsumexp: Tensor, dropout_p: float, is_causal: bool, *,
                        attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, ...]:
    # The CPU backward's parameter names are the ones the templated backward passes by keyword.
    return cp_attention._templated_ring_attention_backward(
        group, SEQ_DIM, CPU_SDPA_BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
        value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


_RING_ATTENTION: dict[torch._ops.OpOverload, Callable[..., tuple[Tensor, ...]]] = {
    CPU_SDPA: _ring_sdpa,
    CPU_SDPA_BACKWARD: _ring_sdpa_backward,
}
