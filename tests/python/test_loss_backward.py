"""`loss.backward()` as a PyTorch loop writes it, next to `model.backward(loss)` (Note
[loss.backward()] in engine.py). The two-rank runs are in test_data_parallel.py."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import patrickstar
from test_initialize import MLP


def batches(steps, batch=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=generator),
             torch.randint(0, 10, (batch,), generator=generator)) for _ in range(steps)]


class Checkpointed(nn.Module):
    """Every block recomputed in backward: the engine's first access inside loss.backward() is
    a recomputed forward, not a pre-backward hook."""

    reentrant = False

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 32)  # so the checkpointed blocks' inputs require grad
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(lambda t, b=block: torch.relu(b(t)), x,
                           use_reentrant=self.reentrant)
        logits = checkpoint(self.head, x, use_reentrant=self.reentrant)
        return nn.functional.cross_entropy(logits, y)


class CheckpointedReentrant(Checkpointed):
    """Reentrant checkpointing runs a nested autograd backward per block: the engine must join
    the outer one (its end is the end of loss.backward())."""
    reentrant = True


def train(model_func, config, data, autograd: bool, accumulation: int = 1):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "default_chunk_size": 4096, "gradient_accumulation_steps": accumulation, **config}
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_func, config=config)
    losses = []
    for step, (x, y) in enumerate(data):
        loss = model(x.to(model.compute_dtype), y)
        if autograd:
            (loss / accumulation).backward()
        else:
            model.backward(loss)
        losses.append(loss.item())
        if (step + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses, model.state_dict()


def assert_same(a, b):
    assert a[0] == b[0]
    for key, tensor in a[1].items():
        torch.testing.assert_close(b[1][key], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("model_func, config, accumulation", [
    (MLP, {}, 1),
    (MLP, {"bf16": {"enabled": True}}, 2),
    (MLP, {"bf16": {"enabled": True, "master_weights": False}}, 1),
    (Checkpointed, {}, 2),
    (CheckpointedReentrant, {}, 1),
    # Note [fp16 loss.backward() scales at the engine's outputs]: 2**40 overflows first, so
    # the skipped steps and the lowered scale match too
    (MLP, {"fp16": {"enabled": True}}, 2),
    (MLP, {"fp16": {"enabled": True, "initial_scale_power": 40}}, 1),
    (CheckpointedReentrant, {"fp16": {"enabled": True}}, 1),
])
def test_loss_backward_trains_as_model_backward(model_func, config, accumulation):
    data = batches(6)
    assert_same(train(model_func, config, data, autograd=False, accumulation=accumulation),
                train(model_func, config, data, autograd=True, accumulation=accumulation))


def test_loss_backward_matches_pytorch():
    data = batches(5)
    torch.manual_seed(0)
    reference = MLP()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = []
    for x, y in data:
        loss = reference(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    losses, state = train(MLP, {}, data, autograd=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)


def test_loss_backward_into_some_parameters_trains_them_only_as_pytorch():
    """`loss.backward(inputs=params)`: torch stores the gradients of those parameters only (Note
    [torch.autograd.grad of parameters] in resting_params.py); it raised "can't retain_grad on
    Tensor that has requires_grad=False"."""
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "default_chunk_size": 4096}
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)
    for step, (x, y) in enumerate(batches(3)):
        reference(x, y).backward(inputs=list(reference.layers[step % 3].parameters()))
        model(x, y).backward(inputs=list(model.module.layers[step % 3].parameters()))
        assert [patrickstar.safe_get_full_grad(p) is not None for p in model.parameters()] == [
            p.grad is not None for p in reference.parameters()]
        for opt in (ref_optimizer, optimizer):
            opt.step()
            opt.zero_grad()
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)


def test_hugging_face_gradient_checkpointing_with_loss_backward():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def run(autograd):
        torch.manual_seed(0)
        model, optimizer = patrickstar.initialize(
            lambda: transformers.GPT2LMHeadModel(config),
            config={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                    "default_chunk_size": 16384})
        model.gradient_checkpointing_enable()
        losses = []
        for _ in range(3):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward() if autograd else model.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, model.state_dict()

    assert_same(run(False), run(True))


def test_fp16_input_gradients_of_the_engines_outputs_are_not_scaled():
    # Note [fp16 loss.backward() scales at the engine's outputs]: torch.autograd.grad
    # accumulates into no parameter, so the gradient it returns is left as it is
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096,
              "fp16": {"enabled": True}}
    model, optimizer = patrickstar.initialize(MLP, config=config)
    x, y = batches(1)[0]
    x = x.half().requires_grad_()
    got, = torch.autograd.grad(model(x, y), x)
    expected, = torch.autograd.grad(model.module(x, y), x)  # no engine output on the way
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.abs().max() < 1  # unscaled (the scale is 2**16)
    # A loss that is changed in place (Hugging Face's Trainer: `loss *= ...`) still trains
    loss = model(x.detach(), y)
    loss *= 0.5
    loss.backward()
    optimizer.step()


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("autograd", [False, True])
def test_fp16_outputs_changed_in_place_train_as_changed_out_of_place(autograd):
    # Note [fp16 loss.backward() scales at the engine's outputs]: the outputs are aliases, not
    # views of a custom Function's output, so an in-place change (as a PyTorch loop may make to
    # its logits) is allowed and trains as the same change made out of place
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096,
              "fp16": {"enabled": True}}
    results = []
    for in_place in (False, True):
        torch.manual_seed(0)
        model, optimizer = patrickstar.initialize(Logits, config=config)
        losses = []
        for x, y in batches(4):
            logits = model(x.half())
            if in_place:
                logits[:, 0] = 0.0
            else:
                logits = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, 1:]], dim=1)
            loss = nn.functional.cross_entropy(logits.float(), y)
            loss.backward() if autograd else model.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append((losses, model.state_dict()))
        model.destroy()
    assert_same(*results)


def test_fp16_loss_backward_past_the_engines_outputs_names_them_and_changes_nothing():
    # A forward of model.module itself returns no output the loss scale is applied at
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096,
              "fp16": {"enabled": True}}
    model, optimizer = patrickstar.initialize(MLP, config=config)
    x, y = batches(1)[0]
    before = model.state_dict()
    with pytest.raises(RuntimeError, match=r"without passing the engine's outputs.*"
                                           r"model\.backward\(loss\)"):
        model.module(x.half(), y).backward()
    for key, tensor in before.items():
        torch.testing.assert_close(model.state_dict()[key], tensor, rtol=0, atol=0)
    # The engine goes on with the supported call.
    model.backward(model(x.half(), y))
    optimizer.step()


def test_call_order_errors_name_the_accumulation_steps():
    model, optimizer = patrickstar.initialize(
        MLP, config={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                     "default_chunk_size": 4096, "gradient_accumulation_steps": 2})
    x, y = batches(1)[0]
    model(x, y).backward()
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps is 2"):
        model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.step()  # no gradients: a no-op, as torch's (test_optimizer_torch_parity.py)
    assert model.global_steps == 1


def test_a_loss_backward_that_raised_leaves_the_engine_usable():
    data = batches(4)
    model, optimizer = patrickstar.initialize(
        MLP, config={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                     "default_chunk_size": 4096})

    def fail(grad):
        raise ValueError("user hook failed")

    x, y = data[0]
    loss = model(x, y)
    loss.register_hook(fail)
    with pytest.raises(ValueError, match="user hook failed"):
        loss.backward()
    # A hook that fails halfway through the graph, after the engine joined the backward.
    h = model.module.layers[0].register_full_backward_hook(lambda *args: fail(None))
    with pytest.raises(ValueError, match="user hook failed"):
        model(x, y).backward()
    h.remove()
    # That one stored the later layers' gradients before it raised: they would be added to the
    # next step's (test_interrupts.py), so the next backward asks for zero_grad() first.
    with pytest.raises(RuntimeError, match="zero_grad"):
        model(x, y).backward()
    optimizer.zero_grad()
    for x, y in data[1:]:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model.memory_stats() is not None


def test_a_disabled_grad_scaler_steps_and_an_enabled_one_names_the_config():
    # nanoGPT's loop: GradScaler(enabled=(dtype == "float16")) around bf16 autocast.
    data = batches(3)
    reference = train(MLP, {}, data, autograd=True)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "default_chunk_size": 4096})
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses = []
    for x, y in data:
        loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert_same(reference, (losses, model.state_dict()))
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale(model(*data[0])).backward()
    with pytest.raises(TypeError, match="fp16.enabled"), pytest.warns(FutureWarning):
        scaler.step(optimizer)


def test_an_enabled_grad_scaler_is_refused_at_unscale_before_a_clip_reads_scaled_gradients():
    """torch's AMP recipe scaler.scale(loss).backward(); scaler.unscale_(optimizer);
    clip_grad_norm_(...); scaler.step(optimizer): the error came only at scaler.step, after
    unscale_ had found no p.grad and returned, so the clip between them returned the scaled norm
    (thousands, torch's unscaled one below 1) and clipped by it. Now unscale_ raises (Note
    [torch.amp.GradScaler over the chunked optimizer]); a disabled scaler's unscale_ + clip
    still matches torch's norms and weights."""
    data = batches(3)
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01,
                                      foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "default_chunk_size": 4096})
    for x, y in data:
        for module, opt in ((reference, ref_optimizer), (model, optimizer)):
            scaler = torch.amp.GradScaler("cpu", enabled=False)
            scaler.scale(module(x, y)).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if module is reference:
                ref_norm = norm
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], tensor, rtol=1e-5, atol=1e-6)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale(model(*data[0])).backward()
    with pytest.raises(TypeError, match="GradScaler cannot scale.*drop the GradScaler.*"
                                        "fp16.enabled.*bfloat16"):
        scaler.unscale_(optimizer)
    optimizer.zero_grad(set_to_none=True)
    assert len(optimizer.param_groups) == 1  # every other reader sees the groups


def _train_alongside(model_func, lr, config, inputs, loss_of, autograd):
    """Builds model_func as a plain model (torch Adam) and as an engine (its Adam, `config` added
    to the optimizer's), trains both on the same inputs (loss_of(module, x)), the engine by
    loss.backward() or model.backward(loss), compares their weights and returns the engine."""
    torch.manual_seed(0)
    reference = model_func()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=lr, foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_func, config={
        "optimizer": {"type": "Adam", "params": {"lr": lr}}, **config})
    for x in inputs:
        loss_of(reference, x).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        loss = loss_of(model, x)
        loss.backward() if autograd else model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)
    return model


def _input_gradient(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out, grad


@pytest.mark.parametrize("autograd", [True, False])
def test_a_gradient_penalty_through_autograd_grad_trains_as_pytorch(autograd):
    # torch.autograd.grad runs the engine's hooks but stores no gradient: not a training
    # backward, so it is not counted against gradient_accumulation_steps.
    def model_func():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def penalized(module, x):
        out, grad = _input_gradient(module, x)
        return out.mean() + 0.1 * grad.pow(2).sum()

    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    _train_alongside(model_func, 1e-2, {"default_chunk_size": 4096}, inputs, penalized,
                     autograd)


@pytest.mark.parametrize("autograd", [True, False])
def test_a_gradient_penalty_under_a_device_budget_trains_as_pytorch(autograd):
    """The backward with create_graph=True saves, for the second backward, what its ops read:
    views of chunk memory (the weights unpacked for it) that moved before the second backward
    read them, so the penalty's parameter gradients were silently wrong (0.01 off after 5
    steps) whenever chunks were evicted in between."""
    def model_func():
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())],
                             nn.Linear(16, 1))

    def penalized(module, x):
        out, grad = _input_gradient(module, x)
        return out.mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()

    inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    # A chunk per layer, three of them on the device.
    model = _train_alongside(model_func, 1e-3, {"default_chunk_size": 272,
                                                "memory": {"device_budget": 3 * 4096}},
                             inputs, penalized, autograd)
    assert model.memory_stats()[0]["evictions"] > 0


def test_model_backward_retain_graph_takes_two_losses_of_one_forward_as_pytorch():
    """DeepSpeed's and torch's `retain_graph=True` (two losses of one forward, one backward
    each): model.backward(loss, retain_graph=True) was a TypeError."""
    data = batches(4)
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 4096,
        "gradient_accumulation_steps": 2, "memory": {"device_budget": 3 * 4096 * 4}})
    for x, y in data:
        loss = reference(x, y)
        (loss / 2).backward(retain_graph=True)
        (loss * loss / 2).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ours = model(x, y)
        model.backward(ours, retain_graph=True)
        model.backward(ours * ours)
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [None, 3 * 4096 * 4])
@pytest.mark.parametrize("part", ["module", "first_layer"])
def test_module_zero_grad_drops_the_engines_gradients_as_pytorch(part, budget):
    """`model.module.zero_grad()` (or a submodule's: a GAN's `netD.zero_grad()`) between two
    backwards of one step drops the first backward's gradients in PyTorch. It cleared the
    placeholders' `p.grad` (None already) and left the chunks' gradients: the step used both
    backwards' (0.02 off after one step under accumulation). The whole module's is
    optimizer.zero_grad() (the next backward starts the step: one of one here); a part's drops
    only its gradients (two backwards of two)."""
    data = batches(4)
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 4096,
              "gradient_accumulation_steps": 1 if part == "module" else 2}
    if budget:
        config["memory"] = {"device_budget": budget}
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)

    def clear(module):
        (module if part == "module" else module.layers[0]).zero_grad()

    for (x, y), (x2, y2) in zip(data[::2], data[1::2]):
        for net, opt in ((reference, ref_optimizer), (model.module, optimizer)):
            (net(x, y) / 2).backward()
            clear(net)
            (net(x2, y2) / 2).backward()
            opt.step()
            opt.zero_grad()
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("autograd", [True, False])
def test_one_autocast_region_around_the_whole_loop_trains_as_autocast_per_step(autograd):
    """A loop written inside one `torch.autocast` (forward, backward and step): autocast caches
    each weight's bf16 cast for the whole region. A cast made in an earlier iteration led the
    next backward to a parameter holding its placeholder ("The size of tensor a (0) must match
    ..."); plain PyTorch runs on with the stale cast (Note [Autocast's cast cache])."""
    data = batches(6)
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    ref_losses = []
    for step, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast entered per micro-step
            loss = reference(x, y)
            (loss / 2).backward()
        ref_losses.append(loss.item())
        if step % 2 == 1:
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096,
        "gradient_accumulation_steps": 2})
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for step, (x, y) in enumerate(data):
            loss = model(x, y)
            (loss / 2).backward() if autograd else model.backward(loss)
            losses.append(loss.item())
            if step % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss", ["per_sample", "item"])
def test_model_backward_of_a_non_scalar_names_what_it_got(loss):
    """Before: "backward(loss) expects a scalar loss tensor", for per-sample losses
    (reduction="none") and for loss.item() alike, naming neither."""
    model, optimizer = patrickstar.initialize(lambda: nn.Linear(32, 10),
                                              config={"default_chunk_size": 4096})
    x, y = batches(1)[0]
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    given = losses if loss == "per_sample" else losses.mean().item()
    expected = "a tensor of shape (8,)" if loss == "per_sample" else "a float"
    with pytest.raises(ValueError, match=rf"scalar loss tensor, got {re.escape(expected)}: "
                                         r"reduce per-sample losses first \(loss.mean\(\)"):
        model.backward(given)
    model.backward(losses.mean())  # the forward's graph is still there to train on
    optimizer.step()
