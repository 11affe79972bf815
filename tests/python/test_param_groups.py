"""Param-group callables see the parameters as the model has them (issue 20, item 2): the
common recipe "decay for p.dim() >= 2, none for the rest" (nanoGPT's configure_optimizers,
many Hugging Face scripts) must split as it does on the plain model, and train like it."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar

from patrickstar.examples.gpt import GPT, synthetic_batches
from test_initialize import MLP, gpt_config


def decay_split(module: nn.Module) -> list[dict]:
    """nanoGPT's configure_optimizers: weights (2-D and up) decay; biases, norms don't."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def names_of(module: nn.Module, params) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in module.named_parameters() if id(p) in ids}


def train_gpt_alongside(reference, ref_opt, model, opt, batches, tolerance):
    """A step of the reference GPT and of the engine's on each batch; each loss within
    `tolerance`."""
    for tokens, targets in batches:
        loss = reference(tokens, targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours = model(tokens, targets)
        model.backward(ours)
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - ours.item()) < tolerance


def test_decay_recipe_splits_like_the_plain_model_and_trains_like_it():
    config = gpt_config()
    torch.manual_seed(0)
    reference = GPT(config)
    expected = [names_of(reference, group["params"]) for group in decay_split(reference)]
    assert expected[0] and expected[1]  # the model has both kinds
    ref_opt = torch.optim.AdamW(decay_split(reference), lr=1e-3, foreach=False)

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(
            lambda: GPT(config), param_groups=decay_split,
            config={"default_chunk_size": 1 << 14,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    got = [names_of(model.module, group["params"]) for group in opt.param_groups]
    assert got == expected
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # Outside the callable the parameters are placeholders again (nothing was left behind; their
    # numel() is the real one: Note [Parameters at rest]).
    with torch._C.DisableTorchFunctionSubclass():  # their own data, not what they answer
        assert all(p.data.numel() == 0 for p in model.module.parameters())
    assert all(p.numel() == p.ds_numel for p in model.module.parameters())

    train_gpt_alongside(reference, ref_opt, model, opt,
                        synthetic_batches(config, batch=4, steps=4), tolerance=1e-4)
    state = model.state_dict()
    # The attention key bias gets a gradient of rounding noise only (softmax ignores it), which
    # Adam scales up to about lr per step either way: hence atol of a few lr-sized steps / 100.
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=5e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    model.destroy()


@pytest.mark.parametrize("key, value, error, shown", [
    ("lr", None, TypeError, r"\['lr'\] is None \(NoneType\)"),
    ("lr", "1e-3", TypeError, r"\['lr'\] is '1e-3' \(str\)"),
    ("betas", 0.9, TypeError, r"\['betas'\] is 0.9: expected two numbers"),
    ("betas", (0.9, None), TypeError, r"\['betas'\] is \(0.9, None\) \(NoneType\)"),
    ("weight_decay", torch.tensor([0.1, 0.2]), TypeError, r"\['weight_decay'\] is tensor"),
    # Out of range (a schedule's NaN or negative lr, a beta of 1): the update kernel refused it
    # after the step counts had moved
    ("lr", float("nan"), ValueError, r"\['lr'\] is nan: expected a finite number >= 0"),
    ("lr", -1e-3, ValueError, r"\['lr'\] is -0.001: expected a finite number >= 0"),
    ("eps", float("inf"), ValueError, r"\['eps'\] is inf: expected a finite number >= 0"),
    ("weight_decay", -0.1, ValueError,
     r"\['weight_decay'\] is -0.1: expected a finite number >= 0"),
    ("betas", (0.9, 1.0), ValueError,
     r"\['betas'\] is \(0.9, 1.0\): expected a finite number in \[0, 1\)"),
    ("betas", (torch.tensor(float("nan")), 0.999), ValueError,
     r"\['betas'\] is \(tensor\(nan\), 0.999\)"),
])
def test_a_group_hyperparameter_the_update_cannot_take_is_named_and_changes_nothing(
        key, value, error, shown):
    """`g['lr'] = x` as users schedule it: a value the update cannot take failed inside the
    kernel with a dump of whole tensors, after the step counts had moved, and left the optimizer
    refusing every later step ("failed partway"), though nothing had been updated."""
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(MLP, config={
        "default_chunk_size": 4096, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    model.backward(model(x, y))
    saved = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(error, match=r"optimizer\.param_groups\[0\]" + shown) as error:
        opt.step()
    assert len(str(error.value)) < 300
    opt.param_groups[0][key] = saved
    opt.step()  # the same gradients, now applied
    opt.zero_grad()
    reference(x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    model.backward(model(x, y))  # and training goes on
    opt.step()
    reference(x, y).backward()
    ref_opt.step()
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)




def test_a_plain_pytorch_optimizer_state_dict_with_decay_groups_resumes_like_pytorch():
    # nanoGPT's resume: ckpt.pt from a plain PyTorch run holds torch's optimizer.state_dict(),
    # whose state is numbered in the order parameters appear in the groups (decay weights
    # first). Loading it read those numbers as the engine's parameter indices: a bias's
    # moments went to a weight ("output with shape [32] doesn't match [96, 32]") or, where the
    # shapes agreed, to the wrong parameter silently.
    config = gpt_config()
    batches = list(synthetic_batches(config, batch=4, steps=6))
    torch.manual_seed(0)
    reference = GPT(config)
    ref_opt = torch.optim.AdamW(decay_split(reference), lr=1e-3, foreach=False)
    for tokens, targets in batches[:3]:
        reference(tokens, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    saved_model, saved_opt = reference.state_dict(), ref_opt.state_dict()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(
            lambda: GPT(config), param_groups=decay_split,
            config={"default_chunk_size": 1 << 14,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    train_gpt_alongside(reference, ref_opt, model, opt, batches[3:], tolerance=1e-5)
    # And ours goes back into torch's optimizer the same way.
    ref_opt.load_state_dict(opt.state_dict())
    for ref_group, group in zip(ref_opt.state_dict()["param_groups"], opt.param_groups):
        assert ref_group["weight_decay"] == group["weight_decay"]


def test_an_optimizer_state_dict_of_other_groups_is_refused_naming_them():
    config = gpt_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(
            lambda: GPT(config), param_groups=decay_split,
            config={"default_chunk_size": 1 << 14,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    saved = opt.state_dict()
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match=r"param group 0 .* parameters"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("other, shown", [
    (lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
     r"param group 0 has no 'betas' .*'momentum'.*: it is not the state dict of an Adam"),
    (lambda params: torch.optim.AdamW(params, lr=0.5),
     r"\['decoupled_weight_decay'\] is True but config optimizer type is 'Adam'"),
    (lambda params: torch.optim.Adam(params, lr=0.5, amsgrad=True),
     r"\['amsgrad'\] is True: the PatrickStar optimizer has no amsgrad variant"),
])
def test_another_optimizers_state_dict_is_refused_and_changes_nothing(other, shown):
    """Note [Saved groups of another optimizer]. Before: SGD's state dict loaded into the
    Adam, which then trained at SGD's lr 0.5; AdamW's into an Adam config trained Adam's L2
    decay; amsgrad was dropped."""
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(MLP, config={
        "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match=r"optimizer state dict: .*" + shown):
        opt.load_state_dict(other(MLP().parameters()).state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    reference(x, y).backward()
    ref_opt.step()
    model.backward(model(x, y))
    opt.step()
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def test_a_torch_optimizers_own_param_groups_are_taken_as_they_are():
    # nanoGPT kept as it is: `optimizer = model.configure_optimizers(...)` builds a torch AdamW
    # over the built module, whose groups carry torch's own keys (foreach, fused, amsgrad,
    # maximize, capturable, differentiable, decoupled_weight_decay). Passing
    # `param_groups=optimizer.param_groups` was refused with "unknown keys"; keys that say how
    # torch runs its update, or that a variant is off, mean what ours does.
    config = gpt_config()
    torch.manual_seed(0)
    reference = GPT(config)
    ref_opt = torch.optim.AdamW(decay_split(reference), lr=1e-3, betas=(0.9, 0.95),
                                foreach=False)
    torch.manual_seed(0)
    built = GPT(config)
    torch_groups = torch.optim.AdamW(decay_split(built), lr=1e-3, betas=(0.9, 0.95)).param_groups
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(
            built, param_groups=torch_groups,
            config={"default_chunk_size": 1 << 14,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert [(g["weight_decay"], g["lr"], tuple(g["betas"])) for g in opt.param_groups] == \
        [(0.1, 1e-3, (0.9, 0.95)), (0.0, 1e-3, (0.9, 0.95))]
    train_gpt_alongside(reference, ref_opt, model, opt,
                        synthetic_batches(config, batch=4, steps=4), tolerance=1e-5)


@pytest.mark.parametrize("optimizer, options, message", [
    ("AdamW", {"amsgrad": True}, r"param_groups\[0\]\['amsgrad'\] is True"),
    ("AdamW", {"maximize": True}, r"param_groups\[0\]\['maximize'\] is True"),
    ("Adam", {}, r"param_groups\[0\]\['decoupled_weight_decay'\] is True .*'Adam'"),
])
def test_torch_group_keys_that_change_the_update_are_refused_naming_them(optimizer, options,
                                                                          message):
    module = MLP()
    groups = torch.optim.AdamW(module.parameters(), lr=1e-3, **options).param_groups
    with pytest.raises(ValueError, match=message):
        patrickstar.initialize(module, param_groups=groups,
                               config={"optimizer": {"type": optimizer, "params": {"lr": 1e-3}}})
    # Checked before placement: the module keeps its weights.
    assert all(p.numel() > 0 for p in module.parameters())


def test_trainable_parameters_left_out_of_the_groups_are_named_with_what_to_do():
    """torch trains only what its optimizer was given (an optimizer over the head alone); here
    the optimizer steps every trainable parameter, so groups leaving some out are refused. The
    message named only the first one's shape ("first has shape (64, 32)"); it names them and
    says to freeze them or give them a group."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"4 trainable parameter\(s\) are in no group: "
                                             r"'layers\.0\.weight' \(64, 32\), 'layers\.0\.bias' "
                                             r"\(64,\), 'layers\.1\.weight' \(64, 64\), \.\.\.; .*"
                                             r"requires_grad_\(False\)"):
            patrickstar.initialize(MLP, config={"default_chunk_size": 4096},
                                   param_groups=lambda m: [{"params": m.layers[2].parameters()}])


@pytest.mark.parametrize("form", ["parameters", "named_parameters", "callable"])
def test_torch_optims_parameter_forms_are_one_group_and_train_as_pytorch(form):
    """torch.optim takes an iterable of parameters (or, since torch 2.5, named parameters) as
    one group; param_groups refused both ("expected a dict with a 'params' key"), while
    DeepSpeed's model_parameters= took the first."""
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    torch.manual_seed(0)
    built = MLP()
    groups = {"parameters": built.parameters(), "named_parameters": built.named_parameters(),
              "callable": lambda module: module.parameters()}[form]
    model, opt = patrickstar.initialize(built, config={
        "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
        param_groups=groups)
    assert len(opt.param_groups) == 1
    train_alongside(reference, ref_opt, [(model, opt)], mlp_batches(2))


@pytest.mark.parametrize("group, error, shown", [
    ({"lr": "1e-3"}, TypeError, r"\['lr'\]: expected a number, got str '1e-3'"),
    ({"weight_decay": None}, TypeError, r"\['weight_decay'\]: expected a number, got NoneType"),
    ({"betas": "0.9"}, TypeError, r"\['betas'\]: expected two numbers, got '0.9'"),
    ({"betas": (0.9, 1.5)}, ValueError, r"\['betas'\]: each must be in \[0, 1\), got \(0.9, 1.5\)"),
])
def test_group_hyperparameters_given_at_initialize_are_checked_naming_them(group, error, shown):
    """A string lr failed with "'<' not supported between instances of 'str' and 'int'"; a beta
    of 1.5 (which the config's optimizer.params.betas refuses) was taken."""
    built = MLP()
    with pytest.raises(error, match=r"param_groups\[0\]" + shown):
        patrickstar.initialize(built, config={"default_chunk_size": 4096},
                               param_groups=[{"params": built.parameters(), **group}])
    assert all(p.numel() > 0 for p in built.parameters())  # refused before placement


class WithAnEmptyParameter(MLP):
    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 3))  # kept outside the chunks

    def forward(self, x, y):
        return super().forward(x, y) + self.empty.sum()


def mlp_batches(count):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 32, generator=generator),
             torch.randint(0, 10, (8,), generator=generator)) for _ in range(count)]


def train_alongside(reference, ref_opt, engines, batches):
    """Steps the plain model and each (engine, optimizer) on every batch, then checks every
    engine's weights against the plain model's."""
    for x, y in batches:
        reference(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for engine, optimizer in engines:
            engine.backward(engine(x, y))
            optimizer.step()
            optimizer.zero_grad()
    for engine, _ in engines:
        state = engine.state_dict()
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def test_a_pytorch_state_dict_listing_a_parameter_without_elements_resumes_like_pytorch():
    """Note [Saved state of parameters without elements]. Before: "param group 0 has 7
    parameters, the optimizer's has 6"."""
    batches = mlp_batches(4)
    torch.manual_seed(0)
    reference = WithAnEmptyParameter()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, foreach=False)
    for x, y in batches[:2]:
        reference(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    saved_model, saved_opt = reference.state_dict(), ref_opt.state_dict()
    model, opt = patrickstar.initialize(WithAnEmptyParameter, config={
        "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    train_alongside(reference, ref_opt, [(model, opt)], batches[2:])


def test_the_engines_optimizer_state_dict_lists_a_parameter_without_elements_as_pytorch():
    """Note [Saved state of parameters without elements]: the engine's saved groups left that
    parameter out, so torch.optim.Adam(model.parameters()) of the plain model refused them
    ("a group size mismatch"); now they list it (without state) and torch resumes from the
    engine's state as from its own, and the engine from its own saved state."""
    batches = mlp_batches(4)
    config = {"default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(WithAnEmptyParameter, config=config)
    for x, y in batches[:2]:
        model.backward(model(x, y))
        opt.step()
        opt.zero_grad()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    assert [len(group["params"]) for group in saved_opt["param_groups"]] == [7]
    reference = WithAnEmptyParameter()
    reference.load_state_dict(saved_model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, foreach=False)
    ref_opt.load_state_dict(saved_opt)
    again, again_opt = patrickstar.initialize(WithAnEmptyParameter, config=config)
    again.load_state_dict(saved_model)
    again_opt.load_state_dict(saved_opt)
    train_alongside(reference, ref_opt, [(model, opt), (again, again_opt)], batches[2:])
    # Numbered and laid out as torch's own (its groups list the parameter too), moments equal.
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert len(opt.param_groups[0]["params"]) == len(ref_opt.param_groups[0]["params"])
    assert ours["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
    assert ours["state"].keys() == theirs["state"].keys()
    for number, entry in theirs["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours["state"][number][key].shape == entry[key].shape
            torch.testing.assert_close(ours["state"][number][key], entry[key], rtol=1e-4,
                                       atol=1e-7)
    # And torch's own state dict of this model (the empty parameter's state included) loads.
    again_opt.load_state_dict(ref_opt.state_dict())
    # torch.distributed.checkpoint names the saved numbers through param_groups.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(again, again_opt)
    assert optim_state["param_groups"][0]["params"] == [
        "module." + name for name, _ in reference.named_parameters()]
    set_state_dict(again, again_opt, model_state_dict=model_state, optim_state_dict=optim_state)
    model.destroy()
    again.destroy()


@pytest.mark.parametrize("torch_optimizer, config_type", [(torch.optim.Adam, "AdamW"),
                                                          (torch.optim.AdamW, "Adam")])
def test_groups_without_weight_decay_go_with_either_adam_type(torch_optimizer, config_type):
    """Without weight decay Adam and AdamW make the same update: a torch Adam's groups (its
    weight_decay is 0 by default) with an AdamW config were refused naming
    decoupled_weight_decay, and so was its state dict. Both train as the torch optimizer."""
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch_optimizer(reference.parameters(), lr=1e-2, weight_decay=0.0)
    torch.manual_seed(0)
    built = MLP()
    groups = torch_optimizer(built.parameters(), lr=1e-2, weight_decay=0.0).param_groups
    config = {"default_chunk_size": 4096, "optimizer": {"type": config_type,
                                                         "params": {"lr": 1e-3}}}
    model, opt = patrickstar.initialize(built, param_groups=groups, config=config)
    batches = mlp_batches(4)
    train_alongside(reference, ref_opt, [(model, opt)], batches[:2])
    torch.manual_seed(0)
    resumed, resumed_opt = patrickstar.initialize(MLP, config=config)
    resumed.load_state_dict(reference.state_dict())
    resumed_opt.load_state_dict(ref_opt.state_dict())
    assert resumed_opt.param_groups[0]["lr"] == 1e-2
    train_alongside(reference, ref_opt, [(model, opt), (resumed, resumed_opt)], batches[2:])


def _layer_decay_groups(module: nn.Module) -> list[dict]:
    """timm's param_groups_layer_decay: a group per layer, its own key "lr_scale"."""
    return [{"params": list(layer.parameters()), "lr_scale": 0.5 ** (2 - depth),
             "layer_id": depth} for depth, layer in enumerate(module.layers)]


def test_a_groups_own_keys_are_kept_as_torch_keeps_them():
    # Note [A group's own keys] in optimizer.py: "lr_scale" and "layer_id" were refused as
    # unknown keys, and so was the "initial_lr" every torch scheduler adds to its groups.
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(_layer_decay_groups(reference), lr=1e-2)
    torch.manual_seed(0)
    built = MLP()
    scheduled = torch.optim.AdamW(_layer_decay_groups(built), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: 1.0)  # adds "initial_lr"
    model, opt = patrickstar.initialize(built, param_groups=scheduled.param_groups, config={
        "default_chunk_size": 4096, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert [(g["lr_scale"], g["layer_id"], g["initial_lr"]) for g in opt.param_groups] == \
        [(0.25, 0, 1e-2), (0.5, 1, 1e-2), (1.0, 2, 1e-2)]
    for step, (x, y) in enumerate(mlp_batches(3)):
        for optimizer in (ref_opt, opt):  # the recipe's lr at every step
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 / (step + 1) * group["lr_scale"]
        loss = reference(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours = model(x, y)
        model.backward(ours)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(ours, loss, rtol=1e-6, atol=0)
    assert [g["lr_scale"] for g in opt.state_dict()["param_groups"]] == [0.25, 0.5, 1.0]


@pytest.mark.parametrize("key, meant", [("weight_decy", "weight_decay"), ("beta", "betas")])
def test_a_misspelt_group_key_is_refused_naming_the_key_meant(key, meant):
    built = MLP()
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: key '{key}' is not one the "
                                         rf"update reads; did you mean '{meant}'\?"):
        patrickstar.initialize(built, config={"default_chunk_size": 4096}, param_groups=[
            {"params": built.parameters(), key: 0.5}])


@pytest.mark.parametrize("given", ["param_groups", "optimizer"])
def test_a_torch_optimizers_loaded_state_goes_with_its_groups(given):
    # Note [A torch optimizer's state goes with its groups] in carried_state.py: nanoGPT's
    # resume order (configure_optimizers, optimizer.load_state_dict, then initialize where the
    # DDP wrap was) started the engine's Adam from empty state, without a word.
    config = gpt_config()
    batches = list(synthetic_batches(config, batch=4, steps=6))
    torch.manual_seed(0)
    reference = GPT(config)
    ref_opt = torch.optim.AdamW(decay_split(reference), lr=3e-3, betas=(0.9, 0.95))
    for tokens, targets in batches[:3]:
        reference(tokens, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    built = GPT(config)
    built.load_state_dict(reference.state_dict())
    resumed = torch.optim.AdamW(decay_split(built), lr=3e-3, betas=(0.9, 0.95))
    resumed.load_state_dict(ref_opt.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(
            built, param_groups=resumed if given == "optimizer" else resumed.param_groups,
            config={"default_chunk_size": 1 << 14,
                    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == \
        [3.0] * len(list(model.parameters()))
    train_gpt_alongside(reference, ref_opt, model, opt, batches[3:], tolerance=1e-5)


def test_another_optimizers_state_is_not_carried_and_says_so():
    built = MLP()
    sgd = torch.optim.SGD(built.parameters(), lr=1e-2, momentum=0.9)
    x, y = mlp_batches(1)[0]
    built(x, y).backward()
    sgd.step()
    with pytest.warns(UserWarning, match=r"SGD whose param_groups were given holds state that "
                                         r"is not Adam's \(\['momentum_buffer'\]\)"):
        model, opt = patrickstar.initialize(built, param_groups=sgd.param_groups, config={
            "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    assert len(opt.state) == 0


def test_a_config_without_an_optimizer_takes_the_torch_optimizers_type_with_its_groups():
    # nanoGPT's AdamW groups with a config that has no optimizer section were refused against
    # the default Adam ("decoupled_weight_decay is True but config optimizer type is 'Adam'");
    # DeepSpeed's optimizer= took the type from the same object.
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(decay_split(reference), lr=1e-2, betas=(0.9, 0.95))
    torch.manual_seed(0)
    built = MLP()
    groups = torch.optim.AdamW(decay_split(built), lr=1e-2, betas=(0.9, 0.95)).param_groups
    model, opt = patrickstar.initialize(built, param_groups=groups,
                                        config={"default_chunk_size": 4096})
    assert opt.decoupled_weight_decay
    train_alongside(reference, ref_opt, [(model, opt)], mlp_batches(3))
