"""The systems `benchmarks/benchmark.py` races ours against, each trained on our batches with the same recipe.

- `transformers`: Hugging Face `LlamaForCausalLM` of our shape (config from `Llama3StateDictAdapter.hf_config`), SDPA
  attention, as a plain transformers user trains it.
- `plain`: a Llama written here in plain PyTorch, no framework: what one file of `torch.nn` achieves on this stack,
  the floor every framework should reach. Its modules carry our parameter names, so it loads our state dict as is.

Both start from our initial weights (in fp32 the first losses agree, which checks that the models are the same),
train with `torch.optim.AdamW` in its default implementation, our learning rate, betas, eps, weight decay (on every
parameter, as a plain user does) and clipping, and follow our recipe: bf16 as `torch.autocast` (fp32 master weights)
when `training.mixed_precision_param` is bfloat16; with `compile.enable`, `torch.compile` of the whole forward and
loss, the way a user compiles a model that knows no blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed.fsdp import TORCH_DTYPES
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import rope_table
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

Batch = tuple[torch.Tensor, torch.Tensor]
PEERS = ("transformers", "plain")


def initial_state_dict(trainer) -> dict[str, torch.Tensor]:
    """A copy of our freshly initialised weights, under our names (torch's state-dict API drops the compile and
    activation-checkpoint wrappers from them)."""
    state = get_model_state_dict(trainer.model_parts[0])
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in state.items()}


class PlainAttention(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on consecutive pairs of the last dimension (Meta's layout), in fp32."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).type_as(x)


class PlainBlock(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = PlainAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = nn.ModuleDict({
            "w1": nn.Linear(args.dim, args.ffn_hidden_dim, bias=False),
            "w2": nn.Linear(args.ffn_hidden_dim, args.dim, bias=False),
            "w3": nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn, normed = self.feed_forward, self.ffn_norm(h)
        return h + ffn.w2(F.silu(ffn.w1(normed)) * ffn.w3(normed))


class PlainLlama(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): PlainBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_table(args).unbind(-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.cos[:seq], self.sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_peer_model(name: str, trainer, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    if name == "plain":
        model = PlainLlama(trainer.model_args)
        model.load_state_dict(state_dict)
        return model

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    # It warns that Llama 3.1's original context (8192) is not below max_position_embeddings; harmless.
    hf_logging.set_verbosity_error()
    adapter = Llama3StateDictAdapter(trainer.model_args)
    config = LlamaConfig(**adapter.hf_config(), use_cache=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.load_state_dict(adapter.to_hf(state_dict))
    return model


class PeerTraining:
    """One peer model trained with our recipe and optimizer hyperparameters on the batches we trained on."""

    def __init__(self, name: str, trainer, state_dict: dict[str, torch.Tensor]):
        self.name = name
        self.model = build_peer_model(name, trainer, state_dict).to(trainer.device).train()
        config = trainer.config
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                           eps=opt.eps, weight_decay=opt.weight_decay)
        self.max_norm = config.training.max_norm
        dtype = TORCH_DTYPES[config.training.mixed_precision_param]
        self.autocast = torch.autocast(trainer.device.type, dtype=dtype, enabled=dtype != torch.float32)
        self.loss = torch.compile(self._loss, backend=config.compile.backend) if config.compile.enable else self._loss
        self.recipe = (f"{config.training.mixed_precision_param}{' autocast' if dtype != torch.float32 else ''}, "
                       f"{'torch.compile of forward + loss' if config.compile.enable else 'eager'}")

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        logits = logits.logits if self.name == "transformers" else logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)

    def step(self, micro_batches: list[Batch]) -> float:
        """One optimizer step over the same micro-batches as one of ours; returns their mean loss."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for inputs, labels in micro_batches:
            with self.autocast:
                loss = self.loss(inputs, labels)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        if self.max_norm > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        return total / len(micro_batches)
