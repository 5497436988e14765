"""The Llama 3.1 model: shapes, published sizes, RoPE scaling, causality, initialisation, FLOPs, flavor errors."""

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from torchtitan.errors import UserError
from torchtitan.config import parse_args
from torchtitan.config.model_shape import describe_model, shape_overrides
from torchtitan.models.llama3.args import TransformerModelArgs, llama3_flavors, model_args_for
from torchtitan.models.llama3.model import (Transformer, apply_rotary_emb, flops_per_token, rope_table,
                                            scale_rope_frequencies)
from torchtitan.nn.attention import causal_attention, cpu_attention_in_fp32
from torchtitan.nn.parameters import count_parameters

REPO = Path(__file__).resolve().parents[2]


def meta_model(args: TransformerModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def cpu_model(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    model = meta_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def tiny(seq_len: int = 32, **changes) -> TransformerModelArgs:
    return dataclasses.replace(model_args_for("tiny", seq_len), **changes)


# ---------------------------------------------------------------------------------------------------------------
# Shapes and sizes


def test_logits_shape_for_sequences_up_to_the_rope_length():
    model = cpu_model(tiny(seq_len=32))
    for seq_len in (1, 17, 32):
        tokens = torch.randint(0, 2304, (3, seq_len))
        logits = model(tokens)
        assert logits.shape == (3, seq_len, 2304)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all()


def test_shapes_of_the_modules():
    args = model_args_for("8B", 8192)
    model = meta_model(args)
    block = model.layers["0"]
    assert model.tok_embeddings.weight.shape == (128256, 4096)
    assert block.attention.wq.weight.shape == (32 * 128, 4096)
    assert block.attention.wk.weight.shape == (8 * 128, 4096)
    assert block.attention.wv.weight.shape == (8 * 128, 4096)
    assert block.attention.wo.weight.shape == (4096, 32 * 128)
    assert block.feed_forward.w1.weight.shape == (14336, 4096)
    assert block.feed_forward.w2.weight.shape == (4096, 14336)
    assert model.output.weight.shape == (128256, 4096)
    assert len(model.layers) == 32
    assert model.rope.shape == (8192, 64, 2)


# Meta's published sizes (model cards / the Llama 3 paper) and FFN widths of Llama 3.1.
@pytest.mark.parametrize("flavor, params, ffn, layers", [
    ("8B", 8_030_261_248, 14336, 32),
    ("70B", 70_553_706_496, 28672, 80),
    ("405B", 405_853_388_800, 53248, 126),
])
def test_published_parameter_counts_and_ffn_widths(flavor, params, ffn, layers):
    args = model_args_for(flavor, 8192)
    model = meta_model(args)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_parameters(model) == params
    assert count_parameters(model, exclude_embeddings=True) == params - 128256 * args.dim
    assert args.ffn_hidden_dim == ffn
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == ffn
    assert len(model.layers) == layers


@pytest.mark.parametrize("flavor", ["debugmodel", "tiny", "8B"])
def test_count_parameters_equals_the_sum_over_named_parameters(flavor):
    model = meta_model(model_args_for(flavor, 128))
    assert count_parameters(model) == sum(p.numel() for _, p in model.named_parameters())


def test_model_args_for_replaces_vocab_and_rope_length():
    args = model_args_for("debugmodel", 256, vocab_size=1000)
    assert args.vocab_size == 1000 and args.rope_len == 256
    assert model_args_for("debugmodel", 256).vocab_size == llama3_flavors["debugmodel"].vocab_size
    assert llama3_flavors["debugmodel"].rope_len == 131072, "model_args_for must not modify the flavor table"
    assert model_args_for("tiny", 8192).rope_len == 8192
    # Training beyond the flavor's context extends it (long-context training: TorchTitan's 8B runs at 256k).
    longer = model_args_for("8B", 262144)
    assert (longer.rope_len, longer.max_seq_len) == (262144, 262144)
    assert model_args_for("8B", 8192).max_seq_len == 131072


@pytest.mark.parametrize("flavor, seq_len, pattern", [
    ("9B", 128, r"option model\.flavor: unknown flavor '9B'; valid: debugmodel, tiny, 8B, 70B, 405B"),
    ("8B", 0, r"option training\.seq_len: 0 must be a positive integer"),
])
def test_model_args_for_errors_name_the_option(flavor, seq_len, pattern):
    with pytest.raises(UserError, match=pattern):
        model_args_for(flavor, seq_len)


def test_shape_options_apply_on_top_of_the_flavor():
    overrides = {"dim": 96, "n_layers": 2, "n_heads": 6, "n_kv_heads": 2, "ffn_dim_multiplier": 1.5,
                 "multiple_of": 32, "vocab_size": 2368, "rope_theta": 10000.0}
    args = model_args_for("tiny", 64, vocab_size=2304, overrides=overrides)
    assert {name: getattr(args, name) for name in overrides} == overrides
    assert (args.head_dim, args.kv_heads, args.ffn_hidden_dim, args.rope_len) == (16, 2, 384, 64)
    assert (args.norm_eps, args.use_scaled_rope, args.max_seq_len) == (1e-5, True, 8192), "the rest is the flavor's"
    assert llama3_flavors["tiny"].dim == 64, "model_args_for must not modify the flavor table"
    model = cpu_model(args)
    assert model(torch.randint(0, 2304, (2, 64))).shape == (2, 64, 2368)
    assert describe_model("tiny", overrides).startswith("tiny with dim 96, n_layers 2, n_heads 6, n_kv_heads 2, "
                                                        "ffn_dim_multiplier 1.5, multiple_of 32")
    assert describe_model("tiny", {}) == "tiny"


def test_shipped_125m_config_trains_the_shape_it_says():
    config = parse_args(["--job.config_file", str(REPO / "train_configs/llama3_125m.toml")])
    args = model_args_for(config.model.flavor, config.training.seq_len, 2304, overrides=shape_overrides(config.model))
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.head_dim, args.ffn_hidden_dim) == (
        768, 12, 12, 4, 64, 2048)
    # The figures its comment (and docs/recipes.md) give.
    assert count_parameters(meta_model(args)) == 79_055_616
    with_llama3_tokenizer = dataclasses.replace(args, vocab_size=128256)
    assert count_parameters(meta_model(with_llama3_tokenizer)) == 272_517_888


@pytest.mark.parametrize("overrides, pattern", [
    ({"dim": 100}, r"option model\.dim: 100 is not divisible by model\.n_heads = 8"),
    ({"dim": 72}, r"option model\.n_heads: dim / n_heads = 72 / 8 = 9 is odd"),
    ({"n_heads": 2}, r"option model\.n_kv_heads: 4 does not divide model\.n_heads = 2"),
    ({"n_layers": 0}, r"option model\.n_layers: 0 must be a positive integer"),
    ({"n_kv_heads": -1}, r"option model\.n_kv_heads: -1 must be a positive integer"),
    ({"ffn_dim_multiplier": 0.0}, r"option model\.ffn_dim_multiplier: 0\.0 must be positive"),
    ({"rope_theta": -1.0}, r"option model\.rope_theta: -1\.0 must be positive"),
    ({"vocab_size": 2000}, r"option model\.vocab_size: 2000 is smaller than the tokenizer.s vocabulary \(2304 "),
])
def test_shape_option_errors_name_the_option(overrides, pattern):
    with pytest.raises(UserError, match=pattern):
        model_args_for("tiny", 32, vocab_size=2304, overrides=overrides)


def test_flops_per_token_formula():
    args = model_args_for("8B", 8192)
    non_embedding = count_parameters(meta_model(args), exclude_embeddings=True)
    assert non_embedding == 7_504_924_672
    # 6 FLOPs per weight (forward 2, backward 4) + attention scores and values: 2 matmuls x 2 FLOPs x 3 (fwd+bwd)
    # over seq_len keys for each of the layers x heads x head_dim query channels.
    expected = 6 * 7_504_924_672 + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, non_embedding, 8192) == expected == 57_914_449_920
    assert flops_per_token(args, non_embedding, 4096) == 6 * 7_504_924_672 + 12 * 32 * 32 * 128 * 4096


# ---------------------------------------------------------------------------------------------------------------
# RoPE


def llama31_scaled_frequency(freq: float) -> float:
    """Meta's published apply_scaling (llama-models, Llama 3.1), written out for one frequency."""
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
        return freq
    if wavelen > low_freq_wavelen:
        return freq / scale_factor
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return (1 - smooth) * freq / scale_factor + smooth * freq


def test_rope_frequency_scaling_matches_the_published_llama31_formula():
    head_dim, theta = 128, 500000.0
    freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    wavelens = [2 * math.pi / f for f in freqs]
    assert any(w < 2048 for w in wavelens) and any(w > 8192 for w in wavelens)
    assert any(2048 <= w <= 8192 for w in wavelens), "no frequency in the interpolated band"
    expected = torch.tensor([llama31_scaled_frequency(f) for f in freqs], dtype=torch.float64)
    actual = scale_rope_frequencies(torch.tensor(freqs, dtype=torch.float64))
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=0)


def test_rope_table_holds_cos_and_sin_of_position_times_scaled_frequency():
    args = model_args_for("8B", 64)
    table = rope_table(args)
    assert table.shape == (64, 64, 2) and table.dtype == torch.float32
    freqs = torch.tensor([llama31_scaled_frequency(1.0 / 500000.0 ** (i / 128)) for i in range(0, 128, 2)],
                         dtype=torch.float64)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * freqs
    torch.testing.assert_close(table[..., 0], angles.cos().float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table[..., 1], angles.sin().float(), rtol=0, atol=1e-6)
    unscaled = rope_table(dataclasses.replace(args, use_scaled_rope=False))
    plain = torch.arange(64, dtype=torch.float64)[:, None] * torch.tensor(
        [1.0 / 500000.0 ** (i / 128) for i in range(0, 128, 2)], dtype=torch.float64)
    torch.testing.assert_close(unscaled[..., 1], plain.sin().float(), rtol=0, atol=1e-6)
    assert not torch.allclose(unscaled, table)


def test_rotary_embedding_makes_attention_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    args = tiny(seq_len=16)
    table = rope_table(args)
    q, k = torch.randn(args.head_dim, dtype=torch.float64), torch.randn(args.head_dim, dtype=torch.float64)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        # (batch 1, 16 positions, 1 head, head_dim) with the same vector at every position.
        return apply_rotary_emb(x.expand(1, 16, 1, -1), table)[0, :, 0]

    q_rot, k_rot = rotated(q), rotated(k)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm().expand(16), rtol=1e-6, atol=0)
    score = lambda m, n: (q_rot[m] * k_rot[n]).sum()  # noqa: E731
    torch.testing.assert_close(score(5, 2), score(13, 10), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(score(0, 0), (q * k).sum(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(score(5, 2), score(5, 4))


@pytest.mark.parametrize("per_sequence", [False, True])
def test_compiled_rotary_embedding_is_real_arithmetic_and_equals_the_eager_one(per_sequence):
    """Compiled, the rotation is written without complex numbers, for which inductor generates no code: the same
    values and gradients as the eager complex product, for a shared table and for one table per sequence."""
    torch.manual_seed(0)
    args = tiny(seq_len=16)
    table = rope_table(args)
    if per_sequence:
        table = table[torch.randint(0, 16, (2, 16))]
    x = torch.randn(2, 16, 3, args.head_dim, requires_grad=True)
    eager = apply_rotary_emb(x, table)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), x)
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph

    compiled = torch.compile(apply_rotary_emb, backend=record, fullgraph=True)(x, table)
    (compiled_grad,) = torch.autograd.grad(compiled.square().sum(), x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-6, atol=1e-6)
    assert "complex" not in "".join(graph.code for graph in graphs)


# ---------------------------------------------------------------------------------------------------------------
# Causality


def test_a_token_changes_no_logit_before_it():
    model = cpu_model(tiny(seq_len=16))
    tokens = torch.randint(0, 2304, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    t = 9
    changed[:, t] = (tokens[:, t] + 1) % 2304
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    for position in range(t, 16):
        assert (after[:, position] - before[:, position]).abs().max() > 1e-4, f"position {position} unchanged"


@pytest.mark.parametrize("head_dim, seq_len, in_fp32", [(16, 512, True), (16, 1024, False), (64, 256, True),
                                                          (64, 512, False)])
def test_cpu_bf16_attention_takes_the_faster_path_and_agrees_with_fp32(head_dim, seq_len, in_fp32):
    """docs/performance.md measured which path is faster per shape; both compute the same attention."""
    assert cpu_attention_in_fp32(head_dim, seq_len) == in_fp32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=generator) for heads in (4, 2, 2))
    reference = causal_attention(q, k, v, "cpu")
    out = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "cpu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.02, atol=0.02)


# ---------------------------------------------------------------------------------------------------------------
# Initialisation


def test_init_is_deterministic_per_seed():
    first, second = cpu_model(tiny(), seed=3).state_dict(), cpu_model(tiny(), seed=3).state_dict()
    other_seed = cpu_model(tiny(), seed=4).state_dict()
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(value, other_seed[name]), name


def test_each_parameter_gets_its_own_values():
    params = dict(cpu_model(tiny()).named_parameters())
    wq0, wq1 = params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"]
    assert not torch.equal(wq0, wq1)


def test_init_does_not_depend_on_which_other_parameters_exist():
    full = dict(cpu_model(tiny(), seed=1).named_parameters())
    shallow = dict(cpu_model(tiny(n_layers=2), seed=1).named_parameters())
    assert len(shallow) < len(full)
    for name, value in shallow.items():
        assert torch.equal(value, full[name]), name
    # A pipeline stage drops parts of the model; what it keeps starts from the same values.
    stage = meta_model(tiny())
    stage.tok_embeddings = None
    del stage.layers["0"]
    stage.to_empty(device="cpu")
    stage.init_weights(seed=1)
    for name, value in stage.named_parameters():
        assert torch.equal(value, full[name]), name


def truncated_std(std: float, cut: float) -> float:
    """Std of a normal(0, std) cut at +-cut*std: std * sqrt(1 - 2 c phi(c) / (Phi(c) - Phi(-c)))."""
    phi = math.exp(-cut * cut / 2) / math.sqrt(2 * math.pi)
    return std * math.sqrt(1 - 2 * cut * phi / math.erf(cut / math.sqrt(2)))


def test_depth_scaled_std_of_the_residual_output_projections():
    args = dataclasses.replace(model_args_for("debugmodel", 32), n_layers=4)
    params = dict(cpu_model(args).named_parameters())
    for layer in range(4):
        depth_std = 0.02 / math.sqrt(2 * (layer + 1))
        for suffix, std in [("attention.wo.weight", depth_std), ("feed_forward.w2.weight", depth_std),
                            ("feed_forward.w3.weight", depth_std), ("attention.wq.weight", 0.02),
                            ("attention.wk.weight", 0.02), ("attention.wv.weight", 0.02),
                            ("feed_forward.w1.weight", 0.02)]:
            weight = params[f"layers.{layer}.{suffix}"]
            assert weight.std().item() == pytest.approx(truncated_std(std, 2), rel=0.03), (layer, suffix)
            assert weight.abs().max().item() <= 2 * std + 1e-9, (layer, suffix)
            assert abs(weight.mean().item()) < 0.05 * std, (layer, suffix)
        assert torch.equal(params[f"layers.{layer}.attention_norm.weight"], torch.ones(args.dim))
        assert torch.equal(params[f"layers.{layer}.ffn_norm.weight"], torch.ones(args.dim))


def test_embedding_output_and_final_norm_init():
    args = model_args_for("debugmodel", 32)
    params = dict(cpu_model(args).named_parameters())
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.02)
    output_std = args.dim ** -0.5
    output = params["output.weight"]
    assert output.abs().max().item() <= 3 * output_std + 1e-9
    assert output.abs().max().item() > 2.5 * output_std, "output should be cut at 3 std, not 2"
    assert output.std().item() == pytest.approx(truncated_std(output_std, 3), rel=0.01)
    assert torch.equal(params["norm.weight"], torch.ones(args.dim))


# ---------------------------------------------------------------------------------------------------------------
# scripts/model_info.py


@pytest.fixture(scope="module")
def model_info_main():
    spec = importlib.util.spec_from_file_location("model_info", REPO / "scripts" / "model_info.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_model_info_reports_counts_shapes_and_flops(model_info_main, capsys):
    assert model_info_main(["--flavor", "8B", "--seq_len", "8192"]) == 0
    out = capsys.readouterr().out
    for fragment in ("8,030,261,248", "(8.030 B)", "7,504,924,672", "(7.505 B)", "dim 4096", "layers 32",
                     "kv heads 8", "ffn hidden dim 14336", "57,914,449,920", "at seq_len 8,192"):
        assert fragment in out, fragment


def test_model_info_all_flavors(model_info_main, capsys):
    assert model_info_main(["--all", "--seq_len", "4096"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("llama3 ")] == [
        f"llama3 {flavor}" for flavor in llama3_flavors]
    assert "405,853,388,800" in out and "70,553,706,496" in out


@pytest.mark.parametrize("argv, message", [
    (["--flavor", "9B"], "error: --flavor: unknown flavor '9B'; valid: debugmodel, tiny, 8B, 70B, 405B"),
    (["--flavor", "8B", "--seq_len", "0"], "error: --seq_len: 0 must be a positive integer"),
])
def test_model_info_errors_are_one_line_and_exit_2(model_info_main, argv, message, capsys):
    assert model_info_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(message), line
