"""torch.nn.utils.clip_grad_norm_ over an engine's parameters (Note [torch's clip_grad_norm_] in
clip_grad.py); the two-rank run is test_data_parallel.py's mlp_loss_backward."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import patrickstar
from test_initialize import MLP

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "default_chunk_size": 4096}


def batches(steps, batch=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=generator) * 4,
             torch.randint(0, 10, (batch,), generator=generator)) for _ in range(steps)]


def test_nanogpt_loop_clips_as_pytorch_does():
    data = batches(6)
    torch.manual_seed(0)
    reference = MLP()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    ref_norms = []
    for x, y in data:
        reference(x, y).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    norms = []
    for x, y in data:
        model(x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert min(ref_norms) > 0.5  # every step clipped
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_type", [float("inf"), 1.0, 3.0])
def test_other_norm_orders_clip_as_pytorch_does(norm_type):
    # They were refused ("PatrickStar-C++ clips by the L2 norm"). The two-rank run is
    # test_data_parallel.py's mlp_clip_inf.
    data = batches(4)
    norms = {}
    for kind in ("torch", "engine"):
        torch.manual_seed(0)
        if kind == "torch":
            model = MLP()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        else:
            model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
        norms[kind] = []
        for x, y in data:
            model(x, y).backward()
            norms[kind].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1,
                                                              norm_type=norm_type))
            optimizer.step()
            optimizer.zero_grad()
        norms[kind + " state"] = model.state_dict()
    assert min(norms["torch"]) > 0.1  # every step clipped
    torch.testing.assert_close(norms["engine"], norms["torch"], rtol=1e-5, atol=0)
    for key, tensor in norms["torch state"].items():
        torch.testing.assert_close(norms["engine state"][key], tensor, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="norm_type 0.0 is not supported"):
        model.clip_grad_norm_(1.0, 0.0)


def test_clip_grads_with_norm_clips_by_the_norm_given_and_refuses_an_empty_total():
    # torch's two halves (torchtitan's recipe): get_total_norm over p.grad finds no gradient
    # of an engine (it is 0), and clip_grads_with_norm_ clipped nothing, silently. A norm
    # the engine measured clips as torch's does.
    data = batches(4)
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    for x, y in data:
        reference(x, y).backward()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        torch.nn.utils.clip_grads_with_norm_(reference.parameters(), 0.5, ref_norm)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        model(x, y).backward()
        empty = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                               if p.grad is not None])
        with pytest.raises(ValueError, match=r"total_norm is 0 but the PatrickStar engine's "
                                             r"gradients have norm [0-9.]+: .*clip_grad_norm_"):
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, empty)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, norm)
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        assert ref_norm > 0.5  # clipped
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)


class WithAnEmptyParameter(MLP):
    """A parameter without elements (an nn.Linear(0, n)-like slot of a configurable model)
    stays outside the chunks, a plain parameter in model.parameters()."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x, y):
        return super().forward(x, y) + self.empty.sum()


def test_nanogpt_clipping_of_a_model_with_an_empty_parameter_is_pytorchs():
    """Before: its empty gradient counted as "gradients outside the PatrickStar engine" and
    torch.nn.utils.clip_grad_norm_(model.parameters(), m) raised."""
    data = batches(3)
    torch.manual_seed(0)
    reference = WithAnEmptyParameter()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(WithAnEmptyParameter, config=CONFIG)
    for x, y in data:
        reference(x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        model.backward(model(x, y))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def test_imported_name_and_model_module_parameters_work_too():
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    from torch.nn.utils import clip_grad_norm_  # looked up after initialize()
    x, y = batches(1)[0]
    model.backward(model(x, y))
    expected = model.clip_grad_norm_(1e9).item()
    assert clip_grad_norm_(model.module.parameters(), 1e9).item() == expected
    assert expected > 0
    optimizer.step()


def test_a_subset_or_foreign_gradients_raise_naming_the_engine_call():
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    x, y = batches(1)[0]
    model.backward(model(x, y))
    with pytest.raises(ValueError, match=r"not among those given \(e\.g\. \['layers\.1"):
        torch.nn.utils.clip_grad_norm_(model.module.layers[0].parameters(), 1.0)
    other = nn.Linear(3, 3)
    other(torch.randn(2, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"outside the PatrickStar engine \(shapes \[\(3, 3\)"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    with pytest.raises(ValueError, match="norm_type -inf is not supported"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=-float("inf"))
    # Modules outside any engine keep torch's own function.
    plain = torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()]))
    torch.testing.assert_close(plain, expected)
    optimizer.step()


def test_nonfinite_norm_raises_when_asked():
    model, optimizer = patrickstar.initialize(MLP, config={**CONFIG, "nonfinite_loss": "skip"})
    x, y = batches(1)[0]
    x[0, 0] = float("inf")
    model(x, y).backward()  # loss.backward() does not check the loss
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))


def test_the_registry_does_not_keep_an_engine_alive():
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    params = list(model.parameters())
    alive = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert alive() is None
    # Its parameters, still referenced here, are plain parameters again for torch.
    assert torch.nn.utils.clip_grad_norm_(params, 1.0).item() == 0.0


@pytest.mark.parametrize("subset", [False, True])
def test_clip_grad_value_clamps_the_chunked_gradients_as_pytorch(subset):
    # torch's clip_grad_value_ found no p.grad and clamped nothing, silently.
    data = batches(4)
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    extra = nn.Parameter(torch.ones(3))  # a foreign parameter clamped by torch beside them
    for x, y in data:
        for module, opt in ((reference, ref_opt), (model, optimizer)):
            module(x, y).backward()
            params = list(module.parameters())[:2] if subset else list(module.parameters())
            extra.grad = torch.full((3,), 5.0)
            torch.nn.utils.clip_grad_value_(params + [extra], 0.01)
            assert torch.equal(extra.grad, torch.full((3,), 0.01))
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("after", ["measure_with_inf", "clip_again", "clip_value"])
def test_calls_after_a_clip_see_the_clipped_gradients_as_in_pytorch(after):
    """clip_grad_norm_ is applied by the coming step (Note [A clip before the step]); what comes
    after it in the same step (a second clip_grad_norm_(params, inf) to log the clipped norm, a
    tighter clip, a clip_grad_value_) must see and compose with the clipped gradients, as in
    PyTorch, where the first call scaled p.grad at once."""
    def then(params):
        if after == "measure_with_inf":
            return torch.nn.utils.clip_grad_norm_(params, float("inf")).item()
        if after == "clip_again":
            return torch.nn.utils.clip_grad_norm_(params, 0.2).item()
        torch.nn.utils.clip_grad_value_(params, 0.01)
        return 0.0

    data = batches(3)
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    ref_out = []
    for x, y in data:
        reference(x, y).backward()
        first = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item()
        ref_out.append((first, then(reference.parameters())))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
    out = []
    for x, y in data:
        model(x, y).backward()
        first = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
        out.append((first, then(model.parameters())))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert min(first for first, _ in ref_out) > 0.5  # every step clipped
    torch.testing.assert_close(torch.tensor(out), torch.tensor(ref_out), rtol=1e-5, atol=0)
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)
    model.destroy()


def test_a_backward_after_the_clip_adds_unclipped_gradients_as_in_pytorch():
    # Note [A clip before the step] in optimizer.py: the clip waits for the step; a backward
    # between them (a PyTorch accumulation loop without the config key) made the step clip the
    # sum, where torch clipped only what p.grad held at the clip (0.01 off after one step).
    data = batches(6)
    results = {}
    for kind in ("torch", "engine"):
        torch.manual_seed(0)
        if kind == "torch":
            model = MLP()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        else:
            model, optimizer = patrickstar.initialize(MLP, config=CONFIG)
        norms = []
        for step in range(3):
            (x, y), (x2, y2) = data[2 * step:2 * step + 2]
            model(x, y).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            model(x2, y2).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"),
                                                        norm_type=2.0).item())
            optimizer.step()
            optimizer.zero_grad()
        results[kind] = norms, {k: v.clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(torch.tensor(results["engine"][0]),
                               torch.tensor(results["torch"][0]), rtol=1e-5, atol=0)
    for key, tensor in results["torch"][1].items():
        torch.testing.assert_close(results["engine"][1][key], tensor, rtol=1e-5, atol=1e-6)
