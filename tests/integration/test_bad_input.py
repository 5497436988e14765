"""User mistakes end the run with exit code 2 and exactly one `error:` line that names the option or file: no
traceback, and no harm to checkpoints that were there before.

Most cases call `torchtitan.train.main` in this process (a second each instead of a torchrun start-up). Those that
need several ranks run on a fake process group of that size in this process (the mistake is found before any
real communication), and a few go through torchrun with 2 processes to cover the real path.
"""

import ast
import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.integration.harness import REPO, TINY, launch
from torchtitan import train
from torchtitan.distributed import utils as dist_utils

pytestmark = pytest.mark.integration

BASE = [*TINY, "--training.steps", "2", "--training.local_batch_size", "2", "--metrics.peak_flops", "1e12"]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.no_last_save_model_only"]


@dataclass
class Case:
    name: str
    args: list[str]
    names: str
    """Text the error line must contain: the option or file at fault ({tmp} is the case's folder)."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    """Files the case writes under {tmp} first."""
    world_size: int = 1
    """Above 1: run on a fake process group of this many ranks, of which this process is rank 0."""


CASES = [
    # The command line and the TOML file.
    Case("malformed_toml", ["--job.config_file", "{tmp}/bad.toml"], "{tmp}/bad.toml is not valid TOML",
         files={"bad.toml": "[training\nsteps = 3\n"}),
    Case("missing_config_file", ["--job.config_file", "{tmp}/absent.toml"], "option job.config_file"),
    Case("config_file_is_a_folder", ["--job.config_file", "{tmp}"],
         "option job.config_file: '{tmp}' is a folder, not a TOML file; pass one of the files in it: {tmp}/c.toml",
         files={"c.toml": "[training]\nsteps = 3\n"}),
    Case("unknown_section", ["--job.config_file", "{tmp}/c.toml"], "unknown section [trainng]",
         files={"c.toml": "[trainng]\nsteps = 3\n"}),
    Case("unknown_option_cli", ["--training.stepz", "3"], "unknown option training.stepz; did you mean training.steps"),
    Case("option_of_another_section", ["--training.lr", "1e-3"],
         "unknown option training.lr; did you mean optimizer.lr?"),
    Case("unknown_option_toml", ["--job.config_file", "{tmp}/c.toml"],
         "unknown option training.stepss; did you mean training.steps", files={"c.toml": "[training]\nstepss = 3\n"}),
    Case("wrong_type_int", ["--training.steps", "three"], "option training.steps: 'three' is not a valid value"),
    Case("wrong_type_int_toml", ["--job.config_file", "{tmp}/c.toml"], "option training.steps: 2.5",
         files={"c.toml": "[training]\nsteps = 2.5\n"}),
    Case("wrong_type_float", ["--optimizer.lr", "fast"], "option optimizer.lr: 'fast'"),
    Case("wrong_type_bool", ["--checkpoint.enable=maybe"], "option checkpoint.enable: 'maybe'"),
    Case("wrong_type_bool_toml", ["--job.config_file", "{tmp}/c.toml"], "option checkpoint.enable: 'yes'",
         files={"c.toml": "[checkpoint]\nenable = \"yes\"\n"}),
    Case("wrong_type_list_toml", ["--job.config_file", "{tmp}/c.toml"], "option model.converters: 5",
         files={"c.toml": "[model]\nconverters = 5\n"}),
    Case("bad_literal", ["--optimizer.name", "SGD"], "option optimizer.name: 'SGD' is not one of"),
    Case("renamed_option", ["--training.batch_size", "4"], "training.batch_size is now training.local_batch_size"),
    Case("unsupported_torchtitan_option", ["--parallelism.expert_parallel_degree", "2"],
         "TorchTitan option parallelism.expert_parallel_degree"),
    Case("unsupported_torchtitan_section", ["--job.config_file", "{tmp}/c.toml"], "memory_estimation.peak_gib",
         files={"c.toml": "[memory_estimation]\npeak_gib = 1\n"}),
    Case("positional_argument", ["train.toml"], "unexpected argument 'train.toml'"),
    Case("word_after_bool_flag", ["--compile.enable", "maybe"], "option compile.enable: 'maybe' is not a valid value"),
    Case("misspelt_section_suggests_section", ["--job.config_file", "{tmp}/c.toml"],
         "config file {tmp}/c.toml: unknown section [trainig]; did you mean [training]?",
         files={"c.toml": "[trainig]\nsteps = 3\n"}),
    Case("unsupported_nested_torchtitan_section", ["--job.config_file", "{tmp}/c.toml"],
         "TorchTitan option quantize.grouped_mm.float8.fqns = ['experts'] is not supported by this project (it does "
         "not implement [quantize.grouped_mm])",
         files={"c.toml": "[quantize.grouped_mm.float8]\nfqns = ['experts']\n"}),
    Case("unsupported_torchtitan_dataloader_workers", ["--job.config_file", "{tmp}/c.toml"],
         "TorchTitan option training.dataloader.num_workers = 4",
         files={"c.toml": "[training.dataloader]\nnum_workers = 4\n"}),
    Case("unsupported_torchtitan_training_dtype", ["--training.dtype", "bfloat16"], "TorchTitan option training.dtype"),
    Case("unknown_comm_mode", ["--comm.mode", "local_tensor"],
         "option comm.mode: 'local_tensor' is not one of 'default', 'fake_backend'"),
    Case("option_without_value", ["--training.steps"], "option training.steps needs a value"),
    Case("negative_steps", ["--training.steps", "-5"], "option training.steps: -5 must be a positive integer"),
    Case("zero_batch", ["--training.local_batch_size", "0"], "option training.local_batch_size: 0"),
    Case("negative_lr", ["--optimizer.lr", "-0.1"], "option optimizer.lr: -0.1 must be positive"),
    Case("beta_out_of_range", ["--optimizer.beta2", "1.5"], "option optimizer.beta2: 1.5"),
    Case("bad_exclude_from_loading", ["--checkpoint.exclude_from_loading", "weights"],
         "option checkpoint.exclude_from_loading: 'weights'"),
    Case("dump_folder_is_a_file", ["--job.dump_folder", "{tmp}/taken"], "option job.dump_folder", files={"taken": "x"}),
    # Model and parallelism.
    Case("unknown_flavor", ["--model.flavor", "tiny2"], "option model.flavor: unknown flavor 'tiny2'"),
    Case("unknown_model_name", ["--model.name", "llama4"], "option model.name: 'llama4' is not one of 'llama3'"),
    Case("unknown_converter", ["--model.converters", "int4"], "option model.converters: 'int4'"),
    Case("float8_rowwise_with_float8_all_gather",
         ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise",
          "--quantize.linear.float8.enable_fsdp_float8_all_gather"],
         "option quantize.linear.float8.enable_fsdp_float8_all_gather"),
    Case("degrees_exceed_world_size", ["--parallelism.tensor_parallel_degree", "2"],
         "tensor_parallel_degree x pipeline_parallel_degree = 1 x 1 x 2 x 1 = 2 does not divide the world size 1"),
    Case("global_batch_not_divisible", ["--training.global_batch_size", "3"], "option training.global_batch_size: 3"),
    Case("tp_not_dividing_heads", ["--parallelism.tensor_parallel_degree", "3"],
         "option parallelism.tensor_parallel_degree: 3 does not divide n_heads (8)", world_size=3),
    Case("cp_seq_len_not_divisible", ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"],
         "option training.seq_len: 30 must be divisible", world_size=2),
    Case("pp_more_stages_than_layers", ["--parallelism.pipeline_parallel_degree", "8",
                                        "--parallelism.pipeline_parallel_schedule", "GPipe"],
         "option parallelism.pipeline_parallel_degree: 8 pipeline stages", world_size=8),
    Case("bad_schedule_name", ["--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_schedule", "1F2B"],
         "option parallelism.pipeline_parallel_schedule: unknown schedule '1F2B'", world_size=2),
    Case("seed_checkpoint_with_two_ranks", ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"],
         "option checkpoint.create_seed_checkpoint: run it with one process", world_size=2),
    Case("cpu_offload_on_cpu", ["--training.enable_cpu_offload"], "option training.enable_cpu_offload"),
    Case("async_tp_on_cpu", ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel",
                             "--compile.enable"], "option parallelism.enable_async_tensor_parallel", world_size=2),
    # Tokenizer and data.
    Case("missing_tokenizer", ["--model.hf_assets_path", "{tmp}/no_tokenizer"], "{tmp}/no_tokenizer does not exist"),
    Case("missing_tokenizer_path", ["--model.tokenizer_path", "{tmp}/absent.model"],
         "model.tokenizer_path: {tmp}/absent.model does not exist"),
    Case("corrupt_tokenizer", ["--model.hf_assets_path", "{tmp}/tokenizer.model"], "{tmp}/tokenizer.model",
         files={"tokenizer.model": b"\x00\xffnot base64 at all\n"}),
    Case("missing_dataset_path", ["--training.dataset_path", "{tmp}/absent.jsonl"],
         "training.dataset_path='{tmp}/absent.jsonl' does not exist"),
    Case("empty_dataset", ["--training.dataset_path", "{tmp}/empty.jsonl"], "{tmp}/empty.jsonl' has no documents",
         files={"empty.jsonl": ""}),
    Case("dataset_of_blank_lines", ["--training.dataset_path", "{tmp}/blank.jsonl"],
         "training.dataset_path='{tmp}/blank.jsonl' has no documents", files={"blank.jsonl": "\n\n\n"}),
    Case("dataset_of_empty_json_list", ["--training.dataset_path", "{tmp}/empty.json"],
         "training.dataset_path='{tmp}/empty.json' has no documents", files={"empty.json": "[]\n"}),
    Case("validation_dataset_of_blank_lines", ["--validation.enable", "--validation.seq_len", "32",
                                               "--validation.dataset_path", "{tmp}/blank.jsonl"],
         "validation.dataset_path='{tmp}/blank.jsonl' has no documents", files={"blank.jsonl": "\n\n\n"}),
    Case("missing_text_field", ["--training.dataset_path", "{tmp}/data.jsonl"],
         "{tmp}/data.jsonl line 1 has no field 'text' (it has 'content'); set training.dataset_text_field",
         files={"data.jsonl": '{"content": "some text"}\n' * 4}),
    Case("malformed_jsonl_line", ["--training.dataset_path", "{tmp}/data.jsonl"],
         "training.dataset_path='{tmp}/data.jsonl': {tmp}/data.jsonl line 3 is not valid JSON: Expecting ',' delimiter",
         files={"data.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": "c" "d"}\n'}),
    Case("model_dim_not_divisible_by_heads", ["--model.dim", "100"],
         "option model.dim: 100 is not divisible by model.n_heads = 8"),
    Case("model_odd_head_dim", ["--model.dim", "72", "--model.n_heads", "8"],
         "option model.n_heads: dim / n_heads = 72 / 8 = 9 is odd"),
    Case("model_kv_heads_do_not_divide_heads", ["--model.n_kv_heads", "3"],
         "option model.n_kv_heads: 3 does not divide model.n_heads = 8"),
    Case("model_vocab_smaller_than_tokenizer", ["--model.vocab_size", "1000"],
         "option model.vocab_size: 1000 is smaller than the tokenizer's vocabulary (2304 tokens)"),
    Case("model_layers_not_positive", ["--model.n_layers", "0"], "option model.n_layers: 0 must be a positive integer"),
    Case("unknown_dataset_name", ["--training.dataset", "c5"], "training.dataset='c5' is not a known dataset"),
    Case("data_runs_out", ["--training.dataset_path", "{tmp}/short.jsonl", "--training.no_dataset_loop",
                           "--training.steps", "50"], "option training.dataset_loop: the data ran out at step",
         files={"short.jsonl": '{"text": "a short document about nothing in particular"}\n' * 8}),
    # Checkpoints that are not there.
    Case("missing_initial_load_path", ["--checkpoint.enable", "--checkpoint.initial_load_path", "{tmp}/nowhere"],
         "option checkpoint.initial_load_path: {tmp}/nowhere does not exist"),
]


def fake_process_group(world_size: int):
    """Stands in for init_distributed: this process becomes rank 0 of `world_size` ranks that never talk."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(init_timeout_seconds: int, trace_buf_size: int = 0, trace_folder: str | None = None,
             fake_rank: tuple[int, int] | None = None, fake_on_device: bool = False) -> torch.device:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        return torch.device("cpu")

    return init


def run_main(args: list[str], capsys) -> tuple[int, str]:
    code = train.main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_one_error(code: int, output: str, names: str, expected_code: int = train.EXIT_USER_ERROR) -> str:
    errors = [line for line in output.splitlines() if "error:" in line]
    assert code == expected_code, f"exit code {code}:\n{output[-4000:]}"
    assert len(errors) == 1, f"{len(errors)} error lines:\n{output[-4000:]}"
    assert names in errors[0], f"{names!r} not in {errors[0]!r}"
    assert "Traceback" not in output, output[-4000:]
    print(f"bad input -> {errors[0].split('error: ', 1)[1]}")
    return errors[0]


@pytest.fixture(autouse=True)
def no_launcher_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input(case, tmp_path, capsys, monkeypatch):
    for name, content in case.files.items():
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    if case.world_size > 1:
        monkeypatch.setattr(dist_utils, "init_distributed", fake_process_group(case.world_size))
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in case.args]
    code, output = run_main([*BASE, "--job.dump_folder", str(tmp_path / "dump"), *args], capsys)
    assert_one_error(code, output, case.names.replace("{tmp}", str(tmp_path)))
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: a good one is made first, and must be byte-identical after the failed run.


def file_digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A dump folder with complete checkpoints of steps 1 and 2 (full state: model, optimizer, ...)."""
    dump = tmp_path_factory.mktemp("good")
    assert train.main([*BASE, *CHECKPOINT, "--job.dump_folder", str(dump)]) == 0
    return dump


@pytest.fixture
def dump(good_run, tmp_path) -> Path:
    copy = tmp_path / "dump"
    shutil.copytree(good_run, copy)
    return copy


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def write_shards(dump: Path, damage=None) -> None:
    """Token shards of a small corpus under {dump}/shards, then `damage` done to that folder."""
    from scripts import tokenize_dataset

    (dump / "corpus.jsonl").write_text("".join(f'{{"text": "document {i} with a few words"}}\n' for i in range(300)))
    tokenize_dataset.tokenize(str(dump / "corpus.jsonl"), str(dump / "shards"), documents_per_shard=100,
                              progress=False)
    if damage is not None:
        damage(dump / "shards")


def another_tokenizer(shards: Path) -> None:
    manifest = (shards / "manifest.json").read_text()
    (shards / "manifest.json").write_text(re.sub(r'"sha256": "[0-9a-f]{64}",\n  "vocab', '"sha256": "' + "1" * 64
                                                 + '",\n  "vocab', manifest, count=1))


def corrupt_ids(shards: Path) -> None:
    """Every token id beyond the vocabulary (as a flipped high bit would make them): found when a window is read.
    The index's checksums are erased (not recorded), so that the ids, not the checksum, are what is checked."""
    for shard in shards.glob("shard-*.bin"):
        shard.write_bytes(b"\xff\xfe" * (shard.stat().st_size // 2))
    index = np.load(shards / "shards.npy")
    index[2:] = 0
    np.save(shards / "shards.npy", index)


CHECKPOINT_CASES = [
    # (name, damage done to the copy of the good run before resuming, extra options, text the error names)
    # A shard is opened (and its size checked) when a window first needs it: every one is truncated, so that the
    # first read fails, before a step could save a checkpoint.
    ("truncated_token_shard", lambda d: write_shards(d, lambda s: [truncate(f) for f in s.glob("shard-*.bin")]),
     ["--training.dataset_path", "{dump}/shards", "--checkpoint.exclude_from_loading", "dataloader"],
     "{dump}/shards/shard-0000"),
    # Read by the reader threads: the error reaches the training loop as it does without them.
    ("corrupt_token_shard_read_in_background", lambda d: write_shards(d, corrupt_ids),
     ["--training.dataset_path", "{dump}/shards", "--training.num_workers", "2", "--checkpoint.exclude_from_loading",
      "dataloader"],
     "{dump}/shards': tokens 99..132 hold id 65279, beyond the vocabulary of 2304 (corrupt shard)"),
    ("token_shards_of_another_tokenizer", lambda d: write_shards(d, another_tokenizer),
     ["--training.dataset_path", "{dump}/shards"], "the shards were made with tokenizer 'tokenizer.model' (sha256 111"),
    ("mixture_weights_sum_to_zero", None, ["--training.sources", "{dump}/a.jsonl:0,{dump}/b.jsonl:0"],
     "option training.sources: the weights"),
    ("mixture_source_unreachable", None, ["--training.sources", "{dump}/absent.jsonl:0.5,{dump}/b.jsonl:0.5"],
     "training.sources entry='{dump}/absent.jsonl' does not exist"),
    ("load_step_absent", None, ["--checkpoint.load_step", "7"], "option checkpoint.load_step: step 7"),
    ("another_model_shape", None, ["--model.flavor", "debugmodel"],
     "was saved from another model: dim 64 (this run: 256), n_layers 4 (this run: 6)"),
    # Same parameter shapes (8 heads of 8 = 4 heads of 16): only the saved model.json tells them apart.
    ("another_head_count", None, ["--model.n_heads", "4", "--model.n_kv_heads", "2"],
     "was saved from another model: n_heads 8 (this run: 4), n_kv_heads 4 (this run: 2); set model.name, "
     "model.flavor and the [model] shape options it was trained with"),
    ("another_rope_theta", None, ["--model.rope_theta", "10000"],
     "was saved from another model: rope_theta 500000.0 (this run: 10000.0)"),
    ("truncated_shard", lambda d: truncate(next((d / "checkpoint/step-2").glob("*.distcp"))), [],
     "checkpoint {dump}/checkpoint/step-2 cannot be loaded (corrupt"),
    ("truncated_metadata", lambda d: truncate(d / "checkpoint/step-2/.metadata"), [],
     "checkpoint {dump}/checkpoint/step-2: .metadata cannot be read"),
    ("initial_load_path_not_a_checkpoint", None,
     ["--checkpoint.folder", "elsewhere", "--checkpoint.initial_load_path", "{dump}/checkpoint"],
     "checkpoint {dump}/checkpoint has no .metadata file"),
]


@pytest.mark.parametrize("name,damage,options,names", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint_input(dump, capsys, name, damage, options, names):
    if damage is not None:
        damage(dump)
    before = file_digests(dump / "checkpoint")
    args = [arg.replace("{dump}", str(dump)) for arg in options]
    code, output = run_main([*BASE, *CHECKPOINT, "--training.steps", "4", "--job.dump_folder", str(dump), *args],
                            capsys)
    assert_one_error(code, output, names.replace("{dump}", str(dump)))
    assert file_digests(dump / "checkpoint") == before


@pytest.fixture
def small_disk(tmp_path):
    """A 9 MiB tmpfs: room for one checkpoint of the tiny model with its optimizer state (6 MiB), not two."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); "
                    f"tests/unit/test_checkpoint.py simulates a full disk instead")
    try:
        yield mount_point
    finally:
        unmounted = subprocess.run(["umount", str(mount_point)], capture_output=True, text=True, timeout=30)
        if unmounted.returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount_point)], capture_output=True, timeout=30)
    # A busy file system means the failed run left a file open.
    assert unmounted.returncode == 0, unmounted.stderr


def test_disk_full_during_save(small_disk, capsys):
    dump = small_disk / "dump"
    assert train.main([*BASE, *CHECKPOINT, "--training.steps", "1", "--job.dump_folder", str(dump)]) == 0
    capsys.readouterr()
    before = file_digests(dump / "checkpoint")
    code, output = run_main([*BASE, *CHECKPOINT, "--training.steps", "3", "--job.dump_folder", str(dump)], capsys)
    error = assert_one_error(code, output, "saving the checkpoint of step 2 into")
    assert "No space left on device" in error
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1"]
    assert file_digests(dump / "checkpoint") == before


# ----------------------------------------------------------------------------------------------------------------
# Weights & Biases


def test_wandb_not_installed(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    code, output = run_main([*BASE, "--metrics.enable_wandb", "--job.dump_folder", str(tmp_path)], capsys)
    assert_one_error(code, output, "metrics.enable_wandb is true but wandb cannot be imported")


def wandb_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """W&B in a process of its own (wandb.init leaves state behind in the process that calls it), with an empty
    HOME and settings folder so that no key is found but the one given."""
    return {"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), **variables}


def test_wandb_without_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    proc = launch(tmp_path / "dump", 1, [*BASE, "--metrics.enable_wandb"], timeout=120,
                  env=wandb_env(tmp_path, WANDB_MODE="online"))
    assert_one_error(proc.returncode, proc.stdout, "metrics.enable_wandb is true but W&B failed to start")


# ----------------------------------------------------------------------------------------------------------------
# Mistakes only several processes can make: through torchrun with 2 processes.

MULTI_PROCESS_CASES = [
    ("degrees_do_not_divide_world_size", ["--parallelism.tensor_parallel_degree", "3"],
     "= 3 does not divide the world size 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,options,names", MULTI_PROCESS_CASES, ids=[c[0] for c in MULTI_PROCESS_CASES])
def test_bad_input_two_processes(tmp_path, name, options, names):
    """torchrun itself prints a traceback (ChildFailedError) when a worker fails; each worker's own output, which
    --redirects sends to a file, must hold one error line and none."""
    logs = tmp_path / "logs"
    proc = launch(tmp_path / "dump", 2, [*BASE, *options], timeout=180,
                  launcher_args=["--log-dir", str(logs), "--redirects", "3"])
    assert proc.returncode != 0
    assert "exitcode  : 2" in proc.stdout, proc.stdout[-4000:]
    for rank in (0, 1):
        (attempt,) = logs.glob(f"*/attempt_0/{rank}")
        output = (attempt / "stdout.log").read_text() + (attempt / "stderr.log").read_text()
        errors = [line for line in output.splitlines() if "error:" in line]
        assert len(errors) == 1 and names in errors[0], output[-4000:]
        assert "Traceback" not in output, output[-4000:]


# ----------------------------------------------------------------------------------------------------------------
# Safety: untrusted files never run code, secrets never reach the outputs, files are replaced atomically.

PACKAGE = Path(train.__file__).parent


def package_calls() -> list[tuple[str, ast.Call]]:
    """Every call in the package's, the scripts' and the benchmarks' source, with the file it is in."""
    calls = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "scripts").rglob("*.py"),
                        *(REPO / "benchmarks").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        calls += [(str(path.relative_to(REPO)), node) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return calls


def dotted(node: ast.expr) -> str:
    """`torch.load` for the expression torch.load, '' for anything that is not a plain dotted name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_every_torch_load_is_weights_only():
    for path in PACKAGE.rglob("*.py"):
        assert not re.search(r"from torch(\.serialization)? import [^\n]*\bload\b", path.read_text()), \
            f"{path}: torch.load imported under another name escapes this check"
    loads = [(where, call) for where, call in package_calls()
             if dotted(call.func) in ("torch.load", "torch.serialization.load")]
    assert loads, "no torch.load found: the scan is broken"
    for where, call in loads:
        value = keyword(call, "weights_only")
        assert isinstance(value, ast.Constant) and value.value is True, f"{where}:{call.lineno} torch.load without " \
                                                                       f"weights_only=True"
    # DCP's default load planner unpickles with weights_only=False, and its FileSystemReader reads .metadata with
    # plain pickle: every DCP load names a planner and a reader, and nothing else builds that reader.
    for where, call in package_calls():
        name = dotted(call.func)
        if name in ("dcp.load", "torch.distributed.checkpoint.load"):
            assert keyword(call, "planner") is not None, f"{where}:{call.lineno} DCP load with the default planner"
            assert keyword(call, "storage_reader") is not None, f"{where}:{call.lineno} DCP load, default reader"
        assert name.split(".")[-1] not in ("FileSystemReader", "dcp_to_torch_save"), f"{where}:{call.lineno} {name}"


def test_nothing_evaluates_or_unpickles_input():
    forbidden = {"eval", "exec", "compile", "__import__", "pickle.load", "pickle.loads", "yaml.load", "marshal.loads"}
    found = [f"{where}:{call.lineno} {dotted(call.func)}" for where, call in package_calls()
             if dotted(call.func) in forbidden]
    assert not found, found


def test_hugging_face_export_is_safetensors(tmp_path, capsys):
    from safetensors import safe_open

    code, output = run_main([*BASE, "--training.steps", "1", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                             "--job.dump_folder", str(tmp_path)], capsys)
    assert code == 0, output[-4000:]
    export = tmp_path / "checkpoint" / "step-1"
    weights = sorted(path.name for path in export.iterdir() if path.suffix != ".json")
    assert weights and all(name.endswith(".safetensors") for name in weights), weights
    for name in weights:
        with safe_open(str(export / name), framework="pt") as f:
            assert f.keys()


def test_wandb_api_key_never_written(tmp_path):
    secret = "secret-xyz"
    dump = tmp_path / "dump"
    proc = launch(dump, 1, [*BASE, "--metrics.enable_wandb", "--job.print_args"], timeout=120,
                  env=wandb_env(tmp_path, WANDB_MODE="offline", WANDB_API_KEY=secret))
    assert proc.returncode == 0, proc.stdout[-4000:]
    written = [path for path in dump.rglob("*") if path.is_file()]
    assert {"config.toml", "metrics.jsonl"} <= {path.name for path in written}
    assert any("wandb" in path.parts for path in written), "W&B wrote nothing: the check would be vacuous"
    assert secret not in proc.stdout
    leaks = [str(path) for path in written if secret.encode() in path.read_bytes()]
    assert not leaks, leaks


def test_config_is_replaced_atomically(tmp_path, monkeypatch):
    """A crash while config.toml is being written (here: the disk fills half-way) leaves the previous one whole."""
    from torchtitan.config import JobConfig, save_config

    path = save_config(JobConfig(), str(tmp_path))
    before = path.read_bytes()
    open_file = os.fdopen

    class FillsHalfWay:
        """The file being written, on a disk that fills half-way through the write."""

        def __init__(self, fd, *args, **kwargs):
            self.file = open_file(fd, *args, **kwargs)

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.file.close()

    monkeypatch.setattr(os, "fdopen", FillsHalfWay)
    changed = JobConfig()
    changed.training.steps = 7
    with pytest.raises(OSError, match="No space left"):
        save_config(changed, str(tmp_path))
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path], "the temporary file is removed"


def test_out_of_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
    """A layout too large for the device fails the same way on every rerun: one line with torch's account of it and
    the options that lower the peak, exit code 2, not a traceback."""
    def out_of_memory(self, batches):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.25 GiB "
            "is free. Including non-PyTorch memory, this process has 77.93 GiB memory in use. Of the allocated memory "
            "70.1 GiB is allocated by PyTorch")

    monkeypatch.setattr(train.Trainer, "train_step", out_of_memory)
    code, output = run_main([*BASE, "--job.dump_folder", str(tmp_path / "dump")], capsys)
    line = assert_one_error(code, output, "step 1: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                          "capacity of 79.19 GiB of which 1.25 GiB is free. The layout does not fit")
    assert "training.local_batch_size" in line and "activation_checkpoint.mode" in line
