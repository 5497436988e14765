"""Nothing below the models imports a model: distributed/, components/ and tools/ (and config/, nn/, protocols.py,
which stand below them) take what they need of one from its ModelSpec or from torchtitan/nn/. The registry and a
second family (tests/integration/parallel_block_model.py, trained in tests/integration/test_second_model.py): its
refusals, and what a family without a Hugging Face format refuses."""

from pathlib import Path

import pytest

from tests.integration import parallel_block_model
from tests.unit.test_planner_imports import PACKAGE_ROOT, _module_name, imported_modules
from torchtitan import models
from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.config import parse_args
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.dry_run import dry_run_config
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for, model_shape
from torchtitan.planner.memory import estimate

BELOW_THE_MODELS = ["distributed", "components", "tools", "config", "nn", "protocols.py"]


def model_imports(path: Path) -> list[str]:
    return sorted(name for name in imported_modules(path)
                  if name == "torchtitan.models" or name.startswith("torchtitan.models."))


def test_nothing_below_the_models_imports_a_model():
    paths = {below: [PACKAGE_ROOT / below] if below.endswith(".py") else sorted((PACKAGE_ROOT / below).rglob("*.py"))
             for below in BELOW_THE_MODELS}
    assert all(path.is_file() for found in paths.values() for path in found) and all(paths.values())
    upward = {_module_name(path): model_imports(path) for found in paths.values() for path in found}
    assert {module: names for module, names in upward.items() if names} == {}


def test_the_check_sees_an_import_of_a_model_inside_a_function(tmp_path):
    source = tmp_path / "late.py"
    source.write_text("def f():\n    from torchtitan.models.llama3.model import Transformer\n"
                      "    from torchtitan import models\n")
    assert model_imports(source) == ["torchtitan.models", "torchtitan.models.llama3.model"]


def test_model_name_picks_a_registered_family():
    assert models.spec_of(parse_args([])).name == "llama3"
    config = parse_args(["--model.name", parallel_block_model.NAME])
    assert models.spec_of(config).build_model is parallel_block_model.ParallelBlockTransformer
    with pytest.raises(UserError, match=rf"^option model\.name: 'llama4' is not one of 'llama3', "
                                        rf"'{parallel_block_model.NAME}'$"):
        models.get("llama4")
    with pytest.raises(ValueError, match="registered already"):
        models.register(models.get("llama3"))


def test_custom_import_that_does_not_import_names_the_option():
    with pytest.raises(UserError, match=r"^option job\.custom_import: 'tests\.no_such_module' cannot be imported"):
        models.spec_of(parse_args(["--job.custom_import", "tests.no_such_module"]))


def test_the_second_family_refuses_tensor_parallelism():
    spec = models.get(parallel_block_model.NAME)
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, world_size=2)
    with pytest.raises(UserError, match=r"^option parallelism\.tensor_parallel_degree: model llama3_parallel_blocks "
                                        r"has no tensor-parallel plan; use 1$"):
        spec.validate_parallelism(model_args_for("tiny", 32), dims, config, "cpu")


@pytest.mark.parametrize("option", ["initial_load_in_hf", "last_save_in_hf"])
def test_a_family_without_hugging_face_format_refuses_its_options(tmp_path, option):
    config = CheckpointConfig(enable=True, **{option: True})
    with pytest.raises(UserError, match=rf"^option checkpoint\.{option}: the model family \(model\.name\) has no "
                                        rf"Hugging Face format"):
        CheckpointManager(config, str(tmp_path), [], None, None, None, TrainState(),
                          model_shape(model_args_for("tiny", 32)), hf_adapter=None)


def test_the_planner_refuses_another_family():
    """The planner's memory model is Llama's: neither its estimate nor a compiled dry run (which reports it) takes
    another family."""
    config = parse_args(["--model.name", parallel_block_model.NAME, "--model.flavor", "tiny"])
    with pytest.raises(UserError, match=r"^option model\.name: the planner's memory estimate models llama3 only, not "
                                        r"'llama3_parallel_blocks'; measure the model's memory with a dry run"):
        estimate(config, 8)
    config.compile.enable = True
    with pytest.raises(UserError, match=r"^option model\.name: .*; a compiled dry run reports it .* set "
                                        r"compile\.enable = false$"):
        dry_run_config(config, 8)


def test_a_checkpoint_of_another_family_with_the_same_shape_is_refused(tmp_path):
    """The second family has Llama's parameter names and shapes: only the family's name in model.json tells them
    apart."""
    import json

    from torchtitan.components.checkpoint import MODEL_FILE, check_model_shape

    args = model_args_for("tiny", 32)
    llama = models.get("llama3").recorded_shape(args)
    (tmp_path / MODEL_FILE).write_text(json.dumps(llama.record))
    check_model_shape(tmp_path, llama)
    with pytest.raises(UserError, match=rf"was saved from another model: model llama3 \(this run: "
                                        rf"{parallel_block_model.NAME}\); set model.name"):
        check_model_shape(tmp_path, models.get(parallel_block_model.NAME).recorded_shape(args))
