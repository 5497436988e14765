"""Pre-tokenized token shards: written by `scripts/tokenize_dataset.py`, read memory-mapped by the trainer.

A shard folder holds

    manifest.json       format version, the tokenizer (file, sha256, vocabulary size, BOS/EOS ids), the token dtype,
                        and per shard its token and document counts and sha256
    shard-NNNNN.bin     token ids of consecutive documents, each `BOS text EOS` as the on-the-fly path encodes them,
                        as a flat array in the smallest sufficient dtype (uint16 below 65,536 ids, else uint32)
    shard-NNNNN.idx     int64 offsets of each document's first token in the .bin, then the token count

The manifest is written last, so an interrupted tokenization leaves no folder the trainer would read.

Sampling: the shards concatenated in manifest order are the same token stream the on-the-fly path packs, cut into
the same windows of `seq_len + 1` tokens (the tail that fills no window is dropped). Epoch `e` visits the windows in
a permutation seeded by (`seed`, `e`): global sample `g = e * num_windows + i` is window `permute(i)`. The order
depends on nothing but the data, seq_len and seed, so rank `r` of `D` takes samples `r, r + D, r + 2D, ...` as the
on-the-fly path does, the global batch of every step is the same for every data-parallel degree, and one rank's
state (`next_sample`, the first global sample no rank has consumed) resumes every rank of any degree. Unlike the
on-the-fly path, each rank reads only its own windows: bytes read per rank fall as 1/D.

The permutation is a Feistel network over the next power-of-four domain with cycle walking: a bijection of
`[0, num_windows)` computed per index, so no table of billions of window indices is kept in memory.

Reading: the shards are memory-mapped with the advice that they are read at random, and each window's pages are
asked for at once, so a cold read fetches that window, not the file's read-ahead span around it. With
`num_workers`, threads read the windows ahead of the training loop (read_ahead.py); the state still counts only the
samples the loop consumed.
"""

import functools
import hashlib
import itertools
import json
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.datasets.read_ahead import ReadAhead
from torchtitan.errors import UserError
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import logger

MANIFEST = "manifest.json"
FORMAT = "torchtitan-token-shards-v1"

_STATE_KEYS = ("next_sample", "num_windows", "seq_len", "seed")
_MASK64 = (1 << 64) - 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_shard_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_shard(folder: Path, name: str, documents: list[list[int]], dtype: np.dtype) -> dict[str, Any]:
    """Write one shard of tokenized documents (atomically); returns its manifest entry."""
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for d in documents for t in d), dtype=dtype, count=int(offsets[-1]))
    data = tokens.tobytes()
    with atomic_write(folder / f"{name}.bin", "wb") as f:
        f.write(data)
    with atomic_write(folder / f"{name}.idx", "wb") as f:
        f.write(offsets.tobytes())
    return {"name": name, "num_tokens": int(offsets[-1]), "num_documents": len(documents),
            "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(folder: Path, tokenizer: Any, shards: list[dict[str, Any]], source: str, text_field: str) -> None:
    manifest = {
        "format": FORMAT,
        "tokenizer": {"file": Path(tokenizer.file).name, "sha256": tokenizer.checksum,
                      "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "source": source,
        "text_field": text_field,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "shards": shards,
    }
    with atomic_write(folder / MANIFEST) as f:
        json.dump(manifest, f, indent=1)


class TokenShards:
    """The token stream of a shard folder, memory-mapped, checked against the manifest and the tokenizer."""

    def __init__(self, path: str, tokenizer: Any, option: str):
        self.folder = Path(os.path.expanduser(path))
        self.option = option
        manifest = self._read_manifest()
        self._check_tokenizer(manifest["tokenizer"], tokenizer)
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        dtype = np.dtype(manifest["dtype"])
        self._itemsize = dtype.itemsize
        # The non-empty shards' token arrays, and the memory maps they view.
        self._arrays: list[np.ndarray] = []
        self._mappings: list[mmap.mmap] = []
        starts = [0]
        for entry in manifest["shards"]:
            array = self._open_shard(entry, dtype)
            if len(array):
                self._arrays.append(array)
                starts.append(starts[-1] + len(array))
        self._starts = np.array(starts, dtype=np.int64)
        self.num_tokens = int(self._starts[-1])
        self.bytes_read = 0
        # Reader threads (training.num_workers) add to bytes_read concurrently.
        self._count_lock = threading.Lock()
        logger.info(f"token shards {self.folder}: {self.num_tokens:,} tokens, {manifest['num_documents']:,} "
                    f"documents in {len(manifest['shards'])} shard(s), memory-mapped")

    def _read_manifest(self) -> dict:
        file = self.folder / MANIFEST
        try:
            manifest = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{self.option}: cannot read the shard manifest {file}: {e}; re-create the folder with "
                            f"scripts/tokenize_dataset.py") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise UserError(f"{self.option}: {file} has format {found!r}, not {FORMAT!r}; re-create the folder "
                            f"with scripts/tokenize_dataset.py")
        return manifest

    def _check_tokenizer(self, recorded: dict, tokenizer: Any) -> None:
        checksum = getattr(tokenizer, "checksum", "")
        if recorded.get("sha256") != checksum or recorded.get("vocab_size") != tokenizer.vocab_size:
            raise UserError(
                f"{self.option}: the shards were made with tokenizer {recorded.get('file')!r} (sha256 "
                f"{str(recorded.get('sha256'))[:12]}..., vocabulary {recorded.get('vocab_size')}), but the model's "
                f"tokenizer {Path(getattr(tokenizer, 'file', '') or '?').name!r} has sha256 {checksum[:12]}..., "
                f"vocabulary {tokenizer.vocab_size}; set model.hf_assets_path to the shards' tokenizer or re-tokenize "
                f"with scripts/tokenize_dataset.py --hf_assets_path")

    def _open_shard(self, entry: dict, dtype: np.dtype) -> np.ndarray:
        name = entry["name"]
        data, index = self.folder / f"{name}.bin", self.folder / f"{name}.idx"
        num_tokens, num_documents = int(entry["num_tokens"]), int(entry["num_documents"])
        for file, expected in ((data, num_tokens * dtype.itemsize), (index, (num_documents + 1) * 8)):
            if not file.is_file():
                raise UserError(f"{self.option}: shard file {file} is missing; re-create the folder with "
                                f"scripts/tokenize_dataset.py")
            size = file.stat().st_size
            if size != expected:
                raise UserError(f"{self.option}: shard file {file} has {size} bytes, the manifest says {expected} "
                                f"(truncated or corrupt); re-create the folder with scripts/tokenize_dataset.py")
        offsets = np.memmap(index, dtype=np.int64, mode="r")
        if offsets[0] != 0 or offsets[-1] != num_tokens:
            raise UserError(f"{self.option}: shard index {index} does not match its {num_tokens} tokens (corrupt); "
                            f"re-create the folder with scripts/tokenize_dataset.py")
        if num_tokens == 0:
            return np.zeros(0, dtype=dtype)
        with open(data, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # Windows are read in a random order: without this advice every page fault reads the file's whole read-ahead
        # span around it (8 MiB on the machine measured, for a window of a few KiB). read() asks for each window's
        # pages at once instead (MADV_WILLNEED).
        mapping.madvise(mmap.MADV_RANDOM)
        self._mappings.append(mapping)
        return np.frombuffer(mapping, dtype=dtype)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream, as int64."""
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self._starts[shard])
            piece = self._arrays[shard][offset : offset + length - filled]
            first_byte = offset * self._itemsize
            page_start = first_byte - first_byte % mmap.PAGESIZE
            self._mappings[shard].madvise(mmap.MADV_WILLNEED, page_start, first_byte + piece.nbytes - page_start)
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard += 1
        with self._count_lock:
            self.bytes_read += length * self._itemsize
        if out.max() >= self.vocab_size:
            raise UserError(f"{self.option}: tokens {start}..{start + length} hold id {int(out.max())}, beyond the "
                            f"vocabulary of {self.vocab_size} (corrupt shard); re-create the folder with "
                            f"scripts/tokenize_dataset.py")
        return out


def _mix(value: int, key: int) -> int:
    """A 64-bit mixing function (splitmix64's finaliser) of `value` under `key`."""
    z = (value + key * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def permute(index: int, size: int, seed: int, epoch: int) -> int:
    """Position `index` of a seeded pseudo-random permutation of `range(size)` (one per seed and epoch)."""
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix(seed * 1_000_003 + epoch, round_) for round_ in range(4)]
    x = index
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        x = (left << half) | right
        # Cycle walking: the network permutes [0, 4**half); re-applying it until the value falls in range keeps a
        # bijection of [0, size).
        if x < size:
            return x


class ShardDataset(IterableDataset, Stateful):
    """Yields `(input, label)` LongTensors of length `seq_len` for one data-parallel rank, from token shards."""

    def __init__(self, *, path: str, tokenizer: Any, seq_len: int, dp_rank: int, dp_degree: int, infinite: bool,
                 seed: int, config_section: str = "training", path_option: str | None = None, num_workers: int = 0,
                 read_ahead: int = 16) -> None:
        self._option = f"{path_option or config_section + '.dataset_path'}={path!r}"
        self._section = config_section
        self.shards = TokenShards(path, tokenizer, self._option)
        self._seq_len = seq_len
        self._num_windows = self.shards.num_tokens // (seq_len + 1)
        self._dp_rank, self._dp_degree = dp_rank, dp_degree
        self._infinite = infinite
        self._seed = seed
        if self._num_windows < dp_degree:
            raise UserError(
                f"{self._option} has {self.shards.num_tokens} tokens, {self._num_windows} window(s) of "
                f"{config_section}.seq_len + 1 = {seq_len + 1} tokens, but each of the {dp_degree} data-parallel "
                f"ranks needs at least one window; use more data or a smaller {config_section}.seq_len")
        self._next_sample = 0
        self._reader: ReadAhead[torch.Tensor] = ReadAhead(num_workers, read_ahead)

    def window(self, sample: int) -> torch.Tensor:
        """The `seq_len + 1` tokens of global sample `sample` (any epoch)."""
        epoch, index = divmod(sample, self._num_windows)
        window = permute(index, self._num_windows, self._seed, epoch)
        span = self._seq_len + 1
        return torch.from_numpy(self.shards.read(window * span, span))

    def _samples(self) -> Iterator[int]:
        """This rank's global samples from the consumed position on."""
        first, degree = self._next_sample + self._dp_rank, self._dp_degree
        return itertools.count(first, degree) if self._infinite else iter(range(first, self._num_windows, degree))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        degree, rank = self._dp_degree, self._dp_rank
        windows = self._reader.run((functools.partial(self.window, sample), True) for sample in self._samples())
        try:
            for sample, window in zip(self._samples(), windows):
                # Updated before yielding: the loader may save the state right after this sample. Windows read
                # ahead are not counted: a resume reads them again.
                self._next_sample = sample - rank + degree
                yield window[:-1], window[1:]
        finally:
            windows.close()
        self._next_sample = 0

    def state_dict(self) -> dict[str, int]:
        return {"next_sample": self._next_sample, "num_windows": self._num_windows, "seq_len": self._seq_len,
                "seed": self._seed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise UserError(f"the data loader checkpoint lacks {', '.join(missing)}; it was not written from token "
                            f"shards ({self._option}): resume with its data, or without its data loader state")
        for key, current in (("seq_len", self._seq_len), ("seed", self._seed), ("num_windows", self._num_windows)):
            if state_dict[key] != current:
                option = {"seq_len": f"{self._section}.seq_len", "seed": "training.data_seed",
                          "num_windows": self._option}[key]
                raise UserError(f"{option}: the data loader checkpoint was saved with {key} = {state_dict[key]}, "
                                f"now {current}; resume with the checkpointed run's data and options, or without "
                                f"its data loader state")
        # Windows read ahead of the old position are dropped.
        self._reader.stop()
        self._next_sample = int(state_dict["next_sample"])
