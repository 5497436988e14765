"""The optimizer registry and the parameter groups with their per-group rules."""

import dataclasses
import typing

import pytest
import torch
from torch import nn

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer_groups import GROUP_NAMES, check_matrix_groups, classify, param_groups
from torchtitan.components.optimizers import optimizer_names, optimizer_spec
from torchtitan.config.job_config import Optimizer
from torchtitan.config.manager import parse_args
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer


def tiny_model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(model_args_for("tiny", 16))
    return model.to_empty(device="cpu")


def test_config_choices_are_the_registered_optimizers():
    choices = typing.get_args(typing.get_type_hints(Optimizer)["name"])
    assert sorted(choices) == sorted(optimizer_names())


def test_unknown_name_is_one_user_error_naming_the_valid_ones():
    with pytest.raises(UserError, match=r"^option optimizer.name: 'SGD' is not one of 'AdamW', 'Adam', .*'FlexDeMo'"):
        optimizer_spec("SGD")
    with pytest.raises(UserError, match="optimizer.name: 'Lion'"):
        OptimizersContainer([nn.Linear(2, 2)], dataclasses.replace(Optimizer(), name="Lion"))


def test_groups_classify_every_parameter():
    model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "norm": nn.LayerNorm(4), "proj": nn.Linear(4, 4),
                           "output": nn.Linear(4, 10, bias=False)})
    assert classify(model) == {"emb.weight": "embeddings", "norm.weight": "norms", "norm.bias": "norms",
                               "proj.weight": "hidden_matrices", "proj.bias": "other", "output.weight": "output"}
    groups = classify(tiny_model())
    assert groups["tok_embeddings.weight"] == "embeddings" and groups["output.weight"] == "output"
    assert groups["layers.0.attention.wq.weight"] == "hidden_matrices" and groups["norm.weight"] == "norms"
    assert set(groups.values()) == set(GROUP_NAMES) - {"other"}


def test_toml_overrides_per_group(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[optimizer]\nlr = 0.01\nweight_decay = 0.2\n"
                    "[optimizer.groups.embeddings]\nlr_scale = 0.5\nweight_decay = 0.05\n"
                    "[optimizer.groups.hidden_matrices]\nmatrix_method = false\n")
    config = parse_args(["--job.config_file", str(toml), "--optimizer.groups.norms.lr_scale", "2"]).optimizer
    by_name = {g["group"]: g for g in param_groups(tiny_model(), config)}
    assert list(by_name) == ["hidden_matrices", "output", "embeddings", "norms"]
    assert (by_name["embeddings"]["lr"], by_name["embeddings"]["weight_decay"]) == (0.005, 0.05)
    assert (by_name["norms"]["lr"], by_name["norms"]["weight_decay"]) == (0.02, 0.0)
    assert (by_name["output"]["lr"], by_name["output"]["weight_decay"]) == (0.01, 0.2)
    assert not any(g["matrix_method"] for g in by_name.values())
    assert parse_args([]).optimizer.groups.hidden_matrices.matrix_method


def test_negative_group_rule_is_one_user_error():
    with pytest.raises(UserError, match=r"^option optimizer.groups.output.lr_scale: -1.0 must not be negative$"):
        parse_args(["--optimizer.groups.output.lr_scale", "-1"])


def test_group_learning_rates_follow_the_schedule():
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.config.job_config import LRScheduler
    config = Optimizer(lr=0.1)
    config.groups.norms.lr_scale = 0.25
    container = OptimizersContainer([tiny_model()], config)
    LRSchedulersContainer(container, LRScheduler(warmup_steps=3), total_steps=10)
    lrs = {g["group"]: g["lr"] for g in container.optimizers[0].param_groups}
    assert lrs["norms"] == pytest.approx(lrs["hidden_matrices"] / 4) and lrs["hidden_matrices"] == pytest.approx(0.025)


def test_matrix_method_checks():
    model = tiny_model()
    groups = param_groups(model, Optimizer())
    check_matrix_groups("Muon", groups)  # hidden_matrices: 2-D, matrix_method true by default
    config = Optimizer()
    config.groups.norms.matrix_method = True
    with pytest.raises(UserError, match=r"^option optimizer.groups.norms.matrix_method: true, but Muon treats 2-D "
                                        r"weights only and norms holds tensors of shape \(64,\); set it to false$"):
        check_matrix_groups("Muon", param_groups(model, config))
    config = Optimizer()
    config.groups.hidden_matrices.matrix_method = False
    with pytest.raises(UserError, match=r"^option optimizer.name: Muon needs 2-D weights .* one of: "
                                        r"hidden_matrices, output, embeddings$"):
        check_matrix_groups("Muon", param_groups(model, config))


def test_groups_are_logged(caplog):
    with caplog.at_level("INFO"):
        OptimizersContainer([tiny_model()], Optimizer())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer AdamW, group")]
    assert len(lines) == 4
    assert any(line.startswith("optimizer AdamW, group norms: 9 tensors,") and "weight decay 0," in line
               for line in lines)


def test_default_groups_step_bit_identically_to_two_decay_groups():
    """Before the groups existed, matrices were one group with weight decay and norms and embeddings one without."""
    reference, model = tiny_model(), tiny_model()
    for m in (reference, model):
        m.init_weights(seed=0)
    undecayed = [p for n, p in reference.named_parameters() if "norm" in n or "embeddings" in n]
    decayed = [p for n, p in reference.named_parameters() if not ("norm" in n or "embeddings" in n)]
    baseline = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": undecayed,
                                                                             "weight_decay": 0.0}],
                                 lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    container = OptimizersContainer([model], Optimizer(lr=1e-2))
    for _ in range(3):
        for m in (reference, model):
            m.zero_grad()
            m(torch.arange(16).view(2, 8)).square().mean().backward()
        baseline.step()
        container.step()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_torchao_optimizers_are_refused_in_a_dry_run_on_fake_tensors():
    with pytest.raises(UserError, match=r"^option optimizer.name = 'AdamW-8bit': does not compose with comm.mode = "
                                        r"'fake_backend' on fake tensors"):
        parse_args(["--comm.mode", "fake_backend", "--optimizer.name", "AdamW-8bit"])
    # On real tensors its compiled step runs.
    parse_args(["--comm.mode", "fake_backend", "--comm.no_fake_tensors", "--optimizer.name", "AdamW-8bit"])


# FlexDeMo needs replicas: tests/unit/test_flexdemo.py and tests/integration/test_compression.py check its saving.
# torchao's compiles its step for every new shape (about 20 s here): slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("AdamW-8bit", "AdamW-4bit")
                                  else n for n in optimizer_names() if n != "FlexDeMo"])
def test_saving_changes_no_state(name):
    """A run that takes its optimizer's state_dict() after every step trains bit for bit as one that never does:
    saving reads the state and changes none of it (checkpoint.interval must not be a hyperparameter)."""
    config = Optimizer(name=name, lr=1e-2, implementation="for-loop")
    config.galore.update_gap = 2
    runs = []
    for save in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
        optimizers = OptimizersContainer([model], config)
        for step in range(4):
            torch.manual_seed(10 + step)
            optimizers.zero_grad()
            model(torch.randn(4, 32)).square().mean().backward()
            optimizers.step()
            if save:
                saved = optimizers.state_dict()
                assert saved and all(torch.isfinite(v).all() for v in saved.values() if isinstance(v, torch.Tensor))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
