"""The one optimiser step (rewards/training.py): sync before clipping, the synced norm clips, the reported norm is
the pre-clip one, schedules, several optimisers, checkpoint state and bad input.

Plain SGD at lr 1 makes a step's parameter change exactly minus the gradient it applied, so the tests read the
clipped gradient off the weights. Mutations seen to fail here (applied by hand, then reverted): the sync moved
after the clipping; the clip norm ignored (always inf); the schedule applied to every optimiser.
"""

import io
import math

import pytest
import torch

from tokengym.rewards.training import LR_SCHEDULES, OptimizerStep, lr_factor


def params(*values):
    return [torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for v in values]


def with_grads(ps, *grads):
    for p, g in zip(ps, grads):
        p.grad = torch.tensor(g, dtype=torch.float64)


def sgd(ps, lr=1.0):
    return torch.optim.SGD(ps, lr=lr)


def test_the_synced_gradient_is_clipped_and_its_pre_clip_norm_reported():
    """A second rank's gradient is added by ``sync``: clipping and the reported norm see the sum, not the local part."""
    ps = params([1.0, 2.0], [3.0])
    other_rank = [torch.tensor([2.0, 0.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)]
    seen = []

    def sync(group):
        seen.append([p.grad.clone() for p in group])  # what the all-reduce receives: the unclipped local gradient
        for p, g in zip(group, other_rank):
            p.grad += g

    step = OptimizerStep(sgd(ps), 1.0, max_grad_norm=1.0, sync=sync)
    before = [p.detach().clone() for p in ps]
    with_grads(ps, [1.0, 2.0], [2.0])  # local norm 3; summed over ranks [3, 2], [3]: norm sqrt(22)
    report = step.step()
    total = math.sqrt(22.0)
    assert len(seen) == 1 and torch.equal(seen[0][0], torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert float(report["grad_norm"]) == pytest.approx(total)  # pre-clip, after the sync
    applied = torch.cat([b - p.detach() for b, p in zip(before, ps)])
    want = torch.tensor([3.0, 2.0, 3.0], dtype=torch.float64) / (total + 1e-6)  # clip_grad_norm_'s coefficient
    torch.testing.assert_close(applied, want)
    assert applied.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert report["lr"] == 1.0


def test_sync_may_be_an_object_with_sync_gradients():
    class DP:
        calls = 0

        def sync_gradients(self, group):
            DP.calls += 1
            for p in group:
                p.grad *= 2

    ps = params([3.0, 4.0])
    with_grads(ps, [3.0, 4.0])
    report = OptimizerStep(sgd(ps), 1.0, sync=DP()).step()
    assert DP.calls == 1 and float(report["grad_norm"]) == pytest.approx(10.0)


@pytest.mark.parametrize("off", [None, 0.0])
def test_no_clipping_still_reports_the_norm(off):
    ps = params([30.0, 40.0])
    with_grads(ps, [30.0, 40.0])
    report = OptimizerStep(sgd(ps), 1.0, max_grad_norm=off).step()
    assert float(report["grad_norm"]) == pytest.approx(50.0)
    torch.testing.assert_close(ps[0].detach(), torch.zeros(2, dtype=torch.float64))  # the whole gradient applied


def test_gradients_under_the_norm_are_not_scaled():
    ps = params([0.3, 0.4])
    with_grads(ps, [0.3, 0.4])
    OptimizerStep(sgd(ps), 1.0, max_grad_norm=1.0).step()
    torch.testing.assert_close(ps[0].detach(), torch.zeros(2, dtype=torch.float64), atol=1e-6, rtol=0)


def test_several_optimisers_share_one_sync_clip_apart_and_only_the_first_follows_the_schedule():
    """PPO: policy and critic gradients go through one sync call; each is clipped to the norm on its own."""
    policy, critic = params([3.0, 4.0]), params([0.0, 6.0, 8.0])
    calls = []
    step = OptimizerStep([sgd(policy, 0.5), sgd(critic, 0.25)], 2.0, schedule="linear", max_grad_norm=1.0,
                         sync=lambda group: calls.append(list(group)), names=("policy_optimizer", "critic_optimizer"),
                         norm_names=("grad_norm", "critic_grad_norm"))
    assert step.set_lr(1, 4) == pytest.approx(1.5)
    assert [o.param_groups[0]["lr"] for o in step.optimizers] == [pytest.approx(1.5), 0.25]
    with_grads(policy, [3.0, 4.0])
    with_grads(critic, [0.0, 6.0, 8.0])
    report = step.step()
    assert len(calls) == 1 and [id(p) for p in calls[0]] == [id(p) for p in policy + critic]
    assert float(report["grad_norm"]) == pytest.approx(5.0) and float(report["critic_grad_norm"]) == pytest.approx(10.0)
    assert report["lr"] == pytest.approx(1.5)
    torch.testing.assert_close(policy[0].detach(), torch.tensor([3.0, 4.0], dtype=torch.float64) * (1 - 1.5 / 5), rtol=1e-6, atol=0)
    torch.testing.assert_close(critic[0].detach(), torch.tensor([0.0, 6.0, 8.0], dtype=torch.float64) * (1 - 0.25 / 10), rtol=1e-6, atol=0)


def test_schedule_values():
    ps = params([1.0])

    def lrs(total, **kw):
        step = OptimizerStep(sgd(ps), 2.0, **kw)
        return [step.set_lr(s, total) for s in range(total + 1)]

    assert lrs(4) == [2.0] * 5
    assert lrs(4, schedule="linear") == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    assert lrs(4, schedule="cosine") == pytest.approx([2.0, 1 + 2 ** -0.5, 1.0, 1 - 2 ** -0.5, 0.0])
    # warmup (1/2, 2/2 of the peak), then linear decay to min_ratio * peak over the remaining steps
    assert lrs(6, schedule="linear", warmup=2, min_ratio=0.5) == pytest.approx([1.0, 2.0, 2.0, 1.75, 1.5, 1.25, 1.0])
    assert lrs(3, schedule="constant", warmup=2, min_ratio=0.5) == pytest.approx([1.0, 2.0, 2.0, 2.0])
    assert lr_factor(10, 4, "linear") == 0.0  # past the end: stays at the end value
    assert set(LR_SCHEDULES) == {"constant", "linear", "cosine"}


def test_state_round_trips_through_a_weights_only_checkpoint():
    def make():
        ps = params([1.0, -2.0])
        return ps, OptimizerStep.adamw(ps, 0.1, 0.01, fused=False, betas=(0.9, 0.95))

    ps, step = make()
    for _ in range(2):
        step.zero_grad()
        ps[0].sum().backward()
        step.step()
    buf = io.BytesIO()
    torch.save(step.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert list(state) == ["optimizer"]
    ps2, step2 = make()
    ps2[0].data.copy_(ps[0].data)
    step2.load_state_dict({**state, "global_step": 2})  # other checkpoint keys are ignored
    for a, b in ((ps, step), (ps2, step2)):
        b.zero_grad()
        a[0].sum().backward()
        b.step()
    assert torch.equal(ps[0], ps2[0])
    assert step2.optimizers[0].defaults["betas"] == (0.9, 0.95) and not step2.optimizers[0].defaults.get("fused")
    with pytest.raises(ValueError, match="missing \\['optimizer'\\]"):
        step2.load_state_dict({"policy_optimizer": state["optimizer"]})


def test_zero_grad_sets_every_optimisers_gradients_to_none():
    a, b = params([1.0]), params([2.0])
    step = OptimizerStep([sgd(a), sgd(b)], 1.0, names=("a", "b"), norm_names=("na", "nb"))
    with_grads(a + b, [1.0], [1.0])
    step.zero_grad()
    assert a[0].grad is None and b[0].grad is None


def test_bad_input_is_named():
    ps = params([1.0])
    with pytest.raises(ValueError, match="1 optimisers but 2 names"):
        OptimizerStep(sgd(ps), 1.0, names=("a", "b"))
    with pytest.raises(ValueError, match="unknown schedule 'cosin'"):
        OptimizerStep(sgd(ps), 1.0, schedule="cosin")


def test_the_agents_see_the_same_step():
    from tokengym.agents.runtime import optim

    assert optim.OptimizerStep is OptimizerStep and optim.lr_factor is lr_factor and optim.LR_SCHEDULES is LR_SCHEDULES
