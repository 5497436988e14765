"""AdamW with its two moments stored in low precision; the weights stay fp32 masters and every update is computed
in fp32 from the dequantized moments.

AdamW-bf16  both moments in bfloat16 (4 bytes per parameter instead of 8), rounded to nearest when stored. bf16
            keeps 8 significant bits: a moment changes by a factor (beta2 = 0.95: 5%) far above its rounding
            (0.4%), but with beta2 >= 0.996 the second moment's per-step change falls under half a bf16 ulp and
            is lost; keep beta2 <= 0.99 with this method.
AdamW-8bit  torchao's AdamW8bit: blockwise (256 values) dynamic-tree quantization with one fp32 scale per block,
            for tensors whose local shard has >= 4096 values and a multiple of 256; smaller ones keep fp32 moments.
AdamW-4bit  torchao's AdamW4bit: the same with 4-bit codes in blocks of 128.

All three are elementwise: on DTensor parameters (FSDP, TP shards) each rank updates its own shard and nothing is
gathered. torchao quantizes each rank's local shard in its own blocks, so which values share a block (and a
scale) depends on the layout: a dim-0 shard (FSDP, TP column-wise) is a contiguous run of the whole tensor and
keeps its blocks when its size is a multiple of the block; a dim-1 shard (TP row-wise) groups other values.

Checkpoints of AdamW-8bit/4bit hold the moments dequantized, fp32 and shaped and sharded like their parameter
(DTensors under FSDP/TP), as AdamW's: 8 bytes per parameter, so the state reshards to any layout AdamW's does
(torchao's quantized tensors themselves can be cut along their first dimension only: a TP layout could not load
them). Loading quantizes them again. torchao's quantization alone does not reproduce a block from its dequantized
values where the block's largest magnitude is negative (the signed code books end at -0.993 (8-bit) / -0.8875
(4-bit) but at +1: the re-derived scale comes out smaller), so the loader takes, for each such block, the scale that
reproduces the saved values bitwise, which exists whenever the blocks are those of the saved layout: a run resumed in
its own layout continues exactly, and one resumed in another layout quantizes its new blocks afresh.
"""

import math

import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizers import (BuildContext, RankTensor, StepLayout, gradient, largest_shard, local,
                                              register_optimizer)
from torchtitan.config.compatibility import MethodRefusal
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError


class AdamWBF16State(torch.optim.Optimizer):
    """torch.optim.AdamW's update with bfloat16 moments (as its for-loop implementation computes it, in fp32)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] += 1
                step = state["step"].item()
                weight, grad = local(param), local(gradient(param)).float()
                exp_avg_bf16, exp_avg_sq_bf16 = local(state["exp_avg"]), local(state["exp_avg_sq"])
                exp_avg = exp_avg_bf16.float().lerp_(grad, 1 - beta1)
                exp_avg_sq = exp_avg_sq_bf16.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg_bf16.copy_(exp_avg)
                exp_avg_sq_bf16.copy_(exp_avg_sq)
                weight.mul_(1 - lr * decay)
                denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                weight.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating-point state tensor to its parameter's dtype (fp32): the moments are
        put back in bf16 (exactly, as they were saved), or a resumed run would keep fp32 moments, twice the memory,
        and step differently from the run it resumes."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)


def _bf16_moments(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                  matrix_method: bool) -> float:
    return 4 * math.prod(local_shape)


def _bf16_step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
    """Tensor by tensor: both moments in fp32, the root of the second and its quotient (16 bytes per value), while
    the previous tensor's denominator is still bound (20 at most, for two shards of one size in a row)."""
    return 20 * largest_shard(tensors)


@register_optimizer("AdamW-bf16", state_bytes=_bf16_moments, step_bytes=_bf16_step_bytes)
def build_adamw_bf16(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return AdamWBF16State(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


def _torchao_state_bytes(bits: int, block: int):
    """Per moment: the codes, an fp32 scale per block and the fp32 code book (2^bits values); fp32 moments for
    tensors torchao leaves unquantized (torchao quantizes each local shard by itself)."""
    def state_bytes(shape: tuple[int, ...], local_shape: tuple[float, ...], config: OptimizerConfig,
                    matrix_method: bool) -> float:
        numel = math.prod(local_shape)
        if numel < 4096 or numel % block:
            return 8 * numel
        return 2 * (numel * bits / 8 + numel // block * 4 + 2 ** bits * 4)
    return state_bytes


def _dequantized(value):
    """A torchao quantized tensor (or a DTensor of them) as fp32 values of the same shape and placements."""
    inner = local(value)
    if type(inner) is torch.Tensor:
        return value
    if isinstance(value, DTensor):
        return DTensor.from_local(inner.dequantize(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return inner.dequantize()


def _quantize_exactly(values: torch.Tensor, buffer: torch.Tensor) -> None:
    """Fill `buffer` (torchao's quantized tensor, or a plain one for shards torchao keeps in fp32) with `values`.

    torchao's copy derives each block's scale from its largest magnitude; where that value is negative it was
    stored as the code book's most negative code (-0.993 x scale for 8-bit), not -1 x scale, and the scale comes out
    smaller. Those blocks take scale = magnitude / |most negative code| (or the fp32 value beside it) where that
    reproduces every saved value bitwise; blocks no scale reproduces (values quantized in other blocks, under another
    layout) keep torchao's quantization.
    """
    if type(buffer) is torch.Tensor:
        buffer.copy_(values)
        return
    from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap

    buffer.copy_(values)
    block = buffer.block_size
    blocks = values.reshape(-1, block)
    rows = (buffer.dequantize().reshape(-1, block) != blocks).any(-1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    qmap = buffer.qmap
    four_bit = buffer.codes.numel() < buffer.numel()  # two codes per byte
    quantize = quantize_4bit_with_qmap if four_bit else quantize_8bit_with_qmap
    codes_per_block = buffer.codes.view(-1, block // 2 if four_bit else block)
    wanted = blocks[rows]
    scale = wanted.abs().amax(-1) / qmap.min().abs()
    left = torch.ones_like(rows, dtype=torch.bool)
    # The division rounds: the scale the block was stored with is this one or an fp32 neighbour.
    for candidate in (scale, scale.nextafter(torch.full_like(scale, math.inf)),
                      scale.nextafter(torch.zeros_like(scale))):
        codes = quantize(wanted / candidate.view(-1, 1), qmap)
        exact = left & (qmap[codes.int()] * candidate.view(-1, 1) == wanted).all(-1)
        if four_bit:
            codes = (codes[:, ::2] << 4) | codes[:, 1::2]
        codes_per_block[rows[exact]] = codes[exact]
        buffer.scale[rows[exact]] = candidate[exact]
        left &= ~exact


def _torchao_adamw(class_name: str, groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    try:
        from torchao import optim as torchao_optim
    except ImportError as e:
        raise UserError(f"option optimizer.name: {config.name} needs torchao (pip install torchao): {e}") from None

    class TorchaoAdamW(getattr(torchao_optim, class_name)):
        def step(self, closure=None):
            # torchao compiles its step per parameter. AOTAutograd's cache does not tell its quantized tensors
            # apart by their inner shapes (torchao 0.18 gives them no cache hash): a graph cached for one shape is
            # handed to another (an FSDP shard after a one-process run: `wrong number of dimensions`). Inductor's
            # own cache still serves the step.
            with torch_compat.patched_config("functorch_config", enable_autograd_cache=False):
                return super().step(closure)

        def state_dict(self) -> dict:
            """The moments dequantized (fp32, sharded like the parameter): see the module docstring."""
            saved = super().state_dict()
            saved["state"] = {index: {key: _dequantized(value) for key, value in state.items()}
                              for index, state in saved["state"].items()}
            return saved

        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for param in group["params"]:
                    state = self.state.get(param, {})
                    for key, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
                        if key in state:
                            # torchao's buffer for this parameter: quantized or, for small shards, fp32.
                            buffer = self._new_buffer(param, signed)
                            _quantize_exactly(local(state[key]), local(buffer))
                            state[key] = buffer

    TorchaoAdamW.__name__ = class_name
    return TorchaoAdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


# torchao compiles its step on real tensors; a dry run's fake ones crash it.
_NO_FAKE_TENSORS = MethodRefusal("dry_run_on_fake_tensors", "torchao compiles its step on real tensors, which the "
                                 "dry run's fake ones are not", "dry-run with AdamW-bf16 and scale its optimizer state "
                                 "by the memory planner's ratio (docs/recipes.md, Optimizers), run the rank on real "
                                 "tensors (--comm.no_fake_tensors), or run on real devices")


def _torchao_step_bytes(tensors: list[RankTensor], config: OptimizerConfig, layout: StepLayout) -> float:
    """torchao's compiled step, tensor by tensor: by reading, both moments dequantized to fp32 and AdamW's update
    from them (16 bytes per value of the largest shard); not traced (the dry run refuses torchao's step)."""
    return 16 * largest_shard(tensors)


@register_optimizer("AdamW-8bit", state_bytes=_torchao_state_bytes(8, 256), step_bytes=_torchao_step_bytes,
                    refuses=(_NO_FAKE_TENSORS,))
def build_adamw_8bit(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return _torchao_adamw("AdamW8bit", groups, config)


@register_optimizer("AdamW-4bit", state_bytes=_torchao_state_bytes(4, 128), step_bytes=_torchao_step_bytes,
                    refuses=(_NO_FAKE_TENSORS,))
def build_adamw_4bit(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return _torchao_adamw("AdamW4bit", groups, config)
