"""With `training.dataset_loop = false` the run stops at the data's last full batch, on every rank: a short final
batch would train with other weights than every other step (and under pipeline parallelism the first stage cannot
split it into micro-batches while the other stages wait for it)."""

from pathlib import Path

import pytest

from tests.integration.harness import TINY, launch, losses, read_metrics
from torchtitan import train
from torchtitan.components.datasets import build_dataloader
from torchtitan.components.tokenizer import build_model_tokenizer
from torchtitan.config import parse_args

pytestmark = pytest.mark.integration

LOCAL_BATCH = 4


def short_data(tmp_path: Path) -> tuple[list[str], int]:
    """Trainer options over a data file whose last batch is short, and the number of full batches in it."""
    for documents in range(6, 40):
        path = tmp_path / f"data{documents}.jsonl"
        path.write_text("".join(f'{{"text": "document {i} tells a short story about the number {i * 7}"}}\n'
                                for i in range(documents)))
        args = [*TINY, "--training.dataset_path", str(path), "--training.no_dataset_loop",
                "--training.local_batch_size", str(LOCAL_BATCH), "--training.steps", "100",
                "--metrics.peak_flops", "1e12"]
        config = parse_args(args)
        loader = build_dataloader(dataset=config.training.dataset, dataset_path=str(path),
                                  text_field=config.training.dataset_text_field,
                                  tokenizer=build_model_tokenizer(config.model), seq_len=config.training.seq_len,
                                  local_batch_size=LOCAL_BATCH, dp_rank=0, dp_degree=1, infinite=False)
        sizes = [inputs.shape[0] for inputs, _ in loader]
        if sizes[-1] < LOCAL_BATCH and len(sizes) >= 3:
            return args, len(sizes) - 1
    raise AssertionError("no data size gave a short last batch")


def assert_stopped_after_last_full_batch(output: str, dump: Path, full_batches: int) -> None:
    assert f"the data ran out at step {full_batches + 1} " in output, output[-4000:]
    assert len(losses(read_metrics(dump))) == full_batches


def test_without_pipeline_parallelism(tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args, full_batches = short_data(tmp_path)
    code = train.main([*args, "--job.dump_folder", str(tmp_path / "dump")])
    captured = capsys.readouterr()
    assert code == train.EXIT_USER_ERROR, captured.out[-4000:]
    assert_stopped_after_last_full_batch(captured.out + captured.err, tmp_path / "dump", full_batches)
    assert "Traceback" not in captured.out + captured.err


def test_under_pipeline_parallelism(tmp_path):
    args, full_batches = short_data(tmp_path)
    proc = launch(tmp_path / "dump", 2, [*args, "--parallelism.pipeline_parallel_degree", "2"], timeout=180)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stdout, proc.stdout[-4000:]
    assert_stopped_after_last_full_batch(proc.stdout, tmp_path / "dump", full_batches)
    # Both stages stop with the same error, neither waits for the other.
    assert proc.stdout.count("ERROR error: option training.dataset_loop: the data ran out") == 2
