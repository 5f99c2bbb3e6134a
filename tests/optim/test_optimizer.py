"""Optimizer state: state_dict in PyTorch's structure, resuming from a checkpoint as if never
interrupted, and loading torch.optim's state, on every device."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn

rng = np.random.default_rng(20)
INPUTS = rng.standard_normal((6, 5, 3)).astype(np.float32)
TARGETS = rng.uniform(-1, 1, (6, 5, 4)).astype(np.float32)

CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", dict(lr=0.02, weight_decay=0.1)),
    ("AdamW", dict(lr=0.02)),
]


def _loss(model: Any, x: Any, y: Any) -> Any:
    """One small graph for every test here (in PyTorch's ops too): on a device with slow
    compiles, each new kernel costs more than the steps themselves."""
    return (model(x).tanh() - y).square().mean()


def _setup(device: str, name: str, kwargs: dict, seed: int) -> tuple[Any, Any, Any]:
    ag.manual_seed(seed)
    model = nn.Linear(3, 4).to(device)
    opt = getattr(ag.optim, name)(model.parameters(), **kwargs)
    sched = ag.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.8 ** epoch)
    return model, opt, sched


def _train(device: str, model: Any, opt: Any, sched: Any, steps: range) -> None:
    for k in steps:
        opt.zero_grad()
        _loss(model, ag.tensor(INPUTS[k], device=device),
              ag.tensor(TARGETS[k], device=device)).backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("name,kwargs", CASES, ids=[n for n, _ in CASES])
def test_resume_matches_an_uninterrupted_run(device: str, name: str, kwargs: dict) -> None:
    model, opt, sched = _setup(device, name, kwargs, seed=0)
    _train(device, model, opt, sched, range(6))
    expected = [p.numpy() for p in model.parameters()]

    model, opt, sched = _setup(device, name, kwargs, seed=0)
    _train(device, model, opt, sched, range(3))
    f = io.BytesIO()
    ag.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "epoch": 3}, f)
    f.seek(0)
    checkpoint = ag.load(f)
    # fresh objects with other weights and another learning rate: everything comes from the file
    model, opt, sched = _setup(device, name, {**kwargs, "lr": 0.5}, seed=1)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    sched.load_state_dict(checkpoint["scheduler"])
    _train(device, model, opt, sched, range(checkpoint["epoch"], 6))
    for got, want in zip(model.parameters(), expected):
        np.testing.assert_array_equal(got.numpy(), want)


def test_state_dict_structure(device: str) -> None:
    ag.manual_seed(4)
    model = nn.Linear(3, 4).to(device)
    opt = ag.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}],
                        lr=0.1)
    assert opt.state_dict()["state"] == {}
    for k in range(2):
        opt.zero_grad()
        _loss(model, ag.tensor(INPUTS[k], device=device),
              ag.tensor(TARGETS[k], device=device)).backward()
        opt.step()
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0], [1]]
    assert [g["lr"] for g in sd["param_groups"]] == [0.1, 0.5]
    assert sd["param_groups"][0]["betas"] == (0.9, 0.999)
    assert sorted(sd["state"]) == [0, 1]
    for index, p in enumerate((model.weight, model.bias)):
        entry = sd["state"][index]
        assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
        assert entry["step"].shape == () and entry["step"].item() == 2.0
        assert entry["exp_avg"].shape == p.shape and entry["exp_avg"].device == device
        assert np.abs(entry["exp_avg_sq"].numpy()).min() > 0

    twin_model = nn.Linear(3, 4).to(device)
    twin = ag.optim.Adam([{"params": [twin_model.weight]}, {"params": [twin_model.bias]}],
                         lr=0.3)
    with pytest.raises(ValueError, match="number of parameter groups"):
        twin.load_state_dict({"state": {}, "param_groups": sd["param_groups"][:1]})
    wrong = {"state": {0: {**sd["state"][0], "exp_avg": np.ones((3, 4), np.float32)}},
             "param_groups": sd["param_groups"]}
    with pytest.raises(ValueError, match="shape"):
        twin.load_state_dict(wrong)
    assert twin.param_groups[0]["lr"] == 0.3  # nothing changed where loading raised
    with pytest.raises(ValueError, match="AdamW"):
        ag.optim.Adam(twin_model.parameters()).load_state_dict({"state": {}, "param_groups": [
            {"params": [0, 1], "lr": 0.1, "decoupled_weight_decay": True}]})
    twin.load_state_dict(sd)
    loaded = twin.state_dict()
    for index in (0, 1):
        for key, value in sd["state"][index].items():
            np.testing.assert_array_equal(loaded["state"][index][key].numpy(), value.numpy())


def _torch_pair(torch: Any, name: str, kwargs: dict, device: str, steps: int) -> tuple:
    """torch's model and optimizer after ``steps`` steps; ours with the same weights and
    torch's optimizer state loaded."""
    torch.manual_seed(5)
    theirs = torch.nn.Linear(3, 4)
    topt = getattr(torch.optim, name)(theirs.parameters(), **kwargs)
    for k in range(steps):
        topt.zero_grad()
        _loss(theirs, torch.tensor(INPUTS[k]), torch.tensor(TARGETS[k])).backward()
        topt.step()
    ours = nn.Linear(3, 4).to(device)
    ours.load_state_dict(theirs.state_dict())
    opt = getattr(ag.optim, name)(ours.parameters(), **{**kwargs, "lr": 1.0})
    opt.load_state_dict(topt.state_dict())
    return theirs, topt, ours, opt


TORCH_CASES = [
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99))),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1)),
]


@pytest.mark.parametrize("name,kwargs", TORCH_CASES, ids=[n for n, _ in TORCH_CASES])
def test_next_step_from_a_torch_state_matches_torch(device: str, name: str,
                                                     kwargs: dict) -> None:
    torch = pytest.importorskip("torch")
    theirs, topt, ours, opt = _torch_pair(torch, name, kwargs, device, steps=3)
    assert opt.param_groups[0]["lr"] == kwargs["lr"]
    topt.zero_grad()
    _loss(theirs, torch.tensor(INPUTS[3]), torch.tensor(TARGETS[3])).backward()
    topt.step()
    _loss(ours, ag.tensor(INPUTS[3], device=device),
          ag.tensor(TARGETS[3], device=device)).backward()
    opt.step()
    for key, value in theirs.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[key].numpy(), value.numpy(), rtol=1e-5,
                                   atol=1e-6)
    if name != "SGD":  # torch's SGD keeps no step count
        assert opt.state_dict()["state"][0]["step"].item() == 4.0
        assert float(topt.state_dict()["state"][0]["step"]) == 4.0


def test_a_torch_checkpoint_file_resumes(tmp_path: Any) -> None:
    """torch.save of a model's and an optimizer's state, read by anygpu.load."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    theirs = torch.nn.Linear(3, 4)
    topt = torch.optim.AdamW(theirs.parameters(), lr=0.05)
    for k in range(2):
        topt.zero_grad()
        _loss(theirs, torch.tensor(INPUTS[k]), torch.tensor(TARGETS[k])).backward()
        topt.step()
    torch.save({"model": theirs.state_dict(), "optimizer": topt.state_dict()},
               tmp_path / "checkpoint.pt")
    checkpoint = ag.load(tmp_path / "checkpoint.pt")
    ours = nn.Linear(3, 4)
    opt = ag.optim.AdamW(ours.parameters())
    ours.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    for k in range(2, 4):
        topt.zero_grad()
        _loss(theirs, torch.tensor(INPUTS[k]), torch.tensor(TARGETS[k])).backward()
        topt.step()
        opt.zero_grad()
        _loss(ours, ag.tensor(INPUTS[k]), ag.tensor(TARGETS[k])).backward()
        opt.step()
    for key, value in theirs.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[key].numpy(), value.numpy(), rtol=1e-5,
                                   atol=1e-6)
