"""Start-up time, open files and memory maps of one rank's token-shard loader against the number of shards, printed
as one JSON line on stdout (the log goes to stderr).

    python benchmarks/benchmark_shard_scale.py                          # 100, 1,000, 10,000 and 100,000 shards
    python benchmarks/benchmark_shard_scale.py --counts 100 1000 --module /tmp/old_shards.py

For each count N it writes N synthetic shards of --windows windows of --seq_len + 1 random token ids each (once,
under --folder, kept for the next run), then in a fresh process per N: opens the folder as one rank's
`ShardDataset` (start_s: the constructor, after the imports), reads --reads windows in the rank's random order
(reads_per_s) and counts this process's file descriptors and memory maps of the folder's files after opening and
after reading, with the shards open in the loader's cache. The shards are in the page cache (just written or read
before): the times are those of a warm local file system; on a shared one every file lookup costs a round trip.

--module loads the shard format and `ShardDataset` from another copy of shards.py (for instance an earlier
commit's, from `git show COMMIT:torchtitan/components/datasets/shards.py`), to compare; a failure to open is
reported as its error.
"""

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Running `python benchmarks/benchmark_shard_scale.py` puts benchmarks/ first on sys.path, not the checkout with
# torchtitan.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.benchmark import json_main  # noqa: E402
from torchtitan.components.datasets import shards as default_shards  # noqa: E402
from torchtitan.components.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

# Runs in a fresh process per shard count: only its own files and maps are counted.
CHILD = """
import importlib.util, json, os, sys, time
sys.path.insert(0, {repo!r})
from torchtitan.components.tokenizer import build_tokenizer
if {module!r}:
    spec = importlib.util.spec_from_file_location("shards_under_test", {module!r})
    shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shards)
else:
    from torchtitan.components.datasets import shards
tokenizer = build_tokenizer("")

def counts():
    fds = sum(os.path.realpath(f"/proc/self/fd/{{fd}}").startswith({folder!r}) for fd in os.listdir("/proc/self/fd"))
    maps = sum(1 for line in open("/proc/self/maps") if {folder!r} in line)
    return fds, maps

result = {{}}
begin = time.perf_counter()
try:
    dataset = shards.ShardDataset(path={folder!r}, tokenizer=tokenizer, seq_len={seq_len}, dp_rank=0, dp_degree=1,
                                  infinite=True, seed=0)
except Exception as e:
    print(json.dumps({{"error": f"{{type(e).__name__}}: {{e}}"}}))
    sys.exit(0)
result["start_s"] = time.perf_counter() - begin
result["open_files_after_start"], result["maps_after_start"] = counts()
begin = time.perf_counter()
for sample in range({reads}):
    dataset.window(sample)
result["reads_per_s"] = {reads} / (time.perf_counter() - begin)
result["open_files_after_reads"], result["maps_after_reads"] = counts()
print(json.dumps(result))
"""


def write_shards(shards, folder: Path, tokenizer, count: int, tokens_per_shard: int) -> None:
    """`count` shards of random ids in the format of the `shards` module, unless the folder already holds them."""
    if (folder / shards.MANIFEST).exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    dtype = shards.token_dtype(tokenizer.vocab_size)
    offsets = np.array([0, tokens_per_shard], dtype=np.int64).tobytes()
    entries = []
    begin = time.perf_counter()
    for index in range(count):
        tokens = rng.integers(0, tokenizer.vocab_size, tokens_per_shard, dtype=dtype).tobytes()
        name = shards.shard_name(index)
        (folder / f"{name}.bin").write_bytes(tokens)
        (folder / f"{name}.idx").write_bytes(offsets)
        entries.append({"name": name, "num_tokens": tokens_per_shard, "num_documents": 1,
                        "sha256": hashlib.sha256(tokens).hexdigest()})
    shards.write_manifest(folder, tokenizer, entries, source="random ids", text_field="text")
    logger.info(f"wrote {count} shards to {folder} in {time.perf_counter() - begin:.1f} s")


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 1_000, 10_000, 100_000])
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=3, help="windows of seq_len + 1 tokens per shard")
    parser.add_argument("--reads", type=int, default=2_000, help="windows read after start-up")
    parser.add_argument("--folder", default="/tmp/torchtitan_shard_scale", help="where the shards are written")
    parser.add_argument("--module", default="", help="a shards.py to load ShardDataset from instead")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer("")
    shards = default_shards
    if args.module:
        spec = importlib.util.spec_from_file_location("shards_under_test", args.module)
        shards = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(shards)
    result: dict = {"seq_len": args.seq_len, "windows_per_shard": args.windows, "reads": args.reads,
                    "module": args.module or "torchtitan", "by_shard_count": {}}
    for count in args.counts:
        folder = Path(args.folder) / f"{shards.FORMAT}_{count}_shards_{args.windows}x{args.seq_len + 1}"
        write_shards(shards, folder, tokenizer, count, args.windows * (args.seq_len + 1))
        child = CHILD.format(repo=str(REPO), module=args.module, folder=str(folder), seq_len=args.seq_len,
                             reads=args.reads)
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
        result["by_shard_count"][str(count)] = json.loads(done.stdout.strip().splitlines()[-1])
        logger.info(f"{count} shards: {result['by_shard_count'][str(count)]}")
    return result


def main(argv: list[str] | None = None) -> int:
    return json_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
