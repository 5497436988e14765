"""How the Llama model is parallelised: which `apply_*` runs, in which order.

Order: tensor parallel -> activation checkpointing -> compile -> FSDP/HSDP, RTP (rotated tensor parallelism,
parallelism.data_parallel_shard_method = rotated) or DDP. Context parallelism changes no module: the trainer shards the
sequence around forward and backward (FSDP, or RTP's ring, then spans dp_shard x cp); where it gathers keys and values
(packed documents, or causal with context_parallel_method = allgather_kv) the model's mask becomes one over the keys
of every CP rank.
Under pipeline parallelism this runs once per stage.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import JobConfig, validation_shape
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.compression import apply_compression, validate_compression
from torchtitan.distributed.context_parallel import (CAUSAL_CHUNKS_PER_RANK, CHUNKS_PER_RANK, apply_document_cp,
                                                     gathers_keys_and_values)
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.rotated import apply_rtp
from torchtitan.distributed.tensor_parallel import apply_tp
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs


def validate_parallelism(args: TransformerModelArgs, parallel_dims: ParallelDims, config: JobConfig,
                         device_type: str) -> None:
    """Reject layouts the model's shapes cannot be split into, naming the option to change (pairs of features that do
    not compose, devices included: config/compatibility.py)."""
    tp, cp = parallel_dims.tp, parallel_dims.cp
    for what, size in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads),
                       ("the FFN width", args.ffn_hidden_dim), ("the vocabulary size", args.vocab_size)):
        if size % tp:
            raise UserError(f"option parallelism.tensor_parallel_degree: {tp} does not divide {what} ({size}) of "
                            f"flavor {config.model.flavor}; use a divisor of {size}")
    seq_len = config.training.seq_len
    # Sequence parallelism splits the sequence over tp ranks; context parallelism's head-tail load balancing cuts
    # it into 2 x cp chunks (torch's ring silently drops load balancing when that division is uneven), its balancing
    # of packed documents into CHUNKS_PER_RANK x cp.
    chunks = CHUNKS_PER_RANK if config.model.attention_mask == "block_causal" else CAUSAL_CHUNKS_PER_RANK
    multiple = tp * (chunks * cp if cp > 1 else 1)
    if seq_len % multiple:
        raise UserError(f"option training.seq_len: {seq_len} must be divisible by tensor_parallel_degree"
                        + (f" x {chunks} x context_parallel_degree" if cp > 1 else "") + f" = {multiple}")
    validation_seq_len = validation_shape(config)[1]
    if config.validation.enable and validation_seq_len % multiple:
        raise UserError(f"option validation.seq_len: {validation_seq_len} must be divisible by {multiple} "
                        f"(as training.seq_len)")
    validate_compression(config)


def parallelize_llama(model: nn.Module, world_mesh: DeviceMesh, parallel_dims: ParallelDims,
                      config: JobConfig) -> nn.Module:
    if gathers_keys_and_values(config):
        apply_document_cp(model, world_mesh["cp"])
    if parallel_dims.tp_enabled:
        apply_tp(model, world_mesh["tp"], loss_parallel=not config.parallelism.disable_loss_parallel,
                 async_tp=config.parallelism.enable_async_tensor_parallel)
    rotated = config.parallelism.data_parallel_shard_method == "rotated"
    apply_ac(model, config.activation_checkpoint)
    if config.compile.enable and "model" in config.compile.components:
        apply_compile(model, config.compile.backend, fullgraph=not rotated)
    precision = {"param_dtype": config.training.mixed_precision_param,
                 "reduce_dtype": config.training.mixed_precision_reduce}
    # FlexDeMo owns the exchange across replicas: FSDP shards within a replica only (also over one rank, for its
    # mixed precision), and never all-reduces gradients across replicas.
    flexdemo = config.optimizer.name == "FlexDeMo"
    if rotated:
        apply_rtp(model, parallel_dims.get_mesh("dp_shard_cp"), **precision)
    elif parallel_dims.fsdp_enabled or flexdemo:
        dp_mesh = parallel_dims.get_mesh("hsdp" if parallel_dims.hsdp_enabled and not flexdemo else "dp_shard_cp")
        apply_fsdp(model, dp_mesh, pp_enabled=parallel_dims.pp_enabled,
                   cpu_offload=config.training.enable_cpu_offload,
                   reshard_policy=config.parallelism.fsdp_reshard_after_forward, **precision)
        apply_compression(model, config)
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, world_mesh["dp_replicate"], parallel_dims.get_mesh("hsdp"), **precision)
    return model
