"""Tokenize a data source once into token shards that the trainer reads memory-mapped.

    python scripts/tokenize_dataset.py SOURCE OUT_DIR [--hf_assets_path T] [--text_field F] [--workers N]

SOURCE is anything `training.dataset_path` takes (a .jsonl/.json/.parquet/.txt file, a folder of them, a glob, a
Hugging Face hub dataset id). Documents are encoded exactly as the trainer's on-the-fly path encodes them
(`BOS text EOS`, empty documents skipped), in the same order, so `--training.dataset_path OUT_DIR` trains on the same
token stream. Worker processes tokenize and write one shard per `--documents_per_shard` documents; the manifest,
written last, names the tokenizer and its sha256 (see torchtitan/components/datasets/shards.py for the format).
"""

import argparse
import itertools
import sys
import time
from collections import deque
from pathlib import Path

# Running `python scripts/tokenize_dataset.py` puts scripts/ first on sys.path, not the checkout that holds torchtitan.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from torchtitan.components.datasets.shards import (MANIFEST, shard_name, token_dtype, write_manifest,  # noqa: E402
                                                   write_shard)
from torchtitan.components.datasets.documents import document_texts  # noqa: E402
from torchtitan.components.datasets.text import worker_pool  # noqa: E402
from torchtitan.components.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402

_tokenizer = None


def _init_worker(hf_assets_path: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(hf_assets_path, option="--hf_assets_path")


def _tokenize_shard(folder: str, index: int, texts: list[str]) -> dict:
    documents = [_tokenizer.encode(text, add_bos=True, add_eos=True) for text in texts]
    return write_shard(Path(folder), shard_name(index), documents, token_dtype(_tokenizer.vocab_size))


def tokenize(source: str, out_dir: str, hf_assets_path: str = "", text_field: str = "text", workers: int = 1,
             documents_per_shard: int = 50_000, progress: bool = True) -> dict:
    """Write the shards and the manifest; returns the manifest's totals."""
    if workers < 1:
        raise UserError(f"--workers={workers} must be at least 1")
    if documents_per_shard < 1:
        raise UserError(f"--documents_per_shard={documents_per_shard} must be at least 1")
    tokenizer = build_tokenizer(hf_assets_path, option="--hf_assets_path")
    folder = Path(out_dir)
    if (folder / MANIFEST).exists():
        raise UserError(f"OUT_DIR={out_dir!r} already holds token shards; remove it or choose another folder")
    folder.mkdir(parents=True, exist_ok=True)
    texts, size = document_texts(source, text_field, "SOURCE")
    batches = iter(lambda: list(itertools.islice(texts, documents_per_shard)), [])
    shards: list[dict] = []
    begin = time.perf_counter()
    with worker_pool(workers, _init_worker, (hf_assets_path,)) as pool, \
            tqdm(total=size, unit="doc", disable=not progress, file=sys.stderr) as bar:
        pending: deque = deque()
        for index, batch in enumerate(batches):
            # At most two shards per worker in flight: the source is never read far ahead of the tokenizers.
            while len(pending) >= 2 * workers:
                shards.append(_collect(pending, bar))
            pending.append((len(batch), pool.apply_async(_tokenize_shard, (str(folder), index, batch))))
        while pending:
            shards.append(_collect(pending, bar))
    if not shards:
        raise UserError(f"SOURCE={source!r} has no documents with text")
    write_manifest(folder, tokenizer, shards, source, text_field)
    num_tokens = sum(s["num_tokens"] for s in shards)
    seconds = time.perf_counter() - begin
    return {"num_tokens": num_tokens, "num_documents": sum(s["num_documents"] for s in shards),
            "num_shards": len(shards), "seconds": seconds}


def _collect(pending: deque, bar: tqdm) -> dict:
    count, result = pending.popleft()
    entry = result.get()
    bar.update(count)
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="local files, a folder, a glob, or a Hugging Face hub dataset id")
    parser.add_argument("out_dir", help="folder to write the shards and manifest.json to")
    parser.add_argument("--hf_assets_path", default="", help="tokenizer, as model.hf_assets_path (empty = bundled)")
    parser.add_argument("--text_field", default="text", help="field of each record that holds the text")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--documents_per_shard", type=int, default=50_000, help="documents per shard file")
    args = parser.parse_args(argv)
    try:
        totals = tokenize(args.source, args.out_dir, args.hf_assets_path, args.text_field, args.workers,
                          args.documents_per_shard)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out_dir}: {totals['num_tokens']:,} tokens, {totals['num_documents']:,} documents, "
          f"{totals['num_shards']} shard(s) in {totals['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
