"""A CIFAR-style ResNet recipe (Conv2d + BatchNorm2d + ReLU + residual + AdaptiveAvgPool +
Linear) through the engine beside plain PyTorch: train/eval switching with BatchNorm's running
statistics, `torch.no_grad()` evaluation, torch's LR schedulers on the returned optimizer,
`zero_grad(set_to_none=True)`, label-smoothed cross entropy, gradient clipping, and the state
dict into a plain model; and the same model in bf16 (Note [Buffers of 16-bit modules] in
engine.py)."""
from __future__ import annotations

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


def test_buffers_of_modules_without_parameters_keep_their_dtype_in_bf16():
    model, _ = patrickstar.initialize(
        lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False)),
        config={**CONFIG, "bf16": {"enabled": True}})
    assert model.module[1].running_mean.dtype == torch.float32
    model(torch.randn(3, 4).bfloat16()).float().sum().backward()
