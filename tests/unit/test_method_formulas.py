"""Each optimizer's update pinned to its paper's formula, written out again here independently of the code (plain
tensors, one process, two steps so that the state's recurrences count): a test that a changed update cannot pass."""

import math

import pytest
import torch
import torch.distributed as dist

from torchtitan.components.optimizers import flexdemo
from torchtitan.components.optimizers.flexdemo import FlexDeMo
from torchtitan.components.optimizers.galore import GaLoreAdamW
from torchtitan.components.optimizers.muon import Muon
from torchtitan.components.optimizers.ranger21 import Ranger21

LR, WD = 0.01, 0.1


def gradients(shape: tuple[int, int], steps: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


def run(optimizer_for, weight: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    param = torch.nn.Parameter(weight.clone())
    optimizer = optimizer_for(param)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def adam(grad, state, t, beta1=0.9, beta2=0.999, eps=1e-8):
    """Bias-corrected Adam direction m_hat / (sqrt(v_hat) + eps), updating `state` (m, v)."""
    state["m"] = beta1 * state.get("m", 0) + (1 - beta1) * grad
    state["v"] = beta2 * state.get("v", 0) + (1 - beta2) * grad * grad
    return state["m"] / (1 - beta1 ** t) / ((state["v"] / (1 - beta2 ** t)).sqrt() + eps)


@pytest.mark.parametrize("shape", [(16, 40), (40, 16)], ids=["rows_projected", "columns_projected"])
def test_galore_steps_by_the_back_projected_adam_of_the_projected_gradient(shape):
    """W <- W (1 - lr wd) - lr scale P Adam(P^T G), P the top-r left singular vectors of the first gradient (or
    W <- ... - lr scale Adam(G Q) Q^T with Q the right ones, when the columns are the smaller side)."""
    rank, scale = 4, 0.25
    weight, grads = torch.randn(shape, generator=torch.Generator().manual_seed(3)), gradients(shape)
    result = run(lambda p: GaLoreAdamW([{"params": [p], "matrix_method": True}], lr=LR, weight_decay=WD, rank=rank,
                                       scale=scale, svd="exact"), weight, grads)
    u, _, vh = torch.linalg.svd(grads[0], full_matrices=False)
    expected, state = weight.clone(), {}
    for t, grad in enumerate(grads, 1):
        if shape[0] < shape[1]:
            p = u[:, :rank]
            step = p @ adam(p.T @ grad, state, t)
        else:
            q = vh[:rank].T
            step = adam(grad @ q, state, t) @ q.T
        expected = expected * (1 - LR * WD) - LR * scale * step
    assert torch.allclose(result, expected, atol=1e-6)


def newton_schulz_reference(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al.'s quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, from X = G / ||G||_F, on the wide
    orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(16, 40), (40, 16)], ids=["wide", "tall"])
def test_muon_steps_by_the_orthogonalised_nesterov_momentum(shape, nesterov):
    """buf <- mu buf + (1 - mu) g; the step's momentum is (1 - mu) g + mu buf (Nesterov) or buf; W <- W (1 - lr wd)
    - lr 0.2 sqrt(max(m, n)) NS5(momentum)."""
    mu = 0.95
    weight, grads = torch.randn(shape, generator=torch.Generator().manual_seed(3)), gradients(shape)
    result = run(lambda p: Muon([{"params": [p], "matrix_method": True}], lr=LR, weight_decay=WD, momentum=mu,
                                nesterov=nesterov), weight, grads)
    expected, buf = weight.clone(), torch.zeros(shape)
    for grad in grads:
        buf = mu * buf + (1 - mu) * grad
        momentum = (1 - mu) * grad + mu * buf if nesterov else buf
        expected = expected * (1 - LR * WD) - LR * 0.2 * math.sqrt(max(shape)) * newton_schulz_reference(momentum)
    assert torch.allclose(result, expected, atol=1e-5)
    orthogonal = newton_schulz_reference(grads[0])
    singular_values = torch.linalg.svdvals(orthogonal)
    assert singular_values.min() > 0.6 and singular_values.max() < 1.3  # about the polar factor


def test_ranger21_positive_negative_momentum_stable_weight_decay_and_norm_loss():
    """Xie et al.'s positive-negative momentum (odd steps update m+, even steps m-, each with beta1^2; the step
    follows ((1 + b0) m_this - b0 m_other) / sqrt((1 + b0)^2 + b0^2) over Adam's sqrt(v_hat) + eps, bias-corrected
    by 1 - beta1^t), stable weight decay (w <- w (1 - lr wd / sqrt(mean v_hat))) and norm loss (each row scaled by
    1 - lr 2 nl (1 - 1 / |row|))."""
    beta1, beta2, eps, b0, norm_loss = 0.9, 0.99, 1e-8, 1.0, 1e-2
    shape = (8, 12)
    weight, grads = torch.randn(shape, generator=torch.Generator().manual_seed(3)), gradients(shape, steps=3)
    result = run(lambda p: Ranger21([{"params": [p], "weight_decay": WD}], lr=LR, betas=(beta1, beta2), eps=eps,
                                    agc_clip=0.0, agc_eps=1e-3, gradient_centralization=False, pnm_momentum=b0,
                                    norm_loss=norm_loss, lookahead_steps=0, lookahead_alpha=0.5), weight, grads)
    expected = weight.clone()
    positive, negative, v = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    for t, grad in enumerate(grads, 1):
        if t % 2:
            positive = beta1 ** 2 * positive + (1 - beta1 ** 2) * grad
            this, other = positive, negative
        else:
            negative = beta1 ** 2 * negative + (1 - beta1 ** 2) * grad
            this, other = negative, positive
        v = beta2 * v + (1 - beta2) * grad * grad
        v_hat = v / (1 - beta2 ** t)
        momentum = ((1 + b0) * this - b0 * other) / math.sqrt((1 + b0) ** 2 + b0 ** 2)
        expected = expected * (1 - LR * WD / v_hat.mean().sqrt())
        expected = expected * (1 - LR * 2 * norm_loss * (1 - 1 / (expected.norm(dim=1, keepdim=True) + 1e-8)))
        expected = expected - LR / (1 - beta1 ** t) * momentum / (v_hat.sqrt() + eps)
    assert torch.allclose(result, expected, atol=1e-6)


def capture_exchange(monkeypatch) -> list[torch.Tensor]:
    """FlexDeMo alone (one replica, eager selection): the payloads it all-gathers, one per step, in a list."""
    sent = []
    # The eager selection (the compiled one is the same function; compiling it would take most of this test).
    monkeypatch.setattr(flexdemo, "_compiled_running_maxima", lambda: flexdemo._running_maxima)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)

    def all_gather_single(output, payload, group=None):
        sent.append(payload.clone())
        output.copy_(payload)

    monkeypatch.setattr(dist, "all_gather_single", all_gather_single)
    return sent


def test_flexdemo_exchanges_the_top_dct_components_of_its_momentum_and_steps_by_their_sign(monkeypatch):
    """DeMo's step on one replica: m <- decay m + g; per chunk of 64 values the 8 largest DCT-II coefficients of m
    are sent (index, bfloat16 value) and removed from m; the weights step by the sign of the inverse DCT of the
    (replicas' mean) sent components."""
    chunk, topk, decay = 64, 8, 0.9
    shape = (30, 20)  # 600 values: 10 chunks, the last padded with zeros
    sent = capture_exchange(monkeypatch)
    weight, grads = torch.randn(shape, generator=torch.Generator().manual_seed(3)), gradients(shape)
    result = run(lambda p: FlexDeMo([p], lr=LR, weight_decay=WD, chunk_size=chunk, topk=topk, momentum_decay=decay,
                                    replicate_group=None), weight, grads)
    n = torch.arange(chunk, dtype=torch.float64)
    dct = torch.cos(math.pi / chunk * (n[None, :] + 0.5) * n[:, None]) * math.sqrt(2 / chunk)
    dct[0] /= math.sqrt(2)  # orthonormal DCT-II: row k is the k-th cosine
    dct = dct.float()
    expected, momentum = weight.clone(), torch.zeros(600)
    for step, grad in enumerate(grads):
        accumulated = torch.zeros(10 * chunk)  # the padding is zero at every step: it is not part of the tensor
        accumulated[:600] = decay * momentum + grad.flatten()
        coefficients = accumulated.view(10, chunk) @ dct.T
        indices = coefficients.abs().topk(topk, dim=1).indices
        values = coefficients.gather(1, indices).bfloat16().float()
        kept = torch.zeros_like(coefficients).scatter_(1, indices, values)
        momentum = (accumulated - (kept @ dct).flatten())[:600]
        expected = expected * (1 - LR * WD) - LR * (kept @ dct).flatten()[:600].sign().view(shape)
        payload = sent[step].view(10, 3 * topk)
        sent_indices = payload[:, :topk].long()
        sent_values = payload[:, topk:].contiguous().view(torch.bfloat16).float()
        assert torch.equal(sent_indices.sort(dim=1).values, indices.sort(dim=1).values)
        assert torch.equal(torch.zeros_like(coefficients).scatter_(1, sent_indices, sent_values), kept)
    assert torch.allclose(result, expected, atol=1e-6)


def test_flexdemo_tiles_exchange_the_top_2d_dct_components_of_each_tile(monkeypatch):
    """With tiles (DeMo's reference): m <- decay m + g; per 8 x 8 tile of the matrix (64 values) the 8 largest 2-D
    DCT-II coefficients of m are sent (index, bfloat16 value) and removed from m; the weights step by the sign of the
    inverse 2-D DCT of the (replicas' mean) sent components."""
    chunk, topk, decay = 64, 8, 0.9
    shape = (30, 20)  # 4 x 3 tiles of 8 x 8, the last row and column of tiles padded with zeros
    sent = capture_exchange(monkeypatch)
    weight, grads = torch.randn(shape, generator=torch.Generator().manual_seed(3)), gradients(shape)
    result = run(lambda p: FlexDeMo([p], lr=LR, weight_decay=WD, chunk_size=chunk, topk=topk, momentum_decay=decay,
                                    replicate_group=None, tiles=True), weight, grads)
    n = torch.arange(8, dtype=torch.float64)
    dct = torch.cos(math.pi / 8 * (n[None, :] + 0.5) * n[:, None]) * math.sqrt(2 / 8)
    dct[0] /= math.sqrt(2)  # orthonormal DCT-II: row k is the k-th cosine
    dct = dct.float()

    def tiles(matrix: torch.Tensor) -> torch.Tensor:  # 32 x 24 -> (12 tiles, 8, 8), tiles in row-major order
        return matrix.view(4, 8, 3, 8).transpose(1, 2).reshape(12, 8, 8)

    def untiled(tile_values: torch.Tensor) -> torch.Tensor:
        return tile_values.view(4, 3, 8, 8).transpose(1, 2).reshape(32, 24)[:30, :20]

    expected, momentum = weight.clone(), torch.zeros(shape)
    for step, grad in enumerate(grads):
        accumulated = torch.zeros(32, 24)  # the padding is zero at every step: it is not part of the tensor
        accumulated[:30, :20] = decay * momentum + grad
        coefficients = (dct @ tiles(accumulated) @ dct.T).reshape(12, 64)
        indices = coefficients.abs().topk(topk, dim=1).indices
        values = coefficients.gather(1, indices).bfloat16().float()
        kept = torch.zeros_like(coefficients).scatter_(1, indices, values)
        inverse = untiled(dct.T @ kept.view(12, 8, 8) @ dct)
        momentum = accumulated[:30, :20] - inverse
        expected = expected * (1 - LR * WD) - LR * inverse.sign()
        payload = sent[step].view(12, 3 * topk)
        sent_indices = payload[:, :topk].long()
        sent_values = payload[:, topk:].contiguous().view(torch.bfloat16).float()
        assert torch.equal(sent_indices.sort(dim=1).values, indices.sort(dim=1).values)
        # The same coefficients up to fp32 rounding (another order of the sums), so their bfloat16 values are equal or
        # one bfloat16 step (2^-7 relative at most) apart.
        assert torch.allclose(torch.zeros_like(coefficients).scatter_(1, sent_indices, sent_values), kept,
                              rtol=2 ** -7, atol=0)
    assert torch.allclose(result, expected, atol=1e-6)
