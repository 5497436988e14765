"""benchmarks/benchmark_torchtitan.py against TorchTitan, and benchmarks/gpu_carry.py that takes it to a GPU machine: the
turns of the two trainers, the one FLOP convention, the recipes' plumbing, the blocks that fit, the carry's limit;
end to end on this CPU from carried wheels (slow: it downloads them)."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from benchmarks import benchmark_torchtitan as side
from benchmarks import gpu_carry
from benchmarks.turns import Turns, make_fifos

REPO = Path(__file__).resolve().parents[2]


def test_warmups_run_together_then_the_trainers_alternate_ours_first(tmp_path):
    """TorchTitan's side (the wrapped train_step) and ours (benchmarks/benchmark.py's loop: every step in its turn, then
    a last wait) warm up at once; no timed step starts before both warm-ups have ended, and the timed steps alternate,
    ours first."""
    warmup, steps = 2, 3
    ours_fifo, torchtitan_fifo = make_fifos(tmp_path, "ours", "torchtitan")
    events: list[str] = []
    lock = threading.Lock()

    def log(event: str) -> None:
        with lock:
            events.append(event)

    def ours() -> None:
        turns = Turns(f"{ours_fifo}:{torchtitan_fifo}")
        for i in range(warmup):
            with turns.turn():
                log(f"ours warmup {i}")
        for i in range(steps):
            with turns.turn():
                log(f"ours step {i}")
        turns.wait()
        log("ours done")

    torchtitan_turns = Turns(f"{torchtitan_fifo}:{ours_fifo}")
    for _ in range(warmup):  # as _start_ours gives them
        torchtitan_turns.pass_turn()
    thread = threading.Thread(target=ours, daemon=True)
    thread.start()
    calls = iter(range(warmup + steps))

    def original_step(trainer):
        i = next(calls)
        if i < warmup:
            time.sleep(0.2)  # ours' warm-up ends first, and must not start a timed step yet
            log(f"torchtitan warmup {i}")
        else:
            log(f"torchtitan step {i - warmup}")

    times: list[float] = []
    step = side._timed_train_step(original_step, warmup, torchtitan_turns, cuda=False, times=times)
    for _ in range(warmup + steps):
        step(None)
    thread.join(timeout=30)
    assert len(times) == steps
    last_warmup = max(events.index(f"{who} warmup {warmup - 1}") for who in ("ours", "torchtitan"))
    timed = events[last_warmup + 1:]
    assert timed == [f"{who} step {i}" for i in range(steps) for who in ("ours", "torchtitan")] + ["ours done"]


def test_flops_per_token_is_this_projects_count():
    """The harness counts TorchTitan's model by this project's convention: on this project's model it gives the
    trainer's own `flops_per_token`."""
    from torchtitan.models.llama3.args import TransformerModelArgs
    from torchtitan.models.llama3.model import Transformer, flops_per_token
    from torchtitan.nn.parameters import count_parameters

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    ours = flops_per_token(args, count_parameters(model, exclude_embeddings=True), 32)
    assert side.flops_per_token(model, args.n_layers, args.n_heads, args.head_dim, 32) == ours


def _ours(flops: float, tokens_per_s: float, peak_tflops: float = 989.0) -> dict:
    return {"tokens_per_s_per_device": tokens_per_s, "step_time_s": 8192 / tokens_per_s,
            "mfu_pct": 100 * flops * tokens_per_s / (peak_tflops * 1e12),
            "peak": {"tflops": peak_tflops, "source": "datasheet"}}


def test_both_mfus_by_one_convention_and_the_ratio():
    """TorchTitan's MFU is its tokens/s times the same FLOPs per token over ours' peak; the ratio is its step time
    over ours'. Models of different FLOPs are refused, naming both counts."""
    flops = 6 * 1_300_000_000 + 12 * 6 * 32 * 128 * 8192
    torchtitan = {"flops_per_token": flops, "tokens_per_s_per_device": 100_000.0}
    compared = side.compare(torchtitan, _ours(flops, 125_000.0), tokens_per_step=8192)
    assert compared["ratio"] == pytest.approx(1.25)
    assert torchtitan["mfu_pct"] == pytest.approx(100 * flops * 100_000 / 989e12)
    assert compared["peak_tflops"] == 989.0
    with pytest.raises(ValueError, match=f"TorchTitan {flops + 6:,}"):
        side.compare({"flops_per_token": flops + 6, "tokens_per_s_per_device": 1.0}, _ours(flops, 1.0), 8192)


@pytest.mark.parametrize("mib,blocks", [(81_559, 6), (143_771, 11)])
def test_auto_blocks_fit_two_trainers_in_the_gpu_share(mib, blocks):
    """An 80 GB H100 and a 141 GB H200 (their memory as nvidia-smi gives it): the most blocks with which two
    trainers' estimated peaks stay within 90% of the GPU."""
    per_trainer = 0.9 * mib / 1024 / 2
    assert side.blocks_that_fit(mib * 2 ** 20, "8B", 8192) == blocks
    assert side.AUTO_GIB_BESIDE_BLOCKS + blocks * side.AUTO_GIB_PER_BLOCK <= per_trainer
    assert side.AUTO_GIB_BESIDE_BLOCKS + (blocks + 1) * side.AUTO_GIB_PER_BLOCK > per_trainer
    with pytest.raises(SystemExit, match="sized for the 8B flavor at 8,192 tokens"):
        side.blocks_that_fit(mib * 2 ** 20, "8B", 16384)


@pytest.mark.parametrize("n_layers", [2, 6])
def test_auto_blocks_constants_are_the_memory_estimate(n_layers):
    """AUTO_GIB_*: scripts/estimate_memory.py's device total on an H100 for the 8B shape at 8,192 tokens, bf16
    eager without AC (the recipes' largest), vocabulary 2,304."""
    from scripts.estimate_memory import DEBUG_TOML, GIB, device_headroom, estimate
    from torchtitan.config import parse_args
    from torchtitan.planner.hardware import GPUS

    config = parse_args([*DEBUG_TOML, "--model.flavor", "8B", "--model.n_layers", str(n_layers),
                         "--model.vocab_size", "2304", "--training.seq_len", "8192",
                         "--training.local_batch_size", "1", "--activation_checkpoint.mode", "none"])
    tensors = estimate(config, 1, "cuda").total
    total_gib = tensors / GIB + device_headroom(config, 1, tensors, GPUS["h100"]).total_gib
    assert total_gib == pytest.approx(side.AUTO_GIB_BESIDE_BLOCKS + n_layers * side.AUTO_GIB_PER_BLOCK, rel=0.01)


def test_ours_runs_without_torchtitans_package_on_its_path(monkeypatch):
    """The PYTHONPATH entry holding the imported `torchtitan` (here this checkout) is dropped for ours, the
    carried dependencies kept; the rendezvous is not passed on."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), "/carried/deps"]))
    monkeypatch.setenv("RANK", "0")
    env = side.ours_environment()
    assert env["PYTHONPATH"] == "/carried/deps" and "RANK" not in env


def _one_recipe(ratio: float) -> dict:
    memory = {"peak_memory_gib": 30.0, "peak_allocated_gib": 28.0}
    return {"device": "NVIDIA H100 80GB HBM3", "n_layers": 6, "ratio": ratio, "peak_tflops": 989.0,
            "peak_source": "datasheet",
            "ours": {"tokens_per_s_per_device": 100.0, "step_time_s": 1.0, "mfu_pct": 50.0, **memory},
            "torchtitan": {"tokens_per_s_per_device": 90.0, "step_time_s": 1.1, "mfu_pct": 45.0, "parameters": 7,
                           "flops_per_token": 42, **memory}}


def test_recipes_share_the_time_and_write_after_each(tmp_path, monkeypatch):
    """Each recipe runs in its own processes with the time left over the recipes left; the JSON file holds every
    finished recipe (its ratio, both trainers' tokens/s, MFU and memory, or its error) as soon as it ends."""
    output = tmp_path / "side_by_side.json"
    calls = []

    def run_recipe(command, timeout):
        calls.append((command, timeout))
        if len(calls) > 1:
            assert json.loads(output.read_text())["recipes"]["bf16_eager"]["ratio"] == 1.1
        return _one_recipe(1.1) if len(calls) == 1 else {"error": "exited with 1: error: out of memory"}

    monkeypatch.setattr(side, "_run_recipe", run_recipe)
    monkeypatch.setattr(side.signal, "signal", lambda *args: None)  # leave pytest's SIGTERM handling alone
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # which side_by_side sets otherwise
    options, trainer_args = side._parse(["--recipes", "bf16_eager,compile_float8", "--ours", sys.executable,
                                         "--time_limit", "100", "--output", str(output)])
    result = side.side_by_side(options, trainer_args)
    assert json.loads(output.read_text()) == result
    assert calls[0][1] == pytest.approx(50, abs=1) and calls[1][1] == pytest.approx(100, abs=1)
    float8_command = calls[1][0]
    assert "--n_layers" in float8_command and float8_command[float8_command.index("--n_layers") + 1] == "auto"
    assert "quantize.linear.float8" in float8_command
    assert result["device"] == "NVIDIA H100 80GB HBM3" and result["shape"]["n_layers"] == 6
    assert result["flops_per_token"] == 42 and result["shape"]["parameters"] == 7
    eager = result["recipes"]["bf16_eager"]
    assert eager["ratio"] == 1.1 and eager["peak_tflops"] == 989.0 and eager["torchtitan"]["mfu_pct"] == 45.0
    assert eager["ours"]["peak_allocated_gib"] == 28.0 and eager["torchtitan"]["peak_memory_gib"] == 30.0
    assert result["recipes"]["compile_float8"]["error"] == "exited with 1: error: out of memory"


def test_a_recipe_past_its_time_is_ended_with_its_children(tmp_path):
    """The recipe's process group goes at the limit: the process that runs over it and the child it started."""
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
              f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)")
    start = time.monotonic()
    assert side._run_recipe([sys.executable, "-c", script], timeout=1) == {"error": "stopped at its time limit, 1 s"}
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:  # reaped by init once killed
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        assert not Path(f"/proc/{child}").exists()


def test_unknown_recipe_is_one_error_line():
    with pytest.raises(SystemExit, match=r"--recipes 'compile,fp8': unknown \['fp8'\]"):
        side._parse(["--recipes", "compile,fp8", "--ours", sys.executable])
    with pytest.raises(SystemExit, match="--recipes compares the two trainers: give this project's Python"):
        side._parse(["--recipes", "all"])


def test_carry_over_the_limit_is_refused_naming_the_largest():
    wheels = {"deps/torchao.whl": 40 * 2 ** 20, "deps/tyro.whl": 2 ** 20}
    gpu_carry.check_size(wheels, tracked=20 * 2 ** 20)
    with pytest.raises(SystemExit, match=r"exceed the 64 MiB that travel; largest: deps/torchao.whl"):
        gpu_carry.check_size(wheels, tracked=24 * 2 ** 20)


@pytest.mark.slow
def test_side_by_side_end_to_end_from_carried_wheels(tmp_path):
    """The GPU run's CPU form: wheels prepared for this Python (pip download from the index) and installed offline
    as on the GPU machine, TorchTitan 0.2.2 in a folder of its own; two recipes, each a pair of processes taking
    turns; one JSON line with both trainers' figures. The carry fits the limit. (The GPU image has triton, which
    TorchTitan 0.2.2 imports at start-up; a CPU build of torch may not.)"""
    pytest.importorskip("triton", reason="TorchTitan 0.2.2 imports triton at start-up")
    carry, target = tmp_path / "wheels", tmp_path / "site"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    prepared = subprocess.run([sys.executable, "benchmarks/gpu_carry.py", "prepare", "--python", python, "--carry",
                               str(carry)], cwd=REPO, capture_output=True, text=True, check=True)
    sizes = json.loads(prepared.stdout)
    assert sizes["wheels_mib"] + sizes["tracked_mib"] <= 64
    subprocess.run([sys.executable, "benchmarks/gpu_carry.py", "install", str(target), "--carry", str(carry)],
                   cwd=REPO, check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target / "torchtitan"), str(target / "deps")])}
    output = tmp_path / "side_by_side.json"
    run = subprocess.run([sys.executable, "benchmarks/benchmark_torchtitan.py", "--recipes", "bf16_eager,compile_float8",
                          "--ours", sys.executable, "--flavor", "debugmodel", "--n_layers", "2", "--seq_len", "64",
                          "--local_batch_size", "2", "--warmup", "1", "--steps", "2", "--threads", "1",
                          "--output", str(output)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert json.loads(output.read_text()) == result
    assert result["torchtitan"] == "0.2.2" and result["shape"]["n_layers"] == 2
    for name in ("bf16_eager", "compile_float8"):
        entry = result["recipes"][name]
        assert "error" not in entry, entry
        assert entry["ratio"] == pytest.approx(entry["torchtitan"]["step_time_s"] / entry["ours"]["step_time_s"])
        for trainer in ("ours", "torchtitan"):
            assert entry[trainer]["tokens_per_s_per_device"] > 0 and entry[trainer]["peak_memory_gib"] > 0
            assert math.isclose(entry[trainer]["mfu_pct"], 100 * result["flops_per_token"] * entry[trainer][
                "tokens_per_s_per_device"] / (entry["peak_tflops"] * 1e12), rel_tol=1e-6)
    assert "--quantize.linear.float8.emulate" in result["recipes"]["compile_float8"]["options"]
