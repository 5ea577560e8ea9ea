"""Properties of `dpo_loss` (sigmoid / conservative, IPO, hinge, robust)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tokengym.agents.functional import DPO_LOSSES, dpo_loss

F64 = torch.float64
logps = st.floats(-60.0, 0.0, allow_nan=False)
betas = st.sampled_from([0.01, 0.1, 0.5, 2.0])


@st.composite
def pairs(draw, max_b=6):
    B = draw(st.integers(1, max_b))
    return [torch.tensor(draw(st.lists(logps, min_size=B, max_size=B)), dtype=F64) for _ in range(4)]


def test_dpo_hand_computed():
    # beta = 0.5, pc = -1, rc = -2, pr = -3, rr = -2
    # chosen log-ratio 1, rejected log-ratio -1 -> h = 2, z = beta*h = 1
    # sigmoid: -logsigmoid(1) = log(1 + e^-1) = 0.313262
    # ls = 0.1: 0.9*0.313262 + 0.1*log(1 + e^1) = 0.281936 + 0.131326 = 0.413262
    # ipo: (2 - 1/(2*0.5))^2 = (2 - 1)^2 = 1 ; hinge: relu(1 - 1) = 0
    # robust ls = 0.1: (0.9*0.313262 - 0.1*1.313262) / 0.8 = (0.281936 - 0.131326) / 0.8 = 0.188262
    # rewards: 0.5 * 1 = 0.5 and 0.5 * -1 = -0.5
    pc, rc, pr, rr = (torch.tensor([x], dtype=F64) for x in (-1.0, -2.0, -3.0, -2.0))
    sp1, sm1 = math.log1p(math.exp(-1)), math.log1p(math.exp(1))
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert losses.item() == pytest.approx(sp1) and ch.item() == 0.5 and rj.item() == -0.5
    assert dpo_loss(pc, pr, rc, rr, 0.5, "sigmoid", 0.1)[0].item() == pytest.approx(0.9 * sp1 + 0.1 * sm1)
    assert dpo_loss(pc, pr, rc, rr, 0.5, "ipo")[0].item() == pytest.approx(1.0)
    assert dpo_loss(pc, pr, rc, rr, 0.5, "hinge")[0].item() == 0.0
    assert dpo_loss(pc, pr, rc, rr, 0.5, "robust", 0.1)[0].item() == pytest.approx((0.9 * sp1 - 0.1 * sm1) / 0.8)


@given(st.lists(logps, min_size=1, max_size=6), st.lists(logps, min_size=6, max_size=6), betas, st.sampled_from([0.0, 0.2, 0.45]))
def test_policy_equals_reference_gives_log2(chosen, rejected, beta, ls):
    pc = torch.tensor(chosen, dtype=F64)
    pr = torch.tensor(rejected[: len(chosen)], dtype=F64)
    losses, ch, rj = dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=beta, label_smoothing=ls)
    torch.testing.assert_close(losses, torch.full_like(pc, math.log(2)))
    assert torch.all(ch == 0) and torch.all(rj == 0)


@given(pairs(), betas)
def test_sigmoid_gradient_closed_form(p, beta):
    """d loss / d pc = -beta * sigmoid(r_rejected - r_chosen) and d loss / d pr = its negation."""
    pc, pr, rc, rr = p
    pc, pr = pc.clone().requires_grad_(), pr.clone().requires_grad_()
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
    losses.sum().backward()
    expected = -beta * torch.sigmoid(rj - ch)
    torch.testing.assert_close(pc.grad, expected)
    torch.testing.assert_close(pr.grad, -expected)


@given(pairs(), betas)
def test_rewards_and_variants(p, beta):
    pc, pr, rc, rr = p
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
    torch.testing.assert_close(ch, beta * (pc - rc))
    torch.testing.assert_close(rj, beta * (pr - rr))
    z = beta * ((pc - rc) - (pr - rr))
    torch.testing.assert_close(losses, -F.logsigmoid(z))
    # robust with no label noise is plain DPO
    assert torch.equal(dpo_loss(pc, pr, rc, rr, beta, "robust", 0.0)[0], losses)
    hinge = dpo_loss(pc, pr, rc, rr, beta, "hinge")[0]
    assert torch.all(hinge[z >= 1] == 0)
    torch.testing.assert_close(hinge[z < 1], (1 - z)[z < 1])
    h = (pc - rc) - (pr - rr)
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, beta, "ipo")[0], (h - 1 / (2 * beta)) ** 2)


@given(pairs(), betas, st.sampled_from([0.05, 0.2, 0.45]))
def test_label_smoothing_formulas(p, beta, ls):
    pc, pr, rc, rr = p
    z = beta * ((pc - rc) - (pr - rr))
    cdpo = dpo_loss(pc, pr, rc, rr, beta, "sigmoid", ls)[0]
    torch.testing.assert_close(cdpo, -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z))
    robust = dpo_loss(pc, pr, rc, rr, beta, "robust", ls)[0]
    torch.testing.assert_close(robust, ((1 - ls) * -F.logsigmoid(z) + ls * F.logsigmoid(-z)) / (1 - 2 * ls))
    # unbiasedness: averaging the robust loss over a label flip with probability ls recovers the
    # clean loss: (1-ls)*robust(z) + ls*robust(-z) = -logsigmoid(z)
    flipped = dpo_loss(pr, pc, rr, rc, beta, "robust", ls)[0]
    torch.testing.assert_close((1 - ls) * robust + ls * flipped, -F.logsigmoid(z))


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.5, 2.0])
def test_ipo_minimiser_is_half_inverse_beta_margin(beta):
    pc = torch.zeros(1, dtype=F64, requires_grad=True)
    zeros = torch.zeros(1, dtype=F64)
    opt = torch.optim.SGD([pc], lr=0.25)
    for _ in range(200):
        opt.zero_grad()
        dpo_loss(pc, zeros, zeros, zeros, beta=beta, loss_type="ipo")[0].sum().backward()
        opt.step()
    assert pc.item() == pytest.approx(1 / (2 * beta), rel=1e-9)  # h = pc here
    # and a grid search agrees
    hs = torch.linspace(0, 1 / beta, 2001, dtype=F64)
    losses = dpo_loss(hs, torch.zeros_like(hs), torch.zeros_like(hs), torch.zeros_like(hs), beta, "ipo")[0]
    assert hs[losses.argmin()].item() == pytest.approx(1 / (2 * beta), abs=1 / beta / 2000)


def test_dpo_rewards_detached_losses_differentiable():
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    losses, ch, rj = dpo_loss(pc, torch.tensor([-3.0, -1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0]))
    assert losses.shape == (2,) and losses.requires_grad
    assert not ch.requires_grad and not rj.requires_grad


def test_dpo_validation_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=-1.0)
    for ls in [-0.1, 0.5, 0.7]:
        with pytest.raises(ValueError, match="label_smoothing"):
            dpo_loss(x, x, x, x, label_smoothing=ls)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="'sigmoid'.*'ipo'.*'hinge'.*'robust'"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        dpo_loss(x, torch.zeros(2), x, x)
    assert set(DPO_LOSSES) == {"sigmoid", "ipo", "hinge", "robust"}
