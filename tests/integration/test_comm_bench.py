"""The slow-link measurement: recipes on two emulated hosts, bytes counted on the link between them."""

import json

import pytest
import torch

from benchmarks import comm_bench
from torchtitan.components.optimizers import flexdemo
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer
from torchtitan.nn.parameters import count_parameters
from torchtitan.tools.emulated_cluster import two_hosts, unavailable_reason

pytestmark = pytest.mark.integration


def test_emulated_hosts_or_the_reason_why_not():
    with two_hosts(rate_mbit=100) as hosts:
        if hosts.emulated:
            assert hosts.link_bytes() is not None and hosts.interface == "ttlink"
        else:
            assert hosts.why_not and hosts.link_bytes() is None and hosts.interface == "lo"


@pytest.mark.slow
def test_link_bytes_of_the_recipes(tmp_path):
    """6 steps of the debug model on 2 hosts x 1 process over a 1 Gbit/s link: the byte ratios of docs/recipes.md,
    against ring-collective arithmetic, with gloo's link counters as a cross-check."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the link's byte counters need emulated hosts: {reason}")
    comm_bench.main(["--out", str(tmp_path), "--steps", "6", "--rate", "1000", "--local-batch-size", "2",
                     "--recipes", "fsdp,loco4,qsdp8,ddp,flexdemo"])
    results = {r["recipe"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    ring = {name: r["ring_bytes_per_step"] for name, r in results.items()}
    # Ratios by ring arithmetic (what NCCL sends), from the FSDP step's own split between bf16 all-gathers and fp32
    # reduce-scatters (the dry run's buffers): codes cost bits / 8 + 2 / 128 bytes per value.
    collectives = json.loads((tmp_path / "dry_runs" / "fsdp" / "dry_run.json").read_text())["collectives"]
    gathered = sum(c["bytes"] for c in collectives if c["kind"] == "all_gather")
    reduced = sum(c["bytes"] for c in collectives if c["kind"] == "reduce_scatter")
    qsdp8 = (gathered * (1 + 2 / 128) / 2 + reduced * (1 + 2 / 128) / 4) / (gathered + reduced)
    loco4 = (gathered + reduced * (0.5 + 2 / 128) / 4) / (gathered + reduced)
    # About 38% (gathers = reductions here).
    assert ring["qsdp8"] / ring["fsdp"] == pytest.approx(qsdp8, abs=0.02)
    assert ring["loco4"] / ring["fsdp"] == pytest.approx(loco4, abs=0.01)  # the weights' all-gathers unchanged
    # FlexDeMo: each tile's top 32 DCT coefficients at 6 bytes against a ring all-reduce's 2 (R - 1) / R x 4 bytes
    # per value (R = 2): 1.2% for 64 x 64 tiles, a little more with the norms' 64-value chunks (half of them sent).
    with torch.device("meta"):
        model = Transformer(model_args_for("debugmodel", 256))
    payload = sum(flexdemo.payload_bytes(tuple(p.shape), 64, 32) for p in model.parameters())
    assert ring["flexdemo"] / ring["ddp"] == pytest.approx(payload / (4 * count_parameters(model)), rel=0.01)
    # gloo's counters as the cross-check: its all-gather and all-to-all send what a ring does (plus TCP/IP
    # headers), its reduce-scatter about twice: FSDP's baseline moves half again as much as a ring's.
    link = {name: r["link_bytes_per_step"] for name, r in results.items()}
    assert 0.95 < link["qsdp8"] / ring["qsdp8"] < 1.15  # (1.04 against the counters' own ring bytes)
    assert 1.3 < link["fsdp"] / ring["fsdp"] < 1.7
    for name, r in results.items():
        assert r["steps"] == 6 and abs(r["final_loss"] / results[r["baseline"]]["final_loss"] - 1) < 0.01, name


@pytest.mark.slow
def test_300_steps_stay_within_the_loss_bounds(tmp_path):
    """The issue's targets on the final loss (mean of the last 10 of 300 steps, seed 0, same data): LoCo 4-bit and
    QSDP 8-bit within 1% of FSDP. 10-20 minutes on two CPU cores; the link is unthrottled (veth, or loopback without
    root: the losses do not depend on it). Its third target, FlexDeMo within 2% of AdamW under DDP, was the earlier
    variant's; DeMo's step at its reference's density (32 of 4096 coefficients per tile) misses it by far
    (docs/recipes.md, "FlexDeMo: DeMo's step, at more replicas"), so it is not asserted here."""
    comm_bench.main(["--out", str(tmp_path), "--steps", "300", "--rate", "0", "--local-batch-size", "4",
                     "--recipes", "fsdp,loco4,qsdp8"])
    results = {r["recipe"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}

    def gap(name: str) -> float:
        return abs(results[name]["final_loss"] / results[results[name]["baseline"]]["final_loss"] - 1)

    assert gap("loco4") < 0.01
    assert gap("qsdp8") < 0.01


def test_seeds_table_pairs_each_run_with_its_own_seeds_baseline():
    def run(recipe, seed, loss, memory=1.0, step=0.5):
        return {"recipe": recipe, "baseline": "fsdp", "seed": seed, "final_loss": loss, "peak_memory_gib": memory,
                "step_time_s": step, "ring_bytes_per_step": {"fsdp": 40e6, "loco4": 20e6}[recipe]}

    results = [run("fsdp", 0, 5.0), run("loco4", 0, 5.05), run("fsdp", 1, 4.0), run("loco4", 1, 4.0)]
    table = comm_bench.seeds_report(results, None)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    # loco4: +1% on seed 0 and 0% on seed 1 against the same seed's fsdp: mean +0.50%, sample sd 0.71%.
    assert rows["loco4"][3] == "+0.50 ± 0.71%" and rows["loco4"][5] == "50.0%"
    assert rows["fsdp"][2] == "4.5000 ± 0.7071" and rows["fsdp"][3] == "-"


def test_resume_keeps_earlier_runs_of_the_same_length_and_refuses_others(tmp_path):
    runs = [{"recipe": "fsdp", "seed": 0, "steps": 20}, {"recipe": "loco4", "seed": 0, "steps": 20}]
    (tmp_path / "results_partial.json").write_text(json.dumps({"note": "", "results": runs}))
    same = comm_bench.argparse.Namespace(out=tmp_path, steps=20)
    assert comm_bench.earlier_runs(same) == runs
    with pytest.raises(SystemExit, match=r"\[20\] steps, not --steps 30"):
        comm_bench.earlier_runs(comm_bench.argparse.Namespace(out=tmp_path, steps=30))
    with pytest.raises(SystemExit, match="does not exist"):
        comm_bench.earlier_runs(comm_bench.argparse.Namespace(out=tmp_path / "elsewhere", steps=20))
