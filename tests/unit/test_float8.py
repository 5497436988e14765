"""Float8 conversion (torchao): which layers convert, and the real float8 kernel on CPU against its emulation."""

import pytest
import torch
import torchao.float8.float8_ops as float8_ops
from torch import nn

from torchtitan.components.float8 import apply_float8
from torchtitan.config import parse_args
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer

FLOAT8 = ["--model.converters", "quantize.linear.float8"]
FP32_UNIT_ROUNDOFF = 2.0**-24
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float32: FP32_UNIT_ROUNDOFF}


def float8_layer(recipe: str, emulate: bool) -> nn.Linear:
    """One layer of a million weights, the smallest that real float8 kernels convert."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False))
    apply_float8(model, parse_args([*FLOAT8, "--quantize.linear.float8.recipe_name", recipe,
                                    *(["--quantize.linear.float8.emulate"] if emulate else [])]))
    assert type(model[0]).__name__ == "Float8Linear"
    return model.to(torch.bfloat16)[0]


def layer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The activation and the output's gradient, fixed so that both paths quantize the same values."""
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(32, 1024, generator=generator).to(torch.bfloat16),
            torch.randn(32, 1024, generator=generator).to(torch.bfloat16))


def real_float8_products(layer: nn.Linear, x: torch.Tensor, grad_output: torch.Tensor, monkeypatch):
    """Runs the layer forward and backward on torch._scaled_mm; returns each GEMM's dequantized fp64 operands and
    output, as torchao hands them to the kernel (float8 data with its scales, so the reference sees exactly the
    quantized values)."""
    products = []
    unwrapped = float8_ops.addmm_float8_unwrapped

    def recording(a_data, a_scale, b_data, b_scale, output_dtype, **kwargs):
        output = unwrapped(a_data, a_scale, b_data, b_scale, output_dtype, **kwargs)
        products.append((a_data.double() / a_scale.double(), b_data.double() / b_scale.double(), output))
        return output

    monkeypatch.setattr(float8_ops, "addmm_float8_unwrapped", recording)
    layer(x).backward(grad_output)
    return products


def assert_within_accumulation_bound(output: torch.Tensor, a: torch.Tensor, b: torch.Tensor, output_roundings=2):
    """Each element of `output` is the product a @ b as fp32 accumulation and rounding to the output dtype allow.

    The standard bound for a length-K dot product summed in fp32 is gamma * (|a| @ |b|), gamma = n*u / (1 - n*u)
    with u = 2^-24 and n = K + 3 (the reduction, plus the scales' reciprocal and product). Each rounding to the
    output dtype adds at most its unit roundoff relative to the value rounded; there are at most two (rowwise
    scaling rescales the kernel's bf16 output). Nothing here is measured: a kernel that accumulates in bf16 misses
    this bound by several times (test below)."""
    reference = a @ b
    magnitude = a.abs() @ b.abs()
    n = a.shape[1] + 3
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    rounding = (1 + UNIT_ROUNDOFF[output.dtype]) ** output_roundings - 1
    bound = gamma * magnitude + rounding * (reference.abs() + gamma * magnitude)
    excess = (output.double() - reference).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements outside the fp32-accumulation bound"


def test_the_bound_rejects_a_product_accumulated_in_bf16():
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(32, 1024, generator=generator), torch.randn(1024, 64, generator=generator)
    a, b = a.to(torch.float8_e4m3fn).double(), b.to(torch.float8_e4m3fn).double()
    assert_within_accumulation_bound((a @ b).to(torch.bfloat16), a, b)
    accumulated = torch.zeros(32, 64, dtype=torch.bfloat16)
    for k in range(a.shape[1]):
        accumulated += (a[:, k:k + 1] @ b[k:k + 1]).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="outside the fp32-accumulation bound"):
        assert_within_accumulation_bound(accumulated, a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_float8_kernel_on_cpu_matches_emulation(recipe, monkeypatch):
    """torch._scaled_mm on CPU and torchao's emulation both compute the product of the same quantized operands
    (e4m3/e5m2 data with their scales) within the bound of fp32 accumulation, each checked against fp64: the
    output, the input gradient and the weight gradient. The two paths are not compared with each other: their
    accumulation orders differ, so an output may round to a neighbouring bf16 value (and AMX's order is not AVX's)."""
    x, grad_output = layer_inputs()
    real_x = x.clone().requires_grad_()
    products = real_float8_products(float8_layer(recipe, emulate=False), real_x, grad_output, monkeypatch)
    assert [output.shape for _, _, output in products] == [(32, 1024), (32, 1024), (1024, 1024)]
    for a, b, output in products:
        assert_within_accumulation_bound(output, a, b)
    monkeypatch.undo()

    emulated = float8_layer(recipe, emulate=True)
    emulated_x = x.clone().requires_grad_()
    y = emulated(emulated_x)
    y.backward(grad_output)
    for (a, b, _), output in zip(products, (y, emulated_x.grad, emulated.weight.grad)):
        assert_within_accumulation_bound(output, a, b)
    # And float8 stays near the bf16 computation it replaces (e4m3 keeps 3 mantissa bits: a few % per element).
    torch.manual_seed(0)
    expected = nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)(x).float()
    assert (y.float() - expected).norm() <= 0.1 * expected.norm()


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
