"""Speed of the data pipeline, printed as one JSON line on stdout (the log goes to stderr).

From the repository root:

    python benchmarks/benchmark_data.py                     # everything below, a few minutes on 2 CPU cores
    python benchmarks/benchmark_data.py --skip_trainer      # the loader alone

What the line reports:
- loader_tokens_per_s: tokens per second one rank's loader delivers, alone in this process (batches of
  --batch x --seq_len, after one warm-up batch), from the embedded corpus tokenized on the fly with 0, 1 and 2
  tokenizer workers (training.num_workers), and from token shards of the same corpus (scripts/tokenize_dataset.py)
  with 0, 1 and 2 reader threads (training.num_workers; the shards are in the page cache) and, for comparison, with
  2 reader processes instead (a pool of processes that read the windows and send them back, in order).
- slow_reads: the shard readers where reads wait. cold_page_cache: on freshly written shards of --cold_gib GiB of
  random token ids whose pages are dropped from the page cache (fsync, then posix_fadvise DONTNEED on those files
  only: nobody else's cache) before each reader starts, so every window comes from the disk. network_latency: the
  embedded corpus's shards with a sleep of --read_latency_ms injected before every window read (here only), as a
  network file system's round trip would add. For each: tokens_per_s of each reader, and a training loop simulated
  by a sleep of --step_s per batch: data_pct, the share of the loop's time spent waiting for batches.
- bytes_read_per_rank: over --epoch_samples global samples split across D = 1, 2, 4 data-parallel ranks, the token
  bytes each rank reads from shards (measured by the reader), against the tokens each rank tokenizes on the fly
  (every rank tokenizes the whole stream; measured by counting).
- trainer: the debug model (train_configs/debug_model.toml, --trainer_steps steps, no validation) with each data
  path: the trainer's own data_pct and tokens/s, averaged over the logged windows after the first step.
- attention: the debug model at seq 2048 (batch 2, embedded corpus) with model.attention_mask causal and
  block_causal (benchmarks/benchmark.py, one thread; runs alternate, --attention_repeats each): tokens/s and CPU time
  per step, and the cost of block_causal from the best CPU times (negative: block_causal is faster).
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

# Running `python benchmarks/benchmark_data.py` puts benchmarks/ first on sys.path, not the checkout that holds
# torchtitan.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts import tokenize_dataset  # noqa: E402
from benchmarks.benchmark import json_main  # noqa: E402
from torchtitan.components.datasets import build_dataloader  # noqa: E402
from torchtitan.components.datasets.corpus import embedded_corpus  # noqa: E402
from torchtitan.components.datasets.shards import (  # noqa: E402
    ShardDataset,
    TokenShards,
    shard_name,
    token_dtype,
    write_manifest,
)
from torchtitan.components.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

CONFIG = str(REPO / "train_configs" / "debug_model.toml")


def loader_speed(tokenizer, path: str | None, workers: int, seq_len: int, batch: int, batches: int) -> float:
    loader = build_dataloader(dataset="embedded", dataset_path=path, text_field="text", tokenizer=tokenizer,
                              seq_len=seq_len, local_batch_size=batch, dp_rank=0, dp_degree=1, infinite=True,
                              num_workers=workers)
    iterator = iter(loader)
    next(iterator)  # worker start-up and first documents
    begin = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch * seq_len / (time.perf_counter() - begin)


def shard_batches(tokenizer, shards: str, readers: str, seq_len: int, batch: int) -> Iterator:
    """Batches (or, for reader processes, windows) of one rank from token shards, with `readers` = "N_workers"
    (training.num_workers = N, threads) or "N_processes" (a process pool: the design not taken)."""
    count, kind = readers.split("_")
    if kind == "workers":
        return _loader_batches(tokenizer, shards, int(count), seq_len, batch)
    return _process_windows(tokenizer, shards, int(count), seq_len)


def _loader_batches(tokenizer, shards: str, workers: int, seq_len: int, batch: int) -> Iterator:
    yield from build_dataloader(dataset="x", dataset_path=shards, text_field="text", tokenizer=tokenizer,
                                seq_len=seq_len, local_batch_size=batch, dp_rank=0, dp_degree=1, infinite=True,
                                num_workers=workers)


_process_dataset: ShardDataset | None = None


def _open_in_process(shards: str, tokenizer, seq_len: int) -> None:
    global _process_dataset
    _process_dataset = ShardDataset(path=shards, tokenizer=tokenizer, seq_len=seq_len, dp_rank=0, dp_degree=1,
                                    infinite=True, seed=0)


def _window_in_process(sample: int):
    return _process_dataset.window(sample)


def _process_windows(tokenizer, shards: str, processes: int, seq_len: int) -> Iterator:
    context = multiprocessing.get_context("forkserver")
    with context.Pool(processes, initializer=_open_in_process, initargs=(shards, tokenizer, seq_len)) as pool:
        # imap keeps the windows in order; it reads its input ahead without bound (fine for a benchmark).
        yield from pool.imap(_window_in_process, range(10**9), chunksize=4)


def reader_speed(tokenizer, shards: str, readers: str, seq_len: int, batch: int, batches: int,
                 before: Callable[[], None] = lambda: None) -> float:
    """Tokens/s of one rank's shard readers after their first batch (start-up); `before` runs before they start."""
    before()
    items = shard_batches(tokenizer, shards, readers, seq_len, batch)
    per_batch = batch if readers.endswith("_processes") else 1
    for _ in range(per_batch):
        next(items)
    begin = time.perf_counter()
    for _ in range(batches * per_batch):
        next(items)
    elapsed = time.perf_counter() - begin
    items.close()
    return batches * batch * seq_len / elapsed


def write_random_shards(folder: Path, tokenizer, gib: float) -> list[Path]:
    """Token shards of random ids (1 GiB per shard file at most), written and flushed to the disk."""
    folder.mkdir()
    dtype = token_dtype(tokenizer.vocab_size)
    total = int(gib * 2**30) // dtype.itemsize
    rng = np.random.default_rng(0)
    entries, files = [], []
    for index, start in enumerate(range(0, total, 2**30 // dtype.itemsize)):
        tokens = rng.integers(0, tokenizer.vocab_size, min(2**30 // dtype.itemsize, total - start), dtype=dtype)
        name = shard_name(index)
        files.append(folder / f"{name}.bin")
        with open(files[-1], "wb") as f:
            f.write(tokens.data)
            f.flush()
            os.fsync(f.fileno())
        np.array([0, len(tokens)], dtype=np.int64).tofile(folder / f"{name}.idx")
        entries.append({"name": name, "num_tokens": len(tokens), "num_documents": 1, "sha256": ""})
    write_manifest(folder, tokenizer, entries, source="random ids", text_field="text")
    return files


def drop_from_page_cache(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stalled_loop(tokenizer, shards: str, readers: str, seq_len: int, batch: int, steps: int, step_s: float,
                 before: Callable[[], None] = lambda: None) -> dict:
    """A training loop that takes `step_s` a step, fed by the shard readers: the share of its time spent waiting."""
    before()
    batches = shard_batches(tokenizer, shards, readers, seq_len, batch)
    next(batches)
    waiting = 0.0
    begin = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        next(batches)
        waiting += time.perf_counter() - start
        time.sleep(step_s)
    elapsed = time.perf_counter() - begin
    batches.close()
    return {"data_pct": 100 * waiting / elapsed, "data_ms_per_step": 1000 * waiting / steps}


@contextlib.contextmanager
def read_latency(seconds: float):
    """Every window read waits `seconds` first, as a read from a network file system waits for its round trip (the
    wait releases the GIL, as a blocking read does)."""
    read = TokenShards.read

    def slow_read(self, start, length):
        time.sleep(seconds)
        return read(self, start, length)

    TokenShards.read = slow_read
    try:
        yield
    finally:
        TokenShards.read = read


def slow_reads(tokenizer, shards: str, folder: Path, args) -> dict:
    """The shard readers on the disk (cold page cache) and with a simulated network latency per read."""
    files = write_random_shards(folder, tokenizer, args.cold_gib)
    drop = lambda: drop_from_page_cache(files)  # noqa: E731
    cold: dict = {"gib": args.cold_gib, "tokens_per_s": {}, "loop": {}}
    for readers in ("0_workers", "1_workers", "2_workers", "2_processes"):
        cold["tokens_per_s"][readers] = reader_speed(tokenizer, str(folder), readers, args.seq_len, args.batch,
                                                     args.batches, before=drop)
    for readers in ("0_workers", "2_workers"):
        cold["loop"][readers] = stalled_loop(tokenizer, str(folder), readers, args.seq_len, args.batch,
                                             args.loop_steps, args.step_s, before=drop)
    latency: dict = {"read_latency_ms": args.read_latency_ms, "tokens_per_s": {}, "loop": {}}
    with read_latency(args.read_latency_ms / 1000):
        for readers in ("0_workers", "1_workers", "2_workers"):
            latency["tokens_per_s"][readers] = reader_speed(tokenizer, shards, readers, args.seq_len, args.batch,
                                                            args.batches)
        for readers in ("0_workers", "2_workers"):
            latency["loop"][readers] = stalled_loop(tokenizer, shards, readers, args.seq_len, args.batch,
                                                    args.loop_steps, args.step_s)
    return {"step_s": args.step_s, "cold_page_cache": cold, "network_latency": latency}


def bytes_read(tokenizer, shards: str, seq_len: int, samples: int) -> dict:
    out = {}
    for degree in (1, 2, 4):
        per_rank = []
        for rank in range(degree):
            dataset = ShardDataset(path=shards, tokenizer=tokenizer, seq_len=seq_len, dp_rank=rank, dp_degree=degree,
                                   infinite=True, seed=0)
            iterator = iter(dataset)
            for _ in range(samples // degree):
                next(iterator)
            per_rank.append(dataset.shards.bytes_read)
        # On the fly, each rank packs (so tokenizes) every window of the stream up to its last one.
        out[str(degree)] = {"shard_bytes_per_rank": max(per_rank),
                            "on_the_fly_tokens_tokenized_per_rank": samples * (seq_len + 1)}
    return out


def train(extra: list[str], steps: int, dump: str) -> dict:
    command = [sys.executable, "-m", "torchtitan.train", "--job.config_file", CONFIG, "--training.steps", str(steps),
               "--validation.no_enable", "--metrics.log_freq", "5", "--job.dump_folder", dump, *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "data_pct" in row and row.get("step", 0) > 1]
    return {"data_pct": sum(r["data_pct"] for r in rows) / len(rows), "tps": sum(r["tps"] for r in rows) / len(rows)}


def attention_cost(repeats: int) -> dict:
    """Runs alternate between the two masks; one thread each, so that the CPU time per step (the steadier figure
    on a shared machine) compares like with like."""
    results: dict[str, dict[str, list[float]]] = {mask: {"tokens_per_s": [], "step_cpu_time_s": []}
                                                  for mask in ("causal", "block_causal")}
    for _ in range(repeats):
        for mask, figures in results.items():
            proc = subprocess.run(
                [sys.executable, str(REPO / "benchmarks" / "benchmark.py"), "--job.config_file", CONFIG,
                 "--training.seq_len", "2048", "--training.local_batch_size", "2", "--model.attention_mask", mask,
                 "--warmup", "2", "--steps", "6", "--threads", "1"],
                cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if proc.returncode != 0:
                raise RuntimeError(f"benchmark.py failed:\n{proc.stderr[-3000:]}")
            line = json.loads(proc.stdout.strip().splitlines()[-1])
            figures["tokens_per_s"].append(line["tokens_per_s_per_device"])
            figures["step_cpu_time_s"].append(line["step_cpu_time_s"])
    cpu = {mask: min(figures["step_cpu_time_s"]) for mask, figures in results.items()}
    return {**results, "block_causal_cost_pct": 100 * (cpu["block_causal"] / cpu["causal"] - 1)}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=30, help="timed batches per loader")
    parser.add_argument("--epoch_samples", type=int, default=400, help="global samples for bytes_read_per_rank")
    parser.add_argument("--trainer_steps", type=int, default=21)
    parser.add_argument("--attention_repeats", type=int, default=2)
    parser.add_argument("--cold_gib", type=float, default=1.0, help="size of the shards read from the disk")
    parser.add_argument("--read_latency_ms", type=float, default=1.0, help="simulated latency of a network read")
    parser.add_argument("--step_s", type=float, default=0.05, help="step time of the simulated training loop")
    parser.add_argument("--loop_steps", type=int, default=40, help="steps of the simulated training loop")
    parser.add_argument("--skip_trainer", action="store_true", help="measure the loader alone")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer("")
    with tempfile.TemporaryDirectory() as temp:
        corpus = Path(temp) / "embedded.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in embedded_corpus("train")))
        shards = str(Path(temp) / "shards")
        tokenized = tokenize_dataset.tokenize(str(corpus), shards, workers=2, progress=False)
        logger.info(f"token shards of the embedded corpus: {tokenized}")
        result: dict = {"seq_len": args.seq_len, "batch": args.batch, "cpus": len(os.sched_getaffinity(0)),
                        "corpus_tokens": tokenized["num_tokens"], "loader_tokens_per_s": {}}
        for workers in (0, 1, 2):
            result["loader_tokens_per_s"][f"on_the_fly_{workers}_workers"] = loader_speed(
                tokenizer, None, workers, args.seq_len, args.batch, args.batches)
        for readers in ("0_workers", "1_workers", "2_workers", "2_processes"):
            result["loader_tokens_per_s"][f"shards_{readers}"] = reader_speed(
                tokenizer, shards, readers, args.seq_len, args.batch, args.batches * 20)
        result["slow_reads"] = slow_reads(tokenizer, shards, Path(temp) / "cold_shards", args)
        result["bytes_read_per_rank"] = bytes_read(tokenizer, shards, args.seq_len, args.epoch_samples)
        if not args.skip_trainer:
            trainer = {}
            for name, extra in (("on_the_fly_0_workers", []),
                                ("on_the_fly_1_workers", ["--training.num_workers", "1"]),
                                ("on_the_fly_2_workers", ["--training.num_workers", "2"]),
                                ("shards_0_workers", ["--training.dataset_path", shards]),
                                ("shards_2_workers",
                                 ["--training.dataset_path", shards, "--training.num_workers", "2"])):
                trainer[name] = train(extra, args.trainer_steps, str(Path(temp) / name))
                logger.info(f"trainer {name}: {trainer[name]}")
            result["trainer"] = trainer
            result["attention"] = attention_cost(args.attention_repeats)
    return result


def main(argv: list[str] | None = None) -> int:
    return json_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
