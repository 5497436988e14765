"""The Llama 3.1 transformer as a plain `nn.Module`: GQA attention with RoPE, SwiGLU feed-forward, RMSNorm.

It knows nothing of parallelism: `parallelize.py` and `pipeline.py` shard and split it. Built on the meta device,
it is materialised with `to_empty` and then `init_weights`; every parameter's initial values depend only on the
seed and the parameter's name, so any layout starts from the same weights.
"""

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchtitan.models.llama3.args import TransformerModelArgs

Initializer = Callable[[torch.Tensor, torch.Generator], None]


def rope_table(args: TransformerModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin of the rotary angles, shape (rope_len, head_dim // 2, 2), with Llama 3.1's frequency scaling."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, device=device,
                                                    dtype=torch.float64) / args.head_dim))
    if args.use_scaled_rope:
        freqs = scale_rope_frequencies(freqs)
    angles = torch.outer(torch.arange(args.rope_len, device=device, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def scale_rope_frequencies(freqs: torch.Tensor, factor: float = 8.0, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, original_context: int = 8192) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, interpolated, scaled)


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of `x` (batch, seq, heads, head_dim) by the angles in `rope`: (seq, head_dim/2, 2),
    or (batch, seq, head_dim/2, 2) when every sequence has positions of its own."""
    if torch.compiler.is_compiling():
        # Inductor generates no code for complex numbers: it would run the product below as an eager kernel and
        # split the fusion around it. Written out in real arithmetic, the rotation fuses with its neighbours.
        real, imaginary = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = rope.float().unsqueeze(-3).unbind(-1)
        rotated = torch.stack([real * cos - imaginary * sin, real * sin + imaginary * cos], dim=-1)
        return rotated.flatten(-2).type_as(x)
    # Eagerly, as one complex product in fp32: the same arithmetic as rotating the pairs with cos and sin, in one
    # kernel instead of about ten (5.9x faster forward + backward on the CPU at the debug shape).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    # A heads dimension before head_dim/2; broadcasting supplies the batch dimension of a shared table. (FSDP's
    # mixed precision casts a block's inputs, the table among them, to bf16, which has no complex type.)
    angles = torch.view_as_complex(rope.float()).unsqueeze(-2)
    return torch.view_as_real(pairs * angles).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.attention_device = args.attention_device
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: "DocumentMask | None" = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        # Sliced here, not in Transformer.forward: under sequence parallelism the blocks see the whole sequence
        # while the embedding output holds only a slice of it. A per-sequence table is already the right length.
        if rope.dim() == 3:
            rope = rope[:seqlen]
        q, k = apply_rotary_emb(q, rope), apply_rotary_emb(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        device_type = self.attention_device or q.device.type
        out = causal_attention(q, k, v, device_type) if mask is None else \
            block_causal_attention(q, k, v, mask, device_type)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


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


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        # By keyword: tensor parallelism's input plan for the attention covers its positional inputs only.
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    A pipeline stage keeps only some of its parts: a missing `tok_embeddings` means the input is already hidden
    states, a missing `norm`/`output` means the stage returns hidden states.
    """

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by the global layer index keeps parameter names stable when stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args, device=torch.device("meta")), persistent=False)
        # Document ids (None: one causal sequence) and positions -> the attention's mask, when context parallelism
        # attends to the keys of every rank (distributed/context_parallel.py: apply_document_cp).
        self.build_document_mask: Callable[[torch.Tensor | None, torch.Tensor | None], DocumentMask] | None = None

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """With `document_ids` (batch, seq) attention is block-causal (see `document_ids()`); `positions` (batch,
        seq) replace 0..seq-1 as RoPE positions (see `document_positions()`). Under context parallelism over
        gathered keys (`build_document_mask`), positions alone: causal by those positions."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.build_document_mask is not None and (document_ids is not None or positions is not None):
            mask = self.build_document_mask(document_ids, positions)
        else:
            mask = None if document_ids is None else document_mask(document_ids)
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_buffers(self, device: torch.device) -> None:
        self.rope = rope_table(self.args, device=device)

    def parameter_initializers(self) -> Iterator[tuple[str, nn.Parameter, Initializer]]:
        """(name, parameter, how to initialise it) for every parameter, with depth-scaled output projections."""
        output_std = self.args.dim ** -0.5
        for wrapped_name, param in self.named_parameters():
            name = checkpoint_name(wrapped_name)
            if name.endswith("norm.weight"):
                yield name, param, lambda t, g: nn.init.ones_(t)
            elif name == "tok_embeddings.weight":
                yield name, param, lambda t, g: nn.init.normal_(t, generator=g)
            elif name == "output.weight":
                yield name, param, _trunc_normal(output_std, cutoff=3 * output_std)
            else:
                layer_id = int(name.split(".")[1])
                depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
                is_residual_out = name.endswith(("attention.wo.weight", "feed_forward.w2.weight",
                                                 "feed_forward.w3.weight"))
                yield name, param, _trunc_normal(depth_std if is_residual_out else 0.02)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialise a materialised (non-sharded) model in place."""
        for name, param, initializer in self.parameter_initializers():
            initializer(param, parameter_generator(seed, name, param.device))
        self.init_buffers(buffer_device or next(self.parameters()).device)


def checkpoint_name(wrapped_name: str) -> str:
    """A parameter's name as checkpoints key it: activation-checkpoint and compile wrappers insert these segments
    into `named_parameters()` names; the model's state dict omits them."""
    return wrapped_name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _trunc_normal(std: float, cutoff: float | None = None) -> Initializer:
    """A normal of mean 0 and this std truncated to +-cutoff (default 2 std), by the inverse CDF of uniform draws:
    torch 2.11's `trunc_normal_` method. torch 2.13 rejection-samples instead, which draws other values from the same
    generator (docs/torch_versions.md); this one gives every tested torch the same initial weights, and draws value
    after value in order, so that a shard's rows can be drawn alone (distributed/rotated.py)."""
    bound = cutoff if cutoff is not None else 2 * std
    low, high = (math.erf(-bound / (std * math.sqrt(2.0))), math.erf(bound / (std * math.sqrt(2.0))))

    def draw(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        t.uniform_(low, high, generator=g).erfinv_().mul_(std * math.sqrt(2.0))
        return t.clamp_(-bound, bound)
    return draw


def parameter_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator for one parameter, seeded from the run's seed and the parameter's name."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count (on any device, meta included)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and getattr(model, "tok_embeddings", None) is not None:
        total -= model.tok_embeddings.weight.numel()
    return total


def flops_per_token(args: TransformerModelArgs, num_params_no_embedding: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter (forward + backward matmuls) plus attention
    scores and values, 12 * layers * heads * head_dim * seq_len (the full, unmasked attention square)."""
    return 6 * num_params_no_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
