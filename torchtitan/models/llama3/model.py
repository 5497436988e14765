"""The Llama 3.1 transformer as a plain `nn.Module`: GQA attention with RoPE, SwiGLU feed-forward, RMSNorm.

It knows nothing of parallelism: `parallelize.py` and `pipeline.py` shard and split it. Built on the meta device,
it is materialised with `to_empty` and then `init_weights`; every parameter's initial values depend only on the
seed and the parameter's name, so any layout starts from the same weights.
"""

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.nn.attention import DocumentMask, block_causal_attention, causal_attention, document_mask
from torchtitan.nn.parameters import Initializer, checkpoint_name, parameter_generator, trunc_normal


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
                yield name, param, trunc_normal(output_std, cutoff=3 * output_std)
            else:
                layer_id = int(name.split(".")[1])
                depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
                is_residual_out = name.endswith(("attention.wo.weight", "feed_forward.w2.weight",
                                                 "feed_forward.w3.weight"))
                yield name, param, trunc_normal(depth_std if is_residual_out else 0.02)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialise a materialised (non-sharded) model in place."""
        for name, param, initializer in self.parameter_initializers():
            initializer(param, parameter_generator(seed, name, param.device))
        self.init_buffers(buffer_device or next(self.parameters()).device)


def flops_per_token(args: TransformerModelArgs, num_params_no_embedding: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter (forward + backward matmuls) plus attention
    scores and values, 12 * layers * heads * head_dim * seq_len (the full, unmasked attention square)."""
    return 6 * num_params_no_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
