"""Attention machinery that no model owns: causal attention in the layout fastest on each device, and attention
inside packed documents (block-causal): which document each token belongs to, its position in it, and the mask or
spans that block-causal attention reads (context parallelism, torchtitan/distributed/context_parallel.py, builds a
mask over the documents of every rank)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def cpu_attention_in_fp32(head_dim: int, seq_len: int) -> bool:
    """Whether bf16 attention of this shape runs faster in fp32 on the CPU: torch's CPU flash kernel is slower in bf16
    for short sequences and for narrow heads at medium lengths (measured per shape in docs/performance.md)."""
    return seq_len <= 256 or head_dim * seq_len < 16384


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device_type: str) -> torch.Tensor:
    """Causal SDPA over (batch, heads, seq, head_dim), with fewer (grouped) K/V heads than query heads, in the
    layout that is fastest on `device_type`."""
    if device_type != "cpu":
        # CUDA's cuDNN and memory-efficient kernels take no grouped K/V: expanded heads keep every kernel eligible.
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # The CPU flash kernel takes grouped K/V natively, which beats expanding them at every head width measured.
    if q.dtype == torch.bfloat16 and cpu_attention_in_fp32(q.shape[-1], q.shape[-2]):
        # Autocast must be off here, or it would cast the fp32 inputs back to bf16.
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@dataclass(frozen=True)
class DocumentSpans:
    """The documents of a batch on the CPU: each token's document index, and per sequence the [start, end) of each
    document (for attention run document by document)."""

    ids: torch.Tensor
    spans: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class GatheredDocuments:
    """Attention of this rank's queries against the keys and values of the whole sequence, which `gather` collects
    (keys and values together, grouped heads as they are) from the ranks that hold its parts (context parallelism,
    block-causal or causal: torchtitan/distributed/context_parallel.py builds it). `visible`: a BlockMask on GPUs,
    else (batch, 1, queries, keys) booleans."""

    visible: BlockMask | torch.Tensor
    gather: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# What block-causal attention needs of a batch's documents: a FlexAttention BlockMask on GPUs, the spans elsewhere.
DocumentMask = Union[BlockMask, DocumentSpans, GatheredDocuments]


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Index of the document each token belongs to inside its sequence: documents start at BOS (the part of a
    document cut off at the start of a window is document 0)."""
    return (tokens == bos_id).cumsum(dim=1)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own document: positions restart at every document start."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.where(torch.diff(document_ids, dim=1, prepend=document_ids[:, :1]) != 0, index, 0)
    return index - starts.cummax(dim=1).values


def document_mask(document_ids: torch.Tensor, flex: bool | None = None) -> DocumentMask:
    """The block-causal mask of a batch: a token sees the earlier tokens of its own document only. A BlockMask for
    FlexAttention with `flex` (default: on CUDA), else the documents' spans."""
    batch, seq = document_ids.shape
    if flex if flex is not None else document_ids.device.type == "cuda":
        def same_document_causal(b, h, q, kv):
            return (document_ids[b, q] == document_ids[b, kv]) & (q >= kv)

        return build_block_mask(same_document_causal, batch, seq, seq, document_ids.device)
    starts: list[list[int]] = [[0] for _ in range(batch)]
    for row, position in torch.nonzero(document_ids[:, 1:] != document_ids[:, :-1]).tolist():
        starts[row].append(position + 1)
    spans = tuple(tuple(zip(row, row[1:] + [seq])) for row in starts)
    return DocumentSpans(document_ids, spans)


_compiled_create_block_mask: Callable | None = None


def build_block_mask(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """FlexAttention's BlockMask of `mask_mod`, built once per batch and shared by every layer. On GPUs
    `create_block_mask` runs compiled (compiled once per process: the document ids are the graph's inputs, so a new
    batch does not recompile it); eager, it evaluates the mask on every (query, key) pair at once, O(batch x seq^2)
    memory: 268 MB at batch 4 and seq 8k, 4 GB at 32k (measured on CPU at seq 8k: 5.6 s and 2.9 GiB eager, 0.94 s
    and 0.5 GiB compiled). On CPU, where FlexAttention only runs forward, it stays eager (no compile start-up)."""
    if device.type != "cuda":
        return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


_compiled_flex_attention: Callable | None = None


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                           device_type: str) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) inside documents.

    GPUs: FlexAttention (compiled once) with the BlockMask, which skips the blocks between documents. CPU, where
    FlexAttention has no backward (torch 2.13): causal attention document by document, which does only the work
    inside documents (at seq 2048 it measured 2x faster than causal attention over the window, 4x faster than SDPA
    with a block-diagonal mask); inside torch.compile, SDPA with that mask instead, so that compiled blocks do not
    specialise on, and recompile for, every batch's document boundaries. Under context parallelism (packed
    documents, or one causal sequence with parallelism.context_parallel_method = allgather_kv), the same kernels
    (FlexAttention or SDPA with a boolean mask) over the gathered keys and values, their heads grouped.
    """
    if isinstance(mask, GatheredDocuments):
        (k, v), mask = mask.gather(k, v), mask.visible
    if isinstance(mask, BlockMask):
        global _compiled_flex_attention
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention)
        return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if torch.compiler.is_compiling():
        seq = mask.ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.ids.device).tril()
        allowed = ((mask.ids[:, :, None] == mask.ids[:, None, :]) & causal).unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return torch.cat([
        torch.cat([causal_attention(q[b:b + 1, :, start:end], k[b:b + 1, :, start:end], v[b:b + 1, :, start:end],
                                    device_type) for start, end in spans], dim=2)
        for b, spans in enumerate(mask.spans)
    ])
