"""`optimizer.state` read out of the chunks, its entries' edits written back
(state_edits.py), and add_param_group refused (optimizer.py)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import patrickstar
from test_initialize import MLP


def test_state_matches_torch_adamw():
    data = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(3)]
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "default_chunk_size": 4096})
    assert len(optimizer.state) == 0 and optimizer.state[next(model.parameters())] == {}
    for x, y in data:
        reference(x, y).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(optimizer.state) == len(list(reference.parameters()))
    for param, ref_param in zip(model.parameters(), reference.parameters()):
        state, ref_state = optimizer.state[param], ref_optimizer.state[ref_param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == float(ref_state["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-8)
    assert list(optimizer.state) == list(model.parameters())
    with pytest.raises(TypeError, match="cannot be replaced; edit the entry"):
        optimizer.state[next(model.parameters())] = {}


def _train(model, optimizer, batches):
    for x, y in batches:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _pair(config_params=None):
    batches = [(torch.randn(8, 32, generator=torch.Generator().manual_seed(step)),
                torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(step)))
               for step in range(4)]
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                  **(config_params or {})}},
        "default_chunk_size": 4096})
    return batches, (reference, ref_optimizer), (model, optimizer)


def _edit(optimizer, params):
    """The same edits of both optimizers' state, the ways scripts write them."""
    weight, bias, weight2, bias2 = params[:4]
    optimizer.state[weight]["exp_avg"].zero_()  # the dict is dropped before the edit
    entry = optimizer.state[bias]
    entry["exp_avg_sq"] = torch.full_like(entry["exp_avg_sq"], 1e-4)
    entry["step"] = torch.tensor(1.0)
    optimizer.state[weight2].clear()  # Adam starts afresh for it
    kept = optimizer.state[bias2]["exp_avg"]
    optimizer.state[weight]  # another lookup in between
    kept.mul_(0.5)  # the tensor kept after its dict was dropped
    pruned = optimizer.state[params[4]]  # slices assigned (ReLoRA's pruning of the moments)
    pruned["exp_avg"][:3] = 0.0
    pruned["exp_avg_sq"][:3] = 0.0


def test_edits_of_state_entries_reach_the_state_as_in_torch():
    # Note [Edits of optimizer.state entries] in state_edits.py: each edit was taken silently
    # and lost (the entry was a copy), where torch's next step uses it.
    batches, (reference, ref_optimizer), (model, optimizer) = _pair()
    _train(reference, ref_optimizer, batches[:2])
    _train(model, optimizer, batches[:2])
    _edit(ref_optimizer, list(reference.parameters()))
    _edit(optimizer, list(model.parameters()))
    for param, ref_param in zip(model.parameters(), reference.parameters()):
        state, ref_state = optimizer.state[param], ref_optimizer.state[ref_param]
        assert set(state) == set(ref_state)
        for key in state:
            torch.testing.assert_close(state[key].float(), ref_state[key].float(), rtol=1e-5,
                                       atol=1e-8)
    _train(reference, ref_optimizer, batches[2:])
    _train(model, optimizer, batches[2:])
    for (name, value), ref_value in zip(model.module.state_dict().items(),
                                        reference.state_dict().values()):
        torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6, msg=name)
    saved, ref_saved = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    for number, entry in ref_saved.items():
        assert float(saved[number]["step"]) == float(entry["step"]), number


def test_reading_every_entry_keeps_no_copy_of_the_state_alive():
    batches, _, (model, optimizer) = _pair()
    _train(model, optimizer, batches[:1])
    moments = [weakref.ref(optimizer.state[param]["exp_avg"]) for param in model.parameters()]
    optimizer.step()  # the last one handed out is held until the state is next used
    gc.collect()
    assert all(moment() is None for moment in moments)


def test_an_edit_of_an_8bit_entry_by_its_scales_zeroes_the_moment():
    # README: 8-bit entries hold codes and scales; a moment is codes x scales, so zeroing its
    # scales zeroes it (zeroing the codes would not: code 0 is the map's -1).
    batches, _, (model, optimizer) = _pair({"state_dtype": "int8"})
    _train(model, optimizer, batches[:2])
    weight = next(model.parameters())
    optimizer.state[weight]["exp_avg_scale"].zero_()
    entry = optimizer.state[weight]
    values = patrickstar.moment_state.dequantize_moment("exp_avg", entry["exp_avg"],
                                                        entry["exp_avg_scale"])
    assert values.abs().max() == 0
    _train(model, optimizer, batches[2:])  # and trains on


@pytest.mark.parametrize("edit, message", [
    (lambda entry: entry.__setitem__("exp_avg", torch.zeros(3)),
     r"'layers.0.weight' of shape \(64, 32\), but its exp_avg has shape \(3,\)"),
    (lambda entry: entry.pop("exp_avg_sq"), "has no 'exp_avg_sq'"),
    (lambda entry: entry.__setitem__("momentum_buffer", torch.zeros(1)),
     r"given key\(s\) \['momentum_buffer'\]"),
    (lambda entry: entry.__setitem__("step", torch.tensor(-1.0)), "whole number >= 0")],
    ids=["shape", "missing", "unknown", "step"])
def test_an_edit_the_state_cannot_take_is_refused_and_loses_nothing(edit, message):
    batches, (reference, ref_optimizer), (model, optimizer) = _pair()
    _train(reference, ref_optimizer, batches[:2])
    _train(model, optimizer, batches[:2])
    edit(optimizer.state[next(model.parameters())])
    with pytest.raises(ValueError, match=message):
        optimizer.step()
    # The state kept its values, and training goes on as without the edit.
    _train(reference, ref_optimizer, batches[2:])
    _train(model, optimizer, batches[2:])
    for (name, value), ref_value in zip(model.module.state_dict().items(),
                                        reference.state_dict().values()):
        torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_load_replaces_the_entries_handed_out_before_it(tmp_path):
    batches, _, (model, optimizer) = _pair()
    _train(model, optimizer, batches[:2])
    saved = optimizer.state_dict()
    model.save_checkpoint(str(tmp_path), tag="t")
    weight = next(model.parameters())
    for load in (lambda: optimizer.load_state_dict(saved),
                 lambda: model.load_checkpoint(str(tmp_path), tag="t")):
        entry = optimizer.state[weight]
        entry["exp_avg"].zero_()
        load()  # as torch's load replaces its state dicts: the edit is not written after it
        optimizer.state_dict()
        torch.testing.assert_close(optimizer.state[weight]["exp_avg"],
                                   saved["state"][0]["exp_avg"], rtol=0, atol=0)


@pytest.mark.parametrize("extra, weight_keys", [
    ({"bf16": {"enabled": True}}, {"master_param"}),
    ({"bf16": {"enabled": True, "master_weights": False}, "state_dtype": "int8"},
     {"param_compensation", "compensated_param", "exp_avg_scale", "exp_avg_sq_scale"})],
    ids=["bf16", "bf16-no-master-int8-state"])
def test_each_parameters_state_is_its_state_dict_entry(extra, weight_keys):
    # As in torch, where state_dict() is built from optimizer.state: the same keys and values
    # (Note [The state view lists the state dict's keys] in optimizer.py).
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096}
    if "state_dtype" in extra:
        config["optimizer"]["params"]["state_dtype"] = extra["state_dtype"]
    config.update({key: value for key, value in extra.items() if key != "state_dtype"})
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)
    for _ in range(2):
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        model(x.bfloat16(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = optimizer.state_dict()["state"]
    for number, param in enumerate(model.parameters()):
        state = optimizer.state[param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"} | weight_keys
        assert state.keys() == saved[number].keys()
        for key, value in state.items():
            assert torch.equal(value, saved[number][key]), (number, key)
    model.destroy()


def test_add_param_group_after_initialize_is_refused():
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    with pytest.raises(ValueError, match=r"param_groups=\.\.\."):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(optimizer.param_groups) == 1


def test_pickling_the_optimizer_names_what_to_save():
    import io
    _, optimizer = patrickstar.initialize(MLP, config={"default_chunk_size": 4096})
    with pytest.raises(TypeError, match=r"optimizer.state_dict\(\)"):
        torch.save(optimizer, io.BytesIO())
