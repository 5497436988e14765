"""Time TorchTitan v0.2.2's own trainer on this CPU, at the debug shape of docs/performance.md, for the side by side.

TorchTitan's package has this project's name, so it runs from an environment of its own (and this script imports
nothing of this project):

    python3 -m venv /tmp/tt && /tmp/tt/bin/pip install torch==2.13.0 torchtitan==0.2.2 triton
    /tmp/tt/bin/python benchmarks/benchmark_torchtitan.py --ours .venv/bin/python --threads 2 --warmup 3 --steps 10 \
        --training.seq_len 512 --training.local_batch_size 4 --training.mixed_precision_param bfloat16 \
        [--compile.enable]

(`triton` only because TorchTitan 0.2.2 imports it at start-up; nothing runs on it.) Every argument after this
script's own is a trainer option, as TorchTitan's `train.py` takes it; the options above are spelled the same in
this project. With `--ours PYTHON` (this project's environment) `benchmarks/benchmark.py` runs beside it on the same
options and this project's debug model (`train_configs/debug_model.toml`), and the two take turns, one training step
each, warm-up included (`benchmarks/turns.py`): a drift of the machine's speed then slows both alike, as the
alternating steps of `--hf`/`--plain` do within one process. Printed is one JSON line: TorchTitan's median step,
and with `--ours` ours and `ratio`, TorchTitan's median step time over ours (above 1: ours is faster).

TorchTitan 0.2.2 runs on a CPU with four changes, made here before its Trainer is built and nowhere else:
- it takes CUDA when torch finds no accelerator (`device_type = _get_available_device_type() or "cuda"`): torch is
  told the CPU is the device, so TorchTitan picks `cpu`, gloo and CPU autocast by its own rules;
- its memory monitor asks `torch.cuda` for allocator statistics: a stand-in reports the process's peak RSS;
- after the first step it shortens the process groups' timeouts behind a barrier on the device's index, which the
  CPU has not: skipped (one process, nothing to wait for);
- its assets are not in its wheel: a tokenizer (BPE, the model's vocabulary of 2,304, trained with `tokenizers` on
  the Python reference that every CPython ships in `pydoc_data`) and that text as its `c4_test` dataset are built
  in a temporary folder.
Its debug flavor is given 8 KV heads and that vocabulary: the shape of this project's debug model and of the
issue's table (5,901,568 parameters in both). Activation checkpointing is off unless the arguments turn it on, as
in this project's debug model (TorchTitan's own default is selective, every second block, which recomputes half
the blocks' forward: 1.17x slower in fp32 here). Timed is TorchTitan's `train_step` (next batch, forward, backward,
clipping, optimizer, metrics) from its own `train()` loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import socket
import time
from pathlib import Path

import torch
import torch._utils as torch_utils

# Its neighbour in benchmarks/, not this project's package (which TorchTitan's environment does not have).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from turns import Turns, make_fifos  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
VOCAB_SIZE = 2304
KV_HEADS = 8


def _parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads of each process (0: torch's default)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before timing")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--ours", metavar="PYTHON",
                        help="this project's Python: also run benchmarks/benchmark.py, taking turns step by step")
    return parser.parse_known_args()


def _require_torchtitan_0_2_2() -> None:
    try:
        from importlib.metadata import version
        found = version("torchtitan")
    except Exception:
        found = None
    if found != "0.2.2":
        sys.exit(f"error: this script runs TorchTitan 0.2.2 from its own environment (found torchtitan {found}); "
                 f"create one as the module docstring says")


def _build_assets(folder: Path) -> tuple[Path, Path]:
    """A BPE tokenizer of VOCAB_SIZE tokens and a dataset of documents, from the Python reference in pydoc_data."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    documents = [topics[key] for key in sorted(topics)]
    data = folder / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for _ in range(20):  # enough tokens that the timed steps never re-read it
            for text in documents:
                f.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.train_from_iterator(documents, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assets = folder / "tokenizer"
    assets.mkdir()
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True, "add_eos_token": True}))
    return assets, data


class _RSSMonitor:
    """Stands in for TorchTitan's CUDA memory monitor: peak RSS of the process for every figure it logs."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats
        gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        return DeviceMemStats(gib, 100.0, gib, 100.0, 0, 0)

    def reset_peak_stats(self):
        pass


def _start_ours(options: argparse.Namespace, trainer_args: list[str], scratch: Path) -> tuple[subprocess.Popen, Turns]:
    """This project's benchmark on the same options, and the turns this process takes with it (it steps first)."""
    ours_fifo, torchtitan_fifo = make_fifos(scratch, "ours", "torchtitan")
    threads = ["--threads", str(options.threads)] if options.threads else []
    # A process of its own, not a rank of this one's (one-process) group.
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    with open(scratch / "ours.log", "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [options.ours, str(REPO / "benchmarks" / "benchmark.py"), "--job.config_file",
             "train_configs/debug_model.toml", *trainer_args, *threads, "--warmup", str(options.warmup),
             "--steps", str(options.steps), "--turns", f"{ours_fifo}:{torchtitan_fifo}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    turns = Turns(f"{torchtitan_fifo}:{ours_fifo}", other_alive=lambda: process.poll() is None)
    turns.pass_turn()
    return process, turns


def _ours_failed(process: subprocess.Popen, scratch: Path) -> str:
    tail = (scratch / "ours.log").read_text().splitlines()[-5:]
    return f"error: benchmarks/benchmark.py exited with {process.returncode}: " + " | ".join(tail)


def _ours_result(process: subprocess.Popen, scratch: Path) -> dict:
    out, _ = process.communicate()
    if process.returncode != 0:
        sys.exit(_ours_failed(process, scratch))
    return json.loads(out.strip().splitlines()[-1])


def _single_process_rendezvous() -> None:
    """What torchrun would set for one process, so that `python benchmarks/benchmark_torchtitan.py` runs as it is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in zip(_RENDEZVOUS, ("0", "0", "1", "127.0.0.1", str(port))):
        os.environ.setdefault(name, value)


def main() -> None:
    options, trainer_args = _parse()
    _require_torchtitan_0_2_2()
    if options.ours and not os.access(options.ours, os.X_OK):
        sys.exit(f"error: --ours {options.ours!r}: not an executable Python; give this project's, "
                 f"e.g. .venv/bin/python")
    with contextlib.redirect_stdout(sys.stderr):  # TorchTitan logs to stdout, which is for the JSON line
        result = _run(options, trainer_args)
    print(json.dumps(result), flush=True)


def _run(options: argparse.Namespace, trainer_args: list[str]) -> dict:
    if options.threads:
        torch.set_num_threads(options.threads)
    torch_utils._get_available_device_type = lambda: "cpu"
    _single_process_rendezvous()

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3 as llama3
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    metrics.build_device_memory_monitor = lambda: _RSSMonitor()
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    flavor = llama3.llama3_args["debugmodel"]
    flavor.n_kv_heads, flavor.vocab_size = KV_HEADS, VOCAB_SIZE

    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        ours, turns = _start_ours(options, trainer_args, scratch) if options.ours else (None, Turns())
        times: list[float] = []
        original_step = Trainer.train_step

        def timed_step(self, *args, **kwargs):
            with turns.turn():
                start = time.perf_counter()
                result = original_step(self, *args, **kwargs)
                times.append(time.perf_counter() - start)
            return result

        Trainer.train_step = timed_step
        try:
            assets, data = _build_assets(scratch)
            init_logger()
            config = ConfigManager().parse_args([
                "--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", str(assets),
                "--activation_checkpoint.mode", "none",
                "--training.dataset", "c4_test", "--training.dataset_path", str(data),
                "--training.steps", str(options.warmup + options.steps), "--metrics.log_freq", "5",
                "--job.dump_folder", str(scratch / "out"), *trainer_args])
            trainer = Trainer(config)
            try:
                trainer.train()
            finally:
                trainer.close()
        except BaseException:
            if ours is not None:
                if ours.poll() is not None:
                    print(_ours_failed(ours, scratch), file=sys.stderr)
                ours.kill()
            raise
        tokens = config.training.local_batch_size * config.training.seq_len
        step_s = statistics.median(times[options.warmup:])
        parameters = sum(p.numel() for p in trainer.model_parts[0].parameters())
        result = {"torchtitan": {"version": "0.2.2", "parameters": parameters,
                                 "tokens_per_s_per_device": tokens / step_s, "step_time_s": step_s,
                                 "step_times_s": times[options.warmup:]}}
        if ours is not None:
            result["ours"] = _ours_result(ours, scratch)
            result["ratio"] = step_s / result["ours"]["step_time_s"]
    return result


if __name__ == "__main__":
    main()
