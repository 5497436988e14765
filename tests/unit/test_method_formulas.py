"""Each optimizer's update pinned to its paper's formula, written out again here independently of the code (plain
tensors, two or three steps so that the state's recurrences count; one process, except FlexDeMo's, whose replicas
are real gloo processes): a test that a changed update cannot pass."""

import datetime
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.forked_ranks import run_ranks
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


def positive_negative_momenta(grads: list[torch.Tensor], beta1: float, beta2: float, b0: float):
    """Per step t (from 1): the gradient, Xie et al.'s positive-negative momentum (odd steps update m+, even steps
    m-, each with beta1^2; ((1 + b0) m_this - b0 m_other) / sqrt((1 + b0)^2 + b0^2)) and Adam's bias-corrected
    v_hat."""
    positive, negative, v = (torch.zeros_like(grads[0]) for _ in range(3))
    for t, grad in enumerate(grads, 1):
        if t % 2:
            positive = beta1 ** 2 * positive + (1 - beta1 ** 2) * grad
            this, other = positive, negative
        else:
            negative = beta1 ** 2 * negative + (1 - beta1 ** 2) * grad
            this, other = negative, positive
        v = beta2 * v + (1 - beta2) * grad * grad
        yield t, ((1 + b0) * this - b0 * other) / math.sqrt((1 + b0) ** 2 + b0 ** 2), v / (1 - beta2 ** t)


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
                                    norm_loss=norm_loss, lookahead_steps=0, lookahead_alpha=0.5,
                                    gradient_normalization=False, softplus=False), weight, grads)
    expected = weight.clone()
    for t, momentum, v_hat in positive_negative_momenta(grads, beta1, beta2, b0):
        expected = expected * (1 - LR * WD / v_hat.mean().sqrt())
        expected = expected * (1 - LR * 2 * norm_loss * (1 - 1 / (expected.norm(dim=1, keepdim=True) + 1e-8)))
        expected = expected - LR / (1 - beta1 ** t) * momentum / (v_hat.sqrt() + eps)
    assert torch.allclose(result, expected, atol=1e-6)


@pytest.mark.parametrize("shape", [(8, 12), (40,)], ids=["matrix", "vector"])
def test_ranger21_normalized_centralized_gradient_and_softplus_denominator(shape):
    """The reference's defaults using_normgc and softplus (lessw2020/Ranger21): each row of a matrix's gradient
    loses its mean, then the gradient is divided by its unbiased standard deviation over the whole tensor plus 1e-8
    (a vector only by that), and both moments see that gradient; Adam's denominator sqrt(v_hat) + eps becomes
    softplus(x) = ln(1 + exp(50 x)) / 50. Gradients of order 1e-3, so that the normalisation scales them by about
    1e3, and half of the denominators are small enough for softplus to lift them."""
    beta1, beta2, eps, b0 = 0.9, 0.99, 1e-8, 1.0
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    grads = [grad * 1e-3 for grad in gradients(shape, steps=3)]
    result = run(lambda p: Ranger21([{"params": [p], "weight_decay": 0.0}], lr=LR, betas=(beta1, beta2), eps=eps,
                                    agc_clip=0.0, agc_eps=1e-3, gradient_centralization=True, pnm_momentum=b0,
                                    norm_loss=0.0, lookahead_steps=0, lookahead_alpha=0.5), weight, grads)
    normalized = []
    for grad in grads:
        if len(shape) > 1:
            grad = grad - grad.mean(dim=1, keepdim=True)
        n = grad.numel()
        normalized.append(grad / (((grad - grad.mean()) ** 2).sum() / (n - 1)).sqrt().add(1e-8))
    expected = weight.clone()
    for t, momentum, v_hat in positive_negative_momenta(normalized, beta1, beta2, b0):
        denominator = v_hat.sqrt() + eps
        denominator = denominator + torch.log1p(torch.exp(-50 * denominator)) / 50  # ln(1 + e^(50 x)) / 50, x > 0
        expected = expected - LR / (1 - beta1 ** t) * momentum / denominator
    assert torch.allclose(result, expected, atol=1e-6)
    plain = run(lambda p: Ranger21([{"params": [p], "weight_decay": 0.0}], lr=LR, betas=(beta1, beta2), eps=eps,
                                   agc_clip=0.0, agc_eps=1e-3, gradient_centralization=True, pnm_momentum=b0,
                                   norm_loss=0.0, lookahead_steps=0, lookahead_alpha=0.5,
                                   gradient_normalization=False, softplus=False), weight, grads)
    assert not torch.allclose(plain, expected, atol=1e-4)  # the two components change the step


# FlexDeMo at three replicas: DeMo's step (bloc97/DeMo, demo.py), written out again below.
REPLICAS, CHUNK, TOPK, DECAY = 3, 8, 5, 0.9
STEP_LRS = (0.02, 0.01, 0.005)  # a schedule: DeMo accumulates lr-scaled gradients
# A matrix (8 x 5 tiles: 24 rows by 8, 20 columns by their largest divisor up to 8), a vector (chunks of 6) and one
# of prime length (chunks of 1, every value sent).
SHAPES = {"matrix": (24, 20), "vector": (30,), "prime": (11,)}


def demo_gradients(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Correlated replicas (a shared part and each one's own), so that they send some coefficients in common."""
    shared = torch.Generator().manual_seed(1000 + step)
    own = torch.Generator().manual_seed(2000 + 10 * step + rank)
    return {name: torch.randn(shape, generator=shared) + 0.7 * torch.randn(shape, generator=own)
            for name, shape in SHAPES.items()}


def demo_start() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def demo_worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store", REPLICAS), rank=rank,
                            world_size=REPLICAS, timeout=datetime.timedelta(seconds=60))
    try:
        params = {name: torch.nn.Parameter(value) for name, value in demo_start().items()}
        optimizer = FlexDeMo([{"params": [params["matrix"]], "weight_decay": WD},
                              {"params": [params["vector"], params["prime"]], "weight_decay": 0.0}],
                             lr=STEP_LRS[0], weight_decay=WD, chunk_size=CHUNK, topk=TOPK, momentum_decay=DECAY,
                             replicate_group=dist.group.WORLD)
        for step, lr in enumerate(STEP_LRS):
            for group in optimizer.param_groups:
                group["lr"] = lr
            for name, grad in demo_gradients(rank, step).items():
                params[name].grad = grad
            optimizer.step()
        torch.save({"weights": {name: p.detach().clone() for name, p in params.items()},
                    "deltas": {name: optimizer.state[p]["delta"].clone() for name, p in params.items()},
                    "sent_bytes": optimizer.sent_bytes}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def dct_reference(size: int) -> torch.Tensor:
    """D[k, n] = a(k) cos(pi (2n + 1) k / 2N), a(0) = sqrt(1/N), else sqrt(2/N): orthonormal, inverse D^T."""
    n = torch.arange(size, dtype=torch.float64)
    scale = torch.full((size,), math.sqrt(2 / size), dtype=torch.float64)
    scale[0] = math.sqrt(1 / size)
    return (torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * size)) * scale[:, None]).float()


def largest_divisor_up_to(size: int, target: int) -> int:
    return max(d for d in range(1, target + 1) if size % d == 0)


def demo_reference(mean_of_senders: bool = True) -> tuple[dict, dict]:
    """DeMo's step for every replica, from their gradients: per step, w <- w (1 - lr wd); delta <- decay delta +
    lr g; the tiles' (h x w, each side the largest divisor of its dimension up to the chunk) 2-D DCT; the top-k
    magnitudes of each tile sent and subtracted from delta (inverse DCT); each coefficient decoded as the mean over
    the replicas that sent it (torch's scatter_reduce "mean" without self, DeMo's own call), zero where none did;
    w <- w - lr sign(inverse DCT). `mean_of_senders=False`: the sum over replicas divided by R instead."""
    weights = demo_start()
    deltas = [{name: torch.zeros(shape) for name, shape in SHAPES.items()} for _ in range(REPLICAS)]
    for step, lr in enumerate(STEP_LRS):
        grads = [demo_gradients(rank, step) for rank in range(REPLICAS)]
        for name, shape in SHAPES.items():
            rows, cols = (1, shape[0]) if len(shape) == 1 else shape
            h, w = largest_divisor_up_to(rows, CHUNK), largest_divisor_up_to(cols, CHUNK)
            d_h, d_w = dct_reference(h), dct_reference(w)
            k = min(TOPK, h * w)

            def encode(x):  # (rows, cols) -> (tiles down, tiles across, h * w)
                return torch.einsum("yhxw,bh,dw->yxbd", x.reshape(rows // h, h, cols // w, w), d_h, d_w).reshape(
                    rows // h, cols // w, h * w)

            def decode(c):
                return torch.einsum("yxbd,bh,dw->yhxw", c.reshape(rows // h, cols // w, h, w), d_h, d_w).reshape(
                    shape)

            weights[name] = weights[name] * (1 - lr * (WD if name == "matrix" else 0.0))
            sent_indices, sent_values = [], []
            for rank in range(REPLICAS):
                deltas[rank][name] = DECAY * deltas[rank][name] + lr * grads[rank][name]
                coefficients = encode(deltas[rank][name])
                indices = coefficients.abs().topk(k, dim=-1).indices
                values = coefficients.gather(-1, indices)
                deltas[rank][name] = deltas[rank][name] - decode(
                    torch.zeros_like(coefficients).scatter_(-1, indices, values))
                sent_indices.append(indices)
                sent_values.append(values)
            indices, values = torch.cat(sent_indices, dim=-1), torch.cat(sent_values, dim=-1)
            zeros = torch.zeros(rows // h, cols // w, h * w)
            if mean_of_senders:
                combined = zeros.scatter_reduce(-1, indices, values, reduce="mean", include_self=False)
            else:
                combined = zeros.scatter_add(-1, indices, values) / REPLICAS
            weights[name] = weights[name] - lr * decode(combined).sign()
    return weights, deltas


@pytest.fixture(scope="module")
def demo_results(tmp_path_factory) -> list[dict]:
    return run_ranks(demo_worker, tmp_path_factory.mktemp("demo"), REPLICAS, 60, "FlexDeMo")


def test_flexdemo_computes_demos_step_at_three_replicas(demo_results):
    """Three replicas, three steps at three learning rates: every replica's weights are DeMo's, and each replica's
    own delta (what it did not send) too. The sum over replicas divided by R, the combine rule FlexDeMo had, would
    give other weights here (the check below that the two rules differ keeps the test able to fail)."""
    weights, deltas = demo_reference()
    for rank, result in enumerate(demo_results):
        for name in SHAPES:
            assert torch.allclose(result["weights"][name], weights[name], atol=1e-6), (rank, name)
            assert torch.allclose(result["deltas"][name], deltas[rank][name], atol=1e-6), (rank, name)
    summed, _ = demo_reference(mean_of_senders=False)
    assert any(not torch.allclose(summed[name], weights[name], atol=1e-6) for name in SHAPES)
    # Per step: the matrix's 12 tiles, the vector's 5 chunks and the prime one's 11, 5, 5 and 1 coefficients each,
    # 6 bytes per coefficient (int16 index, fp32 value), sent to 2 other replicas.
    assert demo_results[0]["sent_bytes"] == len(STEP_LRS) * (REPLICAS - 1) * 6 * (12 * 5 + 5 * 5 + 11 * 1)
