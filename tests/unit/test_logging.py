"""One rank prefix per log line, whoever launched the trainer."""

import logging
import os
import sys

import pytest

from torchtitan import launch
from torchtitan.tools.logging import CONSOLE_IS_TTY_ENV, LAUNCHER_PREFIXES_RANK_ENV, init_logger, logger


def _formatted(message: str) -> str:
    record = logging.LogRecord("torchtitan", logging.INFO, __file__, 1, message, None, None)
    return logger.handlers[0].format(record)


@pytest.fixture
def restore_logger():
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def test_logger_prefixes_the_global_rank_unless_the_launcher_does(restore_logger, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(LAUNCHER_PREFIXES_RANK_ENV, raising=False)
    init_logger()
    assert _formatted("hello").startswith("[rank3] ")
    monkeypatch.setenv(LAUNCHER_PREFIXES_RANK_ENV, "1")
    init_logger()
    line = _formatted("hello")
    assert "rank" not in line and line.endswith(" INFO hello")


@pytest.mark.parametrize(("tee", "prefixed"), [("3", True), ("2", True), ("1", False), ("0", False)])
def test_launcher_owns_the_prefix_only_when_it_tees_stderr(monkeypatch, tee, prefixed):
    # launch.main sets variables for the workers in its own environment: give it a copy, dropped afterwards.
    environment = {name: value for name, value in os.environ.items() if name not in (
        LAUNCHER_PREFIXES_RANK_ENV, CONSOLE_IS_TTY_ENV, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")}
    monkeypatch.setattr(os, "environ", environment)
    seen = {}
    monkeypatch.setattr(launch, "run", lambda args: seen.update(os.environ))
    assert launch.main(["--nproc_per_node", "2", "--tee", tee, "-m", "torchtitan.train"]) == 0
    if prefixed:
        assert seen["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}] "
        assert seen[LAUNCHER_PREFIXES_RANK_ENV] == "1"
        assert seen[CONSOLE_IS_TTY_ENV] == ("1" if sys.stderr.isatty() else "0")
    else:
        assert LAUNCHER_PREFIXES_RANK_ENV not in seen and "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" not in seen


def test_launcher_exits_with_the_code_of_the_rank_that_stopped_itself(monkeypatch, tmp_path, capsys):
    """Rank 1 refuses the configuration (exit 2) before rank 0 does, and torchrun SIGTERMs rank 0: the launcher's
    code is rank 1's, the refusal's, not the signal's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    no_error_file = str(tmp_path / "none")
    failures = {0: ProcessFailure(0, 100, -15, no_error_file), 1: ProcessFailure(1, 101, 2, no_error_file)}

    def run(args):
        raise ChildFailedError("torchtitan.train", failures)
    monkeypatch.setattr(launch, "run", run)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert launch.main(["--nproc_per_node", "2", "-m", "torchtitan.train"]) == 2
    assert "rank 1 exited with code 2" in capsys.readouterr().err


def _passes(logger_name: str, message: str, *args) -> bool:
    record = logging.LogRecord(logger_name, logging.WARNING, __file__, 1, message, args or None, None)
    return bool(logging.getLogger(logger_name).filter(record))


def test_known_third_party_import_noise_is_filtered_and_nothing_else(monkeypatch):
    import enum

    import torch

    class KernelPreference(enum.Enum):
        AUTO = "auto"

    KernelPreference.__module__ = "torchao.quantization.quantize_.common.kernel_preference"

    class Other(enum.Enum):
        X = 1

    so_file = "Failed to load /venv/torchao/_C_cutlass_90a.abi3.so: Could not load this library"
    enum_notice = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not _passes("torchao", so_file)
    assert not _passes("torch.utils._pytree", enum_notice, KernelPreference)
    assert _passes("torch.utils._pytree", enum_notice, Other)  # someone else's registration: theirs to see
    assert _passes("torchao", "Skipping import of cpp extensions due to incompatible torch version.")
    # On a CUDA build of torch the kernels should load: a failure there is real and stays in the log.
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert _passes("torchao", so_file)
