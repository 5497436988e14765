"""Packed next-token-prediction samples from a text dataset, sharded over data-parallel ranks.

Every document is tokenized as `BOS text EOS` and the documents are concatenated, in dataset order,
into one token stream. The stream is cut into consecutive, non-overlapping windows of `seq_len + 1`
tokens; window `w` gives the sample `input = w[:-1]`, `label = w[1:]`. A partial window at the end
of the data is dropped (or, when looping, continued by the next epoch's first documents).

Windows are numbered 0, 1, 2, ... in the same way on every rank, and rank `r` of `D` data-parallel
ranks takes windows `r, r + D, r + 2D, ...`. The global batch of every step is therefore the same
whatever `D` is, which makes losses comparable across data-parallel degrees, and the data-parallel
layout can change when a run resumes from a checkpoint.

Trade-off: every rank reads and tokenizes the whole stream and throws away the windows of the other
ranks, so tokenization costs `D` times the CPU work of a split-by-document scheme (and a streaming
dataset is downloaded by every rank). In exchange there is no per-rank shard assignment to keep
consistent, and the sample order does not depend on the layout. `num_workers` processes tokenize
documents ahead of the packer, in order, so the stream (and every state) is the same with any number
of them. At scale, pre-tokenize into token shards instead (`shards.py`): there each rank reads only
its own windows.

Checkpoint state (`TextDataset.state_dict()`, found under `dataset_state` in the data loader's
state) holds `next_window`, the first window no rank of the group has consumed, which is the same on
every rank after every batch, and an anchor: the stream position of the start of a window at or
before it (it may differ between ranks, and any such anchor is valid). So one rank's state resumes
every rank of a run, also one with another data-parallel degree or rank. Resuming seeks straight to
the anchor instead of re-tokenizing everything before it: map-style datasets index the document
directly, streaming datasets restart from their own position before it (`anchor_stream`, carried with
each document through the tokenizer processes, so known however far they read ahead; a checkpoint
without one skips the documents before it without tokenizing them).

Empty documents (and null values) contribute nothing to the stream: a `BOS EOS` pair carries no
text to learn from. Where the documents come from, and what is wrong with a source that cannot be read, is
documents.py's.
"""

import itertools
import multiprocessing
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.datasets.documents import Source, StreamRetry, document_text, load_documents
from torchtitan.components.datasets.mixture import MixtureDataset, parse_sources
from torchtitan.components.datasets.shards import ShardAccess, ShardDataset, ShardMaps, is_shard_folder
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger

__all__ = ["TextDataset", "build_dataloader"]

# Documents per task of a tokenizer worker: enough that passing them between processes costs little beside encoding.
_WORKER_CHUNK = 64
# Tasks queued per worker: the workers tokenize this far ahead of the packer (prefetching) without reading the whole
# source into memory.
_TASKS_PER_WORKER = 4
# Steps' worth of token-shard windows that the reader threads keep ready: the next step's batches, and the step's after
# them, which they read while the next step trains.
_READ_AHEAD_STEPS = 2

_STATE_KEYS = (
    "next_window",
    "anchor_window",
    "anchor_epoch",
    "anchor_document",
    "anchor_token",
    "seq_len",
)


# A place in the token stream: (epoch, document index, token index inside that document's tokens).
_Position = tuple[int, int, int]
# A stream's own positions before and after a document (None: a dataset that indexes documents directly).
_Stream = tuple[dict | None, dict | None]
# A document as it passes the tokenizer processes: its index and stream positions.
_Key = tuple[int, _Stream]


class _Tokenizer(Protocol):
    def encode(self, text: str, *, add_bos: bool, add_eos: bool) -> list[int]: ...


_worker_tokenizer: _Tokenizer | None = None


def _init_worker(tokenizer: _Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    return [_worker_tokenizer.encode(text, add_bos=True, add_eos=True) for text in texts]


def worker_pool(num_workers: int, initializer: Callable, initargs: tuple) -> Any:
    """A process pool from a fork server: forking the training process itself (threads of the process group, of
    OpenMP, of logging) can leave a child blocked on a lock that another thread held at the fork. The server forks
    clean children in milliseconds after importing this module once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context.Pool(num_workers, initializer=initializer, initargs=initargs)


def _encode_in_workers(
    texts: Iterator[tuple[_Key, str]], pool: Any, num_workers: int
) -> Iterator[tuple[_Key, list[int]]]:
    """(key, tokens) of the (key, text) pairs of `texts`, in order, tokenized by the pool's processes, which run
    ahead. The key (the document's index and stream position) stays here.

    The documents are read here and sent in chunks; results come back in submission order, so the token stream, and
    with it every window and every checkpointed position, is the same as with tokenization in this process.
    """
    chunks = iter(lambda: list(itertools.islice(texts, _WORKER_CHUNK)), [])
    pending: deque = deque()

    def submit(chunk: list[tuple[_Key, str]]) -> None:
        keys = [key for key, _ in chunk]
        pending.append((keys, pool.apply_async(_encode_chunk, ([text for _, text in chunk],))))

    for chunk in itertools.islice(chunks, num_workers * _TASKS_PER_WORKER):
        submit(chunk)
    try:
        while pending:
            keys, result = pending.popleft()
            following = next(chunks, None)
            if following is not None:
                submit(following)
            yield from zip(keys, result.get())
    finally:
        # The pool is terminated after this: a worker still encoding then could send a result larger than a pipe's
        # buffer after the pool stopped reading results, holding the lock that terminating needs (a hang, seen in
        # benchmarks/benchmark_data.py). So the tasks sent are finished first: at most num_workers x 4 chunks. Not in the
        # interpreter's teardown: multiprocessing's exit handler has terminated the pool, its results never come.
        if not sys.is_finalizing():
            for _, result in pending:
                result.wait()


class TextDataset(IterableDataset, Stateful):
    """Yields `(input, label)` LongTensors of length `seq_len` for one data-parallel rank.

    `dataset`, `dataset_path` and `text_field` select the documents as the `training.dataset*`
    options do; `config_section` names the config section ("training" or "validation") in error
    messages. With `infinite`, the data repeats in epochs; without, iteration stops after the last
    full window, and starting a new iteration starts a new pass from the beginning.
    """

    def __init__(
        self,
        *,
        dataset: str,
        dataset_path: str | None,
        text_field: str,
        tokenizer: _Tokenizer,
        seq_len: int,
        dp_rank: int,
        dp_degree: int,
        infinite: bool,
        config_section: str = "training",
        num_workers: int = 0,
        path_option: str | None = None,
        stream_retry: StreamRetry = StreamRetry(),
    ) -> None:
        if seq_len < 1:
            raise UserError(f"{config_section}.seq_len={seq_len} must be at least 1")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
        self._source = Source(
            dataset=dataset, dataset_path=dataset_path, text_field=text_field, section=config_section,
            path_option=path_option, retry=stream_retry,
        )
        self._documents = load_documents(self._source)
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._dp_rank = dp_rank
        self._dp_degree = dp_degree
        self._infinite = infinite
        self._num_workers = num_workers
        self._check_has_text()
        self._rewind()

    def _rewind(self) -> None:
        self._next_window = 0
        self._anchor_window = 0
        self._anchor: _Position = (0, 0, 0)
        # A stream's own position before the anchor's document (a resume then starts there instead of skipping every
        # document before it).
        self._anchor_stream: dict | None = None

    def _check_has_text(self) -> None:
        """Fail at construction, not at the first step, when a dataset of known size has no text."""
        if self._documents.size is None:
            return
        if self._documents.size == 0:
            raise UserError(f"{self._source.option()} has no documents")
        for index, value in enumerate(self._documents.read_from(0)):
            if self._text(value, index):
                return
        raise UserError(f"{self._source.option()} has only empty documents")

    def _text(self, value: Any, index: int) -> str:
        return document_text(self._source, value, index)

    def _texts(self, start: int, position: dict | None = None) -> Iterator[tuple[_Key, str]]:
        """((document index, its stream positions), text) of every non-empty document from `start` (a stream: from
        `position`, the stream's position before `start`) on. An empty document's position after it is the next
        document's before it."""
        before = position
        for index, (value, after) in enumerate(self._documents.read_positioned(start, position), start=start):
            text = self._text(value, index)
            if text:
                yield (index, (before, after)), text
            before = after

    def _encoded(self, start: int, pool: Any, position: dict | None) -> Iterator[tuple[_Key, list[int]]]:
        """((document index, stream positions), tokens) of the documents from `start` on, tokenized here or by the
        worker processes."""
        if pool is None:
            for key, text in self._texts(start, position):
                yield key, self._tokenizer.encode(text, add_bos=True, add_eos=True)
            return
        yield from _encode_in_workers(self._texts(start, position), pool, self._num_workers)

    def _tokenized(self, epoch: int, start: int,
                   position: dict | None = None) -> Iterator[tuple[int, int, list[int], _Stream]]:
        """(epoch, document index, tokens, stream positions) of every non-empty document from the given position on
        (a stream's own `position` before document `start`, when given)."""
        # One pool for the whole iteration (every epoch): it stops when the iteration does. In the interpreter's
        # teardown, multiprocessing's exit handler has stopped it already.
        pool = worker_pool(self._num_workers, _init_worker, (self._tokenizer,)) if self._num_workers else None
        try:
            yield from self._tokenized_with(epoch, start, pool, position)
        finally:
            if pool is not None and not sys.is_finalizing():
                pool.terminate()

    def _tokenized_with(self, epoch: int, start: int, pool: Any,
                        position: dict | None) -> Iterator[tuple[int, int, list[int], _Stream]]:
        while True:
            seen_tokens = False
            for (index, stream), tokens in self._encoded(start, pool, position):
                if tokens:
                    seen_tokens = True
                    yield epoch, index, tokens, stream
            # Only a pass over a whole epoch proves there is no text; it would otherwise loop forever.
            if start == 0 and not seen_tokens:
                raise UserError(f"{self._source.option()} has no documents with text")
            if not self._infinite:
                return
            epoch, start, position = epoch + 1, 0, None
            logger.info(f"dataset {self._source.label}: starting epoch {epoch + 1}")

    def _windows(self, epoch: int, document: int, token: int,
                 position: dict | None) -> Iterator[tuple[list[int], _Position, dict | None]]:
        """Windows of `seq_len + 1` tokens from a stream position, each with the next window's start and the
        stream's own position before that start's document."""
        span = self._seq_len + 1
        # Not yet consumed documents, as [epoch, document index, tokens, first unconsumed token, stream positions].
        pending: deque[list] = deque()
        buffered = 0
        first = True
        for e, d, tokens, stream in self._tokenized(epoch, document, position):
            start = 0
            if first:
                first = False
                if token and ((e, d) != (epoch, document) or token >= len(tokens)):
                    raise UserError(
                        f"the data loader checkpoint resumes at token {token} of document {document}, "
                        f"which {self._source.option()} does not have with this tokenizer; resume with "
                        f"the data and tokenizer of the checkpointed run, or without its data loader state"
                    )
                start = token
            pending.append([e, d, tokens, start, stream])
            buffered += len(tokens) - start
            while buffered >= span:
                window: list[int] = []
                while len(window) < span:
                    segment = pending[0]
                    seg_tokens, seg_start = segment[2], segment[3]
                    take = min(span - len(window), len(seg_tokens) - seg_start)
                    window.extend(seg_tokens[seg_start : seg_start + take])
                    segment[3] += take
                    if segment[3] == len(seg_tokens):
                        pending.popleft()
                buffered -= span
                if pending:
                    following, before = (pending[0][0], pending[0][1], pending[0][3]), pending[0][4][0]
                else:
                    following, before = (e, d + 1, 0), stream[1]
                yield window, following, before

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        degree, rank = self._dp_degree, self._dp_rank
        base = self._next_window
        index = self._anchor_window
        for window, following, following_stream in self._windows(*self._anchor, self._anchor_stream):
            offset = index - base
            if offset >= 0 and offset % degree == rank:
                # Updated before yielding: the loader may save the state right after this sample.
                self._next_window = base + (offset // degree + 1) * degree
                self._anchor_window = index + 1
                self._anchor = following
                self._anchor_stream = following_stream
                sample = torch.tensor(window, dtype=torch.long)
                yield sample[:-1], sample[1:]
            index += 1
        if base == 0 and index < degree:
            num_tokens = sum(len(tokens) for _, _, tokens, _ in self._tokenized(0, 0))
            raise UserError(
                f"{self._source.option()} has {num_tokens} tokens, {index} window(s) of "
                f"{self._source.section}.seq_len + 1 = {self._seq_len + 1} tokens, but each of the "
                f"{degree} data-parallel ranks needs at least one window; use more data or a smaller "
                f"{self._source.section}.seq_len"
            )
        self._rewind()

    def state_dict(self) -> dict[str, int]:
        anchor_epoch, anchor_document, anchor_token = self._anchor
        return {
            "next_window": self._next_window,
            "anchor_window": self._anchor_window,
            "anchor_epoch": anchor_epoch,
            "anchor_document": anchor_document,
            "anchor_token": anchor_token,
            "anchor_stream": self._anchor_stream,
            "seq_len": self._seq_len,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise UserError(
                f"the data loader checkpoint lacks {', '.join(missing)}; it was not written by "
                f"TextDataset, resume without its data loader state"
            )
        if state_dict["seq_len"] != self._seq_len:
            raise UserError(
                f"{self._source.section}.seq_len={self._seq_len}, but the data loader checkpoint was "
                f"saved with seq_len={state_dict['seq_len']}; resume with that seq_len, or without "
                f"the data loader state"
            )
        self._next_window = int(state_dict["next_window"])
        self._anchor_window = int(state_dict["anchor_window"])
        self._anchor = (
            int(state_dict["anchor_epoch"]),
            int(state_dict["anchor_document"]),
            int(state_dict["anchor_token"]),
        )
        # Checkpoints from before stream positions were kept have none: the stream skips to the anchor.
        self._anchor_stream = state_dict.get("anchor_stream")


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    text_field: str,
    tokenizer: _Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    infinite: bool,
    config_section: str = "training",
    num_workers: int = 0,
    seed: int = 0,
    sources: list[str] | None = None,
    stream_retry: StreamRetry = StreamRetry(),
    batches_per_step: int = 1,
    shard_access: ShardAccess = ShardAccess(),
) -> StatefulDataLoader:
    """A loader of `(inputs, labels)` batches of shape `[local_batch_size, seq_len]` for one rank.

    The data is `dataset_path` (token shards when it is a folder with a shard manifest, read by `num_workers` threads
    ahead of the training loop, else documents tokenized here by `num_workers` processes; with 0 both happen in the
    training thread) or `dataset`; or, with `sources` (`path:weight` entries), a weighted mixture of such paths.
    `seed` orders the windows of token shards; `stream_retry` says how streams from the Hugging Face hub survive
    transient faults; `shard_access` how token shards are opened and checked. `batches_per_step` (gradient
    accumulation) sets how far shard reads run ahead: two steps' worth of batches. One rank's `state_dict()` after
    any batch can be loaded into the loaders of every rank, also of a run with another data-parallel degree (see the
    module docstrings); it counts the samples consumed, not those read ahead.
    """
    if local_batch_size < 1:
        raise UserError(f"{config_section}.local_batch_size={local_batch_size} must be at least 1")
    if num_workers < 0:
        raise UserError(f"{config_section}.num_workers={num_workers} must be 0 (tokenize and read in the training "
                        f"process) or more")

    # Windows of token shards are read up to this many samples ahead by the reader threads.
    read_ahead = _READ_AHEAD_STEPS * batches_per_step * local_batch_size
    # One bound on the open shards of this loader, whatever the number of sources.
    maps = ShardMaps(shard_access.max_open_shards)

    def open_path(path: str | None, rank: int, degree: int, path_option: str | None = None,
                  reader_threads: int = num_workers) -> IterableDataset:
        if path is not None and is_shard_folder(path):
            return ShardDataset(path=path, tokenizer=tokenizer, seq_len=seq_len, dp_rank=rank, dp_degree=degree,
                                infinite=infinite, seed=seed, config_section=config_section, path_option=path_option,
                                num_workers=reader_threads, read_ahead=read_ahead, access=shard_access, maps=maps)
        return TextDataset(dataset=dataset, dataset_path=path, text_field=text_field, tokenizer=tokenizer,
                           seq_len=seq_len, dp_rank=rank, dp_degree=degree, infinite=infinite,
                           config_section=config_section, num_workers=num_workers, path_option=path_option,
                           stream_retry=stream_retry)

    if sources:
        if dataset_path is not None:
            raise UserError(f"{config_section}.dataset_path={dataset_path!r} and training.sources are both set; "
                            f"list every source (with its weight) in training.sources, or use dataset_path alone")
        # The mixture reads its shard sources' windows itself, ahead of the training loop.
        data: IterableDataset = MixtureDataset(
            sources=parse_sources(sources),
            open_source=lambda path: open_path(path, 0, 1, "training.sources entry", reader_threads=0),
            seq_len=seq_len, dp_rank=dp_rank, dp_degree=dp_degree, infinite=infinite, num_workers=num_workers,
            read_ahead=read_ahead)
    else:
        data = open_path(dataset_path, dp_rank, dp_degree)
    with warnings.catch_warnings():
        # StatefulDataLoader() calls torch.set_vital, which torch has emptied and deprecated: a warning the user can
        # do nothing about, on every run. Only that warning, only from torchdata's loader, is silenced.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning,
                                module=r"torchdata\.stateful_dataloader")
        # The loader's own worker processes would each read the whole stream to keep the one global window order:
        # the parallel parts run inside the datasets instead (tokenizer processes, shard reader threads).
        return StatefulDataLoader(data, batch_size=local_batch_size, num_workers=0, collate_fn=_collate)
