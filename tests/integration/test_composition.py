"""Features compose or refuse: the pairwise covering array of benchmarks/composition_matrix.py, cell by cell.

Each cell trains with finite losses (and the one-process losses where it is exact by construction), or stops at
start-up with the compatibility table's one line; a hang or any other exit fails it. The whole array is slow
(about 150 cells); a fixed sample runs in the default suite.
"""

import itertools
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import composition_matrix as matrix  # noqa: E402

from torchtitan.config import compatibility  # noqa: E402

pytestmark = pytest.mark.integration

CELLS = [matrix.Cell(index, levels) for index, levels in enumerate(matrix.cells())]


def _sample() -> list[int]:
    """A fixed sample that trains several features at once, refuses one pair at start-up, and dry-runs one cell."""
    def first(condition) -> int:
        return next(cell.index for cell in CELLS if condition(cell))

    sample = [
        first(lambda c: c.levels["layout"] == "fsdp2" and c.levels["compression"] != "none"
              and c.levels["health"] != "none" and matrix.predicted_refusal(c) is None),
        first(lambda c: matrix.predicted_refusal(c) is not None),
        first(lambda c: c.dry_run and c.levels["layout"] != "one" and matrix.predicted_refusal(c) is None),
    ]
    return sorted(set(sample))  # one cell may be several of these


SAMPLE = _sample()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process runs of the cells' other options, made on first use."""
    made: dict[str, matrix.Outcome] = {}

    def reference_of(cell: matrix.Cell) -> matrix.Outcome:
        key = json.dumps(cell.reference_levels(), sort_keys=True)
        if key not in made:
            made[key] = matrix.run_cell(matrix.Cell(-1, cell.reference_levels()),
                                        tmp_path_factory.mktemp("reference"))
        return made[key]
    return reference_of


def check_cell(cell: matrix.Cell, folder: Path, references) -> None:
    outcome = matrix.run_cell(cell, folder)
    assert outcome.status != "failed", f"cell {cell.index} ({cell.describe()}): {outcome.detail}"
    if outcome.status == "trained" and cell.exact and cell.levels["layout"] != "one":
        reference = references(cell)
        assert reference.status == "trained", reference.detail
        mismatch = matrix.compare_with_reference(outcome, reference)
        assert mismatch is None, f"cell {cell.index} ({cell.describe()}): {mismatch}"


@pytest.mark.parametrize("index", SAMPLE)
def test_sampled_cell_trains_or_is_refused_by_the_table(tmp_path, references, index):
    check_cell(CELLS[index], tmp_path, references)


@pytest.mark.slow
@pytest.mark.parametrize("index", [cell.index for cell in CELLS])
def test_every_cell_trains_or_is_refused_by_the_table(tmp_path, references, index):
    check_cell(CELLS[index], tmp_path, references)


def test_the_array_holds_every_pair_in_a_cell_that_trains_unless_the_table_refuses_the_pair():
    refused = {cell.index for cell in CELLS if matrix.predicted_refusal(cell)}
    for (a, levels_a), (b, levels_b) in itertools.combinations(matrix.FACTORS.items(), 2):
        for x, y in itertools.product(levels_a, levels_b):
            holders = [cell for cell in CELLS if cell.levels[a] == x and cell.levels[b] == y]
            assert holders, f"no cell holds {a}={x}, {b}={y}"
            if all(cell.index in refused for cell in holders):
                # A refused pair: its witness changes nothing else, and the refusal is the table's.
                witness = holders[0]
                others = {name: level for name, level in witness.levels.items() if name not in (a, b)}
                assert others == {name: next(iter(levels)) for name, levels in matrix.FACTORS.items()
                                  if name not in (a, b)}
                assert "does not compose with" in matrix.predicted_refusal(witness)


def test_every_refusal_of_the_table_is_reached_by_a_cell_or_named_as_out_of_its_reach():
    """The array reaches the table's refusals that its factors can express; the others are checked by their own
    tests (test_parallelize.py, test_compression.py, test_dry_run.py, test_fault_tolerance.py): a device, a layout
    or an option the array does not vary, or a pair whose cells another refusal of the table reports first (the
    array's qsdp level quantizes gradients and weights together; HSDP with compression trains under FlexDeMo, and is
    refused otherwise by the first refusal that applies)."""
    reached = {matrix.predicted_refusal(cell) for cell in CELLS} - {None}
    messages = {compatibility.refusal_message(refusal) for refusal in compatibility.refusals()}
    unreached = {message.split(":")[0] + ": " + message.split("does not compose with ")[1].split(" (")[0]
                 for message in messages - reached}
    assert unreached == OUT_OF_REACH, (sorted(unreached - OUT_OF_REACH), sorted(OUT_OF_REACH - unreached))


OUT_OF_REACH = {
    "option training.enable_cpu_offload: a run on the CPU",
    "option training.enable_cpu_offload: data_parallel_shard_degree x context_parallel_degree = 1",
    "option training.enable_cpu_offload: quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "option parallelism.enable_async_tensor_parallel: a run on the CPU",
    "option parallelism.enable_async_tensor_parallel: compile.enable = false",
    "option comm.weight_quantization = 'qsdp': quantize.linear.float8.enable_fsdp_float8_all_gather",
    "option context_parallel_degree > 1 with model.attention_mask = 'block_causal': "
    "parallelism.context_parallel_method = 'ring'",
    "option parallelism.context_parallel_rotate_method = 'alltoall': "
    "context parallelism over gathered keys and values",
    "option comm.gradient_compression (loco, error_feedback, qsdp): data_parallel_replicate_degree > 1",
    "option comm.weight_quantization = 'qsdp': data_parallel_shard_degree x context_parallel_degree = 1",
    "option comm.weight_quantization = 'qsdp': data_parallel_replicate_degree > 1",
    # The array's one rotated layout is RTP 2 alone (tests/unit/test_parallelize.py refuses the others), and its qsdp
    # level compresses gradients too, which is refused first.
    "option parallelism.data_parallel_shard_method = 'rotated': comm.weight_quantization = 'qsdp'",
    "option parallelism.data_parallel_shard_method = 'rotated': tensor_parallel_degree > 1",
    "option parallelism.data_parallel_shard_method = 'rotated': parallelism.fsdp_reshard_after_forward = 'always' or "
    "'never'",
    "option parallelism.data_parallel_shard_method = 'rotated': data_parallel_replicate_degree > 1",
    "option parallelism.data_parallel_shard_method = 'rotated': data_parallel_shard_degree x context_parallel_degree "
    "= 1",
    "option parallelism.data_parallel_shard_method = 'rotated': training.enable_cpu_offload",
}


def test_docs_list_the_table():
    text = (REPO / "docs" / "compatibility.md").read_text()
    assert compatibility.matrix_markdown() in text, "docs/compatibility.md: regenerate the table " \
        "(python benchmarks/composition_matrix.py --table)"
