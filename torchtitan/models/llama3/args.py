"""Llama 3.1 model shapes: the published 8B/70B/405B flavors and small ones for debugging and tests."""

import dataclasses
import math
from dataclasses import dataclass

from torchtitan.errors import UserError


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
    """Longest sequence the model supports; the RoPE table is built for training.seq_len."""
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


def model_args_for(flavor: str, seq_len: int, vocab_size: int | None = None) -> TransformerModelArgs:
    """The flavor's shapes for training at `seq_len`; `vocab_size` (the tokenizer's) replaces the flavor's."""
    if flavor not in llama3_flavors:
        raise UserError(f"option model.flavor: unknown flavor {flavor!r}; valid: {', '.join(llama3_flavors)}")
    args = llama3_flavors[flavor]
    if seq_len > args.max_seq_len:
        raise UserError(f"option training.seq_len: {seq_len} exceeds the {args.max_seq_len} tokens that flavor "
                        f"{flavor} supports")
    return dataclasses.replace(args, rope_len=seq_len, vocab_size=vocab_size or args.vocab_size)
