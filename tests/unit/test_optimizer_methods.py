"""The optimizers of torchtitan/components/optimizers/ on one process: low-precision AdamW and Ranger21.
(Their sharded behaviour is tested against one process in tests/integration/test_parallel_parity.py.)"""

import dataclasses

import pytest
import torch
from torch import nn

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizers import optimizer_spec
from torchtitan.config.job_config import Optimizer


def container(model: nn.Module, name: str, ranger21: dict | None = None, **changes) -> OptimizersContainer:
    """`changes` to [optimizer], `ranger21` to [optimizer.ranger21]."""
    config = dataclasses.replace(Optimizer(name=name, lr=1e-2, implementation="for-loop"), **changes)
    for option, value in (ranger21 or {}).items():
        setattr(config.ranger21, option, value)
    return OptimizersContainer([model], config)


def matrices(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False))


def train_steps(model: nn.Module, optimizers: OptimizersContainer, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizers.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        optimizers.step()


def test_bf16_state_follows_adamw():
    """bf16 moments, fp32 weights: the first step is AdamW's (its moments are not yet rounded); later steps stay
    within bf16's rounding of it."""
    reference, model = matrices(), matrices()
    adamw, bf16 = container(reference, "AdamW"), container(model, "AdamW-bf16")
    train_steps(reference, adamw, 1)
    train_steps(model, bf16, 1)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    train_steps(reference, adamw, 5)
    train_steps(model, bf16, 5)
    state = bf16.optimizers[0].state[model[0].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert model[0].weight.dtype == torch.float32
    drift = max(((a - b).abs().max() / (a.abs().max())).item() for a, b in zip(reference.parameters(),
                                                                                 model.parameters()))
    assert 0 < drift < 1e-2
    step_counters = 2 * 4
    assert bf16.state_bytes() - step_counters == (adamw.state_bytes() - step_counters) / 2


def assert_same_after_three_steps(straight, straight_optimizers, resumed, resumed_optimizers):
    """Both runs take the same three batches; their weights must stay bitwise equal."""
    for steps in range(3):
        torch.manual_seed(10 + steps)
        batch = torch.randn(8, 256)
        for model, optimizers in ((straight, straight_optimizers), (resumed, resumed_optimizers)):
            optimizers.zero_grad()
            model(batch).square().mean().backward()
            optimizers.step()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_bf16_state_resumes_in_bf16_and_exactly():
    """torch's Optimizer.load_state_dict casts state tensors to the parameter's dtype: loaded moments must go back
    to bf16, or the resumed run keeps fp32 moments (twice the memory) and steps differently."""
    straight, resumed = matrices(), matrices()
    straight_optimizer, first = container(straight, "AdamW-bf16"), container(resumed, "AdamW-bf16")
    train_steps(straight, straight_optimizer, 3)
    train_steps(resumed, first, 3)
    second = container(resumed, "AdamW-bf16")
    second.optimizers[0].load_state_dict(first.optimizers[0].state_dict())
    state = second.optimizers[0].state[resumed[0].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert_same_after_three_steps(straight, straight_optimizer, resumed, second)


@pytest.mark.parametrize("name, most", [pytest.param("AdamW-8bit", 0.30, marks=pytest.mark.slow), ("AdamW-4bit", 0.16)])
def test_torchao_state_is_small_and_counted_by_its_codes(name, most):
    model = matrices()
    low, adamw = container(model, name), container(matrices(), "AdamW")
    train_steps(model, low, 2)
    train_steps(adamw.model_parts[0], adamw, 2)
    ratio = low.state_bytes() / adamw.state_bytes()
    assert ratio <= most
    spec = optimizer_spec(name)
    predicted = sum(spec.state_bytes(tuple(p.shape), tuple(p.shape), Optimizer(), False) for p in model.parameters())
    assert low.state_bytes() == pytest.approx(predicted, rel=1e-3)  # the step counters aside


@pytest.mark.parametrize("name", ["AdamW-8bit", "AdamW-4bit"])
def test_torchao_state_is_saved_dequantized_and_resumes_bitwise(name):
    """The checkpointed moments are fp32 values shaped like the parameter (reshardable like AdamW's); loading them
    quantizes them again into the very codes they came from, including the blocks whose largest magnitude is
    negative, which torchao's own quantization of the dequantized values gets wrong."""
    straight, resumed = matrices(), matrices()
    straight_optimizers, first = container(straight, name), container(resumed, name)
    train_steps(straight, straight_optimizers, 3)
    train_steps(resumed, first, 3)
    saved = first.state_dict()
    weight = resumed[0].weight
    moments = {key: value for key, value in saved.items() if key.startswith("state.0.weight.exp_avg")}
    assert sorted(moments) == ["state.0.weight.exp_avg", "state.0.weight.exp_avg_sq"]
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 and v.shape == weight.shape
               for v in moments.values())
    live = first.optimizers[0].state[weight]["exp_avg"]
    torchao_alone = type(live).zeros(weight.shape, True, live.block_size)
    torchao_alone.copy_(moments["state.0.weight.exp_avg"])
    assert not torch.equal(torchao_alone.dequantize(), live.dequantize())

    first.zero_grad()  # as in a trainer that loads before its first step: torch initialises the state to load into
    second = container(resumed, name)
    second.load_state_dict(saved)
    for param in resumed.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            before, after = first.optimizers[0].state[param][key], second.optimizers[0].state[param][key]
            assert type(after) is type(before)
            assert torch.equal(after.dequantize(), before.dequantize())
    assert_same_after_three_steps(straight, straight_optimizers, resumed, second)


def test_ranger21_state_and_lookahead():
    """Lookahead with alpha 0 brings the weights back to the slow weights at every k-th step."""
    model = matrices()
    initial = [p.detach().clone() for p in model.parameters()]
    ranger = container(model, "Ranger21", {"lookahead_steps": 2, "lookahead_alpha": 0.0})
    train_steps(model, ranger, 1)
    assert not torch.equal(model[0].weight, initial[0])
    train_steps(model, ranger, 1)
    for p, start in zip(model.parameters(), initial):
        assert torch.equal(p, start)
    assert set(ranger.optimizers[0].state[model[0].weight]) == {"step", "exp_avg", "neg_exp_avg", "exp_avg_sq",
                                                                 "slow_weights"}
    assert ranger.state_bytes() == 16 * sum(p.numel() for p in model.parameters()) + 2 * 4  # and step counters


def test_ranger21_gradient_centralization_removes_row_constant_gradients():
    """A gradient constant along each row is all mean: centralized, it leaves nothing to step by. (Integer rows
    keep the mean exact; without clipping, which would scale them.)"""
    weight = nn.Parameter(torch.randn(4, 8))
    start = weight.detach().clone()
    ranger = container(nn.ParameterList([weight]), "Ranger21",
                       {"norm_loss": 0.0, "lookahead_steps": 0, "agc_clip": 0.0}, weight_decay=0.0)
    weight.grad = torch.arange(4.0).view(4, 1).expand(4, 8).contiguous()
    ranger.step()
    torch.testing.assert_close(weight.detach(), start)
    ranger = container(nn.ParameterList([weight]), "Ranger21", {"norm_loss": 0.0, "lookahead_steps": 0, "agc_clip": 0.0,
                                                                    "gradient_centralization": False}, weight_decay=0.0)
    weight.grad = torch.arange(4.0).view(4, 1).expand(4, 8).contiguous()
    ranger.step()
    assert not torch.allclose(weight.detach(), start)


def test_ranger21_adaptive_clipping_bounds_each_rows_gradient():
    """Row 0's gradient is 1000x its weight: clipped to 1% of the weight norm, while row 1's passes unchanged;
    Adam's first step is the sign either way, so the clipping shows in the momentum (without the normalisation by
    the gradient's standard deviation, which would rescale both rows)."""
    weight = nn.Parameter(torch.ones(2, 4))
    ranger = container(nn.ParameterList([weight]), "Ranger21",
                       {"gradient_centralization": False, "gradient_normalization": False, "lookahead_steps": 0})
    weight.grad = torch.tensor([[1000.0] * 4, [1e-4] * 4])
    ranger.step()
    beta1_squared = 0.9 ** 2
    momentum = ranger.optimizers[0].state[weight]["exp_avg"] / (1 - beta1_squared)
    torch.testing.assert_close(torch.linalg.vector_norm(momentum, dim=1), torch.tensor([0.01 * 2, 2e-4]))
