"""A CIFAR-style ResNet recipe (Conv2d + BatchNorm2d + ReLU + residual + AdaptiveAvgPool +
Linear) through the engine beside plain PyTorch: train/eval switching with BatchNorm's running
statistics, `torch.no_grad()` evaluation, torch's LR schedulers on the returned optimizer,
`zero_grad(set_to_none=True)`, label-smoothed cross entropy, gradient clipping, and the state
dict into a plain model; and the same model in bf16 (Note [Buffers of 16-bit modules] in
engine.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import patrickstar


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layers = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


DATA = torch.Generator().manual_seed(0)
BATCHES = [(torch.randn(8, 3, 16, 16, generator=DATA), torch.randint(0, 10, (8,), generator=DATA))
           for _ in range(3)]
EVAL_X = torch.randn(8, 3, 16, 16, generator=DATA)
CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 5e-4}},
          "default_chunk_size": 1 << 13}


def schedule(kind: str, optimizer):
    if kind == "onecycle":  # cycles Adam's beta1 too
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=10)
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)


@pytest.mark.parametrize("kind", ["onecycle", "cosine"])
def test_resnet_recipe_trains_and_evaluates_as_pytorch(kind):
    torch.manual_seed(0)
    reference = ResNet()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=5e-4)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(ResNet, config=CONFIG)
    scheduler, ref_scheduler = schedule(kind, optimizer), schedule(kind, ref_optimizer)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    for _ in range(2):  # epochs, each ending in an evaluation
        model.train()
        reference.train()
        for x, y in BATCHES:
            optimizer.zero_grad(set_to_none=True)
            ref_optimizer.zero_grad(set_to_none=True)
            loss, ref_loss = criterion(model(x), y), criterion(reference(x), y)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            loss.backward()
            ref_loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
            optimizer.step()
            ref_optimizer.step()
            scheduler.step()
            ref_scheduler.step()
            assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]
        model.eval()
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(EVAL_X), reference(EVAL_X), rtol=1e-4, atol=1e-5)
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():  # running statistics included
        torch.testing.assert_close(state[key], tensor, rtol=1e-4, atol=1e-5)
    plain = ResNet().eval()
    plain.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(plain(EVAL_X), model(EVAL_X), rtol=0, atol=0)


def test_resnet_trains_in_bf16_with_16_bit_batchnorm_statistics():
    # Before: the first BatchNorm met bf16 weights and fp32 running statistics and raised
    # "expected scalar type BFloat16 but found Float".
    torch.manual_seed(0)
    reference = ResNet()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=5e-4)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(ResNet, config={**CONFIG, "bf16": {"enabled": True}})
    assert model.module.stem[1].running_mean.dtype == torch.bfloat16
    assert model.module.stem[1].num_batches_tracked.dtype == torch.int64
    for x, y in BATCHES:
        loss = F.cross_entropy(model(x.bfloat16()).float(), y)
        ref_loss = F.cross_entropy(reference(x), y)
        torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=0)
        loss.backward()
        ref_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    model.eval()
    reference.eval()
    with torch.no_grad():
        out = model(EVAL_X.bfloat16()).float()
        torch.testing.assert_close(out, reference(EVAL_X), rtol=0, atol=0.1)
    plain = ResNet().eval()
    plain.load_state_dict(model.state_dict())  # bf16 values into the fp32 model
    with torch.no_grad():
        torch.testing.assert_close(plain(EVAL_X), out, rtol=0, atol=0.1)


class MyRotaryEmbedding(nn.Module):
    """inv_freq in a non-persistent buffer, upcast in the forward, as Hugging Face's rotary
    embeddings."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4),
                             persistent=False)

    def forward(self, x):
        return x + torch.cos(self.inv_freq.float()).sum().to(x.dtype)


def test_buffers_of_modules_without_parameters_keep_their_dtype_in_bf16():
    # Note [Buffers of 16-bit modules]: a non-affine BatchNorm's statistics and a rotary
    # embedding's inv_freq stay fp32.
    model, _ = patrickstar.initialize(
        lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False),
                              MyRotaryEmbedding()),
        config={**CONFIG, "bf16": {"enabled": True}})
    assert model.module[1].running_mean.dtype == torch.float32
    assert model.module[2].inv_freq.dtype == torch.float32
    model(torch.randn(3, 4).bfloat16()).float().sum().backward()


class FrozenBatchNorm2d(nn.Module):
    """DETR's (and torchvision's) BatchNorm with its affine weights in buffers, not trained."""

    def __init__(self, n: int):
        super().__init__()
        for name, value in [("weight", torch.rand(n) + 0.5), ("bias", torch.randn(n)),
                            ("running_mean", torch.randn(n)), ("running_var", torch.rand(n) + 0.5)]:
            self.register_buffer(name, value)

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


class FrozenBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), FrozenBatchNorm2d(8),
                                  nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1), FrozenBatchNorm2d(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.body(x).mean((2, 3)))


def test_a_frozen_batchnorms_buffer_weights_compute_in_bf16_as_pytorchs():
    # Note [Buffers of 16-bit modules]: the frozen BatchNorm's fp32 buffers promoted the
    # activations to fp32 and the next convolution raised "Input type (torch.FloatTensor) and
    # weight type (CPUBFloat16Type) should be the same". As `module.bfloat16()` in PyTorch, they
    # take the compute dtype, and the model computes as PyTorch's.
    torch.manual_seed(0)
    reference = FrozenBackbone()
    model, _ = patrickstar.initialize(lambda: copy.deepcopy(reference),
                                      config={**CONFIG, "bf16": {"enabled": True}})
    reference.bfloat16()
    assert model.module.body[1].running_var.dtype == torch.bfloat16
    x, y = BATCHES[0]
    loss = F.cross_entropy(model(x.bfloat16()).float(), y)
    expected = F.cross_entropy(reference(x.bfloat16()).float(), y)
    assert loss.item() == expected.item()
    loss.backward()
    expected.backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.full_gradient(name).float(), param.grad.float(), msg=name)
