"""torch's private names live in torch_compat only; a torch that lacks one imports everything and refuses only the
feature that needs it, in one line; the public fallbacks compute what the private names did."""

import ast
import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.unit.forked_ranks import join_forked
from torchtitan.config import JobConfig
from torchtitan.distributed import torch_compat
from torchtitan.distributed.torch_compat import FEATURES, PRIVATE_NAMES

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[2]

# One configuration per feature that asks for that feature and no other (on the CPU, unless FEATURE_DEVICES says
# otherwise), as TOML-style overrides.
RING = {"parallelism.context_parallel_degree": 2, "parallelism.context_parallel_method": "ring"}
FEATURE_CONFIGS = {
    "dry_run": {"comm.mode": "fake_backend"},
    "cpu_ring_attention": RING,
    "cp_rotate_method": {**RING, "parallelism.context_parallel_rotate_method": "alltoall"},
    "activation_checkpointing": {"activation_checkpoint.mode": "full"},
    "async_tp": {"parallelism.enable_async_tensor_parallel": True},
    "fsdp_hooks": {"comm.gradient_compression": "loco"},
    "pipeline_csv": {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule_csv": "x.csv"},
    "pipeline_eval": {"validation.enable": True},
    "hf_sharded_checkpoint": {"checkpoint.last_save_in_hf": True},
    "memory_snapshot": {"profiling.enable_memory_snapshot": True},
    "low_precision_optimizers": {"optimizer.name": "AdamW-8bit"},
}


def config_with(overrides: dict) -> JobConfig:
    config = JobConfig()
    config.activation_checkpoint.mode = "none"
    for key, value in overrides.items():
        *sections, name = key.split(".")
        target = config
        for section in sections:
            target = getattr(target, section)
        setattr(target, name, value)
    return config


# The ring on the CPU asks for cpu_ring_attention too.
FEATURE_DEVICES = {"cp_rotate_method": "cuda"}


def requested(feature: str) -> list[str]:
    # validation.enable asks for the pipeline's forward-only eval only with a multi-stage schedule.
    return torch_compat.requested_features(config_with(FEATURE_CONFIGS[feature]), FEATURE_DEVICES.get(feature, "cpu"),
                                           multi_stage_pipeline=feature == "pipeline_eval")


@pytest.fixture
def without(monkeypatch):
    """Make this torch lack one entry of PRIVATE_NAMES (every path it may take), as a future release could."""
    def remove(key: str) -> None:
        resolve = torch_compat._resolve

        def resolve_without(path: str):
            if path in PRIVATE_NAMES[key].paths:
                raise AttributeError(f"{path} removed by the test")
            return resolve(path)
        monkeypatch.setattr(torch_compat, "_resolve", resolve_without)
        torch_compat.lookup.cache_clear()
    yield remove
    torch_compat.lookup.cache_clear()


def _private_torch_references(path: Path) -> list[str]:
    """Imports of private torch modules or names, and `torch._x` attribute chains, in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [alias.name for alias in node.names]
            if "._" in node.module or any(name.startswith("_") for name in names):
                found.append(f"{path.name}:{node.lineno} from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] == "torch" and "._" in alias.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            # torch.ops.<namespace>.<op> names operators, not Python modules.
            if isinstance(value, ast.Name) and value.id == "torch" and chain[-1] != "ops":
                found.append(f"{path.name}:{node.lineno} torch.{'.'.join(reversed(chain))}")
    return found


def test_no_module_but_torch_compat_reaches_a_private_torch_name():
    offenders = [reference for path in sorted((ROOT / "torchtitan").rglob("*.py"))
                 if path.name != "torch_compat.py" for reference in _private_torch_references(path)]
    assert offenders == [], "private torch names outside torchtitan/distributed/torch_compat.py:\n" + \
        "\n".join(offenders)


def test_the_scan_finds_private_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nfrom torch.distributed._tools import x\nfrom torch.fx import _y\n"
                      "import torch._dynamo\nz = torch._inductor.config\nw = torch.ops.aten._foo.default\n")
    assert len(_private_torch_references(sample)) == 4


def test_every_private_name_is_found_in_this_torch():
    """On a tested torch every entry resolves: a release that renames one fails here first."""
    # Names only newer releases have, whose absence the callers handle (see their entries).
    optional = {"PipelineInferenceMode", "resolve_group", "group_or_group_name"}
    if torch.__version__.split("+")[0].rsplit(".", 1)[0] not in torch_compat.TESTED_TORCH:
        pytest.skip(f"torch {torch.__version__} is not a tested release")
    missing = [key for key in PRIVATE_NAMES if torch_compat.lookup(key) is None and key not in optional]
    assert missing == [], f"torch {torch.__version__} lacks {missing}"


def test_every_feature_has_a_configuration_that_asks_for_it_alone():
    assert set(FEATURE_CONFIGS) == set(FEATURES)
    for feature in FEATURES:
        assert requested(feature) == [feature]
    assert torch_compat.requested_features(JobConfig(), "cpu") == ["activation_checkpointing"]
    # Context parallelism's default method (and block-causal CP) gathers keys and values with public collectives.
    for overrides in ({"parallelism.context_parallel_degree": 2},
                      {"parallelism.context_parallel_degree": 2, "model.attention_mask": "block_causal"}):
        assert torch_compat.requested_features(config_with(overrides), "cpu") == []


@pytest.mark.parametrize("key", list(PRIVATE_NAMES))
def test_a_missing_private_name_refuses_only_its_feature(without, key):
    without(key)
    feature = PRIVATE_NAMES[key].feature
    for other in FEATURES:
        config, device = config_with(FEATURE_CONFIGS[other]), FEATURE_DEVICES.get(other, "cpu")
        if other == feature:
            with pytest.raises(torch_compat.TorchLacks) as error:
                torch_compat.require_torch_features(config, device, multi_stage_pipeline=other == "pipeline_eval")
            message = str(error.value)
            assert "\n" not in message and torch.__version__ in message and PRIVATE_NAMES[key].paths[0] in message
            assert FEATURES[feature].asked_by.split(" ")[0] in message, message
        else:
            torch_compat.require_torch_features(config, device, multi_stage_pipeline=other == "pipeline_eval")


def test_every_module_imports_on_a_torch_without_any_private_name():
    """A subprocess removes every private name of PRIVATE_NAMES from torch (modules made unimportable, attributes
    deleted), then imports every module of the package and parses the trainer's options."""
    public_modules = sorted({node.module for path in (ROOT / "torchtitan").rglob("*.py")
                             for node in ast.walk(ast.parse(path.read_text()))
                             if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch"})
    script = f"""
import importlib, pkgutil, sys
import torch
# torch's own public modules first: they import its private ones, which must be whole while they load.
for name in {public_modules!r}:
    importlib.import_module(name)
from torchtitan.distributed.torch_compat import PRIVATE_NAMES
for entry in PRIVATE_NAMES.values():
    for path in entry.paths:
        module_name, _, attributes = path.partition(":")
        if not attributes:
            sys.modules[module_name] = None
            continue
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        names = attributes.split(".")
        # The last name, or where it cannot be deleted (a property), the object that holds it.
        for depth in range(len(names), 0, -1):
            owner = importlib.import_module(module_name)
            for parent in names[:depth - 1]:
                owner = getattr(owner, parent, None)
            try:
                delattr(owner, names[depth - 1])
                break
            except (AttributeError, TypeError):
                continue
import torchtitan
for module in pkgutil.walk_packages(torchtitan.__path__, "torchtitan."):
    importlib.import_module(module.name)
from torchtitan.config import parse_args
parse_args(["--training.steps", "1"])
from torchtitan.distributed import torch_compat
assert all(torch_compat.missing_names(feature) for feature in torch_compat.FEATURES), "a feature still works"
print("imported", len(list(pkgutil.walk_packages(torchtitan.__path__, "torchtitan."))), flush=True)
import os
os._exit(0)  # torch's own exit hooks would read the names removed above
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported" in result.stdout


def test_version_aware_lookup_takes_the_first_path_this_torch_has(without):
    assert torch_compat.found_path("set_rotate_method") in PRIVATE_NAMES["set_rotate_method"].paths
    without("set_rotate_method")
    assert torch_compat.found_path("set_rotate_method") is None
    with pytest.raises(torch_compat.TorchLacks, match="context_parallel_rotate_method = 'alltoall'"):
        torch_compat.get("set_rotate_method")


def test_is_fake_without_fake_tensors(without):
    without("is_fake")
    assert torch_compat.is_fake(torch.zeros(1)) is False


def test_a_missing_base_class_refuses_when_instantiated(without):
    without("MemTracker")
    stand_in = torch_compat.private_base("MemTracker")

    class Tracker(stand_in):
        pass
    with pytest.raises(torch_compat.TorchLacks, match="fake_backend"):
        Tracker()


def test_set_element_nests_as_dcp_does():
    from torchtitan.components.checkpoint.safe_io import set_element

    state = {}
    set_element(state, ("optimizer", "param_groups", 1, "lr"), 0.5)
    set_element(state, ("optimizer", "state", "w", "step"), 3)
    set_element(state, ("model", "w"), 1)
    assert state == {"optimizer": {"param_groups": [None, {"lr": 0.5}], "state": {"w": {"step": 3}}}, "model": {"w": 1}}


# ------------------------------------------------------------------------------------------------------------------
# Public fallbacks, exercised with the private name removed


def _flattened_mesh_worker(rank: int, out_dir: str, use_private: bool) -> None:
    from torchtitan.distributed.parallel_dims import ParallelDims

    if not use_private:
        torch_compat.PRIVATE_NAMES["DeviceMesh._flatten"] = torch_compat.PrivateName(("no.such:module",), None)
        torch_compat.lookup.cache_clear()
    dist.init_process_group("gloo", rank=rank, world_size=4, store=dist.FileStore(f"{out_dir}/store", 4),
                            timeout=datetime.timedelta(seconds=60))
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, world_size=4)
    dims.build_mesh("cpu")
    values = torch.tensor([float(rank)])
    sums = {}
    for name in ("dp", "dp_shard_cp", "dp_cp"):
        total = values.clone()
        dist.all_reduce(total, group=dims.get_mesh(name).get_group())
        sums[name] = total.item()
    hsdp = dims.get_mesh("hsdp")
    sums["hsdp_shape"] = tuple(hsdp.mesh.shape)
    torch.save(sums, f"{out_dir}/rank{rank}_{use_private}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("use_private", [True, False], ids=["DeviceMesh._flatten", "public-constructor"])
def test_flattened_meshes_group_the_same_ranks_either_way(tmp_path, use_private):
    join_forked(_flattened_mesh_worker, (str(tmp_path), use_private), 4, 120, "mesh workers")
    for rank in range(4):
        sums = torch.load(tmp_path / f"rank{rank}_{use_private}.pt")
        shard_peer = rank ^ 1  # (dp_replicate, dp_shard) = (rank // 2, rank % 2)
        assert sums["dp"] == sums["dp_cp"] == 6.0
        assert sums["dp_shard_cp"] == rank + shard_peer
        assert sums["hsdp_shape"] == (2, 2)


def _gather_worker(rank: int, out_dir: str, use_private: bool) -> None:
    if not use_private:
        for key in ("all_gather_autograd", "all_gather_tensor"):
            torch_compat.PRIVATE_NAMES[key] = torch_compat.PrivateName(("no.such:module",), None)
        torch_compat.lookup.cache_clear()
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(f"{out_dir}/store", 2),
                            timeout=datetime.timedelta(seconds=60))
    local = torch.arange(6.0).reshape(1, 2, 3).add(10 * rank).requires_grad_()
    gathered = torch_compat.all_gather_autograd_function()(local, 2, dist.group.WORLD)
    (gathered * torch.arange(1.0, 7.0)).sum().backward()
    plain = torch_compat.all_gather(local.detach(), 2, dist.group.WORLD)
    torch.save({"gathered": gathered.detach(), "plain": plain, "grad": local.grad}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("use_private", [True, False], ids=["functional-collectives", "torch.distributed.nn"])
def test_key_value_gather_and_its_backward_either_way(tmp_path, use_private):
    join_forked(_gather_worker, (str(tmp_path), use_private), 2, 120, "gather workers")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    expected = torch.cat([torch.arange(6.0).reshape(1, 2, 3) + 10 * rank for rank in range(2)], dim=2)
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], expected) and torch.equal(result["plain"], expected)
        # Each rank's loss weighs the gathered tensor by 1..6; its gradient is its own slice, summed over 2 ranks.
        assert torch.equal(result["grad"], 2 * torch.arange(1.0, 7.0)[3 * rank:3 * rank + 3].expand(1, 2, 3))


def test_ddp_without_fsdps_replicate_replicates_with_fully_shard(without):
    from torch.distributed.fsdp import FSDPModule

    from torchtitan.distributed.fsdp import apply_ddp
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.models.llama3.model import Transformer

    without("replicate")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        dims = ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=1, world_size=2)
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(model_args_for("tiny", 32))
        apply_ddp(model, mesh["dp_replicate"], dims.get_mesh("hsdp"), param_dtype="float32", reduce_dtype="float32")
        assert isinstance(model, FSDPModule)
        weight = model.layers["0"].attention.wq.weight
        # Every rank holds the whole parameter: a one-rank shard dimension under replication.
        assert weight.to_local().shape == weight.shape
        assert [type(p).__name__ for p in weight.placements] == ["Replicate", "Shard"]
    finally:
        dist.destroy_process_group()


def test_train_timeout_without_the_private_setter_keeps_the_init_timeout(without, caplog):
    from torchtitan.distributed import utils as dist_utils

    without("set_pg_timeout")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dist_utils.set_train_timeout(5)
    finally:
        dist.destroy_process_group()
    assert "comm.train_timeout_seconds" in caplog.text and "init_timeout_seconds" in caplog.text


def test_the_tested_range_is_stated_where_users_read_it():
    readme, pyproject = (ROOT / "README.md").read_text(), (ROOT / "pyproject.toml").read_text()
    oldest = min(torch_compat.TESTED_TORCH, key=lambda v: tuple(map(int, v.split("."))))
    assert f'"torch>={oldest}"' in pyproject
    for version in torch_compat.TESTED_TORCH:
        assert version in readme
