"""scripts/compare_runs.py on dump folders written by the test: metrics.jsonl and TensorBoard event files."""

import json
import math

import pytest
from matplotlib import image

from scripts import compare_runs
from tests.integration.harness import TINY

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss_vs_step.png", "loss_vs_tokens.png", "throughput.png")
START = 1_700_000_000.0
TOKENS_PER_STEP = 1024


def training_rows(losses, tps=(50.0, 1000.0, 1200.0, 1400.0, 1600.0), mfu=(1.0, 10.0, 12.0, 14.0, 16.0),
                  memory=(1.0, 2.5, 2.0, 2.0, 2.0)):
    """Five logged steps, 10 s apart; step 1's throughput is low, as a warm-up step's is."""
    return [{"step": step, "time": START + 10 * (step - 1), "loss": loss, "grad_norm": 1.0, "lr": 1e-3,
             "tps": tps[step - 1], "tflops": 0.1, "mfu": mfu[step - 1], "memory_gib": memory[step - 1],
             "data_pct": 0.5, "tokens_seen": TOKENS_PER_STEP * step, "model_state_gib": 0.1,
             "optimizer_state_gib": 0.05}
            for step, loss in enumerate(losses, start=1)]


def write_jsonl(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def write_tensorboard(folder, rows):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder / "tb"))
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time"):
                writer.add_scalar(key, value, row["step"], walltime=row["time"])
    writer.close()
    return folder


LOSSES = [8.0, 7.0, 6.0, 6.5, 5.5]


@pytest.fixture
def jsonl_run(tmp_path):
    rows = training_rows(LOSSES)
    rows.append({"step": 5, "time": START + 41, "validation_loss": 5.75, "validation_perplexity": math.exp(5.75)})
    return write_jsonl(tmp_path / "jsonl_run", rows)


@pytest.fixture
def tensorboard_run(tmp_path):
    rows = training_rows([8.0, 7.5, 7.0, 6.8, 6.6], tps=(10.0, 400.0, 500.0, 600.0, 700.0))
    return write_tensorboard(tmp_path / "tb_run", rows)


def table_rows(out, table: int = 0):
    """comparison.md's `table`-th table (0: the summary, 1: the goodput) as {run label: {column: cell}}."""
    tables = (out / "comparison.md").read_text().split("\n\n")
    lines = [[line for line in block.splitlines() if line.startswith("|")] for block in tables]
    lines = [block for block in lines if block][table]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row)) for row in rows}


def test_table_from_jsonl_and_tensorboard(tmp_path, jsonl_run, tensorboard_run, capsys):
    out = tmp_path / "out"
    assert compare_runs.main([str(jsonl_run), str(tensorboard_run), "--out", str(out), "--labels", "a,b"]) == 0
    rows = table_rows(out)
    assert list(rows) == ["a", "b"]
    # Loss changes -1, -1, 0.5, -1: mean -0.625, variance 0.421875.
    assert rows["a"] == {"run": "a", "steps": "5", "final loss": "5.5000", "best loss": "5.5000",
                         "loss change variance": "4.22e-01", "final validation loss": "5.7500",
                         "best validation loss": "5.7500", "mean tokens/s": "1,300", "mean MFU %": "13.00",
                         "peak memory GiB": "2.50", "optimizer state MiB": "51.20", "wall time s": "41.0",
                         "goodput %": "n/a"}
    # From TensorBoard: no validation, throughput without step 1, wall time from the events' times.
    assert rows["b"] == {"run": "b", "steps": "5", "final loss": "6.6000", "best loss": "6.6000",
                         "loss change variance": "2.25e-02", "final validation loss": "n/a",
                         "best validation loss": "n/a", "mean tokens/s": "550", "mean MFU %": "13.00",
                         "peak memory GiB": "2.50", "optimizer state MiB": "51.20", "wall time s": "40.0",
                         "goodput %": "n/a"}
    assert (out / "comparison.md").read_text() in capsys.readouterr().out
    assert "Where the time went" not in (out / "comparison.md").read_text()  # no run has a goodput account


def test_goodput_from_run_records_or_the_last_logged_metrics(tmp_path):
    """A folder with run records (a crash at step 7 after a save at step 4, a restart 20 s later) shows the whole
    job's account; a folder without them, the goodput metrics of its last logged step."""
    from torchtitan.components.health import RunRecord

    crashed = write_jsonl(tmp_path / "crashed", training_rows(LOSSES))
    (crashed / "health").mkdir()
    seconds = {"productive": 7.0, "startup": 10.0, "checkpoint": 0.0, "data": 0.0, "validation": 0.0, "skipped": 0.0,
               "other": 0.0}
    runs = [RunRecord(0.0, 17.0, 0, 7, seconds, {4: 4.0}, ""),
            RunRecord(37.0, 50.0, 4, 10, {**seconds, "productive": 6.0, "startup": 5.0, "other": 2.0}, {}, "finished")]
    for number, record in enumerate(runs):
        (crashed / "health" / f"run-{record.start:.3f}-{number}.json").write_text(json.dumps(record.__dict__))
    logged = training_rows(LOSSES)
    logged[-1].update({"goodput_pct": 80.0, "goodput/wall_s": 10.0, "goodput/productive_s": 8.0,
                       "goodput/startup_s": 2.0, "goodput/lost_steps": 0})
    clean = write_jsonl(tmp_path / "clean", logged)
    out = tmp_path / "out"
    assert compare_runs.main([str(crashed), str(clean), "--out", str(out)]) == 0
    assert table_rows(out)["crashed"]["goodput %"] == "20.0"  # (7 + 6 - 3 lost) of 50 s
    rows = table_rows(out, table=1)
    assert rows["crashed"] == {"run": "crashed", "goodput %": "20.0", "wall s": "50.0", "productive s": "10.0",
                               "start-up + compile s": "10.0", "checkpoint s": "0.0", "data s": "0.0",
                               "validation s": "0.0", "skipped steps s": "0.0", "quorum wait s": "0.0",
                               "lost work s": "3.0",
                               "restart s": "25.0", "other s": "2.0", "steps redone": "3"}
    assert (rows["clean"]["goodput %"], rows["clean"]["start-up + compile s"],
            rows["clean"]["data s"]) == ("80.0", "2.0", "n/a")


def test_plots_are_valid_pngs(tmp_path, jsonl_run, tensorboard_run):
    out = tmp_path / "out"
    assert compare_runs.main([str(jsonl_run), str(tensorboard_run), "--out", str(out)]) == 0
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        height, width, _ = image.imread(out / name).shape
        assert height > 100 and width > 100, name


def test_nonfinite_losses_are_read_and_compared(tmp_path, capsys):
    rows = training_rows(LOSSES)
    rows[2]["loss"] = "nan"
    rows[4]["loss"] = "inf"
    folders = [str(write_jsonl(tmp_path / name, rows)) for name in ("diverged", "diverged_too")]
    # Default labels: the folder names. Runs that diverge alike agree, even at tolerance 0.
    assert compare_runs.main([*folders, "--out", str(tmp_path / "out"), "--assert-close", "0"]) == 0
    assert "losses agree" in capsys.readouterr().out
    row = table_rows(tmp_path / "out")["diverged"]
    assert (row["final loss"], row["best loss"]) == ("inf", "6.5000")


def test_resumed_run_keeps_the_latest_record_of_a_step(tmp_path):
    rows = training_rows(LOSSES)
    # Resumed from a checkpoint of step 3: steps 4 and 5 are logged again, with other losses.
    rows += [{**row, "time": row["time"] + 100, "loss": row["loss"] - 1} for row in rows[3:]]
    folder = write_jsonl(tmp_path / "resumed", rows)
    run = compare_runs.read_run(folder, "resumed")
    assert run.points("loss") == [(1, 8.0), (2, 7.0), (3, 6.0), (4, 5.5), (5, 4.5)]


def test_assert_close_passes_within_tolerance(tmp_path, jsonl_run, capsys):
    close = write_jsonl(tmp_path / "close", training_rows([loss * (1 + 5e-6) for loss in LOSSES]))
    code = compare_runs.main([str(jsonl_run), str(close), "--out", str(tmp_path / "out"), "--assert-close", "1e-5"])
    assert code == 0
    assert "losses agree" in capsys.readouterr().out


def test_assert_close_names_the_first_differing_step(tmp_path, jsonl_run, capsys):
    losses = list(LOSSES)
    losses[2] *= 1.001
    losses[4] *= 1.1
    other = write_jsonl(tmp_path / "other", training_rows(losses))
    code = compare_runs.main([str(jsonl_run), str(other), "--out", str(tmp_path / "out"), "--assert-close", "1e-4"])
    assert code == 1
    err = capsys.readouterr().err
    assert "step 3:" in err and "run other" in err and "run jsonl_run" in err
    assert "step 5" not in err


def test_assert_close_fails_when_a_run_lacks_steps(tmp_path, jsonl_run, capsys):
    short = write_jsonl(tmp_path / "short", training_rows(LOSSES[:4]))
    code = compare_runs.main([str(jsonl_run), str(short), "--out", str(tmp_path / "out"), "--assert-close", "0.5"])
    assert code == 1
    assert "step 5: run jsonl_run logged a loss, run short did not" in capsys.readouterr().err


@pytest.mark.parametrize("case,expected", [
    ("missing", "does not exist"),
    ("empty", "has no metrics.jsonl and no TensorBoard event files"),
    ("labels", "--labels: 3 label(s)"),
    ("launch_config", "config file nowhere.toml does not exist"),
    ("launch_syntax", "expected \"LABEL=CONFIG.toml"),
    ("single_assert", "give at least two runs"),
    ("duplicate_label", "x used twice"),
    ("empty_label", "has an empty label"),
    ("no_loss", "holds no training loss"),
    ("bad_line", "line 2: not a metrics record"),
])
def test_errors(tmp_path, jsonl_run, capsys, case, expected):
    out = ["--out", str(tmp_path / "out")]
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "validation_only", [{"step": 1, "time": START, "validation_loss": 3.0}])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text(json.dumps(training_rows(LOSSES)[0]) + "\n{truncated\n")
    argv = {
        "missing": [str(tmp_path / "nowhere")],
        "empty": [str(tmp_path / "empty")],
        "labels": [str(jsonl_run), "--labels", "a,b,c"],
        "launch_config": ["--launch", "x=nowhere.toml"],
        "launch_syntax": ["--launch", "--training.steps 3"],
        "single_assert": [str(jsonl_run), "--assert-close", "1e-5"],
        "duplicate_label": [str(jsonl_run), "--labels", "x", "--launch", "x=train_configs/debug_model.toml"],
        "empty_label": [str(jsonl_run), str(jsonl_run), "--labels", "a,"],
        "no_loss": [str(tmp_path / "validation_only")],
        "bad_line": [str(tmp_path / "bad")],
    }[case]
    assert compare_runs.main(argv + out) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "out" / "comparison.md").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_launch_trains_the_recipe_into_out(tmp_path, capsys):
    recipe = " ".join(["train_configs/debug_model.toml", *TINY, "--training.steps", "3"])
    out = tmp_path / "out"
    assert compare_runs.main(["--out", str(out), "--launch", f"tiny={recipe}"]) == 0, capsys.readouterr().err
    assert table_rows(out)["tiny"]["steps"] == "3"
    assert (out / "tiny" / "train.log").is_file()
    # The trainer saved the resolved config of the launched recipe: the overrides reached it.
    assert 'flavor = "tiny"' in (out / "tiny" / "config.toml").read_text()
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)
