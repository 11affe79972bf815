"""The user's own hooks on the engine's model see what they see in PyTorch: forward hooks read a
module's weights (Note [User hooks around the engine's] in hooks.py), gradient hooks change the
gradient that is trained. Each against the same model in plain PyTorch, with and without a
device budget under which parameters really move between uses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar

CHUNK = 1024  # elements: a layer or two per chunk, four chunks on the device under a budget
BUDGETS = [None, 4 * CHUNK * 4]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.d = nn.Linear(32, 4)

    def forward(self, x):
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def batches(steps):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=generator),
             torch.randint(0, 4, (8,), generator=generator)) for _ in range(steps)]


def build(model_func, budget):
    torch.manual_seed(0)
    reference = model_func()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": CHUNK}
    if budget:
        config["memory"] = {"device_budget": budget}
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_func, config=config)
    return reference, ref_optimizer, model, optimizer


def build_hooked(add_hooks, when, budget):
    """The reference and the engine's model with `add_hooks(net, log)` applied to each (in
    model_func, or to model.module after initialize()); returns both, their optimizers and
    their logs."""
    ref_log, log = [], []

    def hooked():
        net = Net()
        add_hooks(net, log)
        return net

    if when == "in_model_func":
        torch.manual_seed(0)
        reference = Net()
        add_hooks(reference, ref_log)
        ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
        _, _, model, optimizer = build(hooked, budget)
        log.clear()  # what the planning builds logged, if anything
    else:
        reference, ref_optimizer, model, optimizer = build(Net, budget)
        add_hooks(reference, ref_log)
        add_hooks(model.module, log)
    return reference, ref_optimizer, model, optimizer, ref_log, log


def train_both(reference, ref_optimizer, model, optimizer, steps=3):
    for x, y in batches(steps):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()


def assert_same_weights(reference, model):
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


def weight_readers(log):
    """Forward hooks that read the module's weight, as activation/weight loggers do."""
    def post(module, inputs, output):
        log.append(("post", tuple(module.weight.shape), module.weight.sum().item()))

    def pre(module, inputs):
        log.append(("pre", tuple(module.weight.shape), module.weight.sum().item()))

    def post_kwargs(module, args, kwargs, output):
        log.append(("post_kwargs", tuple(module.weight.shape), module.weight.norm().item()))
        return output * 2

    return pre, post, post_kwargs


def hook(net, log):
    pre, post, post_kwargs = weight_readers(log)
    net.b.register_forward_pre_hook(pre)
    net.b.register_forward_hook(post)
    net.c.register_forward_hook(post_kwargs, with_kwargs=True)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("when", ["in_model_func", "after_initialize"])
def test_forward_hooks_read_the_modules_weights_as_in_pytorch(when, budget):
    # Before: a forward hook registered after initialize() ran after the engine's release and
    # read the empty placeholder (shape (0,), sum 0.0); a pre-hook registered in model_func ran
    # before the engine's access, the same.
    reference, ref_optimizer, model, optimizer, ref_log, log = build_hooked(hook, when,
                                                                            budget)
    train_both(reference, ref_optimizer, model, optimizer)
    assert [entry[:2] for entry in log] == [entry[:2] for entry in ref_log]
    assert [entry[2] for entry in log] == pytest.approx([entry[2] for entry in ref_log],
                                                        rel=1e-5, abs=1e-6)
    assert_same_weights(reference, model)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("when", ["in_model_func", "after_initialize"])
def test_post_accumulate_grad_hooks_see_and_change_the_gradient_as_in_pytorch(when, budget):
    # Before: a hook registered after initialize() ran after the engine's, which had moved the
    # gradient into its chunk and set p.grad to None: a gradient logger failed on None and a
    # hook scaling p.grad in place changed nothing.
    def add_hooks(net, sink):
        for name, param in net.named_parameters():
            def scale_and_log(p, name=name):
                p.grad.mul_(0.5 if name.startswith("b.") else 1.0)
                sink.append((name, p.grad.norm().item()))
            param.register_post_accumulate_grad_hook(scale_and_log)

    reference, ref_optimizer, model, optimizer, ref_log, log = build_hooked(add_hooks, when,
                                                                            budget)
    train_both(reference, ref_optimizer, model, optimizer)
    assert [name for name, _ in log] == [name for name, _ in ref_log]
    assert [norm for _, norm in log] == pytest.approx([norm for _, norm in ref_log], rel=1e-5)
    assert_same_weights(reference, model)


@pytest.mark.parametrize("budget", BUDGETS)
def test_tensor_hooks_on_parameters_scale_the_trained_gradient_as_in_pytorch(budget):
    reference, ref_optimizer, model, optimizer = build(Net, budget)
    for net in (reference, model.module):
        for param in net.parameters():
            param.register_hook(lambda grad: grad * (0.0 if grad.dim() == 1 else 10.0))
    train_both(reference, ref_optimizer, model, optimizer)
    assert_same_weights(reference, model)


def backward_pre_hook(net, log):
    """A full backward pre-hook that reads the module's weight and scales the gradient."""
    def pre(module, grad_output):
        log.append((tuple(module.weight.shape), module.weight.sum().item()))
        return tuple(g * 0.5 for g in grad_output)

    net.b.register_full_backward_pre_hook(pre)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("when", ["in_model_func", "after_initialize"])
def test_full_backward_pre_hooks_read_the_weights_and_change_the_gradient_as_in_pytorch(
        when, budget):
    # Before: torch ran the user's pre-hook before the engine's pre-backward access, so it read
    # the placeholder (shape (0,)) silently (Note [User full backward pre-hooks] in hooks.py).
    reference, ref_optimizer, model, optimizer, ref_log, log = build_hooked(
        backward_pre_hook, when, budget)
    train_both(reference, ref_optimizer, model, optimizer)
    assert [shape for shape, _ in log] == [(32, 32)] * 3
    assert [total for _, total in log] == pytest.approx([total for _, total in ref_log],
                                                        rel=1e-5, abs=1e-6)
    assert_same_weights(reference, model)


def global_weight_readers(log):
    """Global module hooks (every module's calls) that read the module's weight, as a
    library-wide activation/weight logger does; one of them changes the input."""
    def pre(module, inputs):
        if isinstance(module, nn.Linear):
            log.append(("pre", tuple(module.weight.shape), module.weight.sum().item()))
            return (inputs[0] * 1.5,)
        return None

    def post(module, inputs, output):
        if isinstance(module, nn.Linear):
            log.append(("post", tuple(module.weight.shape), module.weight.norm().item()))

    return pre, post


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("when", ["before_initialize", "after_initialize"])
def test_global_module_hooks_read_the_weights_and_change_inputs_as_in_pytorch(when, budget):
    # Before: torch runs global pre-hooks before any module's own, so before the engine's
    # access: they read the placeholder (shape (0,), sum 0.0) silently (Note [Global module
    # hooks] in hooks.py). Global forward hooks saw the values already.
    from torch.nn.modules.module import (register_module_forward_hook as global_post,
                                         register_module_forward_pre_hook as global_pre)
    log = []
    pre, post = global_weight_readers(log)
    handles = []
    try:
        if when == "before_initialize":
            handles = [global_pre(pre), global_post(post)]
        reference, ref_optimizer, model, optimizer = build(Net, budget)
        log.clear()  # what the planning builds logged
        if when == "after_initialize":
            # Through the attribute, as scripts call it: the wrapper puts the engine's first.
            handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                       torch.nn.modules.module.register_module_forward_hook(post)]
        ref_log = []
        for x, y in batches(3):
            for net, opt, sink in ((reference, ref_optimizer, ref_log),
                                   (model, optimizer, log)):
                entries = len(log)
                nn.functional.cross_entropy(net(x), y).backward()
                if sink is ref_log:  # the global hooks logged into `log`; move them over
                    ref_log.extend(log[entries:])
                    del log[entries:]
                opt.step()
                opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    assert len(log) == 3 * 8
    assert [entry[:2] for entry in log] == [entry[:2] for entry in ref_log]
    assert [entry[2] for entry in log] == pytest.approx([entry[2] for entry in ref_log],
                                                        rel=1e-5, abs=1e-6)
    assert_same_weights(reference, model)
    # With the user's global hooks gone, the engines' goes too: no cost per module call.
    model(batches(1)[0][0])
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_a_global_pre_hook_that_raises_leaves_the_next_step_as_in_pytorch():
    reference, ref_optimizer, model, optimizer = build(Net, None)

    def failing(module, inputs):
        if isinstance(module, nn.Linear):
            raise ValueError("hook failed")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(failing)
    try:
        with pytest.raises(ValueError, match="hook failed"):
            model(batches(1)[0][0])
    finally:
        handle.remove()
    train_both(reference, ref_optimizer, model, optimizer)
    assert_same_weights(reference, model)


def train_accumulating(reference, ref_optimizer, model, optimizer, steps=2, micro=3):
    """`micro` loss.backward() calls per step, as a PyTorch accumulation loop writes them."""
    data = batches(steps * micro)
    for step in range(steps):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            for x, y in data[step * micro:(step + 1) * micro]:
                (nn.functional.cross_entropy(net(x), y) / micro).backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("when", ["in_model_func", "after_initialize"])
def test_post_accumulate_grad_hooks_see_the_accumulations_running_sum_as_in_pytorch(when,
                                                                                   budget):
    # Before: each backward's gradient came alone into p.grad (the earlier ones were in the
    # chunk), so the logged norms were each batch's and the in-place halving of b's gradient
    # halved only the last backward's part (Note [The running sum in a user's gradient hook]).
    def add_hooks(net, sink):
        for name, param in net.named_parameters():
            def scale_and_log(p, name=name):
                if name.startswith("b."):
                    p.grad.mul_(0.5)
                sink.append((name, p.grad.dtype, p.grad.norm().item()))
            param.register_post_accumulate_grad_hook(scale_and_log)

    reference, ref_optimizer, model, optimizer, ref_log, log = build_hooked(add_hooks, when,
                                                                            budget)
    train_accumulating(reference, ref_optimizer, model, optimizer)
    assert [entry[:2] for entry in log] == [entry[:2] for entry in ref_log]
    assert [entry[2] for entry in log] == pytest.approx([entry[2] for entry in ref_log],
                                                        rel=1e-5)
    assert_same_weights(reference, model)


@pytest.mark.parametrize("drop", ["zero_grad", "zero_grad(set_to_none=False)", "p.grad = None"])
def test_gradients_dropped_inside_a_gradient_hook_are_dropped_as_in_pytorch(drop):
    # Before: optimizer.zero_grad() in b.weight's hook dropped the chunks but not the hook's own
    # gradient, still in p.grad, which the engine then stored and the step applied; `p.grad =
    # None` there dropped only the last backward's part of the accumulation (Note [The optimizer
    # inside a gradient hook] in backward_pass.py).
    reference, ref_optimizer, model, optimizer = build(Net, None)
    calls = {}

    def dropper(opt):
        def hook(p):
            calls[opt] = calls.get(opt, 0) + 1
            if calls[opt] % 3 != 2:  # in the second backward of each step
                return
            if drop == "p.grad = None":
                p.grad = None
            else:
                opt.zero_grad(set_to_none=drop == "zero_grad")
        return hook

    reference.b.weight.register_post_accumulate_grad_hook(dropper(ref_optimizer))
    model.module.b.weight.register_post_accumulate_grad_hook(dropper(optimizer))
    train_accumulating(reference, ref_optimizer, model, optimizer)
    assert calls[ref_optimizer] == calls[optimizer] == 6
    assert_same_weights(reference, model)


def test_the_optimizer_in_backward_recipe_raises_naming_what_to_do():
    # PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward
    # pass": one torch optimizer per parameter, stepped and zeroed in its gradient hook.
    # Before: the engine's own optimizer stepped there silently trained on part of the
    # gradients (0.03 off torch after three steps).
    reference, ref_optimizer, model, optimizer = build(Net, None)
    x, y = batches(1)[0]
    per_parameter = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def recipe(p):
        per_parameter[p].step()
        per_parameter[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(recipe) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"optimizer-in-backward.*optimizer.step\(\) and "
                                           r"optimizer.zero_grad\(\) after loss.backward"):
        nn.functional.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()
    optimizer.zero_grad()

    def engine_step(p):
        optimizer.step()

    handle = model.module.a.weight.register_post_accumulate_grad_hook(engine_step)
    with pytest.raises(RuntimeError, match=r"inside its backward.*after loss.backward\(\) "
                                           r"returns"):
        nn.functional.cross_entropy(model(x), y).backward()
    handle.remove()
    optimizer.zero_grad()
    train_both(reference, ref_optimizer, model, optimizer)
    assert_same_weights(reference, model)


def test_a_logging_hook_sees_the_bf16_sum_and_leaves_fp32_accumulators_exact():
    # bf16 with gradient_accumulation_steps keeps fp32 accumulators in the chunks; a hook sees
    # p.grad in the parameter's dtype as torch's bf16 model shows it (the running sum), and a
    # hook that changes nothing stores nothing of its own, so training is bit for bit the run
    # without the hook (Note [The running sum in a user's gradient hook]).
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": CHUNK,
              "bf16": {"enabled": True}, "gradient_accumulation_steps": 2}
    runs = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model, optimizer = patrickstar.initialize(Net, config=config)
        log = []
        if hooked:
            for param in model.module.parameters():
                param.register_post_accumulate_grad_hook(
                    lambda p: log.append((p.grad.dtype, p.grad.float().norm().item())))
        for x, y in batches(4):
            model.backward(nn.functional.cross_entropy(model(x.bfloat16()).float(), y))
            model.step()
        runs.append((model.state_dict(), log))
    torch.manual_seed(0)
    reference = Net().bfloat16()
    ref_log = []
    for param in reference.parameters():
        param.register_post_accumulate_grad_hook(
            lambda p: ref_log.append((p.grad.dtype, p.grad.float().norm().item())))
    for x, y in batches(2):
        (nn.functional.cross_entropy(reference(x.bfloat16()).float(), y) / 2).backward()
    (plain, _), (hooked_state, log) = runs
    for key, value in plain.items():
        assert torch.equal(hooked_state[key], value), key
    assert [dtype for dtype, _ in log[:len(ref_log)]] == [torch.bfloat16] * len(ref_log)
    assert [norm for _, norm in log[:len(ref_log)]] == pytest.approx(
        [norm for _, norm in ref_log], rel=2e-2)
