"""Pre-tokenized token shards: written by `scripts/tokenize_dataset.py`, read memory-mapped by the trainer.

A shard folder holds

    manifest.json       format version, the tokenizer (file, sha256, vocabulary size, BOS/EOS ids), the token dtype,
                        the source, the totals and the number of shards
    shards.npy          the index of the shards, one column per shard: int64 rows of the token count at its end
                        (cumulative), its document count, and its sha256 (4 rows of 8 bytes; zeros: not recorded)
    shard-NNNNN.bin     token ids of consecutive documents, each `BOS text EOS` as the on-the-fly path encodes them,
                        as a flat array in the smallest sufficient dtype (uint16 below 65,536 ids, else uint32)
    shard-NNNNN.idx     int64 offsets of each document's first token in the .bin, then the token count

Shard `i` is `shard_name(i)`. The manifest is written last, so an interrupted tokenization leaves no folder the
trainer would read.

Sampling: the shards concatenated in manifest order are the same token stream the on-the-fly path packs, cut into
the same windows of `seq_len + 1` tokens (the tail that fills no window is dropped). Epoch `e` visits the windows in
a permutation seeded by (`seed`, `e`): global sample `g = e * num_windows + i` is window `permute(i)`. The order
depends on nothing but the data, seq_len and seed, so rank `r` of `D` takes samples `r, r + D, r + 2D, ...` as the
on-the-fly path does, the global batch of every step is the same for every data-parallel degree, and one rank's
state (`next_sample`, the first global sample no rank has consumed) resumes every rank of any degree. Unlike the
on-the-fly path, each rank reads only its own windows: bytes read per rank fall as 1/D.

The permutation is a Feistel network over the next power-of-four domain with cycle walking: a bijection of
`[0, num_windows)` computed per index, so no table of billions of window indices is kept in memory.

Opening: the manifest and the index are the only files read when the folder is opened, and the index is
memory-mapped: finding a window's shard is a binary search that touches a few of its pages, so start-up costs the
same on each rank however many shards there are. A shard is memory-mapped when a window first needs it, through a
bounded cache of maps (`ShardMaps`, least recently used closed first): at 15T tokens there are hundreds of
thousands of shards, beyond the open-file limit and the kernel's map count if every rank mapped every one. Its size
is checked against the index then, and the sha256 of a sample of the shards (or of all,
`training.verify_all_shards`) as each process first opens it: a mismatch is one error line naming the shard.

Reading: the shards are memory-mapped with the advice that they are read at random, and each window's pages are
asked for at once, so a cold read fetches that window, not the file's read-ahead span around it. With
`num_workers`, threads read the windows ahead of the training loop (read_ahead.py); the state still counts only the
samples the loop consumed.
"""

import errno
import functools
import hashlib
import itertools
import json
import mmap
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
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
INDEX = "shards.npy"
FORMAT = "torchtitan-token-shards-v2"
# Rows of the index: the token count at each shard's end (cumulative, contiguous for the binary search), its
# documents, its sha256.
_END, _DOCUMENTS, _SHA256 = 0, 1, slice(2, 6)

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
    """The index of `shards` (the entries of shards 0, 1, ... in order, as write_shard returns them), then the
    manifest."""
    index = np.zeros((6, len(shards)), dtype="<i8")
    index[_END] = np.cumsum([s["num_tokens"] for s in shards])
    index[_DOCUMENTS] = [s["num_documents"] for s in shards]
    for column, entry in enumerate(shards):
        if entry["sha256"]:
            index[_SHA256, column] = np.frombuffer(bytes.fromhex(entry["sha256"]), dtype="<i8")
    with atomic_write(folder / INDEX, "wb") as f:
        np.save(f, index)
    manifest = {
        "format": FORMAT,
        "tokenizer": {"file": Path(tokenizer.file).name, "sha256": tokenizer.checksum,
                      "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "source": source,
        "text_field": text_field,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_shards": len(shards),
    }
    with atomic_write(folder / MANIFEST) as f:
        json.dump(manifest, f, indent=1)


# What the reader takes from a manifest beside its format: the tokenizer's record, the ids' dtype and the totals.
_MANIFEST_KEYS = ("tokenizer", "dtype", "num_tokens", "num_documents", "num_shards")
_TOKENIZER_KEYS = ("sha256", "vocab_size")
_TOKEN_DTYPES = ("uint16", "uint32")


def _manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest of the current format (a key missing, or a value the reader cannot use), or
    None. A dtype other than the writer's would read the ids as other numbers: wrong tokens (float16), or negative
    ids (int16)."""
    for key in _MANIFEST_KEYS:
        if key not in manifest:
            return f"lacks {key!r}"
    tokenizer = manifest["tokenizer"]
    if not isinstance(tokenizer, dict):
        return f"has tokenizer = {tokenizer!r}, not the tokenizer's record (file, sha256, vocab_size, BOS/EOS ids)"
    for key in _TOKENIZER_KEYS:
        if key not in tokenizer:
            return f"lacks tokenizer.{key}"
    vocab_size = tokenizer["vocab_size"]
    if type(vocab_size) is not int or vocab_size < 1:
        return f"has tokenizer.vocab_size = {vocab_size!r}, not a positive integer"
    for key in ("num_tokens", "num_documents", "num_shards"):
        if type(manifest[key]) is not int or manifest[key] < 0:
            return f"has {key} = {manifest[key]!r}, not a count"
    dtype = manifest["dtype"]
    if dtype not in _TOKEN_DTYPES:
        return (f"has dtype = {dtype!r}; token ids are stored as {' or '.join(_TOKEN_DTYPES)} (the smallest that holds "
                f"the vocabulary)")
    if np.iinfo(dtype).max < vocab_size - 1:
        return f"has dtype = {dtype!r}, which cannot hold the ids of its vocabulary of {vocab_size}"
    return None


@dataclass(frozen=True)
class ShardAccess:
    """How token shards are opened: at most `max_open_shards` memory maps open per loader (each holds a file
    descriptor and a kernel map; the least recently used is closed first), and the sha256 of every shard checked
    when this process first opens it (`verify_all_shards`) or of the first `CHECKSUM_SAMPLE` it opens."""

    max_open_shards: int = 64
    verify_all_shards: bool = False


# Shards whose sha256 each process checks when it first opens them, unless every shard is checked: the first few it
# opens. Windows are read in a random order, so these are a random sample, another on every rank; each costs one
# read of the whole shard.
CHECKSUM_SAMPLE = 4
# The shard files this process has checked, (folder, shard) -> the file's (device, inode, size, mtime): each is
# hashed once per process, however often the cache of maps closes and opens it again.
_CHECKED: dict[tuple[str, int], tuple[int, ...]] = {}
_CHECKED_LOCK = threading.Lock()


class ShardMaps:
    """A bounded cache of open shard memory maps, least recently used closed first, shared by the token shards one
    loader reads (a mixture's sources too): however many shards there are, a process holds at most `capacity` maps
    for them, plus, per reader thread, the one it copies out of (just evicted) or opens (while opening, its file's
    descriptor and its map's: two). A shard that several threads need at once is opened once: the others wait
    for it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.opened = 0
        self._maps: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()
        # Shards being opened, by the thread that opens them: a thread that needs one of them waits for its result.
        self._opening: dict[tuple[str, int], Future] = {}
        # Reader threads (training.num_workers) read concurrently.
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int], open_map: Callable[[], mmap.mmap]) -> mmap.mmap:
        with self._lock:
            mapping = self._maps.get(key)
            if mapping is not None:
                self._maps.move_to_end(key)
                return mapping
            opening = self._opening.get(key)
            if opening is None:
                opening = self._opening[key] = Future()
                opener = True
            else:
                opener = False
        if not opener:
            return opening.result()
        # Opened outside the lock: other threads keep reading their cached shards meanwhile (a checksum takes long).
        try:
            mapping = open_map()
        except BaseException as error:
            with self._lock:
                del self._opening[key]
            opening.set_exception(error)
            raise
        with self._lock:
            del self._opening[key]
            self.opened += 1
            self._maps[key] = mapping
            while len(self._maps) > self.capacity:
                # Not closed explicitly: a thread may still be copying out of it. The last reference dropped unmaps
                # it and closes its file descriptor.
                self._maps.popitem(last=False)
        opening.set_result(mapping)
        return mapping

    def __len__(self) -> int:
        return len(self._maps)


class TokenShards:
    """The token stream of a shard folder, checked against the manifest and the tokenizer.

    Opening reads the manifest and maps the index (their cost does not grow with the number of shards); each shard
    is memory-mapped when a window first needs it, through `maps`, and checked then: its size against the index,
    and for a sample of the shards (or all, with `access.verify_all_shards`) its sha256 and document index."""

    def __init__(self, path: str, tokenizer: Any, option: str, access: ShardAccess = ShardAccess(),
                 maps: ShardMaps | None = None):
        self.folder = Path(os.path.expanduser(path))
        self.option = option
        self._access = access
        self._maps = maps if maps is not None else ShardMaps(access.max_open_shards)
        manifest = self._read_manifest()
        self._check_tokenizer(manifest["tokenizer"], tokenizer)
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self._dtype = np.dtype(manifest["dtype"])
        self._itemsize = self._dtype.itemsize
        self._index = self._read_index(manifest)
        self.num_tokens = int(manifest["num_tokens"])
        self.bytes_read = 0
        # The shards whose checksum this reader checked (the sample, when not every shard is checked).
        self._sampled: set[int] = set()
        # Reader threads (training.num_workers) add to bytes_read concurrently.
        self._count_lock = threading.Lock()
        logger.info(f"token shards {self.folder}: {self.num_tokens:,} tokens, {manifest['num_documents']:,} "
                    f"documents in {manifest['num_shards']:,} shard(s), memory-mapped on demand (at most "
                    f"{self._maps.capacity} open)")

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
        problem = _manifest_problem(manifest)
        if problem:
            raise UserError(f"{self.option}: the shard manifest {file} {problem}; re-create the folder with "
                            f"scripts/tokenize_dataset.py")
        return manifest

    def _read_index(self, manifest: dict) -> np.ndarray:
        file = self.folder / INDEX
        try:
            index = np.load(file, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise UserError(f"{self.option}: cannot read the shard index {file}: {e}; re-create the folder with "
                            f"scripts/tokenize_dataset.py") from None
        shards, tokens = manifest["num_shards"], manifest["num_tokens"]
        if index.shape != (6, shards) or index.dtype != np.dtype("<i8") or (shards and index[_END, -1] != tokens):
            raise UserError(f"{self.option}: the shard index {file} does not match the manifest's {shards} shard(s) "
                            f"of {tokens} tokens (corrupt or from another tokenization); re-create the folder with "
                            f"scripts/tokenize_dataset.py")
        return index

    def _shard_range(self, shard: int) -> tuple[int, int]:
        """The first token of `shard` in the stream, and its token count."""
        start = int(self._index[_END, shard - 1]) if shard else 0
        return start, int(self._index[_END, shard]) - start

    def _check_tokenizer(self, recorded: dict, tokenizer: Any) -> None:
        checksum = getattr(tokenizer, "checksum", "")
        if recorded.get("sha256") != checksum or recorded.get("vocab_size") != tokenizer.vocab_size:
            raise UserError(
                f"{self.option}: the shards were made with tokenizer {recorded.get('file')!r} (sha256 "
                f"{str(recorded.get('sha256'))[:12]}..., vocabulary {recorded.get('vocab_size')}), but the model's "
                f"tokenizer {Path(getattr(tokenizer, 'file', '') or '?').name!r} has sha256 {checksum[:12]}..., "
                f"vocabulary {tokenizer.vocab_size}; set model.hf_assets_path to the shards' tokenizer or re-tokenize "
                f"with scripts/tokenize_dataset.py --hf_assets_path")

    def _corrupt(self, file: Path, problem: str) -> UserError:
        return UserError(f"{self.option}: shard file {file} {problem}; re-create the folder with "
                         f"scripts/tokenize_dataset.py")

    def _open_shard(self, shard: int) -> mmap.mmap:
        data = self.folder / f"{shard_name(shard)}.bin"
        num_tokens = self._shard_range(shard)[1]
        try:
            with open(data, "rb") as f:
                stat = os.fstat(f.fileno())
                size = stat.st_size
                identity = (stat.st_dev, stat.st_ino, size, stat.st_mtime_ns)
                if size != num_tokens * self._itemsize:
                    raise self._corrupt(data, f"has {size} bytes, the manifest says {num_tokens * self._itemsize} "
                                              f"(truncated or corrupt)")
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise self._corrupt(data, "is missing") from None
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise
            raise UserError(f"{self.option}: opening shard file {data} failed ({e.strerror}) with "
                            f"{len(self._maps)} shard(s) open; lower training.max_open_shards "
                            f"(now {self._maps.capacity}) or raise the limit on open files (ulimit -n "
                            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}) or maps (vm.max_map_count)") from None
        # Windows are read in a random order: without this advice every page fault reads the file's whole read-ahead
        # span around it (8 MiB on the machine measured, for a window of a few KiB). read() asks for each window's
        # pages at once instead (MADV_WILLNEED).
        mapping.madvise(mmap.MADV_RANDOM)
        if self._to_check(shard, identity):
            self._verify(shard, data, mapping)
            with _CHECKED_LOCK:
                _CHECKED[(str(self.folder), shard)] = identity
        return mapping

    def _to_check(self, shard: int, identity: tuple[int, ...]) -> bool:
        """Whether this opening of `shard` (its file's `identity`) is checked: not if this process checked the same
        file before (the cache of maps closed it and it is opened again, here or by another loader of the process:
        a mixture's, the next validation's; a file replaced since has another identity), else for every shard with
        `verify_all_shards`, or for the first CHECKSUM_SAMPLE shards this reader opens."""
        with _CHECKED_LOCK:
            if _CHECKED.get((str(self.folder), shard)) == identity:
                return False
            if self._access.verify_all_shards:
                return True
            if len(self._sampled) < CHECKSUM_SAMPLE:
                self._sampled.add(shard)
            return shard in self._sampled

    def _verify(self, shard: int, data: Path, mapping: mmap.mmap) -> None:
        """The shard's sha256 and its index's ends against the manifest."""
        expected = self._index[_SHA256, shard].astype("<i8").tobytes()
        if any(expected) and hashlib.sha256(mapping).digest() != expected:
            raise self._corrupt(data, f"does not match its sha256 in the manifest ({expected.hex()[:12]}...): "
                                      f"corrupt or replaced")
        index = data.with_suffix(".idx")
        documents = int(self._index[_DOCUMENTS, shard])
        try:
            with open(index, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                ends = np.frombuffer(os.pread(f.fileno(), 8, 0) + os.pread(f.fileno(), 8, size - 8), dtype=np.int64) \
                    if size == (documents + 1) * 8 else None
        except FileNotFoundError:
            raise self._corrupt(index, "is missing") from None
        if ends is None:
            raise self._corrupt(index, f"has {size} bytes, the manifest says {(documents + 1) * 8} (truncated or "
                                       f"corrupt)")
        if ends[0] != 0 or ends[1] != self._shard_range(shard)[1]:
            raise self._corrupt(index, "does not match its shard's token count (corrupt)")

    def _mapping(self, shard: int) -> mmap.mmap:
        return self._maps.get((str(self.folder), shard), functools.partial(self._open_shard, shard))

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream, as int64."""
        out = np.empty(length, dtype=np.int64)
        # The first shard whose end is beyond `start` (so not an empty one).
        shard = int(np.searchsorted(self._index[_END], start, side="right"))
        filled = 0
        while filled < length:
            shard_start, shard_tokens = self._shard_range(shard)
            offset = start + filled - shard_start
            count = min(length - filled, shard_tokens - offset)
            if count == 0:  # an empty shard: nothing to map
                shard += 1
                continue
            mapping = self._mapping(shard)
            first_byte = offset * self._itemsize
            page_start = first_byte - first_byte % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_WILLNEED, page_start, first_byte + count * self._itemsize - page_start)
            out[filled : filled + count] = np.frombuffer(mapping, dtype=self._dtype, count=count, offset=first_byte)
            # Let go of it before the window's next shard is mapped: a thread holds at most one map beside the cache.
            del mapping
            filled += count
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
                 read_ahead: int = 16, access: ShardAccess = ShardAccess(), maps: ShardMaps | None = None) -> None:
        self._option = f"{path_option or config_section + '.dataset_path'}={path!r}"
        self._section = config_section
        self.shards = TokenShards(path, tokenizer, self._option, access, maps)
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
