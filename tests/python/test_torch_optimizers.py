"""A nanoGPT-style script ported as a new user would (Note [torch optimizers over an engine's
parameters] in torch_optimizers.py, and nanoGPT's helpers reached through the engine)."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import patrickstar


class TinyGPT(nn.Module):
    """nanoGPT's GPT helpers on a small model: get_num_params, estimate_mfu,
    configure_optimizers, crop_block_size."""

    def __init__(self, vocab=64, block_size=16, width=32):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block_size, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        logits = self.head(self.ln(x + self.mlp(x)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.wpe.weight.numel()
        return n_params

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        flops_per_iter = 6 * self.get_num_params() * fwdbwd_per_iter * self.block_size
        return flops_per_iter / dt / 312e12

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and False
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def crop_block_size(self, block_size):
        self.block_size = block_size
        self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])


def make():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(TinyGPT, config={"default_chunk_size": 4096})


def batch():
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (2, 16), generator=generator)
    return idx, torch.roll(idx, -1, 1)


def test_a_torch_optimizer_over_the_engines_parameters_raises_at_its_first_step():
    # nanoGPT builds its own: through the engine it saw placeholders and, stepping parameters
    # without .grad, updated nothing at all, silently.
    model, optimizer = make()
    own = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    model.backward(model(*batch()))
    with pytest.raises(RuntimeError, match=r"AdamW holds parameters of a PatrickStar engine "
                                           r"\(e.g. 'module\.\w+\.weight'\).*initialize\(\) "
                                           r"returns"):
        own.step()
    optimizer.step()  # the engine's own steps
    optimizer.zero_grad()
    plain = nn.Linear(2, 2)
    other = torch.optim.SGD(plain.parameters(), lr=0.1)  # unrelated optimizers are left alone
    plain(torch.ones(1, 2)).sum().backward()
    other.step()


def test_nanogpt_parameter_counts_through_the_engine_and_crop_refused():
    model, _ = make()
    reference = TinyGPT()
    assert model.get_num_params() == reference.get_num_params() > 0
    assert model.estimate_mfu(4, 0.5) == pytest.approx(reference.estimate_mfu(4, 0.5))
    with pytest.raises(ValueError, match="crop_block_size.*inside model_func"):
        model.crop_block_size(8)
    model(*batch())


def test_crop_block_size_inside_model_func():
    def cropped():
        gpt = TinyGPT()
        gpt.crop_block_size(8)
        return gpt
    torch.manual_seed(0)
    reference = cropped()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(cropped, config={"default_chunk_size": 4096})
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    idx, targets = batch()
    torch.testing.assert_close(model(idx[:, :8], targets[:, :8]),
                               reference(idx[:, :8], targets[:, :8]))
