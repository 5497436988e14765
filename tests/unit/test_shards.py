"""Token shards: scripts/tokenize_dataset.py writes them, the trainer's loader reads them memory-mapped."""

import hashlib
import itertools
import json
import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from scripts import tokenize_dataset
from torchtitan.components.datasets import build_dataloader
from torchtitan.components.datasets.shards import (ShardAccess, ShardDataset, ShardMaps, TokenShards, permute,
                                                   write_manifest)
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.errors import UserError
from tests.unit.reader_threads import live_reader_threads, read_where_expected, record_reading_threads

SEQ_LEN = 16


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("source")
    with open(folder / "docs.jsonl", "w") as f:
        for i in range(300):
            # Some empty documents: neither path may give them tokens.
            f.write(json.dumps({"body": "" if i % 50 == 7 else f"doc {i}: " + "some words here " * (i % 9 + 1)}))
            f.write("\n")
    return str(folder / "docs.jsonl")


@pytest.fixture(scope="module")
def shards(tmp_path_factory, source):
    out = tmp_path_factory.mktemp("shards")
    totals = tokenize_dataset.tokenize(source, str(out), text_field="body", workers=2, documents_per_shard=70,
                                       progress=False)
    assert totals["num_shards"] == 5
    return str(out)


def windows(loader):
    return [tuple(inputs[row].tolist()) + (labels[row, -1].item(),) for inputs, labels in loader
            for row in range(inputs.shape[0])]


def shard_loader(path, tokenizer, rank=0, degree=1, infinite=False, batch=2, seed=0, num_workers=0, max_open=64,
                 verify_all=False):
    return build_dataloader(dataset="x", dataset_path=path, text_field="body", tokenizer=tokenizer, seq_len=SEQ_LEN,
                            local_batch_size=batch, dp_rank=rank, dp_degree=degree, infinite=infinite, seed=seed,
                            num_workers=num_workers, shard_access=ShardAccess(max_open, verify_all))


def test_shards_hold_the_on_the_fly_windows_in_a_seeded_order(source, shards, tokenizer):
    on_the_fly = windows(shard_loader(source, tokenizer))
    from_shards = windows(shard_loader(shards, tokenizer))
    assert sorted(from_shards) == sorted(on_the_fly)
    assert from_shards != on_the_fly, "the windows are shuffled"
    assert windows(shard_loader(shards, tokenizer, seed=1)) != from_shards
    assert windows(shard_loader(shards, tokenizer)) == from_shards


@pytest.mark.parametrize("infinite", [False, True])
def test_reader_threads_deliver_the_same_windows_and_stop(shards, tokenizer, monkeypatch, infinite):
    num_windows = ShardDataset(path=shards, tokenizer=tokenizer, seq_len=SEQ_LEN, dp_rank=0, dp_degree=1,
                               infinite=False, seed=0)._num_windows
    batches = num_windows if infinite else num_windows // 2 + 1  # two epochs, or to the end (batch 2)
    reference = windows(itertools.islice(shard_loader(shards, tokenizer, infinite=infinite), batches))
    threads = record_reading_threads(monkeypatch)
    loader = shard_loader(shards, tokenizer, infinite=infinite, num_workers=2)
    assert windows(itertools.islice(loader, batches)) == reference
    assert read_where_expected(threads, 2)
    if not infinite:
        assert not live_reader_threads(), "the iteration ended: so did its reader threads"


def test_state_counts_consumed_windows_not_those_read_ahead(shards, tokenizer):
    others = set(live_reader_threads())
    loader = shard_loader(shards, tokenizer, infinite=True, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    readers = set(live_reader_threads()) - others
    assert len(readers) == 2
    window_bytes = (SEQ_LEN + 1) * 2
    # Read ahead: two batches beyond the one consumed (read_ahead = 2 x local_batch_size windows).
    deadline = time.monotonic() + 30
    while loader.dataset.shards.bytes_read < 6 * window_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader.dataset.shards.bytes_read == 6 * window_bytes
    state = loader.state_dict()
    assert state["dataset_state"]["next_sample"] == 2
    following = windows([next(iterator) for _ in range(3)])
    resumed = shard_loader(shards, tokenizer, infinite=True, num_workers=2)
    resumed.load_state_dict(state)
    assert windows(itertools.islice(resumed, 3)) == following
    # Loading a state into a loader whose reads are running ahead drops them, and their threads (the old iterator
    # is still referenced here).
    loader.load_state_dict(state)
    assert windows(itertools.islice(loader, 3)) == following
    assert not any(thread.is_alive() for thread in readers)


def test_permutation_is_a_bijection():
    for size in (1, 2, 3, 17, 1000, 4097):
        assert sorted(permute(i, size, 5, 2) for i in range(size)) == list(range(size))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("new_degree", [1, 3])
def test_ranks_split_the_order_and_resume_under_another_degree(shards, tokenizer, new_degree, num_workers,
                                                                monkeypatch):
    reference = windows(shard_loader(shards, tokenizer))
    threads = record_reading_threads(monkeypatch)
    consumed = []
    states = []
    for rank in range(2):
        loader = shard_loader(shards, tokenizer, rank=rank, degree=2, num_workers=num_workers)
        iterator = iter(loader)
        for step in range(4):
            inputs, labels = next(iterator)
            # Rank r's row j of step s is global sample s * 4 + j * 2 + r: the same global batch as one rank's.
            got = [tuple(inputs[j].tolist()) + (labels[j, -1].item(),) for j in range(2)]
            assert got == [reference[step * 4 + j * 2 + rank] for j in range(2)]
            consumed += got
        states.append(loader.state_dict())
    assert states[0] == states[1]
    for rank in range(new_degree):
        loader = shard_loader(shards, tokenizer, rank=rank, degree=new_degree, num_workers=num_workers)
        loader.load_state_dict(json.loads(json.dumps(states[1])))
        consumed += windows(loader)
    assert sorted(consumed) == sorted(reference)
    assert read_where_expected(threads, num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_reshuffle_and_resume_exactly(shards, tokenizer, num_workers, monkeypatch):
    threads = record_reading_threads(monkeypatch)
    loader = shard_loader(shards, tokenizer, infinite=True, num_workers=num_workers)
    num_windows = loader.dataset.state_dict()["num_windows"]
    iterator = iter(loader)
    first = [next(iterator) for _ in range(num_windows)]  # two epochs: batch 2
    epoch_windows = windows(first)
    assert sorted(epoch_windows[:num_windows]) == sorted(epoch_windows[num_windows:])
    assert epoch_windows[:num_windows] != epoch_windows[num_windows:]
    state = loader.state_dict()
    following = windows([next(iterator) for _ in range(3)])
    resumed = shard_loader(shards, tokenizer, infinite=True, num_workers=num_workers)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert windows([next(iterator) for _ in range(3)]) == following
    assert read_where_expected(threads, num_workers)


def test_bytes_read_per_rank_fall_as_one_over_degree(shards, tokenizer):
    read = {}
    for degree in (1, 2, 4):
        datasets = [ShardDataset(path=shards, tokenizer=tokenizer, seq_len=SEQ_LEN, dp_rank=rank, dp_degree=degree,
                                 infinite=False, seed=0) for rank in range(degree)]
        for dataset in datasets:
            for _ in dataset:
                pass
        read[degree] = [dataset.shards.bytes_read for dataset in datasets]
    window_bytes = (SEQ_LEN + 1) * 2  # uint16 ids
    total = read[1][0]
    for degree in (2, 4):
        assert sum(read[degree]) == total
        assert max(read[degree]) - total / degree <= window_bytes


def mapping_flags(file: str) -> set[str]:
    """The kernel's flags (VmFlags in /proc/self/smaps) of this process's memory maps of `file`."""
    flags, current = set(), None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if line.startswith("VmFlags:") and current == file:
            flags.update(fields[1:])
        elif "-" in fields[0] and ":" not in fields[0]:  # the first line of a mapping: address range, ..., path
            current = fields[5] if len(fields) > 5 else None
    return flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the kernel's flags of a mapping (Linux)")
def test_shards_are_mapped_for_random_reads(shards, tokenizer):
    # Without the advice, a cold page fault reads the file's whole read-ahead span (measured 20-50x slower reads).
    dataset = ShardDataset(path=shards, tokenizer=tokenizer, seq_len=SEQ_LEN, dp_rank=0, dp_degree=1, infinite=False,
                           seed=0)
    assert dataset.shards.read(0, SEQ_LEN + 1).shape == (SEQ_LEN + 1,)
    assert "rr" in mapping_flags(os.path.join(shards, "shard-00000.bin")), "mapped with MADV_RANDOM"


def test_refuses_shards_of_another_tokenizer(shards, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "checksum", "0" * 64)
    with pytest.raises(UserError, match="the shards were made with tokenizer 'tokenizer.model'.*re-tokenize"):
        shard_loader(shards, tokenizer)


def copy_shards(shards, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for name in os.listdir(shards):
        (out / name).write_bytes((open(os.path.join(shards, name), "rb")).read())
    return out


def test_truncated_corrupt_and_missing_shards_are_one_line_errors(shards, tokenizer, tmp_path):
    # Opening reads the manifest alone: a shard's file is checked when a window first needs it.
    copy = copy_shards(shards, tmp_path)
    data = (copy / "shard-00001.bin").read_bytes()
    (copy / "shard-00001.bin").write_bytes(data[:-10])
    with pytest.raises(UserError, match=r"shard-00001.bin has \d+ bytes, the manifest says \d+ \(truncated"):
        windows(shard_loader(str(copy), tokenizer))
    # An id beyond the vocabulary (a flipped high bit) is reported when its window is read (also where the shard's
    # checksum is not checked, or was computed from the corrupt data).
    corrupt_ids(copy, "shard-00001", data)
    with pytest.raises(UserError, match="beyond the vocabulary of 2304 \\(corrupt shard\\)"):
        windows(shard_loader(str(copy), tokenizer))
    (copy / "shard-00001.bin").unlink()
    with pytest.raises(UserError, match="shard-00001.bin is missing"):
        windows(shard_loader(str(copy), tokenizer))
    np.save(copy / "shards.npy", np.load(copy / "shards.npy")[:, :-1])
    with pytest.raises(UserError, match=r"the shard index .*shards.npy does not match the manifest's 5 shard\(s\)"):
        shard_loader(str(copy), tokenizer)
    (copy / "manifest.json").write_text("{ not json")
    with pytest.raises(UserError, match="cannot read the shard manifest"):
        shard_loader(str(copy), tokenizer)


def corrupt_ids(copy, name, data):
    """Every id of shard `name` beyond the vocabulary, under a manifest whose checksum matches the corrupt data."""
    corrupt = np.frombuffer(data, dtype=np.uint16).copy()
    corrupt[:] = 65000
    (copy / f"{name}.bin").write_bytes(corrupt.tobytes())
    index = np.load(copy / "shards.npy")
    index[2:6, int(name.split("-")[1])] = np.frombuffer(hashlib.sha256(corrupt.tobytes()).digest(), dtype="<i8")
    np.save(copy / "shards.npy", index)


@pytest.mark.parametrize("fault", ["truncated", "beyond_vocabulary"])
def test_reader_thread_errors_are_the_same_one_line_errors(shards, tokenizer, tmp_path, monkeypatch, fault):
    copy = copy_shards(shards, tmp_path)
    data = (copy / "shard-00002.bin").read_bytes()
    if fault == "truncated":
        (copy / "shard-00002.bin").write_bytes(data[:-10])
    else:
        corrupt_ids(copy, "shard-00002", data)
    others = set(live_reader_threads())
    outcomes = []
    for num_workers in (0, 2):
        threads = record_reading_threads(monkeypatch)
        delivered = []
        with pytest.raises(UserError) as error:
            for batch in shard_loader(str(copy), tokenizer, num_workers=num_workers, batch=1):
                delivered += windows([batch])
        assert read_where_expected(threads, num_workers)
        outcomes.append((delivered, str(error.value)))
    # The error arrives where the training loop reaches the bad window, after the same good ones.
    assert outcomes[0] == outcomes[1]
    assert {"truncated": r"shard-00002.bin has", "beyond_vocabulary": "beyond the vocabulary of 2304 (corrupt shard)"
            }[fault] in outcomes[1][1]
    assert outcomes[1][0], "windows before the corrupt one are delivered"
    assert set(live_reader_threads()) <= others, "the failed iteration's reader threads are gone"


def shard_start(path, tokenizer, name):
    """The first token of shard `name` in the concatenated stream, and the stream's reader."""
    shard = int(name.split("-")[1])
    start = int(np.load(os.path.join(path, "shards.npy"))[0, shard - 1]) if shard else 0
    return start, ShardDataset(path=str(path), tokenizer=tokenizer, seq_len=SEQ_LEN, dp_rank=0, dp_degree=1,
                               infinite=False, seed=0).shards


def test_sha256_checked_on_first_open_for_a_sample_or_all(shards, tokenizer, tmp_path):
    copy = copy_shards(shards, tmp_path)
    tokens = np.fromfile(copy / "shard-00004.bin", dtype=np.uint16)
    tokens[len(tokens) // 2] = (tokens[len(tokens) // 2] + 1) % 2304  # still an id of the vocabulary
    tokens.tofile(copy / "shard-00004.bin")
    message = r"shard file .*shard-00004.bin does not match its sha256 in the manifest \([0-9a-f]{12}\.\.\.\)"
    # The first shard a process opens is in the sample.
    start, reader = shard_start(copy, tokenizer, "shard-00004")
    with pytest.raises(UserError, match=message):
        reader.read(start, 4)
    # Four other shards opened first fill the sample: the fifth is not hashed (in the order of seed 0, shard 4 is
    # opened last) ...
    loader = shard_loader(str(copy), tokenizer)
    assert len(windows(loader)) == loader.dataset.state_dict()["num_windows"]
    # ... unless every shard is.
    with pytest.raises(UserError, match=message):
        windows(shard_loader(str(copy), tokenizer, verify_all=True))
    # A corrupt index is found by the same check.
    (tmp_path / "index").mkdir()
    copy = copy_shards(shards, tmp_path / "index")
    offsets = np.fromfile(copy / "shard-00002.idx", dtype=np.int64)
    offsets[-1] += 1
    offsets.tofile(copy / "shard-00002.idx")
    start, reader = shard_start(copy, tokenizer, "shard-00002")
    with pytest.raises(UserError, match="shard-00002.idx does not match its shard's token count"):
        reader.read(start, 4)


def open_files_under(folder: str) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # a reader thread closed it since the listing
            continue
        count += target.startswith(folder)
    return count


def maps_under(folder: str) -> int:
    return sum(1 for line in open("/proc/self/maps") if folder in line)


def random_shards(folder, tokenizer, count: int, empty_every: int = 0) -> str:
    """`count` shards of 3 windows of random ids each (every `empty_every`-th one empty)."""
    rng = np.random.default_rng(0)
    entries = []
    for index in range(count):
        empty = empty_every and index % empty_every == empty_every - 1
        tokens = rng.integers(0, tokenizer.vocab_size, 0 if empty else 3 * (SEQ_LEN + 1), dtype=np.uint16)
        tokens.tofile(folder / f"shard-{index:05d}.bin")
        np.array([0, len(tokens)][: 2 if len(tokens) else 1], dtype=np.int64).tofile(folder / f"shard-{index:05d}.idx")
        entries.append({"name": f"shard-{index:05d}", "num_tokens": len(tokens), "num_documents": int(len(tokens) > 0),
                        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()})
    write_manifest(folder, tokenizer, entries, source="random", text_field="text")
    return str(folder)


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, tokenizer):
    """306 shards of 3 windows each, every 51st empty."""
    return random_shards(tmp_path_factory.mktemp("many_shards"), tokenizer, 306, empty_every=51)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="counts this process's open files (Linux)")
def test_reads_through_more_shards_than_open_files_allow(many_shards, tokenizer):
    # Every shard open at once (one descriptor and one map each) ended in "Too many open files" beyond the limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
    threads, cached = 2, 8
    try:
        loader = shard_loader(many_shards, tokenizer, num_workers=threads, max_open=cached)
        dataset = loader.dataset
        seen = 0
        for inputs, _ in loader:
            seen += len(inputs)
            # The cache's maps; per reader thread one more, the map it copies out of after its eviction or the one
            # it opens (two descriptors while it opens: the file's and the map's; or the map's and its document
            # index's, while it checks them); and the folder's index, memory-mapped since it was opened.
            assert maps_under(many_shards) <= cached + threads + 1
            assert open_files_under(many_shards) <= cached + 2 * threads + 1
        assert seen == 900 and dataset.shards._maps.opened >= 300 and len(dataset.shards._maps) == cached
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_threads_needing_the_same_shard_open_and_check_it_once(tmp_path, tokenizer, monkeypatch):
    # Both opened it (and hashed it) when the second asked before the first had it cached: a map more than the
    # cache's bound per duplicate, and a checksum read more.
    reader = ShardDataset(path=random_shards(tmp_path, tokenizer, 2), tokenizer=tokenizer, seq_len=SEQ_LEN,
                          dp_rank=0, dp_degree=1, infinite=False, seed=0).shards
    asking = threading.Semaphore(0)
    get = ShardMaps.get

    def counting_get(self, key, open_map):
        asking.release()
        return get(self, key, open_map)

    open_shard = TokenShards._open_shard
    openings = []

    def open_once_both_asked(self, shard):
        # The first opening goes on once the second thread has asked for the shard too.
        openings.append(shard)
        if len(openings) == 1:
            assert asking.acquire(timeout=10) and asking.acquire(timeout=10)
        return open_shard(self, shard)

    hashed = count_calls(monkeypatch, TokenShards, "_verify")
    monkeypatch.setattr(ShardMaps, "get", counting_get)
    monkeypatch.setattr(TokenShards, "_open_shard", open_once_both_asked)
    with ThreadPoolExecutor(2) as pool:
        reads = [pool.submit(reader.read, start, SEQ_LEN) for start in (0, SEQ_LEN)]
        first, second = (read.result(timeout=30) for read in reads)
    assert np.array_equal(np.concatenate([first, second]), reader.read(0, 2 * SEQ_LEN))
    assert openings == [0] and reader._maps.opened == 1 and hashed == [0]


def count_calls(monkeypatch, cls, name: str) -> list:
    """The first argument (after self) of every call of `cls.name` from now on."""
    calls = []
    method = getattr(cls, name)

    def counting(self, first, *args, **kwargs):
        calls.append(first)
        return method(self, first, *args, **kwargs)

    monkeypatch.setattr(cls, name, counting)
    return calls


@pytest.mark.parametrize("num_workers", [0, 2])
def test_verify_all_shards_hashes_each_shard_once_per_process(tmp_path, tokenizer, monkeypatch, num_workers):
    # Every opening hashed its shard: with the shards read at random through a cache smaller than their number,
    # most reads open one, and 100 shards were hashed 1,819 times over 3 epochs.
    folder = random_shards(tmp_path, tokenizer, 100)
    hashed = count_calls(monkeypatch, TokenShards, "_verify")
    loader = shard_loader(folder, tokenizer, infinite=True, num_workers=num_workers, max_open=8, verify_all=True)
    batches = 3 * 100 * 3 // 2  # 3 epochs of 300 windows, batch 2
    assert len(windows(itertools.islice(loader, batches))) == 2 * batches
    assert loader.dataset.shards._maps.opened > 2 * 100, "shards were closed and opened again"
    assert sorted(hashed) == list(range(100))
    # Another loader of the same shards in this process (the next validation's) checks none again ...
    windows(shard_loader(folder, tokenizer, max_open=8, verify_all=True))
    assert len(hashed) == 100
    # ... but a file replaced since.
    tokens = np.fromfile(os.path.join(folder, "shard-00007.bin"), dtype=np.uint16)
    tokens[0] = (tokens[0] + 1) % tokenizer.vocab_size
    tokens.tofile(os.path.join(folder, "shard-00007.bin"))
    with pytest.raises(UserError, match="shard-00007.bin does not match its sha256"):
        windows(shard_loader(folder, tokenizer, max_open=8, verify_all=True))


@pytest.mark.parametrize("change, problem", [
    ({"dtype": "float16"}, "has dtype = 'float16'; token ids are stored as uint16 or uint32"),
    ({"dtype": "int16"}, "has dtype = 'int16'; token ids are stored as uint16 or uint32"),
    ({"dtype": None}, "lacks 'dtype'"),
    ({"num_tokens": None}, "lacks 'num_tokens'"),
    ({"num_shards": "5"}, "has num_shards = '5', not a count"),
    ({"tokenizer": None}, "lacks 'tokenizer'"),
    ({"tokenizer.vocab_size": None}, "lacks tokenizer.vocab_size"),
    ({"tokenizer.vocab_size": 70000}, "has dtype = 'uint16', which cannot hold the ids of its vocabulary of 70000"),
])
def test_a_manifest_the_reader_cannot_use_is_one_error_line(shards, tokenizer, tmp_path, change, problem):
    # float16 read the ids as other numbers and trained on them; int16 and a missing key ended in a traceback.
    copy = copy_shards(shards, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    for key, value in change.items():
        record, _, key = key.rpartition(".")
        entry = manifest[record] if record else manifest
        if value is None:
            del entry[key]
        else:
            entry[key] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as error:
        windows(shard_loader(str(copy), tokenizer))
    message = str(error.value)
    assert f"the shard manifest {copy / 'manifest.json'} {problem}" in message and "\n" not in message, message
    assert message.endswith("re-create the folder with scripts/tokenize_dataset.py"), message


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="sets this process's open-file limit (Linux)")
def test_no_file_descriptor_left_is_one_error_line(many_shards, tokenizer):
    reader = shard_loader(many_shards, tokenizer, max_open=8).dataset.shards
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        with pytest.raises(UserError, match=r"opening shard file .*shard-00000.bin failed \(Too many open files\) "
                                            r"with 0 shard\(s\) open; lower training.max_open_shards \(now 8\)"):
            reader.read(0, 4)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_resume_rejects_another_seed(shards, tokenizer):
    loader = shard_loader(shards, tokenizer, infinite=True)
    next(iter(loader))
    other = shard_loader(shards, tokenizer, infinite=True, seed=3)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(UserError, match="training.data_seed: .* seed = 0, now 3"):
        next(iter(other))


def test_script_errors_are_one_line(tmp_path, capsys, shards):
    assert tokenize_dataset.main([str(tmp_path / "missing.jsonl"), str(tmp_path / "out")]) == 2
    assert "error: SOURCE='" in capsys.readouterr().err
    assert tokenize_dataset.main([str(tmp_path / "x.jsonl"), shards]) == 2
    assert "already holds token shards" in capsys.readouterr().err


def shard_files(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if name.endswith((".bin", ".idx", ".npy"))}


def test_tokenizing_in_parts_and_resuming_gives_the_same_shards(source, shards, tmp_path, capsys):
    out = str(tmp_path / "parts")
    first = tokenize_dataset.tokenize(source, out, text_field="body", documents_per_shard=70, progress=False,
                                      part="0/2")
    assert (first["num_shards"], first["written"], first["complete"]) == (3, 3, False)
    assert not os.path.exists(os.path.join(out, "manifest.json")), "part 1 of 2 is not done"
    with pytest.raises(UserError, match=r"part\(s\) 1/2 are not done"):
        tokenize_dataset.merge(out)
    # The part that finishes last writes the manifest.
    assert tokenize_dataset.main([source, out, "--text_field", "body", "--documents_per_shard", "70",
                                  "--part", "1/2"]) == 0
    printed = capsys.readouterr().out
    assert "2 shard(s) (2 written, 0 kept)" in printed and "tokens/s; complete" in printed
    assert shard_files(out) == shard_files(shards)
    # A crash of part 0 while it wrote shard 4 (no record yet), and shard 0 damaged since: resuming rewrites both and
    # keeps shard 2.
    for name in ("manifest.json", "shards.npy", "part-0-of-2.json", "shard-00004.json"):
        os.unlink(os.path.join(out, name))
    tokens = np.fromfile(os.path.join(out, "shard-00000.bin"), dtype=np.uint16)
    tokens[3] += 1
    tokens.tofile(os.path.join(out, "shard-00000.bin"))
    resumed = tokenize_dataset.tokenize(source, out, text_field="body", documents_per_shard=70, progress=False,
                                        part="0/2")
    assert (resumed["written"], resumed["kept"], resumed["complete"]) == (2, 1, True)
    assert shard_files(out) == shard_files(shards)
    # Parts copied together from separate disks: --merge writes the index and the manifest.
    for name in ("manifest.json", "shards.npy"):
        os.unlink(os.path.join(out, name))
    assert tokenize_dataset.main(["--merge", out]) == 0
    assert "5 shard(s)" in capsys.readouterr().out
    assert shard_files(out) == shard_files(shards) and os.path.exists(os.path.join(out, "manifest.json"))


def test_resuming_with_other_options_is_one_error_line(source, tmp_path):
    out = str(tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenize.json").write_text(json.dumps(
        {"source": source, "text_field": "body", "tokenizer_sha256": build_tokenizer("").checksum,
         "documents_per_shard": 70, "parts": 2}))
    with pytest.raises(UserError, match=r"--documents_per_shard: OUT_DIR='.*out' was begun with documents_per_shard "
                                        r"= 70, now 50; resume with the same options"):
        tokenize_dataset.tokenize(source, out, text_field="body", documents_per_shard=50, part="0/2")
    with pytest.raises(UserError, match="--part: .* was begun with parts = 2, now 3"):
        tokenize_dataset.tokenize(source, out, text_field="body", documents_per_shard=70, part="0/3")
    for bad in ("2/2", "1", "a/b"):
        with pytest.raises(UserError, match=f"--part='{bad}' must be I/P with 0 <= I < P"):
            tokenize_dataset.tokenize(source, out, part=bad)
