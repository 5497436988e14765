"""Learning-rate schedules, the scheduler container's state, optimizer construction, and the loss."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.components.loss import IGNORE_INDEX, count_valid_tokens, cross_entropy_sum
from torchtitan.components.lr_scheduler import LRSchedulersContainer, lr_factor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer_groups import param_groups
from torchtitan.config.job_config import LRScheduler, Optimizer
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer

PEAK_LR = 0.5


def optimizers(model: nn.Module | None = None, **changes) -> OptimizersContainer:
    model = model if model is not None else nn.Linear(2, 2)
    return OptimizersContainer([model], dataclasses.replace(Optimizer(lr=PEAK_LR, implementation="for-loop"),
                                                           **changes))


def schedule(total_steps: int, **changes) -> list[float]:
    """The learning-rate multiplier used by each of the `total_steps` updates, read from the optimizer."""
    container = optimizers()
    schedulers = LRSchedulersContainer(container, dataclasses.replace(LRScheduler(), **changes), total_steps)
    factors = []
    for _ in range(total_steps):
        group_lrs = {group["lr"] for opt in container.optimizers for group in opt.param_groups}
        assert len(group_lrs) == 1
        factors.append(group_lrs.pop() / PEAK_LR)
        assert schedulers.last_lr == pytest.approx(factors[-1] * PEAK_LR)
        container.step()
        schedulers.step()
    return factors


def approx(values: list[float]):
    return pytest.approx(values, rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Schedules


def test_linear_warmup_then_linear_decay_to_zero():
    factors = schedule(10, warmup_steps=4, decay_type="linear")
    # Warmup: (step + 1) / (warmup + 1), so the first update already moves the weights.
    assert factors[:4] == approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    # Decay over the remaining 6 steps; the last update uses the minimum.
    assert factors[4:] == approx([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0])


@pytest.mark.parametrize("decay_type, remaining", [
    ("linear", lambda p: 1 - p),
    ("sqrt", lambda p: 1 - math.sqrt(p)),
    ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
])
def test_decay_shapes_with_min_lr_factor(decay_type, remaining):
    factors = schedule(12, warmup_steps=2, decay_type=decay_type, min_lr_factor=0.1)
    progress = [k / 10 for k in range(1, 11)]
    assert factors[2:] == approx([0.1 + 0.9 * remaining(p) for p in progress])
    assert factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(factors[2:], factors[3:])), "decay must be strictly decreasing"


def test_sqrt_and_cosine_differ_from_linear_mid_decay():
    linear, sqrt, cosine = (schedule(20, warmup_steps=0, decay_type=t)[9] for t in ("linear", "sqrt", "cosine"))
    assert linear == pytest.approx(0.5)
    assert sqrt == pytest.approx(1 - math.sqrt(0.5))
    assert cosine == pytest.approx(0.5)
    assert sqrt < linear
    assert schedule(20, warmup_steps=0, decay_type="cosine")[2] > schedule(20, warmup_steps=0)[2]


def test_decay_ratio_gives_warmup_stable_decay():
    factors = schedule(20, warmup_steps=3, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.2)
    assert factors[:3] == approx([1 / 4, 2 / 4, 3 / 4])
    assert factors[3:15] == approx([1.0] * 12)
    assert factors[15:] == approx([0.2 + 0.8 * (1 - k / 5) for k in range(1, 6)])


def test_decay_ratio_zero_never_decays():
    assert schedule(8, warmup_steps=2, decay_ratio=0.0)[2:] == approx([1.0] * 6)


def test_decay_ratio_larger_than_what_warmup_leaves_is_capped():
    factors = schedule(10, warmup_steps=6, decay_ratio=0.9)
    assert factors[:6] == approx([k / 7 for k in range(1, 7)])
    assert factors[6:] == approx([3 / 4, 2 / 4, 1 / 4, 0.0])


@pytest.mark.parametrize("decay_ratio", [None, 0.5])
def test_warmup_longer_than_training_only_warms_up(decay_ratio):
    factors = schedule(5, warmup_steps=100, decay_ratio=decay_ratio, min_lr_factor=0.3)
    assert factors == approx([k / 6 for k in range(1, 6)])


def test_without_warmup_the_first_update_already_decays():
    factors = schedule(4, warmup_steps=0)
    assert factors == approx([3 / 4, 2 / 4, 1 / 4, 0.0])


def test_lr_factor_is_a_pure_function_of_the_step():
    kwargs = dict(warmup_steps=2, decay_steps=4, total_steps=10, decay_type="cosine", min_lr_factor=0.0)
    assert lr_factor(1, **kwargs) == pytest.approx(2 / 3)
    assert lr_factor(5, **kwargs) == 1.0
    assert lr_factor(9, **kwargs) == pytest.approx(0.0)
    assert lr_factor(50, **kwargs) == pytest.approx(0.0)


def test_scheduler_state_round_trip_gives_the_same_next_lr():
    config = LRScheduler(warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
    original_optimizers = optimizers()
    original = LRSchedulersContainer(original_optimizers, config, 20)
    for _ in range(13):
        original_optimizers.step()
        original.step()
    state = original.state_dict()
    assert state == {"last_epoch": 13}

    restored_optimizers = optimizers()
    restored = LRSchedulersContainer(restored_optimizers, config, 20)
    assert restored.last_lr != pytest.approx(original.last_lr)
    restored.load_state_dict(state)
    assert restored.last_lr == pytest.approx(original.last_lr)
    assert restored_optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(original.last_lr)
    for _ in range(5):
        original_optimizers.step()
        restored_optimizers.step()
        original.step()
        restored.step()
        assert restored.last_lr == pytest.approx(original.last_lr)
        assert restored_optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(
            original_optimizers.optimizers[0].param_groups[0]["lr"])


def test_one_scheduler_per_model_part_stepped_together():
    container = OptimizersContainer([nn.Linear(2, 2), nn.Linear(3, 3)], Optimizer(lr=PEAK_LR))
    schedulers = LRSchedulersContainer(container, LRScheduler(warmup_steps=2), 6)
    assert len(schedulers.schedulers) == 2
    for _ in range(2):
        container.step()
        schedulers.step()
    assert [opt.param_groups[0]["lr"] for opt in container.optimizers] == approx([PEAK_LR * 3 / 4, PEAK_LR * 3 / 4])
    schedulers.load_state_dict({"last_epoch": 5})
    assert [opt.param_groups[0]["lr"] for opt in container.optimizers] == approx([0.0, 0.0])


# ---------------------------------------------------------------------------------------------------------------
# Optimizer


def tiny_model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(model_args_for("tiny", 16))
    return model.to_empty(device="cpu")


def names_by_weight_decay(model: nn.Module, groups: list[dict]) -> dict[float, set[str]]:
    name_of = {id(p): name for name, p in model.named_parameters()}
    by_decay: dict[float, set[str]] = {}
    for group in groups:
        by_decay.setdefault(group["weight_decay"], set()).update(name_of[id(p)] for p in group["params"])
    return by_decay


def test_norms_and_embeddings_get_no_weight_decay_by_default():
    model = tiny_model()
    by_decay = names_by_weight_decay(model, param_groups(model, Optimizer(weight_decay=0.1)))
    assert set(by_decay) == {0.1, 0.0}
    no_decay = {name for name, _ in model.named_parameters() if name.endswith("norm.weight")}
    no_decay.add("tok_embeddings.weight")
    assert by_decay[0.0] == no_decay
    assert len(no_decay) == 2 * 4 + 2
    assert "output.weight" in by_decay[0.1]
    assert "layers.3.feed_forward.w2.weight" in by_decay[0.1]
    assert by_decay[0.1] | by_decay[0.0] == {name for name, _ in model.named_parameters()}


def test_decay_norms_and_embeddings_decays_everything():
    model = tiny_model()
    groups = param_groups(model, Optimizer(weight_decay=0.05, decay_norms_and_embeddings=True))
    assert names_by_weight_decay(model, groups) == {0.05: {name for name, _ in model.named_parameters()}}


def test_frozen_parameters_are_left_out():
    model = tiny_model()
    model.tok_embeddings.weight.requires_grad_(False)
    names = set().union(*names_by_weight_decay(model, param_groups(model, Optimizer())).values())
    assert "tok_embeddings.weight" not in names and "norm.weight" in names


def test_optimizer_class_and_hyperparameters():
    adamw = optimizers(name="AdamW", lr=0.01, beta1=0.8, beta2=0.9, eps=1e-6).optimizers[0]
    adam = optimizers(name="Adam").optimizers[0]
    assert type(adamw) is torch.optim.AdamW
    assert type(adam) is torch.optim.Adam
    group = adamw.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (0.01, (0.8, 0.9), 1e-6)


@pytest.mark.parametrize("implementation, flags", [
    ("fused", {"fused": True}), ("foreach", {"foreach": True, "fused": None}),
    ("for-loop", {"foreach": False, "fused": None}),
])
def test_optimizer_implementation(implementation, flags):
    group = optimizers(implementation=implementation).optimizers[0].param_groups[0]
    assert {key: group[key] for key in flags} == flags


def test_adamw_decays_decoupled_while_adam_adds_an_l2_gradient():
    # With a zero gradient, AdamW only shrinks the weight by lr * weight_decay; Adam turns weight_decay * w into a
    # gradient, and its normalised first step moves the weight by about lr.
    results = {}
    for name in ("AdamW", "Adam"):
        weight = nn.Parameter(torch.full((3,), 2.0))
        optimizer = OptimizersContainer([nn.ParameterList([weight])],
                                        Optimizer(name=name, lr=0.1, weight_decay=0.1, implementation="for-loop"))
        weight.grad = torch.zeros_like(weight)
        optimizer.step()
        results[name] = weight.detach()
    torch.testing.assert_close(results["AdamW"], torch.full((3,), 2.0 * (1 - 0.1 * 0.1)))
    torch.testing.assert_close(results["Adam"], torch.full((3,), 2.0 - 0.1), atol=1e-6, rtol=0)


def test_zero_grad_sets_gradients_to_none():
    model = nn.Linear(2, 2)
    container = optimizers(model)
    model(torch.ones(1, 2)).sum().backward()
    container.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Loss


def test_cross_entropy_sum_ignores_ignore_index_and_matches_f_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    labels[0, 1] = labels[1, 4] = labels[1, 0] = IGNORE_INDEX
    loss = cross_entropy_sum(logits, labels)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 11), labels.view(-1), reduction="sum",
                                                     ignore_index=IGNORE_INDEX))
    valid = labels != IGNORE_INDEX
    manual = -torch.log_softmax(logits[valid], dim=-1).gather(1, labels[valid][:, None]).sum()
    torch.testing.assert_close(loss, manual)
    assert count_valid_tokens(labels).item() == 7
    all_ignored = torch.full_like(labels, IGNORE_INDEX)
    assert cross_entropy_sum(logits, all_ignored).item() == 0.0
    assert count_valid_tokens(all_ignored).item() == 0


def test_cross_entropy_sum_computes_in_float32_for_bfloat16_logits():
    logits = torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(1)).bfloat16()
    labels = torch.tensor([[0, 3, 6, 2]])
    loss = cross_entropy_sum(logits, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float().view(-1, 7), labels.view(-1), reduction="sum"))
