"""Pipeline stage splitting, placement, the checks of the pipeline options, and building stages and schedules on
a fake process group (no processes)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.config.compatibility import check_composition, setup_of
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import SCHEDULES, pipeline_model, plan_pipeline, stage_ids_for_rank
from torchtitan.errors import UserError
from torchtitan.models import get as model_spec
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.pipeline import build_stage_module, requested_stage_count, split_into_stages

SEQ_LEN = 16
LLAMA3 = model_spec("llama3")


def meta_model(n_layers: int) -> Transformer:
    with torch.device("meta"):
        return Transformer(dataclasses.replace(model_args_for("tiny", SEQ_LEN), n_layers=n_layers))


def blocks_per_stage(stages: list[list[str]]) -> list[int]:
    return [sum(name.startswith("layers.") for name in names) for names in stages]


def config(schedule: str = "1F1B", local_batch_size: int = 4, microbatch_size: int = 1, **parallelism) -> JobConfig:
    job = JobConfig()
    job.training.local_batch_size = local_batch_size
    job.parallelism.pipeline_parallel_schedule = schedule
    job.parallelism.pipeline_parallel_microbatch_size = microbatch_size
    for option, value in parallelism.items():
        setattr(job.parallelism, f"pipeline_parallel_{option}", value)
    return job


# ------------------------------------------------------------------------------------------------------------------
# Splitting


def test_even_split_counts_embedding_and_output_as_one_block_each():
    assert split_into_stages(meta_model(4), 2) == [["tok_embeddings", "layers.0", "layers.1"],
                                                   ["layers.2", "layers.3", "norm", "output"]]
    # 6 blocks + 2 divides by 4: the first and last stages hold one block fewer.
    assert blocks_per_stage(split_into_stages(meta_model(6), 4)) == [1, 2, 2, 1]
    assert blocks_per_stage(split_into_stages(meta_model(6), 2)) == [3, 3]


def test_uneven_split_gives_larger_shares_to_first_and_last_stages_first():
    assert blocks_per_stage(split_into_stages(meta_model(4), 4)) == [1, 1, 1, 1]
    assert blocks_per_stage(split_into_stages(meta_model(32), 8)) == [4] * 8
    # 11 units on 4 stages: shares 3, 3, 2, 3 (first, last, then the second stage get the larger share).
    assert blocks_per_stage(split_into_stages(meta_model(9), 4)) == [2, 3, 2, 2]


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5, 8, 13, 32])
def test_every_split_keeps_each_module_once_in_order(n_layers):
    model = meta_model(n_layers)
    full_order = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    for num_stages in range(1, n_layers + 1):
        stages = split_into_stages(model, num_stages)
        assert len(stages) == num_stages
        assert [name for names in stages for name in names] == full_order
        assert min(blocks_per_stage(stages)) >= 1
        loads = [len(names) - ("norm" in names) for names in stages]
        assert max(loads) - min(loads) <= 1


def test_split_points_start_new_stages():
    model = meta_model(6)
    assert split_into_stages(model, 3, split_points=["layers.2", "layers.4"]) == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3"],
        ["layers.4", "layers.5", "norm", "output"]]
    # layers.0 leaves the embedding alone in the first stage.
    assert split_into_stages(model, 2, split_points=["layers.0"])[0] == ["tok_embeddings"]


def test_layers_per_stage_counts_embedding_and_output_as_blocks():
    model = meta_model(6)
    assert requested_stage_count(6, 2, [], 2) == 4
    assert blocks_per_stage(split_into_stages(model, 4, layers_per_stage=2)) == [1, 2, 2, 1]
    # One unit per stage: the embedding and the head get stages of their own.
    stages = split_into_stages(model, 8, layers_per_stage=1)
    assert stages[0] == ["tok_embeddings"] and stages[-1] == ["norm", "output"]
    # 8 units by 3: the last stage takes the 2 left over.
    assert split_into_stages(model, 3, layers_per_stage=3)[-1] == ["layers.5", "norm", "output"]


def test_stage_module_keeps_only_its_parts_with_global_names():
    model = meta_model(4)
    first, last = (build_stage_module(model, names) for names in split_into_stages(model, 2))
    assert first.norm is None and first.output is None and first.tok_embeddings is not None
    assert last.tok_embeddings is None and list(last.layers) == ["2", "3"]
    full_names = {name for name, _ in model.named_parameters()}
    first_names = {name for name, _ in first.named_parameters()}
    last_names = {name for name, _ in last.named_parameters()}
    assert first_names | last_names == full_names and not first_names & last_names
    assert len(model.layers) == 4, "the original model must be left intact"
    with pytest.raises(ValueError):
        build_stage_module(model, ["layers.9"])


def test_chained_stages_compute_the_whole_model():
    model = Transformer(model_args_for("tiny", SEQ_LEN))
    model.init_weights(seed=0)
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    hidden = tokens
    for names in split_into_stages(model, 3):
        hidden = build_stage_module(model, names)(hidden)
    torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# Placement and plans


def test_looped_placement():
    assert [stage_ids_for_rank(rank, 2, 4, v_shaped=False) for rank in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank(rank, 4, 4, v_shaped=False) for rank in range(4)] == [[0], [1], [2], [3]]
    assert stage_ids_for_rank(1, 2, 6, v_shaped=False) == [1, 3, 5]


def test_v_shaped_placement():
    assert [stage_ids_for_rank(rank, 2, 4, v_shaped=True) for rank in range(2)] == [[0, 3], [1, 2]]
    assert [stage_ids_for_rank(rank, 4, 8, v_shaped=True) for rank in range(4)] == [[0, 7], [1, 6], [2, 5],
                                                                                    [3, 4]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_plan_of_every_schedule(schedule):
    plan = plan_pipeline(LLAMA3, meta_model(4), 2, config(schedule))
    single = schedule in ("GPipe", "1F1B")
    assert plan.num_stages == (2 if single else 4)
    assert plan.v_shaped == (schedule in ("ZBVZeroBubble", "DualPipeV"))
    assert plan.n_microbatches == 4


def test_schedule_names_match_case_insensitively():
    assert plan_pipeline(LLAMA3, meta_model(4), 2, config("interleaved1f1b")).schedule_name == "Interleaved1F1B"


def test_microbatches_and_explicit_stages():
    plan = plan_pipeline(LLAMA3, meta_model(6), 2, config("LoopedBFS", local_batch_size=8, microbatch_size=2,
                                                  split_points=["layers.1", "layers.3", "layers.4"]))
    assert plan.n_microbatches == 4 and blocks_per_stage(plan.stage_names) == [1, 2, 1, 2]
    plan = plan_pipeline(LLAMA3, meta_model(6), 4, config("Interleaved1F1B", layers_per_stage=1))
    assert plan.num_stages == 8


# ------------------------------------------------------------------------------------------------------------------
# Errors: each names the option, the bad value and what would be valid


def raises(match: str):
    return pytest.raises(UserError, match=match)


def test_fewer_blocks_than_stages():
    with raises(r"pipeline_parallel_degree: 4 pipeline stages .* need at least 4 .* has 3"):
        split_into_stages(meta_model(3), 4)
    with raises(r"pipeline_parallel_degree: 4 pipeline stages"):
        plan_pipeline(LLAMA3, meta_model(3), 2, config("Interleaved1F1B"))


@pytest.mark.parametrize("points, problem", [
    (["layers.4"], r"'layers.4' names no transformer block .* valid: layers.0 ... layers.3"),
    (["norm"], r"'norm' names no transformer block"),
    (["layers.x"], r"'layers.x' names no transformer block"),
    (["layers.3", "layers.1", "layers.2"], r"layers.3,layers.1,layers.2 is not in increasing order"),
    (["layers.2", "layers.2", "layers.3"], r"layers.2,layers.2,layers.3 is not in increasing order \(or repeats"),
])
def test_bad_split_points(points, problem):
    with raises("pipeline_parallel_split_points: " + problem):
        split_into_stages(meta_model(4), len(points) + 1, split_points=points)


def test_split_points_and_layers_per_stage_together():
    with raises(r"pipeline_parallel_split_points \(layers.2\) and .*layers_per_stage \(2\) both define"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config(split_points=["layers.2"], layers_per_stage=2))


def test_layers_per_stage_below_one():
    with raises(r"pipeline_parallel_layers_per_stage: 0 must be at least 1"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config(layers_per_stage=0))


def test_split_options_disagreeing_with_the_stage_count():
    with raises(r"pipeline_parallel_split_points: layers.2 makes 2 stages, but the pipeline has 3"):
        split_into_stages(meta_model(4), 3, split_points=["layers.2"])


def test_single_stage_schedule_given_several_stages_per_rank():
    with raises(r"split_points: layers.1,layers.2,layers.3 makes 4 stages, but schedule 1F1B on "
                r"pipeline_parallel_degree 2 needs exactly 2 stages \(one per rank\)"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("1F1B", split_points=["layers.1", "layers.2", "layers.3"]))
    with raises(r"layers_per_stage: 1 units per stage make 6 stages .* GPipe .* needs exactly 2 stages .*"
                r"valid: 3, 4, 5"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("GPipe", layers_per_stage=1))


def test_multi_stage_schedule_given_one_stage_per_rank():
    with raises(r"split_points: layers.2 makes 2 stages, but schedule Interleaved1F1B on pipeline_parallel_degree 2 "
                r"needs a multiple of 2 stages, at least 4"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("Interleaved1F1B", split_points=["layers.2"]))
    with raises(r"layers_per_stage: 2 units per stage make 3 stages .* ZBVZeroBubble .* needs exactly 4 stages "
                r"\(two per rank\).* valid: none"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("ZBVZeroBubble", layers_per_stage=2))


def test_unknown_schedule_lists_the_valid_ones():
    with raises(r"pipeline_parallel_schedule: unknown schedule 'Zigzag'; valid: GPipe, 1F1B, Interleaved1F1B, "
                r"LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("Zigzag"))


@pytest.mark.parametrize("local_batch_size, microbatch_size, valid", [(6, 4, "1, 2, 3, 6"), (4, 0, "1, 2, 4")])
def test_microbatch_size_must_divide_the_local_batch(local_batch_size, microbatch_size, valid):
    with raises(rf"pipeline_parallel_microbatch_size: {microbatch_size} does not divide "
                rf"training.local_batch_size \({local_batch_size}\) .* valid: {valid}"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("GPipe", local_batch_size, microbatch_size))


def test_too_few_microbatches():
    with raises(r"schedule 1F1B needs at least as many micro-batches as stages \(4\), but .* gives 2"):
        plan_pipeline(LLAMA3, meta_model(4), 4, config("1F1B", local_batch_size=2))
    with raises(r"schedule DualPipeV needs at least as many micro-batches as stages \(4\), but .* gives 3"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("DualPipeV", local_batch_size=3))
    plan_pipeline(LLAMA3, meta_model(4), 4, config("GPipe", local_batch_size=1))
    plan_pipeline(LLAMA3, meta_model(4), 2, config("ZBVZeroBubble", local_batch_size=1))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_microbatches_must_fill_whole_rounds(schedule):
    with raises(rf"schedule {schedule} runs the micro-batches in 2 rounds .* gives 5; valid counts nearby: 3, 4, 6"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config(schedule, local_batch_size=5))
    plan_pipeline(LLAMA3, meta_model(4), 2, config(schedule, local_batch_size=3))


def test_validation_batch_must_split_into_the_microbatches():
    job = config("GPipe")
    job.validation.enable, job.validation.local_batch_size = True, 6
    with raises(r"validation.local_batch_size: .* 6 must be a multiple of 4"):
        plan_pipeline(LLAMA3, meta_model(4), 2, job)


def test_schedule_csv_needs_a_multi_stage_schedule_and_an_existing_file(tmp_path):
    csv = tmp_path / "schedule.csv"
    csv.write_text("0F0\n1F0\n")
    with raises(r"pipeline_parallel_schedule_csv: .*pipeline_parallel_schedule = 1F1B is a single-stage schedule; "
                r"name the multi-stage schedule .*: Interleaved1F1B, LoopedBFS"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("1F1B", schedule_csv=str(csv)))
    with raises(r"pipeline_parallel_schedule_csv: '.*missing.csv' is not a file"):
        plan_pipeline(LLAMA3, meta_model(4), 2, config("Interleaved1F1B", schedule_csv=str(tmp_path / "missing.csv")))


# ------------------------------------------------------------------------------------------------------------------
# Building stages and schedules on a fake process group (one process plays one pipeline rank)


@pytest.fixture
def fake_pipeline_rank():
    """Returns a function that joins a fake 2-rank world as the given rank and gives (mesh, parallel dims)."""

    def join(rank: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, world_size=2)
        return dims.build_mesh("cpu"), dims

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def build_pipeline(mesh, dims, job: JobConfig):
    job.parallelism.pipeline_parallel_degree = 2
    job.activation_checkpoint.mode = "none"
    return pipeline_model(LLAMA3, meta_model(4), mesh, dims, job, torch.device("cpu"),
                          lambda logits, labels: logits.sum())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_model_builds_this_ranks_stages(fake_pipeline_rank, schedule):
    v_shaped = schedule in ("ZBVZeroBubble", "DualPipeV")
    if schedule in ("GPipe", "1F1B"):
        expected_layers = [[["0", "1"]], [["2", "3"]]]
    elif v_shaped:
        expected_layers = [[["0"], ["3"]], [["1"], ["2"]]]
    else:
        expected_layers = [[["0"], ["2"]], [["1"], ["3"]]]
    for rank in range(2):
        built, parts, has_first, has_last = build_pipeline(*fake_pipeline_rank(rank), config(schedule))
        assert [list(part.layers) for part in parts] == expected_layers[rank]
        assert has_first == (rank == 0) and has_last == (rank == (0 if v_shaped else 1))
        assert built.scale_grads is False, "the loss is already normalised: gradients must not be divided again"


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
def test_multi_stage_eval_runs_forwards_only(fake_pipeline_rank, schedule):
    built, *_ = build_pipeline(*fake_pipeline_rank(0), config(schedule))
    order = built._forward_only_order()
    kinds = {action.computation_type.value for actions in order.values() for action in actions}
    assert kinds <= {"F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD"}
    for rank, actions in order.items():
        forwards = sorted((a.stage_index, a.microbatch_index) for a in actions if a.computation_type.value == "F")
        stages = stage_ids_for_rank(rank, 2, 4, v_shaped=schedule in ("ZBVZeroBubble", "DualPipeV"))
        assert forwards == [(stage, mb) for stage in stages for mb in range(4)]


def looped_csv(stage_of_rank: dict[int, list[int]], n_microbatches: int = 4) -> str:
    rows = []
    for rank in sorted(stage_of_rank):
        forwards = [f"{stage}F{mb}" for stage in stage_of_rank[rank] for mb in range(n_microbatches)]
        backwards = [f"{stage}B{mb}" for stage in reversed(stage_of_rank[rank]) for mb in range(n_microbatches)]
        rows.append(",".join(forwards + backwards))
    return "\n".join(rows) + "\n"


def test_schedule_csv_is_loaded(fake_pipeline_rank, tmp_path):
    csv = tmp_path / "schedule.csv"
    csv.write_text(looped_csv({0: [0, 2], 1: [1, 3]}))
    built, *_ = build_pipeline(*fake_pipeline_rank(1), config("Interleaved1F1B", schedule_csv=str(csv)))
    assert [str(action) for action in built.pipeline_order[1][:5]] == ["1F0", "1F1", "1F2", "1F3", "3F0"]
    assert built.scale_grads is False


def test_schedule_csv_with_another_placement(fake_pipeline_rank, tmp_path):
    csv = tmp_path / "schedule.csv"
    csv.write_text(looped_csv({0: [0, 3], 1: [1, 2]}))
    with raises(r"pipeline_parallel_schedule_csv: .* runs stage 2 on rank 1, but schedule Interleaved1F1B places "
                r"it on rank 0"):
        build_pipeline(*fake_pipeline_rank(0), config("Interleaved1F1B", schedule_csv=str(csv)))


def test_invalid_schedule_csv(fake_pipeline_rank, tmp_path):
    csv = tmp_path / "schedule.csv"
    csv.write_text("0F0,2F0\n1F0,3F0\n")
    with raises(r"pipeline_parallel_schedule_csv: .* is not a valid schedule for 4 stages on 2 ranks and 4 "
                r"micro-batches: .*expected 4"):
        build_pipeline(*fake_pipeline_rank(0), config("Interleaved1F1B", schedule_csv=str(csv)))


def start_up(job: JobConfig) -> None:
    """The trainer's start-up checks of a 2-stage pipeline on the CPU: the pairs of features, then the plan."""
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, world_size=2)
    check_composition(setup_of(job, dims, "cpu"))
    plan_pipeline(LLAMA3, meta_model(4), 2, job)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_refuse_compiled_blocks(schedule):
    job = config(schedule)
    job.compile.enable = True
    with raises(r"compile.enable with 'model' in compile.components: does not compose with a split-backward pipeline "
                r"schedule .* cannot run its input and weight gradients apart\); use a whole-backward schedule "
                r"\(GPipe, 1F1B, Interleaved1F1B, LoopedBFS\), or leave 'model' out of compile.components"):
        start_up(job)
    job.compile.components = ["loss"]
    start_up(job)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_refuse_per_op_checkpointing(schedule):
    """torch's selective checkpoint lets a region run backward once; the weight pass would be a second (the run
    failed at its first weight pass). Whole-block checkpointing, every block or every N-th, recomputes instead."""
    job = config(schedule)
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = "selective", "op"
    with raises(r"activation_checkpoint.selective_ac_option = 'op': does not compose with a split-backward pipeline "
                r"schedule .* \(per-op checkpointing lets a block run backward once, and the schedule runs it "
                r"twice .*\); .* a whole-backward schedule"):
        start_up(job)
    job.activation_checkpoint.selective_ac_option = "2"
    start_up(job)
    whole = config("Interleaved1F1B")
    whole.activation_checkpoint.mode, whole.activation_checkpoint.selective_ac_option = "selective", "op"
    start_up(whole)


@pytest.fixture
def one_rank_pipeline(tmp_path):
    """A one-process gloo world whose one pipeline rank holds every stage (torch hands the activations between stages
    of one rank over locally): the schedules run for real."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    yield dims.build_mesh("cpu"), dims
    dist.destroy_process_group()


def test_stages_of_one_rank_build_each_microbatch_mask_once(one_rank_pipeline, monkeypatch):
    """block_causal, two stages on the rank, 4 micro-batches: a step builds 4 masks (one per micro-batch, shared by
    both stages), not 8, and its losses are those of stages that each build their own."""
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.models.llama3 import model as llama_model
    from torchtitan.nn import attention
    from torchtitan.nn.attention import document_ids

    job = config("Interleaved1F1B")
    job.parallelism.pipeline_parallel_degree = 1
    job.activation_checkpoint.mode = "none"
    job.model.attention_mask = "block_causal"
    built, parts, *_ = pipeline_model(LLAMA3, meta_model(4), *one_rank_pipeline, job, torch.device("cpu"),
                                      lambda logits, labels: torch.nn.functional.cross_entropy(
                                          logits.flatten(0, 1), labels.flatten(0, 1)))
    assert len(parts) == 2
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(seed=0)
    built_masks, build = [], attention.document_mask

    def counted(ids, flex=None):
        built_masks.append(ids)
        return build(ids, flex)

    monkeypatch.setattr(pipeline_parallel, "document_mask", counted)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 100, (4, SEQ_LEN), generator=generator)
    tokens[:, [0, 5, 6, 11]] = 1
    labels = torch.randint(0, 100, (4, SEQ_LEN), generator=generator)
    ids = document_ids(tokens, 1)

    def step() -> list[torch.Tensor]:
        losses = []
        built.step(tokens, target=labels, losses=losses, document_ids=ids)
        return losses

    step()  # the first step also runs a micro-batch through each stage to learn the stages' shapes
    built_masks.clear()
    shared = step()
    assert len(built_masks) == 4
    assert all(mask.shape == (1, SEQ_LEN) for mask in built_masks)
    monkeypatch.setattr(llama_model, "document_mask", counted)
    for part in parts:
        part.build_document_mask = None
    built_masks.clear()
    assert torch.equal(torch.stack(step()), torch.stack(shared))
    assert len(built_masks) == 8
