"""torch.nn's own building blocks trained as PyTorch trains them: modules that read their
children's parameters (Note [torch's external reads] in external_params.py), models cloned with
copy.deepcopy (Note [Parameters no hook saw] in init_context.py), recurrent and convolutional
layers. The comparison is the loss and the gradient norm, step by step: Adam turns float noise in
a gradient that is zero in exact arithmetic (an attention key bias, a conv bias before
BatchNorm) into whole steps, so parameters are compared only after one step of exact inputs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import patrickstar


class VisionTransformerish(nn.Module):
    """Parameters of the root used in the root's forward, and nn.MultiheadAttention (which
    never calls its out_proj)."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        self.pos = nn.Parameter(torch.randn(1, 5, 16))
        self.proj = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        tokens = self.proj(x)
        tokens = torch.cat([self.cls.expand(tokens.shape[0], -1, -1), tokens], 1) + self.pos
        mixed, _ = self.attn(tokens, tokens, tokens)
        return self.head(mixed[:, 0])


class StackedCopies(nn.Module):
    """One block deep-copied into a stack, as many user models are built."""

    def __init__(self):
        super().__init__()
        block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16))
        self.blocks = nn.ModuleList(copy.deepcopy(block) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.gru = nn.GRU(16, 8, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        out, _ = self.gru(out)
        return self.head(out[:, -1])


def encoder():
    return nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), 2)


def decoder():
    return nn.TransformerDecoder(
        nn.TransformerDecoderLayer(16, 2, 32, batch_first=True, dropout=0.0), 2)


class Decoding(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = decoder()

    def forward(self, x):
        return self.decoder(x, x.flip(1))


def convolutional():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, groups=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def in_place_activations():
    """torchvision's ResNet blocks: ReLU(inplace=True) right after a BatchNorm or a Linear, and
    in-place arithmetic on a module's output (they raised "Output 0 of _BackwardCall is a view
    and is being modified inplace")."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.norm = nn.BatchNorm2d(3)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.norm(self.conv(x))
            out += x
            return self.relu(out)

    return nn.Sequential(Residual(), nn.Flatten(), nn.Linear(48, 8), nn.ReLU(inplace=True),
                         nn.Linear(8, 8), nn.LeakyReLU(inplace=True), nn.Linear(8, 4))


class ParameterContainers(nn.Module):
    """nn.ParameterList / nn.ParameterDict (also inside an nn.ModuleList): no forward, their
    parameters read by the holder's (they met empty placeholders: "size mismatch ... vec (0)")."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(2)])
        self.affine = nn.ParameterDict({"shift": nn.Parameter(torch.randn(8)),
                                        "scale": nn.Parameter(torch.ones(8))})
        self.nested = nn.ModuleList([nn.ParameterList([nn.Parameter(torch.randn(8))])])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for weight in self.weights:
            x = torch.tanh(x @ weight)
        x = (x + self.affine["shift"]) * self.affine["scale"] + self.nested[0][0]
        return self.head(x)


class InPlaceResidual(nn.Module):
    """In-place changes of a hooked module's output outside it (Falcon's `mlp_output +=
    attention_output` on what its MLP container returns) and of a hooked module's input inside
    it: plain autograd allows both ("Output 0 of _BackwardCall is a view and is being modified
    inplace" was raised)."""

    class AddBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(8) * 0.1)

        def forward(self, x):
            x += self.bias
            return x

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.add_bias = self.AddBias()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        attn = self.attn(x)
        mlp = self.mlp(x)
        mlp += attn
        return self.head(self.add_bias(mlp * 1.0))


MODELS = {
    "inplace_residual": (InPlaceResidual, (4, 8)),
    "parameter_containers": (ParameterContainers, (4, 8)),
    "vit_mha": (VisionTransformerish, (2, 4, 8)),
    "transformer_encoder": (encoder, (2, 5, 16)),
    "transformer_decoder": (Decoding, (2, 5, 16)),
    "stacked_copies": (StackedCopies, (3, 16)),
    "recurrent": (Recurrent, (2, 5, 8)),
    "convolutional": (convolutional, (2, 3, 12, 12)),
    "in_place_activations": (in_place_activations, (2, 3, 4, 4)),
}


def train_alongside(model, optimizer, reference, ref_optimizer, x, steps, rtol):
    """`steps` steps of the engine and the plain model on `x` (loss.backward(), torch's
    clip_grad_norm_, Adam at lr 1e-3): losses and norms equal within `rtol`, and after the
    first step every weight within lr of torch's (Adam turns float noise into whole steps
    later, e.g. a conv bias before BatchNorm: one step moves each element by lr at most)."""
    for step in range(steps):
        loss = model(x).pow(2).mean()
        ref_loss = reference(x).pow(2).mean()
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
        torch.testing.assert_close(norm, ref_norm, rtol=rtol, atol=0)
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if step == 0:
            state = model.state_dict()
            for key, tensor in reference.state_dict().items():
                torch.testing.assert_close(state[key], tensor, rtol=0, atol=1e-3 * 1.01)


@pytest.mark.parametrize("name", MODELS)
def test_trains_as_pytorch(name):
    model_func, shape = MODELS[name]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    reference = model_func()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_func, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    train_alongside(model, optimizer, reference, ref_optimizer, x, steps=4, rtol=1e-3)


@pytest.mark.parametrize("name", ["transformer_encoder", "transformer_decoder", "vit_mha"])
def test_eval_fast_paths_read_chunked_parameters(name):
    # In eval mode without autograd nn.TransformerEncoderLayer takes a fused path over all of
    # its children's parameters.
    model_func, shape = MODELS[name]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    reference = model_func().eval()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(model_func, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_deep_copied_parameters_are_planned_and_estimated():
    model, _ = patrickstar.initialize(StackedCopies, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    names = list(model.params.names)
    # Registered parameters first, then the copies in the model's order.
    assert names == ["head.weight", "head.bias"] + [
        name for name, _ in StackedCopies().named_parameters() if name.startswith("blocks.")]
    assert model.params.shapes[names.index("blocks.2.0.weight")] == (16, 16)
    report = patrickstar.estimate_memory(StackedCopies, {
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    assert report is not None


class Parametrized(nn.Module):
    """torch's parametrizations, applied inside model_func: the new parameters they make
    (`parametrizations.weight.original*`) are what the engine places."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations, parametrize
        self.a = parametrizations.weight_norm(nn.Linear(8, 16))
        self.b = parametrizations.spectral_norm(nn.Linear(16, 16))
        self.c = parametrizations.orthogonal(nn.Linear(16, 16))
        self.d = nn.Linear(16, 16)
        parametrize.register_parametrization(self.d, "weight", Symmetric())
        self.e = torch.nn.utils.weight_norm(nn.Linear(16, 2))  # the old, hook-based one

    def forward(self, x):
        for layer in (self.a, self.b, self.c, self.d):
            x = torch.tanh(layer(x))
        return self.e(x)


class Symmetric(nn.Module):
    def forward(self, weight):
        return weight.triu() + weight.triu(1).transpose(-1, -2)


@pytest.mark.parametrize("budget", [None, 4 * 1024 * 4])
def test_parametrizations_in_model_func_train_as_pytorch(budget):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    reference = Parametrized()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 1024}
    if budget:
        config["memory"] = {"device_budget": budget}
    torch.manual_seed(0)
    with warnings.catch_warnings():  # orthogonal cannot run on the meta device: said once
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(Parametrized, config=config)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        ref_loss = reference(x).pow(2).mean()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("apply", [
    lambda m: torch.nn.utils.parametrizations.weight_norm(m),
    lambda m: torch.nn.utils.parametrizations.spectral_norm(m),
    lambda m: torch.nn.utils.parametrizations.orthogonal(m),
    lambda m: torch.nn.utils.parametrize.register_parametrization(m, "weight", Symmetric()),
    lambda m: torch.nn.utils.weight_norm(m),
    lambda m: torch.nn.utils.spectral_norm(m),
], ids=["weight_norm", "spectral_norm", "orthogonal", "register", "old_weight_norm",
        "old_spectral_norm"])
def test_a_parametrization_after_initialize_raises_naming_model_func(apply):
    # Before: "cannot reshape tensor of 0 elements", "Expected a matrix ... Got a tensor of 1
    # dimensions", "triu: input tensor must have at least 2 dimensions" (the placeholder).
    model, _ = patrickstar.initialize(lambda: nn.Sequential(nn.Linear(16, 16)), config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 1024})
    with pytest.raises(ValueError, match=r"'module\.0\.weight' after patrickstar\.initialize.*"
                                         r"inside model_func"):
        apply(model.module[0])
    plain = nn.Linear(4, 4)
    apply(plain)  # other modules: torch's own


def channels_last_convnet():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    return model.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("built", ["model_func", "module"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_channels_last_models_train_as_pytorch_and_warn_about_the_layout(built, layout):
    # Note [Memory formats of parameters]: the values and gradients are PyTorch's, the
    # weights are stored contiguous (said at initialize()), and a channels_last input keeps
    # channels_last activations as in PyTorch.
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    torch.manual_seed(0)
    reference = channels_last_convnet()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    torch.manual_seed(0)
    given = channels_last_convnet if built == "model_func" else channels_last_convnet()
    with pytest.warns(UserWarning, match=r"2 of 8 parameters in a memory format other than the "
                                         r"contiguous one \(e\.g\. '0\.weight': channels_last\)"):
        model, optimizer = patrickstar.initialize(given, config={
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    model.eval()  # no running statistics updated
    reference.eval()
    with torch.no_grad():
        out, ref_out = model.module[:4](x), reference[:4](x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert ref_out.is_contiguous(memory_format=torch.channels_last)  # PyTorch's either way
    assert out.is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")
    model.train()
    reference.train()
    train_alongside(model, optimizer, reference, ref_optimizer, x, steps=3, rtol=1e-5)
