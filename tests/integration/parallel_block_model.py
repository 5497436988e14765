"""A second model family, registered through `torchtitan.models` as a user's own would be (job.custom_import =
tests.integration.parallel_block_model, model.name = llama3_parallel_blocks): Llama 3 with parallel blocks, as GPT-J
and PaLM have them, where attention and feed-forward read the same normalised input and both add to the residual.

It brings its own block and takes the rest from Llama where it fits (attention, feed-forward, args, pipeline split,
the parallelisms but tensor parallelism, whose plan names Llama's block modules: refused). It has no Hugging Face
format. Nothing in torchtitan/distributed or torchtitan/components names it."""

import torch
from torch import nn

from torchtitan import models
from torchtitan.errors import UserError
from torchtitan.models.llama3 import args, model, parallelize, pipeline
from torchtitan.nn.attention import DocumentMask
from torchtitan.protocols import ModelSpec

NAME = "llama3_parallel_blocks"


class ParallelBlock(nn.Module):
    def __init__(self, layer_id: int, model_args: args.TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.attention = model.Attention(model_args)
        self.feed_forward = model.FeedForward(model_args.dim, model_args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        h = self.attention_norm(x)
        return x + self.attention(h, rope, mask=mask) + self.feed_forward(h)


class ParallelBlockTransformer(model.Transformer):
    def __init__(self, model_args: args.TransformerModelArgs):
        super().__init__(model_args)
        self.layers = nn.ModuleDict({str(i): ParallelBlock(i, model_args) for i in range(model_args.n_layers)})


def validate_parallelism(model_args, parallel_dims, config, device_type: str) -> None:
    if parallel_dims.tp > 1:
        raise UserError(f"option parallelism.tensor_parallel_degree: model {NAME} has no tensor-parallel plan; "
                        f"use 1")
    parallelize.validate_parallelism(model_args, parallel_dims, config, device_type)


models.register(ModelSpec(
    name=NAME, build_args=args.model_args_for, build_model=ParallelBlockTransformer,
    flops_per_token=model.flops_per_token, validate_parallelism=validate_parallelism,
    parallelize=parallelize.parallelize_llama, requested_stage_count=pipeline.requested_stage_count,
    split_into_stages=pipeline.split_into_stages, build_stage_module=pipeline.build_stage_module,
    model_shape=args.model_shape))
