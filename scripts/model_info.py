"""Parameter counts, shapes and training FLOPs per token of the Llama 3.1 flavors, without allocating weights.

From the repository root:

    python scripts/model_info.py --flavor 8B --seq_len 8192
    python scripts/model_info.py --all

The model is built on the meta device, so even 405B costs no weight memory. The counts use each flavor's own
vocabulary (Meta's 128,256 tokens for 8B/70B/405B); the trainer replaces it with its tokenizer's size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Running `python scripts/model_info.py` puts scripts/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan.errors import UserError  # noqa: E402
from torchtitan.models.llama3.args import llama3_flavors, model_args_for  # noqa: E402
from torchtitan.models.llama3.model import Transformer, flops_per_token  # noqa: E402
from torchtitan.nn.parameters import count_parameters  # noqa: E402


def describe(flavor: str, seq_len: int) -> str:
    """The report of one flavor trained at `seq_len`; a UserError if the flavor or seq_len is not valid."""
    if flavor not in llama3_flavors:
        raise UserError(f"--flavor: unknown flavor {flavor!r}; valid: {', '.join(llama3_flavors)}")
    if seq_len <= 0:
        raise UserError(f"--seq_len: {seq_len} must be a positive integer")
    args = model_args_for(flavor, seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    total = count_parameters(model)
    no_embedding = count_parameters(model, exclude_embeddings=True)
    flops = flops_per_token(args, no_embedding, seq_len)
    lines = [
        f"llama3 {flavor}",
        f"  parameters            {total:>17,}  ({_billions(total)})",
        f"  without embeddings    {no_embedding:>17,}  ({_billions(no_embedding)})",
        f"  dim {args.dim}, layers {args.n_layers}, heads {args.n_heads}, kv heads {args.kv_heads}, "
        f"head dim {args.head_dim}",
        f"  ffn hidden dim {args.ffn_hidden_dim}, vocab {args.vocab_size:,}, max seq len {args.max_seq_len:,}, "
        f"rope theta {args.rope_theta:g}" + (" (Llama 3.1 scaled)" if args.use_scaled_rope else ""),
        f"  training FLOPs/token  {flops:>17,}  ({flops / 1e9:.4g} GFLOPs) at seq_len {seq_len:,}",
    ]
    return "\n".join(lines)


def _billions(count: int) -> str:
    # Three decimals say nothing about the debug flavors' few million parameters.
    return f"{count / 1e9:.3f} B" if count >= 1e9 else f"{count / 1e9:.6f} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--flavor", help=f"one of {', '.join(llama3_flavors)}")
    which.add_argument("--all", action="store_true", help="every flavor")
    parser.add_argument("--seq_len", type=int, default=8192, help="training sequence length (default: 8192)")
    options = parser.parse_args(argv)
    flavors = list(llama3_flavors) if options.all else [options.flavor]
    try:
        reports = [describe(flavor, options.seq_len) for flavor in flavors]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
