"""The trainer: build every component from the config, then run the training loop.

Run with torchrun (see run_train.sh):  torchrun --nproc_per_node=N -m torchtitan.train --job.config_file FILE
"""

import contextlib
import dataclasses
import gc
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import record_function

from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.components.datasets import build_dataloader
from torchtitan.components.datasets.documents import StreamRetry
from torchtitan.components.datasets.shards import ShardAccess
from torchtitan.components.float8 import apply_float8, precompute_float8_scales
from torchtitan.components.health import Health, TrainingDiverged
from torchtitan.components.loss import count_valid_tokens, cross_entropy_sum
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.metrics import MetricsLogger, communication_metrics, save_run_info
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.components.tokenizer import build_model_tokenizer
from torchtitan.config import JobConfig, parse_args, save_config, to_toml, validation_shape
from torchtitan.config.compatibility import check_composition, setup_of
from torchtitan.config.model_shape import describe_model, shape_overrides
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.compile import compile_loss
from torchtitan.distributed.compression import compensation_state_bytes, require_compensation_fits
from torchtitan.distributed.context_parallel import (context_parallel_context, gathers_keys_and_values,
                                                     shard_documents)
from torchtitan.distributed import torch_compat
from torchtitan.distributed.fake import host_values
from torchtitan.distributed.fault_tolerance import (GroupStopped, QuorumError, data_slice, join_checks,
                                                    peer_checkpoint_folders, setup_fault_tolerance)
from torchtitan.distributed.fsdp import TORCH_DTYPES
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import is_multi_stage, pipeline_model
from torchtitan.distributed.rotated import init_rotated_weights, rotations
from torchtitan.dry_run import FAKE_BOS_ID
from torchtitan.dry_run import run as dry_run
from torchtitan.errors import UserError
from torchtitan.models import spec_of
from torchtitan.nn.attention import document_ids, document_positions
from torchtitan.nn.parameters import count_parameters
from torchtitan.tools.device_info import (device_name, memory_capacity, memory_stats, peak_flops,
                                          require_host_memory, reset_peak_memory)
from torchtitan.tools.logging import init_logger, logger


class NonFiniteError(UserError):
    """The loss or gradient norm became NaN/Inf (with debug.on_nonfinite = stop)."""


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        # A dry run (comm.mode = fake_backend, torchtitan/dry_run.py) plays one rank of a large world: no tokenizer
        # or data. On fake tensors it takes the code paths of the device it stands in for; on real ones (measured
        # on this machine's device) that device's.
        self.dry_run = config.comm.mode == "fake_backend"
        self.fake_tensors = self.dry_run and config.comm.fake_tensors
        self.device = dist_utils.init_distributed(config.comm.init_timeout_seconds, config.comm.trace_buf_size,
                                                  config.job.dump_folder,
                                                  fake_rank=(config.comm.fake_rank, config.comm.fake_world_size)
                                                  if self.dry_run else None, fake_on_device=not self.fake_tensors)
        self.target_device_type = config.comm.fake_device if self.fake_tensors else self.device.type
        self.rank, world_size = dist.get_rank(), dist.get_world_size()
        self.parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
        # Pairs of features that do not compose are refused before anything is built (config/compatibility.py).
        check_composition(setup_of(config, self.parallel_dims, self.target_device_type))
        self.world_mesh = self.parallel_dims.build_mesh(self.device.type)
        logger.info(f"{config.job.description}: {world_size} process(es) on {self.device.type}, mesh "
                    f"{self.parallel_dims.describe()}")
        if self.rank == 0 or self.dry_run:  # a dry run is one process, whichever rank it plays
            save_config(config, config.job.dump_folder)
            if not self.dry_run:
                save_run_info(config.job.dump_folder, world_size, self.device.type, device_name(self.device))
        if config.job.print_config and self.rank == 0:
            logger.info("Config:\n" + to_toml(config))
        self.seed = dist_utils.set_determinism(config.debug.seed, config.debug.deterministic,
                                               config.debug.deterministic_warn_only, self.device)

        # A dry run trains on the flavor's own vocabulary (128,256 for Llama 3.1), as with Meta's tokenizer.
        self.tokenizer = None if self.dry_run else build_model_tokenizer(config.model)
        self.model_spec = spec_of(config)
        self.model_args = dataclasses.replace(
            self.model_spec.build_args(config.model.flavor, config.training.seq_len,
                                       self.tokenizer.vocab_size if self.tokenizer else None,
                                       shape_overrides(config.model)),
            attention_device=self.target_device_type)
        self.model_spec.validate_parallelism(self.model_args, self.parallel_dims, config, self.target_device_type)
        torch_compat.require_torch_features(config, self.target_device_type, multi_stage_pipeline=(
            self.parallel_dims.pp_enabled and is_multi_stage(config.parallelism.pipeline_parallel_schedule)))
        self.grad_accumulation_steps = self._grad_accumulation_steps()
        self.dataloader = None if self.dry_run else self._build_dataloader(
            config.training.dataset, config.training.dataset_path, config.training.local_batch_size,
            config.training.seq_len, infinite=config.training.dataset_loop, section="training")

        with torch.device("meta"):
            model = self.model_spec.build_model(self.model_args)
        self.float8_layers = apply_float8(model, config)
        if config.model.print_after_conversion:
            logger.info(f"Model after conversion:\n{model}")
        self.num_params = count_parameters(model)
        self.flops_per_token = self.model_spec.flops_per_token(
            self.model_args, count_parameters(model, exclude_embeddings=True), config.training.seq_len)
        model_name = describe_model(config.model.flavor, shape_overrides(config.model))
        logger.info(f"Model {self.model_spec.name} {model_name}: {self.num_params:,} parameters, "
                    f"{self.flops_per_token / 1e9:.3f} GFLOPs per token")

        self.pp_schedule = None
        if self.parallel_dims.pp_enabled:
            self.pp_schedule, self.model_parts, self.has_first_stage, self.has_last_stage = pipeline_model(
                self.model_spec, model, self.world_mesh, self.parallel_dims, config, self.device, self._pipeline_loss)
        else:
            self.model_parts = [self.model_spec.parallelize(model, self.world_mesh, self.parallel_dims, config)]
            self.has_first_stage = self.has_last_stage = True
        # Rotated tensor parallelism's rings, one per model part: their norms' gradients are summed once per step.
        self.rotations = rotations(self.model_parts)
        if not self.fake_tensors and (self.device.type == "cpu" or config.training.enable_cpu_offload):
            # The gradients, not allocated yet, will take as many bytes as the parameters.
            require_host_memory(2 * self._parameter_and_gradient_bytes(), model_name,
                                int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if not self.fake_tensors:
            # Gradient compression's compensation state covers the rank's whole local gradient, unsharded.
            require_compensation_fits(config, compensation_state_bytes(self.model_parts),
                                      2 * self._parameter_and_gradient_bytes(),
                                      *memory_capacity(self.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        # A dry run materialises the model as fake tensors (shapes, no storage); its steps run in the same mode.
        self.fake_mode = torch_compat.get("FakeTensorMode")(allow_non_fake_inputs=True) if self.fake_tensors else None
        with self.fake_mode or contextlib.nullcontext():
            for part in self.model_parts:
                dist_utils.materialize_model(part, self.device, config.training.enable_cpu_offload)
                if not self.fake_tensors:  # fake weights have no values to initialise
                    # Under rotated tensor parallelism each rank draws its own shards only.
                    initialise = init_rotated_weights if self.rotations else dist_utils.init_model_weights
                    initialise(part, self.seed, self.device)
                part.train()

        self.loss_fn = cross_entropy_sum
        if config.compile.enable and "loss" in config.compile.components:
            self.loss_fn = compile_loss(cross_entropy_sum, config.compile.backend, loss_parallel=(
                self.parallel_dims.tp_enabled and not config.parallelism.disable_loss_parallel))
        self.global_valid_tokens = torch.ones((), device=self.device)
        # Under FlexDeMo each replica steps with its own gradient (the optimizer exchanges momentum components).
        self.replica_gradients = config.optimizer.name == "FlexDeMo" and self.parallel_dims.dp_replicate > 1
        self.optimizers = build_optimizers(self.model_parts, config.optimizer,
                                           self.world_mesh["dp_replicate"].get_group(), self.target_device_type)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, config.lr_scheduler, config.training.steps)
        self.train_state = TrainState()
        self._logged_sent: dict[str, int] = {}  # OptimizersContainer.sent_bytes() at the last log
        self.checkpointer = CheckpointManager(config.checkpoint, config.job.dump_folder, self.model_parts,
                                              self.optimizers, self.lr_schedulers, self.dataloader,
                                              self.train_state, self.model_spec.recorded_shape(self.model_args),
                                              self.model_spec.hf_adapter(self.model_args),
                                              peer_folders=peer_checkpoint_folders(config))
        # Mixed precision comes from FSDP/DDP's policy (or RTP's, the same) when they wrap the model, else from
        # autocast.
        wrapped = self.parallel_dims.fsdp_enabled or self.parallel_dims.ddp_enabled
        param_dtype = TORCH_DTYPES[config.training.mixed_precision_param]
        self.autocast = (torch.autocast(self.device.type, dtype=param_dtype)
                         if not wrapped and param_dtype != torch.float32 else contextlib.nullcontext())
        self.metrics = MetricsLogger(config.metrics, config.job.dump_folder, self.rank,
                                     is_logging_rank=self.rank == 0,
                                     run_config=dataclasses.asdict(config))
        self.peak_flops, peak_source = peak_flops(self.device, param_dtype, config.metrics.peak_flops)
        logger.info(f"MFU is measured against {self.peak_flops / 1e12:.2f} TFLOP/s per device ({peak_source})")
        self.health = Health(config.health, config.job.dump_folder, self.rank, self.device,
                             self.checkpointer.blocked_s)
        self.preempt_requested = False
        self._sigterm_before = None
        self.preempted = False
        self.left_quorum = False
        self.fault_tolerance = setup_fault_tolerance(config.fault_tolerance, {
            "model": self.checkpointer.model, "optimizer": self.optimizers.replica_group_view(),
            "lr_scheduler": self.lr_schedulers,
            "dataloader": self.dataloader, "train_state": self.train_state}, dict(os.environ), self.model_parts)
        if self.fault_tolerance is not None:
            self.checkpointer.diloco = self.fault_tolerance.diloco_state

    # ----------------------------------------------------------------------------------------------------------
    # Building blocks

    def _grad_accumulation_steps(self) -> int:
        training = self.config.training
        per_step = training.local_batch_size * self.parallel_dims.dp
        if training.global_batch_size == -1:
            return 1
        if training.global_batch_size % per_step:
            raise UserError(f"option training.global_batch_size: {training.global_batch_size} is not a multiple of "
                            f"local_batch_size x data-parallel degree = {training.local_batch_size} x "
                            f"{self.parallel_dims.dp} = {per_step}")
        return training.global_batch_size // per_step

    def _build_dataloader(self, dataset: str, dataset_path: str | None, batch_size: int, seq_len: int,
                          infinite: bool, section: str):
        dp_mesh = self.parallel_dims.get_mesh("dp")
        training = self.config.training
        dp_rank, dp_degree = dp_mesh.get_local_rank(), dp_mesh.size()
        if section == "training":  # each replica group trains on its own slice; each validates on the whole set
            dp_rank, dp_degree = data_slice(self.config.fault_tolerance, dp_rank, dp_degree)
        # Validation builds a loader per evaluation: worker processes and the mixture are for the training stream.
        return build_dataloader(dataset=dataset, dataset_path=dataset_path,
                                text_field=training.dataset_text_field, tokenizer=self.tokenizer,
                                seq_len=seq_len, local_batch_size=batch_size, dp_rank=dp_rank,
                                dp_degree=dp_degree, infinite=infinite, config_section=section,
                                num_workers=training.num_workers if section == "training" else 0,
                                seed=training.data_seed, sources=training.sources if section == "training" else None,
                                batches_per_step=self.grad_accumulation_steps if section == "training" else 1,
                                stream_retry=StreamRetry(training.stream_max_attempts, training.stream_backoff_seconds),
                                shard_access=ShardAccess(training.max_open_shards, training.verify_all_shards))

    def _masking(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs for model.attention_mask = block_causal, from where the batch's documents start (BOS),
        and for causal attention over keys gathered by context parallelism, the tokens' positions; passed to every
        pipeline stage too."""
        if self.config.model.attention_mask == "causal":
            if not gathers_keys_and_values(self.config):
                return {}
            # A rank's share of the sequence is not its start: its tokens' RoPE positions come with them, and order
            # the causal mask over the gathered keys.
            return {"positions": torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)}
        ids = document_ids(inputs, self.tokenizer.bos_id if self.tokenizer else FAKE_BOS_ID)
        if self.config.model.document_positions:
            return {"document_ids": ids, "positions": document_positions(ids)}
        if self.parallel_dims.cp_enabled:
            # A rank's share of the sequence is not its start: its tokens' RoPE positions come with them.
            return {"document_ids": ids, "positions": torch.arange(ids.shape[1], device=ids.device).expand_as(ids)}
        return {"document_ids": ids}

    def _pipeline_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(pred, labels) / self.global_valid_tokens

    @contextlib.contextmanager
    def _train_context(self, inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[
            tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """This rank's (inputs, labels, masking inputs of the model). Context parallelism shards the sequence of the
        batch and the tokens' positions (with packed documents balanced by the mask's work, their ids too; the ring
        shards the RoPE table instead); loss parallelism lets the vocabulary-sharded logits enter the loss. Both must
        cover forward and backward."""
        masking = self._masking(inputs)
        with contextlib.ExitStack() as stack:
            if self.parallel_dims.cp_enabled and masking:
                inputs, labels, *sharded = shard_documents(self.world_mesh["cp"], masking.get("document_ids"),
                                                           [inputs, labels, *masking.values()])
                masking = dict(zip(masking, sharded))
            elif self.parallel_dims.cp_enabled:
                ropes = [part.rope for part in self.model_parts]
                stack.enter_context(context_parallel_context(
                    self.world_mesh["cp"], buffers=[inputs, labels, *ropes], buffer_seq_dims=[1, 1, *[0] * len(ropes)],
                    no_restore_buffers={inputs, labels},
                    rotate_method=self.config.parallelism.context_parallel_rotate_method))
            if self.parallel_dims.tp_enabled and not self.config.parallelism.disable_loss_parallel:
                stack.enter_context(loss_parallel())
            yield inputs, labels, masking

    def _next_batches(self, data_iterator: Iterator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = [batch for _ in range(self.grad_accumulation_steps) if (batch := next(data_iterator, None))]
        # The data's last batch can be short: it would weigh its sequences unlike every other step's, and pipeline
        # micro-batching cannot split it (the first stage raises, the others wait). The run stops before it, so
        # that no checkpoint records the data position the loader moved to after it (the start of the data).
        complete = len(batches) == self.grad_accumulation_steps and all(
            inputs.shape[0] == self.config.training.local_batch_size for inputs, _ in batches)
        if not self.config.training.dataset_loop:
            # Data-parallel ranks can run out a step apart: all stop at the first step any rank cannot fill,
            # rather than some raising while the others wait for them in the step's collectives.
            has_data = torch.tensor(float(complete), device=self.device)
            dist.all_reduce(has_data, op=dist.ReduceOp.MIN)
            complete = bool(has_data.item())
        if not complete:
            raise UserError(f"option training.dataset_loop: the data ran out at step {self.train_state.step + 1} "
                            f"(dataset_loop = false); use more data, fewer training.steps, or dataset_loop = true")
        return [(inputs.to(self.device), labels.to(self.device)) for inputs, labels in batches]

    # ----------------------------------------------------------------------------------------------------------
    # One step

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the loss (already divided by the global token count), after backward."""
        with self._train_context(inputs, labels) as (inputs, labels, masking):
            if self.pp_schedule is not None:
                losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
                targets = labels if self.has_last_stage else None
                with self.autocast:
                    if self.has_first_stage:
                        self.pp_schedule.step(inputs, target=targets, losses=losses, return_outputs=False, **masking)
                    else:
                        self.pp_schedule.step(target=targets, losses=losses, return_outputs=False, **masking)
                return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
            with self.autocast:
                pred = self.model_parts[0](inputs, **masking)
                loss = self.loss_fn(pred, labels) / self.global_valid_tokens
            del pred
            loss.backward()
        # Under loss parallelism the loss is a replicated DTensor: keep a plain tensor for the reductions.
        return loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, float]:
        """One optimizer step over the accumulation micro-batches; returns (global mean loss, grad norm, lr)."""
        local_tokens = torch.stack([count_valid_tokens(labels) for _, labels in batches]).sum().float()
        # Ranks of one data-parallel group hold the same sequences, so the global count sums over dp only.
        # The step's first collective: a rank slower in its own work (data, host, step end) is waited for here.
        with self.health.waiting_for_peers():
            dist.all_reduce(local_tokens, group=self.parallel_dims.get_mesh("dp").get_group())
        self.global_valid_tokens = local_tokens
        # Context parallelism shards the batches in place: a re-run needs them as they came.
        rerun_batches = [(inputs.clone(), labels.clone()) for inputs, labels in batches] \
            if self.config.health.rerun_bad_steps else None
        global_loss, grad_norm_host, any_nonfinite, any_preempted = self._summary(*self._gradients(batches))
        self.preempted = any_preempted > 0
        step = self.train_state.step + 1
        # A dry run's values are no training run's (fake collectives leave their outputs unwritten): every step
        # takes the update, whose time and memory it measures.
        if any_nonfinite and not self.dry_run and self.config.debug.on_nonfinite == "stop":
            raise NonFiniteError(f"step {step}: non-finite loss ({global_loss}) or gradient norm "
                                 f"({grad_norm_host}); stopping before the update (debug.on_nonfinite = "
                                 f"stop). Lower optimizer.lr, check the data, or set debug.on_nonfinite = skip")
        if self.fault_tolerance is not None and not self.fault_tolerance.should_commit():
            self.optimizers.zero_grad()
            self.health.not_committed()
            return global_loss, grad_norm_host, self.lr_schedulers.last_lr
        # The loss and gradient norm are global (the same on every rank), so every rank takes the same decision.
        if not self.dry_run and self.health.skip_update(step, global_loss, grad_norm_host, any_nonfinite > 0):
            if rerun_batches is not None:
                self._rerun_skipped_step(step, rerun_batches, global_loss, grad_norm_host)
            self.optimizers.zero_grad()
        else:
            # An async checkpoint of the previous step may still be copying the weights and optimizer state.
            self.checkpointer.wait_for_staging()
            self.optimizers.step()
            precompute_float8_scales(self.model_parts, self.config)
        lr = self.lr_schedulers.last_lr
        self.lr_schedulers.step()
        return global_loss, grad_norm_host, lr

    def _gradients(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over the step's micro-batches from zeroed gradients, the gradients' average over the
        replica groups (fault tolerance) and clipping: (this rank's loss, the global gradient norm)."""
        self.optimizers.zero_grad()
        loss = sum(self.forward_backward(inputs, labels) for inputs, labels in batches)
        for rotation in self.rotations:
            rotation.sync_replicated_gradients()
        parameters = [p for part in self.model_parts for p in part.parameters()]
        if self.fault_tolerance is not None:
            self.fault_tolerance.average_gradients(parameters)
        # Labelled regions name the step's parts in profiler traces (torchtitan/tools/step_breakdown.py).
        with record_function("clip_grad_norm"):
            grad_norm = dist_utils.clip_grad_norm_(parameters, self.config.training.max_norm,
                                                   self.world_mesh["pp"] if self.parallel_dims.pp_enabled else None,
                                                   self.device)
        return loss, grad_norm

    def _summary(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float, float, float]:
        """(global loss, gradient norm, whether any rank saw a non-finite value, whether any rank was told to stop),
        the same on every rank, so that every rank takes the same decisions on them (skip, stop). One all-reduce
        gives every rank the global loss (each TP rank holds a copy: divide by tp; stages without the loss add zero)
        and the flags (SIGTERM may reach ranks at different steps; all must stop after the same one).

        The gradient norm is the norm of the gradient the optimizer steps with, the same on every rank, except
        where replicas keep their own gradients (FlexDeMo: no gradient is all-reduced across replicas, and each
        replica's norm is its own). There it is the root mean square over the replicas of their gradients' norms,
        sqrt(mean_r |g_r|^2), from the same all-reduce (every rank of a replica holds its replica's norm): the
        norm of no single gradient, at least the norm of the replicas' mean gradient, which no rank holds."""
        grad_norm_value = grad_norm.detach().float()
        nonfinite = (~torch.isfinite(loss.float())) | (~torch.isfinite(grad_norm_value))
        entries = [loss.float() / self.parallel_dims.tp, nonfinite.float(),
                   torch.tensor(float(self.preempt_requested), device=self.device)]
        if self.replica_gradients:
            entries.append(grad_norm_value.square() / self.parallel_dims.world_size)
        with record_function("step_summary"):
            summary = torch.stack(entries)
            dist.all_reduce(summary)
            global_loss, any_nonfinite, any_preempted, *mean_square = host_values(summary)
        norm = math.sqrt(mean_square[0]) if mean_square else host_values(grad_norm_value.reshape(1))[0]
        return global_loss, norm, any_nonfinite, any_preempted

    def _rerun_skipped_step(self, step: int, batches: list[tuple[torch.Tensor, torch.Tensor]], loss: float,
                            grad_norm: float) -> None:
        """health.rerun_bad_steps: the forward and backward of a step whose update was skipped, again, on the same
        micro-batches from the same weights (nothing changed them: the update was skipped, and gradients start from
        zero), compared bit for bit with the first run's global loss and gradient norm. Those are the same on every
        rank, so every rank reaches the same verdict without another collective."""
        rerun_loss, rerun_grad_norm, _, _ = self._summary(*self._gradients(batches))
        self.health.rerun_verdict(step, (loss, grad_norm), (rerun_loss, rerun_grad_norm))

    # ----------------------------------------------------------------------------------------------------------
    # Validation

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        cfg = self.config.validation
        batch_size, seq_len = validation_shape(self.config)
        loader = self._build_dataloader(cfg.dataset, cfg.dataset_path, batch_size, seq_len, infinite=False,
                                        section="validation")
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        data_iterator = iter(loader)
        batches = 0
        while cfg.steps == -1 or batches < cfg.steps:
            batch = next(data_iterator, None)
            # Data-parallel ranks can hold one batch more or less, and the last batch can be short (which pipeline
            # micro-batching cannot split): stop together when any rank has no full batch left.
            full = batch is not None and batch[0].shape[0] == batch_size
            has_batch = torch.tensor(float(full), device=self.device)
            dist.all_reduce(has_batch, op=dist.ReduceOp.MIN)
            if not has_batch.item():
                break
            inputs, labels = batch[0].to(self.device), batch[1].to(self.device)
            # Counted before context parallelism shards the labels in place (they are not restored).
            tokens += count_valid_tokens(labels)
            with self._train_context(inputs, labels) as (inputs, labels, masking), self.autocast:
                if self.pp_schedule is not None:
                    loss_sum += self._pipeline_eval(inputs, labels, masking)
                else:
                    loss = self.loss_fn(self.model_parts[0](inputs, **masking), labels)
                    loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss
            batches += 1
        totals = torch.stack([loss_sum / self.parallel_dims.tp, tokens])
        dist.all_reduce(totals)
        # Tokens were counted on every rank that holds a batch: keep one count per data-parallel rank.
        valid_tokens = totals[1].item() / (self.parallel_dims.world_size // self.parallel_dims.dp)
        loss = totals[0].item() / max(valid_tokens, 1.0)
        result = {"validation_loss": loss, "validation_perplexity": float(torch.tensor(loss).exp())}
        logger.info(f"validation at step {step}: loss {loss:.4f}, perplexity {result['validation_perplexity']:.2f}"
                    f" over {int(valid_tokens):,} tokens")
        return result

    def _pipeline_eval(self, inputs: torch.Tensor, labels: torch.Tensor,
                       masking: dict[str, torch.Tensor]) -> torch.Tensor:
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        targets = labels if self.has_last_stage else None
        self.global_valid_tokens = torch.ones((), device=self.device)
        if self.has_first_stage:
            self.pp_schedule.eval(inputs, target=targets, losses=losses, return_outputs=False, **masking)
        else:
            self.pp_schedule.eval(target=targets, losses=losses, return_outputs=False, **masking)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)

    # ----------------------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> None:
        config = self.config
        if config.checkpoint.create_seed_checkpoint:
            if self.parallel_dims.world_size != 1:
                raise UserError("option checkpoint.create_seed_checkpoint: run it with one process (NGPU=1)")
            self.checkpointer.save_seed()
            logger.info("Seed checkpoint written; exiting")
            return
        self.checkpointer.load()
        if self.fault_tolerance is not None:
            self.fault_tolerance.resume(self.train_state.step)
        self.health.begin(self.train_state.step)
        # Restored by close(): a process that goes on after training (a notebook, a test) keeps its own handling.
        self._sigterm_before = signal.signal(signal.SIGTERM, self._on_sigterm)
        data_iterator = iter(self.dataloader)
        gc.disable()
        gc.collect(1)
        batch_tokens = self.grad_accumulation_steps * config.training.local_batch_size * \
            config.training.seq_len * self.parallel_dims.dp
        window = {"time": time.perf_counter(), "steps": 0, "data_time": 0.0}
        reset_peak_memory(self.device)
        # The training timeout applies after the first step of this run (the first after a resume too): that step
        # may take longer (lazy initialisation, compilation).
        first_step = self.train_state.step + 1
        logger.info(f"Training {config.training.steps} steps from step {self.train_state.step}: global batch "
                    f"{batch_tokens:,} tokens, {self.grad_accumulation_steps} accumulation step(s)")
        with maybe_enable_profiling(config, self.rank, self.train_state.step, self.device) as profiler, \
                maybe_enable_memory_snapshot(config, self.rank, self.device, self.train_state.step) as memory_profiler:
            while self.train_state.step < config.training.steps:
                if self.fault_tolerance is not None:
                    self.health.mark()
                    try:
                        healed = self.fault_tolerance.start_step()
                    except GroupStopped as stopped:
                        self._left(stopped)
                        break
                    self.health.quorum_formed(self.train_state.step if healed else None)
                    if healed:
                        # Recovered from a peer: read on from its data position.
                        data_iterator = iter(self.dataloader)
                step = self.train_state.step + 1
                if step % config.training.gc_freq == 0 or config.training.gc_debug:
                    gc.collect(1)
                data_start = time.perf_counter()
                with record_function("data"), self.health.timed("data"):
                    batches = self._next_batches(data_iterator)
                window["data_time"] += time.perf_counter() - data_start
                with self.health.timed("step", step):
                    loss, grad_norm, lr = self.train_step(batches)
                if self.fault_tolerance is not None and not self.fault_tolerance.committed:
                    continue
                self.train_state.step = step
                self.train_state.tokens_seen += batch_tokens
                if self.fault_tolerance is not None:
                    try:
                        healed = self.fault_tolerance.sync(step)
                    except GroupStopped as stopped:
                        self._left(stopped)
                        break
                    if healed:
                        # LocalSGD or DiLoCo healed this group from a peer at a sync: go on from the peer's step and
                        # data position.
                        data_iterator = iter(self.dataloader)
                        step = self.train_state.step
                        self.health.healed(step)
                window["steps"] += 1
                if step == first_step:
                    dist_utils.set_train_timeout(config.comm.train_timeout_seconds)
                last_step = step == config.training.steps or self.preempted
                if step == 1 or step % config.metrics.log_freq == 0 or last_step:
                    self._log_step(step, loss, grad_norm, lr, batch_tokens, window)
                if config.validation.enable and (step % config.validation.freq == 0 or last_step):
                    validation_start = time.perf_counter()
                    with self.health.timed("validation"):
                        self.metrics.log(step, self.validate(step))
                    # Validation is not training: keep it out of the next logged tokens/s.
                    window["time"] += time.perf_counter() - validation_start
                with self.health.timed("checkpoint", step):
                    self.checkpointer.save(step, last_step=last_step and not self.preempted, force=self.preempted)
                if stragglers := self.health.step_end(step):
                    self.metrics.log(step, stragglers)
                if profiler is not None:
                    profiler.step()
                if memory_profiler is not None:
                    memory_profiler.step()
                if self.preempted:
                    saved = (f"checkpoint {self.checkpointer.folder / f'step-{step}'} written"
                             if config.checkpoint.enable
                             else "NO checkpoint written (checkpoint.enable = false): a relaunch starts over")
                    logger.warning(f"SIGTERM received: stopped after step {step}, {saved}; exiting")
                    break
        with self.health.timed("checkpoint"):
            self.checkpointer.close()
        self.health.finish("left" if self.left_quorum else "preempted" if self.preempted else "finished")
        self.metrics.close()
        if not self.preempted:
            logger.info("Training finished")

    @record_function("log_step")
    def _log_step(self, step: int, loss: float, grad_norm: float, lr: float, batch_tokens: int,
                  window: dict) -> None:
        elapsed = time.perf_counter() - window["time"]
        tokens_per_device = batch_tokens * window["steps"] / self.parallel_dims.world_size
        tps = tokens_per_device / elapsed
        tflops = self.flops_per_token * tps / 1e12
        memory = memory_stats(self.device)
        cuda = self.device.type == "cuda"
        # One all-reduce for every maximum over ranks: peak memory (CUDA: reserved and allocated; CPU: RSS) and
        # the model state held.
        optimizer_bytes = self.optimizers.state_bytes()
        maxima = torch.tensor([memory["max_reserved_gib" if cuda else "max_rss_gib"],
                               memory.get("max_allocated_gib", 0.0),
                               (self._parameter_and_gradient_bytes() + optimizer_bytes) / 2**30,
                               optimizer_bytes / 2**30], device=self.device)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        peak_gib, allocated_gib, state_gib, optimizer_state_gib = maxima.tolist()
        # This rank's bytes sent per step since the last log, by kind (OptimizersContainer.sent_bytes); rotated tensor
        # parallelism's rotations (weight shards and gradient buffers) and its norms' all-reduce are sent as they are,
        # uncompressed.
        sent = self.optimizers.sent_bytes()
        for rotation in self.rotations:
            sent["sent_bytes"] = sent.get("sent_bytes", 0) + rotation.sent_bytes
            sent["uncompressed_bytes"] = sent.get("uncompressed_bytes", 0) + rotation.sent_bytes
        comm = communication_metrics(sent, self._logged_sent, window["steps"])
        self._logged_sent = sent
        self.metrics.log(step, {
            "loss": loss, "grad_norm": grad_norm, "lr": lr, "tps": tps,
            "tflops": tflops, "mfu": 100 * tflops * 1e12 / self.peak_flops, "memory_gib": peak_gib,
            **({"memory_allocated_gib": allocated_gib} if cuda else {}),
            "data_pct": 100 * window["data_time"] / elapsed, "tokens_seen": self.train_state.tokens_seen,
            "model_state_gib": state_gib, "optimizer_state_gib": optimizer_state_gib, **comm,
            **self.health.metrics(),
            **({"replica_groups": self.fault_tolerance.participants()} if self.fault_tolerance else {}),
        })
        window.update(time=time.perf_counter(), steps=0, data_time=0.0)
        reset_peak_memory(self.device)

    def _parameter_and_gradient_bytes(self) -> int:
        """Bytes this rank holds of parameters and gradients (local shards only)."""
        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        total = 0
        for part in self.model_parts:
            for p in part.parameters():
                total += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
        return total

    def _on_sigterm(self, signum, frame) -> None:
        # Finish the current step, checkpoint it, and exit so that a requeued job continues from here. A replica
        # group waiting for a quorum leaves it at once instead (GroupStopped raised here, in the wait).
        self.preempt_requested = True
        if self.fault_tolerance is not None:
            self.fault_tolerance.stop()

    def _left(self, stopped: GroupStopped) -> None:
        """The replica group left the quorum on SIGTERM: no step is in flight; the weights may be half-way through
        a peer's state (healing) or a sync, so nothing is saved: the other groups hold the state, and a restarted
        group heals from them or resumes from its last checkpoint."""
        self.preempted = self.left_quorum = True
        logger.warning(f"{stopped}; exiting without a new checkpoint (the other groups hold the state; this "
                       f"group's checkpoints are in {self.checkpointer.folder})")

    def close(self) -> None:
        # Also after an error: flushes the metrics and releases the file (idempotent after train() closed it).
        self.metrics.close()
        if self._sigterm_before is not None:
            signal.signal(signal.SIGTERM, self._sigterm_before)
            self._sigterm_before = None
        if self.fault_tolerance is not None:
            self.fault_tolerance.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


# Exit codes (docs/debugging.md): a scheduler may requeue EXIT_COMM_FAILURE and EXIT_PREEMPTED, never
# EXIT_USER_ERROR, which would fail the same way again. EXIT_PREEMPTED is what a process killed by SIGTERM reports
# (128 + 15), so that nothing downstream (SLURM's afterok dependencies, wrapper scripts) takes a preempted run for a
# finished one.
EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3
EXIT_COMM_FAILURE = 4
EXIT_PREEMPTED = 128 + signal.SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT


def _failed_during(trainer: Trainer | None) -> str:
    return f"step {trainer.train_state.step + 1}" if trainer is not None else "start-up"


def out_of_memory_message(error: torch.OutOfMemoryError, during: str) -> str:
    """One line for a device out of memory: torch's own account of it (what was asked, what is free) and the options
    that lower the peak. It fails the same way on a rerun, as a configuration mistake does."""
    sentences = str(error).strip().split(". ")
    account = ". ".join(sentences[:3]).rstrip(".")
    return (f"{during}: {account}. The layout does not fit this device: lower training.local_batch_size, checkpoint "
            f"activations (activation_checkpoint.mode), or shard more (parallelism.data_parallel_shard_degree, "
            f"tensor_parallel_degree, pipeline_parallel_degree); a dry run (COMM_MODE=fake_backend) or scripts/plan.py "
            f"gives a layout's peak before the run (docs/scaling.md)")


def main(argv: list[str] | None = None) -> int:
    # Before the first CUDA allocation: segments that grow in place instead of one cudaMalloc per block size. With
    # torch's default, blocks of every size FSDP, activations and the optimizer ask for fragment the reserved
    # memory: measured on an H200, the reserved peak of the 8B on 8 GPUs (one rank, compiled, per-op AC) was 21%
    # above the allocated one (docs/scaling.md). A value the user set wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dist_utils.end_with_launcher(dict(os.environ))
    init_logger()
    if untested := torch_compat.untested_torch():
        logger.warning(untested)
    trainer = None
    try:
        config = parse_args(argv)
        if config.fault_tolerance.enable:  # each replica group is a job of its own: metrics, checkpoints, records
            replica = f"replica_{config.fault_tolerance.replica_id}"
            config.job.dump_folder = os.path.join(config.job.dump_folder, replica)
            # Before writing anything there: a second copy of a running group must not touch its files.
            join_checks(config.fault_tolerance, dict(os.environ))
        try:
            os.makedirs(config.job.dump_folder, exist_ok=True)
        except OSError as e:
            raise UserError(f"option job.dump_folder: cannot create {config.job.dump_folder}: {e}") from None
        if config.comm.mode == "fake_backend":
            dry_run(config, Trainer)
            return 0
        trainer = Trainer(config)
        trainer.train()
    except (NonFiniteError, TrainingDiverged) as e:
        logger.error(f"error: {e}")
        return EXIT_NONFINITE
    except UserError as e:
        logger.error(f"error: {e}")
        return EXIT_USER_ERROR
    except torch.OutOfMemoryError as e:
        logger.error(f"error: {out_of_memory_message(e, _failed_during(trainer))}")
        return EXIT_USER_ERROR
    except QuorumError as e:
        logger.error(f"error: {e}")
        return EXIT_COMM_FAILURE
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal's process group: one line each, not a traceback each.
        logger.warning(f"interrupted (SIGINT) during {_failed_during(trainer)}; stopped without saving a checkpoint")
        return EXIT_INTERRUPTED
    except RuntimeError as e:
        message = dist_utils.describe_comm_failure(e, _failed_during(trainer))
        if message is None:
            raise
        logger.error(f"error: {message}")
        return EXIT_COMM_FAILURE
    finally:
        if trainer is not None:
            trainer.close()
        elif dist.is_initialized():
            # Trainer() failed after joining the process group: a later main() in this process must join anew.
            dist.destroy_process_group()
    if trainer.preempted and trainer.train_state.step < config.training.steps:
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    exit_code = main()
    # Skip interpreter teardown: on rare runs a background thread of torch's still joinable at static destruction
    # aborts the process ("terminate called without an active exception") after training has finished.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
