"""The config system: defaults <- TOML <- command line, every syntax, every error path, validate(), round trips."""

import dataclasses
import re
from pathlib import Path

import pytest

from torchtitan.config import JobConfig, parse_args, save_config, to_toml, validation_shape
from torchtitan.config import option_names
from torchtitan.config.options import get_option, option_specs
from torchtitan.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def write_toml(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def raises(pattern: str):
    return pytest.raises(UserError, match=pattern)


# ---------------------------------------------------------------------------------------------------------------
# Defaults, TOML, precedence


def test_no_arguments_give_the_dataclass_defaults():
    config = parse_args([])
    assert config == JobConfig()
    assert config.training.steps == 10000
    assert config.optimizer.lr == 8e-4
    assert config.debug.seed is None
    assert config.compile.components == ["model", "loss"]
    assert config.quantize.linear.float8.filter_fqns == ["output"]


def test_toml_values_replace_defaults_and_leave_the_rest(tmp_path):
    path = write_toml(tmp_path, """
[training]
steps = 7
seq_len = 64
[optimizer]
lr = 1  # an integer is accepted for a float option
name = "Adam"
[model]
converters = ["quantize.linear.float8"]
""")
    config = parse_args(["--job.config_file", path])
    assert config.training.steps == 7
    assert config.training.seq_len == 64
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.optimizer.name == "Adam"
    assert config.model.converters == ["quantize.linear.float8"]
    assert config.training.local_batch_size == JobConfig().training.local_batch_size
    assert config.job.config_file == path


def test_command_line_beats_toml_beats_defaults(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    # The flag before --job.config_file still wins: the file is read first, whatever the order.
    config = parse_args(["--training.steps", "9", "--job.config_file", path])
    assert config.training.steps == 9
    assert config.training.seq_len == 64
    assert config.training.local_batch_size == 8


def test_a_later_flag_wins_over_an_earlier_one():
    assert parse_args(["--training.steps", "3", "--training.steps=4"]).training.steps == 4


@pytest.mark.parametrize("argv", [["--training.steps", "12"], ["--training.steps=12"]])
def test_both_value_syntaxes(argv):
    assert parse_args(argv).training.steps == 12


@pytest.mark.parametrize("argv, expected", [
    (["--compile.enable"], True),
    (["--compile.enable=true"], True),
    (["--compile.enable", "true"], True),
    (["--compile.enable=yes"], True),
    (["--compile.enable=false"], False),
    (["--compile.enable", "false"], False),
    (["--compile.enable=0"], False),
    (["--compile.enable", "--compile.no_enable"], False),
])
def test_bool_flags(argv, expected):
    assert parse_args(argv).compile.enable is expected


def test_no_prefix_turns_off_an_option_that_toml_turned_on(tmp_path):
    path = write_toml(tmp_path, "[validation]\nenable = true\n")
    assert parse_args(["--job.config_file", path]).validation.enable is True
    assert parse_args(["--job.config_file", path, "--validation.no_enable"]).validation.enable is False


def test_negative_number_is_a_value_not_a_flag():
    assert parse_args(["--training.global_batch_size", "-1"]).training.global_batch_size == -1


def test_lists_are_comma_separated_on_the_command_line():
    config = parse_args(["--compile.components", "loss", "--checkpoint.exclude_from_loading",
                         "optimizer, dataloader", "--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"])
    assert config.compile.components == ["loss"]
    assert config.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    assert config.parallelism.pipeline_parallel_split_points == ["layers.2", "layers.4"]
    assert parse_args(["--compile.components="]).compile.components == []


def test_a_toml_string_for_a_list_option_is_split(tmp_path):
    path = write_toml(tmp_path, '[compile]\ncomponents = "model,loss"\n')
    assert parse_args(["--job.config_file", path]).compile.components == ["model", "loss"]


def test_optional_options_accept_none(tmp_path):
    config = parse_args(["--debug.seed", "5", "--lr_scheduler.decay_ratio", "0.5"])
    assert config.debug.seed == 5 and config.lr_scheduler.decay_ratio == 0.5
    config = parse_args(["--debug.seed", "none", "--lr_scheduler.decay_ratio=null",
                         "--quantize.linear.float8.recipe_name", "None"])
    assert config.debug.seed is None
    assert config.lr_scheduler.decay_ratio is None
    assert config.quantize.linear.float8.recipe_name is None
    path = write_toml(tmp_path, "[debug]\nseed = 3\n")
    assert parse_args(["--job.config_file", path, "--debug.seed=none"]).debug.seed is None


def test_nested_float8_section_in_toml_and_on_the_command_line(tmp_path):
    path = write_toml(tmp_path, """
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
recipe_name = "rowwise"
filter_fqns = ["output", "router"]
""")
    config = parse_args(["--job.config_file", path, "--quantize.linear.float8.emulate"])
    float8 = config.quantize.linear.float8
    assert float8.enable_fsdp_float8_all_gather is True
    assert float8.recipe_name == "rowwise"
    assert float8.filter_fqns == ["output", "router"]
    assert float8.emulate is True
    config = parse_args(["--quantize.linear.float8.filter_fqns", "a,b",
                         "--quantize.linear.float8.no_enable_fsdp_float8_all_gather"])
    assert config.quantize.linear.float8.filter_fqns == ["a", "b"]
    assert config.quantize.linear.float8.enable_fsdp_float8_all_gather is False


@pytest.mark.parametrize("toml", sorted(p.name for p in (REPO / "train_configs").glob("*.toml")))
def test_every_shipped_config_parses_and_round_trips(toml, tmp_path):
    config = parse_args(["--job.config_file", str(REPO / "train_configs" / toml)])
    assert config.job.dump_folder.startswith("./outputs/")
    again = parse_args(["--job.config_file", write_toml(tmp_path, to_toml(config))])
    assert dataclasses.replace(again, job=dataclasses.replace(again.job, config_file=config.job.config_file)) == config


def test_shipped_configs_are_all_checked():
    assert {"debug_model.toml", "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"} <= {
        p.name for p in (REPO / "train_configs").glob("*.toml")}


def test_debug_model_toml_values():
    config = parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")])
    assert config.model.flavor == "debugmodel"
    assert config.training.steps == 60
    assert config.lr_scheduler.decay_ratio == 0.8
    assert config.validation.enable is True
    assert config.debug.seed == 0


# ---------------------------------------------------------------------------------------------------------------
# Round trip and --help


def test_to_toml_round_trip_of_non_default_values(tmp_path):
    config = parse_args([
        "--job.description", 'a "quoted" \\ description', "--training.steps", "5", "--optimizer.lr", "1e-08",
        "--optimizer.name", "Adam", "--debug.seed", "7", "--lr_scheduler.decay_ratio", "0.25",
        "--compile.components", "loss", "--model.converters", "quantize.linear.float8",
        "--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.float8.filter_fqns", "",
        "--validation.enable", "--metrics.peak_flops", "1e15", "--training.dataset_path", "/data/x.jsonl",
        "--parallelism.pipeline_parallel_schedule_csv", "none", "--checkpoint.exclude_from_loading", "optimizer",
    ])
    assert config.quantize.linear.float8.filter_fqns == []
    path = save_config(config, str(tmp_path / "dump"))
    assert path == tmp_path / "dump" / "config.toml"
    again = parse_args(["--job.config_file", str(path)])
    assert again.job.config_file == str(path)
    assert dataclasses.replace(again, job=dataclasses.replace(again.job, config_file=None)) == config


def test_to_toml_round_trip_of_defaults(tmp_path):
    again = parse_args(["--job.config_file", write_toml(tmp_path, to_toml(JobConfig()))])
    assert dataclasses.replace(again, job=dataclasses.replace(again.job, config_file=None)) == JobConfig()


def test_help_lists_every_option_with_its_default_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--training.steps", "3", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    specs = option_specs()
    assert len(specs) > 100
    for key, spec in specs.items():
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(f"--{key} (")), None)
        assert line is not None, f"--help does not list {key}"
        assert line.endswith(f"default: {spec.default!r})"), line
    assert "--quantize.linear.float8.emulate (bool, default: False)" in text
    assert "--training.seq_len (int, default: 2048)" in text
    assert "[quantize.linear.float8]" in text


def test_short_help_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["-h"])
    assert exit_info.value.code == 0
    assert "--optimizer.lr" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("argv, pattern", [
    (["--training.stepz", "5"], r"unknown option training\.stepz; did you mean training\.steps\?"),
    (["--trainng.steps", "5"], r"unknown option trainng\.steps; did you mean training\.steps\?"),
    (["--optimizer.learning_rate=0.1"], r"unknown option optimizer\.learning_rate; did you mean optimizer\.\w+"),
    (["--compile.enabel"], r"unknown option compile\.enabel; did you mean compile\.enable\?"),
    # Every section is searched, and an option of exactly that name in another section comes first.
    (["--training.lr", "1e-3"], r"unknown option training\.lr; did you mean optimizer\.lr\?"),
    (["--training.weight_decay", "0"], r"did you mean optimizer\.weight_decay\?"),
    (["--training.log_freq", "1"], r"did you mean metrics\.log_freq\?"),
    (["--training.warmup_step", "2"], r"training\.warmup_step; did you mean lr_scheduler\.warmup_steps\?"),
    (["--validaton.seq_len", "64"], r"did you mean validation\.seq_len\?"),
])
def test_unknown_option_names_the_closest_key(argv, pattern):
    with raises(pattern):
        parse_args(argv)


def test_unknown_option_in_toml_names_the_file_and_closest_key(tmp_path):
    path = write_toml(tmp_path, "[training]\nseqlen = 64\n")
    with raises(rf"config file {re.escape(path)}: unknown option training\.seqlen; did you mean training\.seq_len"):
        parse_args(["--job.config_file", path])


@pytest.mark.parametrize("section, closest", [
    ("trainng", "training"),
    ("trainig", "training"),
    ("quantize.linear.float9", "quantize.linear.float8"),
    ("training.foo", "training"),
])
def test_unknown_section_in_toml_names_the_file_and_closest_section(tmp_path, section, closest):
    path = write_toml(tmp_path, f"[{section}]\nsteps = 5\n")
    with raises(rf"config file {re.escape(path)}: unknown section \[{re.escape(section)}\]; "
                rf"did you mean \[{re.escape(closest)}\]\?"):
        parse_args(["--job.config_file", path])


def test_a_table_given_to_an_option_is_a_wrong_type(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = {value = 5}\n")
    with raises(r"option training\.steps: \{'value': 5\} is not a valid value; expected int"):
        parse_args(["--job.config_file", path])


def test_unknown_section_on_the_command_line():
    with raises(r"unknown option nosuchsection\.steps"):
        parse_args(["--nosuchsection.steps", "5"])


@pytest.mark.parametrize("argv, pattern", [
    (["--training.steps", "abc"], r"option training\.steps: 'abc' is not a valid value; expected int"),
    (["--training.steps", "1.5"], r"option training\.steps: '1\.5' is not a valid value; expected int"),
    (["--optimizer.lr", "fast"], r"option optimizer\.lr: 'fast' is not a valid value; expected float"),
    (["--compile.enable=maybe"], r"option compile\.enable: 'maybe' is not a valid value; expected bool"),
    (["--debug.seed", "x"], r"option debug\.seed: 'x' is not a valid value; expected int \| none"),
    (["--optimizer.lr", "nan"], r"option optimizer\.lr: 'nan' is not a finite number"),
    (["--model.rope_theta", "-inf"], r"option model\.rope_theta: '-inf' is not a finite number"),
])
def test_wrong_type_on_the_command_line_names_key_value_and_type(argv, pattern):
    with raises(pattern):
        parse_args(argv)


@pytest.mark.parametrize("line, pattern", [
    ('steps = "10"', r"option training\.steps: '10' is not a valid value; expected int"),
    ("steps = 2.5", r"option training\.steps: 2\.5 is not a valid value; expected int"),
    ("steps = true", r"option training\.steps: True is not a valid value; expected int"),
    ('dataset_loop = "false"', r"option training\.dataset_loop: 'false' is not a valid value; expected bool"),
    ("dataset = 3", r"option training\.dataset: 3 is not a valid value; expected str"),
    ("max_norm = [1.0]", r"option training\.max_norm: \[1\.0\] is not a valid value; expected float"),
    ("max_norm = inf", r"option training\.max_norm: inf is not a finite number"),
])
def test_wrong_type_in_toml_names_key_value_and_type(tmp_path, line, pattern):
    path = write_toml(tmp_path, f"[training]\n{line}\n")
    with raises(pattern):
        parse_args(["--job.config_file", path])


def test_bad_literal_lists_the_choices(tmp_path):
    with raises(r"option optimizer\.name: 'SGD' is not one of 'AdamW', 'Adam'"):
        parse_args(["--optimizer.name", "SGD"])
    path = write_toml(tmp_path, '[lr_scheduler]\ndecay_type = "exp"\n')
    with raises(r"option lr_scheduler\.decay_type: 'exp' is not one of 'linear', 'sqrt', 'cosine'"):
        parse_args(["--job.config_file", path])
    with raises(r"quantize\.linear\.float8\.recipe_name: 'colwise' .*'tensorwise' \| 'rowwise' \| "
                r"'rowwise_with_gw_hp' \| none"):
        parse_args(["--quantize.linear.float8.recipe_name", "colwise"])


@pytest.mark.parametrize("argv", [["--training.steps"], ["--training.steps", "--training.seq_len", "5"]])
def test_missing_value(argv):
    with raises(r"option training\.steps needs a value \(int\)"):
        parse_args(argv)


@pytest.mark.parametrize("argv, stray", [
    (["train_configs/debug_model.toml"], "train_configs/debug_model.toml"),
    (["--training.steps", "5", "6"], "6"),
    (["--"], "--"),
    (["-x"], "-x"),
])
def test_stray_positional_argument(argv, stray):
    with raises(rf"unexpected argument {re.escape(repr(stray))}"):
        parse_args(argv)


@pytest.mark.parametrize("word", ["maybe", "yes please", "train.toml"])
def test_a_word_after_a_bool_flag_names_the_flag(word):
    with raises(rf"option compile\.enable: {re.escape(repr(word))} is not a valid value; expected bool "
                rf"\(--compile\.enable, --compile\.no_enable, or --compile\.enable=true/false\)"):
        parse_args(["--compile.enable", word])


def test_negated_bool_takes_no_value():
    with raises(r"--compile\.no_enable=true takes no value"):
        parse_args(["--compile.no_enable=true"])


def test_malformed_toml_names_the_file(tmp_path):
    path = write_toml(tmp_path, "[training\nsteps = 5\n", name="broken.toml")
    with raises(rf"option job\.config_file: {re.escape(path)} is not valid TOML"):
        parse_args(["--job.config_file", path])


def test_missing_config_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with raises(rf"option job\.config_file: {re.escape(repr(missing))} does not exist"):
        parse_args(["--job.config_file", missing])


def test_config_file_that_is_a_folder_lists_its_toml_files(tmp_path):
    for name in ("b.toml", "a.toml", "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub.toml").mkdir()
    folder = str(tmp_path)
    with raises(rf"option job\.config_file: {re.escape(repr(folder))} is a folder, not a TOML file; pass one of the "
                rf"files in it: {re.escape(folder)}/a\.toml, {re.escape(folder)}/b\.toml$"):
        parse_args(["--job.config_file", folder])
    empty = tmp_path / "sub.toml"
    with raises(rf"{re.escape(repr(str(empty)))} is a folder, not a TOML file; it holds no \.toml file$"):
        parse_args(["--job.config_file", str(empty)])


@pytest.mark.parametrize("old, new, value", [
    ("checkpoint.enable_checkpoint", "checkpoint.enable", "true"),
    ("training.seed", "debug.seed", "1"),
    ("lr_scheduler.lr_min", "lr_scheduler.min_lr_factor", "0.1"),
    ("training.batch_size", "training.local_batch_size", "4"),
])
def test_renamed_option_on_the_command_line_names_the_new_one(old, new, value):
    with raises(rf"option {re.escape(old)} is now {re.escape(new)}"):
        parse_args([f"--{old}", value])


def test_renamed_options_in_toml_name_the_new_one(tmp_path):
    path = write_toml(tmp_path, "[float8]\nemulate = true\n")
    with raises(r"option float8\.emulate is now quantize\.linear\.float8\.emulate"):
        parse_args(["--job.config_file", path])
    path = write_toml(tmp_path, "[training]\ncompile = true\n")
    with raises(r"option training\.compile is now compile\.enable"):
        parse_args(["--job.config_file", path])


@pytest.mark.parametrize("argv", [
    ["--parallelism.expert_parallel_degree", "1"],
    ["--parallelism.expert_parallel_degree=1"],
    ["--activation_checkpoint.memory_budget", "0.5"],
    ["--fault_tolerance.enable=false"],
    ["--job.custom_config_module="],
    ["--optimizer.early_step_in_backward", "false"],
    ["--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "moe.router.gate"],
    # TorchTitan's default is true; the model has no dropout, so preserving the RNG state changes nothing.
    ["--activation_checkpoint.preserve_rng_state"],
    ["--activation_checkpoint.preserve_rng_state=false"],
    ["--training.dtype", "float32"],
    ["--comm.mode", "default"],
    ["--comm.save_traces_file_prefix", "rank_"],
    ["--profiling.profiler_active", "1", "--profiling.profiler_warmup", "3"],
    ["--checkpoint.enable_ft_dataloader_checkpoints", "--checkpoint.enable_ft_dataloader_checkpoints=false"],
    ["--checkpoint.initial_load_in_hf_quantized=false"],
    ["--debug.moe_force_load_balance=false"],
    ["--training.debug_moe_force_load_balance=false"],
    ["--parallelism.context_parallel_load_balancer", "headtail"],
    ["--job.save_config_file", "none"],
    ["--lr_scheduler.total_steps", "none"],
    ["--training.dataloader.num_workers", "0", "--validation.dataloader.prefetch_factor", "none"],
])
def test_unsupported_torchtitan_option_at_its_off_value_is_accepted(argv):
    assert parse_args(argv) == JobConfig()


@pytest.mark.parametrize("argv, pattern", [
    (["--parallelism.expert_parallel_degree", "8"],
     r"TorchTitan option parallelism\.expert_parallel_degree = '8' is not supported by this project \(only 1,"),
    (["--fault_tolerance.semi_sync_method", "streaming_diloco"],
     r"option fault_tolerance\.semi_sync_method: 'streaming_diloco' is not one of 'none', 'local_sgd', 'diloco'"),
    (["--activation_checkpoint.memory_budget=0.3"], r"activation_checkpoint\.memory_budget = '0\.3' is not supported"),
    # An option of an unsupported section that the table does not list has no off value to accept.
    (["--memory_estimation.peak_gib", "1"], r"TorchTitan option memory_estimation\.peak_gib = '1' is not supported"),
    (["--quantize.linear.mx.recipe_name", "mxfp8"], r"TorchTitan option quantize\.linear\.mx\.recipe_name"),
    (["--quantize.grouped_mm.float8.fqns", "experts"],
     r"TorchTitan option quantize\.grouped_mm\.float8\.fqns = 'experts' is not supported by this project \(it "
     r"does not implement \[quantize\.grouped_mm\]\)"),
    (["--training.dtype", "bfloat16"], r"TorchTitan option training\.dtype = 'bfloat16' .*\(only 'float32',"),
    (["--profiling.profiler_warmup", "1"], r"TorchTitan option profiling\.profiler_warmup = '1' .*\(only 3,"),
    (["--profiling.profiler_active", "2"], r"TorchTitan option profiling\.profiler_active = '2' .*\(only 1,"),
    (["--checkpoint.initial_load_in_hf_quantized"], r"TorchTitan option checkpoint\.initial_load_in_hf_quantized"),
    (["--comm.save_traces_file_prefix", "r"],
     r"TorchTitan option comm\.save_traces_file_prefix = 'r' .*\(only 'rank_'"),
    (["--debug.moe_force_load_balance"], r"TorchTitan option debug\.moe_force_load_balance = 'true'"),
    (["--parallelism.context_parallel_load_balancer", "ptrr"],
     r"TorchTitan option parallelism\.context_parallel_load_balancer = 'ptrr' .*\(only 'headtail',"),
    (["--job.save_config_file", "config.json"],
     r"TorchTitan option job\.save_config_file = 'config\.json' .*only none"),
    (["--training.dataloader.num_workers", "4"],
     r"TorchTitan option training\.dataloader\.num_workers = '4' .*\(only 0,"),
    (["--activation_checkpoint.preserve_rng_state", "sometimes"],
     r"activation_checkpoint\.preserve_rng_state = 'sometimes' .*\(only False or True,"),
    # A boolean is not the integer 1.
    (["--parallelism.expert_parallel_degree", "true"], r"parallelism\.expert_parallel_degree = 'true'"),
])
def test_unsupported_torchtitan_option_turned_on_is_an_error(argv, pattern):
    with raises(pattern):
        parse_args(argv)


def test_unsupported_torchtitan_options_in_toml(tmp_path):
    path = write_toml(tmp_path, """
[parallelism]
expert_parallel_degree = 1
enable_compiled_autograd = false
[fault_tolerance]
enable = false
[experimental]
custom_import = ""
""")
    assert parse_args(["--job.config_file", path]) == dataclasses.replace(
        JobConfig(), job=dataclasses.replace(JobConfig().job, config_file=path))
    path = write_toml(tmp_path, "[parallelism]\nexpert_parallel_degree = 4\n")
    with raises(rf"config file {re.escape(path)}: TorchTitan option parallelism\.expert_parallel_degree = 4 is not "
                rf"supported"):
        parse_args(["--job.config_file", path])


def test_torchtitan_defaults_of_options_left_out_are_accepted_in_toml(tmp_path):
    path = write_toml(tmp_path, """
[job]
print_config = false
[profiling]
profiler_active = 1
profiler_warmup = 3
[training]
dtype = "float32"
[training.dataloader]
num_workers = 0
persistent_workers = false
pin_memory = false
[parallelism]
context_parallel_load_balancer = "headtail"
[checkpoint]
enable_ft_dataloader_checkpoints = true
initial_load_in_hf_quantized = false
[activation_checkpoint]
preserve_rng_state = true
[comm]
mode = "default"
save_traces_file_prefix = "rank_"
[validation.dataloader]
num_workers = 0
[debug]
moe_force_load_balance = false
""")
    expected = dataclasses.replace(JobConfig(), job=dataclasses.replace(JobConfig().job, config_file=path))
    assert parse_args(["--job.config_file", path]) == expected


@pytest.mark.parametrize("text, pattern", [
    ("[quantize.grouped_mm.float8]\nfqns = ['experts']\n",
     r"TorchTitan option quantize\.grouped_mm\.float8\.fqns = \['experts'\] is not supported by this project "
     r"\(it does not implement \[quantize\.grouped_mm\]\)"),
    ("[quantize.grouped_mm.mx]\nrecipe_name = 'mxfp8'\n",
     r"TorchTitan option quantize\.grouped_mm\.mx\.recipe_name = 'mxfp8' .*does not implement "
     r"\[quantize\.grouped_mm\]"),
    ("[training.dataloader]\npin_memory = true\n",
     r"TorchTitan option training\.dataloader\.pin_memory = True is not supported by this project \(only False,"),
    ("[validation.dataloader]\nnum_workers = 2\n", r"TorchTitan option validation\.dataloader\.num_workers = 2"),
    ('[training]\ndtype = "bfloat16"\n', r"TorchTitan option training\.dtype = 'bfloat16'"),
])
def test_unsupported_torchtitan_options_in_toml_name_the_option_or_section(tmp_path, text, pattern):
    path = write_toml(tmp_path, text)
    with raises(rf"config file {re.escape(path)}: {pattern}"):
        parse_args(["--job.config_file", path])


def test_print_config_is_off_by_default():
    assert JobConfig().job.print_config is False
    assert parse_args(["--job.print_config"]).job.print_config is True


@pytest.mark.parametrize("argv, expected", [
    (["--job.print_args"], True),
    (["--job.print_args=false"], False),
    (["--job.print_args", "false"], False),
    (["--job.no_print_args"], False),
])
def test_print_args_is_an_alias_of_print_config(argv, expected, monkeypatch):
    warnings = []
    monkeypatch.setattr(option_names, "warn_once", warnings.append)
    assert parse_args(argv).job.print_config is expected
    assert warnings == ["command line: option job.print_args is deprecated; it is now job.print_config "
                        "(TorchTitan v0.2 naming)"]


def test_print_args_in_toml_sets_print_config(tmp_path):
    path = write_toml(tmp_path, "[job]\nprint_args = false\n")
    assert parse_args(["--job.config_file", path]).job.print_config is False
    with raises(r"option job\.print_config: 'no' is not a valid value; expected bool"):
        parse_args(["--job.config_file", write_toml(tmp_path, '[job]\nprint_args = "no"\n')])


@pytest.mark.parametrize("argv", [["--model.name", "llama4"], ["--model.name", "deepseek_v3"]])
def test_model_name_other_than_llama3_is_an_error(argv):
    with raises(rf"option model\.name: '{argv[1]}' is not one of 'llama3'"):
        parse_args(argv)
    assert parse_args(["--model.name", "llama3"]).model.name == "llama3"


# ---------------------------------------------------------------------------------------------------------------
# validate()

POSITIVE = ["training.local_batch_size", "training.seq_len", "training.steps", "metrics.log_freq",
            "training.gc_freq", "checkpoint.interval", "validation.local_batch_size", "validation.seq_len",
            "validation.freq", "profiling.profile_freq", "comm.init_timeout_seconds", "comm.train_timeout_seconds",
            "parallelism.data_parallel_replicate_degree", "parallelism.tensor_parallel_degree",
            "parallelism.pipeline_parallel_degree", "parallelism.context_parallel_degree",
            "parallelism.pipeline_parallel_microbatch_size"]


@pytest.mark.parametrize("key", POSITIVE)
@pytest.mark.parametrize("value", ["0", "-2"])
def test_options_that_must_be_positive(key, value):
    with raises(rf"option {re.escape(key)}: {value} must be a positive integer"):
        parse_args([f"--{key}", value])
    assert get_option(parse_args([f"--{key}", "1"]), key) == 1


@pytest.mark.parametrize("argv, pattern", [
    (["--parallelism.data_parallel_shard_degree", "0"], r"data_parallel_shard_degree: 0 must be -1"),
    (["--parallelism.data_parallel_shard_degree", "-2"], r"data_parallel_shard_degree: -2 must be -1"),
    (["--training.global_batch_size", "0"], r"global_batch_size: 0 must be -1 \(no accumulation\) or positive"),
    (["--training.global_batch_size", "-4"], r"global_batch_size: -4 must be -1"),
    (["--optimizer.lr", "0"], r"optimizer\.lr: 0\.0 must be positive"),
    (["--optimizer.eps", "-1e-8"], r"optimizer\.eps: -1e-08 must be positive"),
    (["--optimizer.weight_decay", "-0.1"], r"optimizer\.weight_decay: -0\.1 must not be negative"),
    (["--training.max_norm", "-1"], r"training\.max_norm: -1\.0 must not be negative"),
    (["--lr_scheduler.warmup_steps", "-1"], r"lr_scheduler\.warmup_steps: -1 must not be negative"),
    (["--metrics.peak_flops", "-1"], r"metrics\.peak_flops: -1\.0 must not be negative"),
    (["--optimizer.beta1", "1"], r"optimizer\.beta1: 1\.0 must be in \[0, 1\)"),
    (["--optimizer.beta1", "-0.1"], r"optimizer\.beta1: -0\.1 must be in \[0, 1\)"),
    (["--optimizer.beta2", "1.5"], r"optimizer\.beta2: 1\.5 must be in \[0, 1\)"),
    (["--lr_scheduler.min_lr_factor", "1.1"], r"min_lr_factor: 1\.1 must be in \[0, 1\]"),
    (["--lr_scheduler.min_lr_factor", "-0.1"], r"min_lr_factor: -0\.1 must be in \[0, 1\]"),
    (["--lr_scheduler.decay_ratio", "1.5"], r"decay_ratio: 1\.5 must be in \[0, 1\]"),
    (["--lr_scheduler.decay_ratio", "-0.5"], r"decay_ratio: -0\.5 must be in \[0, 1\]"),
    (["--activation_checkpoint.selective_ac_option", "every"], r"selective_ac_option: 'every' must be 'op' or a pos"),
    (["--activation_checkpoint.selective_ac_option", "0"], r"selective_ac_option: '0' must be 'op' or a positive"),
    (["--activation_checkpoint.selective_ac_option", "-1"], r"selective_ac_option: '-1' must be 'op' or a pos"),
    (["--compile.components", "model,optimizer"], r"compile\.components: 'optimizer' is not one of 'model', 'loss'"),
    (["--checkpoint.exclude_from_loading", "model,weights"],
     r"exclude_from_loading: 'weights' is not one of model, optimizer, lr_scheduler, dataloader, train_state"),
    (["--model.converters", "quantize.linear.mx"],
     r"model\.converters: 'quantize\.linear\.mx' is not a known converter; valid: quantize\.linear\.float8"),
    (["--checkpoint.keep_latest_k", "-1"], r"keep_latest_k: -1 must be 0 \(keep all\) or positive"),
    (["--validation.enable", "--training.seq_len", "128", "--validation.seq_len", "2048"],
     r"option validation\.seq_len: 2048 is longer than training\.seq_len = 128"),
])
def test_validate_rejects(argv, pattern):
    with raises(pattern):
        parse_args(argv)


def test_validate_accepts_the_edges_of_each_range():
    config = parse_args([
        "--parallelism.data_parallel_shard_degree", "4", "--training.global_batch_size", "16",
        "--optimizer.weight_decay", "0", "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0",
        "--optimizer.beta1", "0", "--optimizer.beta2", "0.999", "--lr_scheduler.min_lr_factor", "1",
        "--lr_scheduler.decay_ratio", "0", "--activation_checkpoint.selective_ac_option", "op",
        "--compile.components", "model,loss", "--model.converters", "float8", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.exclude_from_loading", "model,optimizer,lr_scheduler,dataloader,train_state",
    ])
    assert config.parallelism.data_parallel_shard_degree == 4
    assert config.lr_scheduler.min_lr_factor == 1.0


def test_validation_seq_len_is_only_checked_when_validation_runs():
    config = parse_args(["--training.seq_len", "128", "--validation.seq_len", "256"])
    assert config.validation.seq_len == 256
    config = parse_args(["--validation.enable", "--training.seq_len", "128", "--validation.seq_len", "64"])
    assert config.validation.seq_len == 64


def test_validation_follows_training_shape_unless_set():
    config = parse_args(["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "128",
                         "--training.local_batch_size", "4"])
    assert (config.validation.enable, config.validation.seq_len, config.validation.local_batch_size) == (True, None,
                                                                                                          None)
    assert validation_shape(config) == (4, 128)
    config = parse_args(["--training.seq_len", "128", "--validation.local_batch_size", "2",
                         "--validation.seq_len", "64"])
    assert validation_shape(config) == (2, 64)
    # Unset stays unset in the saved config, so that re-running it with another training.seq_len still works.
    saved_validation = to_toml(parse_args([])).split("[validation]")[1]
    assert "seq_len" not in saved_validation and "local_batch_size" not in saved_validation


def test_selective_ac_option_is_only_checked_in_selective_mode():
    config = parse_args(["--activation_checkpoint.mode", "full", "--activation_checkpoint.selective_ac_option", "x"])
    assert config.activation_checkpoint.mode == "full"


def test_validate_also_checks_toml_values(tmp_path):
    path = write_toml(tmp_path, "[training]\nlocal_batch_size = 0\n")
    with raises(r"option training\.local_batch_size: 0 must be a positive integer"):
        parse_args(["--job.config_file", path])


# ---------------------------------------------------------------------------------------------------------------
# Each method's own table ([optimizer.muon], [comm.loco], ...), declared next to its implementation

def test_every_method_table_is_an_option_table_with_help(capsys):
    """The registered methods' tables are sections like any other: --help lists them with their docstrings."""
    from torchtitan.components.optimizers import method_options as optimizer_tables
    from torchtitan.distributed.compression import method_options as comm_tables

    specs = option_specs()
    tables = [f"optimizer.{t}" for t in optimizer_tables()] + [f"comm.{t}" for t in comm_tables()]
    assert {"optimizer.flexdemo", "optimizer.galore", "optimizer.muon", "optimizer.ranger21", "comm.loco"} <= set(tables)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for table in tables:
        assert f"[{table}]" in text
        keys = [key for key in specs if key.rpartition(".")[0] == table]
        assert keys and all(specs[key].doc for key in keys), table
    assert "--optimizer.muon.ns_steps (int, default: 5)" in text
    assert not any(key.startswith(("optimizer.muon_", "optimizer.methods", "comm.loco_")) for key in specs)


def test_method_options_by_their_table_in_toml_and_on_the_command_line(tmp_path):
    path = write_toml(tmp_path, "[optimizer]\nname = \"Muon\"\n[optimizer.muon]\nns_steps = 3\n"
                                "[comm.loco]\nbeta = 0.5\n[optimizer.ranger21]\ngradient_centralization = false\n")
    config = parse_args(["--job.config_file", path, "--optimizer.muon.momentum", "0.9",
                         "--optimizer.galore.svd", "exact", "--comm.loco.reset_interval=8"])
    assert (config.optimizer.muon.ns_steps, config.optimizer.muon.momentum) == (3, 0.9)
    assert (config.comm.loco.beta, config.comm.loco.reset_interval) == (0.5, 8)
    assert config.optimizer.galore.svd == "exact" and config.optimizer.ranger21.gradient_centralization is False
    assert parse_args(["--optimizer.ranger21.no_gradient_centralization"]).optimizer.ranger21.gradient_centralization \
        is False
    # The saved config reads back to the same one, tables included.
    assert parse_args(["--job.config_file", write_toml(tmp_path, to_toml(config), "again.toml")]).optimizer == \
        config.optimizer
    with raises(r"option optimizer\.muon\.ns_steps: 'many' is not a valid value; expected int"):
        parse_args(["--optimizer.muon.ns_steps", "many"])


@pytest.mark.parametrize("argv, where", [
    (["--optimizer.muon_ns_steps", "3"], "command line"),
    (["--optimizer.muon_ns_steps=3"], "command line"),
    (None, "config file"),
])
def test_old_flat_method_options_still_work_with_one_deprecation_line(argv, where, tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(option_names, "warn_once", warnings.append)
    if argv is None:
        path = write_toml(tmp_path, "[optimizer]\nmuon_ns_steps = 3\n")
        argv, where = ["--job.config_file", path], f"config file {path}"
    assert parse_args(argv).optimizer.muon.ns_steps == 3
    assert warnings == [f"{where}: option optimizer.muon_ns_steps is deprecated; it is now optimizer.muon.ns_steps "
                        f"(each method's options are in its own table, [optimizer.muon]; the old name goes in the "
                        f"next release)"]


def test_every_old_flat_method_option_names_its_table_option():
    old = {key: new for key, (new, _) in option_names.deprecated_aliases().items() if key != "job.print_args"}
    assert {"optimizer.demo_chunk_size": "optimizer.flexdemo.chunk_size", "optimizer.galore_rank": "optimizer.galore.rank",
            "optimizer.ranger_agc_clip": "optimizer.ranger21.agc_clip", "comm.loco_beta": "comm.loco.beta",
            "optimizer.muon_momentum": "optimizer.muon.momentum"}.items() <= old.items()
    # flexdemo 3, ranger21 7, galore 5, muon 2, loco 2: the flat options job_config.py held before the tables
    assert len(old) == 19 and set(old.values()) <= set(option_specs())
    parse_args(["--optimizer.no_ranger_gradient_centralization", "--comm.loco_reset_interval", "0"])


@pytest.mark.parametrize("argv, hint", [
    (["--optimizer.muon.ns_step", "3"], "optimizer.muon.ns_steps"),
    (["--optimizer.ns_steps", "3"], "optimizer.muon.ns_steps"),
    (["--comm.loco.betta", "0.5"], "comm.loco.beta"),
])
def test_did_you_mean_covers_the_method_tables(argv, hint):
    with raises(rf"unknown option {re.escape(argv[0][2:])}; did you mean {re.escape(hint)}\?"):
        parse_args(argv)
