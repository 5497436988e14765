"""The job configuration: one typed dataclass per TOML section.

Section and option names follow TorchTitan v0.2 so that its TOML files run here unchanged. The docstring under each
option is its `--help` text and its entry in `docs/config_reference.md`.
"""

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

# Where each section's methods register their tables, imported on first use (they import torch; the config does
# not): each module has a function `method_options()` -> {table name: options dataclass}.
METHOD_REGISTRIES = {
    "optimizer": "torchtitan.components.optimizers",
    "comm": "torchtitan.distributed.compression",
}


@functools.cache
def method_options(section: str) -> dict[str, type]:
    """{table: options dataclass} of the methods registered for `section` (optimizer, comm)."""
    return importlib.import_module(METHOD_REGISTRIES[section]).method_options()


class MethodTables:
    """The tables of one section's methods ([optimizer.muon], [comm.loco], ...). Each method declares its options as
    a small dataclass next to its implementation and registers it with its registry (the optimizer registry, the
    gradient compression methods), so that adding a method edits no class here. A table is made, with its
    defaults, when first read."""

    def __init__(self, section: str):
        self._section = section

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        options = method_options(self._section)
        if name not in options:
            raise AttributeError(f"[{self._section}] has no option or method table {name!r}")
        table = options[name]()
        setattr(self, name, table)
        return table

    def tables(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in method_options(self._section)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MethodTables) and self._section == other._section and \
            self.tables() == other.tables()

    def __repr__(self) -> str:
        return f"MethodTables({self._section!r}, {self.tables()!r})"


def _method_table(section: Any, name: str) -> Any:
    """`section.<name>` for a section's method table (config.optimizer.muon). Python calls this only for names that
    are not fields; `methods` itself is missing only while an instance is being built (copy, unpickling)."""
    if name.startswith("_") or name == "methods" or "methods" not in vars(section):
        raise AttributeError(f"{type(section).__name__!r} object has no attribute {name!r}")
    return getattr(section.methods, name)


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to read options from; command-line flags override it."""

    dump_folder: str = "./outputs"
    """Folder for all the run writes: config.toml, run.json, metrics.jsonl, checkpoints, TensorBoard logs, traces."""

    description: str = "default job"
    """Free-text description of the job, logged at start."""

    print_config: bool = False
    """Log the resolved configuration (as TOML) at start; it is saved to <dump_folder>/config.toml either way (as in TorchTitan, off by default). job.print_args, the old name, is still accepted."""

    custom_import: str = ""
    """Python module (dotted name, importable from the working directory or PYTHONPATH) to import before the model is built, e.g. one that registers another model family with torchtitan.models.register (TorchTitan's experimental.custom_import). Empty = none."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Folder (under dump_folder) for profiler traces, one file per rank and profiled step."""

    profile_freq: int = 10
    """Profile one step every this many steps."""

    enable_memory_snapshot: bool = False
    """Record memory snapshots: the CUDA caching allocator's history on GPUs, a CPU memory profile elsewhere."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder (under dump_folder) for memory snapshots."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at the first and last step)."""

    enable_tensorboard: bool = False
    """Write TensorBoard event files."""

    disable_color_printing: bool = False
    """Print the per-step console line without ANSI colours. Colours are only ever used when the console is a terminal and NO_COLOR is unset."""

    save_tb_folder: str = "tb"
    """Folder (under dump_folder) for TensorBoard event files."""

    save_for_all_ranks: bool = False
    """Write TensorBoard/W&B metrics from every rank, not only the rank that holds the loss."""

    enable_wandb: bool = False
    """Log metrics to Weights & Biases (the API key comes from the environment only; WANDB_MODE=offline works without a network)."""

    peak_flops: float = 0.0
    """Peak FLOP/s of one device for the MFU figure. 0 = the datasheet value on known GPUs, a measured matmul peak on CPU."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family to train, by its registered name (torchtitan/models/__init__.py): llama3, the one this project implements, or a family that a module named by job.custom_import registers."""

    flavor: str = "debugmodel"
    """Model size: debugmodel, tiny (for tests), 8B, 70B or 405B (see torchtitan/models/llama3/args.py). The shape options below change it."""

    dim: int | None = None
    """Model width (hidden size); a multiple of n_heads giving an even head dimension. None = the flavor's."""

    n_layers: int | None = None
    """Transformer blocks. None = the flavor's."""

    n_heads: int | None = None
    """Attention (query) heads. None = the flavor's."""

    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide n_heads. None = the flavor's."""

    ffn_dim_multiplier: float | None = None
    """Multiplier of the SwiGLU width (8/3 x dim, times this, rounded up to multiple_of). None = the flavor's."""

    multiple_of: int | None = None
    """The SwiGLU width is rounded up to a multiple of this. None = the flavor's."""

    vocab_size: int | None = None
    """Embedding rows, at least the tokenizer's vocabulary (larger pads it, e.g. to a multiple of 64). None = the tokenizer's."""

    rope_theta: float | None = None
    """Base of the rotary embedding frequencies. None = the flavor's."""

    hf_assets_path: str = ""
    """Folder (or file) with the tokenizer: tokenizer.json, or a tiktoken tokenizer.model as Meta ships it. Empty = the small tokenizer bundled with torchtitan."""

    tokenizer_path: str | None = None
    """Deprecated alias of hf_assets_path that points at the tokenizer file itself; used when set."""

    converters: list[str] = field(default_factory=list)
    """Module swaps applied to the model before parallelism, comma separated. Valid: quantize.linear.float8."""

    print_after_conversion: bool = False
    """Print the model after converters have been applied."""

    attention_mask: Literal["causal", "block_causal"] = "causal"
    """causal: every token attends to all earlier tokens of its window; block_causal: only to earlier tokens of its own document (documents start at BOS)."""

    document_positions: bool = False
    """With block_causal, restart RoPE positions at 0 at every document, so a document is seen as if it started the window."""


@dataclass
class OptimizerGroup:
    lr_scale: float = 1.0
    """Multiplier of the learning rate for this group's parameters, at every step of the schedule."""

    weight_decay: float | None = None
    """Weight decay of this group. None = optimizer.weight_decay, except for embeddings and norms: 0 unless optimizer.decay_norms_and_embeddings."""

    matrix_method: bool = False
    """Apply the optimizer's matrix treatment (a low-rank projection, an orthogonalisation) to this group, which must hold 2-D weights only; groups without it get the method's elementwise fallback. Optimizers without a matrix treatment ignore it. Default: true for hidden_matrices only."""


@dataclass
class OptimizerGroups:
    """Every trainable parameter belongs to exactly one group; each group has its own rules."""

    hidden_matrices: OptimizerGroup = field(default_factory=lambda: OptimizerGroup(matrix_method=True))
    output: OptimizerGroup = field(default_factory=OptimizerGroup)
    embeddings: OptimizerGroup = field(default_factory=OptimizerGroup)
    norms: OptimizerGroup = field(default_factory=OptimizerGroup)
    other: OptimizerGroup = field(default_factory=OptimizerGroup)


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "FlexDeMo", "AdamW-bf16", "AdamW-8bit", "AdamW-4bit", "Ranger21", "GaLore-AdamW",
                  "Muon"] = "AdamW"
    """Optimizer: AdamW (decoupled weight decay), Adam (L2 penalty added to the gradient), FlexDeMo (DeMo's step: replicas exchange only the top DCT components of their momentum instead of all-reducing gradients, and step by the sign of their mean; needs data_parallel_replicate_degree >= 2), AdamW-bf16 (AdamW with bfloat16 moments, fp32 weights and update; keep beta2 <= 0.99), AdamW-8bit / AdamW-4bit (torchao's AdamW with blockwise 8-/4-bit moments), Ranger21 (AdamW with gradient clipping and centralization, positive-negative momentum, stable weight decay, norm loss and Lookahead; options in [optimizer.ranger21]), GaLore-AdamW (AdamW with the moments of matrix_method matrices kept for their gradient projected to low rank, options in [optimizer.galore]), Muon (orthogonalised Nesterov momentum for matrix_method matrices, AdamW for the other groups, options in [optimizer.muon]). FlexDeMo's options are in [optimizer.flexdemo]. See docs/recipes.md, Optimizers."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Weight decay of matrices (see decay_norms_and_embeddings)."""

    decay_norms_and_embeddings: bool = False
    """Also apply weight decay to normalisation weights and embeddings."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel: fused (fastest, falls back to foreach where the device has no fused kernel), foreach, for-loop."""

    groups: OptimizerGroups = field(default_factory=OptimizerGroups)
    """Per-group rules ([optimizer.groups.<group>]). Groups: hidden_matrices (2-D weights inside the blocks), output (the final projection to the vocabulary), embeddings, norms (normalisation weights), other (the rest, e.g. biases)."""

    methods: "MethodTables" = field(default_factory=lambda: MethodTables("optimizer"), repr=False)
    """Each optimizer's own table ([optimizer.muon], ...), reached as config.optimizer.muon."""

    def __getattr__(self, name: str):
        return _method_table(self, name)


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to optimizer.lr."""

    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end (warmup-stable-decay). None = decay right after warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay: linear, sqrt (1 - sqrt) or cosine."""

    min_lr_factor: float = 0.0
    """The learning rate decays to optimizer.lr * min_lr_factor."""


@dataclass
class Training:
    dataset: str = "embedded"
    """Dataset: embedded (offline corpus built from Python's own documentation), c4 (HF hub, streamed), or any name when dataset_path is set."""

    dataset_path: str | None = None
    """Local data (a .jsonl/.json/.parquet/.txt file, a folder of them, or a glob) or an HF hub dataset id."""

    dataset_text_field: str = "text"
    """Field of each record that holds the document text."""

    dataset_loop: bool = True
    """At the end of the data start a new epoch; when false, training stops there with a message."""

    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-step."""

    global_batch_size: int = -1
    """Sequences per optimizer step; a multiple of local_batch_size x data-parallel degree (the quotient is the gradient accumulation). -1 = no accumulation."""

    seq_len: int = 2048
    """Tokens per training sequence."""

    max_norm: float = 1.0
    """Clip gradients to this total L2 norm (0 disables clipping)."""

    steps: int = 10000
    """Optimizer steps to train."""

    enable_cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state in CPU memory (GPU runs with FSDP)."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters: through FSDP's MixedPrecisionPolicy when FSDP is applied, through autocast otherwise."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of FSDP gradient reductions."""

    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic collection is disabled during training)."""

    gc_debug: bool = False
    """Collect garbage at every step to find reference cycles."""

    num_workers: int = 0
    """Background workers of the training data, running ahead of the training loop: for documents tokenized on the fly, processes that tokenize them; for token shards (also the shard sources of training.sources), threads that read the windows of the next two steps, so that a cold page cache or a slow file system does not stall a step. 0 = tokenize and read in the training thread. The samples, their order and the checkpointed position (the samples the training loop consumed, not those read ahead) do not depend on it."""

    data_seed: int = 0
    """Seed of the order in which windows of token shards are sampled (the same on every rank and data-parallel degree)."""

    max_open_shards: int = 64
    """Token shards (also those of training.sources) each data loader keeps memory-mapped at once; the least recently used is closed first. Each open shard holds a file descriptor and a kernel memory map, so this bounds both per process however many shards the data has (hundreds of thousands at 15T tokens); a shard is opened when a window first needs it."""

    verify_all_shards: bool = False
    """Check the sha256 of every token shard against the manifest when this process first opens it (one extra read of each shard) instead of a sample: the first 4 shards each process opens, which, read in a random order, are other shards on every rank. A mismatch stops the run with an error naming the shard."""

    sources: list[str] = field(default_factory=list)
    """Weighted mixture of data sources instead of dataset_path: path:weight entries (a.jsonl:0.7,shards/:0.3), or [[training.sources]] tables with path and weight in TOML. Each path is anything dataset_path takes."""

    stream_max_attempts: int = 8
    """Reads in a row of a Hugging Face hub stream that may fail with a transient error (HTTP 429 or 5xx, a dropped connection) before the run stops with an error; each retry resumes at the record after the last one read."""

    stream_backoff_seconds: float = 1.0
    """Wait before the first retry of a failed hub stream read; it doubles with each further attempt (at most a minute), times a random factor between 1 and 2."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or the replicate dimension of HSDP). 1 = disabled."""

    data_parallel_shard_degree: int = -1
    """Ranks that shard parameters with FSDP2. -1 = whatever the other degrees leave of the world size."""

    data_parallel_shard_method: Literal["fsdp", "rotated"] = "fsdp"
    """How the data_parallel_shard_degree x context_parallel_degree ranks share the weights: fsdp (FSDP2 gathers each block's weights before computing it) or rotated (RTP, rotated tensor parallelism: every Linear and the embedding split by rows, one shard per rank, the shards passed around the ring while each rank computes with the one in hand; no weight is ever gathered whole; norms replicated). The same checkpoints either way. See docs/parallelism.md, Rotated tensor parallelism."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always, never, or default (always except under pipeline parallelism)."""

    tensor_parallel_degree: int = 1
    """Tensor (and sequence) parallel degree. 1 = disabled."""

    disable_loss_parallel: bool = False
    """Gather the vocabulary-sharded logits before the loss instead of computing the loss in parallel."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with matmuls (GPUs with NCCL and compile.enable only)."""

    pipeline_parallel_degree: int = 1
    """Pipeline stages' ranks. 1 = disabled."""

    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Module names that start a new stage, e.g. layers.4,layers.8. Empty = an even split."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per (virtual) stage; the embedding and output count as one block each. None = derived."""

    pipeline_parallel_schedule: str = "1F1B"
    """Schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."""

    pipeline_parallel_schedule_csv: str | None = None
    """CSV file with a custom schedule (the schedule option then names its runtime class)."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; local_batch_size must be a multiple."""

    context_parallel_degree: int = 1
    """Context parallel degree: the sequence is sharded across this many ranks. 1 = disabled."""

    context_parallel_method: Literal["allgather_kv", "ring"] = "allgather_kv"
    """How causal attention runs under context parallelism. allgather_kv: each layer all-gathers the grouped keys and values (n_kv_heads, not expanded to the query heads) over the CP group and attends the rank's head-tail chunks to them, as the Llama 3 paper does (its backward reduce-scatters their gradients); ring: torch's ring attention, which passes the keys and values expanded to the query heads, n_heads / n_kv_heads times the bytes (4x for Llama 3.1 8B, 16x for 405B at TP 8). block_causal always all-gathers. Measured bytes and memory: docs/parallelism.md."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How the ring (context_parallel_method = ring) exchanges key/value shards: all-gathered once per call, or passed to the next rank chunk by chunk."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints, and resume from the latest one at start."""

    folder: str = "checkpoint"
    """Folder (under dump_folder) with one step-N subfolder per checkpoint."""

    interval: int = 500
    """Save every this many steps (and at the last step)."""

    initial_load_path: str | None = None
    """Checkpoint to start from when folder has none (a step-N folder, or an HF folder with initial_load_in_hf)."""

    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json + safetensors)."""

    last_save_model_only: bool = True
    """The last checkpoint holds only the model weights (in export_dtype)."""

    last_save_in_hf: bool = False
    """Write the last checkpoint as Hugging Face safetensors + config.json."""

    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """Dtype of model-only checkpoints."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled (synchronous), async (a background thread writes), async_with_pinned_mem (a background process with pinned staging)."""

    keep_latest_k: int = 10
    """Keep this many latest full checkpoints (model + optimizer + data position + train state; model-only ones do not count and go once older than all of them); 0 = all."""

    load_step: int = -1
    """Resume from this step's checkpoint instead of the latest (-1 = latest)."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts not to load when resuming, comma separated: model, optimizer, lr_scheduler, dataloader, train_state, rng, diloco (fault_tolerance.semi_sync_method = diloco: the last sync's weights and the outer momentum)."""

    enable_first_step_checkpoint: bool = False
    """Also save a checkpoint after the first step."""

    create_seed_checkpoint: bool = False
    """Initialise the model, save it as step-0 and exit (run with one process)."""

    load_only: bool = False
    """Load checkpoints but never save."""

    timeout_seconds: int = 1800
    """Timeout of the collectives of a checkpoint save or load (their own process group, not comm.train_timeout_seconds): they wait for the slowest rank's writes."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """none, full (recompute every block), or selective (see selective_ac_option)."""

    selective_ac_option: str = "2"
    """For selective: an integer N (checkpoint every N-th block) or 'op' (save the outputs of expensive ops, recompute the rest)."""


@dataclass
class Compile:
    enable: bool = False
    """Compile with torch.compile (each transformer block separately, and the loss)."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile, comma separated: model, loss."""

    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Float8:
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise recipe)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute float8 scales of all FSDP parameters in one all-reduce after each optimizer step."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """torchao float8 recipe. None = tensorwise."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains one of these are kept in high precision (layers too small or misaligned for float8 are skipped as well)."""

    emulate: bool = False
    """Emulate float8 matmuls in high precision (any device); without it CUDA needs compute capability 8.9+."""


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of process-group initialisation and of the first steps."""

    train_timeout_seconds: int = 100
    """Timeout of every collective after the first step: a stalled peer becomes an error, not a hang."""

    trace_buf_size: int = 20000
    """Entries of the NCCL flight recorder (GPU runs)."""

    mode: Literal["default", "fake_backend"] = "default"
    """fake_backend: a dry run. One process plays rank comm.fake_rank of a world of comm.fake_world_size ranks on torch's fake process group. On fake tensors (the default; no GPU, data, tokenizer or checkpoint needed) it runs two training steps of the configured layout and reports that rank's peak memory by category and every collective of one step in dump_folder/dry_run.json; on real tensors (--comm.no_fake_tensors) it times the rank's steps on this machine's GPU (docs/scaling.md)."""

    fake_rank: int = 0
    """Dry run: the rank this process plays."""

    fake_tensors: bool = True
    """Dry run: fake tensors (no storage, so any rank of any model fits; memory from torch's trackers). With --comm.no_fake_tensors the rank runs on real tensors on this machine's device (its GPU if it has one; the collectives stay fake and leave their outputs unwritten): comm.fake_steps timed steps, compile included, with the allocator's peak memory; the rank's share of the model must fit the device (docs/scaling.md)."""

    fake_steps: int = 5
    """Dry run on real tensors: the steps to run; the first two (compilation, the optimizer state) are not counted in the median step time."""

    fake_world_size: int = 0
    """Dry run: the number of ranks (GPUs) of the world; 0 = the NGPU environment variable."""

    fake_device: Literal["cuda", "cpu"] = "cuda"
    """Dry run: the device whose code paths (attention layout, float8 kernels, async TP) the run takes."""

    fake_gpu: str = "h100"
    """Dry run on cuda: the GPU whose memory the peak must fit in (h100, h100_96gb, h200, a100, b200; see docs/scaling.md)."""

    fake_other_end: bool = True
    """Dry run under PP: also dry-run the rank at the other end of the pipeline (a second process), whose stage differs."""

    gradient_compression: Literal["none", "loco", "error_feedback", "qsdp"] = "none"
    """FSDP gradient reduce-scatter: none (full precision); loco (gradient_bits codes; LoCo's compensation: a moving average of the past compression errors, kept as 8-bit codes, about 1 byte per unsharded parameter on every rank, reset every comm.loco.reset_interval steps); error_feedback (gradient_bits codes; classic error feedback: the whole last error, fp32, 4 bytes per unsharded parameter on every rank); or qsdp (gradient_bits codes, stochastic rounding, no residual). Needs FSDP without a replicate dimension (docs/recipes.md)."""

    gradient_bits: int = 8
    """Bits per gradient value on the wire with gradient_compression: 4 or 8 (plus one bfloat16 scale per 128 values)."""

    weight_quantization: Literal["none", "qsdp"] = "none"
    """FSDP weight all-gather: none (the compute dtype), or qsdp (weight_bits codes rounded stochastically; each rank keeps its shard in full precision)."""

    weight_bits: int = 8
    """Bits per weight value on the wire with weight_quantization = qsdp: 4 or 8."""

    quantization_rotation: Literal["none", "hadamard"] = "none"
    """Rotate each block of 128 values by a Walsh-Hadamard matrix before quantizing (spreads outliers); needs gradient_compression or weight_quantization."""

    methods: "MethodTables" = field(default_factory=lambda: MethodTables("comm"), repr=False)
    """Each compression method's own table ([comm.loco], ...), reached as config.comm.loco."""

    def __getattr__(self, name: str):
        return _method_table(self, name)


@dataclass
class Debug:
    seed: int | None = None
    """Seed of all random number generators. None = a random seed, logged."""

    deterministic: bool = False
    """Use deterministic algorithms only (slower)."""

    deterministic_warn_only: bool = False
    """With deterministic, warn instead of failing on an op without a deterministic implementation."""

    on_nonfinite: Literal["stop", "skip"] = "stop"
    """On a NaN/Inf loss or gradient norm: stop with an error naming the step, or skip that update."""


@dataclass
class Health:
    """Goodput accounting is always on; these set the loss-spike guard and the straggler report
    (docs/resilience.md)."""

    spike_sigma: float = 0.0
    """Skip the optimizer update of a step whose loss or gradient norm is more than this many standard deviations above the mean of the last spike_window accepted steps (the same decision on every rank). 0 = off."""

    spike_window: int = 100
    """Accepted steps whose loss and gradient norm make the running statistics of spike_sigma."""

    spike_warmup: int = 20
    """Accepted steps before spike_sigma judges any step (the first steps move fast and are few)."""

    max_skipped_in_a_row: int = 5
    """Stop with an error after this many skipped updates in a row (spikes, or non-finite values with debug.on_nonfinite = skip). 0 = never stop."""

    rerun_bad_steps: bool = False
    """Run the forward and backward of a step whose update is skipped (a spike, or a non-finite value with debug.on_nonfinite = skip) again, on the same inputs from the same weights, and log whether the loss and gradient norm came out bit for bit the same (reproducible: a real divergence, the data or the numerics) or not (suspect a hardware or other non-deterministic fault); counted in the metrics health/reruns_reproducible and health/reruns_not_reproducible. The comparison needs deterministic kernels (debug.deterministic on GPUs). Costs one forward-backward per skipped step."""

    straggler_interval: int = 100
    """Every this many steps the ranks share their own step times (one all_gather) and the spread goes to the metrics. 0 = off."""

    straggler_factor: float = 1.5
    """A rank whose own step time is more than this factor above the median is a straggler."""

    straggler_patience: int = 3
    """Name a straggler in the log once it has been one at this many checks in a row."""


@dataclass
class Validation:
    enable: bool = False
    """Compute the validation loss and perplexity."""

    dataset: str = "embedded_validation"
    """Validation dataset (the held-out split of the embedded corpus by default)."""

    dataset_path: str | None = None
    """Local data or HF hub id for validation, as training.dataset_path."""

    local_batch_size: int | None = None
    """Validation sequences per data-parallel rank per step. None = training.local_batch_size."""

    seq_len: int | None = None
    """Tokens per validation sequence (at most training.seq_len). None = training.seq_len."""

    freq: int = 500
    """Validate every this many training steps."""

    steps: int = -1
    """Validation batches per evaluation; -1 = the whole validation set."""


@dataclass
class FaultTolerance:
    """Replica-group fault tolerance on torchft (docs/resilience.md): the data-parallel replicas are separate torchrun
    jobs (replica groups) that a torchft lighthouse joins into a quorum each step; a group that dies is restarted by
    its own torchrun and recovers the live state from a healthy peer while the others train on."""

    enable: bool = False
    """Run this job as one replica group of a torchft quorum (run_train.sh with FT_GROUPS starts the lighthouse and the groups). Each group writes under <job.dump_folder>/replica_<replica_id>."""

    process_group: Literal["gloo", "nccl"] = "gloo"
    """Backend of the managed process group that averages the gradients across replica groups."""

    process_group_timeout_ms: int = 10000
    """Timeout of one cross-group collective: a group that does not answer within it is dropped from the step."""

    replica_id: int = 0
    """This group's index, 0 to group_size - 1: it names the group to the lighthouse and picks its share of the data."""

    group_size: int = 0
    """Number of replica groups. The data is split into this many slices, one per group, so that every sample is read once while all groups are live."""

    min_replica_size: int = 1
    """A step commits only when at least this many replica groups took part in it."""

    lighthouse: str = ""
    """Address of the torchft lighthouse, e.g. http://host:29510. Empty = the TORCHFT_LIGHTHOUSE environment variable."""

    connect_timeout_seconds: float = 60.0
    """Stop with an error if the lighthouse cannot be reached within this many seconds at start."""

    semi_sync_method: Literal["none", "local_sgd", "diloco"] = "none"
    """none: every step's gradients are averaged over the groups (per-step mode). local_sgd: torchft's LocalSGD, each group takes sync_steps optimizer steps of its own, then the groups' weights are averaged (one quorum per sync; a recovering group heals then). diloco: torchft's DiLoCo, each group takes sync_steps optimizer steps of its own, then the groups average their pseudo-gradients (the weights of the last sync minus their own) and every group applies the same outer step (SGD with Nesterov momentum: outer_lr, outer_momentum) to the weights of the last sync."""

    sync_steps: int = 5
    """With semi_sync_method = local_sgd or diloco: optimizer steps between two syncs of the groups."""

    outer_lr: float = 0.7
    """With semi_sync_method = diloco: learning rate of the outer SGD step on the averaged pseudo-gradient (0.7: the DiLoCo paper's and TorchTitan's). outer_lr 1 with outer_momentum 0 is LocalSGD's averaging."""

    outer_momentum: float = 0.9
    """With semi_sync_method = diloco: Nesterov momentum of the outer SGD step, in [0, 1) (0.9: the DiLoCo paper's and TorchTitan's; 0 = plain SGD)."""

    quorum_timeout_seconds: float = 300.0
    """Longest wait for a step's quorum (the other groups reaching the step, a restarted group healing); past it the group stops with exit code 4, for its torchrun to restart it."""

    join_timeout_seconds: float = 10.0
    """The lighthouse's wait for a group that heartbeats but has not asked for the step's quorum (a hung group), before it forms the quorum of the others (torchft's join_timeout_ms, 60 s there). run_train.sh and multinode_trainer.slurm start the lighthouse with it; a lighthouse started otherwise has its own."""

    heartbeat_timeout_seconds: float = 5.0
    """The lighthouse counts a group dead once its last heartbeat is this old (torchft's heartbeat_timeout_ms). Passed to the lighthouse by run_train.sh and multinode_trainer.slurm. A live group waits at most process_group_timeout_ms + heartbeat_timeout_seconds + join_timeout_seconds for a failed one, before its steps' own time."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
    health: Health = field(default_factory=Health)
    validation: Validation = field(default_factory=Validation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
