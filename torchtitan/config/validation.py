"""Checks of single options' values, once the config is built."""

import dataclasses

from torchtitan.config.compatibility import check_options
from torchtitan.config.job_config import JobConfig
from torchtitan.config.options import get_option
from torchtitan.errors import UserError


def validation_shape(config: JobConfig) -> tuple[int, int]:
    """(local batch size, sequence length) of validation batches: training's, where [validation] leaves them unset,
    so that overriding training.seq_len alone keeps validation valid."""
    validation, training = config.validation, config.training
    return (training.local_batch_size if validation.local_batch_size is None else validation.local_batch_size,
            training.seq_len if validation.seq_len is None else validation.seq_len)


def validate(config: JobConfig) -> None:
    """Checks of single options' values that need no model or devices (pairs of features that do not compose:
    config/compatibility.py, checked when the run starts)."""
    positive = ["training.local_batch_size", "training.seq_len", "training.steps", "metrics.log_freq",
                "training.gc_freq", "checkpoint.interval", "validation.local_batch_size", "validation.seq_len",
                "validation.freq", "profiling.profile_freq", "comm.init_timeout_seconds",
                "comm.train_timeout_seconds", "parallelism.data_parallel_replicate_degree",
                "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.context_parallel_degree", "parallelism.pipeline_parallel_microbatch_size",
                "health.spike_window", "health.straggler_patience"]
    for key in positive:
        value = get_option(config, key)
        if value is not None and value <= 0:
            raise UserError(f"option {key}: {value} must be a positive integer")
    shard = config.parallelism.data_parallel_shard_degree
    if shard == 0 or shard < -1:
        raise UserError(f"option parallelism.data_parallel_shard_degree: {shard} must be -1 (use the ranks left) "
                        f"or a positive integer")
    gbs = config.training.global_batch_size
    if gbs != -1 and gbs <= 0:
        raise UserError(f"option training.global_batch_size: {gbs} must be -1 (no accumulation) or positive")
    for key in ("optimizer.lr", "optimizer.eps"):
        if get_option(config, key) <= 0:
            raise UserError(f"option {key}: {get_option(config, key)} must be positive")
    for key in ("optimizer.weight_decay", "training.max_norm", "lr_scheduler.warmup_steps", "metrics.peak_flops",
                "health.spike_sigma", "health.spike_warmup", "health.max_skipped_in_a_row",
                "health.straggler_interval"):
        if get_option(config, key) < 0:
            raise UserError(f"option {key}: {get_option(config, key)} must not be negative")
    for group in dataclasses.fields(config.optimizer.groups):
        rules = getattr(config.optimizer.groups, group.name)
        for name in ("lr_scale", "weight_decay"):
            value = getattr(rules, name)
            if value is not None and value < 0:
                raise UserError(f"option optimizer.groups.{group.name}.{name}: {value} must not be negative")
    for key in ("optimizer.beta1", "optimizer.beta2"):
        if not 0 <= get_option(config, key) < 1:
            raise UserError(f"option {key}: {get_option(config, key)} must be in [0, 1)")
    if not 0 <= config.lr_scheduler.min_lr_factor <= 1:
        raise UserError(f"option lr_scheduler.min_lr_factor: {config.lr_scheduler.min_lr_factor} must be in [0, 1]")
    ratio = config.lr_scheduler.decay_ratio
    if ratio is not None and not 0 <= ratio <= 1:
        raise UserError(f"option lr_scheduler.decay_ratio: {ratio} must be in [0, 1] (or unset)")
    if config.validation.enable and validation_shape(config)[1] > config.training.seq_len:
        # The model's RoPE table is built for training.seq_len: longer validation sequences have no angles.
        raise UserError(f"option validation.seq_len: {config.validation.seq_len} is longer than training.seq_len = "
                        f"{config.training.seq_len}; set validation.seq_len <= training.seq_len (or leave it unset "
                        f"to follow training.seq_len)")
    option = config.activation_checkpoint.selective_ac_option
    if config.activation_checkpoint.mode == "selective" and option != "op" and not (option.isdigit() and
                                                                                  int(option) > 0):
        raise UserError(f"option activation_checkpoint.selective_ac_option: {option!r} must be 'op' or a positive "
                        f"integer N (checkpoint every N-th block)")
    for component in config.compile.components:
        if component not in ("model", "loss"):
            raise UserError(f"option compile.components: {component!r} is not one of 'model', 'loss'")
    for part in config.checkpoint.exclude_from_loading:
        if part not in ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "diloco"):
            raise UserError(f"option checkpoint.exclude_from_loading: {part!r} is not one of model, optimizer, "
                            f"lr_scheduler, dataloader, train_state, rng, diloco")
    valid_converters = ("quantize.linear.float8", "float8")
    for converter in config.model.converters:
        if converter not in valid_converters:
            raise UserError(f"option model.converters: {converter!r} is not a known converter; valid: "
                            f"{', '.join(valid_converters)}")
    if config.training.stream_max_attempts < 1:
        raise UserError(f"option training.stream_max_attempts: {config.training.stream_max_attempts} must be at least 1")
    if config.training.stream_backoff_seconds < 0:
        raise UserError(f"option training.stream_backoff_seconds: {config.training.stream_backoff_seconds} must not be "
                        f"negative")
    if config.training.max_open_shards < 1:
        raise UserError(f"option training.max_open_shards: {config.training.max_open_shards} must be at least 1")
    if config.training.num_workers < 0:
        raise UserError(f"option training.num_workers: {config.training.num_workers} must be 0 (tokenize and read in "
                        f"the training process) or positive")
    if config.model.document_positions and config.model.attention_mask != "block_causal":
        raise UserError("option model.document_positions: true needs model.attention_mask = 'block_causal' (with "
                        "causal attention a document sees the ones before it, so its positions continue)")
    if config.health.straggler_factor <= 1:
        raise UserError(f"option health.straggler_factor: {config.health.straggler_factor} must be above 1 (a "
                        f"straggler is slower than the median by this factor)")
    if config.checkpoint.keep_latest_k < 0:
        raise UserError(f"option checkpoint.keep_latest_k: {config.checkpoint.keep_latest_k} must be 0 (keep all) "
                        f"or positive")
    if config.fault_tolerance.enable:
        _validate_fault_tolerance(config)
    check_options(config)


def _validate_fault_tolerance(config: JobConfig) -> None:
    ft = config.fault_tolerance
    if ft.group_size < 1:
        raise UserError(f"option fault_tolerance.group_size: {ft.group_size} must be the number of replica groups "
                        f"(1 or more) when fault_tolerance.enable is set")
    if not 0 <= ft.replica_id < ft.group_size:
        raise UserError(f"option fault_tolerance.replica_id: {ft.replica_id} is not a group of group_size = "
                        f"{ft.group_size}; valid: 0 to {ft.group_size - 1}")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise UserError(f"option fault_tolerance.min_replica_size: {ft.min_replica_size} must be in [1, group_size = "
                        f"{ft.group_size}]")
    for key in ("fault_tolerance.process_group_timeout_ms", "fault_tolerance.connect_timeout_seconds",
                "fault_tolerance.quorum_timeout_seconds", "fault_tolerance.sync_steps",
                "fault_tolerance.join_timeout_seconds", "fault_tolerance.heartbeat_timeout_seconds"):
        if get_option(config, key) <= 0:
            raise UserError(f"option {key}: {get_option(config, key)} must be positive")
    if ft.semi_sync_method == "diloco":
        if ft.outer_lr <= 0:
            raise UserError(f"option fault_tolerance.outer_lr: {ft.outer_lr} must be positive (the DiLoCo outer "
                            f"step's learning rate; the DiLoCo paper's is 0.7)")
        if not 0 <= ft.outer_momentum < 1:
            raise UserError(f"option fault_tolerance.outer_momentum: {ft.outer_momentum} must be in [0, 1) (the "
                            f"DiLoCo outer step's Nesterov momentum; the DiLoCo paper's is 0.9)")
