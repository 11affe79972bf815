"""torch.optim.Optimizer's API on the engine's optimizer, against torch's AdamW: its hooks
(Note [Optimizer state-dict hooks] in optimizer.py) and step(closure)."""
from __future__ import annotations

import pytest
import torch

import patrickstar
from test_initialize import MLP

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "default_chunk_size": 4096}


def pair():
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01,
                                      foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    return reference, ref_optimizer, model, optimizer


def hooked(optimizer, log: list):
    """A script's own entry added to the saved dict and taken back out before the load."""
    def saved_extra(opt, state_dict):
        log.append(("state_dict post", sorted(state_dict)))
        return {**state_dict, "epoch": 7}

    def took_extra(opt, state_dict):
        log.append(("load pre", state_dict.pop("epoch")))

    optimizer.register_state_dict_pre_hook(lambda opt: log.append(("state_dict pre",)))
    optimizer.register_state_dict_post_hook(saved_extra)
    optimizer.register_load_state_dict_pre_hook(took_extra)
    optimizer.register_load_state_dict_post_hook(lambda opt: log.append(("load post",)))


def test_state_dict_hooks_run_and_change_the_dict_as_in_pytorch():
    reference, ref_optimizer, model, optimizer = pair()
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    reference(x, y).backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    model.backward(model(x, y))
    optimizer.step()
    optimizer.zero_grad()
    logs = {}
    for name, opt in (("torch", ref_optimizer), ("engine", optimizer)):
        log = logs[name] = []
        hooked(opt, log)
        saved = opt.state_dict()
        assert saved["epoch"] == 7
        opt.load_state_dict(saved)
        assert saved["epoch"] == 7  # the load's pre-hook changed a shallow copy
    # The engine's dict also carries its loss scaler's state.
    logs["engine"][1] = ("state_dict post", [k for k in logs["engine"][1][1] if k != "loss_scaler"])
    assert logs["engine"] == logs["torch"] == [
        ("state_dict pre",), ("state_dict post", ["param_groups", "state"]), ("load pre", 7),
        ("load post",)]
    # The round trip kept the state: both train on alike.
    for _ in range(2):
        loss = reference(x, y)
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ours = model(x, y)
        model.backward(ours)
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(ours, loss, rtol=1e-5, atol=1e-6)


def test_step_hooks_run_around_the_step_as_in_pytorch():
    reference, ref_optimizer, model, optimizer = pair()
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    logs = {}
    for name, opt, run in (("torch", ref_optimizer, reference), ("engine", optimizer, model)):
        log = logs[name] = []
        first = next(iter(run.parameters()))
        def record(when, log=log, opt=opt, first=first):
            def hook(hooked, args, kwargs):
                with torch.no_grad():
                    log.append((when, hooked is opt, len(args), kwargs, first.sum().item()))
            return hook

        opt.register_step_pre_hook(record("pre"))
        opt.register_step_post_hook(record("post"))
        loss = run(x, y)
        loss.backward()
        opt.step()
    assert [entry[:4] for entry in logs["engine"]] == [entry[:4] for entry in logs["torch"]]
    assert [entry[:2] for entry in logs["torch"]] == [("pre", True), ("post", True)]
    for ours, theirs in zip(logs["engine"], logs["torch"]):  # the weights before and after
        assert abs(ours[4] - theirs[4]) < 1e-5


def test_step_with_a_closure_trains_as_pytorch():
    """torch's documented closure: it zeroes the gradients, re-evaluates the loss, calls
    backward and returns the loss, which step() returns."""
    reference, ref_optimizer, model, optimizer = pair()
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,),
                                                                    generator=generator)
        losses = []
        for run, opt, backward in ((reference, ref_optimizer, lambda loss: loss.backward()),
                                   (model, optimizer, model.backward)):
            def closure(run=run, opt=opt, backward=backward):
                opt.zero_grad()
                loss = run(x, y)
                backward(loss)
                return loss
            losses.append(opt.step(closure))
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_groups_show_torchs_keys_and_refuse_a_variant_set_in_training():
    """Note [torch.optim's own group keys] in optimizer.py: the groups lacked torch's AdamW keys
    (`param_groups[0]["maximize"]` a KeyError), and `maximize` set during training was
    ignored."""
    reference, _, model, optimizer = pair()
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for ours, theirs in ((optimizer.defaults, plain.defaults),
                         (optimizer.param_groups[0], plain.param_groups[0]),
                         (optimizer.state_dict()["param_groups"][0],
                          plain.state_dict()["param_groups"][0])):
        assert set(ours) == set(theirs)
        assert {k: v for k, v in ours.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"}
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    model.backward(model(x, y))
    before = model.state_dict()
    optimizer.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match=r"optimizer.param_groups\[0\]\['maximize'\] is True.*"
                                         r"no maximize variant.*nothing was updated"):
        optimizer.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    optimizer.param_groups[0]["maximize"] = False
    optimizer.step()  # the step can be made once it is fixed
    assert not torch.equal(model.state_dict()["layers.0.weight"], before["layers.0.weight"])


def assert_same_weights(reference, model):
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("case", ["all, fresh", "some, fresh", "after a backward",
                                  "then zero_grad", "then zero_grad(set_to_none=False)",
                                  "then a backward"])
def test_zeros_set_by_hand_before_the_first_step_step_as_in_pytorch(case):
    # Before: zeros set by hand where the optimizer had no state became an empty gradient
    # (torch.distributed.checkpoint's mark), so a step at lr 1e-2 changed nothing where torch's
    # AdamW applies its weight decay and makes each parameter's state, step 1 (Note [Zeros set
    # by hand before the first step] in optimizer.py); after a backward the backward's
    # gradient was applied instead of the zeros, and a backward after them failed.
    reference, ref_optimizer, model, optimizer = pair()
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for net, opt in ((reference, ref_optimizer), (model, optimizer)):
        if case == "after a backward":
            net(x, y).backward()
        params = list(net.parameters())
        for param in params[:2] if case == "some, fresh" else params:
            param.grad = torch.zeros_like(param)
        if case.startswith("then zero_grad"):
            opt.zero_grad(set_to_none=case == "then zero_grad")
        if case == "then a backward":  # failed on torch's bare size error (0 vs 32)
            net(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert_same_weights(reference, model)
    ref_steps = [ref_optimizer.state[p].get("step") for p in reference.parameters()]
    steps = [optimizer.state[p].get("step") for p in model.parameters()]
    assert [None if s is None else float(s) for s in steps] == [
        None if s is None else float(s) for s in ref_steps]
    assert any(s is not None for s in ref_steps) != (case == "then zero_grad")
