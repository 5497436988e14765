"""Train the small bundled tokenizer on the train split of the embedded corpus.

A byte-level BPE with Llama 3's pre-tokenization regex is trained with Hugging Face `tokenizers` and
written in the tiktoken BPE format of Llama 3's `tokenizer.model`: one `base64(token bytes) rank` line
per mergeable token, the 256 single bytes first (rank = byte value), then merged tokens in the order
they were learned. tiktoken always applies the lowest-ranked available merge, so that order makes it
reproduce the trained BPE.

From the repository root:

    python -m scripts.train_tokenizer [--vocab-size 2048] [--output PATH]

writes `torchtitan/assets/tokenizer/tokenizer.model` unless told otherwise.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan.components.datasets.corpus import embedded_corpus
from torchtitan.components.tokenizer import DEFAULT_TOKENIZER_PATH, LLAMA3_PATTERN, TiktokenTokenizer
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import init_logger, logger

if TYPE_CHECKING:
    import tokenizers


def byte_level_alphabet() -> dict[str, int]:
    """The printable character that byte-level BPE uses for each byte value, mapped back to the byte.

    Bytes that are printable Latin-1 characters stand for themselves; the others (controls, space,
    soft hyphen) take the code points from 256 upwards, in byte order.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    char_to_byte = {chr(b): b for b in printable}
    substitutes = (b for b in range(256) if b not in printable)
    for offset, b in enumerate(substitutes):
        char_to_byte[chr(256 + offset)] = b
    return char_to_byte


def train_bpe(documents: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train a byte-level BPE with Llama 3's pre-tokenization on `documents`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=True,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def tiktoken_ranks(bpe: tokenizers.Tokenizer, vocab_size: int) -> dict[bytes, int]:
    """The byte strings of `bpe`'s first `vocab_size` tokens, ranked bytes first, then by merge order."""
    alphabet = byte_level_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(bpe.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        # Different merges can spell the same bytes; the first one learned owns the rank.
        ranks.setdefault(bytes(alphabet[c] for c in left + right), len(ranks))
        if len(ranks) == vocab_size:
            break
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    # Atomic: the bundled tokenizer is replaced whole or not at all.
    with atomic_write(path, encoding="ascii") as f:
        f.writelines(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in by_rank)


def count_mismatches(
    bpe: tokenizers.Tokenizer, ranks: dict[bytes, int], path: Path, documents: list[str]
) -> int:
    """How many of `documents` the written file encodes differently from the trained BPE."""
    alphabet = byte_level_alphabet()
    rank_of_id = {i: ranks[bytes(alphabet[c] for c in token)] for token, i in bpe.get_vocab().items()}
    written = TiktokenTokenizer(path)
    return sum(
        [rank_of_id[i] for i in bpe.encode(d).ids] != written.encode(d, add_bos=False, add_eos=False)
        for d in documents
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        help="mergeable tokens, the 256 single bytes included; Llama 3's 256 special tokens come on top",
    )
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_TOKENIZER_PATH, help="where to write the tiktoken BPE file"
    )
    args = parser.parse_args(argv)
    if args.vocab_size <= 256:
        parser.error(f"--vocab-size {args.vocab_size} is too small; it must exceed the 256 single bytes")

    init_logger()
    start = time.perf_counter()
    bpe = train_bpe(embedded_corpus("train"), args.vocab_size)
    ranks = tiktoken_ranks(bpe, args.vocab_size)
    if len(ranks) < args.vocab_size:
        logger.warning(
            f"The corpus yields only {len(ranks)} tokens, fewer than --vocab-size {args.vocab_size}"
        )
    write_ranks(ranks, args.output)

    validation = embedded_corpus("validation")
    mismatches = count_mismatches(bpe, ranks, args.output, validation)
    logger.info(
        f"Wrote {len(ranks)} mergeable tokens to {args.output} ({args.output.stat().st_size} bytes) "
        f"in {time.perf_counter() - start:.1f}s; tiktoken reproduces the trained BPE on "
        f"{len(validation) - mismatches}/{len(validation)} validation documents"
    )
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
