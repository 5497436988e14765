"""Context parallel on CPU (gloo) against a single-process reference, with real processes: causal attention by torch's
ring (both rotate methods) and over grouped keys and values all-gathered (context_parallel_method = allgather_kv)."""

import datetime
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.unit.forked_ranks import join_forked
from torchtitan.distributed import context_parallel as cp
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer

pytestmark = pytest.mark.smoke

BATCH, SEQ_LEN = 2, 64
ROTATE_METHODS = ("allgather", "alltoall")
# The ring's two rotate methods, then the keys and values gathered.
METHODS = (*ROTATE_METHODS, "allgather_kv")


def build_model() -> Transformer:
    model = Transformer(model_args_for("tiny", SEQ_LEN))
    model.init_weights(seed=0)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, model_args_for("tiny", SEQ_LEN).vocab_size, (BATCH, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_and_grads(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor, **model_inputs) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    logits = model(inputs, **model_inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    loss.backward()
    return loss.detach()


def cp_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    # A collective that never completes fails the test instead of hanging it.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = dist.device_mesh.DeviceMesh("cpu", list(range(world_size)), mesh_dim_names=("cp",))
        model = build_model()
        full_rope = model.rope.clone()
        for method in ROTATE_METHODS:
            inputs, labels = batch()
            # Head-tail load balancing: rank r holds chunks r and 2n-1-r of the sequence cut in 2n.
            chunks = inputs.chunk(2 * world_size, dim=1)
            head_tail = torch.cat([chunks[rank], chunks[-1 - rank]], dim=1)
            with cp.context_parallel_context(mesh["cp"], [inputs, labels, model.rope], [1, 1, 0],
                                             {inputs, labels}, method):
                assert torch.equal(inputs, head_tail), "the sequence is not sharded head-tail"
                loss = loss_and_grads(model, inputs, labels)
            assert inputs.shape == (BATCH, SEQ_LEN // world_size), inputs.shape
            assert torch.equal(model.rope, full_rope), "the rope buffer was not restored after the CP context"
            dist.all_reduce(loss)
            grads = {name: p.grad for name, p in model.named_parameters()}
            for grad in grads.values():
                dist.all_reduce(grad)
            if rank == 0:
                torch.save({"loss": loss, "grads": grads}, Path(out_dir) / f"{method}.pt")
        # The same causal sequence, each rank's head-tail chunks attending to the keys and values of all, gathered
        # with their heads grouped (the spy records the heads of each gathered buffer: keys and values together).
        gathered_heads = []
        gather = torch_compat.all_gather_autograd_function()

        def spy(tensor, dim, group):
            gathered_heads.append(tensor.shape[1])
            return gather(tensor, dim, group)
        torch_compat.all_gather_autograd_function = lambda: spy
        cp.apply_document_cp(model, mesh["cp"])
        inputs, labels = batch()
        positions = torch.arange(SEQ_LEN).expand_as(inputs)
        inputs, labels, positions = cp.shard_documents(mesh["cp"], None, [inputs, labels, positions])
        chunks = batch()[0].chunk(2 * world_size, dim=1)
        assert torch.equal(inputs, torch.cat([chunks[rank], chunks[-1 - rank]], dim=1)), "not sharded head-tail"
        loss = loss_and_grads(model, inputs, labels, positions=positions)
        dist.all_reduce(loss)
        grads = {name: p.grad for name, p in model.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad)
        if rank == 0:
            torch.save({"loss": loss, "grads": grads, "gathered_heads": gathered_heads},
                       Path(out_dir) / "allgather_kv.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model()
    loss = loss_and_grads(model, *batch())
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def cp_results(request, tmp_path_factory) -> dict[str, dict]:
    """Both rotate methods, run by the same processes: starting them is most of the cost, so they are forked
    (spawned ones would import torch again, seconds each on two cores)."""
    world_size = request.param
    tmp = tmp_path_factory.mktemp(f"cp{world_size}")
    join_forked(cp_worker, (world_size, str(tmp / "store"), str(tmp)), world_size, 120,
                f"{world_size} context-parallel workers")
    return {method: torch.load(tmp / f"{method}.pt") for method in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_context_parallel_matches_single_process(cp_results, reference, method):
    ref_loss, ref_grads = reference
    result = cp_results[method]
    assert torch.allclose(result["loss"], ref_loss, rtol=1e-5, atol=0), (result["loss"], ref_loss)
    assert result["grads"].keys() == ref_grads.keys()
    for name, grad in result["grads"].items():
        diff = (grad - ref_grads[name]).abs().max().item()
        assert diff <= 1e-5, f"{name}: gradient differs by {diff:.3g}"


def test_gathered_keys_and_values_keep_their_heads_grouped(cp_results):
    """One all-gather per layer of the keys and values together, over the model's KV heads (4 of the 8 query heads
    of the tiny flavor): nothing expanded them to the query heads before the exchange."""
    args = model_args_for("tiny", SEQ_LEN)
    assert args.kv_heads < args.n_heads
    assert cp_results["allgather_kv"]["gathered_heads"] == [2 * args.kv_heads] * args.n_layers


def test_context_parallel_method_options():
    """The gathered keys and values by default; the ring's rotate method only with the ring; block-causal attention
    only over gathered keys (the ring is causal only)."""
    from torchtitan.config import parse_args

    cp2 = ["--parallelism.context_parallel_degree", "2"]
    assert parse_args(cp2).parallelism.context_parallel_method == "allgather_kv"
    alltoall = ["--parallelism.context_parallel_rotate_method", "alltoall"]
    assert parse_args([*cp2, "--parallelism.context_parallel_method", "ring", *alltoall]).parallelism.\
        context_parallel_rotate_method == "alltoall"
    with pytest.raises(UserError, match=r"^option parallelism.context_parallel_rotate_method = 'alltoall': does not "
                                        r"compose with context parallelism over gathered keys and values "
                                        r"\(parallelism.context_parallel_method = 'allgather_kv', the default.*; leave "
                                        r"parallelism.context_parallel_rotate_method at 'allgather'"):
        parse_args([*cp2, *alltoall])
    with pytest.raises(UserError, match=r"^option context_parallel_degree > 1 with model.attention_mask = "
                                        r"'block_causal': does not compose with parallelism.context_parallel_method = "
                                        r"'ring' .*; use parallelism.context_parallel_method = 'allgather_kv'$"):
        parse_args([*cp2, "--parallelism.context_parallel_method", "ring", "--model.attention_mask", "block_causal"])
    # Without context parallelism neither option does anything: nothing to refuse.
    parse_args(alltoall)


def test_unknown_rotate_method():
    with pytest.raises(UserError, match=r"context_parallel_rotate_method: 'ring' .* allgather, alltoall"):
        with cp.context_parallel_context(None, [], [], set(), "ring"):
            pass


def test_private_torch_api_still_there():
    """The CPU registration rests on these private torch symbols (torch_compat): a rename must fail here, not in a
    training run."""
    from torchtitan.distributed import torch_compat

    def names(fn):
        return list(inspect.signature(fn).parameters)

    where = "torch.distributed.tensor.experimental._context_parallel"
    assert torch_compat.missing_names("cpu_ring_attention") == []
    custom_ops = torch_compat.get("cp_custom_ops")
    assert isinstance(custom_ops, dict), f"{where}._attention.custom_ops (the table CP dispatches SDPA ops through)"
    enable = inspect.getmodule(torch_compat.get("ring_attention"))._enable_cp_dtensor_dispatcher
    assert "custom_ops" in inspect.getsource(enable), \
        f"{where}._attention._enable_cp_dtensor_dispatcher no longer installs custom_ops"
    assert names(torch_compat.get("ring_attention"))[:6] == ["group", "seq_dim", "op", "query", "key", "value"], \
        f"{where}._attention._templated_ring_attention changed its signature"
    assert names(torch_compat.get("ring_attention_backward"))[:11] == [
        "group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key", "value", "out", "logsumexp",
        "is_causal"], f"{where}._attention._templated_ring_attention_backward changed its signature"
    assert names(torch_compat.get("set_rotate_method")) == ["rotate_method"], f"{where}: set_rotate_method changed"
    assert names(torch_compat.get("cp_strategy_context"))[:3] == ["op_overload", "strategy_func", "schema_info"], \
        f"{torch_compat.found_path('cp_strategy_context')} changed"
    dispatcher = torch_compat.get("dtensor_dispatcher")
    for attribute in ("unwrap_to_op_info", "wrap", "sharding_propagator"):
        assert hasattr(dispatcher, attribute), f"DTensor._op_dispatcher.{attribute} is gone"

    sdpa, sdpa_backward = cp._cpu_sdpa_ops()
    forward, backward = sdpa._schema, sdpa_backward._schema
    assert [r.name for r in forward.returns] == ["output", "logsumexp"], forward
    assert [a.name for a in backward.arguments] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"], \
        backward
    assert names(cp._ring_sdpa)[1:] == [a.name for a in forward.arguments], forward
    assert names(cp._ring_sdpa_backward)[1:] == [a.name for a in backward.arguments], backward

    cp.register_cpu_ring_attention()
    cp.register_cpu_ring_attention()
    assert custom_ops[sdpa] is cp._cpu_sdpa_handler
    assert custom_ops[sdpa_backward] is cp._cpu_sdpa_handler
