"""Time TorchTitan v0.2.2's own trainer beside this project's, the two taking turns step by step: one recipe on this
CPU at the debug shape, or `--recipes` on one GPU at the 8B shape (docs/performance.md).

TorchTitan's package has this project's name, so it runs from an environment of its own (and this script imports
nothing of this project). On this CPU:

    python3 -m venv /tmp/tt && /tmp/tt/bin/pip install torch==2.13.0 torchtitan==0.2.2 triton
    /tmp/tt/bin/python benchmarks/benchmark_torchtitan.py --ours .venv/bin/python --threads 2 --warmup 3 --steps 10 \
        --training.seq_len 512 --training.local_batch_size 4 --training.mixed_precision_param bfloat16 \
        [--compile.enable]

(`triton` only because TorchTitan 0.2.2 imports it at start-up; nothing runs on it.) On a GPU machine, whose image
has torch but neither TorchTitan nor some of either trainer's dependencies, from wheels carried there
(`benchmarks/gpu_carry.py`; `scripts/run_gpu_checks.sh` does all of this):

    python3 benchmarks/gpu_carry.py install /tmp/gpu_carry
    PYTHONPATH=/tmp/gpu_carry/torchtitan:/tmp/gpu_carry/deps python3 benchmarks/benchmark_torchtitan.py \
        --recipes all --ours python3 --output side_by_side.json

Why 0.2.2 and not 0.3.0: TorchTitan 0.3.0 needs a torch newer than 2.11, the GPU image's (its trainer imports
`torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 lacks; its README asks for a nightly), and a CUDA
torch does not fit the 64 MiB that travel to the GPU machine. 0.2.2 is the newest release that runs on torch 2.11.

One recipe: every argument after this script's own is a trainer option, as TorchTitan's `train.py` takes it; the
options above are spelled the same in this project. With `--ours PYTHON` (this project's environment)
`benchmarks/benchmark.py` runs beside it on the same options and this project's debug model
(`train_configs/debug_model.toml`). Both warm up at once (`--warmup` steps each: compilation, allocator growth);
when both are done, they take turns, one training step each, ours first (`benchmarks/turns.py`): a drift of the
machine's speed then slows both alike, as the alternating steps of `--hf`/`--plain` do within one process. On a GPU
each timed step ends with the device idle (ours reads its loss; TorchTitan's is followed by a synchronize), so no
step of one overlaps a step of the other. Printed is one JSON line: TorchTitan's median step and tokens/s, its peak
memory over the timed steps (on a GPU the caching allocator's peak reserved and allocated bytes, as ours reports
them; on the CPU the peak RSS), and with `--ours` ours, `ratio` (TorchTitan's median step time over ours: above 1,
ours is faster) and both MFUs by one convention: FLOPs per token 6 x the parameters outside the embedding plus
12 x layers x heads x head dim x sequence length (the full attention square), this project's and TorchTitan's
count alike, computed here from TorchTitan's model and checked against ours' (the two models must be the same),
over the peak ours reports (on NVIDIA GPUs the datasheet's dense bf16 figure, also for Float8 recipes).

`--recipes all` (or names, comma-separated) runs the recipes of docs/performance.md one after another, each as a
pair of fresh processes (one invocation of this script's one-recipe form), at one shape: `--flavor` (8B),
`--n_layers` (auto: as many blocks as fit two trainers on the GPU), `--seq_len` (8,192), `--local_batch_size` (1),
bf16 autocast:
- bf16_eager: no compile, no activation checkpointing;
- compile: each block and the loss compiled (both trainers' default components);
- compile_float8: and Float8 on the blocks' linear layers (tensorwise scaling, torchao; the output layer stays bf16,
  as both trainers' 8B configurations have it);
- compile_float8_sac: and selective activation checkpointing by op (TorchTitan's policy, which ours follows).
On the CPU, Float8 is emulated and its recipes run eagerly (TorchTitan 0.2.2 refuses emulated Float8 under
compile): a check of the plumbing, not a measurement. The recipes share `--time_limit` (each gets what is left over
the recipes left); the JSON line, also written to `--output` after every recipe so that a run cut short keeps what
it measured, holds each recipe's ratio, tokens/s, MFU and peak memory, or the error that stopped it.

`--n_layers auto`: an 8B block at 8,192 tokens per step, bf16 eager without activation checkpointing (the recipes'
largest), takes 5.52 GiB by `scripts/estimate_memory.py` (parameters, Adam's moments, autocast's bf16 weights,
activations, the allocator's reserve), and 1.37 GiB goes beside the blocks (embedding, output layer, CUDA context);
the two trainers together are given 90% of the GPU: 6 blocks on an 80 GB H100, 11 on a 141 GB H200.

TorchTitan 0.2.2 runs on a CPU with three changes, made here before its Trainer is built and nowhere else:
- it takes CUDA when torch finds no accelerator (`device_type = _get_available_device_type() or "cuda"`): torch is
  told the CPU is the device, so TorchTitan picks `cpu`, gloo and CPU autocast by its own rules;
- its memory monitor asks `torch.cuda` for allocator statistics: a stand-in reports the process's peak RSS;
- after the first step it shortens the process groups' timeouts behind a barrier on the device's index, which the
  CPU has not: skipped (one process, nothing to wait for).
On either device its assets are not in its wheel: a tokenizer (BPE, the model's vocabulary of 2,304, trained with
`tokenizers` on the Python reference that every CPython ships in `pydoc_data`) and that text as its `c4_test`
dataset are built in a temporary folder. Its flavor is given that vocabulary (ours takes its tokenizer's, also
2,304), `--n_layers` blocks, and for the debug flavor 8 KV heads: the shape of this project's debug model (5,901,568
parameters in both). Activation checkpointing is off unless the arguments turn it on, as in this project's debug
model (TorchTitan's own default is selective, every second block, which recomputes half the blocks' forward: 1.17x
slower in fp32 here). TorchTitan logs its metrics at its first step only (ours' benchmark logs none). Timed is
TorchTitan's `train_step` (next batch, forward, backward, clipping, optimizer) from its own `train()` loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._utils as torch_utils

# Its neighbour in benchmarks/, not this project's package (which TorchTitan's environment does not have).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from turns import Turns, make_fifos  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TORCHTITAN_VERSION = "0.2.2"
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
VOCAB_SIZE = 2304
KV_HEADS = 8
GIB = 2 ** 30
MFU_CONVENTION = ("FLOPs per token = 6 x parameters outside the embedding + 12 x layers x heads x head_dim x "
                  "seq_len (full attention square), over ours' peak (datasheet dense bf16 on NVIDIA GPUs)")
# --n_layers auto (8B blocks, 8,192 tokens per step, bf16 eager without AC): scripts/estimate_memory.py's device
# totals for 2-8 blocks are 1.37 + 5.52 x blocks GiB; the two trainers together get this share of the GPU.
AUTO_SHAPE = ("8B", 8192)
AUTO_GIB_PER_BLOCK = 5.52
AUTO_GIB_BESIDE_BLOCKS = 1.37
AUTO_GPU_SHARE = 0.9


@dataclass(frozen=True)
class Recipe:
    compile: bool
    float8: bool
    selective_ac: bool

    def options(self, cuda: bool) -> list[str]:
        """The trainer options of this recipe, the same for both trainers. On the CPU, Float8 is emulated and runs
        eagerly: TorchTitan 0.2.2 refuses emulated Float8 under compile."""
        options = ["--training.mixed_precision_param", "bfloat16",
                   "--activation_checkpoint.mode", "selective" if self.selective_ac else "none"]
        if self.selective_ac:
            options += ["--activation_checkpoint.selective_ac_option", "op"]
        if self.float8:
            options += ["--model.converters", "quantize.linear.float8",
                        "--quantize.linear.float8.filter_fqns", "output",
                        *([] if cuda else ["--quantize.linear.float8.emulate"])]
        if self.compile and (cuda or not self.float8):
            options.append("--compile.enable")
        return options


RECIPES = {
    "bf16_eager": Recipe(compile=False, float8=False, selective_ac=False),
    "compile": Recipe(compile=True, float8=False, selective_ac=False),
    "compile_float8": Recipe(compile=True, float8=True, selective_ac=False),
    "compile_float8_sac": Recipe(compile=True, float8=True, selective_ac=True),
}


def _parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads of each process (0: torch's default)")
    parser.add_argument("--warmup", type=int, default=3, help="steps each trainer runs before timing (at least 1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each trainer")
    parser.add_argument("--ours", metavar="PYTHON",
                        help="this project's Python: also run benchmarks/benchmark.py, taking turns step by step")
    parser.add_argument("--n_layers", help="blocks of the flavor (default: its own; with --recipes: auto, as "
                                           "many as fit two trainers on the GPU)")
    recipes = parser.add_argument_group("--recipes: the side by side of docs/performance.md, one recipe after another")
    recipes.add_argument("--recipes", help=f"'all' or some of {','.join(RECIPES)}")
    recipes.add_argument("--flavor", default="8B", help="the recipes' model flavor (default 8B)")
    recipes.add_argument("--seq_len", type=int, default=8192, help="default 8192")
    recipes.add_argument("--local_batch_size", type=int, default=1, help="default 1")
    recipes.add_argument("--time_limit", type=float, default=520.0,
                         help="seconds for all the recipes together (each gets what is left / recipes left)")
    recipes.add_argument("--output", type=Path, help="the JSON line is also written here, after every recipe")
    options, trainer_args = parser.parse_known_args(argv)
    if options.warmup < 1 or options.steps < 1:
        sys.exit("error: --warmup and --steps must be at least 1 (the first step compiles and allocates)")
    if options.ours:
        found = shutil.which(options.ours)
        if found is None:
            sys.exit(f"error: --ours {options.ours!r}: not an executable Python; give this project's, "
                     f"e.g. .venv/bin/python")
        options.ours = os.path.abspath(found)  # ours runs in the repository's root (not resolved: a venv's link)
    if options.recipes:
        if not options.ours:
            sys.exit("error: --recipes compares the two trainers: give this project's Python with --ours")
        names = list(RECIPES) if options.recipes == "all" else options.recipes.split(",")
        unknown = [name for name in names if name not in RECIPES]
        if unknown:
            sys.exit(f"error: --recipes {options.recipes!r}: unknown {unknown}; use 'all' or some of "
                     f"{','.join(RECIPES)}")
        options.recipes = names
        options.n_layers = options.n_layers or "auto"
    if options.n_layers not in (None, "auto") and not (options.n_layers.isdigit() and int(options.n_layers) > 0):
        sys.exit(f"error: --n_layers {options.n_layers!r}: a positive number of blocks, or auto")
    return options, trainer_args


def _require_torchtitan_0_2_2() -> None:
    try:
        from importlib.metadata import version
        found = version("torchtitan")
    except Exception:
        found = None
    if found != TORCHTITAN_VERSION:
        sys.exit(f"error: this script runs TorchTitan {TORCHTITAN_VERSION} from its own environment (found "
                 f"torchtitan {found}); create one as the module docstring says")


def blocks_that_fit(gpu_bytes: int, flavor: str, tokens_per_step: int) -> int:
    """--n_layers auto: the most blocks of the 8B shape with which two trainers fit in AUTO_GPU_SHARE of the GPU."""
    if (flavor, tokens_per_step) != AUTO_SHAPE:
        sys.exit(f"error: --n_layers auto is sized for the {AUTO_SHAPE[0]} flavor at {AUTO_SHAPE[1]:,} tokens per "
                 f"step (seq_len x local_batch_size), not {flavor} at {tokens_per_step:,}: give a number of blocks")
    per_trainer_gib = AUTO_GPU_SHARE * gpu_bytes / GIB / 2
    blocks = int((per_trainer_gib - AUTO_GIB_BESIDE_BLOCKS) // AUTO_GIB_PER_BLOCK)
    if blocks < 1:
        sys.exit(f"error: --n_layers auto: two trainers of even one {flavor} block do not fit in "
                 f"{gpu_bytes / GIB:.1f} GiB")
    return blocks


def flops_per_token(model: torch.nn.Module, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """The one FLOP convention of MFU_CONVENTION (this project's `flops_per_token`, TorchTitan's count alike)."""
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    outside_embedding = sum(p.numel() for p in model.parameters()) - embedding
    return 6 * outside_embedding + 12 * n_layers * n_heads * head_dim * seq_len


def compare(torchtitan: dict, ours: dict, tokens_per_step: int) -> dict:
    """Both trainers' MFU by one convention, over ours' peak, and the ratio; the two models must be the same (the
    FLOPs per token that ours' MFU implies equal TorchTitan's count)."""
    peak = ours["peak"]["tflops"] * 1e12
    flops = torchtitan["flops_per_token"]
    ours_flops = ours["mfu_pct"] / 100 * peak / ours["tokens_per_s_per_device"]
    if round(ours_flops) != flops:  # integers, apart by 6 a parameter
        raise ValueError(f"the two models differ: ours does {ours_flops:,.0f} FLOPs per token, TorchTitan "
                         f"{flops:,} (give both the same shape)")
    torchtitan["mfu_pct"] = 100 * flops * torchtitan["tokens_per_s_per_device"] / peak
    step_s = tokens_per_step / torchtitan["tokens_per_s_per_device"]
    return {"ratio": step_s / ours["step_time_s"], "mfu_convention": MFU_CONVENTION,
            "peak_tflops": ours["peak"]["tflops"], "peak_source": ours["peak"]["source"]}


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
    """Stands in for TorchTitan's CUDA memory monitor on the CPU: peak RSS of the process for every figure it logs."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats
        gib = _peak_rss_gib()
        return DeviceMemStats(gib, 100.0, gib, 100.0, 0, 0)

    def reset_peak_stats(self):
        pass


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def ours_environment() -> dict[str, str]:
    """Ours' environment: this one's, less the rendezvous (ours is a process of its own, not a rank of this
    one-process group) and less the PYTHONPATH entry that holds TorchTitan's package (which has this project's
    name; the rest, carried dependencies, serves both)."""
    import torchtitan

    torchtitan_root = Path(torchtitan.__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != torchtitan_root]
    env.pop("PYTHONPATH", None)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _start_ours(options: argparse.Namespace, trainer_args: list[str], scratch: Path) -> tuple[subprocess.Popen, Turns]:
    """This project's benchmark on the same options, and the turns this process takes with it: its warm-up steps
    are given their turns at once, so that both warm up together."""
    ours_fifo, torchtitan_fifo = make_fifos(scratch, "ours", "torchtitan")
    threads = ["--threads", str(options.threads)] if options.threads else []
    with open(scratch / "ours.log", "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [options.ours, str(REPO / "benchmarks" / "benchmark.py"), "--job.config_file",
             "train_configs/debug_model.toml", *trainer_args, *threads, "--warmup", str(options.warmup),
             "--steps", str(options.steps), "--turns", f"{ours_fifo}:{torchtitan_fifo}"],
            cwd=REPO, env=ours_environment(), stdout=subprocess.PIPE, stderr=log, text=True)
    turns = Turns(f"{torchtitan_fifo}:{ours_fifo}", other_alive=lambda: process.poll() is None)
    for _ in range(options.warmup):
        turns.pass_turn()
    return process, turns


def _ours_failed(process: subprocess.Popen, scratch: Path) -> str:
    tail = (scratch / "ours.log").read_text().splitlines()[-5:]
    return f"error: benchmarks/benchmark.py exited with {process.returncode}: " + " | ".join(tail)


def _ours_result(process: subprocess.Popen, scratch: Path) -> dict:
    out, _ = process.communicate()
    if process.returncode != 0:
        sys.exit(_ours_failed(process, scratch))
    print(f"--- benchmarks/benchmark.py's log ---\n{(scratch / 'ours.log').read_text()}--- end of its log ---",
          file=sys.stderr)
    return json.loads(out.strip().splitlines()[-1])


def _single_process_rendezvous() -> None:
    """What torchrun would set for one process, so that `python benchmarks/benchmark_torchtitan.py` runs as it is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in zip(_RENDEZVOUS, ("0", "0", "1", "127.0.0.1", str(port))):
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> None:
    options, trainer_args = _parse(argv)
    _require_torchtitan_0_2_2()
    # Both trainers' allocator settings (this project's default, TorchTitan's run_train.sh's), before CUDA starts.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with contextlib.redirect_stdout(sys.stderr):  # TorchTitan logs to stdout, which is for the JSON line
        result = side_by_side(options, trainer_args) if options.recipes else _run(options, trainer_args)
    print(json.dumps(result), flush=True)


def _timed_train_step(original_step, warmup: int, turns: Turns, cuda: bool, times: list[float]):
    """TorchTitan's train_step, warm-up steps free; then both trainers meet (ours' warm-up steps each passed a
    turn back), and every later step is timed in its turn, the device idle at its end."""
    calls = 0

    def step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls <= warmup:
            result = original_step(self, *args, **kwargs)
            if calls == warmup:
                if cuda:
                    torch.cuda.synchronize()
                for _ in range(warmup):
                    turns.wait()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                turns.pass_turn()  # ours steps first
            return result
        with turns.turn():
            start = time.perf_counter()
            result = original_step(self, *args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return result

    return step


def _run(options: argparse.Namespace, trainer_args: list[str]) -> dict:
    cuda = torch.cuda.is_available()
    if options.threads:
        torch.set_num_threads(options.threads)
    if not cuda:
        torch_utils._get_available_device_type = lambda: "cpu"
    _single_process_rendezvous()

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3 as llama3
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    if not cuda:
        metrics.build_device_memory_monitor = lambda: _RSSMonitor()
        dist_utils.set_pg_timeouts = lambda *args, **kwargs: None

    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        assets, data = _build_assets(scratch)
        init_logger()
        total_steps = options.warmup + options.steps
        config = ConfigManager().parse_args([
            "--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", str(assets),
            "--activation_checkpoint.mode", "none",
            "--training.dataset", "c4_test", "--training.dataset_path", str(data),
            "--training.steps", str(total_steps), "--metrics.log_freq", str(total_steps + 1),
            "--job.dump_folder", str(scratch / "out"), *trainer_args])
        flavor = llama3.llama3_args[config.model.flavor]
        tokens_per_step = config.training.local_batch_size * config.training.seq_len
        if options.n_layers == "auto":
            if not cuda:
                sys.exit("error: --n_layers auto sizes the model to a GPU's memory; on the CPU give a number")
            flavor.n_layers = blocks_that_fit(torch.cuda.get_device_properties(0).total_memory,
                                              config.model.flavor, tokens_per_step)
        elif options.n_layers:
            flavor.n_layers = int(options.n_layers)
        flavor.vocab_size = VOCAB_SIZE
        if config.model.flavor == "debugmodel":
            flavor.n_kv_heads = KV_HEADS

        ours_args = [*trainer_args, "--model.n_layers", str(flavor.n_layers)] if options.n_layers else trainer_args
        ours, turns = _start_ours(options, ours_args, scratch) if options.ours else (None, Turns())
        times: list[float] = []
        original_step = Trainer.train_step
        Trainer.train_step = _timed_train_step(original_step, options.warmup, turns, cuda, times)
        try:
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
        finally:
            Trainer.train_step = original_step
        step_s = statistics.median(times)
        model = trainer.model_parts[0]
        torchtitan = {
            "version": TORCHTITAN_VERSION, "parameters": sum(p.numel() for p in model.parameters()),
            "flops_per_token": flops_per_token(model, flavor.n_layers, flavor.n_heads, flavor.dim // flavor.n_heads,
                                               config.training.seq_len),
            "tokens_per_s_per_device": tokens_per_step / step_s, "step_time_s": step_s, "step_times_s": times,
            **_peak_memory(cuda),
        }
        result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                  "n_layers": flavor.n_layers, "torchtitan": torchtitan}
        if ours is not None:
            result["ours"] = _ours_result(ours, scratch)
            try:
                result.update(compare(torchtitan, result["ours"], tokens_per_step))
            except ValueError as e:
                sys.exit(f"error: {e}")
    return result


def _peak_memory(cuda: bool) -> dict:
    """Over the timed steps, as ours' benchmark reports it (its keys)."""
    if cuda:
        return {"peak_memory_gib": torch.cuda.max_memory_reserved() / GIB,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "memory_kind": "CUDA caching allocator: peak reserved (and allocated) bytes"}
    return {"peak_memory_gib": _peak_rss_gib(), "memory_kind": "peak RSS of the process (the whole run)"}


def summarize(one_recipe: dict) -> tuple[dict, dict]:
    """One recipe's JSON line, split into what all recipes share (device, shape, FLOPs) and what the side by side
    keeps of this recipe (the peak MFU is over too: on a CPU each run measures its own)."""
    keys = ("tokens_per_s_per_device", "step_time_s", "mfu_pct", "peak_memory_gib", "peak_allocated_gib")
    shared = {"device": one_recipe["device"], "n_layers": one_recipe["n_layers"],
              "parameters": one_recipe["torchtitan"]["parameters"],
              "flops_per_token": one_recipe["torchtitan"]["flops_per_token"]}
    kept = {name: {k: one_recipe[name][k] for k in keys if k in one_recipe[name]} for name in ("ours", "torchtitan")}
    return shared, {"ratio": one_recipe["ratio"], "peak_tflops": one_recipe["peak_tflops"],
                    "peak_source": one_recipe["peak_source"], **kept}


def _recipe_line(name: str, entry: dict) -> str:
    if "error" in entry:
        return f"side by side: {name}: {entry['error']}"
    ours, torchtitan = entry["ours"], entry["torchtitan"]
    return (f"side by side: {name}: ours {ours['tokens_per_s_per_device']:,.0f} tokens/s ({ours['mfu_pct']:.1f}% "
            f"MFU, {ours['peak_memory_gib']:.2f} GiB), TorchTitan {torchtitan['tokens_per_s_per_device']:,.0f} "
            f"({torchtitan['mfu_pct']:.1f}%, {torchtitan['peak_memory_gib']:.2f} GiB): ratio {entry['ratio']:.3f}")


def _run_recipe(command: list[str], timeout: float) -> dict:
    """One recipe's JSON line, from its pair of processes, run in a process group of their own (ended whole at the
    time limit); or {"error": ...}. Their log is copied to this process's stderr."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            out = None
        except BaseException:  # this process is stopped (SIGTERM from a time limit, Ctrl-C): so is the recipe
            os.killpg(process.pid, signal.SIGKILL)
            raise
        log.seek(0)
        text = log.read()
    sys.stderr.write(text)
    if out is None:
        return {"error": f"stopped at its time limit, {timeout:.0f} s"}
    if process.returncode != 0:
        errors = [line for line in text.splitlines() if line.startswith("error:")] or text.splitlines()[-3:]
        return {"error": f"exited with {process.returncode}: " + " | ".join(errors)}
    return json.loads(out.strip().splitlines()[-1])


def side_by_side(options: argparse.Namespace, trainer_args: list[str]) -> dict:
    # Ask NVML whether there is a GPU: this process starts no CUDA context, which would hold GPU memory throughout.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    cuda = torch.cuda.is_available()
    # The recipes run in process groups of their own, which a time limit's SIGTERM to this process would not reach.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    shape = ["--model.flavor", options.flavor, "--training.seq_len", str(options.seq_len),
             "--training.local_batch_size", str(options.local_batch_size)]
    common = ["--ours", options.ours, "--warmup", str(options.warmup), "--steps", str(options.steps),
              "--n_layers", options.n_layers, *(["--threads", str(options.threads)] if options.threads else [])]
    result = {"device": "cuda" if cuda else "cpu", "torch": torch.__version__, "torchtitan": TORCHTITAN_VERSION,
              "shape": {"flavor": options.flavor, "n_layers": options.n_layers, "seq_len": options.seq_len,
                        "local_batch_size": options.local_batch_size, "vocab_size": VOCAB_SIZE},
              "warmup": options.warmup, "steps": options.steps, "mfu_convention": MFU_CONVENTION, "recipes": {}}
    deadline = time.monotonic() + options.time_limit
    for i, name in enumerate(options.recipes):
        recipe_options = RECIPES[name].options(cuda)
        timeout = (deadline - time.monotonic()) / (len(options.recipes) - i)
        entry = ({"error": "no time left"} if timeout <= 0 else
                 _run_recipe([sys.executable, __file__, *common, *shape, *recipe_options, *trainer_args], timeout))
        if "error" not in entry:
            shared, entry = summarize(entry)
            result["device"] = shared.pop("device")
            result["shape"].update(n_layers=shared.pop("n_layers"), parameters=shared.pop("parameters"))
            result.update(shared)
        result["recipes"][name] = {"options": recipe_options, **entry}
        print(_recipe_line(name, entry), file=sys.stderr, flush=True)
        if options.output:
            options.output.write_text(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
