"""Context parallelism: attention over keys and values all-gathered from the CP group (the default, and packed
documents), or torch's `context_parallel` ring attention, made to work on CPU as well as on GPUs.

Two methods run causal attention (parallelism.context_parallel_method, docs/parallelism.md compares them):

- allgather_kv (the default; the Llama 3 paper's, section 3.3.2): every layer all-gathers the grouped keys and
  values of the whole sequence (n_kv_heads of the rank's TP shard, not expanded to the query heads) and attends the
  rank's head-tail chunks to them under the causal mask by global positions: packed documents' path below, with
  one document. The ring moves n_heads / n_kv_heads times those bytes per call (4x for Llama 3.1 8B, 16x for 405B).
- ring: torch's ring attention, to which the GPU attention path passes keys and values expanded to the query heads.

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
  the temporary-strategy hook of `..._context_parallel._sharding_rules`, exactly as torch does for the CUDA ops:
  outside CP a sequence-sharded SDPA would be wrong;
- computes with torch's `_templated_ring_attention` and `_templated_ring_attention_backward`, so head-tail load
  balancing and both rotate methods (allgather, alltoall) behave as on GPUs.

These are private torch symbols, reached through `torch_compat` (torch 2.14 installs single-dimension strategies
where 2.13 installed op strategies); `tests/unit/test_context_parallel.py` pins them, and a torch that handles the
CPU op itself is left alone.

Packed documents (`model.attention_mask = "block_causal"`) always take the other path, on every device: ring attention
merges causal blocks, not arbitrary masks. Each rank all-gathers the keys and values of the whole sequence and
attends its own queries to them under the block-causal mask of its tokens, as the Llama 3 paper does for document
masks:

- the exchange is cheap: with grouped-query attention K and V are each n_kv_heads / n_heads of the query's size
  (1/4 for Llama 3.1 8B), one all-gather of both per layer; its backward is a reduce-scatter of the key and value
  gradients (`all_gather_single_autograd` of torch's functional collectives);
- the mask is exact for any layout of documents: a query sees a key when both belong to the same document and the
  key's position is not later (document positions or global ones, both increase inside a document), whichever rank
  holds it, so no block has to be skipped or merged by hand and the result is the single-process one;
- it has a backward everywhere: on CPUs SDPA with a boolean mask (FlexAttention has no CPU backward in torch 2.13),
  on CUDA FlexAttention with a BlockMask built from the same rule, which skips the blocks no query sees.

Ring attention that skips invisible blocks would save the full key/value buffer (one layer's at a time under
activation checkpointing) at the price of merging partial results by logsumexp for every mask shape; with GQA the
gathered K/V of a 128k sequence (512 MiB for 8B in bf16) is a fraction of one layer's activations at 16k tokens per
rank, so the simpler exact exchange wins.

The work of a block-causal mask depends on where documents fall, so head-tail balancing (right for one causal
document) is not enough: the sequence is cut into 8 x cp chunks whose visible (query, key) pairs are counted, and
chunks go to ranks heaviest first, each to the least loaded rank with room (or head-tail, if that balances better).
Every rank computes the same assignment from the same batch, without communication; inputs, labels, document ids
and positions are sharded by it alike. `benchmarks/cp_balance.py` measures it (docs/parallelism.md).
"""

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention.flex_attention import BlockMask

from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError
from torchtitan.models.llama3.model import GatheredDocuments, build_block_mask, document_positions

ROTATE_METHODS = ("allgather", "alltoall")

# torch's ring attention hard-codes (batch, heads, seq, head_dim) for q/k/v; the logsumexp is (batch, heads, seq).
SEQ_DIM = 2


def _cpu_sdpa_ops() -> tuple["torch._ops.OpOverload", "torch._ops.OpOverload"]:
    """The CPU's SDPA op and its backward (looked up when CP runs on the CPU, not at import)."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


@contextlib.contextmanager
def context_parallel_context(cp_mesh: DeviceMesh, buffers: list[Tensor], buffer_seq_dims: list[int],
                             no_restore_buffers: set[Tensor], rotate_method: str) -> Iterator[None]:
    """Shard `buffers` along their sequence dims over `cp_mesh` (head-tail load balanced) and run every causal SDPA
    inside as ring attention. Forward, loss and backward must all run inside: the backward is ring attention too.
    Buffers not in `no_restore_buffers` get their full contents back on exit."""
    if rotate_method not in ROTATE_METHODS:
        raise UserError(f"option parallelism.context_parallel_rotate_method: {rotate_method!r} is not valid; "
                        f"valid: {', '.join(ROTATE_METHODS)}")
    if rotate_method != "allgather":  # torch's default: a torch without the setter still runs it
        torch_compat.get("set_rotate_method")(rotate_method)
    with contextlib.ExitStack() as stack:
        if cp_mesh.device_type == "cpu":
            stack.enter_context(_cpu_sharding_rules())
        stack.enter_context(context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=buffer_seq_dims,
                                             no_restore_buffers=no_restore_buffers))
        yield


@contextlib.contextmanager
def _cpu_sharding_rules() -> Iterator[None]:
    register_cpu_ring_attention()
    sdpa, sdpa_backward = _cpu_sdpa_ops()
    custom_ops = torch_compat.get("cp_custom_ops")
    with contextlib.ExitStack() as stack:
        # (output, logsumexp) from (query, key, value); (grad_query, grad_key, grad_value) from (grad_out, query, key,
        # value, out, logsumexp): all sharded on the sequence.
        for op, tensors, input_index in ((sdpa, 5, 2), (sdpa_backward, 9, 3)):
            if custom_ops[op] is _cpu_sdpa_handler:
                stack.enter_context(torch_compat.sequence_sharded_strategy(op, tensors, input_index))
        yield


def register_cpu_ring_attention() -> None:
    """Route the CPU SDPA ops to ring attention whenever a CP context is open. Idempotent; a handler torch itself
    provides for these ops wins."""
    custom_ops = torch_compat.get("cp_custom_ops")
    for op in _cpu_sdpa_ops():
        custom_ops.setdefault(op, _cpu_sdpa_handler)


def _cpu_sdpa_handler(op_call: "torch._ops.OpOverload", args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """DTensor's entry for the CPU SDPA ops while CP is on: local shards in, ring attention, sharded DTensors out."""
    dispatcher = torch_compat.get("dtensor_dispatcher")
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    if op_info.local_kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallel attention supports is_causal masking only, not attn_mask")
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise AssertionError(f"context parallel {op_call} expects query, key and value sharded on the sequence")
    ring = _ring_sdpa if op_call is _cpu_sdpa_ops()[0] else _ring_sdpa_backward
    local_results = ring(op_info.compute_mesh.get_group(), *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local_results, output_sharding.output_spec)


def _ring_sdpa(group: dist.ProcessGroup, query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, *, attn_mask: Tensor | None = None,
               scale: float | None = None) -> tuple[Tensor, ...]:
    return torch_compat.get("ring_attention")(group, SEQ_DIM, _cpu_sdpa_ops()[0], query=query, key=key, value=value,
                                              is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_sdpa_backward(group: dist.ProcessGroup, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                        out: Tensor, logsumexp: Tensor, dropout_p: float, is_causal: bool, *,
                        attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, ...]:
    # The CPU backward's parameter names are the ones the templated backward passes by keyword.
    return torch_compat.get("ring_attention_backward")(
        group, SEQ_DIM, _cpu_sdpa_ops()[1], grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
        value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)



# ----------------------------------------------------------------------------------------------------------------
# Keys and values gathered from the whole CP group: packed documents (block-causal), and one causal sequence

def gathers_keys_and_values(config) -> bool:
    """Whether context parallelism all-gathers the grouped keys and values (model.attention_mask = block_causal, or
    causal with parallelism.context_parallel_method = allgather_kv) rather than running torch's ring attention."""
    parallelism = config.parallelism
    return parallelism.context_parallel_degree > 1 and (
        config.model.attention_mask == "block_causal" or parallelism.context_parallel_method == "allgather_kv")


# Chunks per rank of the balanced assignment. With 2 (head-tail's cut), windows of 131072 tokens of packed documents
# on CP 8 left the busiest rank 1.22-1.62x the mean attention work on average; with 8, 1.01-1.03x, worst window 1.05x
# (benchmarks/cp_balance.py, docs/parallelism.md). The sequence must split into 8 x cp chunks (parallelize.py checks).
CHUNKS_PER_RANK = 8
# One causal sequence: head-tail's two chunks per rank balance it exactly (the ring's cut, 2 x cp chunks).
CAUSAL_CHUNKS_PER_RANK = 2


def chunk_work(document_ids: Tensor, num_chunks: int) -> Tensor:
    """Visible (query, key) pairs of the block-causal mask in each of `num_chunks` equal chunks of the sequence,
    summed over the batch: a query sees the tokens of its document up to itself, its document position + 1."""
    visible = document_positions(document_ids) + 1
    return visible.reshape(document_ids.shape[0], num_chunks, -1).sum(dim=(0, 2))


def head_tail_order(cp: int, chunks_per_rank: int) -> list[int]:
    """Head-tail ("zigzag") balancing of one causal document, for an even number of chunks per rank: in each run of
    2cp chunks, rank r holds chunks r and 2cp-1-r (whose works add up to the same for every r)."""
    return [start + chunk for rank in range(cp) for start in range(0, chunks_per_rank * cp, 2 * cp)
            for chunk in (rank, 2 * cp - 1 - rank)]


def rank_loads(work: Tensor, order: list[int], cp: int) -> Tensor:
    """Work of each rank when rank r holds the chunks order[r*k:(r+1)*k] (k = chunks per rank)."""
    return work[order].reshape(cp, -1).sum(dim=1)


def balanced_chunk_order(work: Tensor, cp: int) -> list[int]:
    """The chunks of each rank, rank after rank, for the given work of an even number of chunks per rank:
    heaviest chunk first, each to the least loaded rank that still has room; head-tail instead where it is better
    balanced, so that one causal document is balanced as well as before."""
    values = work.tolist()  # one copy to the host (from a GPU), not one per chunk
    per_rank = len(values) // cp
    loads, held = [0] * cp, [[] for _ in range(cp)]
    # Ties are broken by chunk index: every rank computes the same assignment.
    for chunk in sorted(range(len(values)), key=lambda c: (-values[c], c)):
        rank = min((r for r in range(cp) if len(held[r]) < per_rank), key=lambda r: (loads[r], r))
        held[rank].append(chunk)
        loads[rank] += values[chunk]
    greedy = [chunk for chunks in held for chunk in sorted(chunks)]

    def busiest(order: list[int]) -> int:
        return max(sum(values[c] for c in order[r * per_rank:(r + 1) * per_rank]) for r in range(cp))

    return min(greedy, head_tail_order(cp, per_rank), key=busiest)


def shard_documents(cp_mesh: DeviceMesh, document_ids: Tensor | None, tensors: list[Tensor]) -> list[Tensor]:
    """This rank's share of (batch, seq) `tensors` (inputs, labels, document ids, positions): the chunks that
    `balanced_chunk_order` gives it by the work of the batch's mask, in sequence order. Without `document_ids` the
    sequences are causal, one document each: head-tail's two chunks per rank, as the ring shards them."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    per_rank = CHUNKS_PER_RANK if document_ids is not None else CAUSAL_CHUNKS_PER_RANK
    num_chunks = per_rank * cp
    if document_ids is None or torch_compat.is_fake(document_ids):
        # Head-tail balances one document exactly: a causal sequence's, and a dry run's (its tensors have no values
        # to count; its sequences are one document each, dry_run.FAKE_BOS_ID).
        order = head_tail_order(cp, per_rank)
    else:
        order = balanced_chunk_order(chunk_work(document_ids, num_chunks), cp)
    mine = order[rank * per_rank:(rank + 1) * per_rank]
    return [torch.cat([tensor.chunk(num_chunks, dim=1)[chunk] for chunk in mine], dim=1) for tensor in tensors]


def visible_keys(query_ids: Tensor | None, query_positions: Tensor, key_ids: Tensor | None, key_positions: Tensor,
                 flex: bool) -> BlockMask | Tensor:
    """Where a query sees a key: same document, key not later; without ids (one causal sequence), key not later.
    Positions may be global or restart per document: both increase inside a document, so either orders its tokens.
    A BlockMask for FlexAttention with `flex`, else (batch, 1, queries, keys) booleans."""
    batch, queries, keys = query_positions.shape[0], query_positions.shape[1], key_positions.shape[1]
    if flex:
        if query_ids is None:
            def visible(b, h, q, kv):
                return query_positions[b, q] >= key_positions[b, kv]
        else:
            def visible(b, h, q, kv):
                return (query_ids[b, q] == key_ids[b, kv]) & (query_positions[b, q] >= key_positions[b, kv])

        return build_block_mask(visible, batch, queries, keys, query_positions.device)
    not_later = query_positions[:, :, None] >= key_positions[:, None, :]
    if query_ids is not None:
        not_later &= query_ids[:, :, None] == key_ids[:, None, :]
    return not_later.unsqueeze(1)


def _gather_keys_and_values(key: Tensor, value: Tensor, gather: Callable[[Tensor, int, dist.ProcessGroup], Tensor],
                            group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """(batch, kv heads, local seq, head_dim) keys and values -> those of the whole sequence, rank after rank, in one
    all-gather (`gather`: torch_compat's autograd all-gather; one call's latency, not two); backward: one
    reduce-scatter of their gradients. Grouped heads stay grouped: the kernels take them as they are (enable_gqa)."""
    gathered = gather(torch.cat([key, value], dim=1), SEQ_DIM, group)
    # Split, not sliced: backward concatenates the two gradients into one buffer for the reduce-scatter, where a
    # slice's backward would allocate a whole zero buffer for each.
    return gathered.split(key.shape[1], dim=1)


class DocumentsAcrossRanks:
    """The model's document mask under context parallelism (`Transformer.build_document_mask`): from this rank's
    document ids (None: one causal sequence) and positions, the mask of its queries against the keys of every rank,
    and how to gather them."""

    def __init__(self, group: dist.ProcessGroup, flex: bool):
        self.group = group
        self.flex = flex

    def __call__(self, document_ids: Tensor | None, positions: Tensor | None) -> GatheredDocuments:
        if positions is None:
            raise ValueError("attention under context parallelism over gathered keys needs each token's position")
        # Document ids and positions of the whole sequence, in the order the keys and values will be gathered in.
        local = positions[None] if document_ids is None else torch.stack([document_ids, positions])
        keys = torch_compat.all_gather(local, 2, self.group)
        key_ids, key_positions = (None, keys[0]) if document_ids is None else (keys[0], keys[1])
        mask = visible_keys(document_ids, positions, key_ids, key_positions, flex=self.flex)
        # The collective is looked up here, outside the blocks that torch.compile may trace.
        return GatheredDocuments(mask, functools.partial(
            _gather_keys_and_values, gather=torch_compat.all_gather_autograd_function(), group=self.group))


def apply_document_cp(model: torch.nn.Module, cp_mesh: DeviceMesh) -> None:
    """Let the model's (or pipeline stage's) attention see the keys and values on the other CP ranks: block-causal
    over packed documents, or causal (`gathers_keys_and_values`). FlexAttention where it has a backward, on CUDA (the
    model's attention device: a dry run for GPUs takes their path on fake tensors of the host), SDPA with booleans
    elsewhere."""
    device = model.args.attention_device or cp_mesh.device_type
    model.build_document_mask = DocumentsAcrossRanks(cp_mesh.get_group(), flex=device == "cuda")
