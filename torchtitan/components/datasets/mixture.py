"""Weighted mixtures of several sources (`[[training.sources]]` with `path` and `weight`).

Each source is a stream of windows of `seq_len + 1` tokens, as it would be alone with one data-parallel rank: the
on-the-fly packing of its documents, or its token shards in their seeded order. The mixture interleaves them in a
fixed, smooth order: every period of `PERIOD` global samples gives each source a quota proportional to its weight
(largest remainders, at least one for a positive weight), spread by smooth weighted round robin, so the proportions
hold within a sample or two over any span of samples. Global sample `g` comes from source `schedule[g % PERIOD]`
and is that source's window number `count(source, g)`, both computed in O(1) from `g`.

Rank `r` of `D` takes global samples `r, r + D, ...` as with one source, so the global batch of a step is the same
for every data-parallel degree. The state (`next_sample`, the first global sample no rank has consumed, and each
source's position at it) is the same on every rank, and resumes any degree: every sample of every source exactly
once. A source that runs out starts a new epoch of its own with `training.dataset_loop`, and ends the mixture
without it.
"""

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.datasets.read_ahead import Read, ReadAhead
from torchtitan.components.datasets.shards import ShardDataset
from torchtitan.errors import UserError

PERIOD = 10_000
OPTION = "training.sources"


def parse_sources(entries: list[str]) -> list[tuple[str, float]]:
    """`path:weight` entries (the TOML tables are written that way too) -> (path, weight), checked."""
    sources = []
    for entry in entries:
        path, _, weight_text = entry.rpartition(":")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = None
        if not path or weight is None or not np.isfinite(weight):
            raise UserError(f"option {OPTION}: {entry!r} is not PATH:WEIGHT (e.g. a.jsonl:0.7,shards/:0.3)")
        if weight < 0:
            raise UserError(f"option {OPTION}: {path!r} has weight {weight}; weights must not be negative")
        sources.append((path, weight))
    if sum(weight for _, weight in sources) <= 0:
        raise UserError(f"option {OPTION}: the weights {', '.join(entries)} must sum to a positive number")
    return sources


def quotas(weights: list[float]) -> list[int]:
    """Samples of each source per `PERIOD`: proportional to the weights, at least one for a positive weight, summing
    to PERIOD. Sources whose proportional share is below one get exactly one, and the others share what is left in
    proportion (repeated until no share falls below one), by largest remainders with ties to the earlier source: so
    equal weights get quotas that differ by at most the one sample of rounding, and a larger weight never gets less."""
    positive = [i for i, w in enumerate(weights) if w > 0]
    if len(positive) > PERIOD:
        raise UserError(f"option {OPTION}: {len(positive)} sources have a positive weight; at most {PERIOD} can "
                        f"each get a sample in every period of {PERIOD}")
    floored: set[int] = set()
    while True:
        rest = [i for i in positive if i not in floored]
        budget = PERIOD - len(floored)
        total = sum(weights[i] for i in rest)
        exact = {i: budget * weights[i] / total for i in rest}
        below_one = {i for i in rest if exact[i] < 1}
        if not below_one:
            break
        floored |= below_one
    counts = [0] * len(weights)
    for i in floored:
        counts[i] = 1
    for i in rest:
        counts[i] = int(exact[i])
    # Fewer than len(rest) samples are left over by the rounding down: one each to the largest remainders.
    leftover = budget - sum(counts[i] for i in rest)
    for i in sorted(rest, key=lambda i: (counts[i] - exact[i], i))[:leftover]:
        counts[i] += 1
    return counts


def schedule(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each position of a period, samples of each source before each position) by smooth weighted round
    robin: each step every source gains its quota, the one furthest ahead is drawn and pays the period back."""
    order = np.empty(PERIOD, dtype=np.int64)
    before = np.zeros((len(counts), PERIOD + 1), dtype=np.int64)
    credit = [0] * len(counts)
    for position in range(PERIOD):
        credit = [c + q for c, q in zip(credit, counts)]
        pick = max(range(len(counts)), key=credit.__getitem__)
        credit[pick] -= PERIOD
        order[position] = pick
        before[:, position + 1] = before[:, position]
        before[pick, position + 1] += 1
    return order, before


class _Sequential:
    """A source read in order (on-the-fly tokenization): windows are taken by increasing index, others skipped."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self._iterator: Iterator | None = None
        self._next = 0

    def window(self, index: int) -> torch.Tensor | None:
        if self._iterator is None:
            self._next = self.dataset.state_dict()["next_window"]
            self._iterator = iter(self.dataset)
        while True:
            sample = next(self._iterator, None)
            if sample is None:
                return None
            self._next += 1
            if self._next > index:
                inputs, labels = sample
                return torch.cat([inputs, labels[-1:]])

    def state_at(self, next_index: int) -> dict:
        # The dataset's anchor is at or before `next_index` (windows beyond it went to other ranks): valid.
        return {**self.dataset.state_dict(), "next_window": next_index}

    def load(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
        self._iterator = None


class _RandomAccess:
    """Token shards: any window is read directly."""

    def __init__(self, dataset: ShardDataset, infinite: bool):
        self.dataset = dataset
        self._infinite = infinite

    def window(self, index: int) -> torch.Tensor | None:
        if not self._infinite and index >= self.dataset.state_dict()["num_windows"]:
            return None
        return self.dataset.window(index)

    def state_at(self, next_index: int) -> dict:
        return {**self.dataset.state_dict(), "next_sample": next_index}

    def load(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


class MixtureDataset(IterableDataset, Stateful):
    """Yields `(input, label)` LongTensors for one data-parallel rank from weighted sources.

    `open_source(path)` returns the source's window stream for one rank of one (a ShardDataset or a TextDataset).
    With `num_workers`, that many threads read the windows of token shards up to `read_ahead` samples ahead.
    """

    def __init__(self, *, sources: list[tuple[str, float]], open_source: Callable[[str], Any], seq_len: int,
                 dp_rank: int, dp_degree: int, infinite: bool, num_workers: int = 0, read_ahead: int = 16) -> None:
        self._sources = sources
        self._streams = [_RandomAccess(d, infinite) if isinstance(d, ShardDataset) else _Sequential(d)
                         for d in (open_source(path) for path, _ in sources)]
        self._order, self._before = schedule(quotas([weight for _, weight in sources]))
        self._seq_len = seq_len
        self._dp_rank, self._dp_degree = dp_rank, dp_degree
        self._next_sample = 0
        self._reader: ReadAhead[torch.Tensor | None] = ReadAhead(num_workers, read_ahead)

    def count(self, source: int, sample: int) -> int:
        """Samples drawn from `source` before global sample `sample`."""
        periods, position = divmod(sample, PERIOD)
        return periods * int(self._before[source, PERIOD]) + int(self._before[source, position])

    def source_of(self, sample: int) -> int:
        return int(self._order[sample % PERIOD])

    def _read(self, sample: int) -> Read:
        """The read of global sample `sample`: token shards in the background, on-the-fly sources in order."""
        source = self.source_of(sample)
        stream = self._streams[source]
        return functools.partial(stream.window, self.count(source, sample)), isinstance(stream, _RandomAccess)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        degree, rank = self._dp_degree, self._dp_rank
        first = self._next_sample + rank
        windows = self._reader.run(map(self._read, itertools.count(first, degree)))
        try:
            for sample, window in zip(itertools.count(first, degree), windows):
                if window is None:
                    break
                # Windows read ahead are not counted: a resume reads them again.
                self._next_sample = sample - rank + degree
                yield window[:-1], window[1:]
        finally:
            windows.close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_sample": self._next_sample,
            "seq_len": self._seq_len,
            "sources": [{"path": path, "weight": weight, "state": stream.state_at(self.count(i, self._next_sample))}
                        for i, ((path, weight), stream) in enumerate(zip(self._sources, self._streams))],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = [(s.get("path"), s.get("weight")) for s in state_dict.get("sources", [])]
        if saved != [(path, weight) for path, weight in self._sources]:
            listed = ", ".join(f"{path}:{weight}" for path, weight in saved) or "a single source"
            raise UserError(f"option {OPTION}: the data loader checkpoint was saved with {listed}; resume with the "
                            f"same sources and weights, or without the data loader state")
        # Windows read ahead of the old position are dropped.
        self._reader.stop()
        self._next_sample = int(state_dict["next_sample"])
        for stream, source_state in zip(self._streams, state_dict["sources"]):
            stream.load(source_state["state"])
