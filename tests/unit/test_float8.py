"""Float8 conversion (torchao): which layers convert, and the real float8 kernel on CPU against its emulation."""

import pytest
import torch
from torch import nn

from torchtitan.components.float8 import apply_float8
from torchtitan.config import parse_args
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer

FLOAT8 = ["--model.converters", "quantize.linear.float8"]


def two_layers() -> nn.Sequential:
    """Layers of a million weights, the smallest that real float8 kernels convert."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))


def output_and_grad(recipe: str, emulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model = two_layers()
    apply_float8(model, parse_args([*FLOAT8, "--quantize.linear.float8.recipe_name", recipe,
                                    *(["--quantize.linear.float8.emulate"] if emulate else [])]))
    assert all(type(layer).__name__ == "Float8Linear" for layer in model)
    model = model.to(torch.bfloat16)
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = model(x)
    y.float().pow(2).sum().backward()
    return y.float(), model[0].weight.grad.float()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_float8_kernel_on_cpu_matches_emulation(recipe):
    """torch._scaled_mm on CPU (e4m3 inputs, higher-precision accumulation) computes what torchao emulates."""
    real_out, real_grad = output_and_grad(recipe, emulate=False)
    emulated_out, emulated_grad = output_and_grad(recipe, emulate=True)
    assert (real_out - emulated_out).norm() <= 1e-4 * emulated_out.norm()
    assert (real_grad - emulated_grad).norm() <= 1e-4 * emulated_grad.norm()
    # And float8 stays near the bf16 computation it replaces (e4m3 keeps 3 mantissa bits: a few % per element).
    reference = two_layers().to(torch.bfloat16)
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = reference(x).float()
    assert (real_out - expected).norm() <= 0.1 * expected.norm()


def test_filters_keep_small_misaligned_and_named_layers_in_high_precision():
    model = nn.ModuleDict({"big": nn.Linear(1024, 1024), "small": nn.Linear(256, 256),
                           "misaligned": nn.Linear(1024, 1030), "output": nn.Linear(1024, 2048)})
    apply_float8(model, parse_args(FLOAT8))
    assert {name: type(layer).__name__ for name, layer in model.items()} == {
        "big": "Float8Linear", "small": "Linear", "misaligned": "Linear", "output": "Linear"}


def test_emulation_converts_small_layers_too():
    with torch.device("meta"):
        model = Transformer(model_args_for("tiny", 32))
    apply_float8(model, parse_args([*FLOAT8, "--quantize.linear.float8.emulate"]))
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert type(model.output).__name__ == "Linear"


def test_nothing_to_convert_is_an_error_not_a_silent_bf16_run():
    with torch.device("meta"):
        model = Transformer(model_args_for("debugmodel", 256))
    with pytest.raises(UserError, match=r"option model.converters: float8 would convert no linear layer .* "
                                        r"quantize.linear.float8.emulate = true"):
        apply_float8(model, parse_args(FLOAT8))
