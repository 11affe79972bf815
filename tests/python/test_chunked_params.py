"""ChunkedParams (chunked_params.py), the owner of parameter identity and of the views into chunks,
and the optimizer state it hands out, compared with the plain PyTorch model and optimizer."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar import _C
from patrickstar.chunked_params import chunk_dtypes

K = _C.ChunkKind


class Net(nn.Module):
    def __init__(self, frozen: bool = True):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)  # buffers: not parameters, no chunks
        self.head = nn.Linear(16, 4)
        # Frozen: a compute copy only. Mixed precision is built without one: initialize()
        # fails there on a frozen parameter (a behaviour bug, outside this test's concern).
        self.head.bias.requires_grad_(not frozen)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.norm(self.embed(x))), y)


def build(precision="fp32"):
    frozen = precision == "fp32"
    torch.manual_seed(0)
    reference = Net(frozen)
    torch.manual_seed(0)
    config = {"default_chunk_size": 1024, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    model, optimizer = patrickstar.initialize(lambda: Net(frozen), config=config)
    return reference, model, optimizer


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_identity_and_views_match_the_plain_model(precision):
    reference, model, _ = build(precision)
    params = model.params
    names = [name for name, _ in reference.named_parameters()]
    assert params.names == names
    assert params.shapes == [tuple(p.shape) for _, p in reference.named_parameters()]
    for index, (name, param) in enumerate(model.module.named_parameters()):
        assert params.index_of(param) == index
        assert params.requires_grad[index] == param.requires_grad
        plain = dict(reference.named_parameters())[name].detach()
        torch.testing.assert_close(params.read(index, K.COMPUTE_PARAM).float(), plain,
                                   rtol=0, atol=0 if precision == "fp32" else 1e-2)
        if precision != "fp32" and param.requires_grad:  # the master copy is the exact fp32
            assert torch.equal(params.read(index, K.MASTER_PARAM), plain)
    for buffer in model.module.buffers():
        assert params.index_of(buffer) is None
    bias = names.index("head.bias")
    if precision == "fp32":  # frozen
        assert params.ids[bias].grad is None and params.ids[bias].momentum is None
        assert params.tensor_id(bias, K.MOMENTUM) is None
    else:
        assert params.tensor_id(bias, K.MOMENTUM) == params.ids[bias].momentum is not None


def test_write_then_read_round_trips():
    _, model, _ = build()
    params = model.params
    value = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    params.write(0, K.COMPUTE_PARAM, value)
    assert torch.equal(params.read(0, K.COMPUTE_PARAM), value)
    with params.view(0, K.COMPUTE_PARAM) as view:
        assert view.shape == (16, 8) and torch.equal(view, value)
    assert torch.equal(model.state_dict()["embed.weight"], value)


def test_chunk_dtypes_follow_the_precision_rule():
    assert chunk_dtypes("fp32", 1) == {"compute": "float32", "master": None, "compensation": None,
                                       "grad": "float32",
                                       "momentum": "float32", "variance": "float32",
                                       "momentum_scale": None, "variance_scale": None}
    assert chunk_dtypes("fp16", 1)["grad"] == "float16"
    assert chunk_dtypes("bf16", 4) == {"compute": "bfloat16", "master": "float32",
                                       "compensation": None,
                                       "grad": "float32", "momentum": "float32",
                                       "variance": "float32", "momentum_scale": None,
                                       "variance_scale": None}
    int8 = chunk_dtypes("fp32", 1, "int8")
    assert (int8["momentum"], int8["variance"]) == ("uint8", "uint8")
    assert (int8["momentum_scale"], int8["variance_scale"]) == ("float32", "float32")
    no_master = chunk_dtypes("bf16", 1, "fp32", master_weights=False)
    assert (no_master["master"], no_master["compensation"]) == (None, "bfloat16")


def test_optimizer_owns_step_counts_has_grad_and_state_like_torch():
    reference, model, optimizer = build()
    plain = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    model.backward(model(x, y))
    trainable = [i for i, r in enumerate(model.params.requires_grad) if r]
    assert [optimizer.has_grad[i] for i in trainable] == [True] * len(trainable)
    optimizer.step()
    optimizer.zero_grad()
    assert not any(optimizer.has_grad)
    reference(x, y).backward()
    plain.step()
    assert optimizer.step_counts == [1 if r else 0 for r in model.params.requires_grad]
    ours = optimizer.state_dict()["state"]
    theirs = list(plain.state.values())
    assert sorted(ours) == trainable
    for index, state in zip(trainable, theirs):
        torch.testing.assert_close(ours[index]["exp_avg"], state["exp_avg"])
        torch.testing.assert_close(ours[index]["exp_avg_sq"], state["exp_avg_sq"])


class TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Embedding(20000, 16)
        self.b = nn.Embedding(20000, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, ids):
        return self.head(self.a(ids) + self.b(ids)).pow(2).mean()


def test_reads_outside_training_fit_the_host_budget_training_fits(tmp_path):
    # Note [Reads where the chunk is]: the model trains with its host peak (4.9 MB) under a
    # 6 MB host budget and no NVMe; state_dict(), the parameters' values and save_checkpoint()
    # moved the device's chunks to the host and failed "cannot take ... the last tier".
    torch.manual_seed(0)
    plain = TwoTables()
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)

    def model_func():
        module = TwoTables()
        module.load_state_dict(initial)
        return module

    config = {"default_chunk_size": 4096, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "memory": {"host_budget": 6_000_000}}
    model, _ = patrickstar.initialize(model_func, config=config)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 20000, (8, 4), generator=generator)
        model.backward(model(ids))
        model.step()
        plain(ids).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[name], msg=name)
    for (name, param), expected in zip(model.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(param.detach().clone(), expected.detach(), msg=name)
    model.save_checkpoint(str(tmp_path), tag="t")
    ids = torch.randint(0, 20000, (8, 4), generator=generator)
    expected = float(plain(ids))
    loaded, _ = patrickstar.initialize(model_func, config=config)
    loaded.load_checkpoint(str(tmp_path), tag="t")
    assert float(loaded(ids)) == pytest.approx(expected, rel=1e-5)
    assert float(model(ids)) == pytest.approx(expected, rel=1e-5)  # and training goes on


def test_fitted_chunk_size_is_the_smallest_power_of_two_holding_the_model():
    """Note [Chunks no larger than the model]: at least 64Ki elements, never above the size
    given, and None (the search) stays None."""
    from patrickstar.config import fitted_chunk_size
    default = 64 * 1024 * 1024
    assert fitted_chunk_size(None, 10) is None
    assert fitted_chunk_size(default, 4420) == 1 << 16
    assert fitted_chunk_size(default, 1 << 16) == 1 << 16
    assert fitted_chunk_size(default, (1 << 16) + 1) == 1 << 17
    assert fitted_chunk_size(default, 1 << 17) == 1 << 17  # exactly one chunk long
    assert fitted_chunk_size(4096, 4420) == 4096
    assert fitted_chunk_size(default, default + 1) == default


def test_a_model_smaller_than_one_chunk_gets_chunks_its_size_and_trains_as_torch(tmp_path,
                                                                                monkeypatch):
    """With the default 64Mi-element chunks a 4,420-parameter model held 256 MiB per chunk
    (about 1.3 GB of the process). It now gets 64Ki-element chunks, trains as torch, and a
    checkpoint written with the larger chunks (same places, larger capacity) still loads."""
    from patrickstar import engine as engine_module

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    reference = make()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model, optimizer = patrickstar.initialize(make, config=config)
    assert model.config.default_chunk_size == 1 << 16
    assert patrickstar.estimate_memory(make, config)["modes"]["fp32"]["chunk_elements"] == 1 << 16
    for tier in model.memory_stats():
        assert tier["reserved_bytes"] <= 4 * (1 << 16) * 4, tier  # four kinds of 64Ki floats
    x, y = torch.randn(8, 64), torch.randint(0, 4, (8,))
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected = nn.functional.cross_entropy(reference(x), y)
        expected.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    model.destroy()

    # A checkpoint of the same model in 1Mi-element chunks, as the engine wrote before.
    monkeypatch.setattr(engine_module, "fitted_chunk_size", lambda size, total: size)
    wide, wide_optimizer = patrickstar.initialize(make, config=dict(config,
                                                                    default_chunk_size=1 << 20))
    assert wide.config.default_chunk_size == 1 << 20
    wide(x).sum().backward()
    wide_optimizer.step()
    wide.save_checkpoint(tmp_path)
    saved = wide.state_dict()
    wide.destroy()
    monkeypatch.undo()
    narrow, _ = patrickstar.initialize(make, config=dict(config, default_chunk_size=1 << 20))
    assert narrow.config.default_chunk_size == 1 << 16
    narrow.load_checkpoint(tmp_path)  # no allow_reshard: only the capacities differ
    for name, value in saved.items():
        assert torch.equal(narrow.state_dict()[name], value), name
    narrow.destroy()
