"""Two engines in one training loop, as a GAN trains: the generator's loss runs through the
discriminator, whose gradients from it are dropped by its zero_grad() (PyTorch's DCGAN recipe).
Compared with the same loop on plain PyTorch modules."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar

CONFIG = {"default_chunk_size": 4096,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def generator():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))


def discriminator():
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


def gan_loop(gen, disc, gen_opt, disc_opt, backward, freeze_disc: bool, steps: int = 4):
    """DCGAN's loop; `backward(module, loss)`. Returns the losses."""
    generator_data = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []
    for _ in range(steps):
        real = torch.randn(6, 16, generator=generator_data) + 2
        noise = torch.randn(6, 8, generator=generator_data)
        fake = gen(noise)
        disc_opt.zero_grad()
        d_loss = bce(disc(real), torch.ones(6, 1)) + bce(disc(fake.detach()), torch.zeros(6, 1))
        backward(disc, d_loss)
        disc_opt.step()
        if freeze_disc:
            disc.requires_grad_(False)
        gen_opt.zero_grad()
        g_loss = bce(disc(fake), torch.ones(6, 1))
        backward(gen, g_loss)
        gen_opt.step()
        if freeze_disc:
            disc.requires_grad_(True)
        losses += [d_loss.item(), g_loss.item()]
    return losses


@pytest.mark.parametrize("autograd", [False, True], ids=["model.backward", "loss.backward"])
@pytest.mark.parametrize("freeze_disc", [False, True])
def test_a_gan_of_two_engines_trains_as_pytorch(autograd, freeze_disc):
    torch.manual_seed(0)
    ref_gen, ref_disc = generator(), discriminator()
    ref_losses = gan_loop(ref_gen, ref_disc,
                          torch.optim.AdamW(ref_gen.parameters(), lr=1e-2, weight_decay=0.0),
                          torch.optim.AdamW(ref_disc.parameters(), lr=1e-2, weight_decay=0.0),
                          lambda module, loss: loss.backward(), freeze_disc)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen, gen_opt = patrickstar.initialize(generator, config=CONFIG)
        disc, disc_opt = patrickstar.initialize(discriminator, config=CONFIG)
    if autograd:
        backward = lambda module, loss: loss.backward()  # noqa: E731
    else:
        backward = lambda module, loss: module.backward(loss)  # noqa: E731
    losses = gan_loop(gen, disc, gen_opt, disc_opt, backward, freeze_disc)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for ours, ref in ((gen, ref_gen), (disc, ref_disc)):
        for name, tensor in ref.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[name], tensor, rtol=0, atol=1e-5)
