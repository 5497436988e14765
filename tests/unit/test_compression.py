"""The low-bit wire format, LoCo's and classic error feedback's compensation, QSDP's all-gather and the checkpointed
residuals, with real gloo processes (forked: spawned ones would import torch again, seconds each on two cores)."""

import contextlib
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from tests.unit.forked_ranks import run_ranks
from torchtitan.components.checkpoint import read_metadata
from torchtitan.components.checkpoint.loading import exact_where_it_fits
from torchtitan.config.compatibility import check_composition, setup_of
from torchtitan.config.job_config import JobConfig
from torchtitan.config.options import get_option
from torchtitan.distributed.compression import (EXACT, GRADIENT_COMPRESSION, CompressionState, _param_groups,
                                                apply_compression, compensation_state_bytes, compression_stats,
                                                require_compensation_fits, validate_compression)
from torchtitan.distributed.compression.hadamard import hadamard_rotate
from torchtitan.distributed.compression.loco import CompressedReduceScatter, ErrorFeedback, LoCo
from torchtitan.distributed.compression.qsdp import QuantizedAllGather
from torchtitan.distributed.compression.quantize import (_add_content_seeded_uniform, decode, encode,
                                                         encode_and_restore, payload_bytes, relative_error)
from torchtitan.distributed.fsdp import apply_fsdp
from torchtitan.distributed.utils import init_model_weights, materialize_model
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer

# A deprecated torch API (all_gather_into_tensor and reduce_scatter_tensor were) fails here, not in users' logs.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

WORLD = 2
ROW = 300  # not a multiple of the 128-value block: the payload pads


# ------------------------------------------------------------------------------------------------------------------
# The wire format, in one process

@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.15)])
@pytest.mark.parametrize("rotate", [False, True])
def test_round_trip_error_and_payload_size(bits, bound, rotate):
    values = torch.randn(3, ROW, generator=torch.Generator().manual_seed(0))
    payload = encode(values, bits, rotate=rotate)
    assert payload.dtype == torch.uint8 and payload.shape == (3, payload_bytes([ROW], bits))
    restored = decode(payload, ROW, bits, rotate=rotate)
    error = ((restored - values).norm() / values.norm()).item()
    assert 0 < error < bound


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("segments", [None, [300, 128, 77]])
def test_what_the_sender_restores_and_decoding_in_place_match_decode(bits, rotate, segments):
    n = sum(segments) if segments else 2 * ROW
    values = torch.randn(2, n, generator=torch.Generator().manual_seed(3)).bfloat16()
    payload, restored = encode_and_restore(values, bits, stochastic=True, rotate=rotate, segments=segments)
    assert torch.equal(payload, encode(values, bits, stochastic=True, rotate=rotate, segments=segments))
    decoded = decode(payload, n, bits, rotate, segments)
    assert torch.equal(restored, decoded)
    out = torch.empty(2, n, dtype=torch.bfloat16)
    assert decode(payload, n, bits, rotate, segments, out=out) is out and torch.equal(out, decoded.bfloat16())


def test_four_bit_codes_pack_two_per_byte_exactly():
    # Values on the grid (scale 1: the block maximum is 7) come back unchanged, both nibbles of every byte.
    codes = torch.arange(-7, 8).repeat(9)[:128].float().view(1, 128)
    assert torch.equal(decode(encode(codes, 4), 128, 4), codes)
    assert payload_bytes([128], 4) == 64 + 2 and payload_bytes([128, 1], 8) == 256 + 4


def test_stochastic_rounding_is_unbiased_and_reproducible():
    values = torch.full((1, 128 * 64), 0.3)
    values[0, ::128] = 1.0  # every block's scale is 1/7: 0.3 lies between two codes
    once = decode(encode(values, 4, stochastic=True), values.shape[1], 4)
    assert torch.equal(once, decode(encode(values, 4, stochastic=True), values.shape[1], 4))
    lower, upper = once[0, 1:128].unique().tolist()  # the two codes around 0.3 (2/7 and 3/7), nothing else
    assert lower == pytest.approx(2 / 7, rel=1e-2) and upper == pytest.approx(3 / 7, rel=1e-2)
    assert abs(once.mean() - values.mean()) < 2e-3
    nearest = decode(encode(values, 4), values.shape[1], 4)
    assert abs(nearest.mean() - values.mean()) > 1e-2  # rounding to nearest is biased here


def test_stochastic_rounding_draws_antithetic_pairs_on_the_float32_grid():
    dither = torch.zeros(1, 1001)
    _add_content_seeded_uniform(dither)
    first, second = dither[0, :501], dither[0, 501:]
    assert 0 <= dither.min() and dither.max() < 1 and len(first.unique()) > 490
    assert torch.equal(first[:500] + second, torch.full((500,), 1 - 2.0 ** -24))  # exact: both on the 2^-24 grid
    assert torch.equal(first * 2 ** 24, (first * 2 ** 24).round())


def test_stochastic_rounding_never_reads_a_device_value_on_the_host(monkeypatch):
    """Under fake tensors any host read of a value (`int()`, `.item()`) raises: the draws are made on the device,
    and no generator is built per encode (a new one each call was the old way)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def no_generator(*args, **kwargs):
        raise AssertionError("a torch.Generator was built")

    monkeypatch.setattr(torch, "Generator", no_generator)
    with FakeTensorMode():  # whole blocks: no cached (real) position index is involved
        payload = encode(torch.randn(2, 4 * 128), 8, stochastic=True)
    assert payload.shape == (2, payload_bytes([4 * 128], 8))


def test_hadamard_is_an_involution_and_spreads_an_outlier():
    blocks = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(hadamard_rotate(hadamard_rotate(blocks)), blocks, atol=1e-5)
    spiky = torch.randn(1, 4096, generator=torch.Generator().manual_seed(2)) * 1e-3
    spiky[0, ::512] = 1.0
    assert relative_error(spiky, 8, rotate=True) < relative_error(spiky, 8) / 2
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotate(torch.zeros(3, 100))


def test_loco_compensates_with_a_moving_average_of_its_errors_kept_in_8_bits_and_reset():
    """LoCo's update (Xie et al. 2024, as DeepSpeed implements it): h = g + e; e <- beta e + (1 - beta)(h - Q(h)),
    stored as 8-bit codes, reset to zero every reset_interval optimizer steps. Each step reduces twice (two
    micro-batches, as FSDP does under gradient accumulation): the reset counts steps, not reductions. Classic error
    feedback (e <- h - Q(h)) fails every comparison here."""
    beta, rows = 0.8, 2
    loco = LoCo(beta, reset_interval=3, segments=[ROW])
    generator = torch.Generator().manual_seed(7)
    reference = torch.zeros(rows, ROW)
    for step in range(1, 6):
        for _micro_batch in range(2):
            grad = torch.randn(rows, ROW, generator=generator)
            compensated = loco.compensate(grad)
            assert torch.allclose(compensated, grad + reference, atol=1e-7)
            sent = decode(encode(compensated, 4), ROW, 4)
            loco.update(compensated, sent)
            average = beta * reference + (1 - beta) * (compensated - sent)
            reference = decode(encode(average, 8), ROW, 8)
            assert not torch.allclose(reference, compensated - sent, atol=1e-3)  # not error feedback's
        loco.commit()
        assert loco.steps == step
        if step % 3 == 0:
            reference = torch.zeros(rows, ROW)  # the reset: the next step starts from a zero error
            assert loco.residual is None
        else:
            assert torch.allclose(loco.residual, reference, atol=1e-7)
    assert loco.raw.dtype == torch.uint8 and loco.raw.numel() == rows * payload_bytes([ROW], 8)


@pytest.mark.parametrize("compensation", [ErrorFeedback(), LoCo(0.8, 0, [ROW])], ids=["error_feedback", "loco"])
def test_a_dropped_step_leaves_the_compensation_as_it_was(compensation):
    """A step's reductions stage the state (each micro-batch's reduction reads what the step's earlier ones left);
    dropping the step's gradients (a skipped update, or before its re-run) discards it, so the state is bitwise
    what it was before the step, LoCo's step count included; the optimizer step commits it."""
    generator = torch.Generator().manual_seed(3)

    def reduce_step() -> None:
        for _micro_batch in range(2):
            compensated = compensation.compensate(torch.randn(2, ROW, generator=generator))
            compensation.update(compensated, decode(encode(compensated, 4), ROW, 4))

    reduce_step()
    compensation.commit()
    before = compensation.raw.clone()
    steps = getattr(compensation, "steps", None)
    reduce_step()
    assert torch.equal(compensation.raw, before)  # staged, not yet the state
    compensation.discard()
    assert torch.equal(compensation.raw, before) and getattr(compensation, "steps", None) == steps
    rows = torch.randn(2, ROW, generator=generator)
    assert torch.equal(compensation.compensate(rows), rows + compensation.residual)  # the next step starts there
    compensation.discard()
    reduce_step()
    compensation.commit()
    assert not torch.equal(compensation.raw, before)


def test_the_optimizer_step_commits_the_compensation_and_dropped_gradients_discard_it():
    """The trainer's two ends of a step: `step()` applies the gradients and commits what their reductions staged;
    `zero_grad()` (a skipped update, the start of a re-run, a step torchft did not commit) drops them and it."""
    from types import SimpleNamespace

    from torchtitan.components.optimizer import build_optimizers

    model = torch.nn.Linear(4, 4)
    container = build_optimizers([model], JobConfig().optimizer)
    calls = []
    container.compression = SimpleNamespace(commit=lambda: calls.append("commit"),
                                            discard=lambda: calls.append("discard"))
    model.weight.grad, model.bias.grad = torch.ones(4, 4), torch.ones(4)
    container.step()
    container.zero_grad()
    assert calls == ["commit", "discard"]


@pytest.mark.parametrize("compensation", [ErrorFeedback(), LoCo(0.8, 0, [128])], ids=["error_feedback", "loco"])
def test_state_set_by_a_checkpoint_is_recorded_on_the_reduction_stream(monkeypatch, compensation):
    """A checkpoint sets the state on the default stream; the reduction reads and releases it on FSDP's
    reduce-scatter stream. The caching allocator must learn of each crossing (record_stream): the state replaced
    (still read by the setter's stream) and the new one, at its first use on the reduction's stream, once."""
    recorded = []
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: "current stream")
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: recorded.append(stream))
    rows = torch.zeros(2, 128, device="meta")  # a device that is not the CPU (which has no streams)
    compensation.residual = rows.clone()
    assert len(recorded) == 0  # nothing replaced yet
    compensation.compensate(rows)
    assert recorded == ["current stream"]  # adopted by the reduction's stream
    compensation.update(rows, rows)
    compensation.commit()
    compensation.compensate(rows)
    assert len(recorded) == 1  # made on the reduction's stream: nothing to record
    compensation.residual = rows.clone()
    assert len(recorded) == 2  # the replaced state, made on the reduction's stream and read by the setter's


def test_scales_round_up_so_no_block_clips_its_maximum():
    # Blocks whose amax / qmax rounds down in bfloat16 (about half of random blocks): the maximum must still be
    # reached by a code, so every value is within half a code of its decoded value (nearest rounding), and the
    # largest magnitude is never decoded smaller than it is by more than that.
    values = torch.randn(1, 128 * 256, generator=torch.Generator().manual_seed(5))
    for bits in (4, 8):
        qmax = 2 ** (bits - 1) - 1
        payload = encode(values, bits)
        restored = decode(payload, values.shape[1], bits)
        scales = payload[:, -2 * 256:].contiguous().view(torch.bfloat16).float().view(-1, 1)
        blocks = values.view(-1, 128)
        assert (scales.squeeze(1) * qmax >= blocks.abs().amax(dim=1)).all()
        assert ((restored.view(-1, 128) - blocks).abs() <= scales / 2 * (1 + 1e-6)).all()


def test_two_fsdp_parameter_groups_are_refused_with_one_clear_error(monkeypatch):
    import torchtitan.distributed.compression as compression

    monkeypatch.setattr(compression, "FSDPModule", torch.nn.Linear)
    monkeypatch.setattr(compression, "fsdp_param_groups", lambda module: [object(), object()])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match=r"comm.gradient_compression: FSDP module 0 has 2 parameter groups"):
        apply_compression(model, config_with(gradient_compression="loco"))


# ------------------------------------------------------------------------------------------------------------------
# Options

def layout(replicate: int = 1, shard: int = 2) -> ParallelDims:
    return ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=1, tp=1, pp=1, world_size=replicate * shard)


def start_up_checks(config: JobConfig, dims: ParallelDims) -> None:
    """What the trainer checks of compression before it builds anything: the options' values, then the pairs."""
    validate_compression(config)
    check_composition(setup_of(config, dims, "cpu"))


def config_with(**comm) -> JobConfig:
    """`comm` options by name, a method's own as `table.option` (loco.beta)."""
    config = JobConfig()
    for key, value in comm.items():
        table, _, name = f"comm.{key}".rpartition(".")
        setattr(get_option(config, table), name, value)
    return config


@pytest.mark.parametrize("comm,dims,message", [
    ({"gradient_bits": 5}, layout(), r"comm.gradient_bits: 5 is not one of 4, 8"),
    ({"weight_quantization": "qsdp", "weight_bits": 16}, layout(), r"comm.weight_bits: 16 is not one of 4, 8"),
    ({"quantization_rotation": "hadamard"}, layout(), r"quantization_rotation: 'hadamard' .* nothing is"),
    ({"gradient_compression": "loco"}, layout(shard=1), r"option comm.gradient_compression.*: does not compose with .*\(no FSDP\)"),
    ({"gradient_compression": "loco"}, layout(replicate=2),
     r"option comm.gradient_compression .*: does not compose with data_parallel_replicate_degree > 1"),
    ({"weight_quantization": "qsdp"}, layout(replicate=2, shard=1),
     r"option comm.weight_quantization = 'qsdp': does not compose with .*\(no FSDP\)"),
    ({"gradient_compression": "loco", "loco.beta": 1.0}, layout(), r"comm.loco.beta: 1.0 must be in \[0, 1\)"),
    ({"gradient_compression": "loco", "loco.reset_interval": -1}, layout(), r"comm.loco.reset_interval: -1 must"),
])
def test_bad_values_and_combinations_are_refused(comm, dims, message):
    with pytest.raises(UserError, match=message):
        start_up_checks(config_with(**comm), dims)


def flexdemo(**options) -> JobConfig:
    config = JobConfig()
    config.optimizer.name = "FlexDeMo"
    for key, value in options.items():
        setattr(config.optimizer.flexdemo, key, value)
    return config


@pytest.mark.parametrize("options,dims,message", [
    ({}, layout(), r"option optimizer.name = 'FlexDeMo': does not compose with data_parallel_replicate_degree = 1"),
    ({"chunk_size": 256}, layout(replicate=2), r"optimizer.flexdemo.chunk_size: 256 must be in \[1, 128\]"),
    ({"topk": 4097}, layout(replicate=2), r"optimizer.flexdemo.topk: 4097 must be in \[1, chunk_size\^2 = 4096\]"),
    ({"momentum_decay": 1.0}, layout(replicate=2), r"optimizer.flexdemo.momentum_decay: 1.0 must be in \[0, 1\)"),
])
def test_bad_flexdemo_options_are_refused(options, dims, message):
    with pytest.raises(UserError, match=message):
        start_up_checks(flexdemo(**options), dims)


def test_flexdemo_lets_loco_compress_within_replicas():
    config = flexdemo()
    config.comm.gradient_compression = "loco"
    start_up_checks(config, layout(replicate=2, shard=2))  # FSDP runs within each replica: no HSDP all-reduce


def test_qsdp_refuses_the_float8_all_gather():
    config = config_with(weight_quantization="qsdp")
    config.model.converters = ["quantize.linear.float8"]
    config.quantize.linear.float8.enable_fsdp_float8_all_gather = True
    with pytest.raises(UserError, match="float8 all-gather"):
        start_up_checks(config, layout())


# ------------------------------------------------------------------------------------------------------------------
# Collectives and FSDP, with two processes

def tiny_fsdp(mesh, comm: dict | None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(model_args_for("tiny", 32))
    apply_fsdp(model, mesh, param_dtype="float32", reduce_dtype="float32", pp_enabled=False, cpu_offload=False,
               reshard_policy="default")
    if comm is not None:
        apply_compression(model, config_with(**comm))
    materialize_model(model, torch.device("cpu"), cpu_offload=False)
    init_model_weights(model, seed=0, device=torch.device("cpu"))
    return model


def backward(model: Transformer, rank: int, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed * 10 + rank))
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    loss.backward()
    return loss.detach()


def local_grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


class CheckedAllGather(AllGather):
    """Runs QSDP's all-gather and records whether it reused its codes and whether they equal a fresh encode."""

    def __init__(self, inner: QuantizedAllGather, calls: list):
        self.inner, self.calls = inner, calls

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # The input lies inside the output, which the all-gather overwrites: encode it first.
        fresh = encode(input_tensor.view(1, -1), self.inner.bits, stochastic=True, rotate=self.inner.rotate,
                       segments=self.inner.segments)
        before = self.inner.encoded
        self.inner(output_tensor, input_tensor, group, async_op)
        self.calls.append((self.inner.encoded is before, torch.equal(fresh, self.inner.encoded[1])))


@contextlib.contextmanager
def recorded_collectives():
    """(collective, dtype) of every all-to-all and reduce-scatter issued inside the block."""
    calls, originals = [], {name: getattr(dist, name) for name in ("all_to_all_single", "reduce_scatter_single")}

    def recording(name):
        def collective(output, input, *args, **kwargs):
            calls.append((name, input.dtype))
            return originals[name](output, input, *args, **kwargs)
        return collective

    for name in originals:
        setattr(dist, name, recording(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store", WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        group = dist.group.WORLD
        generator = torch.Generator().manual_seed(100 + rank)

        # Error feedback: over several steps, what was received plus every rank's residual is the sum of the grads.
        for rotate in (False, True):
            comm = CompressedReduceScatter(4, ErrorFeedback(), stochastic=False, rotate=rotate, segments=[ROW])
            received = torch.zeros(ROW)
            sent = torch.zeros(WORLD * ROW)
            for _ in range(5):
                grad = torch.randn(WORLD * ROW, generator=generator)
                sent += grad
                output = torch.empty(ROW)
                comm(output, grad.clone(), group, dist.ReduceOp.SUM)
                comm.compensation.commit()  # the optimizer stepped
                received += output
            dist.all_reduce(sent)
            residuals = comm.compensation.residual.clone()
            dist.all_reduce(residuals)
            results[f"ef_rotate{rotate}"] = (received, residuals[rank], sent.view(WORLD, ROW)[rank])
            results[f"ef_bytes_rotate{rotate}"] = (comm.sent_bytes, comm.uncompressed_bytes)

        # What one compressed reduce-scatter holds at its peak beyond its input, per value of the input (the memory
        # model's reduction_bytes_per_value): the second call of each (a committed state to read), torch's own
        # accounting of the tensors it allocates (the new state included).
        row = 64 * 1024
        reductions = {}
        for method, compensation in (("loco", lambda: LoCo(0.8, 0, [row])), ("error_feedback", ErrorFeedback),
                                     ("qsdp", lambda: None)):
            for bits in (4, 8):
                comm = CompressedReduceScatter(bits, compensation(), stochastic=method == "qsdp", rotate=False,
                                               segments=[row])
                for _ in range(2):
                    tracker = MemTracker()
                    with tracker:  # made inside, so that the tracker knows them: the input and output are left out
                        grad, output = torch.randn(WORLD * row, generator=generator), torch.empty(row)
                        comm(output, grad, group, dist.ReduceOp.SUM)
                    if comm.compensation is not None:
                        comm.compensation.commit()
                peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
                reductions[method, bits] = (peak - 4 * (grad.numel() + output.numel())) / grad.numel()
        results["reduction_bytes_per_value"] = reductions

        # One reduction without compensation: the own row is summed exactly, the others' rows as their codes.
        inputs = torch.randn(WORLD * ROW, generator=torch.Generator().manual_seed(200 + rank))
        output = torch.empty(ROW)
        CompressedReduceScatter(8, None, stochastic=False, rotate=False, segments=[ROW])(
            output, inputs.clone(), group, dist.ReduceOp.SUM)
        results["own_row"] = output

        # QSDP's all-gather: every rank decodes the same weights, close to the true ones, the same every call.
        shard = torch.randn(ROW, generator=generator)
        gather = QuantizedAllGather(8, rotate=False)
        outputs = []
        for _ in range(2):
            output = torch.empty(WORLD * ROW)
            gather(output, shard.clone(), group)
            outputs.append(output)
        truth = torch.empty(WORLD * ROW)
        dist.all_gather_single(truth, shard)
        results["qsdp"] = (outputs[0], outputs[1], truth)

        # FSDP: compression off leaves FSDP's own collectives (bitwise the same gradients); LoCo changes them a little.
        mesh = init_device_mesh("cpu", (WORLD,))
        plain, off, loco = (tiny_fsdp(mesh, comm) for comm in (None, {}, {"gradient_compression": "loco"}))
        for model in (plain, off, loco):
            backward(model, rank)
        CompressionState([loco]).commit()
        results["fsdp"] = (local_grads(plain), local_grads(off), local_grads(loco))
        results["fsdp_default_comm"] = [type(m._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__
                                        for m in off.modules()
                                        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups]
        results["stats"] = compression_stats([loco])
        # What a reduce-scatter of fp32 sends per rank ((W - 1) x the row), once per FSDP parameter group: the final
        # norm and the output layer share one.
        results["row_bytes"] = 4 * (WORLD - 1) * sum(p.to_local().numel() for p in loco.parameters())
        results["state_bytes"] = (compensation_state_bytes([loco]),
                                  sum(g._reduce_scatter_comm.compensation.raw.numel() for g in _param_groups([loco])))

        # QSDP's weights are encoded once per step: the backward re-gathers reuse the forward's codes, bitwise those
        # a fresh encode of their input gives, and the optimizer's update makes new ones.
        qsdp = tiny_fsdp(mesh, {"weight_quantization": "qsdp"})
        calls: list[tuple[bool, bool]] = []  # per all-gather: (codes reused, identical to a fresh encode)
        param_groups = {id(g): g for m in qsdp.modules() if isinstance(m, FSDPModule)
                        for g in m._get_fsdp_state()._fsdp_param_groups}.values()
        for param_group in param_groups:
            param_group._all_gather_comm = CheckedAllGather(param_group._all_gather_comm, calls)
        # The trainer's default, whose fused kernel leaves the parameters' version counters as they were.
        optimizer = torch.optim.AdamW(qsdp.parameters(), lr=0.1, fused=True)
        phases = []
        for seed in range(2):
            calls.clear()
            backward(qsdp, rank, seed)
            optimizer.step()
            phases.append(list(calls))
        results["qsdp_reuse"] = (len(param_groups), phases)

        # The checkpointed residuals: saving changes nothing live; the verbatim state restores it bit for bit, and
        # without it (another layout) each shard's owner gets what all ranks owed the shard.
        backward(loco, rank, seed=1)
        state = CompressionState([loco])
        state.commit()
        raw_before = [comm.compensation.raw.clone() for comm, _, _ in state.entries]
        owed = [comm.compensation.residual.clone() for comm, _, _ in state.entries]
        for total in owed:
            dist.all_reduce(total)
        with recorded_collectives() as save_collectives:
            saved = state.state_dict()
        raw_after = [comm.compensation.raw.clone() for comm, _, _ in state.entries]
        for comm, _, _ in state.entries:
            comm.compensation.raw = None
        state.load_state_dict(saved)
        restored = [comm.compensation.raw.clone() for comm, _, _ in state.entries]
        state.load_state_dict({key: value for key, value in saved.items() if not key.startswith(EXACT)})
        totals = [comm.compensation.residual.clone() for comm, _, _ in state.entries]
        results["state"] = (raw_before, raw_after, restored, owed, totals, sorted(saved))
        results["loco_save"] = (save_collectives, state.save_sent_bytes, state.save_full_precision_bytes,
                                [payload_bytes(comm.segments, 8) for comm, _, _ in state.entries],
                                [sum(comm.segments) for comm, _, _ in state.entries])

        # A checkpoint of error feedback's (fp32) residuals, which 4 ranks reshard (see test_residuals_reshard...);
        # saving them changes nothing either, and loading restores them bit for bit.
        error_feedback = tiny_fsdp(mesh, {"gradient_compression": "error_feedback"})
        state = CompressionState([error_feedback])
        for seed in range(2):
            backward(error_feedback, rank, seed)
            state.commit()
        raw_before = [comm.compensation.raw.clone() for comm, _, _ in state.entries]
        results["held"] = (state.state_bytes(), sum(raw.numel() * raw.element_size() for raw in raw_before))
        owed = [comm.compensation.residual.clone() for comm, _, _ in state.entries]
        for total in owed:
            dist.all_reduce(total)
        with recorded_collectives() as save_collectives:
            saved = state.state_dict()
        raw_after = [comm.compensation.raw.clone() for comm, _, _ in state.entries]
        for comm, _, _ in state.entries:
            comm.compensation.raw = None
        state.load_state_dict(saved)
        results["ef_state"] = (raw_before, raw_after, [comm.compensation.raw.clone() for comm, _, _ in state.entries])
        state.load_state_dict({key: value for key, value in saved.items() if not key.startswith(EXACT)})
        largest = torch.stack([residual.abs().max() for residual in raw_before])
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        results["ef_save"] = (save_collectives, largest, owed,
                              [comm.compensation.residual.clone() for comm, _, _ in state.entries])
        dcp.save({"optimizer": saved}, checkpoint_id=Path(out_dir) / "error_feedback")
        results["ef_totals"] = {key: value.full_tensor() for key, value in saved.items() if not key.startswith(EXACT)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def compression_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compression")


@pytest.fixture(scope="module")
def results(compression_dir) -> list[dict]:
    return run_ranks(worker, compression_dir, WORLD, 120, "compression")


@pytest.mark.parametrize("rotate", [False, True])
def test_error_feedback_conserves_the_gradient_sum(results, rotate):
    for rank_results in results:
        received, residual, sent = rank_results[f"ef_rotate{rotate}"]
        assert not torch.allclose(received, sent, atol=1e-2)  # the codes alone lose something...
        assert torch.allclose(received + residual, sent, atol=1e-4)  # ...which the residuals hold
        sent_bytes, uncompressed = rank_results[f"ef_bytes_rotate{rotate}"]
        assert sent_bytes / uncompressed == pytest.approx(payload_bytes([ROW], 4) / (4 * ROW))
        assert sent_bytes / uncompressed < 0.2


def test_the_own_row_is_summed_exactly_and_only_the_others_as_codes(results):
    inputs = [torch.randn(WORLD * ROW, generator=torch.Generator().manual_seed(200 + r)).view(WORLD, ROW)
              for r in range(WORLD)]
    for rank, rank_results in enumerate(results):
        expected = inputs[rank][rank].clone()
        for other in range(WORLD):
            if other != rank:
                expected += decode(encode(inputs[other][rank:rank + 1], 8), ROW, 8)[0]
        assert torch.allclose(rank_results["own_row"], expected, atol=1e-6)


def test_qsdp_all_gather_is_identical_on_every_rank_and_close(results):
    first, again, truth = results[0]["qsdp"]
    assert torch.equal(first, again)
    for rank_results in results[1:]:
        assert torch.equal(rank_results["qsdp"][0], first)
    assert 0 < ((first - truth).norm() / truth.norm()).item() < 0.02  # stochastic rounding: ~1%


def test_compression_off_is_bitwise_fsdp(results):
    for rank_results in results:
        plain, off, loco = rank_results["fsdp"]
        assert rank_results["fsdp_default_comm"] and "Compressed" not in str(rank_results["fsdp_default_comm"])
        for name in plain:
            assert torch.equal(plain[name], off[name]), name
        relative = max(((loco[n] - plain[n]).norm() / plain[n].norm()).item() for n in plain if plain[n].any())
        assert 0 < relative < 0.02  # 8-bit codes: every parameter's gradient within 2% (scales are per parameter)
        stats = rank_results["stats"]
        assert 0.25 < stats["sent_bytes"] / stats["uncompressed_bytes"] < 0.3  # 8-bit codes + scales of fp32
        # Each parameter group counted once (the tiny model's shards are unpadded: 64-wide tensors on 2 ranks).
        assert stats["uncompressed_bytes"] == rank_results["row_bytes"]


def test_the_predicted_compensation_state_is_what_loco_holds(results):
    for rank_results in results:
        predicted, held = rank_results["state_bytes"]
        assert predicted == held > 0


@pytest.mark.parametrize("method,bytes_per_value", [("loco", 1 + 2 / 128), ("error_feedback", 4.0), ("qsdp", 0.0)])
def test_the_memory_model_counts_the_compensation_state_unsharded(method, bytes_per_value):
    from torchtitan.planner.memory import estimate
    from torchtitan.nn.parameters import count_parameters

    def optimizer_bytes(gradient_compression: str) -> int:
        config = JobConfig()
        config.model.flavor = "8B"
        config.training.seq_len = 8192
        config.parallelism.data_parallel_shard_degree = 8
        config.comm.gradient_compression = gradient_compression
        return estimate(config, 8).optimizer

    with torch.device("meta"):
        params = count_parameters(Transformer(model_args_for("8B", 8192)))
    # Every rank holds a row per FSDP rank of its shards: the whole model, not an eighth (FSDP 8, no TP).
    assert optimizer_bytes(method) - optimizer_bytes("none") == pytest.approx(params * bytes_per_value, rel=1e-3)


def test_the_logged_optimizer_state_counts_the_compensation_state(results):
    """`optimizer_state_gib` (OptimizersContainer.state_bytes) adds what compensation state the rank holds: error
    feedback's fp32 residuals here, 4 bytes per value of every module's unsharded local gradient."""
    from types import SimpleNamespace

    from torchtitan.components.optimizer import OptimizersContainer

    for rank_results in results:
        held, residuals = rank_results["held"]
        assert held == residuals > 0
        container = SimpleNamespace(optimizers=[], compression=SimpleNamespace(state_bytes=lambda: held))
        assert OptimizersContainer.state_bytes(container) == held


def test_a_layout_whose_compensation_state_cannot_fit_is_refused():
    config = config_with(gradient_compression="error_feedback")
    require_compensation_fits(config, 30 * 2**30, 40 * 2**30, 80 * 2**30, "NVIDIA H100 memory")  # fits
    with pytest.raises(UserError, match=r"^option comm.gradient_compression: error_feedback keeps 32.0 GiB .* "
                                        r"exceeds the 80.0 GiB of NVIDIA H100 memory"):
        require_compensation_fits(config, 32 * 2**30, 50 * 2**30, 80 * 2**30, "NVIDIA H100 memory")


def test_qsdp_encodes_each_weight_shard_once_per_step(results):
    for rank_results in results:
        modules, phases = rank_results["qsdp_reuse"]
        for calls in phases:
            assert sum(not reused for reused, _ in calls) == modules  # each FSDP module's codes made once a step
            assert sum(reused for reused, _ in calls) >= 4  # the 4 blocks' backward re-gathers
            assert all(identical for _, identical in calls)


def test_saving_leaves_the_residuals_and_what_is_saved_restores_them(results):
    """LoCo's codes and error feedback's residuals: saving changes no live state (a run that saves trains as one that does not); the verbatim state restores it
    bit for bit (an exact resume); the per-parameter totals alone give each shard's owner what all ranks owed it."""
    for rank, rank_results in enumerate(results):
        raw_before, raw_after, restored, owed, totals, keys = rank_results["state"]
        assert "layers.0.attention.wq.weight" in keys
        assert any(key.startswith(EXACT) for key in keys)
        assert any(total.abs().sum() > 0 for total in owed)
        ef_before, ef_after, ef_restored = rank_results["ef_state"]
        assert any(before.any() for before in ef_before)
        for before, after, back in zip([*raw_before, *ef_before], [*raw_after, *ef_after],
                                       [*restored, *ef_restored]):
            assert torch.equal(after, before)
            assert torch.equal(back, before)
        for total, loaded in zip(owed, totals):
            # LoCo keeps its state as 8-bit codes: the owner's total is re-encoded, within half a code (the block's
            # maximum / 127, its bfloat16 scale rounded up by at most 2^-8) of the sum.
            atol = float(total.abs().max()) / 254 * (1 + 2 ** -8) + 1e-7
            assert torch.allclose(loaded[rank], total[rank], atol=atol)
            others = [r for r in range(WORLD) if r != rank]
            assert not loaded[others].any()  # each rank owes only its own shard after loading the totals


def test_saving_sends_the_compensation_state_as_8_bit_codes(results):
    """A save's totals travel as 8-bit codes, one all-to-all per FSDP module, not a reduce-scatter of fp32 states
    (the data-parallel link is the one gradient compression spares): (W - 1) payload rows per module and rank, 26%
    of fp32's bytes (1 byte per value and a bfloat16 scale per 128). LoCo's codes are its stored state, so what
    each owner gets is the fp32 sum of the states (checked above); error feedback's fp32 residuals are rounded to
    the codes, each rank's within half a code of its block's largest residual (the block's maximum / 127, its
    bfloat16 scale rounded up by at most 2^-8)."""
    for rank, rank_results in enumerate(results):
        collectives, sent, full_precision, payloads, rows = rank_results["loco_save"]
        assert collectives == [("all_to_all_single", torch.uint8)] * len(payloads)
        assert sent == (WORLD - 1) * sum(payloads)
        assert full_precision == (WORLD - 1) * 4 * sum(rows)
        assert sent < 0.26 * full_precision
        collectives, largest, owed, loaded = rank_results["ef_save"]
        assert {collective for collective in collectives} == {("all_to_all_single", torch.uint8)}
        assert largest.max() > 0
        for bound, total, back in zip(largest.tolist(), owed, loaded):
            # Each rank's codes within half a code of a block whose largest residual is at most `bound`.
            assert torch.allclose(back[rank], total[rank], atol=WORLD * bound / 254 * (1 + 2 ** -8) + 1e-7)


@pytest.mark.parametrize("method", ["loco", "error_feedback", "qsdp"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_memory_model_counts_what_a_compressed_reduce_scatter_holds(results, method, bits):
    """GRADIENT_COMPRESSION's reduction_bytes_per_value, which the planner adds per value of a module's unsharded
    gradient, is what torch's accounting sees one reduction hold at its peak (2 ranks here), within 5%."""
    measured = results[0]["reduction_bytes_per_value"][method, bits]
    assert GRADIENT_COMPRESSION[method].reduction_bytes_per_value[bits] == pytest.approx(measured, rel=0.05)


RESHARDED = 4


def reshard_worker(rank: int, out_dir: str) -> None:
    """4 ranks load the 2 ranks' error-feedback checkpoint as the trainer does: the verbatim state does not fit this
    layout, so each rank's row of its own shards holds the totals."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store4", RESHARDED), rank=rank,
                            world_size=RESHARDED, timeout=datetime.timedelta(seconds=60))
    try:
        model = tiny_fsdp(init_device_mesh("cpu", (RESHARDED,)), {"gradient_compression": "error_feedback"})
        state = CompressionState([model])
        checkpoint = Path(out_dir) / "error_feedback"
        template = exact_where_it_fits(state.state_dict(), read_metadata(checkpoint).state_dict_metadata,
                                       "optimizer.")
        loaded = {"optimizer": template}
        dcp.load(loaded, checkpoint_id=checkpoint)
        state.load_state_dict(loaded["optimizer"])
        own, others = {}, []
        for comm, group, fqns in state.entries:
            residual = comm.compensation.residual
            others.append(residual[[r for r in range(RESHARDED) if r != rank]].clone())
            for fqn, (fsdp_param, offset, size) in zip(fqns, state._layout(group)):
                own[fqn] = residual[rank, offset:offset + size.numel()].view(size)[:fsdp_param.sharded_size[0]].clone()
        torch.save({"loaded_keys": sorted(template), "own": own, "others": others}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_residuals_reshard_from_two_to_four_ranks_exactly(results, compression_dir):
    """Each of the 4 ranks holds, for its shard of every parameter, exactly the total the 2 ranks saved (fp32: no
    rounding anywhere on the way), and nothing for the other ranks' shards. Dropping the residuals on a reshard
    leaves zeros, which fails here."""
    totals = results[0]["ef_totals"]
    assert sum(bool(total.any()) for total in totals.values()) >= len(totals) - 1  # nearly all gradients non-zero
    resharded = run_ranks(reshard_worker, compression_dir, RESHARDED, 120, "reshard")
    for rank, rank_results in enumerate(resharded):
        assert not any(key.startswith(EXACT) for key in rank_results["loaded_keys"])
        assert set(rank_results["own"]) == set(totals)
        for fqn, own in rank_results["own"].items():
            assert torch.equal(own, totals[fqn].chunk(RESHARDED)[rank]), fqn
        assert not any(other.any() for other in rank_results["others"])


def test_parameter_groups_of_torch_before_2_13():
    """torch 2.13's FSDP state holds a list of parameter groups; earlier torch (the GPU hosts' 2.11) one or None."""
    from types import SimpleNamespace

    from torchtitan.distributed.compression import fsdp_param_groups

    def module(**state):
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    group = object()
    assert fsdp_param_groups(module(_fsdp_param_groups=[group])) == [group]
    assert fsdp_param_groups(module(_fsdp_param_group=group)) == [group]
    assert fsdp_param_groups(module(_fsdp_param_group=None)) == []


def test_a_healing_peer_gets_the_optimizer_state_without_the_compensation_state():
    """torchft's checkpoint server (a thread beside the training loop) serves a replica group's state to a peer that
    heals: the compensation state, whose saving runs collectives of the sending group and which is that group's own
    history, stays out of it, and the healed group starts without compensation."""
    from types import SimpleNamespace

    from torchtitan.components.optimizer import OptimizersContainer

    calls = []
    container = SimpleNamespace(
        _optimizer_state_dict=lambda: {"state.w.exp_avg": 1},
        _load_optimizer_state_dict=lambda state: calls.append(("load", state)),
        compression=SimpleNamespace(state_dict=lambda: calls.append("compression collectives"),
                                    clear=lambda: calls.append("clear")))
    view = OptimizersContainer.replica_group_view(container)
    assert view.state_dict() == {"state.w.exp_avg": 1}
    view.load_state_dict({"state.w.exp_avg": 2})
    assert calls == [("load", {"state.w.exp_avg": 2}), "clear"]
