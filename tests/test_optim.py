"""trainer.optim.AdamW: bit-identical to torch.optim.AdamW(fused=True), step after step, whichever path its
step takes; the same state_dict both ways; and the direct call taken where it applies."""
import pytest
import torch
from torch import nn

from trainer.optim import AdamW

STEPS = 6


def model_pair(dtype, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 3)).to(dtype)
    twin = nn.Sequential(nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 3)).to(dtype)
    twin.load_state_dict(model.state_dict())
    return model, twin


def train_steps(model, optimizer, dtype, steps=STEPS, skip_grad=None, scheduler=None, closure=False):
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(5, 13, generator=generator, dtype=dtype)
        y = torch.randn(5, 3, generator=generator, dtype=dtype)

        def loss_fn():
            optimizer.zero_grad(set_to_none=True)
            loss = (model(x) - y).square().mean()
            loss.backward()
            if skip_grad is not None and step % 2:
                skip_grad(model).grad = None  # a parameter with no gradient this step
            return loss

        if closure:
            optimizer.step(loss_fn)
        else:
            loss_fn()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()


def assert_same(model, twin, optimizer, twin_optimizer):
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    state, twin_state = optimizer.state_dict(), twin_optimizer.state_dict()
    assert state["param_groups"] == twin_state["param_groups"]
    assert state["state"].keys() == twin_state["state"].keys()
    for index, entry in state["state"].items():
        assert entry.keys() == twin_state["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(value, twin_state["state"][index][key]), (index, key)


def groups(model, lr):
    first, second = model[0], model[2]
    return [{"params": first.parameters()}, {"params": second.parameters(), "lr": lr / 3, "weight_decay": 0.1}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [
    {},
    {"amsgrad": True},
    {"maximize": True, "weight_decay": 0.0},
    {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.3},
])
def test_steps_are_bit_identical_to_torchs_fused_adamw(dtype, options):
    model, twin = model_pair(dtype)
    ours = AdamW(groups(model, 1e-2), lr=1e-2, **options)
    theirs = torch.optim.AdamW(groups(twin, 1e-2), lr=1e-2, fused=True, **options)
    train_steps(model, ours, dtype, skip_grad=lambda m: m[2].bias)
    train_steps(twin, theirs, dtype, skip_grad=lambda m: m[2].bias)
    assert_same(model, twin, ours, theirs)


def test_a_scheduler_changing_lr_and_betas_every_step_is_followed():
    model, twin = model_pair(torch.float32)
    ours, theirs = AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    schedule = dict(max_lr=0.05, total_steps=STEPS, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95)
    train_steps(model, ours, torch.float32, scheduler=torch.optim.lr_scheduler.OneCycleLR(ours, **schedule))
    train_steps(twin, theirs, torch.float32, scheduler=torch.optim.lr_scheduler.OneCycleLR(theirs, **schedule))
    assert_same(model, twin, ours, theirs)


def test_a_closure_runs_torchs_step_and_returns_the_loss():
    model, twin = model_pair(torch.float32)
    ours, theirs = AdamW(model.parameters()), torch.optim.AdamW(twin.parameters(), fused=True)
    train_steps(model, ours, torch.float32, closure=True)
    train_steps(twin, theirs, torch.float32, closure=True)
    assert_same(model, twin, ours, theirs)
    x = torch.randn(2, 13)
    loss_before_the_step = model(x).sum()
    assert ours.step(lambda: model(x).sum()) == loss_before_the_step


@pytest.mark.parametrize("tensor_setting", ["lr", "betas"])
def test_tensor_lr_or_betas_run_torchs_step(tensor_setting):
    model, twin = model_pair(torch.float32)
    value = {"lr": torch.tensor(1e-2), "betas": (torch.tensor(0.9), torch.tensor(0.99))}[tensor_setting]
    ours = AdamW(model.parameters(), **{tensor_setting: value})
    theirs = torch.optim.AdamW(twin.parameters(), fused=True, **{tensor_setting: value})
    train_steps(model, ours, torch.float32)
    train_steps(twin, theirs, torch.float32)
    assert_same(model, twin, ours, theirs)


def test_checkpoints_move_between_it_and_torchs_adamw_both_ways():
    model, twin = model_pair(torch.float32)
    ours, theirs = AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    train_steps(model, ours, torch.float32, steps=3)
    train_steps(twin, theirs, torch.float32, steps=3)
    # swap the optimizers' states mid-run: each goes on from the other's
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    ours, theirs = AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    ours.load_state_dict(theirs_state)
    theirs.load_state_dict(ours_state)
    train_steps(model, ours, torch.float32, steps=3)
    train_steps(twin, theirs, torch.float32, steps=3)
    assert_same(model, twin, ours, theirs)


def test_after_the_first_step_torchs_step_is_not_called(monkeypatch):
    model, _ = model_pair(torch.float32)
    optimizer = AdamW(model.parameters())
    train_steps(model, optimizer, torch.float32, steps=1)  # creates the state, through torch's step
    calls = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda *args, **kwargs: calls.append(args))
    before = [p.detach().clone() for p in model.parameters()]
    train_steps(model, optimizer, torch.float32, steps=2)
    assert calls == []
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(state["step"].item() == 3 for state in optimizer.state.values())


def test_step_counts_stay_right_when_torchs_step_runs_between_direct_ones():
    # The direct steps add 1 to every count at once (views of one tensor); torch's step, run for a
    # closure, adds to each view; a parameter without a gradient keeps its count.
    model, twin = model_pair(torch.float32)
    ours = AdamW(groups(model, 1e-2), lr=1e-2)
    theirs = torch.optim.AdamW(groups(twin, 1e-2), lr=1e-2, fused=True)
    for optimizer, net in ((ours, model), (theirs, twin)):
        train_steps(net, optimizer, torch.float32, steps=3)
        train_steps(net, optimizer, torch.float32, steps=2, closure=True)
        train_steps(net, optimizer, torch.float32, steps=3, skip_grad=lambda m: m[0].bias)
        train_steps(net, optimizer, torch.float32, steps=2)
    assert_same(model, twin, ours, theirs)
    assert [ours.state[p]["step"].item() for p in model.parameters()] == [10, 9, 10, 10]


def test_fused_false_is_torchs_adamw_unfused():
    model, twin = model_pair(torch.float32)
    ours, theirs = AdamW(model.parameters(), fused=False), torch.optim.AdamW(twin.parameters(), fused=False)
    train_steps(model, ours, torch.float32)
    train_steps(twin, theirs, torch.float32)
    assert_same(model, twin, ours, theirs)


def test_the_trainers_adamw_is_this_one():
    from trainer import config

    cfg = config.load_config(["optim=adamw"])
    assert cfg.optim._target_ == "trainer.optim.AdamW"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_is_torchs(set_to_none):
    model, twin = model_pair(torch.float32)
    ours, theirs = AdamW(model.parameters()), torch.optim.AdamW(twin.parameters(), fused=True)
    train_steps(model, ours, torch.float32, steps=1)
    train_steps(twin, theirs, torch.float32, steps=1)
    model[2].bias.grad = None  # one parameter without a gradient
    twin[2].bias.grad = None
    ours.zero_grad(set_to_none=set_to_none)
    theirs.zero_grad(set_to_none=set_to_none)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
    assert (model[0].weight.grad is None) == set_to_none
