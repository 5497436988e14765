import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.components.datasets import TextDataset, build_dataloader
from torchtitan.components.datasets import documents as documents_module
from torchtitan.components.datasets import text as text_module
from torchtitan.components.datasets.records import first_malformed_record
from torchtitan.errors import UserError

BOS, EOS = 256, 257

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "Pack my box with five dozen liquor jugs.",
    "How vexingly quick daft zebras jump!",
    "Sphinx of black quartz, judge my vow.",
    "A wizard's job is to vex chumps quickly in fog.",
    "x",
    "Jackdaws love my big sphinx of quartz.",
]


class ByteTokenizer:
    """UTF-8 bytes as ids, plus BOS and EOS; records what it encodes."""

    bos_id, eos_id, vocab_size = BOS, EOS, 258

    def __init__(self):
        self.encoded: list[str] = []

    def encode(self, text, *, add_bos, add_eos):
        self.encoded.append(text)
        return [BOS] * add_bos + list(text.encode()) + [EOS] * add_eos

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode()


def stream_of(docs):
    return [t for d in docs if d for t in [BOS, *d.encode(), EOS]]


def windows_of(docs, seq_len, epochs=1):
    stream = stream_of(docs) * epochs
    span = seq_len + 1
    return [stream[i : i + span] for i in range(0, len(stream) - span + 1, span)]


@pytest.fixture
def corpus(monkeypatch):
    """Replace the embedded corpus with `DOCS` (train) and a short validation split."""
    splits = {"train": DOCS, "validation": DOCS[:3]}
    monkeypatch.setattr(documents_module, "embedded_corpus", lambda split: list(splits[split]))


def loader(*, seq_len=16, batch=2, rank=0, degree=1, infinite=True, dataset="embedded", path=None,
           field="text", tokenizer=None, workers=0):
    return build_dataloader(
        dataset=dataset,
        dataset_path=path,
        text_field=field,
        tokenizer=tokenizer or ByteTokenizer(),
        seq_len=seq_len,
        local_batch_size=batch,
        dp_rank=rank,
        dp_degree=degree,
        infinite=infinite,
        num_workers=workers,
    )


def rows(batches):
    """The windows (input + last label) of a list of batches, in order."""
    out = []
    for inputs, labels in batches:
        for i, l in zip(inputs.tolist(), labels.tolist()):
            out.append(i + l[-1:])
    return out


def take(it, n):
    return [next(it) for _ in range(n)]


def test_packing_and_finite_end(corpus):
    seq_len = 16
    batches = list(loader(seq_len=seq_len, batch=3, infinite=False))
    inputs, labels = batches[0]
    assert inputs.shape == labels.shape == (3, seq_len)
    assert inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    expected = windows_of(DOCS, seq_len)
    assert rows(batches) == expected
    # The partial tail is dropped, and empty documents add nothing (not even BOS EOS).
    assert len(expected) == len(stream_of(DOCS)) // (seq_len + 1)


def test_finite_iteration_starts_over(corpus):
    dl = loader(infinite=False)
    first = rows(list(dl))
    assert first == rows(list(dl)) == windows_of(DOCS, 16)


def test_infinite_wraps_epochs(corpus, caplog):
    seq_len = 16
    per_epoch = len(stream_of(DOCS))
    n = 3 * per_epoch // (seq_len + 1)
    with caplog.at_level("INFO", logger="torchtitan"):
        got = rows(take(iter(loader(seq_len=seq_len, batch=1)), n))
    assert got == windows_of(DOCS, seq_len, epochs=4)[:n]
    assert "dataset embedded: starting epoch 2" in caplog.text
    assert "dataset embedded: starting epoch 3" in caplog.text


@pytest.mark.parametrize("infinite", [False, True])
def test_rank_sharding(corpus, infinite):
    seq_len = 8
    full = windows_of(DOCS, seq_len, epochs=3)
    steps = len(windows_of(DOCS, seq_len)) // 6
    for degree in (1, 2, 3):
        per_rank = []
        for rank in range(degree):
            dl = loader(seq_len=seq_len, batch=2, rank=rank, degree=degree, infinite=infinite)
            per_rank.append(rows(take(iter(dl), steps) if infinite else list(dl)))
        if not infinite:
            assert sum(map(len, per_rank)) == len(windows_of(DOCS, seq_len))
        n = sum(map(len, per_rank))
        merged = [per_rank[i % degree][i // degree] for i in range(n)]
        assert merged == full[:n]


def test_state_is_the_same_on_every_rank(corpus):
    states = []
    for rank in range(3):
        dl = loader(seq_len=8, rank=rank, degree=3)
        it = iter(dl)
        take(it, 4)
        states.append(dl.state_dict()["dataset_state"])
    assert len({s["next_window"] for s in states}) == 1
    assert states[0]["next_window"] == 4 * 2 * 3


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("steps", [0, 1, 5, 40])
def test_exact_resume(corpus, steps, workers):
    seq_len = 16
    per_epoch = len(windows_of(DOCS, seq_len))
    reference = take(iter(loader(seq_len=seq_len)), steps + 6)

    dl = loader(seq_len=seq_len, workers=workers)
    it = iter(dl)
    take(it, steps)
    state = json.loads(json.dumps(dl.state_dict()))
    if steps == 40:
        assert state["dataset_state"]["anchor_epoch"] >= 2 * 40 // per_epoch - 1 > 0

    tokenizer = ByteTokenizer()
    resumed = loader(seq_len=seq_len, tokenizer=tokenizer, workers=workers)
    resumed.load_state_dict(state)
    after = take(iter(resumed), 6)
    assert rows(after) == rows(reference[steps:])
    if workers:
        return  # the workers encode: this process's tokenizer records nothing
    # It seeks to the saved document instead of re-tokenizing everything before it.
    anchor = state["dataset_state"]["anchor_document"]
    following = [d for d in DOCS[anchor:] + DOCS * 2 if d]
    assert tokenizer.encoded == following[: len(tokenizer.encoded)]


def test_resume_twice_and_after_fresh_state(corpus):
    reference = rows(take(iter(loader()), 9))
    dl = loader()
    seen = rows(take(iter(dl), 3))
    for _ in range(2):
        state = dl.state_dict()
        dl = loader()
        dl.load_state_dict(state)
        seen += rows(take(iter(dl), 3))
    assert seen == reference


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("saving_rank", [0, 1])
@pytest.mark.parametrize("new_degree", [1, 3])
def test_resume_with_another_dp_degree(corpus, saving_rank, new_degree, workers):
    seq_len, batch, steps = 8, 2, 3
    full = windows_of(DOCS, seq_len)
    seen = []
    states = []
    for rank in range(2):
        dl = loader(seq_len=seq_len, batch=batch, rank=rank, degree=2, infinite=False, workers=workers)
        seen += rows(take(iter(dl), steps))
        states.append(dl.state_dict())
    assert states[0]["dataset_state"]["next_window"] == states[1]["dataset_state"]["next_window"]
    for rank in range(new_degree):
        dl = loader(seq_len=seq_len, batch=batch, rank=rank, degree=new_degree, infinite=False, workers=workers)
        dl.load_state_dict(states[saving_rank])
        seen += rows(list(dl))
    assert sorted(seen) == sorted(full)
    assert len(seen) == len(full)


def test_resume_with_another_dp_degree_keeps_global_batches(corpus):
    seq_len, batch = 8, 2
    reference = windows_of(DOCS, seq_len, epochs=4)
    dl = loader(seq_len=seq_len, batch=batch, rank=1, degree=2)
    take(iter(dl), 5)
    state = dl.state_dict()
    start = state["dataset_state"]["next_window"]
    for rank in range(3):
        dl = loader(seq_len=seq_len, batch=batch, rank=rank, degree=3)
        dl.load_state_dict(state)
        got = rows(take(iter(dl), 2))
        assert got == [reference[start + rank + 3 * k] for k in range(4)]


def test_resume_rejects_other_seq_len(corpus):
    dl = loader(seq_len=16)
    take(iter(dl), 1)
    state = dl.state_dict()
    other = loader(seq_len=8)
    other.load_state_dict(state)
    with pytest.raises(UserError, match=r"training\.seq_len=8.*seq_len=16"):
        next(iter(other))


def test_resume_rejects_changed_data(corpus, monkeypatch):
    dl = loader(seq_len=16)
    it = iter(dl)
    state = None
    while state is None or state["dataset_state"]["anchor_token"] == 0:
        next(it)
        state = dl.state_dict()
    monkeypatch.setattr(documents_module, "embedded_corpus", lambda split: ["a", "b"] * 20)
    other = loader(seq_len=16)
    other.load_state_dict(state)
    with pytest.raises(UserError, match="training.dataset='embedded'"):
        next(iter(other))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_local_formats(tmp_path):
    seq_len = 8
    expected = windows_of(DOCS, seq_len)
    records = [{"text": d, "id": i} for i, d in enumerate(DOCS)]

    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    as_json = tmp_path / "b.json"
    as_json.write_text(json.dumps(records))
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    txt = tmp_path / "d.txt"
    txt.write_text("\n".join(DOCS) + "\n")

    for path in (jsonl, as_json, parquet, txt):
        got = rows(list(loader(seq_len=seq_len, dataset="mine", path=str(path), infinite=False)))
        assert got == expected, path


def test_folder_glob_and_text_field(tmp_path):
    seq_len = 8
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "part0.jsonl", [{"content": d} for d in DOCS[:4]])
    write_jsonl(folder / "sub" / "part1.jsonl", [{"content": d} for d in DOCS[4:]])
    (folder / "README.md").write_text("not data")
    expected = windows_of(DOCS, seq_len)

    got = rows(list(loader(seq_len=seq_len, path=str(folder), field="content", infinite=False)))
    assert got == expected
    got = rows(list(loader(seq_len=seq_len, path=str(folder / "**" / "*.jsonl"), field="content",
                           infinite=False)))
    assert got == expected


def test_local_resume(tmp_path):
    path = str(write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS]))
    reference = rows(take(iter(loader(path=path)), 12))
    dl = loader(path=path)
    before = rows(take(iter(dl), 7))
    resumed = loader(path=path)
    resumed.load_state_dict(dl.state_dict())
    assert before + rows(take(iter(resumed), 5)) == reference


def test_hub_id_streams_and_resumes(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, *, split, streaming):
        calls.append((path, name, split, streaming))
        return datasets.Dataset.from_list([{"text": d} for d in DOCS]).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    reference = rows(take(iter(loader(path="someorg/somedata")), 12))
    assert reference == windows_of(DOCS, 16, epochs=4)[:24]
    dl = loader(path="someorg/somedata")
    before = rows(take(iter(dl), 7))
    resumed = loader(path="someorg/somedata")
    resumed.load_state_dict(dl.state_dict())
    assert before + rows(take(iter(resumed), 5)) == reference
    assert set(calls) == {("someorg/somedata", None, "train", True)}

    calls.clear()
    loader(dataset="c4")
    loader(dataset="c4_validation")
    assert calls == [("allenai/c4", "en", "train", True), ("allenai/c4", "en", "validation", True)]


def test_streaming_missing_text_field(monkeypatch):
    import datasets

    def records():
        yield {"content": "hello"}

    def fake_load_dataset(path, name=None, *, split, streaming):
        return datasets.IterableDataset.from_generator(records)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dl = loader(path="someorg/other")
    with pytest.raises(UserError, match="training.dataset_text_field='text'.*'content'"):
        next(iter(dl))


def test_streaming_without_text(monkeypatch):
    import datasets

    def fake_load_dataset(path, name=None, *, split, streaming):
        return datasets.Dataset.from_list([{"text": ""}, {"text": None}]).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(UserError, match="training.dataset_path='someorg/empty'"):
        next(iter(loader(path="someorg/empty")))


def test_workers_give_the_same_stream_and_errors(corpus, tmp_path):
    assert rows(take(iter(loader(workers=2)), 30)) == rows(take(iter(loader()), 30))
    with pytest.raises(UserError, match="training.num_workers=-1 must be 0"):
        loader(workers=-1)
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [{"text": "fine"}] * 100 + [{"text": 5}])
    # A document that is not text is reported from the process that reads the documents, with workers too.
    with pytest.raises(UserError, match="line 101 has a number in field 'text', not a string"):
        list(loader(path=str(path), workers=2, infinite=False))


def test_tokenizer_workers_are_idle_when_their_pool_stops(monkeypatch):
    # Stopping the pool while a worker encodes can hang the training process (a worker sending a large result holds
    # the lock that the pool's termination waits for): the iteration finishes the tasks it sent first.
    big = [f"document {i} " + "many words in a long document " * 100 for i in range(200)]
    monkeypatch.setattr(documents_module, "embedded_corpus", lambda split: big)
    unfinished = []
    real_pool = text_module.worker_pool

    class RecordingPool:
        def __init__(self, *args):
            self.pool, self.results = real_pool(*args), []

        def apply_async(self, *args):
            self.results.append(self.pool.apply_async(*args))
            return self.results[-1]

        def terminate(self):
            unfinished.append(sum(not result.ready() for result in self.results))
            self.pool.terminate()

    monkeypatch.setattr(text_module, "worker_pool", RecordingPool)
    iterator = iter(loader(workers=2))
    next(iterator)
    del iterator
    assert unfinished == [0]


def test_validation_split(corpus):
    got = rows(list(loader(dataset="embedded_validation", infinite=False)))
    assert got == windows_of(DOCS[:3], 16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dataset="wikitext"), "training.dataset='wikitext'.*embedded, embedded_validation, c4"),
        (dict(path="missing/file.jsonl"), "training.dataset_path='missing/file.jsonl' does not exist"),
        (dict(path="{tmp}/*.parquet"), r"training.dataset_path='.*\*\.parquet' matches no files"),
        (dict(path="{tmp}/data.csv"), r"data\.csv.*valid extensions are \.jsonl, \.json, \.parquet, \.txt"),
        (dict(path="{tmp}/nodata"), "training.dataset_path='.*nodata' is a folder without"),
        (dict(path="{tmp}/mixed"), "mixes file types"),
        (dict(path="{tmp}/good.jsonl", field="body"),
         r"dataset_path='.*good.jsonl': .*good\.jsonl line 1 has no field 'body' \(it has 'text'\); set "
         r"training\.dataset_text_field"),
        (dict(path="{tmp}/numbers.jsonl"), r"numbers\.jsonl line 1 has a number in field 'text', not a string$"),
        (dict(path="{tmp}/empty.txt"), "training.dataset_path='.*empty.txt' has no documents"),
        (dict(path="{tmp}/blank.jsonl"), "has only empty documents"),
        (dict(path="{tmp}/blank_lines.jsonl"), r"training.dataset_path='.*blank_lines.jsonl' has no documents"),
        (dict(path="{tmp}/empty_list.json"), r"training.dataset_path='.*empty_list.json' has no documents"),
        (dict(path="{tmp}/empty_object.json"), r"training.dataset_path='.*empty_object.json' has no documents"),
        (dict(path="{tmp}/no_text.json"), r"no_text\.json line 1 has no field 'text' \(it has 'body'\)"),
        # Malformed records: the file, the line (counting from 1) and what is wrong.
        (dict(path="{tmp}/broken.jsonl"), r"broken\.jsonl line 2 is not valid JSON: Expecting value \(column 10\)$"),
        (dict(path="{tmp}/one_without_text.jsonl"), r"one_without_text\.jsonl line 3 has no field 'text' \(it has "
                                                    r"'body', 'id'\)"),
        (dict(path="{tmp}/list_line.jsonl"), r"list_line\.jsonl line 2 is a list, not a JSON object"),
        (dict(path="{tmp}/array.json"), r"array\.json line 4 has a boolean in field 'text', not a string$"),
        # A trailing comma after line 3's record: json finds the error at the closing bracket.
        (dict(path="{tmp}/broken_array.json"), r"broken_array\.json line 4 is not valid JSON: Expecting value"),
        (dict(path="{tmp}/pq/numbers.parquet"), r"numbers\.parquet row 2: column 'text' holds int64, not strings$"),
        (dict(path="{tmp}/pq/no_text.parquet"), r"no_text\.parquet has no column 'text' \(it has 'body'\)"),
        (dict(path="{tmp}/pq/not.parquet"), r"not\.parquet is not a Parquet file"),
        (dict(seq_len=0), r"training.seq_len=0"),
        (dict(batch=0), r"training.local_batch_size=0"),
    ],
)
def test_user_errors(corpus, tmp_path, kwargs, message):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "notes.md").write_text("hello")
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"text": "hello"}])
    (tmp_path / "mixed" / "b.txt").write_text("hello\n")
    write_jsonl(tmp_path / "good.jsonl", [{"text": "hello"}])
    write_jsonl(tmp_path / "numbers.jsonl", [{"text": 3}])
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "blank_lines.jsonl").write_text("\n\n  \n")
    (tmp_path / "empty_list.json").write_text("[]\n")
    (tmp_path / "empty_object.json").write_text("{}\n")
    (tmp_path / "no_text.json").write_text(json.dumps([{"body": "hello"}, {"body": "world"}]))
    write_jsonl(tmp_path / "one_without_text.jsonl", [{"text": "a"}, {"text": None}, {"body": "b", "id": 3}])
    (tmp_path / "list_line.jsonl").write_text('{"text": "a"}\n["b"]\n')
    (tmp_path / "array.json").write_text('[\n  {"text": "a"},\n  {"text": "b"},\n  {"text": true}\n]\n')
    (tmp_path / "broken_array.json").write_text('[\n  {"text": "a"},\n  {"text": "b"},\n]\n')
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": [None, 5]}), tmp_path / "pq" / "numbers.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "pq" / "no_text.parquet")
    (tmp_path / "pq" / "not.parquet").write_bytes(b"not parquet at all")
    if "path" in kwargs:
        kwargs["path"] = kwargs["path"].format(tmp=tmp_path)
    with pytest.raises(UserError, match=message):
        loader(**kwargs)


def test_first_malformed_record_names_the_first_bad_file_and_line(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, {"text": None}])
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "x"}\n\n{"text": "y"}\n{"text": 1.5}\n{"nope": 1}\n')
    assert first_malformed_record([str(good)], "text") is None
    assert first_malformed_record([str(good), str(bad)], "text") == (
        f"{bad} line 4 has a number in field 'text', not a string")


def test_too_small_for_every_rank(corpus):
    seq_len = 40
    windows = len(windows_of(DOCS, seq_len))
    assert 0 < windows < 8
    dl = loader(seq_len=seq_len, degree=8, rank=0, infinite=False)
    tokens = len(stream_of(DOCS))
    with pytest.raises(UserError, match=rf"training.dataset='embedded' has {tokens} tokens.*seq_len"):
        list(dl)
    # Looping data always has enough windows.
    assert len(take(iter(loader(seq_len=seq_len, degree=8, rank=7)), 2)) == 2


def test_validation_section_in_messages(corpus, tmp_path):
    with pytest.raises(UserError, match="validation.dataset='nope'"):
        TextDataset(dataset="nope", dataset_path=None, text_field="text", tokenizer=ByteTokenizer(),
                    seq_len=8, dp_rank=0, dp_degree=1, infinite=False, config_section="validation")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"validation.dataset_path='.*blank.jsonl' has no documents"):
        TextDataset(dataset="x", dataset_path=str(tmp_path / "blank.jsonl"), text_field="text",
                    tokenizer=ByteTokenizer(), seq_len=8, dp_rank=0, dp_degree=1, infinite=False,
                    config_section="validation")


def test_embedded_corpus_with_real_tokenizer():
    tokenizer_module = pytest.importorskip("torchtitan.components.tokenizer")
    build = getattr(tokenizer_module, "build_tokenizer", None)
    path = getattr(tokenizer_module, "DEFAULT_TOKENIZER_PATH", None)
    if build is None or path is None or not path.exists():
        pytest.skip("the default tokenizer is not available")
    tokenizer = build(str(path))
    seq_len = 32
    dl = build_dataloader(dataset="embedded_validation", dataset_path=None, text_field="text",
                          tokenizer=tokenizer, seq_len=seq_len, local_batch_size=2, dp_rank=0,
                          dp_degree=1, infinite=False)
    inputs, labels = next(iter(dl))
    assert inputs.shape == (2, seq_len)
    assert inputs[0, 0].item() == tokenizer.bos_id
    assert int(inputs.max()) < tokenizer.vocab_size
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert isinstance(tokenizer.decode(inputs[0].tolist()), str)
