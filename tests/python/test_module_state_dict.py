"""The user's module's own state_dict / load_state_dict (Note [The user's module's state dict]
in module_state_hooks.py): model.module.state_dict(), Hugging Face's save_pretrained through
the engine. The two-rank check is test_data_parallel.py's
test_the_users_module_state_dict_is_the_gathered_model."""
from __future__ import annotations

import gc
import io

import pytest
import torch
from torch import nn

import patrickstar
from test_initialize import MLP

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096}


def trained(config=CONFIG, steps=3):
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=generator).to(model.compute_dtype)
        model.backward(model(x, torch.randint(0, 10, (8,), generator=generator)))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("config", [CONFIG, {**CONFIG, "bf16": {"enabled": True}}])
def test_module_state_dict_holds_the_trained_values(config):
    model, _ = trained(config)
    expected = model.state_dict()
    state = model.module.state_dict()
    assert list(state) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    assert state["layers.0.weight"].shape == (64, 32)
    # A submodule's own state dict, and keep_vars (the Parameter objects themselves).
    layer = model.module.layers[1].state_dict()
    assert torch.equal(layer["weight"], expected["layers.1.weight"])
    kept = model.module.state_dict(keep_vars=True)
    assert kept["layers.0.weight"] is model.module.layers[0].weight


def test_module_load_state_dict_trains_as_the_engine_load():
    source, _ = trained()
    weights = source.state_dict()
    results = []
    for load in ("engine", "module"):
        torch.manual_seed(5)
        model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
        if load == "engine":
            model.load_state_dict(weights)
        else:
            keys = model.module.load_state_dict(weights)
            assert keys.missing_keys == [] and keys.unexpected_keys == []
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        model.backward(model(x, y))
        optimizer.step()
        results.append(model.state_dict())
    for key, tensor in results[0].items():
        assert torch.equal(results[1][key], tensor), key
    # Loaded, not the initial weights.
    assert not torch.equal(results[0]["layers.0.weight"], trained(steps=0)[0].state_dict()[
        "layers.0.weight"])


def test_module_load_state_dict_errors_speak_torch_with_real_shapes():
    model, _ = trained(steps=0)
    before = model.state_dict()
    weights = {k: v.clone() for k, v in before.items()}
    del weights["layers.2.bias"]
    keys = model.module.load_state_dict(weights, strict=False)
    assert keys.missing_keys == ["layers.2.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "layers.2.bias"'):
        model.module.load_state_dict(weights)
    weights["layers.2.bias"] = torch.zeros(11)
    with pytest.raises(RuntimeError, match=r"size mismatch for layers.2.bias: copying a param "
                                           r"with shape torch.Size\(\[11\]\) from checkpoint, "
                                           r"the shape in current model is "
                                           r"torch.Size\(\[10\]\)"):
        model.module.load_state_dict(weights)
    weights["layers.2.bias"] = before["layers.2.bias"]
    with pytest.raises(RuntimeError, match=r"assign=True\) cannot replace 'layers.0.weight'") \
            as refused:
        model.module.load_state_dict(weights, assign=True)
    assert "Missing key" not in str(refused.value)  # they were given, only not assignable
    # On the engine too (it was "got an unexpected keyword argument 'assign'").
    with pytest.raises(RuntimeError, match=r"assign=True\) cannot replace the model's "
                                           r"parameters.*load without assign"):
        model.load_state_dict(weights, assign=True)
    # assign kept the engine's parameter objects.
    assert model.module.layers[0].weight in set(model.parameters())
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[key]), key


def test_hugging_face_save_pretrained_writes_the_trained_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        lambda: transformers.GPT2LMHeadModel(config),
        config={"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 16384})
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits,
                                   model(input_ids=tokens).logits, rtol=0, atol=0)


def test_a_module_outliving_its_engine_says_so():
    model, optimizer = trained(steps=1)
    module = model.module
    del model, optimizer
    gc.collect()
    with pytest.raises(RuntimeError, match="engine is gone"):
        module.state_dict()
    model, _ = trained(steps=1)
    model.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        model.module.state_dict()


def test_plain_modules_are_untouched():
    plain = nn.Linear(3, 2)
    trained(steps=0)
    assert plain.state_dict()["weight"].shape == (2, 3)


@pytest.mark.parametrize("strict", [True, False])
def test_engine_load_state_dict_errors_are_torchs(strict):
    # The engine's load_state_dict raised a ValueError naming the first shape mismatch only
    # (after loading the parameters before it), where torch raises a RuntimeError naming every
    # missing/unexpected key and size mismatch; code catching torch's RuntimeError missed it.
    model, _ = trained()
    before = model.state_dict()
    torch.manual_seed(0)
    plain = MLP()
    bad = dict(plain.state_dict())
    del bad["layers.2.bias"]
    bad["extra"] = torch.zeros(1)
    bad["layers.1.weight"] = torch.zeros(3, 3)
    bad["layers.2.weight"] = torch.zeros(10)
    with pytest.raises(RuntimeError) as theirs:
        plain.load_state_dict(bad, strict=strict)
    with pytest.raises(RuntimeError) as ours:
        model.load_state_dict(bad, strict=strict)
    assert str(ours.value) == str(theirs.value)
    after = model.state_dict()  # nothing was loaded
    for key, value in before.items():
        assert torch.equal(after[key], value), key


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))  # 0-dim

    def forward(self, x):
        return (self.linear(x) * self.scale).sum()


@pytest.mark.parametrize("target", ["engine", "module"])
def test_state_dict_values_are_checked_as_torch_checks_them(target):
    """Note [A state dict's values, checked as torch checks them]. Before: a None value raised
    "'NoneType' object has no attribute 'dtype'" (engine) or named "shape ()" (module), a list
    "shape None", a list for the whole state dict "'list' object has no attribute 'get'", and a
    one-element 1-dim value for a 0-dim parameter, which torch loads, a size mismatch."""
    torch.manual_seed(0)
    plain = Scaled()
    model, _ = patrickstar.initialize(lambda: Scaled(), config=CONFIG)
    load = model.load_state_dict if target == "engine" else model.module.load_state_dict
    good = {key: value.clone() for key, value in plain.state_dict().items()}
    for bad in ({**good, "linear.weight": None}, {**good, "linear.bias": [0.0] * 4}):
        with pytest.raises(RuntimeError) as theirs:
            plain.load_state_dict(bad)
        with pytest.raises(RuntimeError) as ours:
            load(bad)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError) as theirs:
        plain.load_state_dict(list(good.items()))
    with pytest.raises(TypeError) as ours:
        load(list(good.items()))
    assert str(ours.value) == str(theirs.value)
    legacy = {**good, "scale": torch.tensor([3.0])}  # a 0-dim parameter saved as shape (1,)
    assert str(load(legacy)) == str(plain.load_state_dict(legacy))
    for key, value in model.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    assert plain.scale.shape == () and plain.scale.item() == 3.0


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        return self.head(self.proj(self.wte(idx))).sum()


def test_tied_weights_share_one_tensor_in_the_state_dict():
    # As in torch: one storage under both names, so torch.save writes it once (it wrote the
    # embedding twice: a larger file and twice the memory when loaded).
    torch.manual_seed(0)
    reference = TiedLM()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(TiedLM, config=CONFIG)
    for state in (model.state_dict(), model.module.state_dict()):
        assert list(state) == list(reference.state_dict())
        assert state["wte.weight"].data_ptr() == state["head.weight"].data_ptr()
        assert torch.equal(state["head.weight"], reference.head.weight)
        ours, theirs = io.BytesIO(), io.BytesIO()
        torch.save(state, ours)
        torch.save(reference.state_dict(), theirs)
        assert len(ours.getvalue()) == len(theirs.getvalue())
    # Another call reads again: a later step's values, not the earlier tensor.
    first = model.state_dict()
    model.load_state_dict({k: v + 1 for k, v in first.items()})
    second = model.state_dict()
    assert torch.equal(second["head.weight"], first["head.weight"] + 1)
    assert second["head.weight"].data_ptr() != first["head.weight"].data_ptr()


def frozen_first_layer():
    module = MLP()
    module.layers[0].requires_grad_(False)
    return module


def test_keep_vars_gives_the_parameters_themselves_as_pytorch():
    """Note [keep_vars gives the parameters themselves] in engine.py: the trainable-weights
    filter of fine-tuning scripts picks what it picks on the plain model, and the entries
    hold the trained values."""
    torch.manual_seed(0)
    reference = frozen_first_layer()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(frozen_first_layer, config=CONFIG)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    model.backward(model(x, y))
    optimizer.step()
    values = model.state_dict()
    for state in (model.state_dict(keep_vars=True), model.state_dict(keep_vars=True, prefix="m.")):
        prefix = "m." if "m.layers.0.weight" in state else ""
        expected = reference.state_dict(keep_vars=True, prefix=prefix)
        assert list(state) == list(expected)
        assert ({k for k, v in state.items() if v.requires_grad}
                == {k for k, v in expected.items() if v.requires_grad}
                == {prefix + k for k in ("layers.1.weight", "layers.1.bias", "layers.2.weight",
                                         "layers.2.bias")})
        own = dict(model.module.named_parameters(prefix=prefix.rstrip(".")))
        for key, value in state.items():
            assert isinstance(value, nn.Parameter) == isinstance(expected[key], nn.Parameter)
            assert value is own[key]
            assert torch.equal(value.detach(), values[key[len(prefix):]])
    buffer = io.BytesIO()
    torch.save(model.state_dict(keep_vars=True), buffer)
    buffer.seek(0)
    for key, value in torch.load(buffer, weights_only=True).items():
        assert torch.equal(value, values[key]), key


@pytest.mark.parametrize("into", ["itself", "its module", "another engine"])
def test_an_engines_own_parameters_load_as_values(into):
    """torch's `m.load_state_dict(m.state_dict(keep_vars=True))` (or another model's
    parameters) copies their values; the engine's read placeholders in chunks it was
    writing and failed with an illegal chunk state transition."""
    source, _ = trained()
    values = source.state_dict()
    kept = source.module.state_dict(keep_vars=True)
    if into == "another engine":
        target, _ = patrickstar.initialize(MLP, config=CONFIG)
    else:
        target = source if into == "itself" else source.module
    assert target.load_state_dict(kept) == nn.modules.module._IncompatibleKeys([], [])
    loaded = (target if into != "its module" else source).state_dict()
    for key, value in values.items():
        assert torch.equal(loaded[key], value), key


class Normed(nn.Module):
    """A BatchNorm (its `_load_from_state_dict` fills in `num_batches_tracked`) whose head
    renames an older checkpoint's key in a load pre-hook, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)
        self.head._register_load_state_dict_pre_hook(self._renamed)

    @staticmethod
    def _renamed(state_dict, prefix, *args):
        if prefix + "kernel" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "kernel")

    def forward(self, x):
        return self.head(self.norm(self.linear(x))).sum()


def test_the_engines_load_runs_the_modules_own_loading_as_pytorch():
    """Note [The engine's load_state_dict is torch's, all or nothing]: before, the engine's
    load_state_dict skipped the modules' load hooks and `_load_from_state_dict`, and refused
    both state dicts torch loads ("Missing key(s)")."""
    torch.manual_seed(1)
    source = Normed()
    older = {key: value.clone() for key, value in source.state_dict().items()
             if "num_batches_tracked" not in key}  # a dict without torch's version metadata
    older["head.kernel"] = older.pop("head.weight")
    torch.manual_seed(0)
    plain = Normed()
    model, _ = patrickstar.initialize(Normed, config=CONFIG)
    log = {}
    for name, target in (("torch", plain), ("engine", model)):
        module = target if name == "torch" else model.module
        entries = log[name] = []
        module.norm.register_load_state_dict_post_hook(
            lambda mod, keys, entries=entries: entries.append(list(keys.missing_keys)))
        assert str(target.load_state_dict(dict(older))) == "<All keys matched successfully>"
    assert log["engine"] == log["torch"] == [[]]
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(model.state_dict()["head.weight"], source.head.weight)


def test_state_dict_hooks_on_the_engine_itself_run_as_on_the_plain_model():
    """Note [Hooks on the engine itself] in engine.py: registered on the engine they were
    accepted and never ran."""
    torch.manual_seed(0)
    plain = MLP()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, config=CONFIG)
    logs, saved = {}, {}
    for name, target in (("torch", plain), ("engine", model)):
        log = logs[name] = []
        target.register_state_dict_pre_hook(
            lambda module, prefix, keep_vars, log=log: log.append(("pre", prefix, keep_vars)))

        def post(module, state_dict, prefix, local_metadata, log=log):
            log.append(("post", prefix, len(state_dict)))
            state_dict[prefix + "step"] = torch.tensor(5)
        target.register_state_dict_post_hook(post)

        def renamed(module, state_dict, prefix, local_metadata, strict, *lists, log=log):
            log.append(("load pre", prefix, strict))
            state_dict.pop(prefix + "step")
            state_dict[prefix + "layers.0.bias"] = state_dict.pop(prefix + "old_bias")
        target.register_load_state_dict_pre_hook(renamed)
        target.register_load_state_dict_post_hook(
            lambda module, keys, log=log: log.append(("load post", list(keys.missing_keys))))
        saved[name] = target.state_dict()
        assert list(target.state_dict(prefix="m.")) == ["m." + key for key in saved[name]]
        older = {**saved[name], "old_bias": saved[name].pop("layers.0.bias") + 1}
        assert str(target.load_state_dict(older)) == "<All keys matched successfully>"
    assert logs["engine"] == logs["torch"]
    assert [entry[0] for entry in logs["torch"]] == ["pre", "post", "pre", "post", "load pre",
                                                     "load post"]
    assert saved["engine"]["step"] == saved["torch"]["step"] == 5
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("load", ["engine", "module"])
def test_a_load_pre_hook_registered_after_initialize_renames_keys_as_in_pytorch(load):
    """Note [The chunk writes run after the user's load pre-hooks] in module_state_hooks.py:
    the rename ran after the engine's hook took the parameters' values, and torch copied the
    renamed value into a placeholder ("size mismatch ... torch.Size([0])")."""
    def renamed(module, state_dict, prefix, *args):
        if prefix + "kernel" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "kernel")

    torch.manual_seed(0)
    plain = MLP()
    model, _ = patrickstar.initialize(MLP, config=CONFIG)
    older = {key: value + 1 for key, value in plain.state_dict().items()}
    older["layers.1.kernel"] = older.pop("layers.1.weight")
    target = model if load == "engine" else model.module
    for module in (plain, model.module):
        module.layers[1].register_load_state_dict_pre_hook(renamed)
    for _ in range(2):  # the order holds for later loads too
        assert str(target.load_state_dict(dict(older))) == str(plain.load_state_dict(dict(older)))
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


class SavesScaled(nn.Module):
    """A model that registers state_dict post-hooks while it is built (inside model_func)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

        def doubled(module, state_dict, prefix, local_metadata):
            for key in [key for key in state_dict if key.startswith(prefix)]:
                state_dict[key] = state_dict[key] * 2

        def counted(module, state_dict, prefix, local_metadata):
            state_dict[prefix + "count"] = torch.tensor(state_dict[prefix + "weight"].numel())
        self.head.register_state_dict_post_hook(doubled)
        self.head._register_state_dict_hook(counted)

    def forward(self, x):
        return self.head(self.linear(x)).sum()


def test_state_dict_post_hooks_of_the_model_see_the_values_as_in_pytorch():
    """Note [The values are read before the user's state-dict post-hooks]: they saw empty
    placeholders (a count of 0) and their changes were overwritten by the values read."""
    torch.manual_seed(0)
    plain = SavesScaled()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(SavesScaled, config=CONFIG)
    expected = plain.state_dict()
    assert expected["head.count"] == 8
    for state in (model.state_dict(), model.module.state_dict()):
        assert list(state) == list(expected)
        for key, value in expected.items():
            assert torch.equal(state[key], value), key


class ChecksLoads(nn.Module):
    """A model whose load post-hook, registered while it is built, reads the loaded weight."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen = []
        self.linear.register_load_state_dict_post_hook(
            lambda module, keys: self.seen.append(("built", module.weight.detach().sum().item())))

    def forward(self, x):
        return self.linear(x).sum()


@pytest.mark.parametrize("load", ["engine", "module"])
def test_load_post_hooks_read_the_loaded_values_as_in_pytorch(load):
    """Note [The values are read before the user's state-dict post-hooks]: a load post-hook of
    the model read placeholders (0.0), and through the engine's load, whose writes wait for
    the load to succeed, one registered later read the old values."""
    torch.manual_seed(0)
    plain = ChecksLoads()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(ChecksLoads, config=CONFIG)
    for module in (plain, model.module):
        module.linear.register_load_state_dict_post_hook(
            lambda hooked, keys, module=module: module.seen.append(
                ("later", hooked.weight.detach().sum().item())))
    target = model if load == "engine" else model.module
    for step in (1.0, 2.0):
        weights = {key: value + step for key, value in ChecksLoads().state_dict().items()}
        plain.load_state_dict(weights)
        target.load_state_dict(weights)
    assert [name for name, _ in model.module.seen] == ["built", "later"] * 2
    assert [value for _, value in model.module.seen] == pytest.approx(
        [value for _, value in plain.seen])


class KeepsExtraState(nn.Module):
    """A module with torch's extra state (get_extra_state / set_extra_state)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.note = {"calls": 0}

    def get_extra_state(self):
        return dict(self.note)

    def set_extra_state(self, state):
        self.note = dict(state)

    def forward(self, x):
        return self.linear(x).sum()


def test_the_engines_load_sets_extra_state_as_pytorch():
    """Note [The engine's load_state_dict is torch's, all or nothing]: the engine's own load
    took the extra state for a tensor ("'dict' object has no attribute 'shape'")."""
    torch.manual_seed(0)
    plain = KeepsExtraState()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(KeepsExtraState, config=CONFIG)
    state = {**plain.state_dict(), "_extra_state": {"calls": 7}}
    assert str(model.load_state_dict(state)) == str(plain.load_state_dict(state))
    assert model.module.note == plain.note == {"calls": 7}
    assert model.state_dict()["_extra_state"] == {"calls": 7}


@pytest.mark.parametrize("whose", ["engine", "module"])
def test_a_state_dict_read_inside_a_forward_hook_gives_the_weights_and_trains_on(whose):
    """Note [A state dict read inside a forward]. Before: `model.state_dict()` in a forward
    pre-hook of a layer (a debugging dump at one module) accessed that layer's parameters a
    second time and released them, and the layer's end of forward failed with "tensor
    'layers.2.weight': illegal state transition HOLD -> HOLD_AFTER_FWD"."""
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    torch.manual_seed(0)
    reference, reference_optimizer = patrickstar.initialize(MLP, config=CONFIG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    source = model if whose == "engine" else model.module
    handle = model.module.layers[2].register_forward_pre_hook(
        lambda module, inputs: seen.append(source.state_dict()))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for engine, opt in ((model, optimizer), (reference, reference_optimizer)):
        loss = engine(x, y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
    handle.remove()
    assert len(seen) == 1 and seen[0].keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(seen[0][key], value), key
    after, expected = model.state_dict(), reference.state_dict()
    for key, value in expected.items():
        assert torch.equal(after[key], value), key
