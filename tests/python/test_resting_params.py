"""What user code sees of the engine's parameters outside its forward and backward (Note
[Parameters at rest] in resting_params.py): reads give the values PyTorch gives, in-place
changes are refused naming the parameter, each against the same model trained in PyTorch."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.resting_params import ParameterAtRest

CHUNK = 1024
BUDGETS = [None, 4 * CHUNK * 4]  # under a budget parameters really move between uses


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(40, 16)
        self.h = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 40, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(torch.relu(self.h(self.wte(x))))


def build(budget=None, precision="fp32"):
    torch.manual_seed(0)
    reference = TiedLM()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": CHUNK}
    if budget:
        config["memory"] = {"device_budget": budget}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(TiedLM, config=config)
    return reference, ref_opt, model, opt


def batches(steps):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 40, (4, 8), generator=generator) for _ in range(steps)]


def step(net, opt, x):
    loss = net(x).float().logsumexp(-1).mean()
    (net.backward(loss) if hasattr(net, "backward") else loss.backward())
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("budget", BUDGETS)
def test_reads_outside_the_forward_give_pytorchs_values(budget):
    # Before: p.norm()/p.sum() 0, numel() 0, shape (0,), print(p) an empty tensor, numpy() of
    # shape (0,), and `lm_head.weight @ v` / allclose torch's bare size errors.
    reference, ref_opt, model, opt = build(budget)
    for x in batches(2):
        step(reference, ref_opt, x)
        step(model, opt, x)
    ours, ref = model.module, reference
    v = torch.randn(16)
    assert sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in reference.parameters()) == 40 * 16 + 16 * 16 + 16
    assert [(n.removeprefix("module."), p.shape, p.dim(), p.size(-1))
            for n, p in model.named_parameters()] == \
        [(n, p.shape, p.dim(), p.size(-1)) for n, p in reference.named_parameters()]
    for name, ref_param in reference.named_parameters():
        param = ours.get_parameter(name)
        torch.testing.assert_close(param.detach(), ref_param.detach(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(param, ref_param, rtol=1e-5, atol=1e-6)
        assert param.norm().item() == pytest.approx(ref_param.norm().item(), rel=1e-5)
        assert param.sum().item() == pytest.approx(ref_param.sum().item(), rel=1e-4, abs=1e-5)
        assert param.detach().cpu().numpy().shape == tuple(ref_param.shape)
        assert len(param) == len(ref_param)
    torch.testing.assert_close(ours.lm_head.weight @ v, ref.lm_head.weight @ v, rtol=1e-5,
                               atol=1e-5)
    assert str(ours.h.bias).startswith("Parameter containing:\ntensor([")
    assert str(ours.h.bias.detach()) == str(ref.h.bias.detach())
    with torch.no_grad():
        torch.testing.assert_close(torch.nn.utils.parameters_to_vector(model.parameters()),
                                   torch.nn.utils.parameters_to_vector(reference.parameters()))
    # Tying, gradients between backward and step, and the model trains on as PyTorch.
    assert ours.lm_head.weight is ours.wte.weight and model.lm_head.weight is model.wte.weight
    x = batches(3)[2]
    model.backward(model(x).float().logsumexp(-1).mean())
    assert ours.h.weight.grad is None  # in chunks: patrickstar.safe_get_full_grad(p)
    reference(x).float().logsumexp(-1).mean().backward()
    torch.testing.assert_close(patrickstar.safe_get_full_grad(ours.h.weight),
                               ref.h.weight.grad, rtol=1e-4, atol=1e-6)
    opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_hand_written_ema_follows_pytorchs(budget):
    # Before: `[p.clone() ...]` copied the empty placeholders and every update changed nothing.
    reference, ref_opt, model, opt = build(budget)
    ema = [p.clone().detach() for p in model.parameters()]
    data_ema = [p.data.clone() for p in model.parameters()]
    ref_ema = [p.clone().detach() for p in reference.parameters()]
    copied = copy.deepcopy(list(model.parameters()))  # also a copy of real values
    assert all(type(p) is nn.Parameter for p in copied)
    for mine, theirs in zip(copied, reference.parameters()):
        torch.testing.assert_close(mine, theirs)
    for x in batches(3):
        step(reference, ref_opt, x)
        step(model, opt, x)
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            for e, p in zip(data_ema, model.parameters()):  # the older `.data` spelling
                e.data.mul_(0.9).add_(p.data, alpha=0.1)
            torch._foreach_lerp_(ref_ema, [p.detach() for p in reference.parameters()], 0.1)
    for e, data_e, ref_e in zip(ema, data_ema, ref_ema):
        torch.testing.assert_close(e, ref_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(data_e, ref_e, rtol=1e-5, atol=1e-6)


def test_averaged_model_is_usable_as_torchs():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    reference, ref_opt, model, opt = build()
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_averaged = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for x in batches(3):
        step(reference, ref_opt, x)
        step(model, opt, x)
        averaged.update_parameters(model)
        ref_averaged.update_parameters(reference)
    x = batches(1)[0]
    torch.testing.assert_close(averaged(x), ref_averaged(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("write", [
    lambda p: p.mul_(2), lambda p: nn.init.normal_(p), lambda p: p.__setitem__(0, 0.0),
    lambda p: torch._foreach_mul_([p], 2.0),
    lambda p: p.data.copy_(torch.zeros(16, 16)),  # loading a weight by hand
    lambda p: p.detach().zero_(),  # an alias of the weight in PyTorch
])
def test_an_in_place_change_outside_the_forward_is_refused_naming_the_parameter(write):
    reference, ref_opt, model, opt = build()
    before = model.state_dict()
    with torch.no_grad(), pytest.raises(
            RuntimeError, match=r"on PatrickStar parameter 'module.h.weight' between its uses"
                                r".*summon_full_params\(writeback=True\)"):
        write(model.module.h.weight)
    for name, tensor in before.items():
        assert torch.equal(model.state_dict()[name], tensor)
    with model.summon_full_params(writeback=True), torch.no_grad():  # the remedy named
        write(model.module.h.weight)
    torch.manual_seed(0)
    with torch.no_grad():
        write(reference.h.weight)
    if write.__code__.co_names != ("nn", "init", "normal_"):
        torch.testing.assert_close(model.state_dict()["h.weight"], reference.h.weight)


def test_the_forward_and_its_hooks_see_plain_parameters_and_precision_is_kept():
    reference, ref_opt, model, opt = build(precision="bf16")
    assert all(type(p) is ParameterAtRest for p in model.parameters())
    seen = []
    model.module.h.register_forward_hook(
        lambda module, args, output: seen.append((type(module.weight), module.weight.shape)))
    step(model, opt, batches(1)[0])
    assert seen == [(nn.Parameter, torch.Size([16, 16]))]
    assert all(type(p) is ParameterAtRest for p in model.parameters())  # at rest again
    weight = model.module.h.weight
    assert weight.dtype == torch.bfloat16 and weight.detach().dtype == torch.bfloat16
    assert torch.equal(weight.detach(), model.state_dict()["h.weight"])
    with torch.no_grad():
        model(batches(1)[0])  # a forward no backward follows leaves the engine at rest
    assert all(type(p) is ParameterAtRest for p in model.parameters())


def test_reads_outside_the_forward_under_data_parallelism_on_every_rank(tmp_path):
    # Each read is a collective (as state_dict()): every rank reads the whole value.
    import os

    from test_data_parallel import launch
    from test_initialize import MLP, mlp_batches
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resting_worker.py")
    results = launch(tmp_path, 2, worker=worker)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, foreach=False)
    ema = [p.detach().clone() for p in reference.parameters()]
    for x, y in mlp_batches(2):
        reference(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for e, p in zip(ema, reference.parameters()):
            e.mul_(0.5).add_(p.detach(), alpha=0.5)
    for result in results:
        assert result["numel"] == sum(p.numel() for p in reference.parameters())
        assert result["norms"] == pytest.approx(
            [p.norm().item() for p in reference.parameters()], rel=1e-4)
        for mine, theirs in zip(result["ema"], ema):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_a_value_read_on_one_rank_only_is_served_by_the_other(tmp_path):
    # A read after a step gathers (a collective): on rank 0 alone (logging under `if rank ==
    # 0:`) it waited for the other ranks until the collective timeout; then both raised at once
    # (Note [Parameter reads agree]). Now rank 1's next forward serves it (Note [Reads on one
    # rank are served] in data_parallel.py): rank 0 gets the value every rank reads together.
    import os

    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resting_worker.py")
    results = launch(tmp_path, 2, "rank0", worker=worker)
    for result in results:
        assert "error" not in result, result.get("traceback")
    assert "lonely_norm" not in results[1]
    torch.testing.assert_close(results[0]["lonely_norm"], results[0]["every_norm"], rtol=0,
                               atol=0)
    torch.testing.assert_close(results[1]["every_norm"], results[0]["every_norm"], rtol=0,
                               atol=0)


def test_python_conversions_of_a_parameter_read_its_value():
    reference, ref_opt, model, opt = build()
    bias = model.module.h.bias
    assert float(bias[0]) == float(reference.h.bias.detach()[0])
    assert [float(v) for v in bias] == [float(v) for v in reference.h.bias.detach()]
    assert bool((bias == reference.h.bias).all())


def test_a_gradient_set_by_hand_at_rest_is_refused_unless_zero():
    # Note [Gradients set by hand at rest]: torch checked it against the placeholder ("a
    # gradient of size [16, 8] to a tensor of size [0]"); zeros (torch.distributed.checkpoint's
    # get_state_dict) become an empty gradient that its state-initializing step clears.
    _, _, model, _ = build()
    weight = model.module.h.weight
    with pytest.raises(RuntimeError, match=r"p.grad = <gradient> on PatrickStar parameter "
                                           r"'module\..*weight'.*would not be applied"):
        weight.grad = torch.ones(weight.shape)
    weight.grad = torch.zeros(weight.shape)
    assert weight.grad.numel() == 0
    weight.grad = None


@pytest.mark.parametrize("when", ["at_rest", "in_flight"])
def test_tensors_like_a_parameter_read_nothing_and_are_torchs(when):
    # Note [Tensors like a parameter at rest]: they read the value (warning at rest that it
    # carries no gradient, refused between the forward and its backward).
    reference, _, model, _ = build()
    if when == "in_flight":
        loss = model(batches(1)[0]).float().logsumexp(-1).mean()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for param, ref in zip(model.parameters(), reference.parameters()):
            for like in (torch.zeros_like(param), torch.full_like(param, 2.0),
                         torch.ones_like(param, dtype=torch.float16)):
                expected = {torch.float16: torch.ones_like(ref, dtype=torch.float16)}.get(
                    like.dtype, torch.zeros_like(ref) if not like.any() else
                    torch.full_like(ref, 2.0))
                assert type(like) is torch.Tensor and not like.requires_grad
                assert torch.equal(like, expected)
            assert torch.randn_like(param).shape == ref.shape
    if when == "in_flight":
        model.backward(loss)


def test_a_penalty_between_the_forward_and_its_backward_is_refused_and_logging_reads_values():
    # Note [Parameters between a forward and its backward]: the tutorials' L2 penalty after the
    # forward was 0 there, then backward failed with autograd's "PowBackward0 returned an
    # invalid gradient ... got [0]".
    reference, _, model, opt = build()
    x = batches(1)[0]
    loss = model(x).float().logsumexp(-1).mean()
    with pytest.raises(RuntimeError, match=r"pow\(\) of PatrickStar parameter 'module\..*' "
                                           r"between the forward and its backward.*weight_decay"):
        sum(p.pow(2).sum() for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"^\.T of PatrickStar parameter 'module\.h\.weight' "
                                           r"between the forward"):  # it said "__get__()"
        model.module.h.weight.T
    with torch.no_grad():  # a logging read gives the value, as in PyTorch
        norms = [p.norm() for p in model.module.parameters()]
    expected = [p.norm() for p in reference.parameters()]
    torch.testing.assert_close(norms, expected)
    assert model.module.h.weight.shape == reference.h.weight.shape
    model.backward(loss)  # the backward is unaffected
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        sum(p.pow(2).sum() for p in model.parameters())  # at rest again


@pytest.mark.parametrize("call", ["no_grad", "functional_call", "with_backward", "submodule"])
def test_reads_after_a_forward_of_the_module_itself_give_pytorchs_values(call):
    # `model.module(x)` (nanoGPT's raw_model.generate(), Hugging Face's generate(),
    # torch.func.functional_call) or a submodule alone (`model.module.wte(ids)`) bypasses
    # forward() and left the parameters plain: numel() 0, norm() 0 and torch.func's
    # `{k: v.detach() ...}` the empty placeholders ("'weight' must be 2-D") until the next step.
    reference, ref_opt, model, opt = build()
    for x in batches(2):
        step(reference, ref_opt, x)
        step(model, opt, x)
    x = batches(3)[2]
    if call == "no_grad":
        with torch.no_grad():
            model.module(x)
    elif call == "submodule":
        with torch.no_grad():
            torch.testing.assert_close(model.module.wte(x), reference.wte(x))
    elif call == "functional_call":
        torch.func.functional_call(model.module, dict(model.module.named_parameters()), (x,))
        with pytest.raises(RuntimeError, match="between the forward and its backward"):
            model.module.h.weight.sum()  # as after model(x): Note [Parameters between ...]
    else:
        loss = model.module(x).float().logsumexp(-1).mean()
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        step(reference, ref_opt, x)
    with torch.no_grad():
        assert sum(p.numel() for p in model.parameters()) == \
            sum(p.numel() for p in reference.parameters())
        for name, ref_param in reference.named_parameters():
            torch.testing.assert_close(model.module.get_parameter(name).norm(), ref_param.norm())
    weights = {k: v.detach() for k, v in model.module.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(model.module, weights, (x,)),
                               reference(x), rtol=1e-4, atol=1e-5)


def test_a_read_with_autograd_on_says_once_that_the_value_carries_no_gradient(monkeypatch):
    # An L2 term built at rest before the forward trained nothing, silently.
    from patrickstar import resting_params
    monkeypatch.setattr(resting_params, "_warned_no_gradient", False)
    _, _, model, _ = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model.module.h.weight.norm()  # logging under no_grad: nothing said
    with pytest.warns(UserWarning, match=r"pow\(\) of PatrickStar parameter 'module\..*' outside "
                                         r"the forward, with autograd on.*trains nothing") as seen:
        penalty = sum(p.pow(2).sum() for p in model.parameters())
    assert not penalty.requires_grad
    assert len([w for w in seen if "trains nothing" in str(w.message)]) == 1  # once
    assert seen[0].filename == __file__  # points at the user's line


@pytest.mark.parametrize("window", ["at_rest", "between_forward_and_backward"])
def test_logging_reads_with_autograd_on_print_and_compare_as_pytorch_without_a_word(
        window, monkeypatch):
    # `print(p)`, `p.tolist()` and comparisons give strings, numbers and bool tensors, which no
    # loss takes in: they warned at rest ("trains nothing") and raised between a forward and
    # its backward. They now read quietly, and print shows torch's "requires_grad=True".
    from patrickstar import resting_params
    monkeypatch.setattr(resting_params, "_warned_no_gradient", False)
    reference, _, model, opt = build()
    x = batches(1)[0]
    if window == "between_forward_and_backward":
        loss = model(x).float().logsumexp(-1).mean()
    param, ref_param = model.module.h.bias, reference.h.bias
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert repr(param) == repr(ref_param)
        assert str(param) == str(ref_param)
        assert param.tolist() == ref_param.tolist()
        assert torch.equal(param, ref_param)
        assert bool(param.isfinite().all())
        assert torch.allclose(param, ref_param)
        assert (param == ref_param).all()
    # A read whose result could enter a loss still warns (at rest) or raises (in flight).
    if window == "at_rest":
        with pytest.warns(UserWarning, match="trains nothing"):
            param.sum()
    else:
        with pytest.raises(RuntimeError, match="between the forward and its backward"):
            param.sum()
        model.backward(loss)
        opt.step()


@pytest.mark.parametrize("budget", BUDGETS)
def test_autograd_grad_of_the_parameters_gives_pytorchs_and_trains_as_pytorch(budget):
    """Note [torch.autograd.grad of parameters]: torch.autograd.grad(loss, model.parameters())
    raised "One of the differentiated Tensors does not require grad" (the parameters were read
    as values). A gradient penalty on them (create_graph=True, as WGAN-GP's on the weights or
    MAML's inner step) then trains as PyTorch, tied weights included."""
    reference, ref_opt, model, opt = build(budget)
    for x in batches(3):
        grads = {}
        for name, net, optimizer in (("ref", reference, ref_opt), ("ours", model, opt)):
            loss = net(x).float().logsumexp(-1).mean()
            params = list(net.parameters())
            grads[name] = torch.autograd.grad(loss, params, create_graph=True)
            total = loss + 0.1 * sum(g.square().sum() for g in grads[name])
            net.backward(total) if net is model else total.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert [g.shape for g in grads["ours"]] == [g.shape for g in grads["ref"]]
        for ours, ref in zip(grads["ours"], grads["ref"]):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    model.destroy()
