"""Weighted mixtures of sources (training.sources): proportions, exactly-once resume under another data-parallel
degree, the end of a source, and the errors of bad weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import tokenize_dataset
from torchtitan.components.datasets import build_dataloader
from torchtitan.components.datasets.mixture import PERIOD, parse_sources, quotas, schedule
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.config import parse_args
from torchtitan.errors import UserError
from tests.unit.reader_threads import live_reader_threads, read_where_expected, record_reading_threads

SEQ_LEN = 16


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A jsonl file (tokenized on the fly) and token shards of another file; every window is distinct."""
    folder = tmp_path_factory.mktemp("sources")
    for name, count in (("a", 80), ("b", 120)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for i in range(count):
                words = " ".join(f"w{i}x{j}" for j in range(i % 7 + 3))
                f.write(json.dumps({"text": f"source {name} document {i}: {words}"}) + "\n")
    tokenize_dataset.tokenize(str(folder / "b.jsonl"), str(folder / "b_shards"), workers=1, documents_per_shard=50,
                              progress=False)
    return str(folder / "a.jsonl"), str(folder / "b_shards")


def mixture(sources, tokenizer, weights=(0.7, 0.3), rank=0, degree=1, infinite=True, batch=2, num_workers=0):
    entries = [f"{path}:{weight}" for path, weight in zip(sources, weights)]
    return build_dataloader(dataset="x", dataset_path=None, text_field="text", tokenizer=tokenizer, seq_len=SEQ_LEN,
                            local_batch_size=batch, dp_rank=rank, dp_degree=degree, infinite=infinite,
                            sources=entries, num_workers=num_workers)


def rows(batches):
    return [tuple(i) + (l[-1],) for inputs, labels in batches for i, l in zip(inputs.tolist(), labels.tolist())]


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [5, 3, 2], [0.97, 0.02, 0.01], [1, 1, 1]])
def test_proportions_hold_over_every_thousand_samples(weights):
    order, before = schedule(quotas(weights))
    stream = list(order) * 2
    total = sum(weights)
    for start in range(0, PERIOD, 37):
        window = stream[start : start + 1000]
        for source, weight in enumerate(weights):
            assert abs(window.count(source) / 1000 - weight / total) <= 0.02
    assert (before[:, -1] == quotas(weights)).all()


@pytest.mark.parametrize("weights", [[1e6, 1, 1, 1], [1e9, 3, 3, 1, 1], [5000, 1, 1, 2, 2, 1e-3], [1, 1, 1],
                                     [0.5, 0.25, 0.25, 0, 1e-12]])
def test_quotas_of_tiny_weights(weights):
    # Minimum quotas of tiny weights once pushed the sum past the period: [1e6, 1, 1, 1] got [9996, 2, 1, 1].
    counts = quotas(weights)
    assert sum(counts) == PERIOD
    total = sum(weights)
    for i, w in enumerate(weights):
        assert (counts[i] >= 1) if w > 0 else (counts[i] == 0)
        # A share above one sample loses at most the floors of the tiny ones, plus one of rounding.
        floors = sum(1 for v in weights if 0 < PERIOD * v / total < 1)
        assert abs(counts[i] - PERIOD * w / total) < floors + 1 or PERIOD * w / total < 1
        for j, v in enumerate(weights):
            if w == v:
                assert abs(counts[i] - counts[j]) <= 1, "equal weights, equal shares (up to one of rounding)"
            elif w > v:
                assert counts[i] >= counts[j], "a larger weight never gets less"
    assert quotas([1e6, 1, 1, 1]) == [PERIOD - 3, 1, 1, 1]
    assert quotas([1e9, 3, 3, 1, 1]) == [PERIOD - 4, 1, 1, 1, 1]


def test_more_sources_than_a_period_is_an_error():
    with pytest.raises(UserError, match=f"option training.sources: {PERIOD + 1} sources have a positive weight"):
        quotas([1.0] * (PERIOD + 1))


def test_sample_g_is_window_count_of_its_source(sources, tokenizer):
    mixed = rows(take(iter(mixture(sources, tokenizer, batch=1)), 60))
    alone = [rows(build_dataloader(dataset="x", dataset_path=path, text_field="text", tokenizer=tokenizer,
                                   seq_len=SEQ_LEN, local_batch_size=1, dp_rank=0, dp_degree=1, infinite=False))
             for path in sources]
    dataset = mixture(sources, tokenizer).dataset
    for g, window in enumerate(mixed):
        source = dataset.source_of(g)
        assert window == alone[source][dataset.count(source, g)]
    assert {dataset.source_of(g) for g in range(60)} == {0, 1}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("new_degree", [1, 3])
def test_resume_under_another_degree_sees_every_sample_once(sources, tokenizer, new_degree, num_workers,
                                                            monkeypatch):
    reference = rows(take(iter(mixture(sources, tokenizer, batch=1)), 2 * 3 * 2 + new_degree * 4 * 2))
    threads = record_reading_threads(monkeypatch)
    consumed = []
    states = []
    for rank in range(2):
        loader = mixture(sources, tokenizer, rank=rank, degree=2, num_workers=num_workers)
        consumed += rows(take(iter(loader), 3))
        states.append(loader.state_dict())
    # Every rank's state holds the same positions (the on-the-fly source's anchor may differ: any valid one works).
    for state in states:
        positions = [s["state"] for s in state["dataset_state"]["sources"]]
        assert state["dataset_state"]["next_sample"] == 12
        assert (positions[0]["next_window"], positions[1]["next_sample"]) == (8, 4)
    for rank in range(new_degree):
        loader = mixture(sources, tokenizer, rank=rank, degree=new_degree, num_workers=num_workers)
        loader.load_state_dict(json.loads(json.dumps(states[1])))
        consumed += rows(take(iter(loader), 4))
    assert sorted(consumed) == sorted(reference)
    assert len(set(reference)) == len(reference)
    assert read_where_expected(threads, num_workers)


def test_workers_give_the_same_mixture_to_its_end(sources, tokenizer, monkeypatch):
    finite = rows(mixture(sources, tokenizer, weights=(0.5, 0.5), infinite=False, batch=1))
    others = set(live_reader_threads())
    threads = record_reading_threads(monkeypatch)
    assert rows(mixture(sources, tokenizer, weights=(0.5, 0.5), infinite=False, batch=1, num_workers=2)) == finite
    assert read_where_expected(threads, 2)
    assert set(live_reader_threads()) <= others, "the finished iteration's reader threads are gone"


def test_a_source_that_runs_out_ends_the_mixture_without_looping(sources, tokenizer):
    finite = rows(mixture(sources, tokenizer, weights=(0.5, 0.5), infinite=False, batch=1))
    a_windows = len(rows(build_dataloader(dataset="x", dataset_path=sources[0], text_field="text",
                                          tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=1, dp_rank=0,
                                          dp_degree=1, infinite=False)))
    dataset = mixture(sources, tokenizer, weights=(0.5, 0.5)).dataset
    # It stops at the first sample of an exhausted source.
    stop = next(g for g in range(10 * PERIOD) if dataset.count(dataset.source_of(g), g) >= (
        a_windows if dataset.source_of(g) == 0 else dataset._streams[1].dataset.state_dict()["num_windows"]))
    assert len(finite) == stop
    # Looping, the same source's windows come round again.
    looped = rows(take(iter(mixture(sources, tokenizer, weights=(0.5, 0.5), batch=1)), stop + 10))
    assert looped[:stop] == finite


@pytest.mark.parametrize(
    "entries, message",
    [
        (["a.jsonl:0", "b.jsonl:0"], "must sum to a positive number"),
        (["a.jsonl:-1", "b.jsonl:2"], "has weight -1.0; weights must not be negative"),
        (["a.jsonl"], "'a.jsonl' is not PATH:WEIGHT"),
        (["a.jsonl:x"], "'a.jsonl:x' is not PATH:WEIGHT"),
    ],
)
def test_bad_weights_are_one_line_errors(entries, message):
    with pytest.raises(UserError, match=message):
        parse_sources(entries)


def test_unreachable_source_and_changed_weights(sources, tokenizer, tmp_path):
    with pytest.raises(UserError, match="training.sources entry='.*missing.jsonl' does not exist"):
        mixture([sources[0], str(tmp_path / "missing.jsonl")], tokenizer)
    loader = mixture(sources, tokenizer)
    next(iter(loader))
    other = mixture(sources, tokenizer, weights=(0.5, 0.5))
    other.load_state_dict(loader.state_dict())
    with pytest.raises(UserError, match="saved with .*a.jsonl:0.7, .*b_shards:0.3; resume with the same"):
        next(iter(other))


def test_toml_tables_and_command_line(tmp_path):
    config = tmp_path / "mix.toml"
    config.write_text('[[training.sources]]\npath = "a.jsonl"\nweight = 0.7\n\n'
                      '[[training.sources]]\npath = "shards/"\nweight = 0.3\n')
    assert parse_args(["--job.config_file", str(config)]).training.sources == ["a.jsonl:0.7", "shards/:0.3"]
    assert parse_args(["--training.sources", "a.jsonl:0.7,shards/:0.3"]).training.sources == [
        "a.jsonl:0.7", "shards/:0.3"]
    config.write_text('[[training.sources]]\npath = "a.jsonl"\n')
    with pytest.raises(UserError, match="option training.sources: .* is not a table with a path .* and a weight"):
        parse_args(["--job.config_file", str(config)])


EXIT_SCRIPT = """
import sys
from torchtitan.components.datasets import build_dataloader
from torchtitan.components.tokenizer import build_tokenizer

if __name__ == "__main__":
    tokenizer = build_tokenizer("")
    a, b = sys.argv[1:]
    iterations = []
    for sources, path in ((None, b), ([a + ":0.5", b + ":0.5"], None)):
        loader = build_dataloader(dataset="x", dataset_path=path, text_field="text", tokenizer=tokenizer, seq_len=16,
                                  local_batch_size=2, dp_rank=0, dp_degree=1, infinite=True, num_workers=2,
                                  sources=sources)
        iterator = iter(loader)
        next(iterator)
        iterations.append((loader, iterator))
    print("exiting with live iterations", flush=True)
"""


@pytest.mark.slow
def test_exit_with_live_workers_is_quick(sources, tmp_path):
    # Reader threads and tokenizer processes still running when the interpreter exits: their iterations end in its
    # teardown, after the libraries' own exit handlers stopped them (waiting there for them hung).
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    repo = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, str(script), *sources], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo})
    assert done.returncode == 0 and "exiting with live iterations" in done.stdout, done.stderr[-2000:]
    # (multiprocessing's Pool.__del__ may still complain in the teardown of a pool it terminated: not our code.)
    assert "torchtitan" not in done.stderr, done.stderr[-2000:]
