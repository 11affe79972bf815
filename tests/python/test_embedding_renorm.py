"""nn.Embedding(max_norm=...) rescales rows of its weight in place during the forward: kept where
the engine's view is the trained weight (fp32, or bf16 without masters, on one process), made
whole-batch under fp32 data parallelism (every rank's rows rescaled), refused at initialize()
where it would be lost (Note [Renormalizing embeddings] in embedding_renorm.py)."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.embedding_renorm import refuse_lost_renorms


class Lookup(nn.Module):
    def __init__(self, bag: bool = False):
        super().__init__()
        self.emb = (nn.EmbeddingBag(20, 8, max_norm=1.0) if bag
                    else nn.Embedding(20, 8, max_norm=1.0))
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        return self.head(self.emb(idx)).pow(2).mean()


IDX = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(1))
EVAL_IDX = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(2))


def config(**extra):
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "default_chunk_size": 4096, **extra}


def test_fp32_on_one_process_renormalizes_as_pytorch():
    torch.manual_seed(0)
    reference = Lookup()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(Lookup, config=config())
    for _ in range(3):
        loss, ref_loss = model(IDX), reference(IDX)
        torch.testing.assert_close(loss, ref_loss)
        model.backward(loss)
        ref_loss.backward()
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    torch.testing.assert_close(model.state_dict()["emb.weight"], reference.emb.weight.detach())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("bag", [False, True])
def test_mixed_precision_with_masters_refuses_naming_the_module(precision, bag):
    # Before: bf16 trained on rows of norm 2-3 where PyTorch's stayed at 1, without a word.
    with pytest.raises(ValueError, match=r"'emb' is Embedding(Bag)?\(max_norm=1\.0\).*"
                                         rf"{precision} training.*without max_norm"):
        patrickstar.initialize(lambda: Lookup(bag), config=config(**{precision: {"enabled": True}}))


def test_bf16_without_masters_keeps_the_renormalization():
    model, _ = patrickstar.initialize(Lookup, config=config(
        bf16={"enabled": True, "master_weights": False}))
    with torch.no_grad():
        model(IDX)
    norms = model.state_dict()["emb.weight"].float().norm(dim=1)
    looked_up = IDX.unique()
    assert norms[looked_up].max() <= 1.0 + 1e-2  # bf16 rounding
    assert norms.max() > 1.5  # rows not looked up keep their N(0, 1) init's norm (about 2.8)


def test_16_bit_data_parallelism_refuses():
    # Each rank's initialize() makes this check on the same model, so every rank raises alike.
    with pytest.raises(ValueError, match=r"'emb' is Embedding\(max_norm=1\.0\).*bf16 training "
                                         r"with data parallelism \(2 ranks\)"):
        refuse_lost_renorms(Lookup(), "bf16", False, 2)
    refuse_lost_renorms(Lookup(), "fp32", True, 2)  # fp32: renormalized across the ranks
    refuse_lost_renorms(nn.Embedding(4, 2), "bf16", True, 2)  # no max_norm: fine


def test_fp32_data_parallelism_renormalizes_the_whole_batchs_rows(tmp_path):
    """Two ranks on half batches train as one process on the whole batch. Before: only the rows
    the weight's owning rank looked up were kept renormalized (torch's DDP keeps each rank's
    own, and the ranks' weights drift apart)."""
    from test_data_parallel import check_no_errors, launch
    results = launch(tmp_path, 2, worker=os.path.join(os.path.dirname(__file__),
                                                      "renorm_worker.py"))
    check_no_errors(results)
    torch.manual_seed(0)
    reference = Lookup()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        loss = reference(IDX)
        torch.testing.assert_close(sum(r["losses"][step] for r in results) / 2, loss.item(),
                                   rtol=1e-5, atol=0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in results:
        for key, tensor in reference.state_dict().items():
            torch.testing.assert_close(result["trained"][key], tensor, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        reference(EVAL_IDX)
    for result in results:
        torch.testing.assert_close(result["evaluated"]["emb.weight"], reference.emb.weight,
                                   rtol=1e-5, atol=1e-6)
