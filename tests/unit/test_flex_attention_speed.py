"""benchmarks/flex_attention_speed.py in its CPU form: its rates count the pairs the trainer's masks leave visible."""

import json

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from benchmarks import flex_attention_speed as speed

SEQ_LEN = 128


@pytest.mark.parametrize("mask", speed.MASKS)
def test_visible_pairs_are_those_the_trainers_mask_leaves(mask):
    block_mask = speed.build_mask(mask, SEQ_LEN, 32, torch.device("cpu"))
    dense = create_mask(block_mask.mask_mod, 1, 1, SEQ_LEN, SEQ_LEN, device="cpu")
    assert speed.visible_pairs(mask, SEQ_LEN, 32) == int(dense.sum())


def test_cpu_form_writes_a_row_per_case_with_its_flops(tmp_path):
    output = tmp_path / "flex.json"
    assert speed.main(["--device", "cpu", "--seq_lens", str(SEQ_LEN), "--masks", "causal", "block_causal",
                       "--document_length", "32", "--iterations", "1", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    rows = record["rows"]
    assert record["complete"] and [(row["mask"], row["compile_cache"]) for row in rows] == [
        ("causal", "reset"), ("block_causal", "reset")]
    shape = speed.CPU_SHAPE
    for row in rows:
        flops = 4 * speed.visible_pairs(row["mask"], SEQ_LEN, 32) * shape["head_dim"] * shape["heads"]
        assert row["forward_tflops"] * 1e12 * row["forward_s"] == pytest.approx(flops, rel=1e-9)
        assert row["forward_fraction_of_flash"] == pytest.approx(row["forward_tflops"] / row["flash_forward_tflops"])


def test_documents_must_fill_the_windows(tmp_path, capsys):
    assert speed.main(["--device", "cpu", "--seq_lens", "100", "--document_length", "32",
                       "--output", str(tmp_path / "flex.json")]) == 2
    assert "option --document_length: 32 must divide every sequence length (100)" in capsys.readouterr().err
