"""The plain PyTorch checkpoint idiom: `torch.save({"model": model.state_dict(), "optimizer":
optimizer.state_dict()}, path)`, then in a new engine `load_state_dict` both and go on. As
with torch.optim over fp32 parameters, the losses after the resume equal an uninterrupted
run's bit for bit, in every precision: the optimizer's state dict carries what 16-bit
`model.state_dict()` values cannot (Note [Master weights in the optimizer's state dict] in
optimizer.py)."""
from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

import patrickstar
from test_initialize import MLP

BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "default_chunk_size": 4096}
CONFIGS = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2}},
    "bf16": {"bf16": {"enabled": True}},
    "bf16-int8-state": {"bf16": {"enabled": True}, "state_dtype": "int8"},
    "bf16-no-master": {"bf16": {"enabled": True, "master_weights": False}},
    "bf16-no-master-int8-state": {"bf16": {"enabled": True, "master_weights": False},
                                  "state_dtype": "int8"},
}


def config(name: str) -> dict:
    result = {**BASE, "optimizer": {"type": "AdamW", "params": dict(BASE["optimizer"]["params"])}}
    for key, value in CONFIGS[name].items():
        if key == "state_dtype":
            result["optimizer"]["params"]["state_dtype"] = value
        else:
            result[key] = value
    return result


def build(name: str):
    torch.manual_seed(0)
    return patrickstar.initialize(MLP, config=config(name))


def batch(step: int, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 32, generator=generator).to(dtype),
            torch.randint(0, 10, (8,), generator=generator))


def train(model, optimizer, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*batch(step, model.compute_dtype))
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def saved(model, optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def resumed(name: str, checkpoint: bytes, steps, optimizer_first: bool = False):
    model, optimizer = build(name)
    state = torch.load(io.BytesIO(checkpoint), map_location="cpu")
    if optimizer_first:
        optimizer.load_state_dict(state["optimizer"])
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scale = optimizer.loss_scale
    losses = train(model, optimizer, steps)
    final = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer
    gc.collect()
    return losses, scale, final


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_save_of_both_state_dicts_resumes_bit_for_bit(name):
    model, optimizer = build(name)
    train(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    scale = optimizer.loss_scale
    expected = train(model, optimizer, range(4, 12))
    expected_final = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer
    gc.collect()
    losses, loaded_scale, final = resumed(name, checkpoint, range(4, 12))
    assert loaded_scale == scale
    assert losses == expected
    # 16-bit losses and weights round away small differences; the fp32 moments do not.
    assert_same_state(final, expected_final)


def assert_same_state(ours: dict, expected: dict) -> None:
    for key, value in expected["model"].items():
        assert torch.equal(ours["model"][key], value), key
    for index, entry in expected["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["optimizer"]["state"][index][key], value), (index, key)


@pytest.mark.parametrize("name", ["fp16", "bf16", "bf16-int8-state", "bf16-no-master",
                                  "bf16-no-master-int8-state"])
def test_loading_the_optimizer_before_the_model_resumes_the_same(name):
    # In torch the two loads are independent. model.load_state_dict wrote the masters from the
    # 16-bit weights after the optimizer's load had restored them; weights equal to what the
    # masters round to now leave them (Note [Loading the weights the model has]). Without
    # masters the optimizer's entries carry the bf16 weights their compensations belong to
    # (Note [The weights a compensation belongs to] in optimizer.py): the compensation was
    # zeroed by the model's load that followed.
    model, optimizer = build(name)
    train(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    expected = train(model, optimizer, range(4, 12))
    expected_final = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer
    gc.collect()
    losses, _, final = resumed(name, checkpoint, range(4, 12), optimizer_first=True)
    assert losses == expected
    assert_same_state(final, expected_final)


def test_the_models_own_state_dict_loads_as_a_no_op():
    # torch: model.load_state_dict(model.state_dict()) changes nothing. In bf16 it rounded the
    # fp32 masters to the bf16 weights.
    model, optimizer = build("bf16")
    train(model, optimizer, range(3))
    before = optimizer.state_dict()
    model.load_state_dict(model.state_dict())
    after = optimizer.state_dict()
    for index, entry in before["state"].items():
        assert torch.equal(after["state"][index]["master_param"], entry["master_param"]), index
    # Other weights still replace the masters.
    weights = {key: value + 1 for key, value in model.state_dict().items()}
    model.load_state_dict(weights)
    master = optimizer.state_dict()["state"][0]["master_param"]
    assert torch.equal(master, weights["layers.0.weight"].float())


@pytest.mark.parametrize("name, flatten", [
    ("fp32", False), ("bf16", False), ("bf16-no-master", False),
    ("bf16-no-master-int8-state", False), ("bf16", True), ("bf16-no-master-int8-state", True)])
def test_torch_distributed_checkpoint_resumes_bit_for_bit(name, flatten, tmp_path):
    # FSDP2's idiom: get_state_dict(model, optimizer) names the optimizer's parameters by their
    # fully qualified names; dcp.save / dcp.load; set_state_dict. Our load read the names as
    # numbers ("invalid literal for int() ... 'module.layers.0.weight'"), and on a new engine
    # get_state_dict failed ("optimizer.step() called before model.backward(loss)").
    # torchtitan's options, flatten_optimizer_state_dict=True: the load rebuilds each entry from
    # the keys of optimizer.state[p], which lacked the masters and compensations (Note [The
    # state view lists the state dict's keys] in optimizer.py): the losses of 4 steps were
    # still equal, the masters and compensations after them not.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, optimizer = build(name)
    train(model, optimizer, range(4))
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if flatten:
        assert "state.module.layers.0.weight.exp_avg" in optimizer_state
    else:
        assert "module.layers.0.weight" in optimizer_state["state"]
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp_path)
    expected = train(model, optimizer, range(4, 8))
    expected_final = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer, model_state, optimizer_state
    gc.collect()

    model, optimizer = build(name)  # a new engine: get_state_dict steps it to make its state
    # (Note [The state-initializing step of torch.distributed.checkpoint] in optimizer.py)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    assert all(param.grad is None for param in model.parameters())
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=options)
    assert train(model, optimizer, range(4, 8)) == expected
    # The weights and Adam state too (set_state_dict loads the optimizer before the model:
    # without masters the compensations were zeroed, Note [The weights a compensation belongs
    # to] in optimizer.py, which the losses of 4 steps did not show).
    assert_same_state(torch.load(io.BytesIO(saved(model, optimizer))), expected_final)


@pytest.mark.parametrize("name", ["fp32", "bf16-no-master-int8-state"])
def test_loading_a_state_dict_saved_before_the_first_step_starts_adam_afresh(name):
    # Note [Loading a state dict without a parameter's state] in optimizer.py: torch's load
    # replaces the state, so parameters the saved dict has no state for start Adam again (step
    # 1, zero moments); ours kept the moments and step counts of the steps before the load.
    model, optimizer = build(name)
    initial = saved(model, optimizer)
    train(model, optimizer, range(3))
    state = torch.load(io.BytesIO(initial))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    assert not optimizer.state_dict()["state"] and not optimizer.state
    losses = train(model, optimizer, range(3, 6))
    final = torch.load(io.BytesIO(saved(model, optimizer)))
    fresh, fresh_optimizer = build(name)  # a new engine: the same steps, bit for bit
    assert train(fresh, fresh_optimizer, range(3, 6)) == losses
    assert_same_state(final, torch.load(io.BytesIO(saved(fresh, fresh_optimizer))))
    if name == "fp32":  # and torch's AdamW doing the same
        torch.manual_seed(0)
        reference = MLP()
        torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        initial_torch = (copy.deepcopy(reference.state_dict()),
                         copy.deepcopy(torch_optimizer.state_dict()))

        def torch_steps(steps):
            for step in steps:
                reference(*batch(step, torch.float32)).backward()
                torch_optimizer.step()
                torch_optimizer.zero_grad()
        torch_steps(range(3))
        reference.load_state_dict(initial_torch[0])
        torch_optimizer.load_state_dict(initial_torch[1])
        torch_steps(range(3, 6))
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(final["model"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fp32", "bf16-no-master-int8-state"])
def test_an_empty_saved_entry_is_no_state_as_in_torch(name):
    # Note [An empty entry is no state] in optimizer.py: torch's load takes {} as a parameter
    # without state (its next step starts Adam afresh); ours raised "has no 'exp_avg'".
    model, optimizer = build(name)
    train(model, optimizer, range(3))
    checkpoint = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer
    gc.collect()
    results = []
    for entry in ({}, None):  # an empty entry, and no entry at all
        state = copy.deepcopy(checkpoint)
        if entry is None:
            del state["optimizer"]["state"][0]
        else:
            state["optimizer"]["state"][0] = entry
        model, optimizer = build(name)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        assert 0 not in optimizer.state_dict()["state"]
        results.append((train(model, optimizer, range(3, 6)),
                        torch.load(io.BytesIO(saved(model, optimizer)))))
        del model, optimizer
        gc.collect()
    assert results[0][0] == results[1][0]
    assert_same_state(results[0][1], results[1][1])
    if name == "fp32":  # torch's AdamW given the same dict
        torch.manual_seed(0)
        reference = MLP()
        reference.load_state_dict(checkpoint["model"])
        torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        state = copy.deepcopy(checkpoint["optimizer"])
        state["state"][0] = {}
        del state["loss_scaler"]
        torch_optimizer.load_state_dict(state)
        losses = []
        for step in range(3, 6):
            loss = reference(*batch(step, torch.float32))
            loss.backward()
            torch_optimizer.step()
            torch_optimizer.zero_grad()
            losses.append(loss.item())
        assert losses == pytest.approx(results[0][0], rel=1e-5)
