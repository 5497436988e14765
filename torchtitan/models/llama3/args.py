"""Llama 3.1 model shapes: the published 8B/70B/405B flavors and small ones for debugging and tests."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torchtitan.config.model_shape import SHAPE_OPTIONS
from torchtitan.errors import UserError
from torchtitan.protocols import ModelShape


@dataclass
class TransformerModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True
    """Llama 3.1 frequency scaling of RoPE (factor 8 over an original context of 8192)."""
    max_seq_len: int = 131072
    """Longest sequence the model supports (its context, exported as max_position_embeddings): the flavor's, or the
    training sequence where that is longer (training at a length extends the context, as long-context training of
    Llama 3 did); the RoPE table is built for training.seq_len."""
    rope_len: int = 131072
    attention_device: str | None = None
    """Device type whose attention layout to use (cpu: grouped K/V heads into SDPA; cuda: expanded heads); None =
    the tensors' own device. A dry run on CPU tensors sets cuda to take (and account for) the GPU layout."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Meta's SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to a multiple of multiple_of."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


llama3_flavors: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2304,
                                       max_seq_len=8192),
    "tiny": TransformerModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2304, multiple_of=64,
                                 max_seq_len=8192),
    "8B": TransformerModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                               multiple_of=1024),
    "70B": TransformerModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                                multiple_of=4096),
    "405B": TransformerModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                                 multiple_of=4096),
}


def model_args_for(flavor: str, seq_len: int, vocab_size: int | None = None,
                   overrides: dict[str, Any] | None = None) -> TransformerModelArgs:
    """The flavor's shapes for training at `seq_len`; `vocab_size` (the tokenizer's) replaces the flavor's.

    `overrides` ({option: value} of SHAPE_OPTIONS, from [model]) replace the flavor's values; a `vocab_size` among
    them pads the embedding beyond the tokenizer's vocabulary (it must hold every token id). The combination is
    checked, each error naming the model.* option at fault.
    """
    if flavor not in llama3_flavors:
        raise UserError(f"option model.flavor: unknown flavor {flavor!r}; valid: {', '.join(llama3_flavors)}")
    args = llama3_flavors[flavor]
    if seq_len < 1:
        raise UserError(f"option training.seq_len: {seq_len} must be a positive integer")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(SHAPE_OPTIONS))
    if unknown:
        raise ValueError(f"not shape options: {', '.join(unknown)}")
    if vocab_size is not None and overrides.get("vocab_size", vocab_size) < vocab_size:
        raise UserError(f"option model.vocab_size: {overrides['vocab_size']} is smaller than the tokenizer's "
                        f"vocabulary ({vocab_size} tokens); use at least {vocab_size}, or leave it unset")
    vocab_size = overrides.pop("vocab_size", vocab_size or args.vocab_size)
    args = dataclasses.replace(args, rope_len=seq_len, max_seq_len=max(args.max_seq_len, seq_len),
                               vocab_size=vocab_size, **overrides)
    _check_shape(args)
    return args


def model_shape(args: TransformerModelArgs) -> ModelShape:
    """What model.json records: every value that decides what the weights compute, named as the model.* options; the
    SwiGLU width both as its options and as the width they give, which is what is compared."""
    record = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
              "ffn_dim_multiplier": args.ffn_dim_multiplier, "multiple_of": args.multiple_of,
              "ffn_hidden_dim": args.ffn_hidden_dim, "vocab_size": args.vocab_size, "rope_theta": args.rope_theta,
              "norm_eps": args.norm_eps, "use_scaled_rope": args.use_scaled_rope}
    return ModelShape(record, compared=tuple(name for name in record
                                             if name not in ("ffn_dim_multiplier", "multiple_of")))


def _check_shape(args: TransformerModelArgs) -> None:
    """The combination of shapes a transformer can have; each error names the model.* options concerned."""
    for name in ("dim", "n_layers", "n_heads", "multiple_of", "vocab_size"):
        if getattr(args, name) < 1:
            raise UserError(f"option model.{name}: {getattr(args, name)} must be a positive integer")
    if args.n_kv_heads is not None and args.n_kv_heads < 1:
        raise UserError(f"option model.n_kv_heads: {args.n_kv_heads} must be a positive integer")
    for name in ("ffn_dim_multiplier", "rope_theta"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UserError(f"option model.{name}: {value} must be positive")
    if args.dim % args.n_heads:
        raise UserError(f"option model.dim: {args.dim} is not divisible by model.n_heads = {args.n_heads}; each "
                        f"head gets dim / n_heads channels")
    if args.head_dim % 2:
        raise UserError(f"option model.n_heads: dim / n_heads = {args.dim} / {args.n_heads} = {args.head_dim} is "
                        f"odd; rotary embeddings need an even head dimension")
    if args.n_heads % args.kv_heads:
        raise UserError(f"option model.n_kv_heads: {args.kv_heads} does not divide model.n_heads = {args.n_heads}; "
                        f"each key/value head serves the same number of query heads")
