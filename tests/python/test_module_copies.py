"""copy.deepcopy and torch.save of the user's module and of the engine (Note [Copies of the
user's module] in module_copies.py): EMA / teacher copies, whole-module pickles."""
from __future__ import annotations

import copy
import gc
import io
import re

import pytest
import torch
from torch import nn

import patrickstar
from test_initialize import MLP
from test_module_state_dict import trained


def assert_same_weights(module: nn.Module, model) -> None:
    expected = model.state_dict()
    state = module.state_dict()
    assert list(state) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key


@pytest.mark.parametrize("source", ["module", "engine"])
def test_deepcopy_is_a_plain_module_with_the_current_weights(source):
    model, optimizer = trained()
    ema = copy.deepcopy(model.module if source == "module" else model)
    assert type(ema) is MLP
    assert_same_weights(ema, model)
    # Independent of the engine: no hooks of it, its own parameters.
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in ema.modules())
    assert not set(map(id, ema.parameters())) & set(map(id, model.parameters()))
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    torch.testing.assert_close(ema(x, y), model(x, y), rtol=0, atol=0)
    # timm's ModelEmaV2 update, then the engine trains on unaffected.
    with torch.no_grad():
        for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(ema_v * 0.9 + 0.1 * model_v)
    before = model.state_dict()
    model.backward(model(x, y))
    optimizer.step()
    after = model.state_dict()
    assert not torch.equal(after["layers.0.weight"], before["layers.0.weight"])
    assert not torch.equal(ema.state_dict()["layers.0.weight"], after["layers.0.weight"])


def test_tied_weights_stay_tied_in_the_copy():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    model, _ = patrickstar.initialize(lambda: transformers.GPT2LMHeadModel(config), config={"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    plain = copy.deepcopy(model.module)
    assert plain.lm_head.weight is plain.transformer.wte.weight
    assert plain.lm_head.weight.shape == (64, 32)
    tokens = torch.randint(0, 64, (2, 8))
    model.eval()
    plain.eval()  # dropout
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=tokens).logits,
                                   model(input_ids=tokens).logits, rtol=0, atol=0)


class LowRank(nn.Module):
    """A LoRA delta as a torch.nn.utils.parametrize parametrization (minLoRA's recipe)."""

    def __init__(self, features: int, rank: int = 2):
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, features) * 0.1)
        self.up = nn.Parameter(torch.randn(features, rank) * 0.1)

    def forward(self, weight):
        return weight + self.up @ self.down


def parametrized_mlp() -> MLP:
    built = MLP(sizes=(32, 32, 10))
    built.requires_grad_(False)
    nn.utils.parametrize.register_parametrization(built.layers[0], "weight", LowRank(32))
    built.layers[1].requires_grad_(True)
    return built


def test_deepcopy_of_parametrized_modules_has_their_own_parameters_too():
    """A LoRA merge on a plain copy (copy.deepcopy(model.module), then
    remove_parametrizations): torch gives parametrized modules a class with its own
    __deepcopy__, which copied their __dict__ as it is, so their own parameters (the bias
    beside the parametrized weight) stayed empty placeholders of shape (0,) in the copy."""
    torch.manual_seed(0)
    reference = parametrized_mlp()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(parametrized_mlp, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 4096})
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    for trained_model, opt in ((model, optimizer), (reference, torch.optim.Adam(
            [p for p in reference.parameters() if p.requires_grad], lr=1e-2))):
        loss = trained_model(x, y)
        if trained_model is model:
            model.backward(loss)
        else:
            loss.backward()
        opt.step()
    plain = copy.deepcopy(model.module)
    assert_same_weights(plain, model)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], tensor, rtol=0, atol=1e-6)
    torch.testing.assert_close(plain(x, y), reference(x, y), rtol=0, atol=1e-6)
    for merged in (plain, reference):
        nn.utils.parametrize.remove_parametrizations(merged.layers[0], "weight")
    # (the merge removes the weight property from the class, which torch's copy shares with
    # the original: the engine's module, like a plain original, cannot run after it)
    torch.testing.assert_close(plain.state_dict(), reference.state_dict(), rtol=0, atol=1e-6)


def test_torch_save_of_the_module_loads_as_a_plain_module():
    model, _ = trained()
    buffer = io.BytesIO()
    torch.save(model.module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is MLP
    assert_same_weights(loaded, model)


def test_torch_save_of_the_engine_names_what_to_save():
    model, _ = trained(steps=0)
    with pytest.raises(TypeError, match=r"torch.save\(model.module\).*save_checkpoint"):
        torch.save(model, io.BytesIO())


@pytest.mark.parametrize("how", ["copy.copy(model)", "copy.deepcopy(optimizer)",
                                 "copy.copy(optimizer)"])
def test_copying_the_engine_or_its_optimizer_names_the_call(how):
    """A copy went through pickling's __reduce_ex__ and was refused as "cannot be pickled
    (torch.save(...))", a call the user did not make."""
    model, optimizer = trained(steps=0)
    target = model if how.endswith("(model)") else optimizer
    call = copy.copy if how.startswith("copy.copy") else copy.deepcopy
    with pytest.raises(TypeError, match=re.escape(how)):
        call(target)


def test_copying_a_module_whose_engine_is_gone_says_so():
    model, optimizer = trained(steps=0)
    module = model.module
    del model, optimizer
    gc.collect()
    with pytest.raises(RuntimeError, match="engine is gone"):
        copy.deepcopy(module)
