"""Scripts that pass trainer options on: `--help` lists the script's own options, not a parse error or only the
trainer's."""

import pytest

from benchmarks import benchmark, checkpoint_stall, step_breakdown
from scripts import estimate_memory
from scripts import plan as plan_script

SCRIPTS = {
    "plan.py": (plan_script.main, "--global_batch"),
    "estimate_memory.py": (estimate_memory.main, "--gpu"),
    "benchmark.py": (benchmark.parse_benchmark_args, "--vs_eager"),
    "step_breakdown.py": (step_breakdown.run, "--plain"),
    "checkpoint_stall.py": (checkpoint_stall.parse_stall_args, "--interval"),
}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_scripts_options_and_where_the_trainers_are(script, flag, capsys):
    entry, own_option = SCRIPTS[script]
    with pytest.raises(SystemExit) as exit_info:
        entry(["--job.config_file", "train_configs/debug_model.toml", flag])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: ") and script in printed.splitlines()[0]
    assert own_option in printed
    assert "--training.steps" not in printed  # the trainer's options are listed by the trainer
    assert printed.rstrip().endswith("`python -m torchtitan.train --help` lists them.")
