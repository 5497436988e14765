"""Tokenize a data source once into token shards that the trainer reads memory-mapped.

    python scripts/tokenize_dataset.py SOURCE OUT_DIR [--hf_assets_path T] [--text_field F] [--workers N]
        [--documents_per_shard K] [--part I/P]
    python scripts/tokenize_dataset.py --merge OUT_DIR [--hf_assets_path T]

SOURCE is anything `training.dataset_path` takes (a .jsonl/.json/.parquet/.txt file, a folder of them, a glob, a
Hugging Face hub dataset id). Documents are encoded exactly as the trainer's on-the-fly path encodes them
(`BOS text EOS`, empty documents skipped), in the same order, so `--training.dataset_path OUT_DIR` trains on the same
token stream. Worker processes tokenize and write one shard per `--documents_per_shard` documents; the manifest,
written last, names the tokenizer and its sha256 (see torchtitan/components/datasets/shards.py for the format).

Resuming: each shard written is recorded beside it (`shard-NNNNN.json`, after its files are complete). Run the same
command again after a crash and the shards recorded and matching their sha256 are kept; the others are written again.
The options must be those the folder was begun with (`tokenize.json`).

Splitting across machines: `--part I/P` (I = 0..P-1) writes shards I, I + P, I + 2P, ... only; every part reads the
whole source (to know where each shard's documents begin) but tokenizes only its own shards. Run the P parts into one
folder on a shared file system: the part that finishes last writes the manifest. Parts written on separate disks are
copied into one folder and joined with `--merge OUT_DIR`.
"""

import argparse
import hashlib
import itertools
import json
import re
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
from torchtitan.tools.files import atomic_write  # noqa: E402

SETTINGS = "tokenize.json"

_tokenizer = None


def _init_worker(hf_assets_path: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(hf_assets_path, option="--hf_assets_path")


def _kept_entry(folder: Path, name: str, itemsize: int) -> dict | None:
    """The recorded entry of shard `name` if its files are complete and its tokens match their sha256, else None."""
    record = folder / f"{name}.json"
    if not record.is_file():
        return None
    entry = json.loads(record.read_text())
    data, index = folder / f"{name}.bin", folder / f"{name}.idx"
    if not (data.is_file() and index.is_file() and data.stat().st_size == entry["num_tokens"] * itemsize
            and index.stat().st_size == (entry["num_documents"] + 1) * 8):
        return None
    digest = hashlib.sha256()
    with open(data, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return entry if digest.hexdigest() == entry["sha256"] else None


def _tokenize_shard(folder: str, index: int, texts: list[str]) -> tuple[dict, bool]:
    """Shard `index`'s entry, and whether it was kept from an earlier run (else it is written now)."""
    name, dtype = shard_name(index), token_dtype(_tokenizer.vocab_size)
    kept = _kept_entry(Path(folder), name, dtype.itemsize)
    if kept is not None:
        return kept, True
    documents = [_tokenizer.encode(text, add_bos=True, add_eos=True) for text in texts]
    entry = write_shard(Path(folder), name, documents, dtype)
    # Recorded after the shard's files are complete: a resumed run keeps only shards with a record.
    with atomic_write(Path(folder) / f"{name}.json") as f:
        json.dump(entry, f)
    return entry, False


def parse_part(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not int(match.group(1)) < int(match.group(2)):
        raise UserError(f"--part={text!r} must be I/P with 0 <= I < P (e.g. 0/4 for the first of 4 parts)")
    return int(match.group(1)), int(match.group(2))


def _begin(folder: Path, settings: dict) -> None:
    """Record the options a folder is begun with, or check that a resumed run or another part uses the same."""
    file = folder / SETTINGS
    if file.is_file():
        begun = json.loads(file.read_text())
        for key, value in settings.items():
            if begun.get(key) != value:
                option = {"source": "SOURCE", "tokenizer_sha256": "--hf_assets_path",
                          "parts": "--part"}.get(key, f"--{key}")
                raise UserError(f"{option}: OUT_DIR={str(folder)!r} was begun with {key} = {begun.get(key)!r}, now "
                                f"{value!r}; resume with the same options, or use another folder")
        return
    with atomic_write(file) as f:
        json.dump(settings, f, indent=1)


def tokenize(source: str, out_dir: str, hf_assets_path: str = "", text_field: str = "text", workers: int = 1,
             documents_per_shard: int = 50_000, progress: bool = True, part: str = "0/1") -> dict:
    """Write this part's shards (keeping those an earlier run wrote and recorded), then the manifest if every part
    is done; returns the part's totals."""
    if workers < 1:
        raise UserError(f"--workers={workers} must be at least 1")
    if documents_per_shard < 1:
        raise UserError(f"--documents_per_shard={documents_per_shard} must be at least 1")
    this_part, parts = parse_part(part)
    tokenizer = build_tokenizer(hf_assets_path, option="--hf_assets_path")
    folder = Path(out_dir)
    if (folder / MANIFEST).exists():
        raise UserError(f"OUT_DIR={out_dir!r} already holds token shards; remove it or choose another folder")
    texts, size = document_texts(source, text_field, "SOURCE")
    folder.mkdir(parents=True, exist_ok=True)
    _begin(folder, {"source": source, "text_field": text_field, "tokenizer_sha256": tokenizer.checksum,
                    "documents_per_shard": documents_per_shard, "parts": parts})
    batches = iter(lambda: list(itertools.islice(texts, documents_per_shard)), [])
    entries: dict[int, dict] = {}
    counts = {"written": 0, "kept": 0, "tokens": 0}
    begin = time.perf_counter()
    num_shards = 0
    with worker_pool(workers, _init_worker, (hf_assets_path,)) as pool, \
            tqdm(total=size, unit="doc", disable=not progress, file=sys.stderr) as bar:
        pending: deque = deque()

        def collect() -> None:
            index, count, result = pending.popleft()
            entries[index], kept = result.get()
            counts["kept" if kept else "written"] += 1
            counts["tokens"] += entries[index]["num_tokens"]
            bar.update(count)
            bar.set_postfix(shards_written=counts["written"], kept=counts["kept"],
                            tokens_per_s=f"{counts['tokens'] / (time.perf_counter() - begin):,.0f}", refresh=False)

        for index, batch in enumerate(batches):
            num_shards = index + 1
            if index % parts != this_part:  # another part's shard: its documents are only counted
                bar.update(len(batch))
                continue
            # At most two shards per worker in flight: the source is never read far ahead of the tokenizers.
            while len(pending) >= 2 * workers:
                collect()
            pending.append((index, len(batch), pool.apply_async(_tokenize_shard, (str(folder), index, batch))))
        while pending:
            collect()
    if not num_shards:
        raise UserError(f"SOURCE={source!r} has no documents with text")
    with atomic_write(folder / f"part-{this_part}-of-{parts}.json") as f:
        json.dump({"num_shards": num_shards, "shards": sorted(entries)}, f)
    seconds = time.perf_counter() - begin
    totals = {"num_tokens": counts["tokens"], "num_documents": sum(e["num_documents"] for e in entries.values()),
              "num_shards": len(entries), "written": counts["written"], "kept": counts["kept"], "seconds": seconds,
              "tokens_per_s": counts["tokens"] / seconds, "complete": False}
    if all((folder / f"part-{i}-of-{parts}.json").is_file() for i in range(parts)):
        merge(out_dir, hf_assets_path)
        totals["complete"] = True
    return totals


def merge(out_dir: str, hf_assets_path: str = "") -> dict:
    """Join the parts in `out_dir` into one manifest once every part is done; returns the manifest's totals."""
    folder = Path(out_dir)
    if not (folder / SETTINGS).is_file():
        raise UserError(f"OUT_DIR={out_dir!r} holds no tokenization begun by this script ({SETTINGS} is missing)")
    settings = json.loads((folder / SETTINGS).read_text())
    tokenizer = build_tokenizer(hf_assets_path, option="--hf_assets_path")
    if tokenizer.checksum != settings["tokenizer_sha256"]:
        raise UserError(f"--hf_assets_path={hf_assets_path!r}: its tokenizer has sha256 {tokenizer.checksum[:12]}..., "
                        f"the parts were tokenized with {settings['tokenizer_sha256'][:12]}...; give the same "
                        f"tokenizer")
    parts = settings["parts"]
    missing = [i for i in range(parts) if not (folder / f"part-{i}-of-{parts}.json").is_file()]
    if missing:
        raise UserError(f"OUT_DIR={out_dir!r}: part(s) {', '.join(f'{i}/{parts}' for i in missing)} are not done; "
                        f"run them (or copy their folders' files here) first")
    num_shards = json.loads((folder / f"part-0-of-{parts}.json").read_text())["num_shards"]
    entries = []
    for index in range(num_shards):
        record = folder / f"{shard_name(index)}.json"
        if not record.is_file():
            raise UserError(f"OUT_DIR={out_dir!r}: shard {shard_name(index)} is missing (part "
                            f"{index % parts}/{parts}); run that part again to write it")
        entries.append(json.loads(record.read_text()))
    write_manifest(folder, tokenizer, entries, settings["source"], settings["text_field"])
    return {"num_tokens": sum(e["num_tokens"] for e in entries),
            "num_documents": sum(e["num_documents"] for e in entries), "num_shards": num_shards}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="local files, a folder, a glob, or a Hugging Face hub dataset id")
    parser.add_argument("out_dir", nargs="?", help="folder to write the shards and manifest.json to")
    parser.add_argument("--hf_assets_path", default="", help="tokenizer, as model.hf_assets_path (empty = bundled)")
    parser.add_argument("--text_field", default="text", help="field of each record that holds the text")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--documents_per_shard", type=int, default=50_000, help="documents per shard file")
    parser.add_argument("--part", default="0/1", help="I/P: write only part I of P (shards I, I + P, ...)")
    parser.add_argument("--merge", metavar="OUT_DIR", help="join the parts written into OUT_DIR into one manifest")
    args = parser.parse_args(argv)
    if (args.merge is None) != (args.out_dir is not None):
        parser.error("give SOURCE OUT_DIR, or --merge OUT_DIR alone")
    try:
        if args.merge is not None:
            totals = merge(args.merge, args.hf_assets_path)
            print(f"{args.merge}: {totals['num_tokens']:,} tokens, {totals['num_documents']:,} documents, "
                  f"{totals['num_shards']} shard(s)")
            return 0
        totals = tokenize(args.source, args.out_dir, args.hf_assets_path, args.text_field, args.workers,
                          args.documents_per_shard, part=args.part)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    done = "complete" if totals["complete"] else f"part {args.part} done, waiting for the other parts"
    print(f"{args.out_dir}: {totals['num_tokens']:,} tokens, {totals['num_documents']:,} documents, "
          f"{totals['num_shards']} shard(s) ({totals['written']} written, {totals['kept']} kept) in "
          f"{totals['seconds']:.1f} s, {totals['tokens_per_s']:,.0f} tokens/s; {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
