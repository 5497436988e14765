"""benchmarks/benchmark.py: the JSON line it prints, and its transformers comparison training the same model."""

import json
import math

import pytest
import torch

from benchmarks import benchmark

TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--metrics.peak_flops", "1e12", "--threads", "1"]


def run_benchmark(capsys, *argv: str) -> dict:
    assert benchmark.main([*TINY, *argv]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, "stdout holds the JSON line alone"
    return json.loads(lines[0])


def test_json_line_reports_throughput_mfu_and_memory(capsys):
    result = run_benchmark(capsys, "--warmup", "1", "--steps", "2")
    assert result["config"]["flavor"] == "tiny" and result["config"]["world_size"] == 1
    assert result["steps"] == 2 and result["step_time_s"] > 0
    tokens_per_step = 2 * 32
    assert math.isclose(result["tokens_per_s_per_device"], tokens_per_step / result["step_time_s"])
    # MFU against the configured 1 TFLOP/s peak.
    assert result["peak"]["tflops"] == 1.0
    assert result["mfu_pct"] > 0
    # (The increase over the baseline RSS is not checked: in this process the baseline holds earlier tests' memory.)
    assert result["peak_memory_gib"] > 0 and "peak_memory_over_baseline_gib" in result
    assert math.isfinite(result["first_loss"]) and math.isfinite(result["last_loss"])
    assert "hf" not in result


def test_peers_train_the_same_model_with_our_recipe(capsys):
    """Same initial weights and first batch in fp32: transformers' and the plain Llama's first losses equal ours, so
    the ratios compare the same computation."""
    result = run_benchmark(capsys, "--warmup", "1", "--steps", "2", "--hf", "--plain")
    for peer in ("hf", "plain"):
        figures = result[peer]
        assert figures["first_loss"] == pytest.approx(result["first_loss"], rel=1e-5), peer
        assert figures["recipe"] == "float32, eager"
        assert figures["tokens_per_s_per_device"] > 0 and figures["ratio_cpu_time"] > 0
        assert math.isclose(figures["ratio"], figures["step_time_s"] / figures["ours_step_time_s_alternating"])


def test_peers_follow_a_bf16_recipe(tmp_path):
    """In bf16 a peer trains under autocast: its first loss is close to, not equal to, the fp32 one."""
    from benchmarks.benchmark import benchmark_config
    from benchmarks.benchmark_peers import PeerTraining, initial_state_dict
    from torchtitan.train import Trainer

    config = benchmark_config([*TINY[:-2], "--training.mixed_precision_param", "bfloat16"], 2, str(tmp_path))
    trainer = Trainer(config)
    try:
        batch = trainer._next_batches(iter(trainer.dataloader))
        peer = PeerTraining("plain", trainer, initial_state_dict(trainer))
        assert peer.recipe == "bfloat16 autocast, eager"
        inputs, labels = batch[0]
        with torch.no_grad():
            fp32_loss = torch.nn.functional.cross_entropy(peer.model(inputs).flatten(0, 1), labels.flatten())
            with peer.autocast:
                assert peer.model(inputs).dtype == torch.bfloat16
        assert peer.step(batch) == pytest.approx(float(fp32_loss), rel=2e-2)
    finally:
        trainer.close()


def test_vs_eager_alternates_compiled_steps_with_eager_ones(capsys):
    """--vs_eager: the compiled trainer's steps alternate with its own steps under the force_eager stance, which
    must run no compiled code. A backend that counts its calls: each compiled step calls the 4 tiny blocks and the
    loss once."""
    calls = []

    @torch._dynamo.register_backend(name="count_calls_for_vs_eager_test")
    def counting(graph, example_inputs):
        def run(*args):
            calls.append(1)
            return graph(*args)
        return run

    result = run_benchmark(capsys, "--warmup", "1", "--steps", "2", "--compile.enable", "--compile.backend",
                           "count_calls_for_vs_eager_test", "--vs_eager")
    compiled_steps = 1 + 2 + 2 * 2  # warm-up and timed steps, then the compiled pairs of the alternating ones
    assert len(calls) == 5 * compiled_steps
    eager = result["eager"]
    assert eager["step_time_s"] > 0 and eager["ratio_cpu_time"] > 0
    assert math.isclose(eager["ratio"], eager["step_time_s"] / eager["compiled_step_time_s_alternating"])


def test_bad_arguments_are_one_error(capsys):
    assert benchmark.main([*TINY, "--steps", "0"]) == 2
    assert "--warmup and --steps must be at least 1" in capsys.readouterr().err
    assert benchmark.main([*TINY, "--vs_eager"]) == 2
    assert "--vs_eager times compile against eager, but compile.enable is off" in capsys.readouterr().err


def test_step_breakdown_sorts_the_step_into_categories(capsys):
    """Every part of the step lands somewhere: the matmuls, attention, the optimizer, the clipping and the data
    fetch of ours by the trainer's labelled regions; the peer has no data or clipping label of its own."""
    from benchmarks import step_breakdown

    assert step_breakdown.json_main(step_breakdown.run, [*TINY, "--warmup", "1", "--steps", "2", "--plain"]) == 0
    result = json.loads(capsys.readouterr().out)
    ours, plain = result["ours"], result["plain"]
    for category in ("matmul", "attention", "optimizer", "gradient clipping", "data", "norms, elementwise, loss"):
        assert ours[category] > 0, category
    assert plain["matmul"] > 0 and plain["attention"] > 0 and plain["data"] == 0


def test_torchtitan_benchmark_needs_an_environment_of_its_own():
    """TorchTitan 0.2.2's package has this project's name: its benchmark refuses to run here and says where to."""
    from importlib.metadata import version

    from benchmarks import benchmark_torchtitan

    with pytest.raises(SystemExit) as stop:
        benchmark_torchtitan._require_torchtitan_0_2_2()
    assert str(stop.value).startswith("error: this script runs TorchTitan 0.2.2 from its own environment")
    assert f"found torchtitan {version('torchtitan')}" in str(stop.value)


def test_two_processes_take_turns_step_by_step(tmp_path):
    """Over two FIFOs each side steps only in its turn, so their steps alternate; a side whose partner has gone
    raises instead of waiting for ever."""
    import threading

    from benchmarks.turns import Turns, make_fifos

    first, second = make_fifos(tmp_path, "first", "second")
    steps: list[str] = []

    def take_turns(turns: Turns, name: str) -> None:
        for _ in range(4):
            with turns.turn():
                steps.append(name)
        if name == "first":  # as benchmarks/benchmark.py does: wait out the other's last step
            turns.wait()
            steps.append("first done")

    waiting = Turns(f"{second}:{first}")
    threads = [threading.Thread(target=take_turns, args=(Turns(f"{first}:{second}"), "first"), daemon=True),
               threading.Thread(target=take_turns, args=(waiting, "second"), daemon=True)]
    for thread in threads:
        thread.start()
    waiting.pass_turn()
    for thread in threads:
        thread.join(timeout=30)
    assert steps == ["first", "second"] * 4 + ["first done"]

    with pytest.raises(RuntimeError, match="has exited"):
        Turns(f"{first}:{second}", other_alive=lambda: False).wait()
    with pytest.raises(ValueError, match="two FIFOs"):
        Turns(f"{tmp_path}:{first}")


def test_turns_are_for_one_process_against_one(capsys):
    assert benchmark.main([*TINY, "--turns", "a:b", "--hf"]) == 2
    assert "--turns times ours against another process" in capsys.readouterr().err


@pytest.mark.slow
def test_attention_paths_compute_the_same_attention(capsys):
    """benchmarks/attention_paths.py: every path, compiled ones included, gives the flash kernel's output and gradient
    (to bf16 rounding), and a time."""
    from benchmarks import attention_paths

    shape = ["--batch", "1", "--heads", "4", "--kv_heads", "2", "--seq_len", "32", "--head_dim", "8"]
    assert attention_paths.main([*shape, "--repeats", "1", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["paths"]) == {"flash_fp32", "flash_bf16", "math_fp32", "math_bf16", "compiled_math_fp32",
                                    "compiled_math_bf16"}
    for name, entry in result["paths"].items():
        assert entry["max_abs_diff_out"] < 0.05 and entry["max_abs_diff_q_grad"] < 0.05, (name, entry)
        assert entry["median_ms"] > 0
    assert attention_paths.main([*shape, "--kv_heads", "3"]) == 2
    assert "--kv_heads must divide --heads" in capsys.readouterr().err
