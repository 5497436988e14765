import inspect
import json
import sys

import pytest

from torchtitan.components.datasets import corpus
from torchtitan.components.datasets.corpus import embedded_corpus, is_validation
from torchtitan.errors import UserError


def test_splits_are_non_empty_english_text():
    train = embedded_corpus("train")
    validation = embedded_corpus("validation")
    assert train and validation
    assert all(isinstance(d, str) and d.strip() for d in train + validation)
    assert sum(len(d) for d in train) > 1_000_000
    assert max(len(d) for d in train) <= 8_000
    text = " ".join(train[:200])
    for word in ("the", "statement", "function"):
        assert f" {word} " in text


def test_splits_are_disjoint_and_sized():
    train = embedded_corpus("train")
    validation = embedded_corpus("validation")
    assert not set(train) & set(validation)
    assert len(set(train)) == len(train)
    assert 0.01 <= len(validation) / (len(train) + len(validation)) <= 0.04
    assert all(is_validation(d) for d in validation)
    assert not any(is_validation(d) for d in train)


def test_callers_cannot_corrupt_the_cache():
    embedded_corpus("train").clear()
    assert embedded_corpus("train")


def test_deterministic_whatever_this_process_patched(monkeypatch, tmp_path):
    before = {split: embedded_corpus(split) for split in corpus.SPLITS}
    # torch replaces inspect.getfile on import; such patches must not leak into the text. (An empty cache
    # directory, so that the documents are built again.)
    monkeypatch.setattr(inspect, "getfile", lambda obj: "patched")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    corpus._splits.cache_clear()
    assert {split: embedded_corpus(split) for split in corpus.SPLITS} == before


def test_built_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = corpus._cached_documents()
    (cache_file,) = (tmp_path / "torchtitan").glob("embedded_corpus-*.json")
    monkeypatch.setattr(corpus, "_documents_from_pristine_interpreter", lambda: pytest.fail("built again"))
    assert corpus._cached_documents() == built
    # An unreadable cache is built again and replaced.
    cache_file.write_text('["truncated')
    monkeypatch.setattr(corpus, "_documents_from_pristine_interpreter", lambda: built[:3])
    assert corpus._cached_documents() == built[:3]
    assert json.loads(cache_file.read_text()) == built[:3]
    # Another virtual environment's interpreter writes its path into the text: it gets a corpus of its own.
    monkeypatch.setattr(sys, "executable", "/another/venv/bin/python")
    monkeypatch.setattr(corpus, "_documents_from_pristine_interpreter", lambda: ["built for the other interpreter"])
    assert corpus._cached_documents() == ["built for the other interpreter"]
    assert len(list((tmp_path / "torchtitan").glob("embedded_corpus-*.json"))) == 2


def test_unknown_split():
    with pytest.raises(UserError, match="'test'.*train, validation"):
        embedded_corpus("test")
