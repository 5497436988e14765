"""Per-step training metrics to the console, a JSON-lines file, TensorBoard and Weights & Biases."""

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.config.job_config import Metrics
from torchtitan.errors import UserError
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import console_has_color, logger

_JSONL_FILE_NAME = "metrics.jsonl"
_MIB = 2**20


def communication_metrics(now: dict[str, int], before: dict[str, int], steps: int) -> dict[str, float]:
    """The logged bytes sent (OptimizersContainer.sent_bytes: `now`, and `before` at the last log), per step since
    the last log in MiB: through the compressed collectives and FlexDeMo's exchange, with what full precision would
    have sent and the percentage (over the run); through optimizers' own exchanges (Muon's), and their part across
    data-parallel replicas; and, once a save (or a load's template) exchanged state, the MiB it sent. Keys appear only
    for what the run has."""

    def per_step(key: str) -> float:
        return (now[key] - before.get(key, 0)) / steps / _MIB

    metrics = {}
    if now["uncompressed_bytes"]:
        metrics.update(comm_sent_mib_per_step=per_step("sent_bytes"),
                       comm_full_precision_mib_per_step=per_step("uncompressed_bytes"),
                       comm_sent_pct=100 * now["sent_bytes"] / now["uncompressed_bytes"])
    if now["exchange_sent_bytes"]:
        metrics.update(optimizer_exchange_mib_per_step=per_step("exchange_sent_bytes"),
                       optimizer_exchange_across_replicas_mib_per_step=per_step("exchange_replica_bytes"))
    if now["save_sent_bytes"] > before.get("save_sent_bytes", 0):
        metrics["checkpoint_state_sent_mib"] = (now["save_sent_bytes"] - before.get("save_sent_bytes", 0)) / _MIB
    return metrics
_RESET = "\033[0m"


@dataclass(frozen=True)
class _ConsoleField:
    label: str
    render: Callable[[float], str]
    color: str


# Metric key -> how the console line shows it, in the order the line shows them.
_CONSOLE_FIELDS = {
    "loss": _ConsoleField("loss", lambda v: f"{v:7.4f}", "\033[36m"),
    "grad_norm": _ConsoleField("grad_norm", lambda v: f"{v:7.4f}", "\033[36m"),
    "lr": _ConsoleField("lr", lambda v: f"{v:.1e}", "\033[33m"),
    "memory_gib": _ConsoleField("memory", lambda v: f"{v:5.2f}GiB", "\033[33m"),
    "tps": _ConsoleField("tps", lambda v: f"{v:,.0f}", "\033[34m"),
    "tflops": _ConsoleField("tflops", lambda v: f"{v:.2f}", "\033[34m"),
    "mfu": _ConsoleField("mfu", lambda v: f"{v:.2f}%", "\033[35m"),
    "data_pct": _ConsoleField("data", lambda v: f"{v:.1f}%", "\033[32m"),
    "goodput_pct": _ConsoleField("goodput", lambda v: f"{v:.1f}%", "\033[32m"),
}
_STEP_COLOR = "\033[31m"
_OTHER_COLOR = "\033[37m"


RUN_INFO_FILE = "run.json"


def save_run_info(dump_folder: str, world_size: int, device_type: str, device: str) -> None:
    """`<dump_folder>/run.json`: what the per-device figures of metrics.jsonl were measured on (read by
    `scripts/plan.py --calibrate`)."""
    import torch

    info = {"world_size": world_size, "device_type": device_type, "device_name": device,
            "torch_version": torch.__version__}
    with atomic_write(os.path.join(dump_folder, RUN_INFO_FILE)) as f:
        f.write(json.dumps(info, indent=2) + "\n")


class MetricsLogger:
    """Sends each step's metrics to every enabled sink; create one per rank and close() it at the end.

    Keys the console line knows (any other key is appended as `key: value`): loss, grad_norm, lr,
    memory_gib (peak), tps (tokens/s per device), tflops (achieved per device), mfu (model FLOPs
    utilisation in percent, 0-100), data_pct (percent of the time spent waiting for data) and goodput_pct
    (components/health.py). Keys with a '/' (`goodput/lost_s`) are left off the console line.

    The console line and `<dump_folder>/metrics.jsonl` are written on the logging rank only;
    TensorBoard and W&B (when enabled) on the logging rank, or on every rank with
    metrics.save_for_all_ranks. In metrics.jsonl each line is `{"step": ..., "time": unix seconds,
    **metrics}`; NaN and infinities, which JSON cannot hold, are written as the strings "nan", "inf"
    and "-inf".
    """

    def __init__(
        self, config: Metrics, dump_folder: str, rank: int, is_logging_rank: bool, run_config: dict | None = None
    ):
        self._is_logging_rank = is_logging_rank
        self._colored = not config.disable_color_printing and console_has_color()
        writes_sinks = is_logging_rank or config.save_for_all_ranks
        self._jsonl_file = None
        self._tensorboard = None
        self._wandb_run = None

        if is_logging_rank:
            os.makedirs(dump_folder, exist_ok=True)
            # Line-buffered, so every record is in the file as soon as log() returns.
            self._jsonl_file = open(os.path.join(dump_folder, _JSONL_FILE_NAME), "a", buffering=1)

        if config.enable_tensorboard and writes_sinks:
            from torch.utils.tensorboard import SummaryWriter

            tensorboard_dir = os.path.join(dump_folder, config.save_tb_folder)
            if config.save_for_all_ranks:
                tensorboard_dir = os.path.join(tensorboard_dir, f"rank_{rank}")
            self._tensorboard = SummaryWriter(log_dir=tensorboard_dir)
            logger.info(f"TensorBoard metrics go to {tensorboard_dir}")

        if config.enable_wandb and writes_sinks:
            run_name = os.path.basename(os.path.abspath(dump_folder))
            if config.save_for_all_ranks:
                run_name = f"{run_name}-rank{rank}"
            self._wandb_run = _start_wandb(dump_folder, run_name, run_config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` for `step` in every sink this rank writes."""
        # 0-d tensors and numpy scalars become plain numbers, which every sink (json included) accepts.
        metrics = {key: value if isinstance(value, int) else float(value) for key, value in metrics.items()}
        if self._is_logging_rank and any("/" not in key for key in metrics):
            logger.info(self._console_line(step, metrics))
        if self._jsonl_file is not None:
            record = {"step": step, "time": time.time(), **{key: _json_safe(value) for key, value in metrics.items()}}
            self._jsonl_file.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
            # Flushed per call (calls come every metrics.log_freq steps) so a crash keeps the curves so far.
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def close(self) -> None:
        """Flush and close every sink; later calls do nothing."""
        if self._jsonl_file is not None:
            self._jsonl_file.close()
            self._jsonl_file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def _console_line(self, step: int, metrics: dict[str, float]) -> str:
        fields = [self._paint(_STEP_COLOR, f"step: {step:3d}")]
        for key, field in _CONSOLE_FIELDS.items():
            if key in metrics:
                fields.append(self._paint(field.color, f"{field.label}: {field.render(metrics[key])}"))
        for key, value in metrics.items():
            # A key with a '/' (a group, as TensorBoard shows it: goodput/data_s) is a detail for the other sinks.
            if key not in _CONSOLE_FIELDS and "/" not in key:
                rendered = f"{value:.4g}" if isinstance(value, float) else str(value)
                fields.append(self._paint(_OTHER_COLOR, f"{key}: {rendered}"))
        return "  ".join(fields)

    def _paint(self, color: str, text: str) -> str:
        return f"{color}{text}{_RESET}" if self._colored else text


def _json_safe(value: float) -> float | str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _start_wandb(dump_folder: str, run_name: str, run_config: dict | None):
    # wandb is imported only when enabled: it is slow to import and optional. It reads the API key
    # (WANDB_API_KEY) and the mode (WANDB_MODE=offline) from the environment itself.
    try:
        import wandb
    except ImportError as exc:
        raise UserError(
            f"metrics.enable_wandb is true but wandb cannot be imported ({exc}); pip install wandb or turn it off."
        ) from exc
    try:
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "torchtitan"), dir=dump_folder, config=run_config, name=run_name
        )
    except Exception as exc:
        raise UserError(
            f"metrics.enable_wandb is true but W&B failed to start ({type(exc).__name__}: {exc}). Set "
            "WANDB_API_KEY in the environment, or WANDB_MODE=offline to log without a network."
        ) from exc
    logger.info(f"W&B run {run.name} logs to {run.dir}")
    return run
