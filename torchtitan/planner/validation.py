"""The performance model against TorchTitan's published H100 figures (data/torchtitan_llama3_h100.csv and
data/torchtitan_llama3_h100_async_tp.csv, sources in their headers) and other published runs (data/*.csv): the rows
read as layouts, the constants fitted on them, and the envelope they make (what they cover, and how far the model is
off on them), from which the search gives each layout its range (search.py). prediction_tables.py sets the
planner's whole predictions beside the same rows.

FIT_ROWS name the rows the three constants of the performance model are fitted on; every other row is a
prediction. The hardware of the table is the H100 96 GB of TorchTitan's hosts (`h100_96gb`), and the rows' layouts
carry TorchTitan's row-split embedding (`Layout.row_split_embedding`), its eager loss (`Layout.compiled_loss`) and
its pipeline's kept outputs (`Layout.kept_pipeline_outputs`),
the code that measured them.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

from torchtitan.models.llama3.args import TransformerModelArgs, model_args_for
from torchtitan.planner.cost import (MODEL_CONSTANTS, Layout, StepTime, attention_step, block_linear_params,
                                     step_time, tokens_per_second_per_gpu)
from torchtitan.planner.hardware import GPU as GPUSpec, GPUS
from torchtitan.planner.pipeline_schedule import split_backward

PUBLISHED = Path(__file__).resolve().parent / "data" / "torchtitan_llama3_h100.csv"
# TorchTitan's async TP runs of June 2025 on the same hosts (8B on FSDP 8 x TP 8, 70B on FSDP 32 x TP 8, vanilla and
# async TP, bf16 and Float8): held out, and with PUBLISHED's rows they make the envelope.
ASYNC_TP = PUBLISHED.with_name("torchtitan_llama3_h100_async_tp.csv")
H100_ROWS = (PUBLISHED, ASYNC_TP)
# The float8 rowwise rows ASYNC_TP leaves out, against tensorwise's (8B and 70B, vanilla and async TP): 3708.5 / 5078.1,
# 3914.9 / 5570.1, 599.6 / 809.8, 624.8 / 942.4.
ROWWISE_OVER_TENSORWISE = (624.8 / 942.4, 599.6 / 809.8)
# TorchTitan's long-context rows (8B and 405B with CP at 32k-256k): held out, and outside the envelope, which the
# rows of H100_ROWS alone make: the model misses them (docs/scaling.md), so they bound nothing.
LONG_CONTEXT = PUBLISHED.with_name("torchtitan_llama3_h100_long_context.csv")
# Published runs of other sources (TorchTitan on H200, Megatron-Bridge on H100): held out, each row with its source,
# GPU, software and method; outside the envelope, which the rows of PUBLISHED alone make.
OTHER = PUBLISHED.with_name("other_llama3_runs.csv")
GPU = GPUS["h100_96gb"]
# The 8B rows on one host: eager, compiled, compiled + float8.
FIT_ROWS = (0, 1, 2)


@dataclass(frozen=True)
class Row:
    index: int
    flavor: str
    gpus: int
    seq_len: int
    layout: Layout
    tps_per_gpu: float
    peak_memory_gib: float
    fitted: bool = False
    """One of FIT_ROWS of PUBLISHED: the constants were fitted on it."""
    gpu: GPUSpec = GPU
    source: str = ""
    """Where the row was published, the software that ran it and how it was read (OTHER's rows)."""
    model: str = ""
    """The model's name where it is not the flavor's (OTHER's Llama 2 rows)."""
    shape: tuple[tuple[str, float], ...] = ()
    """Shape options on top of the flavor ([model], docs/recipes.md), as (option, value)."""
    date: str = ""
    """When the run was published, where its file has more than one date's runs of one layout (ASYNC_TP's)."""

    @property
    def args(self) -> TransformerModelArgs:
        return model_args_for(self.flavor, self.seq_len, overrides=dict(self.shape))

    @property
    def name(self) -> str:
        l = self.layout
        parts = [f"{self.model or self.flavor} on {self.gpus}", f"FSDP {l.dp_shard}"]
        parts += [f"TP {l.tp}"] if l.tp > 1 else []
        parts += [f"PP {l.pp} {l.schedule}" + (f" VP {l.stages_per_rank}" if l.stages_per_rank > 2 else "")] \
            if l.pp > 1 else []
        parts += [f"CP {l.cp}"] if l.cp > 1 else []
        parts += [f"seq {self.seq_len:,}"] if self.seq_len != 8192 else []
        parts += ["compile"] if l.compile else []
        parts += ["float8"] if l.float8 else []
        parts += ["async TP"] if l.async_tp else []
        if self.source:  # OTHER's sources vary the activation checkpointing of one layout
            parts.append(l.ac_label)
        return ", ".join(parts) + (f" ({self.date})" if self.date else "")


def published_rows(*paths: Path) -> list[Row]:
    """The rows of `paths` (by default H100_ROWS, whose rows make the envelope), numbered on from file to file; peak
    memory 0 where the source publishes none."""
    rows: list[Row] = []
    for path in paths or H100_ROWS:
        lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
        rows += _rows_of(csv.DictReader(lines), first_index=len(rows), fitted=path == PUBLISHED)
    return rows


def _published_cp_method(record: dict) -> str:
    """The published runs with CP ran ring attention (torch's, or Transformer Engine's p2p ring); without CP the
    planner's default, so that layouts compare equal."""
    return "ring" if int(record["cp"]) > 1 else Layout.cp_method


def _rows_of(records, first_index: int, fitted: bool) -> list[Row]:
    rows = []
    for index, record in enumerate(records, start=first_index):
        pp = int(record["pp"])
        schedule = record["pp_schedule"] or None
        layout = Layout(dp_replicate=1, dp_shard=int(record["dp_shard"]), tp=int(record["tp"]), pp=pp,
                        cp=int(record["cp"]), schedule=schedule,
                        stages_per_rank=2 if schedule == "Interleaved1F1B" else 1,
                        # TorchTitan's default of that version: as many micro-batches as pipeline ranks.
                        local_batch=int(record["local_batch"]), microbatch=int(record["local_batch"]) // pp,
                        ac={"selective": "op", "full": "full", "none": "none"}[record["ac"]],
                        float8=record["float8"] == "true", float8_all_gather=record["float8_all_gather"] == "true",
                        compile=record["compile"] == "true", async_tp=record["async_tp"] == "true",
                        row_split_embedding=True,
                        compiled_loss=False, kept_pipeline_outputs=True, cp_method=_published_cp_method(record))
        rows.append(Row(index=index, flavor=record["flavor"], gpus=int(record["gpus"]), seq_len=int(record["seq_len"]),
                        layout=layout, tps_per_gpu=float(record["tps_per_gpu"]),
                        peak_memory_gib=float(record["peak_mem_gib"] or 0),
                        fitted=fitted and index in FIT_ROWS, date=record.get("date", "")))
    return rows


def other_rows(path: Path = OTHER) -> list[Row]:
    """OTHER's rows: their own GPU, micro-batch and virtual stages, model shape, activation checkpointing (ac:
    none, op, full or layer/N) and CP rotation; peak memory 0 where the source gives none; tokens/s per GPU from
    the published model TFLOP/s in NeMo's count where the source gives no tokens/s."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    rows = []
    for index, record in enumerate(csv.DictReader(lines)):
        schedule = record["pp_schedule"] or None
        ac, _, every = record["ac"].partition("/")
        shape = tuple((name, float(value) if "." in value else int(value))
                      for name, value in (item.split("=") for item in record["shape"].split()))
        layout = Layout(dp_replicate=1, dp_shard=int(record["dp_shard"]), tp=int(record["tp"]), pp=int(record["pp"]),
                        cp=int(record["cp"]), schedule=schedule, stages_per_rank=int(record["vp"]),
                        local_batch=int(record["local_batch"]), microbatch=int(record["mbs"]), ac=ac,
                        ac_every=int(every or 2),
                        float8=record["float8"] == "true", compile=record["compile"] == "true",
                        async_tp=record["async_tp"] == "true", cp_method=_published_cp_method(record),
                        cp_rotate=record["cp_rotate"] or "allgather")
        row = Row(index=index, flavor=record["flavor"], gpus=int(record["gpus"]), seq_len=int(record["seq_len"]),
                  layout=layout, tps_per_gpu=float(record["tps_per_gpu"] or 0),
                  peak_memory_gib=float(record["peak_mem_gib"] or 0), gpu=GPUS[record["gpu"]],
                  source=f"{record['source']}; {record['software']}; {record['method']}",
                  model=record["model"], shape=shape)
        if not row.tps_per_gpu:
            tflops = float(record["model_tflops_per_gpu"])
            row = dataclasses.replace(row, tps_per_gpu=tflops * 1e12 / nemo_model_flops_per_token(row.args, row.seq_len))
        rows.append(row)
    return rows


def nemo_model_flops_per_token(args: TransformerModelArgs, seq_len: int) -> float:
    """NeMo's model FLOPs per token, the count behind its published "model TFLOP/s per GPU": 6 per weight of the
    blocks' linear layers and of the output layer (not the embedding), plus 12 x layers x dim x seq for attention's
    two products, without the causal halving (this framework's count halves them)."""
    weights = block_linear_params(args) * args.n_layers + args.vocab_size * args.dim
    return 6 * weights + 12 * args.n_layers * args.dim * seq_len


def attention_split_check(rows: list[Row], gpu: GPUSpec | None = None) -> tuple[tuple[float, float], list[dict]]:
    """Whether a source's CP rows keep the error its rows without CP or with CP 2 have, attention and the rest
    apart: the model's step per token split into attention (its kernels, recomputed forward and ring merges, times
    the bubble) and everything else, and the two factors by which the source's published step differs from each,
    fitted by least squares in relative error on the rows with CP <= 2 only, then applied to every row. A factor
    pair that holds at CP 4 and beyond (residual near 0) says the model's CP terms scale as the source does, at the
    source's own level of attention and of the rest; a residual that jumps at CP 4 says they do not. A diagnostic
    of one source against itself: nothing of the model is fitted on these rows. `gpu`: the rows' GPU where it is
    not their own (the long-context rows'). Returns the factors (rest, attention) and, per row, its CP, attention's
    share of the model's step, the model's error in tokens/s per GPU and the error left after the factors (both
    positive where the prediction is too fast)."""
    parts = []
    for row in rows:
        layout, args, on = row.layout, row.args, gpu or row.gpu
        step = step_time(args, layout, row.seq_len, on)
        tokens = layout.tokens_per_gpu(row.seq_len)
        attention = attention_step(args, layout, row.seq_len, on).seconds * step.bubble / tokens
        parts.append((row, step.seconds / tokens - attention, attention, 1 / row.tps_per_gpu))
    # Least squares of (a x rest + b x attention) / published - 1 over the rows with CP <= 2: the 2 x 2 normal
    # equations of the features rest / published and attention / published against 1.
    fit_on = [(rest / published, attention / published) for row, rest, attention, published in parts
              if row.layout.cp <= 2]
    xx = sum(x * x for x, _ in fit_on)
    xy = sum(x * y for x, y in fit_on)
    yy = sum(y * y for _, y in fit_on)
    x1, y1 = sum(x for x, _ in fit_on), sum(y for _, y in fit_on)
    determinant = xx * yy - xy * xy
    rest_factor, attention_factor = (x1 * yy - y1 * xy) / determinant, (y1 * xx - x1 * xy) / determinant
    table = [{"row": row.index, "name": row.name, "cp": row.layout.cp, "attention_share": attention / (rest + attention),
              "tps_error": published / (rest + attention) - 1,
              "residual": published / (rest_factor * rest + attention_factor * attention) - 1}
             for row, rest, attention, published in parts]
    return (rest_factor, attention_factor), table


# NeMo's long-sequence table (Llama 2 7B on H100, Llama 3 8B on B200): the rows of OTHER that attention_split_check
# sets beside TorchTitan's long-context rows.
NEMO_LONG_SEQUENCE = "NVIDIA/NeMo/blob/9421f21af3bc554cd5656caac4dff863b20e8c65/docs/source/performance/" \
                     "performance_long_sequence.md"


def cp_sources() -> dict[str, tuple[tuple[float, float], list[dict]]]:
    """attention_split_check of each source with rows at CP 1 to CP 8 and beyond: TorchTitan's long-context rows
    of the 8B and of the 405B (torch's ring attention, January 2025), NeMo's long-sequence rows on H100 and on B200 (Transformer Engine's)."""
    nemo = [row for row in other_rows() if NEMO_LONG_SEQUENCE in row.source]
    long_context = published_rows(LONG_CONTEXT)
    return {**{f"TorchTitan, {flavor}, H100 (torch's ring attention)":
               attention_split_check([row for row in long_context if row.flavor == flavor], GPU)
               for flavor in ("8B", "405B")},
            **{f"NeMo, {rows[0].model or rows[0].flavor}, {gpu.upper()} (Transformer Engine's ring)":
               attention_split_check(rows)
               for gpu in ("h100", "b200") for rows in [[row for row in nemo if row.gpu.name == gpu]]}}


@dataclass(frozen=True)
class Envelope:
    """What the validated rows cover: the GPU families, sequence lengths, degrees and world sizes they ran, and how
    much communication the model hides behind compute in them. A layout outside it is predicted by terms no
    published figure has checked; where published rows checked the same excess (long context, another GPU), their
    errors widen the layout's range."""

    gpus: frozenset[str]
    seq_lens: frozenset[int]
    max_degrees: dict[str, int]
    max_world: int
    max_overlap_ratio: float
    tps_errors: tuple[float, ...]
    """The relative error in tokens/s per GPU of each held-out row (negative: the model predicted less than
    published)."""
    long_context_errors: tuple[tuple[int, float], ...] = ()
    """(CP degree, relative error in tokens/s per GPU) of each long-context row (LONG_CONTEXT), which lie outside."""
    other_gpu_errors: dict[str, tuple[int, float, float]] = dataclasses.field(default_factory=dict)
    """By GPU family outside the envelope: how many of OTHER's rows ran on it, and their least and largest relative
    error in tokens/s per GPU (the uncertainty a layout on that GPU carries, as far as those rows checked it)."""
    schedules: frozenset[str] = frozenset()
    """The pipeline schedules the rows ran."""

    @property
    def tps_error_range(self) -> tuple[float, float]:
        """The least and the largest relative error in tokens/s per GPU over the held-out rows."""
        return min(self.tps_errors), max(self.tps_errors)

    def _long_context(self, layout: Layout, seq_len: int) -> list[float]:
        """The errors of the long-context rows like `layout`, where its CP degree or its sequence lies beyond the
        validated rows': those with CP up to the layout's (the excess of the rows grows with CP)."""
        if layout.cp <= self.max_degrees["cp"] and seq_len <= max(self.seq_lens):
            return []
        return [error for cp, error in self.long_context_errors if cp <= layout.cp]

    def error_band(self, layout: Layout, seq_len: int, gpu: GPUSpec) -> tuple[float, float]:
        """The least and the largest relative error in tokens/s per GPU of the published rows like `layout`: the
        held-out rows', widened by TorchTitan's long-context rows with CP up to its degree (torch's ring attention)
        where its CP or its sequence lies beyond the validated rows', by the published rows of its GPU family where
        that is another, and by rowwise Float8's published speed against tensorwise's (the model's figure)."""
        errors = [*self.tps_errors, *self._long_context(layout, seq_len)]
        family = gpu.name.split("_")[0]
        if family not in self.gpus and family in self.other_gpu_errors:
            errors += self.other_gpu_errors[family][1:]
        low, high = min(errors), max(errors)
        if layout.float8 and layout.float8_recipe != "tensorwise":
            slowest, fastest = ROWWISE_OVER_TENSORWISE
            low, high = (1 + low) / fastest - 1, (1 + high) / slowest - 1
        return low, high

    def tps_range(self, step: StepTime, tokens: float, layout: Layout, seq_len: int,
                  gpu: GPUSpec) -> tuple[float, float]:
        """The conservative and the optimistic end of a layout's tokens/s per GPU (`tokens` per rank and step):
        no more communication hidden per second of compute than the validated rows hid, less the largest
        overprediction of the rows like it (error_band); and the prediction plus their largest underprediction."""
        low, high = self.error_band(layout, seq_len, gpu)
        return (tokens / step.seconds_hiding_at_most(self.max_overlap_ratio) / (1 + max(0.0, high)),
                tokens / step.seconds / (1 + min(0.0, low)))

    def outside(self, layout: Layout, seq_len: int, gpu: GPUSpec, overlap_ratio: float) -> tuple[str, ...]:
        reasons = []
        family = gpu.name.split("_")[0]
        if family not in self.gpus:
            checked = ""
            if family in self.other_gpu_errors:
                count, low, high = self.other_gpu_errors[family]
                checked = f"; {count} published rows on it predicted {100 * low:+.0f}% to {100 * high:+.0f}%"
            reasons.append(f"GPU {gpu.name} (validated: {', '.join(sorted(self.gpus))}{checked})")
        if seq_len not in self.seq_lens:
            reasons.append(f"seq_len {seq_len} (validated: {', '.join(map(str, sorted(self.seq_lens)))})")
        for name, most in self.max_degrees.items():
            if getattr(layout, name) > most:
                reasons.append(f"{name} {getattr(layout, name)} (validated up to {most})")
        like = self._long_context(layout, seq_len)
        if like:
            reasons.append(f"TorchTitan's long-context rows with CP up to {layout.cp} (torch's ring attention, "
                           f"32k-256k) were predicted {100 * min(like):+.0f}% to {100 * max(like):+.0f}%, which the "
                           f"range carries")
        if layout.float8 and layout.float8_recipe != "tensorwise":
            reasons.append(f"float8 recipe {layout.float8_recipe} (predicted as tensorwise; TorchTitan's June-2025 "
                           f"rowwise runs, not modelled, ran {ROWWISE_OVER_TENSORWISE[0]:.2f}-"
                           f"{ROWWISE_OVER_TENSORWISE[1]:.2f}x of tensorwise's tokens/s, which the range carries)")
        if layout.schedule is not None and layout.schedule not in self.schedules:
            reasons.append(f"schedule {layout.schedule} (validated: {', '.join(sorted(self.schedules))}; its bubble "
                           f"is torch's own order, run with the model's pass times)")
            if layout.ac != "none" and split_backward(layout.schedule):
                reasons.append("activation checkpointing under a split backward: the weight passes run the blocks' "
                               "forward again, a peak the memory model does not count (CPU runs with full AC, "
                               "docs/scaling.md: 1.45-1.60x the model's)")
        if layout.rotated:
            reasons.append("rotated tensor parallelism (no published run: its time is the model's per-turn overlap "
                           "of planner/rotated.py, not measured on GPUs)")
        if layout.world_size > self.max_world:
            reasons.append(f"{layout.world_size} GPUs (validated up to {self.max_world})")
        if overlap_ratio > self.max_overlap_ratio * (1 + 1e-9):
            reasons.append(f"hides {overlap_ratio:.2f}x its compute in communication (validated up to "
                           f"{self.max_overlap_ratio:.2f}x)")
        return tuple(reasons)


def _error(row: Row) -> float:
    """The model's relative error in tokens/s per GPU on `row` (at the row's own GPU and model shape)."""
    return tokens_per_second_per_gpu(row.args, row.layout, row.seq_len, row.gpu) / row.tps_per_gpu - 1


def envelope_of(rows: list[Row], long_context: list[Row], others: list[Row]) -> Envelope:
    """The envelope that `rows` (H100_ROWS's, fitted and held out) make, with the errors of the held-out ones, of
    the `long_context` rows and of the `others` on another GPU family."""
    ratios = [step_time(row.args, row.layout, row.seq_len, row.gpu).overlap_ratio for row in rows]
    families: dict[str, list[float]] = {}
    for row in others:
        family = row.gpu.name.split("_")[0]
        if family != GPU.name.split("_")[0]:
            families.setdefault(family, []).append(_error(row))
    return Envelope(gpus=frozenset({GPU.name.split("_")[0]}), seq_lens=frozenset(row.seq_len for row in rows),
                    max_degrees={name: max(getattr(row.layout, name) for row in rows)
                                 for name in ("tp", "pp", "cp", "dp_replicate")},
                    max_world=max(row.gpus for row in rows), max_overlap_ratio=max(ratios),
                    tps_errors=tuple(_error(row) for row in rows if not row.fitted),
                    long_context_errors=tuple((row.layout.cp, _error(row)) for row in long_context),
                    other_gpu_errors={family: (len(errors), min(errors), max(errors))
                                      for family, errors in families.items()},
                    schedules=frozenset(row.layout.schedule for row in rows if row.layout.schedule))


@functools.lru_cache(maxsize=1)
def envelope() -> Envelope:
    """The envelope of the published rows (all of them: fitted and held out), with the model's constants."""
    return envelope_of(published_rows(), published_rows(LONG_CONTEXT), other_rows())


def row_range(row: Row, validated: Envelope) -> tuple[float, float]:
    """The range (conservative and optimistic end, tokens/s per GPU) the planner gives `row`'s layout on its GPU and
    model shape under `validated`."""
    step = step_time(row.args, row.layout, row.seq_len, row.gpu)
    return validated.tps_range(step, row.layout.tokens_per_gpu(row.seq_len), row.layout, row.seq_len, row.gpu)


def ranges_without_the_row() -> list[dict]:
    """Each held-out row of TorchTitan's own software (its H100 rows, long-context rows, and OTHER's rows from
    pytorch/torchtitan: H200, A100, the 405B of August 2024) against the range of the envelope made without it:
    whether the published figure lies in the range the planner gave before the row was known (a range holds its
    own rows by construction; this is its test on rows it has not seen). Other software's rows are left out: the
    planner predicts this framework, not theirs."""
    rows, long_context, others = published_rows(), published_rows(LONG_CONTEXT), other_rows()
    groups = (("TorchTitan's H100 rows", [row for row in rows if not row.fitted]),
              ("TorchTitan's long-context rows", long_context),
              ("TorchTitan's other rows", [row for row in others if "pytorch/torchtitan" in row.source]))
    table = []
    for group, checked in groups:
        for row in checked:
            without = envelope_of([r for r in rows if r is not row], [r for r in long_context if r is not row],
                                  [r for r in others if r is not row])
            conservative, optimistic = row_range(row, without)
            outside = (row.tps_per_gpu / conservative - 1 if row.tps_per_gpu < conservative * (1 - 1e-9) else
                       row.tps_per_gpu / optimistic - 1 if row.tps_per_gpu > optimistic * (1 + 1e-9) else 0.0)
            table.append({"group": group, "name": row.name, "gpu": row.gpu.name, "tps_published": row.tps_per_gpu,
                          "tps_conservative": conservative, "tps_optimistic": optimistic, "outside": outside})
    return table


def fit_constants(rows: list[Row]) -> dict[str, float]:
    """The constants that minimise the largest relative tokens/s error on FIT_ROWS."""
    return fit([(model_args_for(row.flavor, row.seq_len), row.layout, row.seq_len, row.tps_per_gpu, False)
                for row in rows if row.fitted], GPU)


def fit(points: list[tuple[TransformerModelArgs, Layout, int, float, bool]], gpu: GPUSpec,
        only_efficiency: bool = False) -> dict[str, float]:
    """The constants that minimise the largest relative error over `points` (model shape, layout, sequence length,
    measured tokens/s per GPU, and whether one rank ran alone: a dry run on real tensors), by a grid search, coarse
    then fine around the coarse optimum: efficiency 0.30-1.00 by 0.01, memory-bound bytes 0-3,000 by 20, compiled
    fraction 0-1 by 0.025; `only_efficiency` keeps the other two at the model's values."""
    def error(constants: dict[str, float]) -> float:
        return max(abs(tokens_per_second_per_gpu(args, layout, seq_len, gpu, alone, **constants) / measured - 1)
                   for args, layout, seq_len, measured, alone in points)

    def best(efficiencies, bytes_, fractions) -> dict[str, float]:
        grid = ({"efficiency": e, "memory_bound_bytes": b, "compiled_fraction": f}
                for e, b, f in itertools.product(efficiencies, bytes_, fractions))
        return min(grid, key=error)

    def around(value: float, step: float, low: float, high: float, fine: float) -> list[float]:
        count = round(2 * step / fine)
        return sorted({round(min(high, max(low, value - step + i * fine)), 4) for i in range(count + 1)})

    if only_efficiency:
        return best([x / 100 for x in range(30, 101)], [MODEL_CONSTANTS["memory_bound_bytes"]],
                    [MODEL_CONSTANTS["compiled_fraction"]])
    coarse = best([x / 20 for x in range(6, 21)], [float(b) for b in range(0, 3001, 100)], [x / 10 for x in range(11)])
    return best(around(coarse["efficiency"], 0.05, 0.3, 1.0, 0.01),
                around(coarse["memory_bound_bytes"], 100, 0, 3000, 20),
                around(coarse["compiled_fraction"], 0.1, 0, 1, 0.025))
