"""Operations a script applies to the whole model after initialize(), compared with PyTorch on
the plain model: changing its structure as fine-tuning scripts do (Note [Parameters added after
initialize()] in added_params.py) and share_memory()."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar

CONFIG = {"default_chunk_size": 2048, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh())
        self.norm = nn.BatchNorm1d(32)  # (after Tanh: no bias whose gradient it cancels)
        self.classifier = nn.Linear(32, 4)

    def forward(self, x):
        return self.classifier(self.norm(self.body(x)))


def make():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(Net, config=CONFIG)
    torch.manual_seed(0)
    reference = Net()
    return model, optimizer, reference, torch.optim.Adam(reference.parameters(), lr=1e-2)


def step(model, optimizer, seed) -> float:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean()
    (model.backward(loss) if hasattr(model, "backward") else loss.backward())
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def assert_trains_as(model, optimizer, reference, ref_optimizer, steps=3) -> None:
    for seed in range(steps):
        assert step(model, optimizer, seed) == pytest.approx(
            step(reference, ref_optimizer, seed), rel=1e-5, abs=1e-7), seed
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def new_head(m):
    m.classifier = nn.Linear(32, 6)


def append_layer(m):
    m.body.append(nn.Linear(32, 32))


def add_module(m):
    m.add_module("extra", nn.Linear(32, 32))


def register_parameter(m):
    m.register_parameter("gain", nn.Parameter(torch.ones(4)))


def replace_layer(m):
    m.body[2] = nn.Linear(32, 32)


def into_a_new_container(m):
    m.body.append(nn.Sequential())  # no parameters: accepted
    m.body[4].append(nn.Linear(32, 32))


@pytest.mark.parametrize("change, added", [
    (new_head, r"Net.classifier = Linear\(...\) \(as 'module.classifier'\).*"
               r"'module.classifier.weight' \(6, 32\), 'module.classifier.bias' \(6,\)"),
    (append_layer, r"Sequential.4 = Linear\(...\) \(as 'module.body.4'\)"),
    (add_module, r"Net.extra = Linear\(...\) \(as 'module.extra'\)"),
    (register_parameter, r"Net.gain = <new parameter> \(as 'module.gain'\).*'module.gain' \(4,\)"),
    (replace_layer, r"Sequential.2 = Linear\(...\) \(as 'module.body.2'\)"),
    (into_a_new_container, r"'module.body.4.0.weight' \(32, 32\)"),
], ids=lambda v: getattr(v, "__name__", "message"))
def test_new_trainable_parameters_after_initialize_raise_at_once_naming_model_func(change,
                                                                                   added):
    """A new head or layer after initialize() computed in the forward but was never trained
    (the engine's optimizer was built over the chunks' parameters), without a word."""
    model, optimizer, reference, ref_optimizer = make()
    assert_trains_as(model, optimizer, reference, ref_optimizer, steps=1)
    with pytest.raises(ValueError, match=added + r".*never be trained.*inside model_func"):
        change(model.module)
    # Nothing changed (the parameterless container of the last case aside, as in PyTorch):
    # the engine trains on as PyTorch does.
    if change is into_a_new_container:
        reference.body.append(nn.Sequential())
    assert_trains_as(model, optimizer, reference, ref_optimizer)
    change(reference)  # plain modules: torch's own


def frozen_extra(m):
    layer = nn.Linear(32, 32)
    layer.requires_grad_(False)
    m.extra = layer


def rewrap(m):
    m.body = nn.Sequential(m.body, nn.Tanh())  # the engine's own parameters, rewrapped


def identity_for_norm(m):
    del m.norm
    m.norm = nn.Identity()


@pytest.mark.parametrize("change", [
    lambda m: m.body.append(nn.ReLU()),
    lambda m: m.register_buffer("mask", torch.ones(4)),
    frozen_extra, rewrap, identity_for_norm,
], ids=["parameterless", "buffer", "frozen", "rewrap", "removed"])
def test_changes_that_add_nothing_to_train_train_as_pytorch(change):
    model, optimizer, reference, ref_optimizer = make()
    assert_trains_as(model, optimizer, reference, ref_optimizer, steps=1)
    torch.manual_seed(1)
    change(model.module)
    torch.manual_seed(1)
    change(reference)
    assert_trains_as(model, optimizer, reference, ref_optimizer)


def test_changes_inside_model_func_train_as_pytorch():
    """What the errors name: the same new head, added inside model_func."""
    def with_new_head():
        torch.manual_seed(0)
        built = Net()
        new_head(built)
        return built

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(with_new_head, config=CONFIG)
    reference = with_new_head()
    assert_trains_as(model, optimizer, reference,
                     torch.optim.Adam(reference.parameters(), lr=1e-2))


@pytest.mark.parametrize("target", ["engine", "module", "submodule"])
def test_share_memory_of_the_engines_parameters_raises_before_moving_anything(target):
    """share_memory() shared the placeholders and the buffers and returned as if the weights
    were shared: another process trained or read a copy the engine never updates."""
    model, optimizer, reference, ref_optimizer = make()
    module = {"engine": model, "module": model.module, "submodule": model.module.body}[target]
    with pytest.raises(ValueError, match=r"share_memory\(\): parameter 'module.body.0.weight'"
                                         r".*torchrun.*copy.deepcopy\(model.module\)"):
        module.share_memory()
    assert not any(buffer.is_shared() for buffer in model.buffers())
    assert_trains_as(model, optimizer, reference, ref_optimizer)
    import copy
    plain = copy.deepcopy(model.module).share_memory()  # a plain copy: torch's own
    assert all(p.is_shared() for p in plain.parameters())
    assert all(p.is_shared() for p in reference.share_memory().parameters())


@pytest.mark.parametrize("target", ["engine", "module", "submodule"])
def test_to_empty_after_initialize_raises_before_anything_changes(target):
    # Note [to_empty() after initialize()] in resting_params.py: it replaced the buffers with
    # uninitialized memory, kept the parameters and returned as if done.
    model, optimizer, reference, ref_optimizer = make()
    module = {"engine": model, "module": model.module, "submodule": model.module.norm}[target]
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"to_empty\(device='cpu'\): parameter 'module\.\w+"
                                         r".*inside model_func, before initialize"):
        module.to_empty(device="cpu")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert_trains_as(model, optimizer, reference, ref_optimizer)
    with torch.device("meta"):
        plain = Net()
    assert plain.to_empty(device="cpu").body[0].weight.device.type == "cpu"  # torch's own


def test_pickling_the_engine_names_the_call_and_what_to_save():
    """pickle.dumps(model) was refused as "(torch.save(model))", a call the script did not
    make."""
    import io
    import pickle
    model, *_ = make()
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match=r"\(torch.save\(model\) or pickle.dumps\(model\)\).*"
                                            r"torch.save\(model.module\)"):
            save(model)
    plain = pickle.loads(pickle.dumps(model.module))
    assert type(plain) is Net
    for name, tensor in model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name


@pytest.mark.parametrize("call", ["engine", "module"])
def test_unfreezing_what_was_added_frozen_raises_at_the_next_forward(call):
    """A layer added frozen is accepted; `requires_grad_(True)` on it afterwards would leave it
    untrained the same way, so the next forward (of the engine or of model.module) refuses."""
    model, optimizer, reference, ref_optimizer = make()
    for target in (model.module, reference):
        torch.manual_seed(1)
        frozen_extra(target)
        target.gain = nn.Parameter(torch.ones(32), requires_grad=False)
    model.module.extra.requires_grad_(True)
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"requires_grad_\(True\) of parameters added frozen "
                                         r"after patrickstar.initialize\(\).*"
                                         r"'module.extra.weight' \(32, 32\).*inside model_func"):
        model(x) if call == "engine" else model.module(x)
    model.module.gain.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'module.extra.weight' .*'module.gain' \(32,\)"):
        model(x)
    model.module.extra.requires_grad_(False)
    model.module.gain.requires_grad_(False)
    assert_trains_as(model, optimizer, reference, ref_optimizer)
    del model.module.extra  # gone from the model: its flag is its own again
    del reference.extra
    model.module.gain.requires_grad_(True)
    with pytest.raises(ValueError, match=r"\('module.gain' \(32,\)\)"):
        model(x)


def prune_classifier(m):
    nn.utils.prune.l1_unstructured(m.classifier, "weight", amount=0.5)


def prune_globally(m):
    nn.utils.prune.global_unstructured([(m.body[0], "weight"), (m.body[2], "weight")],
                                       pruning_method=nn.utils.prune.L1Unstructured, amount=0.3)


@pytest.mark.parametrize("prune", [prune_classifier, prune_globally],
                         ids=["l1_unstructured", "global_unstructured"])
def test_pruning_and_making_it_permanent_train_as_pytorch(prune):
    """prune.remove() assigns `weight_orig.data` outside the forward: the write was lost (the
    next forward raised about it, the pruned weights gone). global_unstructured raised about
    parameters_to_vector with autograd on; both warned about a penalty."""
    model, optimizer, reference, ref_optimizer = make()
    assert_trains_as(model, optimizer, reference, ref_optimizer, steps=1)
    with warnings.catch_warnings():  # (pruning reads values with autograd on: no penalty)
        warnings.simplefilter("error", UserWarning)
        for target in (model.module, reference):
            prune(target)
            prune(target)  # again: torch's PruningContainer
    assert_trains_as(model, optimizer, reference, ref_optimizer, steps=2)
    for target in (model.module, reference):
        for module in target.modules():
            if hasattr(module, "weight_mask"):
                nn.utils.prune.remove(module, "weight")
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    assert (state["body.0.weight" if prune is prune_globally else "classifier.weight"] == 0).any()
    assert_trains_as(model, optimizer, reference, ref_optimizer)
    assert isinstance(model.module.body[0].weight, nn.Parameter)


def test_a_trainable_module_set_on_the_engine_itself_raises_too():
    """`model.proj = nn.Linear(...)` on the engine (used as `model.proj(model(x))`) was never
    trained either."""
    model, optimizer, reference, ref_optimizer = make()
    with pytest.raises(ValueError, match=r"PatrickStarEngine.proj = Linear\(...\) \(as 'proj'\)"
                                         r".*'proj.weight' \(4, 4\).*inside model_func"):
        model.proj = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"PatrickStarEngine.scale = <new parameter> \(as "
                                         r"'scale'\)"):
        model.register_parameter("scale", nn.Parameter(torch.ones(4)))
    model.tag = "run-1"  # anything else: as on any module
    assert [name for name, _ in model.named_children()] == ["module"]
    assert not list(model.named_parameters(recurse=False))
    assert_trains_as(model, optimizer, reference, ref_optimizer)


def test_converting_the_engines_precision_names_the_call_and_a_converted_copy():
    """`model.float()` of a bf16 engine was refused naming model.half(), .bfloat16() and
    .to(dtype) only, without a way to get float32 weights."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(Net, config={**CONFIG, "bf16": {"enabled": True}})
    before = model.state_dict()
    for convert in (model.float, model.double, lambda: model.to(torch.float32)):
        with pytest.raises(ValueError, match=r"precision 'bf16'.*\.float\(\), \.double\(\).*"
                                             r"nothing was converted.*"
                                             r"copy.deepcopy\(model.module\)"):
            convert()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    copied = copy_of(model).float()
    for name, tensor in before.items():
        assert torch.equal(copied.state_dict()[name], tensor.float()), name
    assert model.to("cpu") is model and model.to(torch.bfloat16) is model  # its own: no-ops


def copy_of(model):
    import copy
    return copy.deepcopy(model.module)
