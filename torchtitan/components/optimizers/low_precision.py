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

Checkpoints of AdamW-8bit/4bit hold torchao's quantized tensors themselves, by parameter name: a resumed run
continues exactly, and the state reshards along the first dimension (FSDP or data-parallel degree changes, one
process). torchao's quantized tensors cannot be sliced along another dimension, so a checkpoint whose 8-/4-bit
state must be cut along the second (resumed under TP, whose row-wise shards split it that way) fails to load with
"Only support aten.slice along the first dim". Saving the moments dequantized instead would load anywhere, but
torchao's quantization does not reproduce its own codes from their dequantized values (measured: a resumed 8-bit
run's loss drifts by 3e-5 relative within 4 steps, a 4-bit one by 2e-4), so exact resumption is kept.
"""

import math

import torch

from torchtitan.components.optimizers import BuildContext, gradient, local, register_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig
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


@register_optimizer("AdamW-bf16", state_bytes=_bf16_moments)
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
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return super().step(closure)

    TorchaoAdamW.__name__ = class_name
    return TorchaoAdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


@register_optimizer("AdamW-8bit", state_bytes=_torchao_state_bytes(8, 256))
def build_adamw_8bit(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return _torchao_adamw("AdamW8bit", groups, config)


@register_optimizer("AdamW-4bit", state_bytes=_torchao_state_bytes(4, 128))
def build_adamw_4bit(groups: list[dict], config: OptimizerConfig, context: BuildContext) -> torch.optim.Optimizer:
    return _torchao_adamw("AdamW4bit", groups, config)
