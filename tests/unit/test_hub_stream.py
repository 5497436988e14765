"""Streaming from the Hugging Face hub survives faults: a local HTTP server stands in for the hub (HF_ENDPOINT) and
serves a repository of parquet files, failing on purpose (429s, dropped connections, persistent 503s). The
libraries' own retries are cut to one attempt without waits, so that the failures reach the loader's retry layer."""

import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.hub_server import HubServer
from torchtitan.components.datasets.documents import Source, StreamRetry, is_transient, load_documents
from torchtitan.components.datasets.text import TextDataset
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.errors import UserError

RECORDS_PER_SHARD = 100


@pytest.fixture
def repository(tmp_path):
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    for shard in range(2):
        table = pa.table({"text": [f"shard {shard} record {i}" for i in range(RECORDS_PER_SHARD)]})
        pq.write_table(table, root / "data" / f"train-0000{shard}-of-00002.parquet", row_group_size=10)
    return root


def stream(max_attempts: int = 4) -> list[str]:
    source = Source(dataset="x", dataset_path="org/data", text_field="text", section="training",
                    retry=StreamRetry(max_attempts=max_attempts, backoff_seconds=0.001))
    return list(load_documents(source).read_from(0))


EXPECTED = [f"shard {s} record {i}" for s in range(2) for i in range(RECORDS_PER_SHARD)]


@pytest.mark.parametrize("fault", ["429", "dropped_connection"])
def test_transient_faults_mid_stream_lose_and_repeat_nothing(repository, hub_client, caplog, fault):
    # The first downloads open the first shard (schema) and read it; the faults hit the second shard mid-stream,
    # more of them than the hub client retries (6 tries a request).
    faults = {"429": {"fail_429": 7}, "dropped_connection": {"drop": 7}}[fault]
    with HubServer(repository, fail_after=2, **faults) as hub:
        hub_client(hub.url)
        records = stream()
    assert records == EXPECTED
    retries = [r for r in caplog.records if "transient error while streaming" in r.getMessage()]
    assert retries, "the faults must reach the loader's retry layer"


def test_persistent_failure_is_one_error_line_after_the_configured_attempts(repository, hub_client):
    with HubServer(repository, fail_after=0, always_503=True) as hub:
        hub_client(hub.url)
        with pytest.raises(UserError, match=r"training.dataset_path='org/data': streaming failed 3 times in a row "
                                            r"\(training.stream_max_attempts = 3\), last with .*503"):
            stream(max_attempts=3)


def hub_dataset(tokenizer) -> TextDataset:
    return TextDataset(dataset="x", dataset_path="org/data", text_field="text", tokenizer=tokenizer, seq_len=16,
                       dp_rank=0, dp_degree=1, infinite=False, stream_retry=StreamRetry(4, 0.001))


def test_a_checkpoint_resumes_the_stream_from_its_own_position(tmp_path, hub_client):
    # Skipping to the checkpoint's document downloaded every file before it again, on every rank.
    root = tmp_path / "long"
    (root / "data").mkdir(parents=True)
    files = [f"train-0000{i}-of-00004.parquet" for i in range(4)]
    for i, name in enumerate(files):
        pq.write_table(pa.table({"text": [f"file {i} record {j}" for j in range(RECORDS_PER_SHARD)]}),
                       root / "data" / name, row_group_size=10)
    tokenizer = build_tokenizer("")
    with HubServer(root) as hub:
        hub_client(hub.url)
        dataset = hub_dataset(tokenizer)
        iterator = iter(dataset)
        while dataset.state_dict()["anchor_document"] <= 3 * RECORDS_PER_SHARD:  # into the last file
            next(iterator)
        state = dataset.state_dict()
        assert state["anchor_stream"] is not None
        following = [inputs.tolist() for inputs, _ in iterator]
        resumed = hub_dataset(tokenizer)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        # (Opening the stream reads the first file's schema.)
        hub.downloads.clear()
        assert [inputs.tolist() for inputs, _ in resumed] == following and following
        # The stream resumes at its last batch boundary, which may lie at the end of the file before the anchor's.
        assert {name for name, _ in hub.downloads} <= set(files[2:]), hub.downloads


def test_a_checkpoint_keeps_the_stream_position_however_far_the_tokenizers_read_ahead(tmp_path, hub_client,
                                                                                      monkeypatch):
    """32 tokenizer workers read 32 x 4 tasks x 64 = 8,192 documents ahead of the packer, which was as many stream
    positions as were kept: from 32 workers on, the checkpoint had none and a resume downloaded every file before
    it again. (The workers are threads here, the same pool interface without 32 process start-ups: they only
    encode; the reading and the positions are the training process's.)"""
    from multiprocessing.pool import ThreadPool

    from torchtitan.components.datasets import text

    monkeypatch.setattr(text, "worker_pool", ThreadPool)
    per_file = 1000
    root = tmp_path / "long"
    (root / "data").mkdir(parents=True)
    files = [f"train-{i:05d}-of-00012.parquet" for i in range(12)]
    for i, name in enumerate(files):
        pq.write_table(pa.table({"text": [f"f{i} r{j}" for j in range(per_file)]}), root / "data" / name,
                       row_group_size=250)
    tokenizer = build_tokenizer("")

    def dataset(num_workers: int) -> TextDataset:
        return TextDataset(dataset="x", dataset_path="org/data", text_field="text", tokenizer=tokenizer, seq_len=16,
                           dp_rank=0, dp_degree=1, infinite=False, num_workers=num_workers,
                           stream_retry=StreamRetry(4, 0.001))

    with HubServer(root) as hub:
        hub_client(hub.url)
        reading = dataset(32)
        iterator = iter(reading)
        while reading.state_dict()["anchor_document"] <= 2 * per_file:  # into the third file
            next(iterator)
        state = reading.state_dict()
        assert state["anchor_stream"] is not None
        following = [inputs.tolist() for inputs, _ in itertools.islice(iterator, 3)]
        iterator.close()
        resumed = dataset(0)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        hub.downloads.clear()
        assert [inputs.tolist() for inputs, _ in itertools.islice(iter(resumed), 3)] == following
        # It resumes at the stream's last batch boundary, in the third file or at the end of the second.
        assert files[0] not in {name for name, _ in hub.downloads}, hub.downloads


def test_stalled_reads_and_resuming_at_a_later_document_under_faults(repository, hub_client, monkeypatch, caplog):
    import huggingface_hub.constants

    # A read that stalls times out on the client's side (after 0.1 s here), more times than the client retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.1)
    later = RECORDS_PER_SHARD + 50
    with HubServer(repository, stall_seconds=0.3) as hub:
        hub_client(hub.url)
        source = Source(dataset="x", dataset_path="org/data", text_field="text", section="training",
                        retry=StreamRetry(max_attempts=4, backoff_seconds=0.001))
        documents = load_documents(source)
        reader = documents.read_positioned(0)
        read = list(itertools.islice(reader, later))
        assert [value for value, _ in read] == EXPECTED[:later]
        position = read[-1][1]
        reader.close()
        # Resumed from the stream's own position, it meets 7 stalled reads.
        hub.parquet_requests, hub.stall = 0, 7
        caplog.clear()
        assert list(documents.read_from(later, position)) == EXPECTED[later:]
    stalls = [r for r in caplog.records if "transient error while streaming" in r.getMessage()]
    assert stalls and hub.stall == 0, "the stalls must reach the loader's retry layer"


class ClientError(Exception):
    """aiohttp's exception classes (aiohttp 3), by name and hierarchy: fsspec's HTTP file system raises them."""


class ClientConnectionError(ClientError):
    pass


class ServerDisconnectedError(ClientConnectionError):
    pass


class ClientPayloadError(ClientError):
    pass


@pytest.mark.parametrize("error", [ServerDisconnectedError("Server disconnected"), ClientConnectionError("reset"),
                                   ClientPayloadError("Response payload is not completed")])
def test_aiohttp_disconnects_are_transient(error):
    assert is_transient(error)
    wrapped = RuntimeError("reading the parquet file failed")
    wrapped.__cause__ = error
    assert is_transient(wrapped)
    assert not is_transient(ClientError("400 Bad Request"))


@pytest.mark.slow
def test_a_trainer_checkpoint_resumes_the_hub_stream(tmp_path, hub_client, monkeypatch):
    """The trainer streaming from the hub stand-in saves after step 4 and a second launch resumes from that
    checkpoint: steps 5-8 see the documents of an uninterrupted 8-step run (equal losses; one process, so bitwise),
    and the resumed stream starts from the position in the checkpoint (the stream's file and record), not by
    downloading the files before it again."""
    import io

    import torch
    import torch.distributed.checkpoint as dcp

    from tests.integration.harness import TINY, losses, read_metrics
    from torchtitan.components.checkpoint import WeightsOnlyLoadPlanner, without_collectives
    from torchtitan.train import main as train_main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "long"
    (root / "data").mkdir(parents=True)
    # 16 files of 3 documents of 10-30 tokens: the 8 windows of 33 tokens of 4 steps end a few files in.
    files = [f"train-{i:05d}-of-00016.parquet" for i in range(16)]
    for i, name in enumerate(files):
        table = pa.table({"text": [f"file {i} record {j} " + " ".join(f"w{i}{j}{k}" for k in range(3 * j))
                                   for j in range(3)]})
        pq.write_table(table, root / "data" / name, row_group_size=5)
    # A constant learning rate after warmup: a 4-step launch and an 8-step one take the same steps.
    base = [*TINY, "--training.local_batch_size", "2", "--training.dataset", "hub",
            "--training.dataset_path", "org/data", "--lr_scheduler.decay_ratio", "0"]
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.no_last_save_model_only"]
    with HubServer(root) as hub:
        hub_client(hub.url)
        assert train_main([*base, "--training.steps", "8", "--job.dump_folder", str(tmp_path / "straight")]) == 0
        saved = tmp_path / "saved"
        assert train_main([*base, *checkpoint, "--training.steps", "4", "--job.dump_folder", str(saved)]) == 0
        state = {"dataloader": b""}
        with without_collectives():
            dcp.load(state, checkpoint_id=saved / "checkpoint" / "step-4", planner=WeightsOnlyLoadPlanner(),
                     no_dist=True)
        position = torch.load(io.BytesIO(state["dataloader"]), weights_only=True)["dataset_state"]
        stream_file = position["anchor_stream"]["examples_iterable"]["examples_iterable"]["examples_iterable"][
            "shard_idx"]
        assert stream_file >= 3, position
        hub.downloads.clear()
        assert train_main([*base, *checkpoint, "--training.steps", "8", "--job.dump_folder", str(saved)]) == 0
    print(f"checkpoint at stream file {stream_file}; the resumed run downloaded {hub.downloads}")
    # Opening the stream reads the first file (its schema); the stream resumes in the position's file or at the end
    # of the one before (its last batch boundary): the files between are not downloaded again.
    assert not set(files[1:stream_file - 1]) & {name for name, _ in hub.downloads}, hub.downloads
    resumed = [row for row in read_metrics(saved) if "loss" in row and row["step"] > 4]
    straight = [row for row in read_metrics(tmp_path / "straight") if "loss" in row and row["step"] > 4]
    assert [row["step"] for row in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == losses(straight)
