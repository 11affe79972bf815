"""register_external_parameter (Note [External parameters] in external_params.py): a forward that
reads another module's parameter directly trains as in plain PyTorch, on one rank and on two;
reads by name need no registration (Note [Reads found in the module's code]); for the others the
error says what to do."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar
from dp_scenarios import ExternalUse
from test_data_parallel import check_matches_reference, check_no_errors, launch
from test_initialize import assert_same_training, mlp_batches

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 1e-2}},
          "default_chunk_size": 1024}


@pytest.mark.parametrize("budget", [None, 6 * 1024 * 4])
def test_a_parameter_read_by_the_parent_trains_as_in_pytorch(budget):
    torch.manual_seed(0)
    reference = ExternalUse()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(0)
    config = dict(CONFIG, memory={"device_budget": budget} if budget else {})
    model, opt = patrickstar.initialize(ExternalUse, config=config)
    ref_losses, losses = [], []
    for x, y in mlp_batches(6):
        ref = reference(x, y)
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(x, y)
        model.backward(loss); opt.step(); opt.zero_grad()
        ref_losses.append(ref.item()); losses.append(loss.item())
    assert_same_training(ref_losses, losses, reference.state_dict(), model.state_dict())


def test_without_registration_a_read_by_name_trains_as_in_pytorch():
    # Note [Reads found in the module's code]: `self.head.weight` in the parent's forward is
    # found before the first forward; it raised (with a note naming the registration) before.
    torch.manual_seed(0)
    reference = ExternalUse(register=False)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=1e-2)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(lambda: ExternalUse(register=False), config=CONFIG)
    ref_losses, losses = [], []
    for x, y in mlp_batches(4):
        ref = reference(x, y)
        ref.backward(), ref_opt.step(), ref_opt.zero_grad()
        loss = model(x, y)
        loss.backward(), opt.step(), opt.zero_grad()
        ref_losses.append(ref.item()), losses.append(loss.item())
    assert_same_training(ref_losses, losses, reference.state_dict(), model.state_dict())


class _ReadsThroughAnIndex(nn.Module):
    """Reads a child's weight through an index, which the code scan does not follow."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 10)])

    def forward(self, x, y):
        return nn.functional.cross_entropy(x @ self.layers[0].weight.t(), y)


def test_a_read_the_code_scan_cannot_see_gets_the_registration_hint():
    model, _ = patrickstar.initialize(_ReadsThroughAnIndex, config=CONFIG)
    x, y = next(mlp_batches(1))
    with pytest.raises(RuntimeError) as caught:
        model(x, y)
    assert any("register_external_parameter" in note for note in caught.value.__notes__)
    model.destroy()

    def registered():
        module = _ReadsThroughAnIndex()
        patrickstar.register_external_parameter(module, module.layers[0].weight)
        return module

    model, _ = patrickstar.initialize(registered, config=CONFIG)
    assert model(x, y).dim() == 0
    model.destroy()


class _ViewsItsTargets(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 5)

    def forward(self, x, targets):
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.view(-1, 5), targets.view(-1))


def test_a_view_of_a_non_contiguous_input_gets_torchs_error_without_the_placeholder_note():
    """`targets.view(-1)` on sliced tokens (`batch[:, 1:]`) fails in plain PyTorch too; the
    error is the input's stride, not a placeholder, so no register_external_parameter note."""
    x = torch.randn(2, 3, 8)
    targets = torch.randint(0, 5, (2, 4))[:, 1:]
    with pytest.raises(RuntimeError) as plain:
        _ViewsItsTargets()(x, targets)
    model, _ = patrickstar.initialize(_ViewsItsTargets, config=CONFIG)
    with pytest.raises(RuntimeError) as caught:
        model(x, targets)
    assert str(caught.value) == str(plain.value)
    assert not any("register_external_parameter" in note
                   for note in getattr(caught.value, "__notes__", []))
    assert model(x, targets.contiguous()).dim() == 0
    model.destroy()


def test_fp32_inputs_to_a_bf16_model_get_the_dtype_hint_not_the_placeholder_one():
    model, _ = patrickstar.initialize(lambda: nn.Linear(8, 4), config=dict(
        CONFIG, bf16={"enabled": True}))
    with pytest.raises(RuntimeError) as caught:
        model(torch.randn(2, 8))
    notes = getattr(caught.value, "__notes__", [])
    assert any("cast floating-point inputs to the model's dtype" in note for note in notes)
    assert not any("register_external_parameter" in note for note in notes)
    assert model(torch.randn(2, 8).bfloat16()).dtype == torch.bfloat16
    model.destroy()


def test_a_half_model_under_an_fp32_config_is_named_at_initialize_and_in_the_hint():
    """A PyTorch user's `model.half()` in model_func without an fp16 section trains in fp32
    (the config chooses the precision): initialize() says so, and fp16 inputs then get a hint
    that names the fp32 parameters, not "with bf16 or fp16 enabled"."""
    with pytest.warns(UserWarning, match=r"built 2 of 2 parameters in torch.float16 "
                                         r"\(e.g. 'weight'\), but the config trains in fp32.*"
                                         r"'fp16': \{'enabled': true\}"):
        model, _ = patrickstar.initialize(lambda: nn.Linear(8, 4).half(), config=CONFIG)
    with pytest.raises(RuntimeError) as caught:
        model(torch.randn(2, 8).half())
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert "compute in float32" in notes and "with bf16 or fp16 enabled" not in notes
    assert model(torch.randn(2, 8)).dtype == torch.float32  # as torch's fp32 Linear
    model.destroy()
    with warnings.catch_warnings():  # the model's own dtype, or fp32 under 16 bits: no warning
        warnings.simplefilter("error")
        for build, precision in ((lambda: nn.Linear(8, 4).half(), "fp16"),
                                 (lambda: nn.Linear(8, 4), "bf16")):
            model, _ = patrickstar.initialize(build, config=dict(
                CONFIG, **{precision: {"enabled": True}}))
            model.destroy()


def test_registering_something_that_is_not_a_model_parameter_is_a_clear_error():
    stray = nn.Parameter(torch.zeros(3, 5))

    def model_func():
        model = ExternalUse(register=False)
        patrickstar.register_external_parameter(model, stray)
        return model

    with pytest.raises(ValueError, match=r"shape \(3, 5\) registered on ExternalUse"):
        patrickstar.initialize(model_func, config=CONFIG)
    with pytest.raises(TypeError, match="must be an nn.Parameter"):
        patrickstar.register_external_parameter(nn.Linear(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="not registered"):
        patrickstar.unregister_external_parameter(nn.Linear(2, 2), stray)


def test_two_ranks_match_pytorch_on_the_whole_batch(tmp_path):
    results = launch(tmp_path, 2, "external_parameters")
    check_no_errors(results)
    check_matches_reference(results, "external_parameters")


def test_an_input_of_the_wrong_width_gets_torchs_error_without_the_placeholder_note():
    """Note [Placeholder errors name a size of 0]: a shape error naming no size of 0 is the
    user's input, as in plain PyTorch; the register_external_parameter hint sent users looking
    for a read of another module's parameter that was not there."""
    x = torch.randn(8, 33)
    with pytest.raises(RuntimeError) as plain:
        nn.Linear(32, 4)(x)
    model, _ = patrickstar.initialize(lambda: nn.Linear(32, 4), config=CONFIG)
    with pytest.raises(RuntimeError) as caught:
        model(x)
    assert str(caught.value) == str(plain.value)
    assert not any("register_external_parameter" in note
                   for note in getattr(caught.value, "__notes__", []))
    model.destroy()
