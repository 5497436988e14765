"""Block-causal attention: packed documents do not see each other, and with document positions a document in a
window is computed exactly as if it were alone."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.nn.attention import document_ids, document_positions

BOS = 7


def tiny_model(seq_len: int = 64) -> Transformer:
    args = dataclasses.replace(llama3_flavors["tiny"], rope_len=seq_len, vocab_size=64)
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def document(length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(8, 64, (length,), generator=torch.Generator().manual_seed(seed))
    ids[0] = BOS
    return ids


def loss_sum(model: Transformer, tokens: torch.Tensor, **masking) -> torch.Tensor:
    logits = model(tokens[None, :-1], **masking)
    return F.cross_entropy(logits[0].float(), tokens[1:], reduction="sum")


def block_causal(window: torch.Tensor, restart_positions: bool) -> dict:
    ids = document_ids(window[None, :-1], BOS)
    return {"document_ids": ids, "positions": document_positions(ids) if restart_positions else None}


def test_document_ids_and_positions():
    tokens = torch.tensor([[3, 4, BOS, 5, 6, 7 - 7 + BOS, 9], [BOS, 1, 2, 3, BOS, 4, 5]])
    ids = document_ids(tokens, BOS)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2, 2]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2]]


@torch.no_grad()
@pytest.mark.parametrize("restart_positions", [True, False])
def test_window_of_two_documents_has_the_losses_of_each_alone(restart_positions):
    """RoPE scores depend only on relative positions: inside its own block, B's offset in the window changes nothing
    but rounding, with or without positions that restart at each document."""
    model = tiny_model()
    a, b = document(23, 1), document(30, 2)
    # Each document alone: its tokens predict its next tokens. In the window, A's last token predicts B's BOS: the
    # one label that exists only there, left out of the comparison.
    window = torch.cat([a, b])
    logits = model(window[None, :-1], **block_causal(window, restart_positions))[0]
    per_token = F.cross_entropy(logits, window[1:], reduction="none")
    alone_a, alone_b = loss_sum(model, a), loss_sum(model, b)
    in_window_a, in_window_b = per_token[: len(a) - 1].sum(), per_token[len(a):].sum()
    torch.testing.assert_close(in_window_a, alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(in_window_b, alone_b, rtol=1e-5, atol=1e-5)
    # The logits too, token by token.
    torch.testing.assert_close(logits[len(a):], model(b[None, :-1])[0], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_with_causal_attention_b_differs_from_b_alone():
    model = tiny_model()
    a, b = document(23, 1), document(30, 2)
    window = torch.cat([a, b])
    logits = model(window[None, :-1])[0]
    assert not torch.allclose(logits[len(a):], model(b[None, :-1])[0], atol=1e-3)
    # A comes first: the same either way.
    torch.testing.assert_close(logits[: len(a) - 1], model(a[None, :-1])[0], rtol=1e-4, atol=1e-5)


def test_gradients_flow_within_documents_only():
    model = tiny_model()
    a, b = document(20, 3), document(20, 4)
    window = torch.cat([a, b])
    embeddings = model.tok_embeddings(window[None, :-1]).detach().requires_grad_()
    model.tok_embeddings, saved = None, model.tok_embeddings
    logits = model(embeddings, **block_causal(window, restart_positions=True))
    logits[0, len(a):].sum().backward()
    # B's outputs depend on no token of A.
    assert embeddings.grad[0, : len(a)].abs().max() == 0
    assert embeddings.grad[0, len(a):].abs().max() > 0
    model.tok_embeddings = saved


def test_options_refuse_positions_without_the_mask():
    from torchtitan.config import parse_args
    from torchtitan.errors import UserError

    with pytest.raises(UserError, match="document_positions: true needs model.attention_mask = 'block_causal'"):
        parse_args(["--model.document_positions"])
    with pytest.raises(UserError, match="option model.attention_mask: 'sliding' is not one of"):
        parse_args(["--model.attention_mask", "sliding"])


@torch.no_grad()
def test_flex_attention_block_mask_matches_the_sdpa_mask(monkeypatch):
    """The GPU path (FlexAttention with a BlockMask) computes what the CPU path does; FlexAttention runs forward on
    the CPU too, so its mask and call are checked here (eager: compiling it would take the test 15 s)."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan.nn import attention
    from torchtitan.nn.attention import block_causal_attention, document_mask

    monkeypatch.setattr(attention, "_compiled_flex_attention", flex_attention)

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 128, 16, generator=generator)
    k, v = torch.randn(2, 2, 128, 16, generator=generator), torch.randn(2, 2, 128, 16, generator=generator)
    tokens = torch.randint(8, 64, (2, 128), generator=generator)
    tokens[0, [0, 40, 41, 100]] = BOS
    tokens[1, [70]] = BOS
    ids = document_ids(tokens, BOS)
    flex = block_causal_attention(q, k, v, document_mask(ids, flex=True), "cpu")
    torch.testing.assert_close(flex, block_causal_attention(q, k, v, document_mask(ids), "cpu"), rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_compiled_code_uses_a_mask_with_the_same_result(monkeypatch):
    """Inside torch.compile, attention takes a block-diagonal mask instead of a loop over documents: same output."""
    from torchtitan.nn.attention import block_causal_attention, document_mask

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 96, 16, generator=generator) for _ in range(3))
    tokens = torch.randint(8, 64, (2, 96), generator=generator)
    tokens[0, [10, 11, 60]] = BOS
    mask = document_mask(document_ids(tokens, BOS))
    assert mask.spans == (((0, 10), (10, 11), (11, 60), (60, 96)), ((0, 96),))
    per_document = block_causal_attention(q, k, v, mask, "cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(block_causal_attention(q, k, v, mask, "cpu"), per_document, rtol=1e-4, atol=1e-5)
