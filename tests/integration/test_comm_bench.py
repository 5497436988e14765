"""The slow-link measurement: recipes on two emulated hosts, bytes counted on the link between them."""

import json

import pytest

from scripts import comm_bench
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
    """6 steps of the debug model on 2 hosts x 1 process over a 1 Gbit/s link: the byte ratios of docs/recipes.md."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the link's byte counters need emulated hosts: {reason}")
    comm_bench.main(["--out", str(tmp_path), "--steps", "6", "--rate", "1000", "--local-batch-size", "2",
                     "--recipes", "fsdp,loco4,qsdp8,ddp,flexdemo"])
    results = {r["recipe"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    per_step = {name: r["link_bytes_per_step"] for name, r in results.items()}
    # FSDP: all-gathers of bf16 weights + reduce-scatters of fp32 gradients; DDP: one fp32 all-reduce.
    assert per_step["loco4"] / per_step["fsdp"] < 0.40  # the weights' all-gathers are left as they are
    assert per_step["qsdp8"] / per_step["fsdp"] < 0.30
    assert per_step["flexdemo"] / per_step["ddp"] < 0.10
    for name, r in results.items():
        assert r["steps"] == 6 and abs(r["final_loss"] / results[r["baseline"]]["final_loss"] - 1) < 0.01, name


@pytest.mark.slow
def test_300_steps_stay_within_the_loss_bounds(tmp_path):
    """The issue's targets on the final loss (mean of the last 10 of 300 steps, seed 0, same data): LoCo 4-bit and
    QSDP 8-bit within 1% of FSDP, FlexDeMo within 2% of AdamW under DDP. 13-25 minutes on two CPU cores; the link
    is unthrottled (veth, or loopback without root: the losses do not depend on it)."""
    comm_bench.main(["--out", str(tmp_path), "--steps", "300", "--rate", "0", "--local-batch-size", "4",
                     "--recipes", "fsdp,loco4,qsdp8,ddp,flexdemo"])
    results = {r["recipe"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}

    def gap(name: str) -> float:
        return abs(results[name]["final_loss"] / results[results[name]["baseline"]]["final_loss"] - 1)

    assert gap("loco4") < 0.01
    assert gap("qsdp8") < 0.01
    assert gap("flexdemo") < 0.02
